"""What runs each stage besides the eager modules: handed explicitly to whoever runs a stage (Pipeline, Token2Wav,
the scheduler's token2wav worker) instead of attributes set on the models.

An empty `StageBackends()` means: every stage runs the eager PyTorch modules. `engine_set.py` (engine files or CUDA
graphs of the eager modules) and `compiled.py` (torch.compile) return filled ones.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from ...engines.buckets import ShapeStats

log = logging.getLogger("cosytrt.backends")


@dataclass
class StageBackends:
    dit_stream: Callable | None = None      # DiT estimator of streaming calls (None: the flow's eager DiT)
    dit_offline: Callable | None = None     # DiT estimator of offline / final calls
    hift_offline: Any = None                # offline HiFT: `.inference_batch(mels, finalize=True)` (None: eager)
    hift_stream_windows: Callable | None = None  # non-final streaming HiFT windows: `(mel, source, finalize)` -> wav
    shape_stats: ShapeStats | None = None   # bucket hits / padding / eager fallbacks of the engine calls
    engine_set: Any = None                  # the opened engine set (manifest, runners, tables), for tools
    name: str = "eager"                     # what these are, for logs and benchmark labels
    closers: list = field(default_factory=list)  # called by close()
    dit_cached: Any = None                  # prefix-cached streaming hops: flow_hop_calls.CachedHopGraphs (None: eager)

    def estimator(self, streaming: bool) -> Callable | None:
        """The DiT estimator of one attention mode, or None (the flow's own)."""
        return self.dit_stream if streaming else self.dit_offline

    def close(self) -> None:
        """Release the runners (engine sessions, graph pools); the backends are unusable afterwards."""
        closers, self.closers = self.closers, []
        for fn in closers:
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - closing the rest matters more
                log.warning("closing %s backends: %r", self.name, e)


_logged: set = set()


def log_fallback_once(stage: str, reason: str) -> None:
    """Log an engine fallback (a call that ran eagerly instead) once per (stage, reason) for the process."""
    key = (stage, reason)
    if key not in _logged:
        _logged.add(key)
        log.warning("%s: eager fallback: %s (logged once per reason)", stage, reason)
