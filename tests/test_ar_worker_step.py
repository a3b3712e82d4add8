"""The AR worker's decode step (issue #18: the batch's logits go to one `sample_batch` without a per-row split):
a failing decode batch or a failing sample batch falls back row by row, only the failing row fails, and every other
row samples exactly once per step, with the tokens it gets without the failure."""
from types import SimpleNamespace

import pytest
import torch

from cosytrt.runtime.models.sampling import SamplingParams, StaticSampler, TokenPolicy
from cosytrt.runtime.scheduling.ar_worker import ARWorker
from cosytrt.runtime.scheduling.config import SchedulerConfig
from cosytrt.runtime.scheduling.stage_clock import StageClock

V = 6761


class SlotRunner:
    """Logits fixed per slot (stop ids at -inf); decode raises for a batch holding slot `bad`."""

    def __init__(self, slots: int):
        self.max_batch, self.max_len = slots, 1 << 20
        g = torch.Generator().manual_seed(0)
        self.table = torch.randn(slots, V, generator=g) * 2
        self.table[:, 6561:] = float("-inf")
        self.free = list(range(slots - 1, -1, -1))
        self.bad = None

    def allocate(self):
        return self.free.pop()

    def release(self, slot):
        self.free.append(slot)

    def decode(self, tokens, slots, positions):
        if self.bad in slots:
            raise RuntimeError("injected decode failure")
        return self.table[slots]


class SamplingRunner(SlotRunner):
    """`SlotRunner` that samples the decode step itself (as `TorchARRunner` with `ar_graph_sampling`, eagerly)."""

    def __init__(self, slots: int):
        super().__init__(slots)
        self.graph_sampler = StaticSampler(V, 6561, top_k=50)
        self.sampled = 0

    def decode_sampled(self, tokens, slots, positions, packed):
        logits = self.decode(tokens, slots, positions)
        if not self.graph_sampler.fits(packed):
            return logits, None
        self.sampled += 1
        return logits, self.graph_sampler(logits, self.graph_sampler.rows(packed, len(tokens))).tolist()


class Sink:
    def __init__(self):
        self.calls = []

    def tokens(self, r, done):
        self.calls.append(r)

    def flush(self):
        pass


def _worker(n: int, runner_cls=SlotRunner, runner=None, sink=None):
    """An ARWorker with `n` running rows (seeds 0..n-1) over `runner` (default: a new `runner_cls(n)`)."""
    runner, sink, failed = runner or runner_cls(n), sink or Sink(), []
    w = ARWorker(runner, SchedulerConfig(ar_graph_sampling=True), sink, lambda r, e: failed.append((r, str(e))),
                 StageClock(False), "cpu")   # the setting on: a runner with a sampler samples (SamplingRunner)
    for i in range(n):
        pol = TokenPolicy(1, SamplingParams(seed=i, top_k=50, min_tokens=1000, max_tokens=1000),
                          mask_all_stops_before_min=True)
        pol.next_input = 0
        w.running.append(SimpleNamespace(policy=pol, slot=runner.allocate(), pos=10, tokens=[],
                                         metrics=SimpleNamespace(t_ar=0.0), dead=False))
    return w, runner, failed


def _reference(n: int, steps: int) -> list[list[int]]:
    w, _, failed = _worker(n)
    with torch.inference_mode():
        for _ in range(steps):
            w._decode()
    assert not failed
    return [r.tokens for r in w.running]


@pytest.mark.parametrize("runner_cls", [SlotRunner, SamplingRunner])
def test_failing_decode_row_fails_alone(runner_cls):
    """Also with `ar_graph_sampling` (`SamplingRunner`: the runner samples each decode step, `decode_sampled`): the
    tokens are the ones `sample_batch` gives, and the rows that do not fail keep the uniforms they drew."""
    ref = _reference(4, 12)
    w, runner, failed = _worker(4, runner_cls)
    rows = list(w.running)
    with torch.inference_mode():
        for step in range(12):
            if step == 5:
                runner.bad = 2
            w._decode()
    assert [(r, e) for r, e in failed] == [(rows[2], "injected decode failure")]
    assert rows[2] not in w.running and rows[2].slot is None and 2 in runner.free
    assert len(rows[2].tokens) == 5
    for i in (0, 1, 3):
        assert rows[i].tokens == ref[i] and rows[i].policy.num_sampled == 12 and rows[i].pos == 22, i
    if runner_cls is SamplingRunner:
        assert runner.sampled == 11  # not step 5: its batch failed, the rows went one by one, sampled from the logits


