"""How long a Python thread waits for the interpreter lock during a cell: a probe thread sleeps `interval_s` again and
again and records how late it wakes (the OS wakes it on time; the rest is the wait for the lock behind the AR, DiT,
HiFT and frontend threads). A direct gauge of the contention the runtime's worker threads impose on each other
(BENCHMARKS.md runs 36-39: no stage busy all the time at saturation). The probe itself takes the lock
1 / interval_s times a second, briefly."""
from __future__ import annotations

import threading
import time

from .playback import distribution


class GilProbe:
    def __init__(self, interval_s: float = 0.005):
        self.interval_s = interval_s
        self.late: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cosytrt-gil-probe", daemon=True)

    def _run(self) -> None:
        late, interval, clock = self.late, self.interval_s, time.perf_counter
        while not self._stop.is_set():
            t = clock()
            time.sleep(interval)
            late.append(clock() - t - interval)

    def __enter__(self) -> "GilProbe":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        """p50 / p95 / p99 / max of the lateness in ms, and the number of wake-ups."""
        d = distribution([x * 1e3 for x in self.late])
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in d.items()}
