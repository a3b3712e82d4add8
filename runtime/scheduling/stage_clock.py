"""Busy time per scheduler stage: which stage limits a workload.

Each worker wraps its batched work in `clock.span(stage)`. On CUDA a span is a pair of timing events recorded on the
worker's current stream, so it measures the GPU time from the first to the last kernel of the batch (including
time spent waiting behind other streams' kernels); on the CPU it is wall time. `busy_s()` adds up the spans whose
end event has completed (it never blocks), so a stage's busy seconds divided by the wall time of a workload is its
occupancy: near 1 for the stage that limits throughput. Stages run on different streams, so the occupancies of the
stages can sum to more than 1.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import contextmanager

import torch


class StageClock:
    def __init__(self, cuda: bool):
        self.cuda = cuda
        self._lock = threading.Lock()
        self._busy: dict[str, float] = {}
        self._spans: dict[str, int] = {}
        self._pending: dict[str, deque] = {}   # stage -> (start, end) CUDA events, in recording order

    @contextmanager
    def span(self, stage: str):
        if not self.cuda:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self._add(stage, time.perf_counter() - t0)
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            yield
        finally:
            end.record()
            with self._lock:
                self._pending.setdefault(stage, deque()).append((start, end))
                self._settle(stage)  # a server that never asks must not collect events without bound

    def _add(self, stage: str, seconds: float) -> None:
        with self._lock:
            self._busy[stage] = self._busy.get(stage, 0.0) + seconds
            self._spans[stage] = self._spans.get(stage, 0) + 1

    def _settle(self, stage: str) -> None:
        """Add up the stage's spans whose end event has completed (in recording order; caller holds the lock)."""
        q = self._pending[stage]
        while q and q[0][1].query():
            start, end = q.popleft()
            self._busy[stage] = self._busy.get(stage, 0.0) + start.elapsed_time(end) / 1e3
            self._spans[stage] = self._spans.get(stage, 0) + 1

    def pending(self) -> int:
        """CUDA spans recorded but not yet completed on the GPU."""
        with self._lock:
            return sum(len(q) for q in self._pending.values())

    def busy_s(self) -> dict[str, float]:
        """Busy seconds per stage so far (CUDA: the spans completed on the GPU)."""
        with self._lock:
            for stage in self._pending:
                self._settle(stage)
            return dict(self._busy)

    def spans(self) -> dict[str, int]:
        with self._lock:
            return dict(self._spans)


def occupancy(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict[str, float]:
    """Busy fraction of each stage over a workload of `wall_s` seconds, from two `busy_s()` snapshots."""
    if wall_s <= 0:
        return {}
    return {s: (after[s] - before.get(s, 0.0)) / wall_s for s in sorted(after)}
