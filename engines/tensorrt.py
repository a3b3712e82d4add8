"""TensorRT 10/11 adapter: one optimization profile per bucket, one execution context per profile.

Written against the documented API (strongly typed networks, name-based tensors, `execute_async_v3`); `tensorrt` is
imported lazily and is not installed in cosytrt's CI, so this module's runtime path has not been executed there.
"""
from __future__ import annotations

import torch

from .buckets import Bucket
from .errors import BackendUnavailableError, EngineSetError
from .base import EngineRunner, EngineSpec
from .shapes import profile_index, resolve_shape


def import_tensorrt():
    try:
        import tensorrt as trt  # noqa: PLC0415 - lazy on purpose
    except ImportError as e:
        raise BackendUnavailableError("tensorrt", "tensorrt", str(e)) from None
    return trt


def tensorrt_version() -> str | None:
    try:
        return import_tensorrt().__version__
    except BackendUnavailableError:
        return None


class TensorRTRunner(EngineRunner):
    """Deserializes a plan; keeps one context and one CUDA stream per optimization profile (bucket)."""

    backend = "tensorrt"

    def __init__(self, path: str, spec: EngineSpec, device: str = "cuda"):
        super().__init__(path, spec, device)
        if self.device.type != "cuda":
            raise EngineSetError("TensorRT engines run on CUDA only")
        trt = import_tensorrt()
        self._trt = trt
        self._logger = trt.Logger(trt.Logger.WARNING)
        with open(path, "rb") as f:
            plan = f.read()
        self.engine = trt.Runtime(self._logger).deserialize_cuda_engine(plan)
        if self.engine is None:
            raise EngineSetError(f"TensorRT could not deserialize {path} (built by another TensorRT version or GPU?)")
        n = self.engine.num_optimization_profiles
        if n != len(spec.buckets):
            raise EngineSetError(f"{path}: {n} optimization profiles but the manifest lists {len(spec.buckets)} buckets")
        self.templates = spec.extra.get("input_shapes", {})
        self.contexts = []
        self.streams = []
        for k in range(n):
            stream = torch.cuda.Stream(device=self.device)
            ctx = self.engine.create_execution_context()
            ctx.set_optimization_profile_async(k, stream.cuda_stream)
            self.contexts.append(ctx)
            self.streams.append(stream)
        torch.cuda.synchronize(self.device)

    def run(self, inputs: dict[str, torch.Tensor], bucket: Bucket) -> dict[str, torch.Tensor]:
        k = profile_index(self.spec.buckets, bucket)
        ctx, stream = self.contexts[k], self.streams[k]
        caller = torch.cuda.current_stream(self.device)
        stream.wait_stream(caller)
        for name in self.spec.input_names:
            t = inputs[name].contiguous()
            ctx.set_input_shape(name, tuple(t.shape))
            ctx.set_tensor_address(name, t.data_ptr())
        outs = {}
        for name in self.spec.output_names:
            shape = tuple(ctx.get_tensor_shape(name))
            dtype = _torch_dtype_of(self._trt, self.engine.get_tensor_dtype(name))
            outs[name] = torch.empty(shape, dtype=dtype, device=self.device)
            ctx.set_tensor_address(name, outs[name].data_ptr())
        with torch.cuda.stream(stream):
            if not ctx.execute_async_v3(stream.cuda_stream):
                raise EngineSetError(f"{self.path}: execute_async_v3 failed for bucket {bucket.key}")
        caller.wait_stream(stream)
        for t in list(inputs.values()) + list(outs.values()):
            t.record_stream(stream)
        return outs

    def static_shapes(self, bucket: Bucket) -> dict[str, tuple[int, ...]]:
        return {n: resolve_shape(t, bucket.batch, bucket.length) for n, t in self.templates.items()}


def _torch_dtype_of(trt, dt) -> torch.dtype:
    table = {trt.float32: torch.float32, trt.float16: torch.float16, trt.int32: torch.int32, trt.bool: torch.bool}
    if hasattr(trt, "bfloat16"):
        table[trt.bfloat16] = torch.bfloat16
    if hasattr(trt, "int64"):
        table[trt.int64] = torch.int64
    if dt not in table:
        raise EngineSetError(f"unsupported TensorRT tensor dtype {dt}")
    return table[dt]
