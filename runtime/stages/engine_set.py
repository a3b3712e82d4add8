"""Loading an engine set into a pipeline: manifest checks, one runner per engine, bucketed stage callables."""
from __future__ import annotations

import torch

from ...engines.manifest import Manifest, set_path
from ...engines import open_runner
from ...engines.buckets import BucketTable, ShapeStats, parse_key
from ...engines.errors import CosytrtError, EngineSetError, InputError
from .bucketed import BucketedDiT


def check_ar_runner(manifest: Manifest, folder: str) -> str:
    """The AR runner a set expects (manifest `ar_runner`), checked here: a known name, and for `trtllm` the
    TensorRT-LLM package and the engine directory (BackendUnavailableError / EngineSetError say which is missing)."""
    import os

    from ...engines import AR_RUNNERS

    name = manifest.ar_runner
    if name not in AR_RUNNERS:
        raise EngineSetError(f"{folder}: the manifest expects AR runner {name!r}; this cosytrt has "
                             f"{', '.join(AR_RUNNERS)}")
    if name == "trtllm":
        from .ar_trtllm import import_executor_api

        import_executor_api()
        for sub in ("ar_trtllm_engine", manifest.commands.get("ar_hf_checkpoint", "ar_hf")):
            if not os.path.isdir(os.path.join(folder, sub)):
                raise EngineSetError(f"{folder}: the manifest expects the trtllm AR runner but {sub}/ is missing")
    return name


class CompiledSet:
    """A `compiled` engine set opened on this machine: its cache pre-loaded, its CUDA-graph profile and dtype."""

    def __init__(self, folder: str, manifest: Manifest, profile_path: str, dtype, load_seconds: float):
        self.folder, self.manifest, self.profile_path = folder, manifest, profile_path
        self.dtype, self.load_seconds = dtype, load_seconds
        self.ar_runner = manifest.ar_runner

    def check_model(self, models) -> None:
        """The cache is bound to the architecture (not the weights' values): refuse another config."""
        import json

        if self.manifest.model.get("config") != json.loads(json.dumps(models.config.to_dict())):
            raise EngineSetError(f"{self.folder}: compiled for another model configuration "
                                 f"({self.manifest.model.get('source')}): rebuild it with `trtbuild build --backend "
                                 f"compiled --model ...`")


def open_compiled_set(folder: str, device) -> CompiledSet | None:
    """None unless `folder` is a `compiled` engine set; else check it (torch version, GPU model, digest, AR runner)
    and pre-load its compile cache, before anything compiles."""
    import os

    from .compiled import load_engine_set_cache

    manifest = Manifest.load(folder)
    if manifest.backend != "compiled":
        return None
    check_ar_runner(manifest, folder)
    secs = load_engine_set_cache(folder, manifest.compile_cache, device)
    profile_path = os.path.join(folder, manifest.compile_cache.get("profile_file", "profile.yaml"))
    if not os.path.isfile(profile_path):
        raise EngineSetError(f"compiled engine set lacks its profile file {profile_path}")
    dt = manifest.compile_cache.get("dtype")
    dtype = getattr(torch, dt) if dt else None
    return CompiledSet(folder, manifest, profile_path, dtype, secs)


class LoadedEngineSet:
    """An engine set opened for one device: the manifest, runners per (stage, mode), and the call statistics."""

    def __init__(self, folder: str, weights_hash: str, device: str = "cpu", model_file_hashes: dict | None = None,
                 verify: bool = True):
        """`verify`: re-hash every file of the set against the manifest first (EngineSetError naming a changed or
        missing file); `model_file_hashes`: the loaded model directory's {file: sha256}, checked against the
        manifest's record (a corrupted checkpoint or frontend is named)."""
        self.folder = folder
        self.manifest = Manifest.load(folder)
        if self.manifest.backend == "compiled":
            raise EngineSetError(f"{folder} is a compiled engine set (a torch.compile cache): load it with "
                                 "TTS.load(engines=...) / `trtbuild serve --engines`")
        if model_file_hashes:
            self.manifest.check_model_files(model_file_hashes)
        self.manifest.check_compatible(weights_hash)
        self.ar_runner = check_ar_runner(self.manifest, folder)
        if self.manifest.backend == "tensorrt" and not str(device).startswith("cuda"):
            raise EngineSetError("a TensorRT engine set needs device='cuda'")
        if verify:
            self.manifest.verify(folder)
        waste = float(self.manifest.profile.get("max_padding_waste", 1.5))
        self.runners = {}
        self.tables = {}
        for spec in self.manifest.engines:
            set_path(folder, spec.file)  # inside the set (the manifest reader checked the name; this, symlinks)
            try:
                runner = open_runner(spec, folder, device)
            except CosytrtError:
                raise
            except Exception as e:  # noqa: BLE001 - a backend's own error on a bad file (e.g. InvalidProtobuf)
                raise EngineSetError(f"engine set {folder!r}: cannot load {spec.file} ({spec.backend}): "
                                     f"{type(e).__name__}: {e}") from None
            buckets = [parse_key(k) for k in spec.buckets]
            if spec.backend == "aoti" and str(device).startswith("cuda"):
                runner = _graphed(runner, spec, buckets, device)
            self.runners[(spec.stage, spec.mode)] = runner
            self.tables[(spec.stage, spec.mode)] = BucketTable(buckets, waste)
        self.stats = ShapeStats()

    def stage(self, stage: str) -> tuple[dict, dict]:
        runners = {m: r for (s, m), r in self.runners.items() if s == stage}
        tables = {m: t for (s, m), t in self.tables.items() if s == stage}
        return runners, tables


