"""The cluster's stage engines: the scheduler's AR worker and token2wav worker, each wired alone with a remote side.

* `ARStage`: the AR worker whose token sink is a token stream (`TokenStream`): each request's handle yields int64
  arrays of new speech tokens, flushed where token2wav can use them (the hop points of streaming, or once at the end).
* `Token2WavStage`: the token2wav worker fed by a remote token source: `open(req, inputs)` -> handle (PCM chunks),
  then `feed(handle, tokens)` as tokens arrive and `feed(handle, None, final=True)` when the LM is done. Its DiT jobs
  are made by the same worker code as in one process, so the audio is the same.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ...engines.errors import InputError
from ..models.frontend import LMRequestInputs
from ..scheduling.ar_worker import ARWorker
from ..scheduling.config import SchedulerConfig
from ..scheduling.handle import RequestHandle
from ..scheduling.lifecycle import FrontendPool, Lifecycle
from ..scheduling.prepare import ar_side, flow_prompt
from ..stages.request import Request
from ..scheduling.scheduler import collect_stats, make_ar_runner, start_workers
from ..scheduling.stage_clock import StageClock
from ..scheduling.state import RequestState
from ..scheduling.token2wav_worker import Token2WavWorker
from ..stages.hop_schedule import HopSchedule


def hop_flush_points(prompt_tokens: int):
    """Token counts at which a streaming request's hops fire: first hop + look-ahead, then hops of 50, 100, ..."""
    hops = HopSchedule(prompt_tokens)
    while True:
        yield hops.next_fire()
        hops.advance()


def _check_inputs(req: Request, inputs) -> None:
    if inputs is None:
        raise InputError(f"request {req.request_id}: a stage request needs the frontend's LM inputs")


class TokenStream:
    """The AR worker's sink in an AR replica: new tokens go to the request's handle as int64 arrays at its flush
    points (`RequestState.flush`, the hop schedule of streaming) or at the end; the request then completes."""

    def __init__(self, finish):
        self.finish = finish

    def tokens(self, r: RequestState, done: bool) -> None:
        if done:
            r.metrics.tokens = len(r.tokens)
            r.handle.tokens = list(r.tokens)
        ids = r.take_flushed(done)
        if ids:
            r.handle._put(np.asarray(ids, dtype=np.int64))
        if done:
            self.finish(r, None)

    def flush(self) -> None:
        pass


class ARStage:
    """The AR worker alone: `submit_inputs(req, inputs)` takes the frontend's output; the handle's chunks are int64
    arrays of new speech tokens."""

    def __init__(self, pipeline, config: SchedulerConfig | None = None, runner=None):
        self.config = cfg = config or SchedulerConfig()
        self.lm = pipeline.models.llm
        self.device = torch.device(pipeline.device)
        self.runner = runner or make_ar_runner(pipeline.models, cfg, self.device, pipeline.backends.engine_set)
        self.clock = StageClock(self.device.type == "cuda")
        self.requests = Lifecycle(cfg, on_dead=lambda r: self.ar.wake())
        self.ar = ARWorker(self.runner, cfg, TokenStream(self.requests.finish), self.requests.finish, self.clock,
                           self.device)
        self.frontend = FrontendPool(cfg.frontend_workers, self._prepare, self.ar.put, self.requests.finish)
        self._threads = start_workers([("ar", self.ar.loop)], self.requests)

    def submit_inputs(self, req: Request, inputs: LMRequestInputs) -> RequestHandle:
        _check_inputs(req, inputs)
        r = self.requests.admit(req, inputs)
        self.frontend.submit(r)
        return r.handle

    def _prepare(self, r: RequestState) -> None:  # the frontend ran remotely: only the LM input and policy here
        t0 = time.perf_counter()
        ar_side(r, r.inputs, self.lm, self.runner, self.device, slots_name="the AR replica's KV-cache slots",
                setting="scheduler.ar_max_len of the AR stage")
        r.metrics.t_tokenizer = time.perf_counter() - t0

    def stats(self) -> dict:
        return collect_stats(self.requests, self.frontend, self.clock, ar=self.ar).to_dict()

    def close(self, drain_timeout_s: float = 30.0) -> None:
        self.requests.drain(drain_timeout_s)
        self.ar.stop()
        for t in self._threads:
            t.join(timeout=10)
        self.frontend.shutdown()
        self.runner.close()


