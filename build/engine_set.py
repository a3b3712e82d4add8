"""Build an engine set: every (stage, mode) of a profile through one backend, into a folder with a manifest.

Backends: `onnxruntime` (ONNX files; ORT picks its provider at load), `aoti` (AOTInductor `.pt2` packages, CPU or
CUDA), `tensorrt` (ONNX → plans with one optimization profile per bucket; needs `tensorrt`). The AR LM runs in the
runtime (static KV cache + CUDA graphs) for those backends; with `tensorrt` the merged-vocab HF checkpoint and the
TensorRT-LLM build commands are written too (and run when `tensorrt_llm` is importable).

Incremental: an engine whose inputs (weights, profile buckets, dtype, backend versions) are unchanged is not rebuilt.
"""
from __future__ import annotations

import hashlib
import json
import os
import shlex
import time
from dataclasses import dataclass

import torch

from ..engines.base import EngineSpec
from ..engines.dtypes import torch_dtype
from ..engines.errors import BackendUnavailableError, EngineSetError
from ..runtime.models.loading import CosyVoice3Models
from ..runtime.stages.profile import Profile
from ..engines.manifest import Manifest, backend_versions, now_iso

BACKENDS = ("onnxruntime", "aoti", "tensorrt")


def resolve_backend(backend: str, device: str) -> str:
    """`auto`: TensorRT where installed (CUDA), else AOTInductor on CUDA, else ONNX Runtime."""
    if backend != "auto":
        if backend not in BACKENDS:
            raise EngineSetError(f"unknown backend {backend!r}; one of auto, {', '.join(BACKENDS)}")
        return backend
    if device.startswith("cuda"):
        from ..engines.tensorrt import tensorrt_version

        return "tensorrt" if tensorrt_version() else "aoti"
    return "onnxruntime"


@dataclass
class BuildResult:
    spec: EngineSpec
    rebuilt: bool
    seconds: float


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


