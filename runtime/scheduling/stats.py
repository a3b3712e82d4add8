"""Typed scheduler statistics. `SchedulerStats.to_dict()` gives the nested dict that `Scheduler.stats()` returns
(the keys metrics export, the server and the benchmarks read)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class ARCounters:
    """AR worker: batched prefills and decode steps."""
    prefill_calls: int = 0
    prefill_rows: int = 0
    decode_steps: int = 0
    decode_rows: int = 0
    max_decode_batch: int = 0
    batched_decode_steps: int = 0
    first_audio_holds: int = 0        # waits (<= 1 ms each) instead of a decode step, for a stream's first audio
    #                                   (ar_first_audio_hold_ms); first_audio_hold_s: their seconds
    first_audio_hold_s: float = 0.0
    pace_waits: int = 0               # waits instead of a decode step while every stream was far enough ahead of its
    pace_wait_s: float = 0.0          # listener (ar_pace_lead_s); pace_wait_s: their seconds
    multi_step_calls: int = 0         # runner calls of ar_decode_steps steps each (their steps count in decode_steps)
    # every 8th single decode step on CUDA (stage_clock.StepTimer): how many, and their seconds in the runner call
    # (host), on the GPU from just before to just after that call (its kernels and their waits for SMs), and on the
    # host after it (sampling, the wait for the ids, bookkeeping; with ar_graph_sampling the runner call itself
    # samples and reads the ids back, so its wait counts in the call)
    timed_steps: int = 0
    timed_launch_s: float = 0.0
    timed_gpu_s: float = 0.0
    timed_rest_s: float = 0.0

    def prefill(self, rows: int) -> None:
        self.prefill_calls += 1
        self.prefill_rows += rows

    def hold(self, seconds: float) -> None:
        self.first_audio_holds += 1
        self.first_audio_hold_s += seconds

    def pace(self, seconds: float) -> None:
        self.pace_waits += 1
        self.pace_wait_s += seconds

    def decode(self, rows: int) -> None:
        self.decode_steps += 1
        self.decode_rows += rows
        self.max_decode_batch = max(self.max_decode_batch, rows)
        self.batched_decode_steps += rows > 1


@dataclass
class BatchCounters:
    """A stage's batched calls: how many, how many rows in all, the largest."""
    calls: int = 0
    rows: int = 0
    max_batch: int = 0

    def add(self, rows: int) -> None:
        self.calls += 1
        self.rows += rows
        self.max_batch = max(self.max_batch, rows)


@dataclass
class DitCounters(BatchCounters):
    """DiT calls, plus frames per CFG row: of whole-history rows (the flow prefix cache counts its own), and per
    kind of call ("cached" hops, whole-history "stream" hops, "offline" finals; a "/step" suffix under step-level
    scheduling, where a call is one Euler step) its calls and rows."""
    frames_uncached: int = 0
    kinds: dict = field(default_factory=dict)
    # streams whose flow prefix was freed as soon as their final was the next job queued with no hop of theirs in
    # flight (the final is a full-attention pass that does not read it), instead of when the final started
    prefixes_freed_early: int = 0

    def call(self, kind: str, rows: int, n: int = 1, steps: bool = False) -> None:
        k = kind + ("/step" if steps else "")
        c = self.kinds.setdefault(k, {"calls": 0, "rows": 0})
        c["calls"] += n
        c["rows"] += rows


@dataclass
class QueueDepths:
    """Requests / jobs in each named queue (see scheduler.py)."""
    frontend: int = 0     # submitted, frontend work not done
    ar_waiting: int = 0   # admission queue
    ar_running: int = 0   # decoding in a KV slot
    dit: int = 0          # DiT jobs queued
    hift: int = 0         # vocoder jobs queued
    output: int = 0       # chunks whose device-to-host copy is in flight


@dataclass
class SchedulerStats:
    in_flight: int = 0
    closing: bool = False
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    rejected: int = 0
    shed: int = 0                   # refused by load shedding (SchedulerConfig.shed_lag_s; admission's count)
    stream_lag_s: float = 0.0       # the live stream furthest behind its listener, seconds (Lifecycle.worst_stream_lag)
    admission: dict = field(default_factory=dict)   # the admission control's slots, waiters, limits, counts
    queues: QueueDepths = field(default_factory=QueueDepths)
    ar_runner: dict = field(default_factory=dict)   # the runner's own numbers (slots, graph replays, ...)
    ar: ARCounters = field(default_factory=ARCounters)
    dit: DitCounters = field(default_factory=DitCounters)
    hift: BatchCounters = field(default_factory=BatchCounters)
    shapes: dict | None = None                      # engine calls: bucket hits / padding / eager fallbacks
    compiles_since_start: int = 0                   # torch.compile graphs compiled while serving (expected 0)
    busy_s: dict = field(default_factory=dict)      # busy seconds per stage (stage_clock)
    host_s: dict = field(default_factory=dict)      # per stage: its thread's wall / CPU seconds in its spans
    waits_s: dict = field(default_factory=dict)     # per wait (StageClock.wait): wall / CPU seconds, count
    flow_cache: dict = field(default_factory=dict)  # the flow prefix cache pool's numbers (stages/flow_cache.py)
    setup_s: dict = field(default_factory=dict)     # seconds of the scheduler's start, by part (Scheduler.__init__)
    sm_partition: dict | None = None                # dit_green_reserve_sms: the DiT / HiFT streams' SMs, the device's

    def to_dict(self) -> dict:
        out = {"in_flight": self.in_flight, "closing": self.closing, "completed": self.completed,
               "failed": self.failed, "cancelled": self.cancelled, "rejected": self.rejected, "shed": self.shed,
               "stream_lag_s": round(self.stream_lag_s, 3),
               "admission": self.admission,
               "queues": dataclasses.asdict(self.queues), "ar": {**self.ar_runner, **dataclasses.asdict(self.ar)},
               "dit": dataclasses.asdict(self.dit), "hift": dataclasses.asdict(self.hift)}
        # DiT frames per CFG row and Euler step: computed (whole-history rows + cached hops' new frames), reused from
        # the flow prefix cache, hops that fell back (pool full)
        fc = self.flow_cache
        uncached = out["dit"].pop("frames_uncached")
        out["dit"].update(frames_computed=uncached + fc.get("frames_computed", 0),
                          frames_reused=fc.get("frames_reused", 0), cache_fallbacks=fc.get("fallback_hops", 0),
                          flow_cache=fc)
        if self.shapes is not None:
            out["shapes"] = self.shapes
        out["compiles_since_start"] = self.compiles_since_start
        out["busy_s"] = self.busy_s
        out["host_s"] = self.host_s
        out["waits_s"] = self.waits_s
        out["setup_s"] = self.setup_s
        if self.sm_partition is not None:
            out["sm_partition"] = self.sm_partition
        return out
