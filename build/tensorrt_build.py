"""Build a TensorRT plan from an ONNX file: strongly typed, one optimization profile per bucket.

The same code targets TensorRT 10 and 11: precision comes from the ONNX itself (an fp16/bf16 export), never from
builder flags (removed in 11). `tensorrt` is imported lazily; it is not installed in cosytrt's CI, so `build_plan`
has not been executed there — the pure-Python parts (`profile_shapes`, `network_flags`) are unit-tested.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

from ..engines.shapes import profile_shapes
from ..engines.tensorrt import import_tensorrt
from ..engines.buckets import Bucket
from ..engines.errors import EngineSetError


@dataclass
class TensorRTOptions:
    opt_level: int = 3  # builder_optimization_level 0..5
    workspace_gb: float = 8.0
    timing_cache: str | None = None  # path; read if present, written after the build
    detailed_profiling: bool = True


def network_flags(trt) -> int:
    """STRONGLY_TYPED on TensorRT 10 (opt-in); 0 on 11 where strong typing is always on and the flag deprecated."""
    major = int(str(trt.__version__).split(".")[0])
    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    if major >= 11 or flag is None:
        return 0
    return 1 << int(flag)


def build_plan(onnx_path: str, plan_path: str, buckets: list[Bucket], input_shapes: dict[str, list],
               options: TensorRTOptions | None = None) -> dict:
    """Build and atomically write `plan_path`. Returns build info (seconds, per-profile device memory)."""
    trt = import_tensorrt()
    options = options or TensorRTOptions()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(network_flags(trt))
    parser = trt.OnnxParser(network, logger)
    with open(onnx_path, "rb") as f:
        if not parser.parse(f.read()):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise EngineSetError(f"TensorRT could not parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(options.workspace_gb * (1 << 30)))
    config.builder_optimization_level = options.opt_level
    if options.detailed_profiling:
        config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    cache_bytes = b""
    if options.timing_cache and os.path.isfile(options.timing_cache):
        with open(options.timing_cache, "rb") as f:
            cache_bytes = f.read()
    config.set_timing_cache(config.create_timing_cache(cache_bytes), ignore_mismatch=False)
    for bucket in buckets:  # profile index = insertion order = manifest bucket order
        profile = builder.create_optimization_profile()
        for name, (mn, op, mx) in profile_shapes(input_shapes, bucket).items():
            profile.set_shape(name, mn, op, mx)
        config.add_optimization_profile(profile)
    t0 = time.perf_counter()
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise EngineSetError(f"TensorRT failed to build {onnx_path}")
    seconds = time.perf_counter() - t0
    tmp = plan_path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(plan)
    os.replace(tmp, plan_path)
    if options.timing_cache:
        with open(options.timing_cache + ".tmp", "wb") as f:
            f.write(config.get_timing_cache().serialize())
        os.replace(options.timing_cache + ".tmp", options.timing_cache)
    engine = trt.Runtime(logger).deserialize_cuda_engine(plan)
    memory = [int(engine.get_device_memory_size_for_profile_v2(k)) for k in range(len(buckets))]
    return {"seconds": seconds, "profile_device_memory": memory, "tensorrt_version": trt.__version__}
