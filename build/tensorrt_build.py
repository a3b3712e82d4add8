"""Build a TensorRT plan from an ONNX file: strongly typed, one optimization profile per bucket.

The same code targets TensorRT 10 and 11 and TensorRT for RTX (see engines/tensorrt.py for which is used and how they
differ): precision comes from the ONNX itself (an fp16/bf16 export), never from builder flags (removed in 11, absent
in TensorRT-RTX). With TensorRT-RTX the build needs no GPU (it is ahead of time; kernels are compiled on the target
at run time) and `compute_capabilities` picks the targets. `tensorrt` is imported lazily; the pure-Python parts
(`profile_shapes`, `network_flags`, `compute_capability_targets`) are unit-tested without it.
"""
from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field

from ..engines.shapes import profile_shapes
from ..engines.tensorrt import _describe_validity, library_of, select_tensorrt, shared_logger
from ..engines.buckets import Bucket
from ..engines.errors import EngineSetError


@dataclass
class TensorRTOptions:
    opt_level: int = 3  # builder_optimization_level 0..5
    workspace_gb: float = 8.0
    timing_cache: str | None = None  # path; read if present, written after the build
    detailed_profiling: bool = True
    # TensorRT-RTX targets: names of its ComputeCapability enum ("SM89", "SM120", "CURRENT"); [] = library default
    compute_capabilities: list[str] = field(default_factory=list)
    max_threads: int | None = None  # builder threads; None = every CPU (TensorRT-RTX's default is 1)


def network_flags(trt) -> int:
    """STRONGLY_TYPED on TensorRT 10 (opt-in); 0 on 11 and TensorRT-RTX, where strong typing is always on and the
    flag deprecated (TensorRT-RTX versions are 1.x: the major alone would wrongly ask for the flag)."""
    if library_of(trt).rtx:
        return 0
    major = int(str(trt.__version__).split(".")[0])
    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    if major >= 11 or flag is None:
        return 0
    return 1 << int(flag)


def compute_capability_targets(trt, names: list[str]) -> list:
    """ComputeCapability members for `names` ("SM89", "sm120", "8.9", "current"); EngineSetError on unknown ones."""
    enum = getattr(trt, "ComputeCapability", None)
    if names and enum is None:
        raise EngineSetError(f"compute_capabilities={names} needs TensorRT-RTX ({library_of(trt)} has no targets)")
    out = []
    for n in names:
        key = str(n).upper().replace(".", "")
        key = key if key in ("CURRENT",) or key.startswith("SM") else "SM" + key
        if key not in enum.__members__:
            raise EngineSetError(f"unknown compute capability {n!r}; {library_of(trt)} targets "
                                 f"{', '.join(k for k in enum.__members__ if k != 'NONE')}")
        out.append(enum.__members__[key])
    return out


def parse_onnx(trt, network, logger, onnx_path: str, mark: int = 0):
    """Parse an ONNX file (external data beside it is found through the path) or raise with every parser error."""
    parser = trt.OnnxParser(network, logger)
    ok = parser.parse_from_file(onnx_path) if hasattr(parser, "parse_from_file") else None
    if ok is None:
        with open(onnx_path, "rb") as f:
            ok = parser.parse(f.read(), onnx_path)
    if not ok:
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EngineSetError(f"{library_of(trt)} could not parse {onnx_path}: {errors or '; '.join(logger.errors[mark:])}")
    return parser