def _graphed(runner, spec, buckets, device):
    """An AOTInductor package on CUDA, captured once per static bucket (loaded with run_single_threaded=True)."""
    from ...engines.base import torch_dtype
    from ...engines.cudagraph import CudaGraphRunner, example_from_templates

    dt = torch_dtype(spec.dtype) if spec.stage == "dit" else torch.float32
    example = example_from_templates(spec.extra["input_shapes"], spec.input_names,
                                     {n: dt for n in spec.input_names}, device)
    return CudaGraphRunner(lambda *args: runner.model(*args), spec, device, buckets, example)


def attach_engine_set(pipeline, folder: str) -> LoadedEngineSet:
    """Route the pipeline's DiT (and HiFT) calls through the engine set's buckets."""
    models = pipeline.models
    return _install(pipeline, LoadedEngineSet(folder, models.weights_hash, str(pipeline.device),
                                              getattr(models, "file_hashes", None)))


def _install(pipeline, es, eager_dit=None):
    """Point the pipeline's DiT calls and offline HiFT calls at the set's bucketed runners (`eager_dit`: what runs
    shapes no bucket covers; default the flow's eager DiT)."""
    from .bucketed import BucketedHiFT

    runners, tables = es.stage("dit")
    eager_dit = pipeline.models.flow.estimator if eager_dit is None else eager_dit
    pipeline.token2wav.estimator = BucketedDiT(eager_dit, runners, tables, es.stats)
    runners, tables = es.stage("hift")
    if runners:
        pipeline.token2wav.hift_runner = BucketedHiFT(pipeline.models.hift, runners, tables, es.stats)
    pipeline.engine_set = es
    return es


