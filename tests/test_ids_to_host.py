"""`models.sampling.ids_to_host` (SchedulerConfig.ar_event_sync): the AR's per-step read of the sampled ids, either
`.tolist()` or, on CUDA with the switch on, a pinned copy and an event wait — the same values; the scheduler sets the
process-wide read-back only on CUDA, and schedulers that overlap keep it on until the last closes."""
from __future__ import annotations

import pytest
import torch

from cosytrt.runtime.models import sampling
from cosytrt.runtime.models.sampling import ids_to_host, set_event_sync


def test_cpu_reads_are_tolist_either_way():
    ids = torch.tensor([3, 1, 4, 1, 5])
    prev = set_event_sync(True)
    try:
        assert ids_to_host(ids) == [3, 1, 4, 1, 5] and ids_to_host(ids[None]) == [[3, 1, 4, 1, 5]]
        assert set_event_sync(False) is True
        assert ids_to_host(ids) == [3, 1, 4, 1, 5]
    finally:
        set_event_sync(prev)


def test_scheduler_sets_it_on_cuda_only_and_restores(tiny_tts):
    from cosytrt.runtime.scheduling.scheduler import Scheduler, SchedulerConfig

    before = sampling.event_sync_on()
    sched = Scheduler(tiny_tts.pipeline, SchedulerConfig(ar_event_sync=True))
    try:
        assert sampling.event_sync_on() == before and sched._process_switches == []  # the CPU: nothing to change
    finally:
        sched.close()
    assert sampling.event_sync_on() == before


def test_overlapping_users_keep_it_on_until_the_last_closes():
    """`use_event_sync`: two schedulers that overlap and close in either order: on while either is registered (a
    save-and-restore switch would turn it off under the second when the first closes)."""
    assert not sampling.event_sync_on()
    sampling.use_event_sync(+1)
    sampling.use_event_sync(+1)
    try:
        sampling.use_event_sync(-1)                      # the first closes
        assert sampling.event_sync_on()
    finally:
        sampling.use_event_sync(-1)
    assert not sampling.event_sync_on()
    sampling.use_event_sync(-1)                          # an extra release does not go below zero
    sampling.use_event_sync(+1)
    assert sampling.event_sync_on()
    sampling.use_event_sync(-1)
    assert not sampling.event_sync_on()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA: the pinned copy and event wait need a GPU")
def test_event_sync_reads_equal_tolist_on_cuda():
    from cosytrt.runtime.models.sampling import pack_rows, select_packed, SamplingParams, TokenPolicy

    prev = set_event_sync(True)
    try:
        g = torch.Generator().manual_seed(0)
        for n in (1, 3, 64, 65, 200):  # buffers grow and are reused
            for dtype in (torch.long, torch.int32):
                ids = torch.randint(0, 6561, (n,), generator=g).to("cuda", dtype)
                assert ids_to_host(ids) == ids.tolist()
        logits = (torch.randn(5, 6761, generator=g) * 3).cuda()
        pols = [TokenPolicy(4, SamplingParams(seed=i)) for i in range(5)]
        off_pols = [TokenPolicy(4, SamplingParams(seed=i)) for i in range(5)]
        on = select_packed(logits, pack_rows(pols, 6761))
        set_event_sync(False)
        assert on == select_packed(logits, pack_rows(off_pols, 6761))
    finally:
        set_event_sync(prev)
