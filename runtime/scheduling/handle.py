"""RequestHandle: the caller's side of one scheduled request (its PCM chunks in order, its metrics, cancel)."""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Callable, Iterator

import numpy as np

from ..stages.request import Request, RequestMetrics


class RequestHandle:
    """The caller's side of one request: its PCM chunks (float32, in order), its metrics, cancel."""

    def __init__(self, request: Request, metrics: RequestMetrics, cancel: Callable[["RequestHandle"], None]):
        self.request = request
        self.request_id = request.request_id
        self.metrics = metrics
        self.error: BaseException | None = None
        self.tokens: list[int] | None = None  # the generated speech tokens, once the LM has finished
        self._cancel = cancel
        self._cond = threading.Condition()
        self._chunks: list[np.ndarray] = []
        self._done = False
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    # ---------------------------------------------------------------- scheduler side
    def _notify(self) -> None:
        self._cond.notify_all()
        for loop, ev in self._waiters:
            try:
                loop.call_soon_threadsafe(ev.set)
            except RuntimeError:  # loop closed
                pass

    def _put(self, chunk: np.ndarray) -> None:
        with self._cond:
            if not self._done:
                self._chunks.append(chunk)
                self._notify()

    def _finish(self, error: BaseException | None = None, stamp: Callable[[], None] | None = None) -> bool:
        """Mark done (with `error` if it failed), calling `stamp()` first; False when it was already done."""
        with self._cond:
            if self._done:
                return False
            if stamp is not None:
                stamp()
            self._done = True
            self.error = error
            self._notify()
            return True

    # ---------------------------------------------------------------- caller side
    def done(self) -> bool:
        return self._done

    def cancel(self) -> None:
        """Stop the request: its handle raises RejectedError, every stage drops it, its KV slot frees at the next
        AR step. No effect once it is done."""
        if not self._done:
            self._cancel(self)

    def _next(self, i: int, deadline: float | None) -> np.ndarray | None:
        with self._cond:
            while i >= len(self._chunks) and not self._done:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"request {self.request_id}: no audio within the timeout")
                self._cond.wait(left)
            if i < len(self._chunks):
                return self._chunks[i]
            if self.error is not None:
                raise self.error
            return None

    def chunks(self, timeout: float | None = None) -> Iterator[np.ndarray]:
        """PCM chunks in order as they arrive; `timeout` bounds each wait. Raises the request's error if it failed."""
        i = 0
        while True:
            c = self._next(i, None if timeout is None else time.monotonic() + timeout)
            if c is None:
                return
            i += 1
            yield c

    async def achunks(self):
        """Async version of `chunks()` (no executor thread per waiting request)."""
        loop = asyncio.get_running_loop()
        ev = asyncio.Event()
        with self._cond:
            self._waiters.append((loop, ev))
        try:
            i = 0
            while True:
                with self._cond:
                    if i < len(self._chunks):
                        c = self._chunks[i]
                    elif self._done:
                        if self.error is not None:
                            raise self.error
                        return
                    else:
                        c = None
                        ev.clear()
                if c is None:
                    await ev.wait()
                    continue
                i += 1
                yield c
        finally:
            with self._cond:
                self._waiters.remove((loop, ev))

    def result(self, timeout: float | None = None) -> np.ndarray:
        """The whole waveform (all chunks concatenated) once the request is done."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._done:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
                self._cond.wait(left)
            if self.error is not None:
                raise self.error
            return np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.float32)
