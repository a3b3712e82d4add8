"""Build an engine set: every (stage, mode) of a profile through one backend, into a folder with a manifest.

Backends: `onnxruntime` (ONNX files; ORT picks its provider at load), `aoti` (AOTInductor `.pt2` packages, CPU or
CUDA), `tensorrt` (ONNX → plans with one optimization profile per bucket; needs `tensorrt`, or TensorRT for RTX, which
also builds with --device cpu: see `tensorrt_build_device`). The AR LM runs in the
runtime (static KV cache + CUDA graphs) for those backends; with `tensorrt` the merged-vocab HF checkpoint and the
TensorRT-LLM build commands are written too (and run when `tensorrt_llm` is importable).

Incremental: an engine whose inputs (weights, profile buckets, dtype, backend versions) are unchanged is not rebuilt.

Atomic: the set is written into a sibling temporary folder (`OUT.partial-PID`; reusable files of the previous set
are hard-linked or copied in) and renamed over OUT only once every engine is built and the manifest (with the sha256
of every file) is written; a failed build removes the temporary folder and leaves OUT as it was.

HiFT: only the offline (finalize) graph is built. The streaming vocoder (runtime/hift_stream.py) carries f0 and the
sine phase across windows and calls only the conv stack (`HiFT.decode(mel, source)`), so a whole-HiFT graph of a
window (`HiFTOnnxGraph(finalize=False)`) cannot serve it; the profile's `hift.stream` buckets are used by the CUDA-graph
path (`attach_cuda_graphs`), which captures that conv stack per bucket.
"""
from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import time
from dataclasses import dataclass

import torch

from ..engines.base import EngineSpec
from ..engines.dtypes import torch_dtype
from ..engines.errors import BackendUnavailableError, EngineSetError
from ..runtime.models.loading import CosyVoice3Models
from ..runtime.stages.profile import Profile
from ..engines.manifest import MANIFEST, Manifest, backend_versions, hash_set_files, now_iso, set_path

BACKENDS = ("onnxruntime", "aoti", "tensorrt", "compiled")  # compiled: torch.compile's cache, no engine files


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


def tensorrt_build_device(device: str) -> str:
    """The device a `tensorrt` engine set is built for. TensorRT plans run on CUDA only, so the set's device is
    "cuda"; `--device cpu` is allowed with TensorRT for RTX only, whose build is ahead of time and needs no GPU
    (the ONNX exports run on the CPU, the plans target the GPUs TensorRT-RTX supports; see engines/tensorrt.py).
    TensorRT 10/11 times kernels on the GPU it builds on: --device cuda."""
    if device.startswith("cuda"):
        return device
    from ..engines.tensorrt import select_tensorrt

    lib = select_tensorrt()[1]
    if not lib.rtx:
        raise EngineSetError(f"the tensorrt backend builds on --device cuda with {lib} (it times kernels on the GPU); "
                             f"only TensorRT for RTX builds without one")
    return "cuda"


def check_out_dir(out_dir: str) -> str:
    """The absolute engine-set folder `out_dir`, refused (EngineSetError) when replacing it could destroy something
    that is not an engine set: an empty name, a file, the current folder or one above it, or a folder that holds
    files but no manifest.json (the build replaces OUT as a whole)."""
    if not isinstance(out_dir, str) or not out_dir.strip():
        raise EngineSetError(f"--out {out_dir!r}: give the engine-set folder to write")
    final = os.path.abspath(out_dir)
    if os.path.exists(final) and not os.path.isdir(final):
        raise EngineSetError(f"--out {out_dir!r} exists and is not a folder")
    above = os.path.dirname(final)
    while not os.path.exists(above) and os.path.dirname(above) != above:
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        raise EngineSetError(f"--out {out_dir!r}: {above} is a file, not a folder")
    if not os.access(above, os.W_OK):
        raise EngineSetError(f"--out {out_dir!r}: folder {above} is not writable")
    try:
        cwd = os.path.realpath(os.getcwd())
    except OSError:
        cwd = None
    real = os.path.realpath(final)
    if cwd is not None and os.path.commonpath([real, cwd]) == real:
        raise EngineSetError(f"--out {out_dir!r} is the current folder or one above it: the build replaces that "
                             f"folder as a whole; name a new folder (e.g. engine_sets/NAME)")
    if os.path.isdir(final) and not _looks_like_engine_set(final):
        try:
            entries = os.listdir(final)
        except OSError as e:
            raise EngineSetError(f"--out {out_dir!r}: cannot read the folder ({e})") from None
        if entries:
            raise EngineSetError(f"--out {out_dir!r} is a folder that is not empty and not an engine set (no "
                                 f"manifest.json of cosytrt's): the build replaces that folder as a whole, so it "
                                 f"refuses; name a new or empty folder")
    return final


