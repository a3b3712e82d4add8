"""The batching policies switched off one at a time (what `trtbuild bench --suite features` compares): each switch
changes how calls are batched, never the audio (tokens identical, audio within the batched-GEMM float noise)."""
from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from cosytrt.engines.buckets import group_by_length
from cosytrt.runtime.stages.request import default_voice_wav
from cosytrt.runtime.scheduling.scheduler import Scheduler, SchedulerConfig
from cosytrt.runtime.tts import make_request

BATCHED_ATOL = 2e-3  # golden HiFT wav tolerance (batched DiT / HiFT calls are not bit-exact)


@pytest.fixture(scope="module")
def tts(one_torch_thread, tiny_tts):
    return tiny_tts


@pytest.fixture(scope="module")
def speaker(tts):
    return tts.make_speaker(default_voice_wav(16000, 1.0), "Short voice.", 16000)


def run_all(tts, cfg: SchedulerConfig, reqs) -> tuple[list[np.ndarray], dict]:
    sched = Scheduler(tts.pipeline, cfg)
    try:
        handles = [sched.submit(r) for r in reqs]
        wavs = [h.result(timeout=120) for h in handles]
        return wavs, sched.stats()
    finally:
        sched.close()


def lockstep(speaker, n=4, stream=True):
    """n requests with the same prompt and length: their hops fall in the same AR steps."""
    return [make_request("Lockstep text.", speaker=speaker, seed=i, stream=stream, force_tokens=60) for i in range(n)]


def assert_same_audio(a, b):
    assert [w.shape for w in a] == [w.shape for w in b]
    for x, y in zip(a, b):
        assert np.abs(x - y).max() <= BATCHED_ATOL


def test_continuous_batching_off_admits_only_between_batches(tts, speaker):
    """Three requests arriving while a long one decodes join it at the next steps (on), or wait until it has finished
    and then run as one static batch (off)."""
    def staggered(cfg):
        sched = Scheduler(tts.pipeline, cfg)
        try:
            first = sched.submit(make_request("First, long.", speaker=speaker, seed=1, force_tokens=300))
            end = time.monotonic() + 60
            while sched.stats()["ar"]["decode_steps"] < 5:
                assert time.monotonic() < end
                time.sleep(0.002)
            late = [sched.submit(make_request("Late.", speaker=speaker, seed=2 + i, force_tokens=40)) for i in range(3)]
            wavs = [h.result(timeout=120) for h in [first] + late]
            return wavs, sched.stats(), first.metrics, late[0].metrics
        finally:
            sched.close()

    on, st_on, _, _ = staggered(SchedulerConfig())
    off, st_off, m_first, m_late = staggered(SchedulerConfig(continuous_batching=False))
    assert st_on["ar"]["max_decode_batch"] == 4
    assert st_off["ar"]["max_decode_batch"] == 3 and st_off["ar"]["prefill_calls"] == 2
    # off: the late requests waited in the AR queue for the long one's 299 decode steps, then took 39 together
    assert st_off["ar"]["decode_steps"] == 299 + 39
    assert m_late.t_queue > 0.5 * m_first.t_ar
    assert_same_audio(on, off)


def test_dit_chunk_aligned_off_runs_one_request_per_call(tts, speaker):
    reqs = lockstep(speaker)
    on, st_on = run_all(tts, SchedulerConfig(dit_max_wait_ms=50), reqs)
    off, st_off = run_all(tts, SchedulerConfig(dit_max_wait_ms=50, dit_chunk_aligned=False), lockstep(speaker))
    assert st_on["dit"]["max_batch"] == 4 and st_on["dit"]["calls"] < st_off["dit"]["calls"]
    assert st_off["dit"]["max_batch"] == 1 and st_off["dit"]["calls"] == st_off["dit"]["rows"]
    assert_same_audio(on, off)


def test_group_by_length_in_arrival_order_when_not_length_aware():
    lengths = [100, 900, 120, 880, 110]
    assert group_by_length(lengths, 8) == [[0, 4, 2], [3, 1]]                   # sorted, waste <= 1.5
    assert group_by_length(lengths, 8, length_aware=False) == [[0, 1, 2, 3, 4]]  # arrival order, any waste
    assert group_by_length(lengths, 2, length_aware=False) == [[0, 1], [2, 3], [4]]
    # the frames cap still holds: a third row next to the 900 (or 880) one would pad to > 2000 frames
    assert group_by_length(lengths, 8, max_frames=2000, length_aware=False) == [[0, 1], [2, 3], [4]]


