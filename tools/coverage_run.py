"""Bucket coverage: replay a workload through the runtime (TTS + an engine set) and report how its stage calls fit.

The workload runs through the runtime's own scheduler, so the call shapes are the ones batching really makes. Every
bucketed stage call (the engine set's ShapeStats: hits and eager fallbacks) is recorded with its shape.

The pieces, one job each: coverage_workload.py (the requests: JSONL fields, the matrix, open-loop traffic),
coverage_replay.py (submitting them, recording the calls), coverage_report.py (report.json: hits, waste, fallbacks,
suggested buckets), coverage_plot.py (the heatmap). This module wires them (`run_coverage`) and re-exports their
public names.
"""
from __future__ import annotations

import json
import os

from .coverage_plot import plot_provenance, write_heatmap
from .coverage_replay import CallRecorder, ReplayResult, replay
from .coverage_report import batch_ladder, build_report, length_ladder, suggest_buckets
from .coverage_workload import (FILLER, WorkloadRequest, default_matrix, load_workload, open_loop_workload,
                                parse_request, text_of_tokens)

__all__ = ["CallRecorder", "FILLER", "ReplayResult", "WorkloadRequest", "batch_ladder", "build_report",
           "default_matrix", "length_ladder", "load_workload", "open_loop_workload", "parse_request",
           "plot_provenance", "replay", "run_coverage", "suggest_buckets", "text_of_tokens", "write_heatmap"]


def run_coverage(engines: str, requests: list[WorkloadRequest], model: str | None = None, device: str | None = None,
                 out_dir: str | None = None, source: str = "", timeout_s: float = 600.0, progress: bool = False,
                 waste_target: float | None = 1.25, tts=None) -> dict:
    """Load TTS with the engine set (or use `tts`), replay `requests`, build the report; with `out_dir` write
    report.json and heatmap.png there."""
    from ..engines.manifest import Manifest

    man = Manifest.load(engines)
    own = tts is None
    if own:
        from ..runtime.tts import TTS

        tts = TTS.load(model or man.model.get("source") or "tiny", engines=engines, device=device or man.device)
    try:
        res = replay(tts, requests, timeout_s, progress)
    finally:
        if own:
            tts.close()
    es = tts.pipeline.backends.engine_set
    models = tts.pipeline.models
    meta = {"engines": engines, "backend": man.backend, "device": str(tts.pipeline.device),
            "model": str(models.source), "max_padding_waste": float(man.profile.get("max_padding_waste", 1.5)),
            "workload": {"source": source, "requests": res.requests, "groups": res.groups,
                         "wall_seconds": res.wall_seconds, "failed": res.failed}}
    report = build_report(res.calls, es.tables, meta,
                          {"dit": models.flow.max_frames, "hift": models.hift.max_frames}, waste_target)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        write_heatmap(report, es.tables, os.path.join(out_dir, "heatmap.png"))
        report["heatmap"] = "heatmap.png"
        with open(os.path.join(out_dir, "report.json"), "w") as f:
            json.dump(report, f, indent=1)
    return report