@dataclass
class _Feed:
    """A token2wav request's remote token source: tokens received before its stream state was ready, the end."""
    pending: list = field(default_factory=list)
    prepared: bool = False
    lm_done: bool = False
    final_queued: bool = False


class Token2WavStage:
    """The token2wav worker fed with speech tokens from outside (see module docstring)."""

    def __init__(self, pipeline, config: SchedulerConfig | None = None, backends=None):
        self.config = cfg = config or SchedulerConfig()
        self.pipeline = pipeline
        self.device = torch.device(pipeline.device)
        self.clock = StageClock(self.device.type == "cuda")
        self.backends = backends if backends is not None else pipeline.backends
        self._lock = threading.RLock()
        self._feeds: dict[int, _Feed] = {}  # live requests by id(handle)
        self._open: set[int] = set()        # requests whose final DiT job is not queued yet (read without the lock)
        self.requests = Lifecycle(cfg, on_dead=self._forget)
        self.worker = Token2WavWorker(pipeline.models, self.backends, cfg, pipeline.sample_rate, self.device,
                                      self.clock, self.requests.finish, more_tokens=self._more_tokens)
        self.frontend = FrontendPool(cfg.frontend_workers, self._prepare, self._prepared, self.requests.finish)
        self._threads = start_workers([("dit", self.worker.dit_loop), ("hift", self.worker.hift_loop)],
                                      self.requests)

    def open(self, req: Request, inputs: LMRequestInputs) -> RequestHandle:
        _check_inputs(req, inputs)
        self.pipeline._check_noise(inputs, req)  # RequestTooLongError before any model work
        r = self.requests.admit(req, inputs)
        with self._lock:
            self._feeds[id(r.handle)] = _Feed()
            self._open.add(id(r.handle))
        self.frontend.submit(r)
        return r.handle

    def feed(self, handle: RequestHandle, tokens, final: bool = False, ar_metrics: dict | None = None) -> None:
        r = self.requests.get(handle)
        if r is None:
            return
        with self._lock:
            f = self._feeds.get(id(handle))
            if f is None:
                return
            if tokens is not None:
                f.pending.extend(int(t) for t in np.asarray(tokens).reshape(-1))
            if ar_metrics:
                r.metrics.t_ar = float(ar_metrics.get("t_ar", 0.0))
                r.metrics.t_queue = float(ar_metrics.get("t_queue", 0.0))
            if final:
                f.lm_done = True
            self._queue_jobs(r, f)

    def fail(self, handle: RequestHandle, error: BaseException) -> None:
        r = self.requests.get(handle)
        if r is not None:
            self.requests.finish(r, error)

    def stats(self) -> dict:
        return collect_stats(self.requests, self.frontend, self.clock, t2w=self.worker,
                             backends=self.backends).to_dict()

    def close(self, drain_timeout_s: float = 30.0) -> None:
        self.requests.drain(drain_timeout_s)
        self.worker.stop()
        for t in self._threads:
            t.join(timeout=10)
        self.frontend.shutdown()

    # ---------------------------------------------------------------- internals
    def _prepare(self, r: RequestState) -> None:  # the flow prompt onto the device and the stream state
        flow_prompt(r, r.inputs, self.device)
        self.worker.start(r)

    def _prepared(self, r: RequestState) -> None:
        with self._lock:
            f = self._feeds.get(id(r.handle))
            if f is not None:
                f.prepared = True
                self._queue_jobs(r, f)

    def _queue_jobs(self, r: RequestState, f: _Feed) -> None:
        """The hops now due and the final call, into the DiT queue (under the lock: a request's jobs stay in order)."""
        if not f.prepared or r.dead:
            return
        r.tokens.extend(f.pending)
        f.pending.clear()
        done = f.lm_done and not f.final_queued
        if done:
            f.final_queued = True
            self._open.discard(id(r.handle))
        self.worker.tokens(r, done)
        self.worker.flush()

    def _forget(self, r: RequestState) -> None:
        with self._lock:
            self._feeds.pop(id(r.handle), None)
            self._open.discard(id(r.handle))

    def _more_tokens(self) -> bool:
        """More DiT jobs can come while a request still expects tokens. Called by the DiT thread under its queue's
        lock, so it takes no lock itself (feed holds the lock while it queues DiT jobs)."""
        return bool(self.frontend.pending or self._open)