def test_hift_length_aware_switch_reaches_the_grouping(tts, speaker, monkeypatch):
    """The offline HiFT grouping gets the switch (its effect on the groups is the unit test above)."""
    import cosytrt.runtime.scheduling.policies as policies_module

    seen = []

    def spy(*args, **kw):
        if "length_aware" in kw:  # the HiFT call (the DiT grouping is always length-aware)
            seen.append(kw["length_aware"])
        return group_by_length(*args, **kw)

    monkeypatch.setattr(policies_module, "group_by_length", spy)
    for flag in (True, False):
        seen.clear()
        run_all(tts, SchedulerConfig(hift_length_aware=flag), lockstep(speaker, 2, stream=False))
        assert seen and set(seen) == {flag}


def test_async_d2h_off_is_the_synchronous_copy(tts, speaker):
    """On the CPU every copy is synchronous; the switch must still validate and leave the audio unchanged."""
    reqs = lockstep(speaker, 2)
    on, _ = run_all(tts, SchedulerConfig(), reqs)
    off, _ = run_all(tts, SchedulerConfig(async_d2h=False), lockstep(speaker, 2))
    assert_same_audio(on, off)


def test_policies_compared_over_one_ar_runner(tts, speaker):
    """A Scheduler is cheap over an existing AR runner (its KV slots, graphs, compiled functions): one scheduler per
    SchedulerConfig compares the policies on the same runner. DiT batching off -> one request per call; on ->
    batched calls; every slot is free again after each scheduler."""
    from cosytrt.runtime.scheduling.scheduler import make_ar_runner

    base = SchedulerConfig(dit_max_wait_ms=50)
    runner = make_ar_runner(tts.pipeline.models, base, tts.pipeline.device)

    def wave(cfg):
        sched = Scheduler(tts.pipeline, cfg, runner=runner)
        try:
            [h.result(timeout=120) for h in [sched.submit(r) for r in lockstep(speaker)]]
            st = sched.stats()["dit"]
            return st["calls"], st["rows"]
        finally:
            sched.close()

    calls_on, rows_on = wave(base)
    calls_off, rows_off = wave(replace(base, dit_chunk_aligned=False))
    calls_again, _ = wave(base)
    assert calls_off == rows_off and calls_on < rows_on and calls_again < calls_off
    assert runner.free == runner.max_batch


# ---------------------------------------------------------------- DiT slack priority

class _Job:
    def __init__(self, name, metrics):
        self.name, self.r = name, type("R", (), {"metrics": metrics})()


def _metrics(t_submit, ttfa=None, audio_seconds=0.0):
    from cosytrt.runtime.stages.request import RequestMetrics

    return RequestMetrics(t_submit=t_submit, ttfa=ttfa, audio_seconds=audio_seconds)


def test_playback_slack_and_dit_order():
    from cosytrt.runtime.scheduling.scheduler import dit_order, playback_slack

    def dit_anchor(ready, now, slack_priority):
        return dit_order(ready, now, slack_priority)[0]

    now = 100.0
    buffered = _metrics(t_submit=90.0, ttfa=0.5, audio_seconds=12.0)    # 9.5 s played, 12 s delivered
    underrun = _metrics(t_submit=95.0, ttfa=0.5, audio_seconds=3.0)     # 4.5 s played, 3 s delivered
    new = _metrics(t_submit=99.8)                                        # no audio yet, waited 0.2 s
    older_new = _metrics(t_submit=99.5)
    assert playback_slack(buffered, now) == pytest.approx(2.5)
    assert playback_slack(underrun, now) == pytest.approx(-1.5)
    assert playback_slack(new, now) == pytest.approx(-0.2)
    queue = [_Job("buffered", buffered), _Job("new", new), _Job("older new", older_new)]
    assert dit_anchor(queue, now, slack_priority=True).name == "older new"    # waited longest, no audio yet
    assert dit_anchor(queue, now, slack_priority=False).name == "buffered"    # the oldest queued job
    assert dit_anchor(queue + [_Job("underrun", underrun)], now, True).name == "underrun"
    # ties go to the job queued first
    twins = [_Job("a", _metrics(t_submit=99.0)), _Job("b", _metrics(t_submit=99.0))]
    assert dit_anchor(twins, now, True).name == "a"
    names = [j.name for j in dit_order(queue + [_Job("underrun", underrun)] + twins, now, True)]
    assert names == ["underrun", "a", "b", "older new", "new", "buffered"]
    # a conversation's next sentence (its listener still had 3 s of earlier audio when it came) yields to new ones
    nxt = _metrics(t_submit=99.0)
    nxt.buffered_s = 3.0
    assert playback_slack(nxt, now) == pytest.approx(2.0)
    assert [j.name for j in dit_order([_Job("next", nxt), _Job("new", new)], now, True)] == ["new", "next"]
    nxt.ttfa, nxt.audio_seconds = 0.5, 1.0  # its first second came at 99.5; playback starts when the 3 s run out
    assert playback_slack(nxt, now) == pytest.approx(1.0 - (100.0 - 99.0 - 3.0))
    # chained: a sentence that follows another of the same listener
    prev = _metrics(t_submit=98.0, ttfa=0.5, audio_seconds=1.0)  # producing: 1 s delivered, playing since 98.5
    chained = _metrics(t_submit=99.0)
    chained.follows = prev
    assert playback_slack(prev, now) == pytest.approx(-0.5)
    assert playback_slack(chained, now) == pytest.approx(-0.5)  # needed once prev's audio runs out, at the earliest
    prev.tokens = 100  # prev's LM is done: 4 s in all, 3 s of it still to come
    assert playback_slack(chained, now) == pytest.approx(-0.5 + 3.0)
    chained.ttfa, chained.audio_seconds = 0.5, 2.0  # a chunk of its own already, prev still producing
    assert playback_slack(chained, now) == pytest.approx(2.0 - 0.5 + 3.0)
    prev.tokens = 0
    prev.audio_seconds, prev.total = 4.0, 1.5  # prev done: 4 s, heard 98.5 .. 102.5
    assert playback_slack(chained, now) == pytest.approx(2.0 + 2.5)  # its 2 s play from 102.5 on
    chained.ttfa, chained.audio_seconds = None, 0.0
    assert playback_slack(chained, now) == pytest.approx(2.5)  # needed at 102.5
    assert [j.name for j in dit_order([_Job("chained", chained), _Job("new", new)], now, True)] == ["new", "chained"]


