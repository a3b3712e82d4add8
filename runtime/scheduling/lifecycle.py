"""Request lifecycle shared by every wiring of the workers (the scheduler, the cluster's stages): admission on submit
(asks the `AdmissionControl` of admission.py, unless the caller holds a ticket), the live requests, finishing /
failing / cancelling them exactly once, drain on close, and the frontend thread pool that prepares a request before its first stage."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from ...engines.errors import InputError, RejectedError
from .admission import AdmissionControl, Ticket
from .config import SchedulerConfig
from .handle import RequestHandle
from .policies import playback_slack
from ..stages.request import Request, RequestMetrics
from .state import RequestState


class Lifecycle:
    """The live requests of one scheduler. `on_finish(metrics)` is called once per request when it completes, fails
    or is cancelled; `on_dead(r)` right after a request finished (workers drop its jobs, free its KV slot).
    `admission`: the control deciding admission (default: one from `config`; a TTS passes its own, which the server
    also asks)."""

    def __init__(self, config: SchedulerConfig, on_finish: Callable[[RequestMetrics], None] | None = None,
                 on_dead: Callable[[RequestState], None] | None = None, admission: AdmissionControl | None = None):
        self.config = config
        self.on_finish = on_finish
        self.on_dead = on_dead
        self.admission = admission if admission is not None else AdmissionControl.from_config(config)
        self.lock = threading.Lock()
        self.space = threading.Condition(self.lock)  # notified when a request finishes (drain waits on it)
        self.live: dict[int, RequestState] = {}
        self.tickets: dict[int, Ticket] = {}  # the admission ticket each request took (none under a lease)
        self.in_flight = 0
        self.closing = False
        self.dead: str | None = None  # why a worker thread died (the scheduler is then unhealthy)
        self.counts = dict(completed=0, failed=0, cancelled=0, rejected=0)
        # load shedding (shed_lag_s): the admission control asks this lifecycle whether the runtime is overloaded
        self.admission.overload = self.overload_reason if config.shed_lag_s > 0 else None

    def admit(self, req: Request, inputs=None, lease: Ticket | None = None, after=None) -> RequestState:
        """A new request's state (and handle) once admission grants a slot; RejectedError when closed, full
        (QueueFullError) or no slot freed in time (AdmissionTimeoutError). Under `lease` (a ticket of the same
        admission control, held by the caller) the request takes no slot of its own."""
        if not isinstance(req, Request):
            raise InputError(f"Scheduler.submit takes a Request, got {type(req).__name__}")
        what = f"request {req.request_id}"
        if lease is not None and (not isinstance(lease, Ticket) or lease.control is not self.admission
                                  or lease.released):
            raise InputError(f"{what}: lease must be an unreleased ticket of this scheduler's admission control")
        if self.closing:
            raise RejectedError(f"{what}: the scheduler is closed")
        ticket = None
        if lease is None:
            try:  # a conversation's next sentence (`after`) is not shed
                ticket = self.admission.admit(what, shed=after is None)
            except RejectedError:
                with self.lock:
                    self.counts["rejected"] += 1
                raise
        m = RequestMetrics(request_id=req.request_id, stream=req.stream, buffered_s=req.buffered_s,
                           follows=getattr(after, "metrics", None))
        with self.space:
            if self.closing:
                self.counts["rejected"] += 1
                if ticket is not None:
                    ticket.release()
                raise RejectedError(f"{what}: the scheduler is closed")
            self.in_flight += 1
            r = RequestState(req, RequestHandle(req, m, self.cancel), inputs)
            self.live[id(r.handle)] = r
            if ticket is not None:
                self.tickets[id(r.handle)] = ticket
        return r

    def worst_stream_lag(self, now: float | None = None) -> float:
        """How far the live stream furthest behind its listener is, in seconds (0 when none is behind): minus its
        playback slack (`policies.playback_slack`: before its first chunk, how long its listener has waited for
        it; after, the audio it still owes the time played)."""
        now = time.perf_counter() if now is None else now
        with self.lock:
            streams = [r.metrics for r in self.live.values() if r.metrics.stream]
        return max([0.0] + [-playback_slack(m, now) for m in streams])

    def overload_reason(self) -> str | None:
        """Load shedding (`SchedulerConfig.shed_lag_s` > 0; the admission control's `overload` hook): why a new
        request should be refused now — a live stream more than shed_lag_s behind its listener — or None."""
        limit = self.config.shed_lag_s
        lag = self.worst_stream_lag() if limit > 0 else 0.0
        if lag > limit > 0:
            return (f"the runtime is overloaded: a stream in flight is {lag:.2f} s behind its listener "
                    f"(shed_lag_s {limit:g}); retry later")
        return None

    def get(self, handle: RequestHandle) -> RequestState | None:
        return self.live.get(id(handle))

    def cancel(self, handle: RequestHandle) -> None:
        r = self.live.get(id(handle))
        if r is not None:
            self.finish(r, RejectedError(f"request {handle.request_id} was cancelled"), cancelled=True)

    def finish(self, r: RequestState, error: BaseException | None, cancelled: bool = False) -> None:
        """Complete (error None) or fail one request; the first call wins."""
        m = r.metrics

        def stamp():
            m.total = time.perf_counter() - m.t_submit
            if error is not None:
                m.error = f"{type(error).__name__}: {error}"
        if not r.handle._finish(error, stamp):
            return
        with self.space:
            self.live.pop(id(r.handle), None)
            ticket = self.tickets.pop(id(r.handle), None)
            self.in_flight -= 1
            self.counts["cancelled" if cancelled else "failed" if error is not None else "completed"] += 1
            self.space.notify_all()
        if ticket is not None:
            ticket.release()
        if self.on_dead is not None:
            self.on_dead(r)
        if self.on_finish is not None:
            self.on_finish(m)

    def drain(self, timeout_s: float) -> None:
        """Stop accepting requests, wait up to `timeout_s` for in-flight ones, fail the rest with RejectedError."""
        with self.space:
            self.closing = True
            self.space.notify_all()
            self.space.wait_for(lambda: self.in_flight == 0, timeout_s)
            left = list(self.live.values())
        for r in left:
            self.finish(r, RejectedError(f"request {r.req.request_id}: the scheduler closed before it finished"))

    def fail_all(self, error: BaseException, dead: str | None = None) -> None:
        """A worker died (`dead`: why): reject later submits and fail every live request (nobody must wait
        forever)."""
        with self.space:
            self.closing = True
            if dead is not None:
                self.dead = dead
            self.space.notify_all()
        for r in list(self.live.values()):
            self.finish(r, error)


class FrontendPool:
    """A small thread pool running `prepare(r)` (tokenizer, prompt features, LM input) for each submitted request,
    then `ready(r)`; a failure fails that request alone (`finish(r, error)`)."""

    def __init__(self, workers: int, prepare: Callable[[RequestState], None], ready: Callable[[RequestState], None],
                 finish: Callable[[RequestState, BaseException | None], None]):
        self.prepare, self.ready, self.finish = prepare, ready, finish
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="cosytrt-frontend")
        self.lock = threading.Lock()
        self.pending = 0

    def submit(self, r: RequestState) -> None:
        with self.lock:
            self.pending += 1
        try:
            self.pool.submit(self._run, r)
        except RuntimeError:  # the pool was shut down by a close() that gave up draining
            with self.lock:
                self.pending -= 1
            err = RejectedError(f"request {r.req.request_id}: the scheduler is closed")
            self.finish(r, err)
            raise err from None

    def _run(self, r: RequestState) -> None:
        try:
            if r.dead:
                return
            self.prepare(r)
            self.ready(r)
        except BaseException as e:
            self.finish(r, e)
        finally:
            with self.lock:
                self.pending -= 1

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
