"""Aggregates of per-request metrics: p50 / p95 / p99 of each timing, throughput, JSON export."""
from __future__ import annotations

import json

import numpy as np

FIELDS = ("T_tokenizer", "T_AR", "T_DiT", "T_vocoder", "T_queue", "ttfa", "total", "rtf")


def percentiles(values, qs=(50, 95, 99)) -> dict:
    vals = [float(v) for v in values if v is not None and np.isfinite(v)]
    if not vals:
        return {f"p{q}": None for q in qs} | {"mean": None, "n": 0}
    arr = np.asarray(vals)
    return {f"p{q}": float(np.percentile(arr, q)) for q in qs} | {"mean": float(arr.mean()), "n": len(vals)}


def aggregate(history, stage_stats: dict | None = None) -> dict:
    """`history`: RequestMetrics objects. Returns {field: {p50, p95, p99, mean, n}, ...} plus counts."""
    rows = [m.to_dict() for m in history]
    out = {"requests": len(rows), "failed": sum(1 for r in rows if r["error"]),
           "audio_seconds": float(sum(r["audio_seconds"] for r in rows))}
    for f in FIELDS:
        out[f] = percentiles([r[f] for r in rows])
    out["inter_chunk"] = percentiles([x for r in rows for x in r["inter_chunk"]])
    if stage_stats is not None:
        out["stages"] = stage_stats
    return out


def to_json(history, path: str, stage_stats: dict | None = None) -> None:
    with open(path, "w") as f:
        json.dump({"aggregate": aggregate(history, stage_stats), "requests": [m.to_dict() for m in history]}, f,
                  indent=1)
