"""How long a Python thread waits for the interpreter lock during a cell: the server's `LockProbe` (a thread that
sleeps `interval_s` again and again and records how late it wakes: the wait behind the AR, DiT, HiFT and frontend
threads), its samples kept for the cell's quantiles. A direct gauge of the contention the runtime's worker threads
impose on each other (BENCHMARKS.md runs 36-39 suspected it of the saturation with no stage busy all the time; run 41
measured it small: p95 1.8 ms at saturation)."""
from __future__ import annotations

from ...runtime.scheduling.lock_probe import LockProbe
from .playback import distribution


class GilProbe(LockProbe):
    def __init__(self, interval_s: float = 0.005):
        self.late: list[float] = []
        super().__init__(self.late.append, interval_s)

    def summary(self) -> dict:
        """p50 / p95 / p99 / max of the lateness in ms, and the number of wake-ups."""
        d = distribution([x * 1e3 for x in self.late])
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in d.items()}
