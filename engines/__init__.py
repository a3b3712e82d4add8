"""Engine adapters: one per backend (onnxruntime, aoti, tensorrt, trtllm, eager) behind one small interface."""
from __future__ import annotations

import os

from .base import EngineRunner, EngineSpec


def open_runner(spec: EngineSpec, folder: str, device: str = "cpu") -> EngineRunner:
    """The runner for one manifest entry (backend packages are imported only here, lazily)."""
    from .errors import EngineSetError

    path = os.path.join(folder, spec.file)
    if not os.path.isfile(path):
        raise EngineSetError(f"engine file missing: {path}")
    if spec.backend == "onnxruntime":
        from .onnxruntime import OnnxRuntimeRunner

        return OnnxRuntimeRunner(path, spec, device)
    if spec.backend == "aoti":
        from .aoti import AOTIRunner

        return AOTIRunner(path, spec, device)
    if spec.backend == "tensorrt":
        from .tensorrt import TensorRTRunner

        return TensorRTRunner(path, spec, device)
    raise EngineSetError(f"{path}: unknown backend {spec.backend!r}")


__all__ = ["EngineRunner", "EngineSpec", "open_runner"]
