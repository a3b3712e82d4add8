"""Admission control: the one place that decides whether a request may use the runtime now.

Every way into the runtime asks it: `Scheduler.submit` (through the Lifecycle) for a plain request, and the HTTP
server for each speech request and voice upload (`TTS.admission`; its `--max-in-flight`, `--max-queue` and
`--queue-timeout` configure it). A granted slot is a `Ticket`; a caller holding one (the server, for an HTTP request
that runs as one runtime request per sentence) passes it to `TTS.submit(..., lease=ticket)` so those requests do not
take further slots.

    ticket = admission.admit()                 # threads: waits (FIFO) up to timeout_s
    ticket = await admission.admit_async()     # event loops: the same queue, no thread held while waiting
    ticket.release()                           # idempotent

Refusals are RejectedError subclasses, so callers map them without knowing the limits: `QueueFullError` (every slot
held and `max_waiting` callers already waiting, or `on_full="reject"`: refused at once), `AdmissionTimeoutError` (no
slot freed within `timeout_s`), `OverloadedError` (load shedding: the `overload` hook — set by a scheduler with
`SchedulerConfig.shed_lag_s`, `Lifecycle.overload_reason` — names a reason, and a caller that may be shed is refused
at once, before it takes a slot or a place in the queue). Thread-safe; one instance may serve several event loops
and threads."""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque

from ...engines.errors import InputError, RejectedError


class QueueFullError(RejectedError):
    """Refused at once: every slot is held and no more callers may wait."""


class AdmissionTimeoutError(RejectedError):
    """No slot became free within the admission timeout."""


class OverloadedError(RejectedError):
    """Refused at once: the runtime is overloaded (a live stream is behind its listener, `shed_lag_s`)."""


class Ticket:
    """One admitted slot; `release()` gives it back (the first call wins). `waited`: seconds spent waiting."""

    __slots__ = ("control", "waited", "_released")

    def __init__(self, control: "AdmissionControl", waited: float = 0.0):
        self.control, self.waited, self._released = control, waited, False

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        self.control._release(self)


class _Waiter:
    __slots__ = ("wake", "ticket", "t0")

    def __init__(self, wake):
        self.wake, self.ticket, self.t0 = wake, None, time.perf_counter()


