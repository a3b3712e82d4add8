"""Loading an engine set into a pipeline: manifest checks, one runner per engine, bucketed stage callables."""
from __future__ import annotations

import torch

from ...engines.manifest import Manifest, set_path
from ...engines import open_runner
from ...engines.buckets import BucketTable, ShapeStats, parse_key
from ...engines.dtypes import dtype_name
from ...engines.errors import CosytrtError, EngineSetError, InputError
from .backends import StageBackends
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
    if manifest.compile_cache.get("scope"):  # compile the way the cache was built (else every compile misses it)
        from .compiled import set_compile_scope

        set_compile_scope(manifest.compile_cache["scope"])
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

    def close(self) -> None:
        for runner in self.runners.values():
            runner.close()

    def stage(self, stage: str) -> tuple[dict, dict]:
        runners = {m: r for (s, m), r in self.runners.items() if s == stage}
        tables = {m: t for (s, m), t in self.tables.items() if s == stage}
        return runners, tables


def _graphed(runner, spec, buckets, device):
    """An AOTInductor package on CUDA, captured once per static bucket (loaded with run_single_threaded=True)."""
    from ...engines.dtypes import torch_dtype
    from ...engines.cudagraph import CudaGraphRunner, example_from_templates

    dt = torch_dtype(spec.dtype) if spec.stage == "dit" else torch.float32
    example = example_from_templates(spec.extra["input_shapes"], spec.input_names,
                                     {n: dt for n in spec.input_names}, device)
    return CudaGraphRunner(lambda *args: runner.model(*args), spec, device, buckets, example)


def engine_set_backends(models, folder: str, device: str = "cpu") -> StageBackends:
    """StageBackends running the DiT (and HiFT) calls through an engine set's buckets (manifest checked against the
    models' weights and, when the model directory's files were hashed, against those files)."""
    return _backends(models, LoadedEngineSet(folder, models.weights_hash, str(device),
                                             getattr(models, "file_hashes", None)), name=f"engines:{folder}")


def attach_engine_set(pipeline, folder: str) -> StageBackends:
    """`engine_set_backends` for a pipeline's models, set on the pipeline (`Pipeline.set_backends`)."""
    backends = engine_set_backends(pipeline.models, folder, str(pipeline.device))
    pipeline.set_backends(backends)
    return backends


def _backends(models, es, eager_dit=None, hift_offline=None, stream_windows=None, name: str = "engines"):
    """The set's bucketed DiT (`eager_dit`: what runs shapes no bucket covers; default the flow's eager DiT) and, when
    it has HiFT engines, its bucketed offline HiFT."""
    from .bucketed import BucketedHiFT

    runners, tables = es.stage("dit")
    dit = BucketedDiT(models.flow.estimator if eager_dit is None else eager_dit, runners, tables, es.stats)
    if hift_offline is None:
        runners, tables = es.stage("hift")
        if runners:
            hift_offline = BucketedHiFT(models.hift, runners, tables, es.stats)
    return StageBackends(dit_stream=dit, dit_offline=dit, hift_offline=hift_offline,
                         hift_stream_windows=stream_windows, shape_stats=es.stats, engine_set=es, name=name,
                         closers=[es.close])


