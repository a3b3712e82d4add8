"""Parity metrics and thresholds: how an engine output is compared with the eager one (max abs / relative
error, cosine, SNR), the rules per stage and dtype, and the report (build/parity.py runs the checks)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

WAV_SAMPLES_PER_FRAME = 480
FP32_MAX_ABS = {"dit": 1e-3, "hift": 2e-3}  # golden README: flow mels 1e-3, HiFT wav 2e-3
REDUCED_MIN_SNR_DB = 30.0
REDUCED_MIN_COSINE = 0.999
PIPELINE_MIN_SNR_DB = {"float32": 40.0, "reduced": 20.0}
BOUNDARY_P99_FACTOR = 4.0

THRESHOLDS = {
    "float32": {"dit_max_abs": FP32_MAX_ABS["dit"], "hift_max_abs": FP32_MAX_ABS["hift"],
                "pipeline_min_snr_db": PIPELINE_MIN_SNR_DB["float32"]},
    "float16": {"min_snr_db": REDUCED_MIN_SNR_DB, "min_cosine": REDUCED_MIN_COSINE,
                "pipeline_min_snr_db": PIPELINE_MIN_SNR_DB["reduced"]},
    "bfloat16": {"min_snr_db": REDUCED_MIN_SNR_DB, "min_cosine": REDUCED_MIN_COSINE,
                 "pipeline_min_snr_db": PIPELINE_MIN_SNR_DB["reduced"]},
}


# ------------------------------------------------------------------------------------------------------ metrics

def compare(ref: torch.Tensor, out: torch.Tensor) -> dict:
    """max_abs_err, max_rel_err, cosine, snr_db of `out` against `ref` (float64; inf / nan when shapes differ or
    `out` is not finite)."""
    r = ref.detach().double().flatten().cpu()
    o = out.detach().double().flatten().cpu()
    if r.shape != o.shape:
        return {"max_abs_err": math.inf, "max_rel_err": math.inf, "cosine": math.nan, "snr_db": -math.inf,
                "shape_match": False}
    if r.numel() == 0:
        return {"max_abs_err": 0.0, "max_rel_err": 0.0, "cosine": 1.0, "snr_db": math.inf, "shape_match": True}
    if not bool(torch.isfinite(o).all()):
        return {"max_abs_err": math.inf, "max_rel_err": math.inf, "cosine": math.nan, "snr_db": -math.inf,
                "shape_match": True, "finite": False}
    err = (o - r).abs()
    peak = float(r.abs().max())
    floor = max(1e-3 * peak, 1e-30)
    nr, no = float(r.norm()), float(o.norm())
    cos = 1.0 if nr == 0 and no == 0 else (0.0 if nr == 0 or no == 0 else float(r.dot(o)) / (nr * no))
    noise = float((err * err).sum())
    snr = math.inf if noise == 0 else (10.0 * math.log10(float((r * r).sum()) / noise) if nr > 0 else -math.inf)
    return {"max_abs_err": float(err.max()), "max_rel_err": float((err / r.abs().clamp_min(floor)).max()),
            "cosine": cos, "snr_db": snr, "shape_match": True}


@dataclass(frozen=True)
class Rule:
    """Pass criterion: a max |error| bound (float32) or SNR and cosine floors (reduced precision)."""

    max_abs: float | None = None
    min_snr_db: float | None = None
    min_cosine: float | None = None

    def passed(self, m: dict) -> bool:
        if not m.get("shape_match", True) or m.get("finite") is False:
            return False
        ok = True
        if self.max_abs is not None:
            ok &= m["max_abs_err"] <= self.max_abs
        if self.min_snr_db is not None:
            ok &= m["snr_db"] >= self.min_snr_db
        if self.min_cosine is not None:
            ok &= m["cosine"] >= self.min_cosine
        return bool(ok)

    def describe(self) -> str:
        parts = []
        if self.max_abs is not None:
            parts.append(f"max |err| <= {self.max_abs:g}")
        if self.min_snr_db is not None:
            parts.append(f"SNR >= {self.min_snr_db:g} dB")
        if self.min_cosine is not None:
            parts.append(f"cosine >= {self.min_cosine:g}")
        return " and ".join(parts)

    def why(self, m: dict) -> str:
        """What broke the rule, in words."""
        if not m.get("shape_match", True):
            return "output shape differs"
        if m.get("finite") is False:
            return "engine output has inf/nan"
        out = []
        if self.max_abs is not None and not m["max_abs_err"] <= self.max_abs:
            out.append(f"max |err| {m['max_abs_err']:.3e} > {self.max_abs:g}")
        if self.min_snr_db is not None and not m["snr_db"] >= self.min_snr_db:
            out.append(f"SNR {m['snr_db']:.1f} dB < {self.min_snr_db:g} dB")
        if self.min_cosine is not None and not m["cosine"] >= self.min_cosine:
            out.append(f"cosine {m['cosine']:.6f} < {self.min_cosine:g}")
        return "; ".join(out)


def engine_rule(stage: str, dtype: str) -> Rule:
    if dtype == "float32":
        return Rule(max_abs=FP32_MAX_ABS["hift" if stage == "hift" else "dit"])
    return Rule(min_snr_db=REDUCED_MIN_SNR_DB, min_cosine=REDUCED_MIN_COSINE)


def pipeline_min_snr(dtypes: list[str]) -> float:
    return PIPELINE_MIN_SNR_DB["float32" if all(d == "float32" for d in dtypes) else "reduced"]


# ------------------------------------------------------------------------------------------------------- checks

@dataclass
class Check:
    name: str
    kind: str  # "engine" | "polygraphy" | "pipeline_stream" | "hift_batch"
    passed: bool
    rule: str
    stage: str | None = None
    mode: str | None = None
    bucket: str | None = None
    case: str | None = None
    dtype: str | None = None
    batch: int | None = None
    lengths: list[int] | None = None
    metrics: dict = field(default_factory=dict)
    note: str = ""
    details: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("name", "kind", "stage", "mode", "bucket", "case", "dtype", "batch",
                                           "lengths")}
        for k in ("max_abs_err", "max_rel_err", "cosine", "snr_db"):
            d[k] = self.metrics.get(k)
        d.update(rule=self.rule, passed=self.passed, note=self.note, details=self.details)
        return _json_safe(d)


@dataclass
class ParityReport:
    engines: str
    model: str
    backend: str
    device: str
    checks: list[Check]

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]

    def to_dict(self) -> dict:
        return {"engines": self.engines, "model": self.model, "backend": self.backend, "device": self.device,
                "thresholds": THRESHOLDS, "checks": [c.to_dict() for c in self.checks],
                "failed": [c.name for c in self.failed], "passed": self.passed}


def _json_safe(v):
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    return v