def test_buffered_hint_keeps_the_audio(tts, speaker):
    """`buffered_s` only reorders DiT calls: every request's audio equals the same requests without the hint."""
    import dataclasses

    reqs = lockstep(speaker, n=3)
    hinted = [dataclasses.replace(r, buffered_s=2.0 * i) for i, r in enumerate(reqs)]
    plain, _ = run_all(tts, SchedulerConfig(dit_max_wait_ms=20), reqs)
    hint, st = run_all(tts, SchedulerConfig(dit_max_wait_ms=20), hinted)
    assert st["completed"] == 3
    assert_same_audio(plain, hint)
    sched = Scheduler(tts.pipeline, SchedulerConfig(dit_max_wait_ms=20))  # chained with `after`
    try:
        handles = []
        for r in reqs:
            handles.append(sched.submit(dataclasses.replace(r), after=handles[-1] if handles else None))
        chained = [h.result(timeout=120) for h in handles]
        assert handles[1].metrics.follows is handles[0].metrics
    finally:
        sched.close()
    assert_same_audio(plain, chained)
    with pytest.raises(Exception, match="buffered_s"):
        make_request("x", buffered_s=-1.0)


def test_dit_slack_priority_off_keeps_the_audio(tts, speaker):
    """The policy only reorders calls across requests (each request's jobs still run in order): same audio."""
    reqs = lockstep(speaker, n=3) + [make_request("Offline one.", speaker=speaker, seed=9, force_tokens=50)]
    on, st_on = run_all(tts, SchedulerConfig(dit_max_wait_ms=20), reqs)
    off, _ = run_all(tts, SchedulerConfig(dit_max_wait_ms=20, dit_slack_priority=False), reqs)
    assert st_on["completed"] == 4
    assert_same_audio(on, off)


# ---------------------------------------------------------------- building blocks

def test_run_rows_retries_row_by_row():
    """One helper runs every batched call of the workers: the batch at once, and when it raises each row alone, so
    only the failing rows fail."""
    from cosytrt.runtime.scheduling.state import run_rows

    failed, calls = [], []

    def call(rows):
        calls.append(list(rows))
        if 2 in rows:
            raise ValueError("bad row")
        return [r * 10 for r in rows]

    assert run_rows(call, [1, 2, 3], lambda r, e: failed.append((r, str(e)))) == [(1, 10), (3, 30)]
    assert failed == [(2, "bad row")] and calls == [[1, 2, 3], [1], [2], [3]]
    assert run_rows(call, [2], lambda r, e: failed.append(r)) == [] and failed[-1] == 2
    assert run_rows(call, [1, 2], lambda r, e: None, single=lambda r: -r) == [(1, -1), (2, -2)]


def test_admission_policy():
    """Free slots and the padded-token budget of one prefill bound an admission (always at least one row); without
    continuous batching nobody joins while rows are decoding."""
    from types import SimpleNamespace

    from cosytrt.runtime.scheduling.policies import admit

    waiting = [SimpleNamespace(lm_input=torch.zeros(n, 4)) for n in (100, 300, 50, 10)]
    cfg = SchedulerConfig(ar_max_prefill_tokens=600)
    assert admit(waiting, 0, 8, cfg) == 2                  # 2 x 300 = 600 fits, 3 x 300 does not
    assert admit(waiting, 0, 1, cfg) == 1
    assert admit(waiting[1:], 0, 8, SchedulerConfig(ar_max_prefill_tokens=10)) == 1
    assert admit(waiting, 3, 8, replace(cfg, continuous_batching=False)) == 0
    assert admit(waiting, 0, 8, replace(cfg, continuous_batching=False)) == 2