class GraphedEagerSet:
    """No engine files: the eager DiT and HiFT captured as CUDA graphs per static bucket of a profile (`compile`: the
    DiT and the HiFT compiled by torch.compile first, see `compiled.py`; `use_hift_variant` switches the HiFT back
    to the eager vocoder's graphs)."""

    def __init__(self, pipeline, profile, progress: bool = False, compile: bool = False):
        from ...engines.signatures import DIT_INPUTS, DIT_OUTPUT
        from ...engines.base import EngineSpec
        from ...engines.cudagraph import CudaGraphRunner, example_from_templates
        from ..models.dit import FixedModeDiT

        device = str(pipeline.device)
        flow, hift = pipeline.models.flow, pipeline.models.hift
        dit = flow.estimator
        dtype = next(dit.parameters()).dtype
        dname = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
        c = dit.cfg
        dit_tpl = {"x": ["B", c.mel_dim, "T"], "mask": ["B", 1, "T"], "mu": ["B", c.mu_dim, "T"], "t": ["B"],
                   "spks": ["B", c.spk_dim], "cond": ["B", c.mel_dim, "T"]}
        self.stats = ShapeStats()
        self.manifest = None
        self.compiled_dit = None
        if compile:
            from .compiled import CompiledDiT

            self.compiled_dit = CompiledDiT.of(dit)
        self.runners, self.tables = {}, {}
        waste = profile.max_padding_waste
        for mode in ("stream", "offline"):
            buckets = profile.buckets("dit", mode)
            if not buckets:
                continue
            spec = EngineSpec("dit", mode, "cudagraph", "", list(DIT_INPUTS), [DIT_OUTPUT], [b.key for b in buckets],
                              dtype=dname, device=device)
            fn = FixedModeDiT(dit, mode == "stream") if not compile else self.compiled_dit.fixed(mode == "stream")
            self.runners[("dit", mode)] = CudaGraphRunner(
                fn, spec, device, buckets, example_from_templates(dit_tpl, list(DIT_INPUTS), {n: dtype for n in DIT_INPUTS},
                                                              device), progress)
            self.tables[("dit", mode)] = BucketTable(buckets, waste)
        # HiFT: the vocoder functions it can capture (`hift_fns`: eager and, with `compile`, compiled); only the one in
        # use is captured now, another on the first `use_hift_variant` switch to it (the benchmark compares both)
        self._hift, self._profile, self._device, self._progress = hift, profile, device, progress
        self.hift_fns = {"eager": (lambda mel: hift.inference(mel, finalize=True)[0],
                                   lambda m, src: hift.decode(m, src, finalize=False))}
        if compile:
            from .compiled import CompiledHiFT

            compiled_hift = CompiledHiFT.of(hift)
            self.hift_fns["compiled"] = (compiled_hift.offline, compiled_hift.stream_window)
        self._hift_graphs: dict = {}
        self.hift_variant = "compiled" if compile else "eager"
        offline_runner, self.stream_decoder = self.hift_graphs(self.hift_variant)
        if offline_runner is not None:
            self.runners[("hift", "offline")] = offline_runner
            self.tables[("hift", "offline")] = BucketTable(profile.buckets("hift", "offline"), waste)

    def hift_graphs(self, name: str) -> tuple:
        """(offline runner, streaming window decoder) of the HiFT variant `name`, captured on first use; either is
        None when the profile has no bucket for it."""
        if name not in self._hift_graphs:
            offline_fn, window_fn = self.hift_fns[name]
            hift, profile, device = self._hift, self._profile, self._device
            self._hift_graphs[name] = (self._hift_offline_runner(hift, profile, offline_fn, device, self._progress),
                                       self._hift_stream_decoder(hift, profile, window_fn, device))
        return self._hift_graphs[name]

    @staticmethod
    def _hift_offline_runner(hift, profile, fn, device: str, progress: bool):
        """Offline HiFT (`fn(mel) -> wav`) captured per static offline bucket, or None without offline buckets."""
        from ...engines.base import EngineSpec
        from ...engines.cudagraph import CudaGraphRunner, example_from_templates

        buckets = profile.buckets("hift", "offline")
        if not buckets:
            return None
        spf = hift.samples_per_frame
        tpl = {"mel": ["B", 80, "T"], "sine_noise": [1, f"T*{spf}", hift.cfg.nb_harmonics + 1]}
        spec = EngineSpec("hift", "offline", "cudagraph", "", ["mel", "sine_noise"], ["wav"],
                          [b.key for b in buckets], device=device)
        return CudaGraphRunner(lambda mel, noise: fn(mel), spec, device, buckets,
                               example_from_templates(tpl, ["mel", "sine_noise"], {}, device), progress)

    def _hift_stream_decoder(self, hift, profile, fn, device: str):
        """Non-final streaming HiFT windows (`fn(mel, source) -> wav`) captured per static stream bucket, or None."""
        from ...engines.cuda_graphs import GraphCache
        from .bucketed import BucketedStreamDecoder

        buckets = [b for b in profile.buckets("hift", "stream") if not b.dynamic]
        if not buckets:
            return None
        cache = GraphCache(fn, device)
        spf = hift.samples_per_frame
        for b in sorted(buckets, key=lambda b: -b.cost):
            cache.capture(b.key, (torch.full((b.batch, hift.cfg.in_channels, b.length), -4.0, device=device),
                                  torch.zeros(b.batch, 1, b.length * spf, device=device)))
        return BucketedStreamDecoder(hift, lambda bucket, m, src: cache.run(bucket.key, m, src).clone(),
                                     BucketTable(buckets, profile.max_padding_waste), self.stats)

    stage = LoadedEngineSet.stage


def use_hift_variant(pipeline, name: str) -> None:
    """Switch a pipeline built by `attach_cuda_graphs(..., compile=True)` between its HiFT graphs: "compiled" (the
    default there) or "eager" (captured on the first switch to it, so call this between requests). Swaps the offline
    runner and the streaming window decoder; the audio is the same up to float rounding (max abs error ~1e-4 on the
    H200, run 13)."""
    es = getattr(pipeline, "engine_set", None)
    variants = getattr(es, "hift_fns", None) or {}
    if name not in variants:
        raise InputError(f"no HiFT variant {name!r} on this pipeline (has: {sorted(variants) or 'none'})")
    offline_runner, stream_decoder = es.hift_graphs(name)
    runner = pipeline.token2wav.hift_runner
    if offline_runner is not None and runner is not None:
        runner.runners["offline"] = offline_runner
        es.runners[("hift", "offline")] = offline_runner
    if stream_decoder is not None:
        pipeline.models.hift.stream_decoder = stream_decoder
    es.stream_decoder = stream_decoder
    es.hift_variant = name


def attach_cuda_graphs(pipeline, profile, progress: bool = False, compile: bool = False) -> GraphedEagerSet:
    """Route DiT calls, offline HiFT calls and streaming HiFT windows through CUDA graphs of the eager modules (one
    per static bucket of `profile`); `compile`: graphs of the torch.compile'd DiT and HiFT (uncovered DiT shapes run
    the compiled DiT too)."""
    graphed = GraphedEagerSet(pipeline, profile, progress, compile)
    es = _install(pipeline, graphed, graphed.compiled_dit)
    if es.stream_decoder is not None:
        pipeline.models.hift.stream_decoder = es.stream_decoder
    return es
