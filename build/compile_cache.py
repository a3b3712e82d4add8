"""The `compiled` engine-set backend: compile what a compiled server compiles and keep Inductor's artifacts, so a
server that loads the set starts without compiling (runtime/stages/compiled.py loads them)."""
from __future__ import annotations

import os
from typing import Callable

import torch

from ..engines.errors import InputError
from ..runtime.stages.compiled import COMPILE_CACHE_FILE, _sha256, compiled_graph_count, device_name, save_compile_cache


def warm_compiled_tts(source: str, device: str, profile_path: str | None, dtype: torch.dtype | None):
    """Load a compiled TTS (every function compiled by its warm-up) the way `TTS.load(engines=<compiled set>)` will:
    the same model source, device, dtype and CUDA-graph profile, so the cache holds what serving compiles."""
    from ..runtime.tts import TTS

    return TTS.load(model=source, device=device, dtype=dtype, compile=True,
                    cuda_graphs=profile_path if profile_path else True)


def build_compile_cache(out_dir: str, source: str, device: str, profile_path: str | None = None,
                        dtype: torch.dtype | None = None, warm: Callable | None = None) -> dict:
    """Compile everything a compiled server compiles (`warm`: default `warm_compiled_tts`) and write Inductor's
    artifacts to `out_dir/compile_cache.bin`; returns the manifest entry (file, bytes, sha256, torch, device name,
    compile seconds, graphs compiled)."""
    import time

    t0 = time.perf_counter()
    graphs0 = compiled_graph_count()
    tts = (warm or warm_compiled_tts)(source, device, profile_path, dtype)
    seconds = time.perf_counter() - t0
    path = os.path.join(out_dir, COMPILE_CACHE_FILE)
    n = save_compile_cache(path)
    if hasattr(tts, "close"):
        tts.close()
    if n == 0:
        raise InputError("torch.compile produced no artifacts to cache (nothing was compiled?)")
    return {"file": COMPILE_CACHE_FILE, "bytes": n, "sha256": _sha256(path), "torch": torch.__version__,
            "device_name": device_name(device), "compile_seconds": round(seconds, 2),
            "graphs": compiled_graph_count() - graphs0, "dtype": str(dtype).replace("torch.", "") if dtype else None}
