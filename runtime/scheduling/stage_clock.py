"""Busy time per scheduler stage: which stage limits a workload.

Each worker wraps its batched work in `clock.span(stage)`. On CUDA a span is a pair of timing events recorded on the
worker's current stream, so it measures the GPU time from the first to the last kernel of the batch (including
time spent waiting behind other streams' kernels); on the CPU it is wall time. `busy_s()` adds up the spans whose
end event has completed (it never blocks), so a stage's busy seconds divided by the wall time of a workload is its
occupancy: near 1 for the stage that limits throughput. Stages run on different streams, so the occupancies of the
stages can sum to more than 1.

Beside it, every span's host side (`host_s()`): the worker thread's wall seconds inside its spans and its CPU seconds
there (`time.thread_time`). Wall minus CPU is time the thread was blocked inside its own batched work — waiting for
the interpreter lock, or descheduled — since a CUDA wait for the GPU spins (CPU time) on these machines: under load
the AR's host time per step, not the GPU, set its pace (BENCHMARKS.md runs 47 and 51-53), and this splits that host
time.
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
        self._host: dict[str, list[float]] = {}  # stage -> [wall s, thread CPU s, spans] inside its spans
        self._waits: dict[str, list[float]] = {}  # wait name -> [wall s, thread CPU s, count]

    @contextmanager
    def span(self, stage: str):
        t0, c0 = time.perf_counter(), time.thread_time()
        if not self.cuda:
            try:
                yield
            finally:
                self._add(stage, time.perf_counter() - t0)
                self._add_times(self._host, stage, t0, c0)
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            yield
        finally:
            end.record()
            self._add_times(self._host, stage, t0, c0)
            with self._lock:
                self._pending.setdefault(stage, deque()).append((start, end))
                self._settle(stage)  # a server that never asks must not collect events without bound

    @contextmanager
    def wait(self, name: str):
        """A worker thread's wait outside its spans (e.g. "dit_fence", "dit_idle"): its wall and CPU seconds (a CUDA
        wait spins: CPU) and how many, in `waits_s()`."""
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self._add_times(self._waits, name, t0, c0)

    def waits_s(self) -> dict[str, dict[str, float]]:
        """Per wait name: wall and CPU seconds and the number of waits so far."""
        with self._lock:
            return {n: {"wall_s": w[0], "cpu_s": w[1], "count": w[2]} for n, w in self._waits.items()}

    def _add_times(self, table: dict, key: str, t0: float, c0: float) -> None:
        """`table[key]` (= [wall s, thread CPU s, count]) += the wall and CPU seconds since `t0` / `c0`, and one."""
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        with self._lock:
            h = table.setdefault(key, [0.0, 0.0, 0])
            h[0] += wall
            h[1] += cpu
            h[2] += 1

    def host_s(self) -> dict[str, dict[str, float]]:
        """Per stage: the wall seconds its worker thread spent inside its spans and the thread's CPU seconds there."""
        with self._lock:
            return {s: {"wall_s": h[0], "cpu_s": h[1]} for s, h in self._host.items()}

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


class StepTimer:
    """The anatomy of every `every`-th AR decode step on CUDA, into `counters` (an ARCounters): the host seconds of
    the runner call (inputs up, the decode graph launched), the GPU seconds from just before that call to just after
    it (a timing event pair on the AR stream: the decode's kernels INCLUDING any time they wait for SMs that other
    streams' kernels hold) and the host seconds after it (sampling launched, the wait for the ids, bookkeeping). Why:
    under load the AR's step took 6.5 ms with ~1.3 ms of its kernels' own time (run 68); whether the rest is the GPU
    (kernels waiting to run) or the host (launches, the interpreter lock) decides what to fix. Settles events only
    once they completed (never blocks); steps it skips cost nothing."""

    def __init__(self, cuda: bool, counters, every: int = 8):
        self.cuda, self.counters, self.every = cuda, counters, every
        self._n = 0
        self._pending: deque = deque()  # (start event, end event, launch s, rest s)

    def start(self):
        """A token for this step (None: not timed)."""
        if not self.cuda:
            return None
        self._n += 1
        if self._n % self.every:
            return None
        e0 = torch.cuda.Event(enable_timing=True)
        e0.record()
        return [time.perf_counter(), e0, None, 0.0]

    def launched(self, tok) -> None:
        """The runner call returned (on the AR thread, its stream current)."""
        if tok is not None:
            tok[2] = torch.cuda.Event(enable_timing=True)
            tok[2].record()
            tok[3] = time.perf_counter()

    def end(self, tok) -> None:
        """The step's tokens are booked."""
        if tok is not None and tok[2] is not None:
            self._pending.append((tok[1], tok[2], tok[3] - tok[0], time.perf_counter() - tok[3]))
        while self._pending and self._pending[0][1].query():
            e0, e1, launch, rest = self._pending.popleft()
            c = self.counters  # written by the AR thread only
            c.timed_steps += 1
            c.timed_launch_s += launch
            c.timed_gpu_s += e0.elapsed_time(e1) / 1e3
            c.timed_rest_s += rest