def test_failing_sample_row_fails_alone():
    ref = _reference(4, 8)
    w, runner, failed = _worker(4)
    rows = list(w.running)
    with torch.inference_mode():
        for step in range(8):
            if step == 3:
                rows[1].policy.finished = True      # sampling it raises: the batch falls back to one row at a time
            w._decode()
    assert len(failed) == 1 and failed[0][0] is rows[1] and "finished" in failed[0][1]
    assert rows[1] not in w.running and rows[1].slot is None
    for i in (0, 2, 3):
        assert rows[i].tokens == ref[i] and rows[i].policy.num_sampled == 8, i


def test_ar_step_bench_table_runs():
    """tools/bench/ar_step (host µs per decode step) keeps working; its numbers are not checked."""
    from cosytrt.tools.bench.ar_step import table

    (row,) = table(batches=(2,), steps=2, repeats=1)
    assert row["batch"] == 2 and row["fixed_us"] > 0 and row["tiny_us"] > 0 and row["fixed_ops"] > 10
    assert row["tiny_x4_us"] > 0 and row["tiny_x4_calls"] > 0
    import threading

    from cosytrt.tools.bench.ar_step import GilLoad

    (row,) = table(batches=(2,), steps=2, repeats=1, gil_threads=1, gil_hold_us=100, gil_gap_us=100)
    assert row["fixed_us"] > 0
    assert not any(t.name.startswith("cosytrt-bench-gil-load") for t in threading.enumerate())  # stopped
    with GilLoad(0):
        pass


def test_gpu_load_checks_its_arguments_and_is_a_no_op_at_zero():
    """`GpuLoad` (ar_step --gpu-load): CUDA only, a share in [0, 1); at 0 nothing starts and `on()` is a no-op (the
    GEMM thread itself needs a GPU)."""
    import pytest

    from cosytrt.tools.bench.ar_step import GpuLoad

    with pytest.raises(ValueError, match="needs --device cuda"):
        GpuLoad(0.5, "cpu")
    with pytest.raises(ValueError, match=r"must be in \[0, 1\)"):
        GpuLoad(1.0, "cuda")
    with GpuLoad(0.0, "cpu") as load:
        with load.on():
            pass
    assert load.thread is None and load.launches == 0


def test_first_audio_hold_conditions():
    """`ARWorker._hold_for_first_audio`: holds (True, after a short wait) only while a running stream whose first DiT
    job was made waits for its first audio, within the hold's time after that job, no stream still needs tokens for
    its first hop and no request waits for admission; never with the setting off."""
    import time

    def worker(hold_ms, rows):
        w = ARWorker(SlotRunner(4), SchedulerConfig(ar_first_audio_hold_ms=hold_ms), Sink(), lambda r, e: None,
                     StageClock(False), "cpu")
        w.running = rows
        return w

    now = time.perf_counter()

    def row(stream=True, dit_jobs=1, ttfa=None, first_job_t=now, dead=False):
        return SimpleNamespace(stream=object() if stream else None, dit_jobs=dit_jobs, first_job_t=first_job_t,
                               metrics=SimpleNamespace(ttfa=ttfa), dead=dead)

    waiting = row()
    assert not worker(0, [waiting])._hold_for_first_audio()                  # off
    w = worker(500, [waiting, row(stream=False, dit_jobs=0)])                 # an offline row does not matter
    assert w._hold_for_first_audio() and w.counters.first_audio_holds == 1 and w.counters.first_audio_hold_s > 0
    assert not worker(500, [waiting, row(dit_jobs=0)])._hold_for_first_audio()  # a stream short of its first hop
    assert not worker(500, [row(ttfa=0.1)])._hold_for_first_audio()         # first audio already out
    assert not worker(500, [row(first_job_t=now - 1.0)])._hold_for_first_audio()  # the hold's time is over
    assert not worker(500, [row(dead=True)])._hold_for_first_audio()         # a cancelled request
    w = worker(500, [waiting])
    w.waiting.append(object())                                                # admission goes first
    assert not w._hold_for_first_audio()