# ---------------------------------------------------------------- step-level DiT

class _DJob(_Job):
    """A DiT job stand-in: attention mode, kind and length for the step-level policy."""

    def __init__(self, name, metrics, streaming, finalize, frames=200):
        super().__init__(name, metrics)
        self.streaming, self.finalize, self.frames, self.t_enqueue = streaming, finalize, frames, 0.0

    @property
    def kind(self):
        return self.streaming, self.finalize


def test_pick_dit_step_lets_a_first_hop_overtake_a_final_mid_solve():
    from cosytrt.runtime.scheduling.policies import pick_dit_step

    now, cfg = 100.0, SchedulerConfig()
    final = _DJob("final", _metrics(t_submit=90.0, ttfa=0.5, audio_seconds=12.0), False, True, 2000)  # 2.5 s buffered
    hop = _DJob("hop", _metrics(t_submit=99.9), True, False, 150)                                       # a new stream
    # mid-solve final, new first hop: the hop's step runs next, without the final's rows (other attention mode)
    group, wait = pick_dit_step([hop], [final], cfg, now, True)
    assert ([j.name for j in group], wait) == (["hop"], None)
    # a prefix-cached hop and a whole-history hop never share a call; cached hops group by their new frames
    cached_a = _DJob("cached a", _metrics(t_submit=99.0), True, False, 900)
    cached_b = _DJob("cached b", _metrics(t_submit=99.5), True, False, 300)
    kinds = {"cached a": ("cached", 100), "cached b": ("cached", 100), "hop": ("stream", 150),
             "final": ("offline", 2000)}
    describe = lambda j: kinds[j.name]  # noqa: E731
    group, _ = pick_dit_step([cached_b, hop], [cached_a, final], cfg, now, True, describe)
    assert sorted(j.name for j in group) == ["cached a", "cached b"]  # 900 vs 300 frames, the same new frames
    group, _ = pick_dit_step([cached_b, hop], [cached_a, final], cfg, now, True, describe, cap=lambda k: 1)
    assert [j.name for j in group] == ["cached a"]
    # an underrunning stream's final goes first, and queued finals of similar length join its step
    late = _DJob("late", _metrics(t_submit=95.0, ttfa=0.5, audio_seconds=3.0), False, True, 1900)
    other = _DJob("other", _metrics(t_submit=99.0), False, True, 1800)
    group, _ = pick_dit_step([hop, other], [late], cfg, now, True)
    assert sorted(j.name for j in group) == ["late", "other"]
    # nothing mid-solve: the call is formed (and waited for) as without step-level scheduling
    group, wait = pick_dit_step([hop], [], replace(cfg, dit_max_wait_ms=1e6), now, True)
    assert group == [] and wait > 0
    # ... except a stream's first job: later jobs can join its next step, so it does not wait for them
    hop.first, hop.r.stream = True, object()
    group, wait = pick_dit_step([hop], [], replace(cfg, dit_max_wait_ms=1e6), now, True)
    assert [j.name for j in group] == ["hop"] and wait is None
    assert pick_dit_step([hop], [], replace(cfg, dit_max_wait_ms=1e6, dit_first_now=False), now, True)[0] == []
    hop.r.stream = None  # an offline request's first job still waits for company
    assert pick_dit_step([hop], [], replace(cfg, dit_max_wait_ms=1e6), now, True)[0] == []
    from cosytrt.runtime.scheduling.policies import pick_dit_group
    hop.r.stream = object()  # whole-call scheduling keeps the wait (a call's rows cannot join later)
    assert pick_dit_group([hop], replace(cfg, dit_max_wait_ms=1e6), now, True)[0] == []



def test_dit_max_active_bounds_the_jobs_mid_solve_but_not_first_hops():
    """`dit_max_active`: with that many jobs mid-solve a queued job does not start (the call advances the started
    ones), except a stream's first job; 0 (the default) starts the most urgent job whatever is mid-solve."""
    from cosytrt.engines.errors import InputError
    from cosytrt.runtime.scheduling.policies import pick_dit_step

    now = 100.0
    kinds = {}

    def job(name, t_submit, first=False, ttfa=0.5, audio=1.0):
        j = _DJob(name, _metrics(t_submit=t_submit, ttfa=None if first else ttfa, audio_seconds=0.0 if first else audio),
                  True, False, 300)
        j.first = first
        kinds[name] = ("cached", 100)
        return j

    a, b = job("a", 90.0, audio=40.0), job("b", 91.0, audio=40.0)  # mid-solve, far ahead of their listeners
    urgent = job("urgent", 99.0, audio=0.6)                          # queued, its listener about to run dry
    describe = lambda j: kinds[j.name]  # noqa: E731
    cap = lambda k: 1  # noqa: E731 - one row per call: the most urgent job alone
    group, _ = pick_dit_step([urgent], [a, b], SchedulerConfig(), now, True, describe, cap)
    assert [j.name for j in group] == ["urgent"]                     # no bound: it starts
    bounded = SchedulerConfig(dit_max_active=2)
    group, _ = pick_dit_step([urgent], [a, b], bounded, now, True, describe, cap)
    assert group and group[0].name in ("a", "b")                     # at the bound: a started job advances
    assert [j.name for j in pick_dit_step([urgent], [a], bounded, now, True, describe, cap)[0]] == ["urgent"]
    first = job("first", 99.9, first=True)                           # a new stream's first hop still starts
    group, _ = pick_dit_step([first], [a, b], bounded, now, True, describe, cap)
    assert [j.name for j in group] == ["first"]
    with pytest.raises(InputError, match="dit_max_active must be an int >= 0"):
        SchedulerConfig(dit_max_active=-1)


