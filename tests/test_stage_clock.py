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