def test_ar_pacing_conditions():
    """`policies.ar_step_due` / `ARWorker._pace` (`ar_pace_lead_s`): a decode step is due for an offline row, a stream
    before its first DiT job, or a stream whose listener reaches the end of its hops' audio within the lead plus the
    steps its next hop needs; otherwise the worker waits, no longer than until the first row becomes due; never with
    the setting off or while a request waits for admission."""
    import time

    from cosytrt.runtime.scheduling.policies import ar_step_due
    from cosytrt.runtime.stages.hop_schedule import HopSchedule

    now = time.perf_counter()

    def row(stream=True, dit_jobs=1, offset=0, tokens=0, ttfa=None, t_submit=now, dead=False, finished=False):
        hops = HopSchedule(0)
        hops.offset, hops.hop, hops.finished = offset, 100, finished   # next hop fires at offset + 103 tokens
        m = SimpleNamespace(ttfa=ttfa, t_submit=t_submit, buffered_s=0.0, follows=None)
        return SimpleNamespace(stream=SimpleNamespace(hops=hops) if stream else None, dit_jobs=dit_jobs,
                               tokens=[0] * tokens, metrics=m, dead=dead)

    step = 0.003
    assert ar_step_due([row(stream=False)], now, 1.0, step) == (True, None)           # offline
    assert ar_step_due([row(dit_jobs=0)], now, 1.0, step) == (True, None)             # no first hop yet
    # playing since 1 s ago; its hops cover 75 tokens = 3 s: the listener needs more in 2 s
    ahead = row(offset=75, tokens=170, ttfa=0.0, t_submit=now - 1.0)                  # 8 tokens to go: 24 ms
    due, wait = ar_step_due([ahead], now, 1.0, step)
    assert not due and wait == pytest.approx(2.0 - 1.0 - 8 * step)
    assert ar_step_due([ahead], now, 2.0, step)[0]                                     # a longer lead: due
    behind = row(offset=75, tokens=80, ttfa=0.0, t_submit=now - 1.0)                  # 98 tokens to go: 0.294 s
    assert ar_step_due([ahead, behind], now, 1.8, step)[0]                             # 2 - 1.8 < 0.294
    assert ar_step_due([ahead, behind], now, 1.0, step)[0] is False
    # before its first audio the listener is taken to start now: 3 s of hop audio ahead
    assert ar_step_due([row(offset=75, tokens=170)], now, 1.0, step)[0] is False
    assert ar_step_due([row(dead=True, dit_jobs=0), ahead], now, 1.0, step)[0] is False  # a cancelled row
    assert ar_step_due([row(finished=True), ahead], now, 1.0, step)[0] is False
    assert ar_step_due([], now, 1.0, step) == (False, None)

    def worker(lead, rows):
        w = ARWorker(SlotRunner(4), SchedulerConfig(ar_pace_lead_s=lead), Sink(), lambda r, e: None,
                     StageClock(False), "cpu")
        w.running = rows
        return w

    assert not worker(0, [ahead])._pace()                                              # off
    w = worker(1.0, [ahead])
    assert w._pace() and w.counters.pace_waits == 1 and w.counters.pace_wait_s > 0
    assert not worker(1.0, [ahead, row(stream=False)])._pace()
    w = worker(1.0, [ahead])
    w.waiting.append(object())                                                         # admission goes first
    assert not w._pace()
    with pytest.raises(Exception, match="ar_pace_lead_s"):
        SchedulerConfig(ar_pace_lead_s=-0.5)


class _OneAtATimeRunner(SlotRunner):
    """Records whether two decode calls ever overlap, and hands out its output buffer as a graph runner does (the
    same tensor each call, overwritten by the next)."""

    def __init__(self, slots: int):
        super().__init__(slots)
        self.inside, self.overlaps, self.calls = 0, 0, 0
        self.out = torch.empty(slots, V)

    def decode(self, tokens, slots, positions):
        import time

        self.inside += 1
        self.overlaps += self.inside > 1
        self.calls += 1
        time.sleep(0.0005)  # lets another thread in, were the step not locked
        out = self.out[:len(slots)]
        out.copy_(self.table[slots])
        self.inside -= 1
        return out


def test_two_workers_over_one_runner_take_its_steps_in_turn():
    """Two AR workers over one runner (a scheduler draining in `TTS.reconfigure` beside the next one, a benchmark's
    `make_scheduler`, the AR process's sessions): a graph runner's input / output buffers are the runner's, so each
    whole step (the call and the sampling that reads its output) is taken under the runner's step lock — the calls
    never overlap, and each worker's rows get the tokens they get alone."""
    import threading

    from cosytrt.runtime.scheduling.ar_worker import Stopped, step_lock

    class StopAfter(Sink):  # the worker's loop stops after 30 steps
        def flush(self):
            self.steps = getattr(self, "steps", 0) + 1
            if self.steps == 30:
                self.worker.stopped = True

    def worker_over(runner, rows: int):
        sink = StopAfter()
        sink.worker = _worker(rows, runner=runner, sink=sink)[0]
        return sink.worker

    runner = _OneAtATimeRunner(8)
    workers = [worker_over(runner, 2) for _ in range(2)]  # slots 0, 1 and 2, 3
    assert workers[0].step_lock is workers[1].step_lock is step_lock(runner)
    alone = worker_over(SlotRunner(8), 2)                  # slots 0, 1 of the same logits table
    with torch.inference_mode():
        for _ in range(30):
            alone._decode()

    def run(w):
        try:
            w.loop()
        except Stopped:
            pass
    threads = [threading.Thread(target=run, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert runner.calls == 60 and runner.overlaps == 0
    assert [r.tokens for r in workers[0].running] == [r.tokens for r in alone.running]