def test_dit_step_level_keeps_the_audio_and_steps_rows_together(tts, speaker):
    """Step-level DiT scheduling only changes which rows share an estimator call (each row's Euler arithmetic is
    the solve's): every request's audio equals the whole-call schedule within the flow's batching bound."""
    reqs = lockstep(speaker, n=3) + [make_request("Offline one.", speaker=speaker, seed=9, force_tokens=50)]
    on, st_on = run_all(tts, SchedulerConfig(dit_max_wait_ms=20, dit_step_level=True), reqs)
    off, st_off = run_all(tts, SchedulerConfig(dit_max_wait_ms=20, dit_step_level=False), reqs)
    assert st_on["completed"] == 4
    assert st_on["dit"]["calls"] >= 10 * st_off["dit"]["calls"] // 2  # one call per Euler step, not per solve
    assert_same_audio(on, off)


def test_fast_gil_switch_is_cuda_only_and_restored(tts):
    """`fast_gil_switch` shortens the interpreter's GIL switch interval while a CUDA scheduler runs and restores it
    when the last such scheduler closes; on the CPU it changes nothing (no GPU work for the worker threads to keep
    queued)."""
    import sys

    from cosytrt.runtime.scheduling.scheduler import FAST_GIL_SWITCH_S, use_fast_gil_switch

    before = sys.getswitchinterval()
    sched = Scheduler(tts.pipeline, SchedulerConfig(fast_gil_switch=True))
    try:
        assert sys.getswitchinterval() == before and sched._process_switches == []
    finally:
        sched.close()
    assert sys.getswitchinterval() == before
    # two overlapping users (CUDA schedulers): short while either is registered, the old interval after the last
    use_fast_gil_switch(+1)
    use_fast_gil_switch(+1)
    try:
        assert sys.getswitchinterval() == min(before, FAST_GIL_SWITCH_S)
        use_fast_gil_switch(-1)
        assert sys.getswitchinterval() == min(before, FAST_GIL_SWITCH_S)
    finally:
        use_fast_gil_switch(-1)
    assert sys.getswitchinterval() == before
    use_fast_gil_switch(-1)  # an extra release changes nothing
    assert sys.getswitchinterval() == before


def test_dit_conv_switch_holds_for_the_schedulers_life(tts, speaker):
    """`SchedulerConfig.dit_conv` (an A/B lever): the process's DiT convolution is the named one from the scheduler's
    start (before its cached-hop graphs are captured) to its close, then the one before comes back; the audio is
    the same; an unknown name is refused with the field's name."""
    from cosytrt.engines.errors import InputError
    from cosytrt.runtime.models import dit_conv

    before = dit_conv.CONV
    reqs = [make_request("Hello there.", speaker=speaker, seed=3, force_tokens=40, stream=True)]
    ref, _ = run_all(tts, SchedulerConfig(), reqs)
    sched = Scheduler(tts.pipeline, SchedulerConfig(dit_conv="unfold"))
    try:
        assert dit_conv.CONV == "unfold"
    finally:
        sched.close()
    assert dit_conv.CONV == before
    got, _ = run_all(tts, SchedulerConfig(dit_conv="unfold"), reqs)
    assert dit_conv.CONV == before
    assert_same_audio(got, ref)
    with pytest.raises(InputError, match="dit_conv"):
        SchedulerConfig(dit_conv="fft")
    with pytest.raises(ValueError, match="choose one of"):
        dit_conv.use("benchmark")


