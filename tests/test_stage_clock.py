"""StageClock: busy seconds per stage and occupancy over a workload (CPU: wall time of the spans)."""
import time

import pytest
import torch

from cosytrt.runtime.scheduling.stage_clock import StageClock, occupancy


def test_spans_add_up_per_stage_and_count():
    clock = StageClock(cuda=False)
    before = clock.busy_s()
    for _ in range(3):
        with clock.span("dit"):
            time.sleep(0.01)
    with clock.span("ar"):
        time.sleep(0.02)
    busy = clock.busy_s()
    assert busy["dit"] == pytest.approx(0.03, abs=0.015) and busy["ar"] == pytest.approx(0.02, abs=0.01)
    assert clock.spans() == {"dit": 3, "ar": 1}
    occ = occupancy(before, busy, wall_s=0.1)
    assert occ["dit"] == pytest.approx(busy["dit"] / 0.1) and set(occ) == {"ar", "dit"}


def test_a_span_that_raises_still_counts():
    clock = StageClock(cuda=False)
    with pytest.raises(ValueError):
        with clock.span("hift"):
            raise ValueError("batch failed")
    assert clock.spans() == {"hift": 1}


def test_occupancy_of_an_empty_workload_is_empty():
    assert occupancy({}, {"ar": 1.0}, 0.0) == {}


class _DoneEvent:
    """Stands in for a completed torch.cuda.Event (CPU tests): 2 ms between any start and end."""

    def __init__(self, enable_timing=True):
        pass

    def record(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, end):
        return 2.0


def test_cuda_spans_settle_as_they_complete_without_being_asked(monkeypatch):
    """On CUDA a span is two events; completed ones are added up when the next span of the stage is recorded, so a
    server that never reads the clock keeps no growing list of events."""
    monkeypatch.setattr(torch.cuda, "Event", _DoneEvent)
    clock = StageClock(cuda=True)
    for _ in range(1000):
        with clock.span("ar"):
            pass
    assert clock.pending() == 0 and clock.spans() == {"ar": 1000}
    assert clock.busy_s()["ar"] == pytest.approx(2.0)  # 1000 spans x 2 ms


def test_host_seconds_split_wall_from_cpu():
    """`host_s`: a span's wall seconds and its thread's CPU seconds; a span that sleeps (blocked, as a thread waiting
    for the interpreter lock) adds wall but little CPU, one that computes adds both."""
    clock = StageClock(cuda=False)
    with clock.span("ar"):
        time.sleep(0.05)
    with clock.span("dit"):
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.05:
            pass
    h = clock.host_s()
    assert h["ar"]["wall_s"] >= 0.05 and h["ar"]["cpu_s"] < 0.02
    assert h["dit"]["wall_s"] >= 0.05 and h["dit"]["cpu_s"] > 0.03


def test_open_loop_host_delta_and_its_table():
    """The bench's cell share of the host seconds: wall / CPU shares, blocked share, AR ms per decode step; and the
    report's table of them."""
    from cosytrt.tools.bench.open_loop import host_delta
    from cosytrt.tools.bench.report import _host_row

    before = {"host_s": {"ar": {"wall_s": 1.0, "cpu_s": 0.5}}}
    after = {"host_s": {"ar": {"wall_s": 3.0, "cpu_s": 1.5}, "dit": {"wall_s": 2.0, "cpu_s": 2.0}}}
    d = host_delta(before, after, 10.0, decode_steps=400)
    assert d["ar"] == pytest.approx({"wall_share": 0.2, "cpu_share": 0.1, "blocked": 0.5, "wall_ms_per_step": 5.0,
                                     "cpu_ms_per_step": 2.5})
    assert d["dit"]["blocked"] == 0.0 and "wall_ms_per_step" not in d["dit"]
    assert host_delta({}, {}, 10.0, 5) == {}
    assert _host_row(d) == ["0.20 / 0.10", "50 %", "5.00 / 2.50", "0.20 / 0.20", "0 %", "—", "—"]


def test_waits_count_wall_cpu_and_number():
    """`wait(name)`: a worker thread's wait outside its spans (the DiT fence, idle waits): wall and CPU seconds and
    how many, apart from the spans' busy and host seconds."""
    clock = StageClock(cuda=False)
    for _ in range(2):
        with clock.wait("dit_idle"):
            time.sleep(0.02)
    w = clock.waits_s()
    assert w["dit_idle"]["count"] == 2 and w["dit_idle"]["wall_s"] >= 0.04 and w["dit_idle"]["cpu_s"] < 0.02
    assert clock.busy_s() == {} and clock.host_s() == {}


