"""ONNX Runtime adapter: CUDA execution provider when present and asked for, else CPU."""
from __future__ import annotations

import numpy as np
import torch

from .buckets import Bucket
from .errors import BackendUnavailableError, EngineSetError
from .base import EngineRunner, EngineSpec

_ORT_TO_NUMPY = {
    "tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
    "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_,
}


def _import_ort():
    try:
        import onnxruntime as ort
    except ImportError as e:  # pragma: no cover - a hard dependency
        raise BackendUnavailableError("onnxruntime", "onnxruntime", str(e)) from None
    return ort


def session_options(intra_op_threads: int = 0, inter_op_threads: int = 0, graph_optimization: str = "all"):
    """Session options exposed to users: thread counts and the graph optimization level."""
    ort = _import_ort()
    so = ort.SessionOptions()
    if intra_op_threads:
        so.intra_op_num_threads = intra_op_threads
    if inter_op_threads:
        so.inter_op_num_threads = inter_op_threads
    levels = {"none": ort.GraphOptimizationLevel.ORT_DISABLE_ALL, "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
              "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
              "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}
    if graph_optimization not in levels:
        raise EngineSetError(f"unknown onnxruntime graph_optimization {graph_optimization!r}; one of {sorted(levels)}")
    so.graph_optimization_level = levels[graph_optimization]
    # no busy-waiting worker threads: they starve torch and the scheduler's threads on small CPU machines
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.log_severity_level = 3
    return so


def providers_for(device: str) -> list[str]:
    ort = _import_ort()
    available = ort.get_available_providers()
    if str(device).startswith("cuda") and "CUDAExecutionProvider" in available:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


class OnnxRuntimeRunner(EngineRunner):
    backend = "onnxruntime"

    def __init__(self, path: str, spec: EngineSpec, device: str = "cpu", options: dict | None = None):
        super().__init__(path, spec, device)
        ort = _import_ort()
        self.session = ort.InferenceSession(path, sess_options=session_options(**(options or {})),
                                            providers=providers_for(device))
        self._in_types = {i.name: _ORT_TO_NUMPY.get(i.type, np.float32) for i in self.session.get_inputs()}
        names = set(self._in_types)
        if set(spec.input_names) != names:
            raise EngineSetError(f"{path}: ONNX inputs {sorted(names)} differ from the manifest's {spec.input_names}")

    def run(self, inputs: dict[str, torch.Tensor], bucket: Bucket) -> dict[str, torch.Tensor]:
        feeds = {}
        for name in self.spec.input_names:
            if name not in inputs:
                raise EngineSetError(f"{self.path}: missing input {name!r}")
            feeds[name] = inputs[name].detach().cpu().numpy().astype(self._in_types[name], copy=False)
        outs = self.session.run(self.spec.output_names, feeds)
        return {n: torch.from_numpy(np.ascontiguousarray(o)).to(self.device) for n, o in zip(self.spec.output_names, outs)}