def test_a_failed_scheduler_start_gives_back_the_process_switches(tts, speaker, monkeypatch):
    """A scheduler whose start fails after it switched the process's DiT conv gives the switch back (run 66: the
    Triton conv's failed compile left it switched, and every later scheduler of the bench process failed the same
    way), and closes the AR runner it built; the next scheduler runs with the process's own conv and audio."""
    from cosytrt.runtime.models import dit_conv
    from cosytrt.runtime.scheduling import scheduler as scheduler_module

    before = dit_conv.CONV
    reqs = [make_request("Hello there.", speaker=speaker, seed=3, force_tokens=40, stream=True)]
    ref, _ = run_all(tts, SchedulerConfig(), reqs)
    closed = []
    real_runner = scheduler_module.make_ar_runner

    def runner(*a, **k):
        r = real_runner(*a, **k)
        real_close = r.close
        r.close = lambda: (closed.append(True), real_close())
        return r

    def broken(*a, **k):
        raise RuntimeError("stage start failed")

    monkeypatch.setattr(scheduler_module, "make_ar_runner", runner)
    monkeypatch.setattr(scheduler_module, "Token2WavWorker", broken)
    with pytest.raises(RuntimeError, match="stage start failed"):
        Scheduler(tts.pipeline, SchedulerConfig(dit_conv="unfold"))
    assert dit_conv.CONV == before
    assert closed == [True]
    monkeypatch.undo()
    got, _ = run_all(tts, SchedulerConfig(), reqs)
    assert_same_audio(got, ref)


def test_tts_reconfigure_keeps_the_ar_runner_and_the_audio(speaker):
    """TTS.reconfigure swaps the scheduler for one with new settings over the same AR runner (an A/B without
    building the runner's graphs again): the same request gives the same audio; a setting the runner depends on
    is refused with its name."""
    from cosytrt.engines.errors import InputError
    from cosytrt.runtime.tts import TTS

    tts = TTS.load("tiny", scheduler=SchedulerConfig(dit_step_level=True))
    try:
        req = make_request("Same words twice.", speaker=speaker, seed=5, force_tokens=60, stream=True)
        first = np.concatenate(list(tts.submit(req).chunks()))
        runner = tts.ar_runner
        tts.reconfigure(replace(tts.scheduler_config, dit_step_level=False, dit_first_now=False))
        assert tts.scheduler.config.dit_step_level is False and tts.ar_runner is runner
        req = make_request("Same words twice.", speaker=speaker, seed=5, force_tokens=60, stream=True)
        again = np.concatenate(list(tts.submit(req).chunks()))
        np.testing.assert_allclose(again, first, atol=2e-3)  # the scheduling bound (step-level vs whole calls)
        # in-graph sampling is taken on by the same runner (its sampler and, on a GPU, a decode graph set with it)
        free = dict(speaker=speaker, seed=7, max_tokens=80)
        h = tts.submit(make_request("Free running words.", **free))
        h.result(timeout=120)
        assert runner.graph_sampler is None
        tts.reconfigure(replace(tts.scheduler_config, ar_graph_sampling=True))
        h2 = tts.submit(make_request("Free running words.", **free))
        h2.result(timeout=120)
        assert tts.ar_runner is runner and runner.graph_sampler is not None and h2.tokens == h.tokens
        with pytest.raises(InputError, match="ar_max_batch would need another AR runner"):
            tts.reconfigure(replace(tts.scheduler_config, ar_max_batch=3))
    finally:
        tts.close()


def test_ar_graph_sampling_keeps_the_tokens(tts, speaker):
    """`ar_graph_sampling`: the AR runner samples each decode step in the fixed-shape ops its decode graphs hold (here
    on the CPU, eagerly). Free-running requests (stop ids, RAS repeats, a greedy one, one with another top_k that the
    sampler does not fit and samples from the logits) get the same tokens and audio as with the sampler apart."""
    reqs = [make_request("Sample me freely, please.", speaker=speaker, seed=s, max_tokens=90, stream=s % 2 == 0,
                         **extra) for s, extra in enumerate([{}, {}, {"greedy": True}, {"top_k": 5}])]
    def run(cfg):
        sched = Scheduler(tts.pipeline, cfg)
        try:
            handles = [sched.submit(r) for r in reqs]
            wavs = [h.result(timeout=120) for h in handles]
            return wavs, [h.tokens for h in handles], sched
        finally:
            sched.close()

    on, tok_on, sched = run(SchedulerConfig(ar_graph_sampling=True))
    assert sched.runner.graph_sampler is not None and sched.stats()["completed"] == 4
    off, tok_off, sched = run(SchedulerConfig(ar_graph_sampling=False))
    assert sched.runner.graph_sampler is None
    assert tok_on == tok_off and len({len(t) for t in tok_on}) > 1   # free-running: lengths differ
    assert_same_audio(on, off)


def run_staggered(tts, cfg: SchedulerConfig, reqs, gap_s: float = 0.05):
    """`reqs` submitted `gap_s` apart to a scheduler with `cfg`: (wavs, tokens, stats)."""
    sched = Scheduler(tts.pipeline, cfg)
    try:
        handles = []
        for r in reqs:
            handles.append(sched.submit(r))
            time.sleep(gap_s)
        wavs = [h.result(timeout=120) for h in handles]
        return wavs, [h.tokens for h in handles], sched.stats()
    finally:
        sched.close()


