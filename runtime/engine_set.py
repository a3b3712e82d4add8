"""Loading an engine set into a pipeline: manifest checks, one runner per engine, bucketed stage callables."""
from __future__ import annotations

from ..build.manifest import Manifest
from ..engines import open_runner
from .buckets import BucketTable, ShapeStats, parse_key
from .errors import EngineSetError
from .stage_runner import BucketedDiT


class LoadedEngineSet:
    """An engine set opened for one device: the manifest, runners per (stage, mode), and the call statistics."""

    def __init__(self, folder: str, weights_hash: str, device: str = "cpu"):
        self.folder = folder
        self.manifest = Manifest.load(folder)
        self.manifest.check_compatible(weights_hash)
        if self.manifest.backend == "tensorrt" and not str(device).startswith("cuda"):
            raise EngineSetError("a TensorRT engine set needs device='cuda'")
        waste = float(self.manifest.profile.get("max_padding_waste", 1.5))
        self.runners = {}
        self.tables = {}
        for spec in self.manifest.engines:
            self.runners[(spec.stage, spec.mode)] = open_runner(spec, folder, device)
            self.tables[(spec.stage, spec.mode)] = BucketTable([parse_key(k) for k in spec.buckets], waste)
        self.stats = ShapeStats()

    def stage(self, stage: str) -> tuple[dict, dict]:
        runners = {m: r for (s, m), r in self.runners.items() if s == stage}
        tables = {m: t for (s, m), t in self.tables.items() if s == stage}
        return runners, tables


def attach_engine_set(pipeline, folder: str) -> LoadedEngineSet:
    """Route the pipeline's DiT (and HiFT) calls through the engine set's buckets."""
    device = str(pipeline.device)
    es = LoadedEngineSet(folder, pipeline.models.weights_hash, device)
    runners, tables = es.stage("dit")
    pipeline.token2wav.estimator = BucketedDiT(pipeline.models.flow.estimator, runners, tables, es.stats)
    runners, tables = es.stage("hift")
    if runners:
        from .stage_runner import BucketedHiFT

        pipeline.token2wav.hift_runner = BucketedHiFT(pipeline.models.hift, runners, tables, es.stats)
    pipeline.engine_set = es
    return es