def workspace_hint(errors: str, options: TensorRTOptions) -> str:
    """A hint when the build failed on the workspace limit: TensorRT(-RTX) reports "Error Code 2: OutOfMemory
    (Requested size was N bytes.)" when a profile's scratch memory exceeds the WORKSPACE pool (seen: the fp32 streaming
    DiT at b16 x t2100 asks 9914508224 bytes, over the default 8 GiB; it builds with 12)."""
    m = re.search(r"OutOfMemory \(Requested size was (\d+) bytes", errors)
    if not m or int(m.group(1)) <= options.workspace_gb * (1 << 30):
        return ""
    need = -(-int(m.group(1)) // (1 << 30)) + 1
    return (f" -- a profile needs {int(m.group(1)) / 2**30:.1f} GiB of scratch, over workspace_gb="
            f"{options.workspace_gb:g}: set the stage's options to {{workspace_gb: {need}}} or drop its largest bucket")


def build_plan(onnx_path: str, plan_path: str, buckets: list[Bucket], input_shapes: dict[str, list],
               options: TensorRTOptions | None = None) -> dict:
    """Build and atomically write `plan_path`. Returns build info (seconds, per-profile device memory where the plan
    can be deserialized here, the library that built it)."""
    trt, lib = select_tensorrt()
    options = options or TensorRTOptions()
    logger = shared_logger(trt)
    mark = len(logger.errors)

    def errors() -> str:
        return "; ".join(logger.errors[mark:]) or "no error logged"

    builder = trt.Builder(logger)
    if hasattr(builder, "max_threads"):
        builder.max_threads = int(options.max_threads or os.cpu_count() or 1)
    network = builder.create_network(network_flags(trt))
    t_parse = time.perf_counter()
    parser = parse_onnx(trt, network, logger, onnx_path, mark)  # noqa: F841 - keeps the parser (and its weights) alive
    parse_seconds = time.perf_counter() - t_parse
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(options.workspace_gb * (1 << 30)))
    config.builder_optimization_level = options.opt_level
    if options.detailed_profiling:
        config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    targets = compute_capability_targets(trt, options.compute_capabilities)
    if targets:
        config.num_compute_capabilities = len(targets)
        for i, cc in enumerate(targets):
            if not config.set_compute_capability(cc, i):
                raise EngineSetError(f"{lib} refused compute capability {cc} as target {i}: "
                                     f"{errors()}")
    timing_cache = options.timing_cache if not lib.rtx else None  # TensorRT-RTX times no kernels: no cache
    cache_bytes = b""
    if timing_cache and os.path.isfile(timing_cache):
        with open(timing_cache, "rb") as f:
            cache_bytes = f.read()
    if not lib.rtx:
        config.set_timing_cache(config.create_timing_cache(cache_bytes), ignore_mismatch=False)
    for bucket in buckets:  # profile index = insertion order = manifest bucket order
        profile = builder.create_optimization_profile()
        for name, (mn, op, mx) in profile_shapes(input_shapes, bucket).items():
            profile.set_shape(name, mn, op, mx)
        if config.add_optimization_profile(profile) < 0:
            raise EngineSetError(f"{lib} rejected the optimization profile of bucket {bucket.key} for {onnx_path}: "
                                 f"{errors()}")
    t0 = time.perf_counter()
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise EngineSetError(f"{lib} failed to build {onnx_path}: {errors()}{workspace_hint(errors(), options)}")
    seconds = time.perf_counter() - t0
    tmp = plan_path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(plan)
    os.replace(tmp, plan_path)
    if timing_cache:
        with open(timing_cache + ".tmp", "wb") as f:
            f.write(config.get_timing_cache().serialize())
        os.replace(timing_cache + ".tmp", timing_cache)
    info = {"seconds": seconds, "parse_seconds": parse_seconds, "plan_bytes": os.path.getsize(plan_path),
            "tensorrt_version": lib.version, "tensorrt_library": lib.library, "workspace_gb": options.workspace_gb,
            "compute_capabilities": [getattr(t, "name", str(t)) for t in targets]}
    info.update(_profile_memory(trt, lib, plan, len(buckets)))
    return info


def _profile_memory(trt, lib, plan, n_profiles: int) -> dict:
    """Per-profile device memory, read by deserializing the plan; a TensorRT-RTX plan that cannot run here (no GPU,
    or one it does not support) is not deserialized: the reason is recorded instead."""
    logger = shared_logger(trt)
    mark = len(logger.errors)
    runtime = trt.Runtime(logger)
    if lib.rtx and hasattr(runtime, "get_engine_validity"):
        state, _flags = runtime.get_engine_validity(plan)
        if getattr(state, "name", str(state)) == "INVALID":
            return {"profile_device_memory": None,
                    "runnable_here": False,
                    "not_runnable_reason": f"{lib} cannot run this plan here{_describe_validity(trt, (state, _flags))}"
                                           f"{': ' + '; '.join(logger.errors[mark:]) if logger.errors[mark:] else ''}"}
    engine = runtime.deserialize_cuda_engine(plan)
    if engine is None:
        if lib.rtx:
            return {"profile_device_memory": None, "runnable_here": False,
                    "not_runnable_reason": "; ".join(logger.errors[mark:]) or "deserialization failed"}
        raise EngineSetError(f"{lib} built a plan it cannot deserialize: {'; '.join(logger.errors[mark:])}")
    return {"profile_device_memory": [int(engine.get_device_memory_size_for_profile_v2(k)) for k in
                                      range(n_profiles)], "runnable_here": True}