def same_audio_and_counted(tts, reqs, **setting) -> tuple[dict, dict]:
    """`reqs()` staggered without and with `setting` (an ordering-only switch): the same tokens and audio; returns
    the two runs' scheduler stats (off, on) for the switch's counters."""
    base = SchedulerConfig()
    off_wavs, off_tokens, off_stats = run_staggered(tts, base, reqs())
    on_wavs, on_tokens, on_stats = run_staggered(tts, replace(base, **setting), reqs())
    assert on_tokens == off_tokens
    assert_same_audio(on_wavs, off_wavs)
    return off_stats, on_stats


def test_first_audio_hold_keeps_the_audio_and_holds(tts, speaker):
    """`ar_first_audio_hold_ms`: the AR worker holds decode steps while a stream waits for its first audio (after its
    first DiT job was made): the same tokens and audio as without the hold, and the holds are counted. Staggered
    streams of different lengths (a later one's first hop comes while earlier ones decode on)."""
    def reqs():
        return [make_request("Hold on for the first audio.", speaker=speaker, seed=i, stream=True,
                             force_tokens=60 + 30 * i) for i in range(3)]

    off_stats, on_stats = same_audio_and_counted(tts, reqs, ar_first_audio_hold_ms=200.0)
    assert off_stats["ar"]["first_audio_holds"] == 0
    assert on_stats["ar"]["first_audio_holds"] > 0 and on_stats["ar"]["first_audio_hold_s"] > 0
    with pytest.raises(Exception, match="ar_first_audio_hold_ms"):
        SchedulerConfig(ar_first_audio_hold_ms=-1)


def test_ar_pacing_keeps_the_audio_and_paces(tts, speaker):
    """`ar_pace_lead_s`: the AR worker waits while every stream is far enough ahead of its listener: the same tokens
    and audio as without pacing (ordering only), the waits are counted, and the streams still finish. Staggered
    streams of different lengths, one offline request among them at the end (due whenever it runs)."""
    def reqs():
        out = [make_request("Pace the speech tokens.", speaker=speaker, seed=i, stream=True,
                            force_tokens=60 + 25 * i) for i in range(3)]
        return out + [make_request("Offline too.", speaker=speaker, seed=9, stream=False, force_tokens=40)]

    off_stats, on_stats = same_audio_and_counted(tts, reqs, ar_pace_lead_s=0.5)
    assert off_stats["ar"]["pace_waits"] == 0
    assert on_stats["ar"]["pace_waits"] > 0 and on_stats["ar"]["pace_wait_s"] > 0
    # (rows per decode step with and without pacing are not compared: on a loaded CI machine the order in which
    # threads run decides them — 291 rows in 155 vs 153 steps failed such a check once — a timing, not a behaviour)


def test_cached_hop_kv_form_is_paged_where_its_kernel_runs(monkeypatch):
    """`SchedulerConfig.dit_paged_prefix` None (auto, the default since run 66): the cached hops read the prefix from
    the pages where the paged attention's Triton kernel runs on the scheduler's device (CUDA), else per-layer K / V
    inputs; an explicit value wins; `auto` / `none` reach the field from `--scheduler` / `--ab`; other values are
    refused with the field's name."""
    from cosytrt.engines.errors import InputError
    from cosytrt.runtime.models import hop_attention
    from cosytrt.runtime.scheduling.config import config_overrides
    from cosytrt.runtime.scheduling.scheduler import kv_form

    cpu = torch.device("cpu")
    assert SchedulerConfig().dit_paged_prefix is None
    assert kv_form(SchedulerConfig(), cpu) == "layers"
    assert kv_form(SchedulerConfig(dit_paged_prefix=True), cpu) == "paged"
    assert kv_form(SchedulerConfig(dit_paged_prefix=False, dit_kv_layer_inputs=False), cpu) == "stacked"
    cuda = torch.device("cuda")
    for triton in (True, False):
        monkeypatch.setattr(hop_attention, "available", lambda: triton)
        assert kv_form(SchedulerConfig(), cuda) == ("paged" if triton else "layers")
        assert kv_form(SchedulerConfig(dit_paged_prefix=False), cuda) == "layers"
        assert kv_form(SchedulerConfig(), cpu) == "layers"
    assert config_overrides(["dit_paged_prefix=auto"]) == {"dit_paged_prefix": None}
    assert config_overrides(["dit_paged_prefix=1"]) == {"dit_paged_prefix": True}
    with pytest.raises(InputError, match="dit_paged_prefix"):
        SchedulerConfig(dit_paged_prefix="yes")


