"""How long a thread of this process waits for the interpreter lock (`LockProbe`): the server's
`cosytrt_interpreter_lock_wait_seconds` and the bench's per-cell GIL probe. Here, below the server, so that the bench
(and any library user) can use it without the server's packages."""
from __future__ import annotations

import threading
import time
from typing import Callable


class LockProbe:
    """How long a thread of this process waits for the interpreter lock: a daemon thread sleeps `interval_s` again and
    again and passes how late it woke to `observe` (seconds; the OS wakes it on time, the rest is the wait behind the
    runtime's AR, DiT, HiFT and frontend threads and the event loop; on an H100 at saturation 0.1 ms at the median and
    1.8 ms at the 95th percentile, BENCHMARKS.md run 41). It takes the lock itself 1 / interval_s times a second,
    briefly."""

    def __init__(self, observe: Callable[[float], None], interval_s: float = 0.02):
        self.observe, self.interval_s = observe, interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        interval, clock, stop = self.interval_s, time.perf_counter, self._stop
        while not stop.is_set():
            t = clock()
            time.sleep(interval)
            self.observe(max(0.0, clock() - t - interval))

    def start(self) -> "LockProbe":
        if self._thread is None:
            self._stop.clear()  # an app started again after a shutdown probes again
            self._thread = threading.Thread(target=self._run, name="cosytrt-lock-probe", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> "LockProbe":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