class AdmissionControl:
    """At most `max_in_flight` tickets out; up to `max_waiting` callers (None: any number) wait in arrival order, each
    at most `timeout_s` seconds. `on_full="reject"` refuses at once instead of waiting."""

    def __init__(self, max_in_flight: int, max_waiting: int | None = None, timeout_s: float = 30.0,
                 on_full: str = "wait"):
        self._lock = threading.Lock()
        self.in_flight = 0
        self._waiters: deque[_Waiter] = deque()
        self.counts = dict(admitted=0, queue_full=0, timed_out=0, shed=0)
        # load shedding: a callable returning why the runtime is overloaded now (or None), asked by `admit` /
        # `admit_async` for callers that may be shed (set by the scheduler's Lifecycle; None: never shed)
        self.overload = None
        self.max_in_flight, self.max_waiting, self.timeout_s, self.on_full = 1, None, 30.0, "wait"
        self.configure(max_in_flight=max_in_flight, max_waiting=max_waiting, timeout_s=timeout_s, on_full=on_full)

    @classmethod
    def from_config(cls, config) -> "AdmissionControl":
        """From a SchedulerConfig (max_in_flight, max_waiting, submit_timeout_s, on_full)."""
        return cls(config.max_in_flight, config.max_waiting, config.submit_timeout_s, config.on_full)

    @property
    def limits(self) -> dict:
        return dict(max_in_flight=self.max_in_flight, max_waiting=self.max_waiting, timeout_s=self.timeout_s,
                    on_full=self.on_full)

    def configure(self, **limits) -> dict:
        """Change limits (max_in_flight, max_waiting, timeout_s, on_full); returns the previous ones. A larger
        `max_in_flight` admits waiting callers at once."""
        unknown = set(limits) - {"max_in_flight", "max_waiting", "timeout_s", "on_full"}
        if unknown:
            raise InputError(f"unknown admission limit(s): {sorted(unknown)}")
        old = self.limits
        new = {**old, **limits}
        n, w, t, full = new["max_in_flight"], new["max_waiting"], new["timeout_s"], new["on_full"]
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise InputError(f"admission max_in_flight must be a positive int, got {n!r}")
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 0):
            raise InputError(f"admission max_waiting must be None or an int >= 0, got {w!r}")
        if not isinstance(t, (int, float)) or isinstance(t, bool) or t < 0:
            raise InputError(f"admission timeout_s must be a number >= 0, got {t!r}")
        if full not in ("wait", "reject"):
            raise InputError(f"admission on_full must be 'wait' or 'reject', got {full!r}")
        with self._lock:
            self.max_in_flight, self.max_waiting, self.timeout_s, self.on_full = n, w, float(t), full
            woken = self._grant_locked()
        for waiter in woken:
            waiter.wake()
        return old

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def snapshot(self) -> dict:
        with self._lock:
            return {"in_flight": self.in_flight, "waiting": len(self._waiters), **self.limits, **self.counts}

    # ------------------------------------------------------------------ admitting
    def _refusal(self, what: str) -> RejectedError:
        self.counts["queue_full"] += 1
        return QueueFullError(f"{what}: too many requests: {self.in_flight} in flight and {len(self._waiters)} "
                              f"waiting (max_in_flight={self.max_in_flight}, max_waiting={self.max_waiting})")

    def _free_ticket_locked(self) -> Ticket | None:
        """A ticket if a slot is free and nobody waits for one (they come first), else None."""
        if self.in_flight < self.max_in_flight and not self._waiters:
            self.in_flight += 1
            self.counts["admitted"] += 1
            return Ticket(self)
        return None

    def _enter_locked(self, what: str, wake) -> Ticket | _Waiter:
        """A ticket at once, a queued waiter, or raise QueueFullError."""
        ticket = self._free_ticket_locked()
        if ticket is not None:
            return ticket
        if self.on_full == "reject" or (self.max_waiting is not None and len(self._waiters) >= self.max_waiting):
            raise self._refusal(what)
        waiter = _Waiter(wake)
        self._waiters.append(waiter)
        return waiter

    def _give_up_locked(self, waiter: _Waiter, what: str, timeout: float) -> Ticket:
        """The waiter's ticket if it was granted meanwhile, else it leaves the queue and AdmissionTimeoutError."""
        if waiter.ticket is not None:
            return waiter.ticket
        self._waiters.remove(waiter)
        self.counts["timed_out"] += 1
        raise AdmissionTimeoutError(f"{what}: no slot became free within {timeout:g} s "
                                    f"(max_in_flight={self.max_in_flight})")

    def _finish_wait(self, waiter: _Waiter) -> Ticket:
        waiter.ticket.waited = time.perf_counter() - waiter.t0
        return waiter.ticket

    def _check_overload(self, what: str) -> None:
        """OverloadedError when the `overload` hook names a reason (asked outside this control's lock)."""
        check = self.overload
        reason = check() if check is not None else None
        if reason:
            with self._lock:
                self.counts["shed"] += 1
            raise OverloadedError(f"{what}: {reason}")

    def admit(self, what: str = "request", timeout: float | None = None, shed: bool = True) -> Ticket:
        """A ticket, waiting (this thread) up to `timeout` (default `timeout_s`) seconds for one. `shed`: this caller
        may be refused by load shedding (not: a later part of work already admitted, e.g. a conversation's next
        sentence)."""
        if shed:
            self._check_overload(what)
        event = threading.Event()
        with self._lock:
            got = self._enter_locked(what, event.set)
            timeout = self.timeout_s if timeout is None else timeout
        if isinstance(got, Ticket):
            return got
        if not event.wait(timeout):
            with self._lock:
                self._give_up_locked(got, what, timeout)
        return self._finish_wait(got)

    def try_admit(self) -> Ticket | None:
        """A ticket if one is free now and nobody waits for one, else None (nothing queued, nothing counted as a
        refusal): for optional work such as synthesising a session's next sentence ahead."""
        with self._lock:
            return self._free_ticket_locked()

    async def admit_async(self, what: str = "request", timeout: float | None = None, shed: bool = True) -> Ticket:
        """`admit` for a coroutine: waits on the event loop (no thread held). Cancelling it while it waits leaves
        the queue (or gives back a ticket granted meanwhile)."""
        if shed:
            self._check_overload(what)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def wake():
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(None))

        with self._lock:
            got = self._enter_locked(what, wake)
            timeout = self.timeout_s if timeout is None else timeout
        if isinstance(got, Ticket):
            return got
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            with self._lock:
                self._give_up_locked(got, what, timeout)
        except BaseException:  # cancelled while waiting
            with self._lock:
                granted = got.ticket
                if granted is None:
                    self._waiters.remove(got)
            if granted is not None:
                granted.release()
            raise
        return self._finish_wait(got)

    # ------------------------------------------------------------------ releasing
    def _grant_locked(self) -> list[_Waiter]:
        woken = []
        while self._waiters and self.in_flight < self.max_in_flight:
            waiter = self._waiters.popleft()
            self.in_flight += 1
            self.counts["admitted"] += 1
            waiter.ticket = Ticket(self)
            woken.append(waiter)
        return woken

    def _release(self, ticket: Ticket) -> None:
        with self._lock:
            if ticket._released:
                return
            ticket._released = True
            self.in_flight -= 1
            woken = self._grant_locked()
        for waiter in woken:
            waiter.wake()