def test_hift_takes_least_slack_first_when_oversubscribed():
    """More streams' vocoder windows ready than a call takes (`hift_max_batch`): `hift_slack_priority` (default) puts
    a stream's first chunk and an underrunning stream in the call ahead of buffered streams queued before them;
    off, queue order. One job per request per call either way; offline finals all come along; under the batch size
    nothing is reordered away."""
    from cosytrt.runtime.scheduling.policies import pick_hift_jobs

    now = 100.0

    class J(_Job):
        def __init__(self, name, metrics, stream=True):
            super().__init__(name, metrics)
            self.r.stream = object() if stream else None
            self.t_enqueue = 90.0

    buffered = [J(f"buffered{i}", _metrics(t_submit=90.0, ttfa=0.5, audio_seconds=12.0 + i)) for i in range(4)]
    first = J("first", _metrics(t_submit=99.5))
    underrun = J("underrun", _metrics(t_submit=95.0, ttfa=0.5, audio_seconds=3.0))
    offline = J("offline", _metrics(t_submit=99.0), stream=False)
    queue = buffered + [first, underrun, offline]
    cfg = SchedulerConfig(hift_max_batch=3)
    jobs, wait = pick_hift_jobs(queue, cfg, now, more_coming=True)
    assert wait is None and [j.name for j in jobs] == ["underrun", "first", "buffered0", "offline"]
    jobs, _ = pick_hift_jobs(queue, replace(cfg, hift_slack_priority=False), now, more_coming=True)
    assert [j.name for j in jobs] == ["buffered0", "buffered1", "buffered2", "offline"]
    jobs, _ = pick_hift_jobs(queue, replace(cfg, hift_max_batch=8), now, more_coming=True)
    assert [j.name for j in jobs] == [j.name for j in queue]


def test_hift_slack_priority_keeps_the_audio(tts, speaker):
    """The vocoder's slack-first pick (five streams, two per vocoder call, so the pick orders them) gives every
    stream the audio of queue order."""
    reqs = lockstep(speaker, n=5)
    base = SchedulerConfig(hift_max_batch=2)
    on, _ = run_all(tts, base, reqs)
    off, _ = run_all(tts, replace(base, hift_slack_priority=False), reqs)
    assert_same_audio(on, off)


def test_dit_green_reserve_sms_is_checked_and_refused_off_cuda(tts, monkeypatch):
    """`dit_green_reserve_sms` (the DiT / HiFT streams in an SM partition): a negative or non-int value is refused by
    the config; on the CPU a scheduler asking for it fails to start with the reason (no silent no-op) and gives back
    what it took; `green_streams` refuses a reserve that leaves no SM to either side and a torch whose green
    contexts have no `Stream()`, and makes its streams from `GreenContext.create(num_sms=...)` otherwise (a fake
    context here: the GPU's numbers are benchmarks/green_ctx_probe.py's)."""
    from cosytrt.engines.errors import InputError
    from cosytrt.runtime.scheduling import sm_partition

    for bad in (-1, True, 1.5):
        with pytest.raises(InputError, match="dit_green_reserve_sms must be an int >= 0"):
            SchedulerConfig(dit_green_reserve_sms=bad)
    with pytest.raises(InputError, match="needs a CUDA device"):
        Scheduler(tts.pipeline, SchedulerConfig(dit_green_reserve_sms=8))
    reqs = [make_request("Hello there.", seed=3, force_tokens=30)]
    run_all(tts, SchedulerConfig(), reqs)  # the next scheduler starts and runs

    class Props:
        multi_processor_count = 132

    made = []

    class FakeContext:
        @staticmethod
        def create(num_sms=None, device_id=None):
            made.append((num_sms, device_id))
            return FakeContext()

    import torch.cuda.green_contexts as gc

    class FakeStream:
        synced = 0

        def synchronize(self):
            self.synced += 1

    FakeContext.Stream = lambda self: FakeStream()  # a distinct stream per call
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props())
    monkeypatch.setattr(gc, "GreenContext", FakeContext)
    monkeypatch.setattr(sm_partition, "_PARTITIONS", {})
    for reserve in (0, 132, 200):
        with pytest.raises(InputError, match="leave SMs to both sides"):
            sm_partition.green_streams("cuda:0", reserve, True)
    g = sm_partition.green_streams("cuda:0", 16, True)  # the vocoder on a stream of its own (hift_own_stream)
    assert made == [(116, 0)] and g.sms == 116 and g.total_sms == 132 and len(g.streams) == 2
    assert g.dit is g.streams[0] and g.hift is g.streams[1] and g.dit is not g.hift
    shared = sm_partition.green_streams("cuda:0", 16, False)  # the vocoder on the DiT's stream
    assert len(shared.streams) == 1 and shared.hift is shared.dit
    # a scheduler's close drains the streams and keeps the context: freeing blocks allocated on a destroyed green
    # context's stream aborted the process (run 68); a later scheduler asking for the same partition gets it again
    g.close()
    assert g.dit.synced == 1 and g.hift.synced == 1 and len(g.streams) == 2
    assert sm_partition.green_streams("cuda:0", 16, True) is g and len(made) == 2
    monkeypatch.delattr(FakeContext, "Stream")
    with pytest.raises(InputError, match="without Stream"):
        sm_partition.green_streams("cuda:0", 24, True)