class EngineSetBuilder:
    """Builds one engine set. `build()` returns the manifest; progress goes to a tqdm bar per engine."""

    def __init__(self, models: CosyVoice3Models, profile: Profile, backend: str, device: str, out_dir: str,
                 progress: bool = True):
        self.models = models
        self.profile = profile
        self.device = device
        self.backend = resolve_backend(backend, device)
        self.out_dir = out_dir
        self.progress = progress
        if self.backend == "tensorrt":
            from ..engines.tensorrt import import_tensorrt

            import_tensorrt()  # BackendUnavailableError naming the package when absent
            if not device.startswith("cuda"):
                raise EngineSetError("the tensorrt backend builds on --device cuda")
        self.versions = backend_versions(self.backend)
        self.previous = self._previous_manifest()

    def _previous_manifest(self) -> Manifest | None:
        try:
            return Manifest.load(self.out_dir)
        except EngineSetError:
            return None

    # ------------------------------------------------------------------ planning
    def plan(self) -> list[tuple[str, str]]:
        out = []
        for stage in ("dit", "hift"):
            sp = self.profile.stage(stage)
            if sp is None:
                continue
            for mode in ("stream", "offline"):
                if sp.buckets(mode):
                    out.append((stage, mode))
        return out

    def _input_hash(self, stage: str, mode: str) -> str:
        sp = self.profile.stage(stage)
        return _digest({"weights": self.models.weights_hash, "stage": stage, "mode": mode, "backend": self.backend,
                        "device": self.device, "dtype": sp.dtype, "buckets": [b.key for b in sp.buckets(mode)],
                        "options": sp.options, "versions": self.versions, "format": 1})

    def _reusable(self, stage: str, mode: str, input_hash: str) -> EngineSpec | None:
        if self.previous is None:
            return None
        spec = self.previous.engine(stage, mode)
        if spec is None or spec.extra.get("input_hash") != input_hash or spec.backend != self.backend:
            return None
        if not os.path.isfile(os.path.join(self.out_dir, spec.file)):
            return None
        return spec

    # ------------------------------------------------------------------ building
    def build(self) -> Manifest:
        from tqdm import tqdm

        os.makedirs(self.out_dir, exist_ok=True)
        results: list[BuildResult] = []
        jobs = self.plan()
        bar = tqdm(jobs, desc=f"building {self.backend} engines", unit="engine", disable=not self.progress)
        for stage, mode in bar:
            bar.set_postfix_str(f"{stage}/{mode}")
            h = self._input_hash(stage, mode)
            spec = self._reusable(stage, mode, h)
            if spec is not None:
                results.append(BuildResult(spec, False, 0.0))
                continue
            t0 = time.perf_counter()
            spec = self._build_stage(stage, mode)
            spec.extra["input_hash"] = h
            spec.build_seconds = time.perf_counter() - t0
            results.append(BuildResult(spec, True, spec.build_seconds))
        commands = {}
        if self.profile.stage("ar") is not None:  # every backend: the runtime runs the AR itself unless TRT-LLM is built
            commands.update(self._build_ar_trtllm())
        manifest = Manifest(
            model={"source": self.models.source, "kind": self.models.kind, "weights_hash": self.models.weights_hash,
                   "config": self.models.config.to_dict()},
            backend=self.backend, device=self.device, dtype=self.profile.dtype, versions=self.versions,
            profile=self.profile.to_dict(), profile_hash=self.profile.profile_hash(),
            engines=[r.spec for r in results], created=now_iso(),
            build_seconds=sum(r.seconds for r in results), commands=commands)
        manifest.save(self.out_dir)
        self.results = results
        return manifest

    def _build_stage(self, stage: str, mode: str) -> EngineSpec:
        sp = self.profile.stage(stage)
        buckets = sp.buckets(mode)
        dtype = torch_dtype(sp.dtype)
        if stage == "dit":
            from .stage_exports import dit_export

            exp = dit_export(self.models.flow.estimator, mode == "stream", dtype, self.device)
        else:
            from .stage_exports import hift_export

            exp = hift_export(self.models.hift, mode, self.device)
        base = f"{stage}_{mode}"
        max_b = max(b.batch for b in buckets)
        lo = min(b.length_range[0] for b in buckets)
        hi = max(b.length for b in buckets)
        if self.backend in ("onnxruntime", "tensorrt"):
            onnx_path = os.path.join(self.out_dir, base + ".onnx")
            exp.to_onnx(onnx_path)
            file = base + ".onnx"
            extra = {"input_shapes": exp.input_shapes}
            if self.backend == "tensorrt":
                from ..engines.buckets import Bucket  # noqa: F401
                from .tensorrt_build import TensorRTOptions, build_plan

                opts = TensorRTOptions(opt_level=int(sp.options.get("opt_level", 3)),
                                       workspace_gb=float(sp.options.get("workspace_gb", 8)),
                                       timing_cache=os.path.join(self.out_dir, "timing.cache"))
                info = build_plan(onnx_path, os.path.join(self.out_dir, base + ".plan"), buckets, exp.input_shapes,
                                  opts)
                file = base + ".plan"
                extra.update(info)
        elif self.backend == "aoti":
            file = base + ".pt2"
            info = exp.to_aoti(os.path.join(self.out_dir, file), max_b, lo, hi)
            extra = {"input_shapes": exp.input_shapes, **info}
        else:  # pragma: no cover - resolve_backend guards
            raise EngineSetError(f"unknown backend {self.backend}")
        return EngineSpec(stage=stage, mode=mode, backend=self.backend, file=file, input_names=list(exp.input_names),
                          output_names=list(exp.output_names), buckets=[b.key for b in buckets], dtype=sp.dtype,
                          device=self.device, extra=extra)

    def _build_ar_trtllm(self) -> dict:
        """Merged-vocab HF checkpoint + the exact TensorRT-LLM commands; run only where tensorrt_llm imports."""
        from .hf_export import export_merged_hf
        from .trtllm import build_trtllm_engine, trtllm_commands

        sp = self.profile.stage("ar")
        hf_dir = os.path.join(self.out_dir, "ar_hf")
        dtype = torch_dtype(sp.dtype)
        meta_path = os.path.join(hf_dir, "cosytrt_metadata.json")
        stamp = {"weights": self.models.weights_hash, "dtype": sp.dtype}
        if not (os.path.isfile(meta_path) and json.load(open(meta_path)).get("cosytrt_build") == stamp):
            meta = export_merged_hf(self.models.llm, hf_dir, dtype=dtype)
            meta["cosytrt_build"] = stamp
            with open(meta_path, "w") as f:
                json.dump(meta, f, indent=1)
        ckpt = os.path.join(self.out_dir, "ar_trtllm_ckpt")
        eng = os.path.join(self.out_dir, "ar_trtllm_engine")
        max_b = max(b.batch for b in sp.buckets("decode")) if sp.buckets("decode") else 64
        seq = sp.max_seq_len or 2048
        kw = {"dtype": "bfloat16", "max_batch_size": max_b, "max_seq_len": seq, "max_input_len": max(1, seq // 2)}
        cmds = trtllm_commands(hf_dir, ckpt, eng, **kw)
        out = {"trtllm": [" ".join(shlex.quote(a) for a in c) for c in cmds], "trtllm_built": False,
               "ar_hf_checkpoint": "ar_hf"}
        try:
            build_trtllm_engine(hf_dir, ckpt, eng, **kw)
            out["trtllm_built"] = True
        except BackendUnavailableError as e:
            out["trtllm_note"] = str(e)
        return out


def build_engine_set(models: CosyVoice3Models, profile: Profile, backend: str, device: str, out_dir: str,
                     progress: bool = True) -> tuple[Manifest, list[BuildResult]]:
    b = EngineSetBuilder(models, profile, backend, device, out_dir, progress)
    m = b.build()
    return m, b.results
