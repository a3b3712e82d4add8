"""Server-side admission control: the one place that decides whether a request may use the runtime now.

Kept small and self-contained so it can be swapped for the scheduler's own admission (the scheduler has its own
`max_in_flight`); speech requests and voice uploads (speaker extraction runs the frontend models) both go through
it."""
from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

from .errors import APIError


class Admission:
    """At most `max_in_flight` admitted requests; up to `max_queue` more wait (429 beyond), each at most
    `timeout` seconds (503 then). Lives on one event loop; create it there."""

    def __init__(self, max_in_flight: int, max_queue: int, timeout: float):
        self.max_in_flight, self.max_queue, self.timeout = max_in_flight, max_queue, timeout
        self.in_flight = 0
        self.waiting = 0
        self._sem = asyncio.Semaphore(max_in_flight)

    async def acquire(self) -> float:
        """Wait for a slot; returns the seconds waited."""
        t0 = time.perf_counter()
        if self._sem.locked() or self.waiting:
            if self.waiting >= self.max_queue:
                raise APIError(429, f"too many requests: {self.in_flight} in flight and {self.waiting} waiting "
                                    f"(limits {self.max_in_flight} / {self.max_queue})", code="too_many_requests",
                               headers={"Retry-After": "1"})
            self.waiting += 1
            try:
                await asyncio.wait_for(self._sem.acquire(), self.timeout)
            except asyncio.TimeoutError:
                raise APIError(503, f"no synthesis slot became free within {self.timeout:g} s",
                               code="queue_timeout", headers={"Retry-After": "1"}) from None
            finally:
                self.waiting -= 1
        else:
            await self._sem.acquire()
        self.in_flight += 1
        return time.perf_counter() - t0

    def release(self) -> None:
        self.in_flight -= 1
        self._sem.release()

    @asynccontextmanager
    async def slot(self):
        """`async with admission.slot():` for work that is not a speech job (voice uploads)."""
        await self.acquire()
        try:
            yield
        finally:
            self.release()