def _looks_like_engine_set(folder: str) -> bool:
    """A manifest.json that is a JSON object with cosytrt's manifest keys (any format version: an old set may be
    rebuilt over); a stray manifest.json of something else (`{}`, another tool's) does not make a folder one."""
    try:
        with open(os.path.join(folder, MANIFEST), encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(d, dict) and isinstance(d.get("format"), int) and {"backend", "profile"} <= d.keys()


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
                 progress: bool = True, onnx_dir: str | None = None):
        self.models = models
        self.onnx_dir = onnx_dir  # tensorrt: share ONNX exports between engine sets (<stage>_<mode>_<dtype>.onnx)
        self.profile = profile
        self.device = device
        self.export_device = device  # where the models run for export (differs only for an ahead-of-time build)
        self.backend = resolve_backend(backend, device)
        self.out_dir = out_dir
        self.progress = progress
        if self.backend == "tensorrt":
            from ..engines.tensorrt import import_tensorrt

            import_tensorrt()  # BackendUnavailableError naming the package when absent
            self.device = tensorrt_build_device(device)
        self.versions = backend_versions(self.backend)
        self.previous = self._previous_manifest()

    def _previous_manifest(self) -> Manifest | None:
        try:
            return Manifest.load(self.out_dir)
        except EngineSetError:
            return None

    # ------------------------------------------------------------------ planning
    # (stage, mode) pairs an engine file is built for; hift/stream is not (see the module docstring)
    BUILT = (("dit", "stream"), ("dit", "offline"), ("hift", "offline"))

    def plan(self) -> list[tuple[str, str]]:
        if self.backend == "compiled":  # no engine file per stage: one compile cache for the whole pipeline
            return []
        out = []
        for stage, mode in self.BUILT:
            sp = self.profile.stage(stage)
            if sp is not None and sp.buckets(mode):
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
        try:
            path = set_path(self.out_dir, spec.file)
        except EngineSetError:
            return None
        if not os.path.isfile(path) or self.previous.files.get(spec.file) != _sha(path):
            return None  # missing or changed since its build: rebuild it
        return spec

    # ------------------------------------------------------------------ building
    def build(self) -> Manifest:
        """Build into a temporary sibling folder, then rename it over `out_dir` (nothing half-written is left)."""
        final = check_out_dir(self.out_dir)
        parent = os.path.dirname(final)
        os.makedirs(parent, exist_ok=True)
        work = f"{final}.partial-{os.getpid()}"
        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(work)
        try:
            manifest = self._build_into(work, final)
            old = None
            if os.path.isdir(final):
                old = f"{final}.old-{os.getpid()}"
                os.replace(final, old)
            try:
                os.replace(work, final)
            except BaseException:
                if old:
                    os.replace(old, final)  # put the previous set back
                raise
            if old:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        return manifest

    def _carry(self, rel: str, work: str) -> None:
        """Bring a reusable file or folder of the previous set into the work folder (hard link, else copy)."""
        src = os.path.join(self.out_dir, rel)
        dst = os.path.join(work, rel)
        if os.path.isdir(src):
            shutil.copytree(src, dst, copy_function=_link_or_copy, dirs_exist_ok=True)
        elif os.path.isfile(src):
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            _link_or_copy(src, dst)

    def _build_into(self, work: str, final: str) -> Manifest:
        from tqdm import tqdm

        results: list[BuildResult] = []
        jobs = self.plan()
        if self.backend == "aoti":  # fail in seconds, not after compiling the engines before the bad one
            self.check_exports([j for j in jobs if self._reusable(*j, self._input_hash(*j)) is None])
        if self.backend == "tensorrt" and os.path.isfile(os.path.join(self.out_dir, "timing.cache")):
            shutil.copy2(os.path.join(self.out_dir, "timing.cache"), work)  # a copy: TensorRT rewrites it
        bar = tqdm(jobs, desc=f"building {self.backend} engines", unit="engine", disable=not self.progress)
        for stage, mode in bar:
            bar.set_postfix_str(f"{stage}/{mode}")
            h = self._input_hash(stage, mode)
            spec = self._reusable(stage, mode, h)
            if spec is not None:
                self._carry(spec.file, work)
                results.append(BuildResult(spec, False, 0.0))
                continue
            t0 = time.perf_counter()
            spec = self._build_stage(stage, mode, work)
            spec.extra["input_hash"] = h
            spec.build_seconds = time.perf_counter() - t0
            results.append(BuildResult(spec, True, spec.build_seconds))
        commands = {}
        if self.profile.stage("ar") is not None:  # every backend: the runtime runs the AR itself unless TRT-LLM is built
            commands.update(self._build_ar_trtllm(work, final))
        compile_cache = self._build_compile_cache(work) if self.backend == "compiled" else {}
        manifest = Manifest(
            model={"source": self.models.source, "kind": self.models.kind, "weights_hash": self.models.weights_hash,
                   "config": self.models.config.to_dict(), "files": dict(getattr(self.models, "file_hashes", {}))},
            backend=self.backend, device=self.device, dtype=self.profile.dtype, versions=self.versions,
            profile=self.profile.to_dict(), profile_hash=self.profile.profile_hash(),
            engines=[r.spec for r in results], created=now_iso(),
            build_seconds=sum(r.seconds for r in results) + compile_cache.get("compile_seconds", 0.0),
            commands=commands, ar_runner="trtllm" if commands.get("trtllm_built") else "torch",
            compile_cache=compile_cache, files=hash_set_files(work),
            tensorrt_library=self.versions.get("tensorrt_library", "") if self.backend == "tensorrt" else "")
        manifest.save(work)
        self.results = results
        return manifest

    def _stage_export(self, stage: str, mode: str):
        """(StageExport, buckets, max batch, min length, max length) of one planned engine."""
        sp = self.profile.stage(stage)
        buckets = sp.buckets(mode)
        dtype = torch_dtype(sp.dtype)
        if stage == "dit":
            from .stage_exports import dit_export

            exp = dit_export(self.models.flow.estimator, mode == "stream", dtype, self.export_device)
        else:
            from .stage_exports import hift_export

            # options reduce_phase / stft_matmul: export variants for the CUDA EP (issue #22), see HiFTOnnxGraph
            exp = hift_export(self.models.hift, mode, self.export_device,
                              reduce_phase=bool(sp.options.get("reduce_phase", False)),
                              stft_matmul=bool(sp.options.get("stft_matmul", False)))
        return (exp, buckets, max(b.batch for b in buckets), min(b.length_range[0] for b in buckets),
                max(b.length for b in buckets))

    def check_exports(self, jobs: list[tuple[str, str]] | None = None) -> None:
        """AOTInductor: torch.export every planned engine over its ranges before compiling any (seconds each), so a
        range that cannot be exported fails the build at once, naming the engine."""
        from tqdm import tqdm

        self._programs = getattr(self, "_programs", {})
        jobs = self.plan() if jobs is None else jobs
        for stage, mode in tqdm(jobs, desc="torch.export", unit="engine", disable=not self.progress or not jobs):
            exp, _, max_b, lo, hi = self._stage_export(stage, mode)
            try:
                self._programs[(stage, mode)] = exp.check_export(max_b, lo, hi)  # compiled later, not re-exported
            except EngineSetError as e:
                raise EngineSetError(f"{stage}/{mode} (batch <= {max_b}, length {lo}..{hi}): {e}") from None

    def _build_stage(self, stage: str, mode: str, out_dir: str) -> EngineSpec:
        sp = self.profile.stage(stage)
        exp, buckets, max_b, lo, hi = self._stage_export(stage, mode)
        base = f"{stage}_{mode}"
        if self.backend in ("onnxruntime", "tensorrt"):
            if stage == "dit":  # torch.onnx.export(dynamo=True) imports onnxscript
                from cosytrt.extras import require

                require("onnxscript", "onnx", f"building {self.backend} engines (the DiT's ONNX export)")
            onnx_path = os.path.join(out_dir, base + ".onnx")
            if self.backend == "tensorrt" and self.onnx_dir:
                onnx_path = self._shared_onnx(exp, f"{base}_{sp.dtype}")
            else:
                exp.to_onnx(onnx_path)
            file = base + ".onnx"
            extra = {"input_shapes": exp.input_shapes}
            if self.backend == "tensorrt":
                from ..engines.buckets import Bucket  # noqa: F401
                from .tensorrt_build import TensorRTOptions, build_plan

                opts = TensorRTOptions(opt_level=int(sp.options.get("opt_level", 3)),
                                       workspace_gb=float(sp.options.get("workspace_gb", 8)),
                                       timing_cache=os.path.join(out_dir, "timing.cache"),
                                       compute_capabilities=list(sp.options.get("compute_capabilities", [])),
                                       max_threads=sp.options.get("max_threads"))
                info = build_plan(onnx_path, os.path.join(out_dir, base + ".plan"), buckets, exp.input_shapes,
                                  opts)
                file = base + ".plan"
                extra.update(info, onnx=os.path.relpath(onnx_path, self.out_dir))
                if self.progress:
                    print(f"{base} ({sp.dtype}): {info['tensorrt_library']} parsed {onnx_path} in "
                          f"{info['parse_seconds']:.1f} s, built {len(buckets)} profiles in {info['seconds']:.1f} s, "
                          f"plan {info['plan_bytes'] / 2**20:.1f} MiB", flush=True)
        elif self.backend == "aoti":
            file = base + ".pt2"
            program = getattr(self, "_programs", {}).pop((stage, mode), None)
            info = exp.to_aoti(os.path.join(out_dir, file), max_b, lo, hi, program=program)
            extra = {"input_shapes": exp.input_shapes, **info}
        else:  # pragma: no cover - resolve_backend guards
            raise EngineSetError(f"unknown backend {self.backend}")
        return EngineSpec(stage=stage, mode=mode, backend=self.backend, file=file, input_names=list(exp.input_names),
                          output_names=list(exp.output_names), buckets=[b.key for b in buckets], dtype=sp.dtype,
                          device=self.device, extra=extra)

    def _shared_onnx(self, exp, name: str) -> str:
        """Export to `onnx_dir/name.onnx` unless an export of the same weights is there already."""
        os.makedirs(self.onnx_dir, exist_ok=True)
        path = os.path.join(self.onnx_dir, name + ".onnx")
        stamp = path + ".json"
        want = {"weights_hash": self.models.weights_hash, "input_shapes": exp.input_shapes}
        if os.path.isfile(path) and os.path.isfile(stamp):
            with open(stamp) as f:
                if json.load(f) == json.loads(json.dumps(want)):
                    return path
        exp.to_onnx(path)
        with open(stamp, "w") as f:
            json.dump(want, f)
        return path

    def _build_compile_cache(self, work: str) -> dict:
        """Backend `compiled`: compile what a compiled server compiles (same model, device, dtype and CUDA-graph
        profile) and keep Inductor's artifacts; reused while torch, the GPU model, the config and the profile are
        unchanged (see build/compile_cache.py)."""
        import yaml

        from ..runtime.stages.compiled import COMPILE_CACHE_FILE, compile_scope, device_name
        from .compile_cache import build_compile_cache

        stamp = json.loads(json.dumps({"config": self.models.config.to_dict(), "profile_hash": self.profile.profile_hash(),
                                       "torch": torch.__version__, "device_name": device_name(self.device),
                                       "scope": compile_scope()}))
        prev = self.previous.compile_cache if self.previous is not None else {}
        if prev.get("stamp") == stamp and os.path.isfile(os.path.join(self.out_dir, COMPILE_CACHE_FILE)):
            for rel in (COMPILE_CACHE_FILE, prev.get("profile_file", "profile.yaml")):
                self._carry(rel, work)
            return prev
        profile_path = os.path.join(work, "profile.yaml")
        with open(profile_path, "w") as f:
            yaml.safe_dump(self.profile.to_dict(), f, sort_keys=False)
        dtype = torch_dtype(self.profile.dtype) if self.device.startswith("cuda") else None
        entry = build_compile_cache(work, self.models.source, self.device, profile_path, dtype)
        entry["stamp"] = stamp
        entry["profile_file"] = "profile.yaml"
        entry["scope"] = stamp["scope"]  # the compile scope the cache holds (the runtime compiles the same way)
        return entry

    def _build_ar_trtllm(self, work: str, final: str) -> dict:
        """Merged-vocab HF checkpoint + the exact TensorRT-LLM commands (naming the final folder); run only where
        tensorrt_llm imports."""
        from .hf_export import export_merged_hf
        from .trtllm import build_trtllm_engine, trtllm_commands

        sp = self.profile.stage("ar")
        hf_dir = os.path.join(work, "ar_hf")
        dtype = torch_dtype(sp.dtype)
        meta_path = os.path.join(hf_dir, "cosytrt_metadata.json")
        stamp = {"weights": self.models.weights_hash, "dtype": sp.dtype}
        if _read_json(os.path.join(self.out_dir, "ar_hf", "cosytrt_metadata.json")).get("cosytrt_build") == stamp:
            self._carry("ar_hf", work)  # the previous set's checkpoint is current (never rewritten in place)
        else:
            meta = export_merged_hf(self.models.llm, hf_dir, dtype=dtype)
            meta["cosytrt_build"] = stamp
            with open(meta_path, "w") as f:
                json.dump(meta, f, indent=1)
        ckpt = os.path.join(work, "ar_trtllm_ckpt")
        eng = os.path.join(work, "ar_trtllm_engine")
        max_b = max(b.batch for b in sp.buckets("decode")) if sp.buckets("decode") else 64
        seq = sp.max_seq_len or 2048
        kw = {"dtype": "bfloat16", "max_batch_size": max_b, "max_seq_len": seq, "max_input_len": max(1, seq // 2)}
        cmds = trtllm_commands(*(os.path.join(final, d) for d in ("ar_hf", "ar_trtllm_ckpt", "ar_trtllm_engine")),
                               **kw)
        out = {"trtllm": [" ".join(shlex.quote(a) for a in c) for c in cmds], "trtllm_built": False,
               "ar_hf_checkpoint": "ar_hf"}
        try:
            build_trtllm_engine(hf_dir, ckpt, eng, **kw)
            out["trtllm_built"] = True
        except BackendUnavailableError as e:
            out["trtllm_note"] = str(e)
        return out


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            d = json.load(f)
        return d if isinstance(d, dict) else {}
    except (OSError, ValueError):
        return {}


def _sha(path: str) -> str:
    from ..engines.manifest import sha256_file

    return sha256_file(path)


def _link_or_copy(src: str, dst: str) -> str:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    return dst


def build_engine_set(models: CosyVoice3Models, profile: Profile, backend: str, device: str, out_dir: str,
                     progress: bool = True, onnx_dir: str | None = None) -> tuple[Manifest, list[BuildResult]]:
    b = EngineSetBuilder(models, profile, backend, device, out_dir, progress, onnx_dir)
    m = b.build()
    return m, b.results
