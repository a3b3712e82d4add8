"""Engine adapters: one per backend that has an engine file format, behind one small interface (`EngineRunner`).

`ADAPTERS` lists exactly the adapters that exist: `onnxruntime` (ONNX files), `aoti` (AOTInductor `.pt2` packages),
`tensorrt` (TensorRT plans). Not file adapters, and so not here: the CUDA-graph wrapper (`engines/cudagraph.py`,
wraps any callable), the `compiled` engine set (torch.compile's cache, loaded by the runtime), and the AR runners
(`torch` and `trtllm`, `AR_RUNNERS`: the LM is not a bucketed stage).
"""
from __future__ import annotations

import importlib
import os

from .base import EngineRunner, EngineSpec

# backend -> (module under cosytrt.engines, runner class); imported lazily by open_runner
ADAPTERS: dict[str, tuple[str, str]] = {
    "onnxruntime": ("onnxruntime", "OnnxRuntimeRunner"),
    "aoti": ("aoti", "AOTIRunner"),
    "tensorrt": ("tensorrt", "TensorRTRunner"),
}

# AR runner name (manifest `ar_runner`) -> (module, class) implementing runtime.stages.ar_runner.ARRunner
AR_RUNNERS: dict[str, tuple[str, str]] = {
    "torch": ("cosytrt.runtime.stages.ar_runner", "TorchARRunner"),
    "trtllm": ("cosytrt.runtime.stages.ar_trtllm", "TrtllmARRunner"),
}


def open_runner(spec: EngineSpec, folder: str, device: str = "cpu", options: dict | None = None) -> EngineRunner:
    """The runner for one manifest entry (backend packages are imported only here, lazily). `options`: runner
    options of backends that take them (onnxruntime: `OrtOptions` fields)."""
    from .errors import EngineSetError

    path = os.path.join(folder, spec.file)
    if spec.backend not in ADAPTERS:
        raise EngineSetError(f"{path}: unknown backend {spec.backend!r} (adapters: {', '.join(ADAPTERS)})")
    if not os.path.isfile(path):
        raise EngineSetError(f"engine file missing: {path}")
    module, cls = ADAPTERS[spec.backend]
    runner_cls = getattr(importlib.import_module(f"{__name__}.{module}"), cls)
    if options is not None:
        return runner_cls(path, spec, device, options)
    return runner_cls(path, spec, device)


__all__ = ["ADAPTERS", "AR_RUNNERS", "EngineRunner", "EngineSpec", "open_runner"]
