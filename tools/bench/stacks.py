"""Where the scheduler's worker threads spend their time: a sampling profiler in pure Python (no py-spy on the lent
GPU machine). Every `interval_s` it reads `sys._current_frames()` for the threads named cosytrt-* and counts, per
thread, the innermost frame (what runs now, e.g. a torch op called from Python or a lock wait) and the innermost
frame inside cosytrt (which of our lines led there). A thread blocked on a condition shows as `wait` in threading.py;
a thread waiting for the GIL shows at the line it will run next, so the shares are of wall time, not of CPU time.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter


def _where(frame) -> str:
    code = frame.f_code
    return f"{os.path.basename(code.co_filename)}:{code.co_name}:{frame.f_lineno}"


class StackSampler:
    def __init__(self, interval_s: float = 0.005, prefix: str = "cosytrt-"):
        self.interval_s, self.prefix = interval_s, prefix
        self.leaf: dict[str, Counter] = {}
        self.ours: dict[str, Counter] = {}
        self.samples: Counter = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def __enter__(self) -> "StackSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        while not self._stop.wait(self.interval_s):
            names = {t.ident: t.name for t in threading.enumerate() if t.name.startswith(self.prefix)}
            for ident, frame in sys._current_frames().items():
                name = names.get(ident)
                if name is None:
                    continue
                self.samples[name] += 1
                self.leaf.setdefault(name, Counter())[_where(frame)] += 1
                f = frame
                while f is not None and not os.path.abspath(f.f_code.co_filename).startswith(root):
                    f = f.f_back
                if f is not None:
                    self.ours.setdefault(name, Counter())[_where(f)] += 1

    def summary(self, top: int = 12) -> dict:
        """Per thread: samples, and the top innermost frames / innermost cosytrt frames with their share."""
        out = {}
        for name, n in sorted(self.samples.items()):
            out[name] = {"samples": n,
                         "leaf": [[w, round(c / n, 3)] for w, c in self.leaf.get(name, Counter()).most_common(top)],
                         "cosytrt": [[w, round(c / n, 3)] for w, c in self.ours.get(name, Counter()).most_common(top)]}
        return out


def timed_sampler(enabled: bool, interval_s: float = 0.005):
    """A StackSampler, or a no-op context when disabled."""
    if enabled:
        return StackSampler(interval_s)
    import contextlib

    return contextlib.nullcontext()
