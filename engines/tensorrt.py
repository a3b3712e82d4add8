"""TensorRT adapter (TensorRT 10/11 or TensorRT for RTX): one optimization profile per bucket, one execution context
per profile.

Which library: `tensorrt` when it imports, else TensorRT for RTX (`tensorrt_rtx_bindings`, the PyPI wheels
`tensorrt-rtx-cu13-bindings` + `tensorrt-rtx-cu13-libs`, or `tensorrt_rtx` from NVIDIA's SDK), which has TensorRT's
Python API. `select_tensorrt()` returns the module and a `TensorRTLibrary` naming it; the build records it in the
manifest (`tensorrt_library`, and `versions["tensorrt_library"]`), and an engine set built by one library is refused by
the other (`Manifest.check_compatible`).

TensorRT-RTX differences from TensorRT 10/11 that cosytrt's code met (TensorRT-RTX 1.7.1.116 from PyPI; its ONNX
parser and builder ran for real on the full-size DiT exports on an H200, and, through `trtbuild build --backend
tensorrt --device cpu`, on the full-size HiFT and fp32 streaming DiT on a CPU-only machine — see BENCHMARKS.md):
- Strong typing is always on; `NetworkDefinitionCreationFlag.STRONGLY_TYPED` exists but is deprecated and ignored
  (as in TensorRT 11). Versions are 1.x, so `network_flags` must not infer "TensorRT 10" from the major: it passes 0.
- The build is ahead of time and hardware-agnostic: no kernel timing; a "compiler backend" compiles each
  optimization profile (about 8-11 s per full-size DiT profile with 14 builds in parallel on the H200 machine's 16
  cores, linear in profiles), and it needs no GPU (on a CPU-only machine parse + build ran; only deserialization
  fails). Targets: `IBuilderConfig.num_compute_capabilities` + `set_compute_capability(ComputeCapability.SM89, i)`;
  the enum lists SM75, SM80, SM86, SM89, SM120, SM121 and CURRENT; cosytrt sets them only when the profile's stage
  options name `compute_capabilities` (the library default was used on the H200).
- No GPU is needed to build, so `trtbuild build --backend tensorrt --device cpu` is allowed with TensorRT-RTX only
  (`build.engine_set.tensorrt_build_device`: the exports run on the CPU, the set's device is "cuda"; TensorRT 10/11
  times kernels on its build GPU and keeps --device cuda). On a machine without a CUDA driver the builder logs
  "Error reading CUDA GPU properties: In getCurrentCC ... (cudaError 35: CUDA driver version is insufficient for CUDA
  runtime version)" and still builds; `get_engine_validity` then says INVALID (recorded as
  `runnable_here: false`). A cp311 bindings wheel exists too (`tensorrt_rtx_cu13_bindings-...-cp311`).
- No timing cache: the builder logs "The timing cache will not be used!" and a cache it serialized fails to load
  next time ("Failed to deserialize timing cache"), so `build_plan` uses none with TensorRT-RTX.
- `Builder.max_threads` defaults to 1; `build_plan` sets it to the CPU count (no speed-up was measurable on 2 cores).
- The logger is process-wide: a second Runtime/Builder given another logger logs "The logger passed into
  createInferRuntime differs from one already registered ... the current new logger is ignored", so cosytrt keeps one
  logger per module (`shared_logger`) and reads a call's errors from it.
- Plans run only on the GPUs TensorRT-RTX supports. On an H200 `Runtime.get_engine_validity(plan)` returns
  (INVALID, UNSUPPORTED_CC) and `deserialize_cuda_engine` returns None after logging "IRuntime::deserializeCudaEngine:
  Error Code 6: API Usage Error (The engine cannot run on this GPU, which has compute capability 9.0. Supported
  compute capabilities: 8.0 8.6 8.9 12.0 12.1 >12.0. TensorRT-RTX does not support this compute capability, so the
  engine cannot be rebuilt for it ...)". `deserialize_plan` refuses with that text; the builder does not deserialize
  a TensorRT-RTX plan that cannot run here (TensorRT does, to read per-profile device memory), and records why.
- Parser (TensorRT's too): Mish takes FLOAT32/FLOAT16 only ("Only FLOAT32 or FLOAT16 input is supported for the Mish
  operator", on the bf16 DiT export): export_dit computes Mish in float32 in reduced-precision exports. The float64
  f0 predictor of the HiFT export parses: no layer of the parsed network is DOUBLE (it is computed in float32).
- Builder: a profile whose scratch memory exceeds the WORKSPACE pool fails the whole build with "Error Code 2:
  OutOfMemory (Requested size was 9914508224 bytes.)" (the fp32 streaming DiT at b16 x t2100 under default.yaml's
  workspace_gb 8, on the H200 and on a CPU-only machine alike; it builds with 10 on the CPU, 12 on the H200; bf16
  fits in 8). On a CPU-only machine the limit is checked, not allocated (that build peaked at ~6 GiB RSS).
  `build_plan` adds the workspace_gb that would do to the error.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from .buckets import Bucket
from .errors import BackendUnavailableError, EngineSetError
from .base import EngineRunner, EngineSpec
from .shapes import profile_index

# (module to import, library it is), in order of preference
TENSORRT_MODULES = (("tensorrt", "tensorrt"), ("tensorrt_rtx_bindings", "tensorrt_rtx"), ("tensorrt_rtx", "tensorrt_rtx"))
LIBRARY_NAMES = {"tensorrt": "TensorRT", "tensorrt_rtx": "TensorRT-RTX"}


@dataclass(frozen=True)
class TensorRTLibrary:
    """Which TensorRT-family library is in use: `library` "tensorrt" | "tensorrt_rtx", the module, its version."""

    library: str
    module: str
    version: str

    @property
    def rtx(self) -> bool:
        return self.library == "tensorrt_rtx"

    def __str__(self) -> str:
        return f"{LIBRARY_NAMES.get(self.library, self.library)} {self.version} ({self.module})"


def select_tensorrt():
    """-> (module, TensorRTLibrary): `tensorrt` when it imports, else TensorRT for RTX. Raises
    BackendUnavailableError naming the packages and why each failed to import."""
    reasons = []
    for module, library in TENSORRT_MODULES:
        try:
            trt = importlib.import_module(module)
        except ImportError as e:  # a missing shared library surfaces as ImportError too
            reasons.append(f"{module}: {e}")
            continue
        return trt, TensorRTLibrary(library, module, str(getattr(trt, "__version__", "unknown")))
    raise BackendUnavailableError(
        "tensorrt", "tensorrt",
        "nor TensorRT for RTX (pip install tensorrt-rtx-cu13-bindings tensorrt-rtx-cu13-libs); " + "; ".join(reasons))


def import_tensorrt():
    """The TensorRT-family module in use (see `select_tensorrt`)."""
    return select_tensorrt()[0]


def tensorrt_library() -> TensorRTLibrary | None:
    try:
        return select_tensorrt()[1]
    except BackendUnavailableError:
        return None


def tensorrt_version() -> str | None:
    lib = tensorrt_library()
    return lib.version if lib else None


def library_of(trt) -> TensorRTLibrary:
    """The TensorRTLibrary of an already imported module (tests pass fakes)."""
    name = getattr(trt, "__name__", "tensorrt")
    library = "tensorrt_rtx" if "rtx" in name else "tensorrt"
    return TensorRTLibrary(library, name, str(getattr(trt, "__version__", "unknown")))


def rtx_target_capabilities(trt) -> list[str]:
    """Compute capabilities a TensorRT-RTX build can target, from its ComputeCapability enum ("8.9", "12.0", ...)."""
    out = []
    for name in getattr(getattr(trt, "ComputeCapability", None), "__members__", {}):
        if name.startswith("SM") and name[2:].isdigit():
            out.append(f"{name[2:-1]}.{name[-1]}")
    return out


_LOGGERS: dict[int, object] = {}


def shared_logger(trt):
    """The process-wide logger for a TensorRT-family module. TensorRT(-RTX) keeps the first logger it is given
    (a later Runtime with another one logs "The logger passed into createInferRuntime differs from one already
    registered ... the current new logger is ignored"), so every builder and runtime here shares this one; read a
    call's errors as `logger.errors[mark:]` with `mark = len(logger.errors)` taken before the call."""
    logger = _LOGGERS.get(id(trt))
    if logger is None:
        base = trt.ILogger
        sev = trt.ILogger.Severity

        class _Logger(base):
            def __init__(self):
                base.__init__(self)
                self.errors: list[str] = []
                self.min = sev.WARNING

            def log(self, severity, msg):
                if severity in (sev.ERROR, sev.INTERNAL_ERROR):
                    self.errors.append(str(msg))
                if int(severity) <= int(self.min):
                    print(f"[{library_of(trt).library}] {msg}", flush=True)

        logger = _LOGGERS[id(trt)] = _Logger()
    return logger


def deserialize_plan(trt, plan: bytes, path: str, logger=None, device_capability: tuple[int, int] | None = None):
    """Deserialize a plan or raise EngineSetError with the library's own error text. A TensorRT-RTX plan on a GPU
    that TensorRT-RTX does not support (e.g. an H200, compute capability 9.0) is refused with its Error Code 6."""
    lib = library_of(trt)
    logger = logger or shared_logger(trt)
    mark = len(logger.errors)
    runtime = trt.Runtime(logger)
    validity = None
    if hasattr(runtime, "get_engine_validity"):
        try:
            validity = runtime.get_engine_validity(plan)
        except Exception:  # noqa: BLE001 - a diagnostic only
            validity = None
    engine = runtime.deserialize_cuda_engine(plan)
    if engine is not None:
        return engine
    errors = "; ".join(logger.errors[mark:]) or "no error logged"
    where = f" on this GPU (compute capability {device_capability[0]}.{device_capability[1]})" if device_capability \
        else ""
    if lib.rtx:
        diag = _describe_validity(trt, validity)
        raise EngineSetError(
            f"{path}: {lib} refuses to run this plan{where}: {errors}{diag}. TensorRT-RTX plans run only on the GPUs "
            f"it supports (RTX-class: Ampere, Ada, Blackwell; not Hopper); on other GPUs use TensorRT (the `tensorrt` "
            f"package) or another backend (aoti, onnxruntime)")
    raise EngineSetError(f"{lib} could not deserialize {path}{where} (built by another TensorRT version or GPU?): "
                         f"{errors}")


def _describe_validity(trt, validity) -> str:
    if not validity:
        return ""
    state, flags = validity
    names = [n for n, v in getattr(getattr(trt, "EngineInvalidityDiagnostics", None), "__members__", {}).items()
             if int(flags) & int(v)]
    return f" [engine validity {getattr(state, 'name', state)}{': ' + ', '.join(names) if names else ''}]"


class TensorRTRunner(EngineRunner):
    """Deserializes a plan; keeps one context and one CUDA stream per optimization profile (bucket)."""

    backend = "tensorrt"

    def __init__(self, path: str, spec: EngineSpec, device: str = "cuda"):
        super().__init__(path, spec, device)
        if self.device.type != "cuda":
            raise EngineSetError("TensorRT engines run on CUDA only")
        trt, lib = select_tensorrt()
        built_by = spec.extra.get("tensorrt_library")
        if built_by and built_by != lib.library:
            raise EngineSetError(f"{path} was built by {LIBRARY_NAMES.get(built_by, built_by)} but this machine has "
                                 f"{lib}: rebuild it with `trtbuild build`")
        self._trt = trt
        self._logger = shared_logger(trt)
        with open(path, "rb") as f:
            plan = f.read()
        self.engine = deserialize_plan(trt, plan, path, self._logger,
                                       torch.cuda.get_device_capability(self.device))
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


def _torch_dtype_of(trt, dt) -> torch.dtype:
    table = {trt.float32: torch.float32, trt.float16: torch.float16, trt.int32: torch.int32, trt.bool: torch.bool}
    if hasattr(trt, "bfloat16"):
        table[trt.bfloat16] = torch.bfloat16
    if hasattr(trt, "int64"):
        table[trt.int64] = torch.int64
    if dt not in table:
        raise EngineSetError(f"unsupported TensorRT tensor dtype {dt}")
    return table[dt]