class GraphedEagerSet:
    """No engine files: the eager DiT and HiFT captured as CUDA graphs per static bucket of a profile (`compile`: the
    DiT and the HiFT compiled by torch.compile first, see `compiled.py`).

    Its HiFT can be captured from the eager vocoder or (with `compile`) the compiled one: `backends(hift)` gives the
    StageBackends of one variant, sharing the DiT graphs; a variant's HiFT graphs are captured on its first use."""

    def __init__(self, models, device, profile, progress: bool = False, compile: bool = False):
        from ...engines.signatures import DIT_INPUTS, DIT_OUTPUT
        from ...engines.base import EngineSpec
        from ...engines.cudagraph import CudaGraphRunner, example_from_templates
        from ..models.dit import FixedModeDiT

        device = str(device)
        self.models = models
        flow, hift = models.flow, models.hift
        dit = flow.estimator
        dtype = next(dit.parameters()).dtype
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
                              dtype=dtype_name(dtype), device=device)
            fn = FixedModeDiT(dit, mode == "stream") if not compile else self.compiled_dit.fixed(mode == "stream")
            self.runners[("dit", mode)] = CudaGraphRunner(
                fn, spec, device, buckets, example_from_templates(dit_tpl, list(DIT_INPUTS), {n: dtype for n in DIT_INPUTS},
                                                              device), progress)
            self.tables[("dit", mode)] = BucketTable(buckets, waste)
        self._hift, self._profile, self._device, self._progress = hift, profile, device, progress
        # prefix-cached streaming hops: forward_cached per (requests, new frames, prefix) bucket, captured when a
        # scheduler with the flow prefix cache starts (stages/flow_hop_calls.py)
        self.cached_hops = None
        if profile.cached_grid is not None:
            from .flow_hop_calls import CachedHopGraphs
            from .flow_hops import cached_dit_fn

            # compiled variant: the graphs replay the compiled forward_cached (dynamic shapes: one compile for every
            # bucket), as its whole-history calls replay the compiled DiT; eager hops are launch-bound (~1000
            # kernels per Euler step)
            self.cached_hops = CachedHopGraphs(dit, profile.cached_grid, device, dtype,
                                               fn=cached_dit_fn(flow, self.compiled_dit))
        self.hift_variants = {"eager": (lambda mel: hift.inference(mel, finalize=True)[0],
                                        lambda m, src: hift.decode(m, src, finalize=False))}
        if compile:
            from .compiled import CompiledHiFT

            compiled_hift = CompiledHiFT.of(hift)
            self.hift_variants["compiled"] = (compiled_hift.offline, compiled_hift.stream_window)
        self.default_hift = "compiled" if compile else "eager"
        self._hift_graphs: dict = {}
        if profile.buckets("hift", "offline"):
            self.tables[("hift", "offline")] = BucketTable(profile.buckets("hift", "offline"), waste)

    def backends(self, hift: str | None = None) -> StageBackends:
        """StageBackends with the DiT graphs and the HiFT graphs of variant `hift` ("eager", or "compiled" with
        `compile`; default: the compiled one when compiled)."""
        from .bucketed import BucketedHiFT

        name = hift or self.default_hift
        if name not in self.hift_variants:
            raise InputError(f"no HiFT variant {name!r} here (has: {sorted(self.hift_variants)})")
        offline_runner, stream_windows = self.hift_graphs(name)
        hift_offline = None
        if offline_runner is not None:
            if name == self.default_hift:  # what tools see as the set's offline HiFT engine
                self.runners[("hift", "offline")] = offline_runner
            hift_offline = BucketedHiFT(self._hift, {"offline": offline_runner},
                                        {"offline": self.tables[("hift", "offline")]}, self.stats)
        b = _backends(self.models, self, self.compiled_dit, hift_offline, stream_windows,
                      name=f"cuda-graphs{'+compile' if self.compiled_dit is not None else ''} hift={name}")
        b.dit_cached = self.cached_hops
        b.closers = []  # the set's graphs are shared by its variants: `close()` releases them
        return b

    def close(self) -> None:
        self.runners.clear()
        self._hift_graphs.clear()
        if self.cached_hops is not None:
            self.cached_hops.close()

    def hift_graphs(self, name: str) -> tuple:
        """(offline runner, streaming window decoder) of the HiFT variant `name`, captured on first use; either is
        None when the profile has no bucket for it."""
        if name not in self._hift_graphs:
            offline_fn, window_fn = self.hift_variants[name]
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
        """Streaming HiFT windows (`fn(mel, source) -> wav`, non-final) captured per static stream bucket, plus the
        final windows' tail (a final decode of `decode_left_context() + 1` frames) per batch; or None."""
        from ...engines.cuda_graphs import GraphCache
        from .bucketed import BucketedStreamDecoder

        buckets = [b for b in profile.buckets("hift", "stream") if not b.dynamic]
        if not buckets:
            return None
        cache = GraphCache(fn, device, group="hift")
        spf = hift.samples_per_frame
        for b in sorted(buckets, key=lambda b: -b.cost):
            cache.capture(b.key, (torch.full((b.batch, hift.cfg.in_channels, b.length), -4.0, device=device),
                                  torch.zeros(b.batch, 1, b.length * spf, device=device)))
        decoder = BucketedStreamDecoder(hift, lambda bucket, m, src: cache.run(bucket.key, m, src).clone(),
                                        BucketTable(buckets, profile.max_padding_waste), self.stats)
        decoder.tail = _tail_graphs(hift, sorted({b.batch for b in buckets}), decoder.tail_frames, device)
        return decoder

    stage = LoadedEngineSet.stage


def cuda_graph_backends(models, device, profile, progress: bool = False, compile: bool = False,
                        hift: str | None = None) -> StageBackends:
    """StageBackends routing DiT calls, offline HiFT calls and streaming HiFT windows through CUDA graphs of the
    eager modules (one per static bucket of `profile`); `compile`: graphs of the torch.compile'd DiT and HiFT
    (uncovered DiT shapes run the compiled DiT too). Other HiFT variants: `backends.engine_set.backends(name)`."""
    graphed = GraphedEagerSet(models, device, profile, progress, compile)
    backends = graphed.backends(hift)
    backends.closers = [graphed.close]
    return backends


def attach_cuda_graphs(pipeline, profile, progress: bool = False, compile: bool = False) -> StageBackends:
    """`cuda_graph_backends` for a pipeline's models, set on the pipeline (`Pipeline.set_backends`)."""
    backends = cuda_graph_backends(pipeline.models, pipeline.device, profile, progress, compile)
    pipeline.set_backends(backends)
    return backends


def _tail_graphs(hift, batches: list[int], frames: int, device: str):
    """The final streaming windows' tail, `tail(mel [b, 80, frames], source) -> wav`: a final decode captured as one
    CUDA graph per batch rung (rows padded with zeros: rows are independent); more rows than the largest rung run
    eagerly."""
    from ...engines.cuda_graphs import GraphCache

    spf = hift.samples_per_frame
    cache = GraphCache(lambda m, src: hift.decode(m, src, finalize=True), device, group="hift")
    for b in batches:
        cache.capture(b, (torch.full((b, hift.cfg.in_channels, frames), -4.0, device=device),
                          torch.zeros(b, 1, frames * spf, device=device)))

    def tail(mel: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        b = mel.shape[0]
        B = next((x for x in batches if x >= b), None)
        if B is None:
            return hift.decode(mel, source, finalize=True)
        if B > b:
            mel = torch.cat([mel, mel.new_zeros(B - b, *mel.shape[1:])])
            source = torch.cat([source, source.new_zeros(B - b, *source.shape[1:])])
        return cache.run(B, mel, source)[:b].clone()
    return tail