def test_open_loop_waits_delta_and_its_table():
    from cosytrt.tools.bench.open_loop import _waits_line, waits_delta
    from cosytrt.tools.bench.report import _waits_row

    before = {"waits_s": {"dit_fence": {"wall_s": 1.0, "cpu_s": 1.0, "count": 10}}}
    after = {"waits_s": {"dit_fence": {"wall_s": 4.0, "cpu_s": 3.5, "count": 40},
                         "dit_idle": {"wall_s": 2.0, "cpu_s": 0.0, "count": 5}}}
    d = waits_delta(before, after, 10.0)
    assert d["dit_fence"] == pytest.approx({"wall_share": 0.3, "cpu_share": 0.25, "count": 30})
    assert d["dit_idle"]["wall_share"] == pytest.approx(0.2)
    assert _waits_line(d) == "; waits dit_fence 0.30, dit_idle 0.20" and _waits_line({}) == ""
    host = {"dit": {"wall_share": 0.21}}
    assert _waits_row(host, d) == ["0.21", "0.30", "0.20", "—", "—", "—"]


def test_scheduler_reports_the_dit_and_hift_threads_idle_waits():
    """On the CPU the worker threads wait for work between requests: stats()["waits_s"] counts those waits."""
    from cosytrt.runtime.tts import TTS

    tts = TTS.load("tiny")
    try:
        tts.submit("hello there", seed=1).result(timeout=120)
        waits = tts.metrics()["stages"]["waits_s"]   # the public path (README: Capacity)
    finally:
        tts.close()
    assert waits["dit_idle"]["count"] >= 1 and waits["hift_idle"]["count"] >= 1


def test_open_loop_table_part_only_for_cells_that_have_the_key():
    from cosytrt.tools.bench.report import _open_loop_table

    cells = [{"setting": "a", "rate": 12, "waits": {"dit_idle": {"wall_share": 0.5}}}, {"setting": "b", "rate": 8},
             {"setting": "c", "rate": 4, "error": "x", "waits": {}}]
    part = _open_loop_table(cells, "waits", lambda c: ["0.50"], "**T**", ["DiT idle"])
    assert part == ["**T**\n\n| setting | req/s | DiT idle |\n|---|---|---|\n| a | 12 | 0.50 |"]
    assert _open_loop_table(cells[1:], "waits", lambda c: [], "**T**", []) == []


def test_step_timer_times_every_nth_step_once_its_events_completed(monkeypatch):
    """`StepTimer` (the AR step's anatomy, every `every`-th decode step on CUDA): the runner call's host seconds, the
    GPU span of its timing events (read only once the end event completed: it never blocks) and the host seconds
    after it, added to the AR counters; on the CPU it times nothing. The bench turns the counters into ms per timed
    step and the report shows them."""
    from cosytrt.runtime.scheduling import stage_clock
    from cosytrt.runtime.scheduling.stats import ARCounters
    from cosytrt.tools.bench.open_loop import _anatomy_line, stats_delta
    from cosytrt.tools.bench.report import _anatomy_cell

    class Event:
        done = False

        def __init__(self, enable_timing=False):
            assert enable_timing

        def record(self):
            pass

        def query(self):
            return Event.done

        def elapsed_time(self, end):
            return 4.0  # ms

    monkeypatch.setattr(stage_clock.torch.cuda, "Event", Event)
    c = ARCounters()
    t = stage_clock.StepTimer(True, c, every=2)
    toks = []
    for _ in range(4):
        tok = t.start()
        toks.append(tok)
        t.launched(tok)
        t.end(tok)
    assert [tok is not None for tok in toks] == [False, True, False, True]
    assert c.timed_steps == 0  # their end events have not completed: nothing read yet
    Event.done = True
    t.end(t.start())  # an untimed step settles what completed
    assert c.timed_steps == 2 and c.timed_gpu_s == pytest.approx(0.008)
    assert c.timed_launch_s >= 0 and c.timed_rest_s >= 0
    cpu = stage_clock.StepTimer(False, ARCounters(), every=1)
    assert cpu.start() is None
    before = {"ar": {"decode_steps": 10, "decode_rows": 20, "timed_steps": 1, "timed_launch_s": 0.001,
                     "timed_gpu_s": 0.002, "timed_rest_s": 0.003}}
    after = {"ar": {"decode_steps": 30, "decode_rows": 60, "timed_steps": 3, "timed_launch_s": 0.003,
                    "timed_gpu_s": 0.010, "timed_rest_s": 0.009}}
    ar = stats_delta(before, after, 1.0)["ar_steps"]
    assert ar["anatomy_ms"] == pytest.approx({"launch": 1.0, "gpu": 4.0, "rest": 3.0})
    assert _anatomy_cell(ar) == "1.00 / 4.00 / 3.00" and _anatomy_cell({}) == "—"
    assert "its GPU span 4.00 ms" in _anatomy_line(ar) and _anatomy_line(None) == ""
