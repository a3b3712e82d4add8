"""Engine-vs-eager parity: every engine and bucket of an engine set against the eager models, plus pipeline checks.

Comparing outputs is its own module (as in Polygraphy); `trtbuild parity` (tools/parity.py) is the command line.

Per engine and bucket, seeded inputs at three shapes: `min_len` (full batch at the smallest length the bucket
serves: `min_frames` of a dynamic bucket, ceil(length / max_padding_waste) of a static one), `max_len` (full batch at
the bucket length) and `ragged` (rows of different lengths with masks, one unused batch slot when the bucket has more
than two rows). The engine side runs through the runtime's own pad → run → crop (`BucketedDiT._run` for the DiT);
the eager side runs each row alone at its own length. Metrics over the real rows: max abs error, max relative error
(|err| / max(|ref|, 1e-3 max|ref|)), cosine similarity, SNR in dB.

Thresholds (`THRESHOLDS`, printed by the CLI): float32 engines use the golden README bounds on max |error| (DiT
estimator output ≤ 1e-3 like the flow mels, HiFT wav ≤ 2e-3); float16 / bfloat16 engines need SNR ≥ 30 dB and cosine
≥ 0.999. The HiFT tail rule: a right-padded final (finalize) row differs from the row alone only in its last 480
samples, which the runtime recomputes; engine-level HiFT checks leave those samples out.

Polygraphy: where both sides are Polygraphy runners its `Comparator` runs too, at the `max_len` inputs: an eager
runner (a `BaseRunner` over the PyTorch module) vs `OnnxrtRunner` on the ONNX file, and vs `TrtRunner` on the plan
(its bucket's optimization profile) when `tensorrt` imports. `polygraphy` is imported only there.

Pipeline level: one streaming request through the engine set vs eager (same seed and tokens): audio SNR ≥ 40 dB for a
float32 set (the golden streaming bound), ≥ 20 dB with reduced-precision engines; chunk lengths equal; continuity: at
each chunk boundary the jump |a[k] - a[k-1]| of the engine audio minus that of the eager audio must stay within
max(2 x the wav bound, 4 x the 99th percentile of the same quantity away from the boundaries). With HiFT engines: a
padded batch of ragged mels vs the same rows alone, through the runtime's HiFT wrapper when it has one (whole rows),
else through the engine with the tail rule.

JSON (`ParityReport.to_dict()`, `trtbuild parity --json`):
  engines, model, backend, device   what was checked
  thresholds                        {dtype: {"dit_max_abs", "hift_max_abs"} or {"min_snr_db", "min_cosine"}, and
                                     "pipeline_min_snr_db"}
  checks                            list, one per check: name, kind ("engine" | "polygraphy" | "pipeline_stream" |
                                     "hift_batch"), stage, mode, bucket, case, dtype, batch, lengths, max_abs_err,
                                     max_rel_err, cosine, snr_db, rule (text), passed, note, details (kind-specific:
                                     pipeline chunk lengths, boundary jumps, engine/fallback call counts)
  failed                            names of the failed checks
  passed                            true when every check passed
Non-finite numbers are written as the strings "inf", "-inf", "nan".
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from ..engines.buckets import Bucket, parse_key
from ..engines.errors import EngineSetError

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


# ------------------------------------------------------------------------------------------------------- shapes

def bucket_cases(bucket: Bucket, max_padding_waste: float, min_len: int = 1) -> list[tuple[str, list[int]]]:
    """(case, row lengths) to test a bucket with: min_len and max_len (full batch) and ragged (masked rows of
    different lengths, one batch slot unused when the bucket has more than two rows)."""
    lo, hi = bucket.length_range
    if not bucket.dynamic:
        lo = math.ceil(hi / max_padding_waste)
    hi = max(hi, min_len)
    lo = min(max(lo, min_len), hi)
    B = bucket.batch
    cases = [("min_len", [lo] * B), ("max_len", [hi] * B)]
    rows = B if B <= 2 else B - 1
    if rows >= 2:
        lengths = [int(round(hi - (hi - lo) * i / (rows - 1))) for i in range(rows)]
        cases.append(("ragged", lengths))
    return cases


# ------------------------------------------------------------------------------------------------------- inputs

def dit_case_inputs(dit, lengths: list[int], seed: int) -> tuple[torch.Tensor, ...]:
    """Seeded (x, mask, mu, t, spks, cond) for rows of `lengths` (right-padded to the longest, as Flow.collate)."""
    from .export_dit import example_inputs

    p = next(dit.parameters())
    n = max(lengths)
    x, mask, mu, t, spks, cond = example_inputs(dit, len(lengths), n, dtype=torch.float32, device=p.device, seed=seed)
    for i, L in enumerate(lengths):
        mask[i, :, L:] = 0
        mu[i, :, L:] = 0
        cond[i, :, L:] = 0
    return x, mask, mu, t, spks, cond


def hift_case_mels(hift, lengths: list[int], seed: int) -> list[torch.Tensor]:
    """Seeded log-mel-like rows [80, n_i] (around -4, as real mels)."""
    g = torch.Generator().manual_seed(seed)
    dev = hift.sine_waves.device
    return [(torch.randn(hift.cfg.in_channels, n, generator=g) * 1.5 - 4.0).to(dev) for n in lengths]


def hift_kept_samples(hift, frames: int, finalize: bool) -> int:
    return (frames if finalize else frames - hift.held_back_frames) * hift.samples_per_frame


def hift_engine_feeds(spec, hift, bucket: Bucket, mel: torch.Tensor) -> dict[str, torch.Tensor]:
    """Engine inputs for a padded mel [batch, 80, L]: `mel` and the fixed sine noise from sample 0 (its shape from the
    manifest's template, [1, L*480, 9] by default), as the runtime's BucketedHiFT feeds them."""
    from ..engines.dtypes import torch_dtype
    from ..engines.shapes import resolve_shape

    templates = spec.extra.get("input_shapes", {})
    feeds = {}
    for name in spec.input_names:
        if name == "mel":
            feeds[name] = mel.to(torch_dtype(spec.dtype))
        elif name == "sine_noise":
            tpl = templates.get(name, [1, f"T*{hift.samples_per_frame}", hift.harmonics])
            shape = resolve_shape(tpl, bucket.batch, int(mel.shape[-1]))
            src = hift.sine_waves[:, :shape[1], :shape[2]].to(mel.device)
            if src.shape[1] < shape[1]:
                raise EngineSetError(f"{spec.file}: sine_noise needs {shape[1]} samples, the noise buffer has "
                                     f"{src.shape[1]}")
            feeds[name] = src.expand(shape[0], -1, -1).contiguous()
        else:
            raise EngineSetError(f"{spec.file}: parity does not know how to make HiFT input {name!r}")
    return feeds


def run_hift_engine(runner, hift, bucket: Bucket, mels: list[torch.Tensor], finalize: bool) -> list[torch.Tensor]:
    """Right-pad mels into the bucket, run the engine, crop each row to its own output length."""
    lengths = [int(m.shape[-1]) for m in mels]
    L = bucket.run_length(max(lengths))
    mel = torch.zeros(bucket.batch, hift.cfg.in_channels, L, device=mels[0].device)
    for i, m in enumerate(mels):
        mel[i, :, :lengths[i]] = m
    out = runner.run(hift_engine_feeds(runner.spec, hift, bucket, mel), bucket)[runner.spec.output_names[0]].float()
    return [out[i, :hift_kept_samples(hift, n, finalize)] for i, n in enumerate(lengths)]


# --------------------------------------------------------------------------------------------------- polygraphy

def polygraphy_compare(eager_fn, input_names: list[str], feed: dict[str, np.ndarray], targets: list[tuple[str, object]],
                       rule: Rule) -> tuple[bool, str]:
    """Polygraphy Comparator: an eager runner vs each (name, runner) target on one feed. Returns (passed, note)."""
    from polygraphy.backend.base import BaseRunner
    from polygraphy.common import TensorMetadata
    from polygraphy.comparator import Comparator
    from polygraphy.logger import G_LOGGER

    class EagerRunner(BaseRunner):
        """A Polygraphy runner over a PyTorch callable (dict of tensors -> dict of tensors), on any device."""

        def __init__(self):
            super().__init__(name="eager", prefix="eager-runner")

        def activate_impl(self):
            pass

        def get_input_metadata_impl(self):
            meta = TensorMetadata()
            for n in input_names:
                meta.add(n, dtype=feed[n].dtype, shape=feed[n].shape)
            return meta

        def infer_impl(self, feed_dict):
            import time

            t0 = time.perf_counter()
            with torch.inference_mode():
                out = eager_fn({k: torch.from_numpy(np.asarray(v)) for k, v in feed_dict.items()})
            self.inference_time = time.perf_counter() - t0
            return {k: np.ascontiguousarray(v.detach().float().cpu().numpy()) for k, v in out.items()}

        def deactivate_impl(self):
            pass

    funcs = _polygraphy_funcs(rule)
    if funcs is None:
        return True, "polygraphy has no SNR/cosine compare functions here: skipped"
    runners = [EagerRunner()] + [r for _, r in targets]
    with G_LOGGER.verbosity(G_LOGGER.CRITICAL):
        results = Comparator.run(runners, data_loader=[{k: np.ascontiguousarray(v) for k, v in feed.items()}])
        acc = Comparator.compare_accuracy(results, compare_func=funcs,
                                          comparisons=[(0, i) for i in range(1, len(runners))])
    return bool(acc), "eager-runner vs " + ", ".join(n for n, _ in targets)


def _polygraphy_funcs(rule: Rule):
    import polygraphy.comparator as pc

    if rule.max_abs is not None:
        if hasattr(pc, "SimpleCompareFunc"):
            return [pc.SimpleCompareFunc(atol=rule.max_abs, rtol=0.0, check_error_stat="max")]
        return [pc.CompareFunc.simple(atol=rule.max_abs, rtol=0.0, check_error_stat="max")]
    if hasattr(pc, "SnrCompareFunc") and hasattr(pc, "CosineSimilarityCompareFunc"):
        return [pc.SnrCompareFunc(snr_threshold=rule.min_snr_db),
                pc.CosineSimilarityCompareFunc(cosine_similarity_threshold=rule.min_cosine)]
    return None


def polygraphy_targets(spec, folder: str, bucket: Bucket, device: str, session=None) -> list[tuple[str, object]]:
    """Polygraphy runners for an engine file: OnnxrtRunner on its ONNX file (`session`: an open InferenceSession of
    it to reuse); TrtRunner on its plan (the bucket's optimization profile) where tensorrt imports."""
    base, ext = os.path.splitext(spec.file)
    onnx_path = os.path.join(folder, base + ".onnx")
    targets = []
    if spec.backend in ("onnxruntime", "tensorrt") and os.path.isfile(onnx_path):
        from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx

        if session is not None:  # the engine's own ONNX Runtime session
            targets.append(("onnxrt-runner", OnnxrtRunner(session)))
        else:
            providers = ["cuda", "cpu"] if str(device).startswith("cuda") else ["cpu"]
            targets.append(("onnxrt-runner", OnnxrtRunner(SessionFromOnnx(onnx_path, providers=providers))))
    if spec.backend == "tensorrt" and ext == ".plan":
        from ..engines.tensorrt import tensorrt_version

        if tensorrt_version():
            from polygraphy.backend.common import BytesFromPath
            from polygraphy.backend.trt import EngineFromBytes, TrtRunner

            from ..engines.shapes import profile_index

            k = profile_index(spec.buckets, bucket)
            eng = EngineFromBytes(BytesFromPath(os.path.join(folder, spec.file)))
            targets.append(("trt-runner", TrtRunner(eng, optimization_profile=k)))
    return targets


# ------------------------------------------------------------------------------------------------------ checker

class ParityChecker:
    """Runs every parity check of one engine set against eager models.

    models: the eager CosyVoice3Models the set was built from. check_weights=False accepts a set whose manifest
    names other weights (diagnosing a set built from another checkpoint)."""

    def __init__(self, models, folder: str, device: str = "cpu", *, check_weights: bool = True, seed: int = 0,
                 polygraphy: bool = True, pipeline: bool = True, stream_tokens: int = 80,
                 prompt_seconds: float = 1.0):
        from ..engines.manifest import Manifest

        self.models = models
        self.folder = folder
        self.device = str(device)
        self.seed = seed
        self.use_polygraphy = polygraphy
        self.use_pipeline = pipeline
        self.stream_tokens = stream_tokens
        self.prompt_seconds = prompt_seconds
        self.manifest = Manifest.load(folder)
        if not check_weights:
            built = self.manifest.model.get("weights_hash")
            models = dataclasses.replace(models, weights_hash=built, file_hashes={})
        self.eager_pipeline, self.engine_pipeline = self._pipelines(models)
        self.engine_set = self.engine_pipeline.backends.engine_set

    def _pipelines(self, models):
        from ..runtime.stages.engine_set import attach_engine_set
        from ..runtime.stages.pipeline import Pipeline, make_frontend

        frontend, speaker = make_frontend(models)
        eager = Pipeline(self.models, frontend, speaker)
        engine = Pipeline(models, frontend, speaker)  # its own StageBackends
        attach_engine_set(engine, self.folder)
        return eager, engine

    # ---------------------------------------------------------------- entry point
    def run(self) -> ParityReport:
        checks: list[Check] = []
        for spec in self.manifest.engines:
            checks += self.check_engine(spec)
        if self.use_pipeline:
            if self.manifest.engine("dit", "stream") or self.manifest.engine("dit", "offline"):
                checks += self.check_stream_pipeline()
            if any(e.stage == "hift" for e in self.manifest.engines):
                checks += self.check_hift_batch()
        return ParityReport(self.folder, str(self.models.source), self.manifest.backend, self.device, checks)

    # ---------------------------------------------------------------- per engine
    def check_engine(self, spec) -> list[Check]:
        if spec.stage not in ("dit", "hift"):
            return [Check(f"{spec.stage}/{spec.mode}", "engine", True, "", spec.stage, spec.mode, dtype=spec.dtype,
                          note=f"stage {spec.stage} is not checked here (the LM runs in the runtime)")]
        runner = self.engine_set.runners[(spec.stage, spec.mode)]
        table = self.engine_set.tables[(spec.stage, spec.mode)]
        rule = engine_rule(spec.stage, spec.dtype)
        out = []
        for key in spec.buckets:
            bucket = parse_key(key)
            min_len = 2 if spec.stage == "dit" else self._hift_min_len(spec.mode == "offline")
            feed = None
            for i, (case, lengths) in enumerate(bucket_cases(bucket, table.max_padding_waste, min_len)):
                seed = self.seed + 101 * i + 7 * bucket.length + bucket.batch
                c = Check(f"{key} {case}", "engine", False, rule.describe(), spec.stage, spec.mode, key, case,
                          spec.dtype, len(lengths), lengths)
                try:
                    if spec.stage == "dit":
                        m, f = self._dit_case(runner, bucket, spec.mode == "stream", lengths, seed)
                    else:
                        m, f, c.note = self._hift_case(runner, bucket, spec.mode == "offline", lengths, seed)
                    if case == "max_len":
                        feed = f
                    c.metrics = m
                    c.passed = rule.passed(m)
                    if not c.passed:
                        c.note = "; ".join(x for x in (rule.why(m), c.note) if x)
                except Exception as e:  # noqa: BLE001 - a failing engine is a failed check, not a crash
                    c.note = f"engine error: {type(e).__name__}: {e}"
                out.append(c)
            if self.use_polygraphy and feed is not None:
                out += self._polygraphy_check(spec, bucket, feed, rule)
        return out

    def _hift_min_len(self, finalize: bool) -> int:
        h = self.models.hift
        return 2 if finalize else h.held_back_frames + 2

    @torch.inference_mode()
    def _dit_case(self, runner, bucket, streaming: bool, lengths: list[int], seed: int):
        from ..runtime.stages.bucketed import BucketedDiT

        dit = self.models.flow.estimator
        x, mask, mu, t, spks, cond = dit_case_inputs(dit, lengths, seed)
        got = BucketedDiT._run(runner, bucket, x, mask, mu, t, spks, cond)
        feed = None
        if len(set(lengths)) == 1:  # no padding inside the batch: one eager call is the same as rows alone
            ref = dit(x, mask, mu, t, spks, cond, streaming=streaming)
            if len(lengths) == bucket.batch:
                feed = {"x": x, "mask": mask, "mu": mu, "t": t, "spks": spks, "cond": cond}
            return compare(ref, got[:, :, :lengths[0]]), feed
        refs, outs = [], []
        for i, n in enumerate(lengths):
            r = dit(x[i:i + 1, :, :n], mask[i:i + 1, :, :n], mu[i:i + 1, :, :n], t[i:i + 1], spks[i:i + 1],
                    cond[i:i + 1, :, :n], streaming=streaming)
            refs.append(r.float().flatten())
            outs.append(got[i, :, :n].float().flatten())
        return compare(torch.cat(refs), torch.cat(outs)), feed

    @torch.inference_mode()
    def _hift_case(self, runner, bucket, finalize: bool, lengths: list[int], seed: int):
        hift = self.models.hift
        mels = hift_case_mels(hift, lengths, seed)
        got = run_hift_engine(runner, hift, bucket, mels, finalize)
        width = bucket.run_length(max(lengths))
        refs, outs, tails = [], [], 0
        for m, g, n in zip(mels, got, lengths):
            r = hift.inference(m.unsqueeze(0), finalize)[0][0]
            if finalize and n < width:  # the tail rule: the last frame of a padded final row is recomputed
                r, g = r[:-WAV_SAMPLES_PER_FRAME], g[:-WAV_SAMPLES_PER_FRAME]
                tails += 1
            refs.append(r.float())
            outs.append(g.float())
        note = (f"tail rule: last {WAV_SAMPLES_PER_FRAME} samples of {tails} padded final row(s) left out"
                if tails else "")
        feed = None
        if len(set(lengths)) == 1 and len(lengths) == bucket.batch:
            feed = {"mel": torch.stack(mels)}
        return compare(torch.cat(refs), torch.cat(outs)), feed, note

    def _polygraphy_check(self, spec, bucket: Bucket, feed: dict, rule: Rule) -> list[Check]:
        name = f"{bucket.key} polygraphy"
        width = int(next(iter(feed.values())).shape[-1])
        if spec.dtype == "bfloat16":
            return [Check(name, "polygraphy", True, rule.describe(), spec.stage, spec.mode, bucket.key, "max_len",
                          spec.dtype, note="skipped: numpy feeds have no bfloat16")]
        try:
            runner = self.engine_set.runners[(spec.stage, spec.mode)]
            session = getattr(runner, "session", None) if spec.backend == "onnxruntime" else None
            targets = polygraphy_targets(spec, self.folder, bucket, self.device, session)
        except ImportError as e:
            return [Check(name, "polygraphy", True, rule.describe(), spec.stage, spec.mode, bucket.key, "max_len",
                          spec.dtype, note=f"skipped: {e} (Polygraphy comes with pip install -e '.[parity]')")]
        if not targets:
            return []
        if spec.stage == "dit":
            from ..runtime.models.dit import FixedModeDiT

            module = FixedModeDiT(self.models.flow.estimator, spec.mode == "stream").eval()
            names = list(spec.input_names)

            def eager_fn(f):
                dev = next(module.parameters()).device
                return {spec.output_names[0]: module(*[f[n].to(dev, torch.float32) for n in names])}

            np_feed = {n: feed[n].cpu().numpy().astype(_np_dtype(spec.dtype)) for n in names}
        else:
            hift = self.models.hift
            finalize = spec.mode == "offline"
            np_feed = {n: np.ascontiguousarray(v.cpu().numpy())
                       for n, v in hift_engine_feeds(spec, hift, bucket, feed["mel"]).items()}
            names = list(spec.input_names)

            def eager_fn(f):
                dev = hift.sine_waves.device
                return {spec.output_names[0]: hift.inference(f["mel"].to(dev, torch.float32), finalize)[0]}

        try:
            ok, note = polygraphy_compare(eager_fn, names, np_feed, targets, rule)
            if not ok:
                note = f"Polygraphy Comparator: {note}: outputs differ beyond {rule.describe()}"
        except Exception as e:  # noqa: BLE001
            ok, note = False, f"polygraphy error: {type(e).__name__}: {e}"
        return [Check(name, "polygraphy", ok, rule.describe(), spec.stage, spec.mode, bucket.key, "max_len",
                      spec.dtype, bucket.batch, [width] * bucket.batch, note=note)]

    # ---------------------------------------------------------------- pipeline
    def _stream_request(self):
        from ..runtime.stages.request import Request, default_voice_wav
        from ..runtime.models.sampling import SamplingParams

        wav = default_voice_wav(16000, self.prompt_seconds)
        return Request(text="Parity check of a streaming request through the engine set.", prompt_wav=wav,
                       prompt_sr=16000, stream=True,
                       sampling=SamplingParams(seed=self.seed, force_tokens=self.stream_tokens))

    def check_stream_pipeline(self) -> list[Check]:
        dtypes = [e.dtype for e in self.manifest.engines if e.stage in ("dit", "hift")]
        min_snr = pipeline_min_snr(dtypes)
        wav_bound = FP32_MAX_ABS["hift"]
        rule = (f"audio SNR >= {min_snr:g} dB, same chunk lengths, boundary jump deviation <= max("
                f"{2 * wav_bound:g}, {BOUNDARY_P99_FACTOR:g} x p99 away from boundaries)")
        c = Check("pipeline stream", "pipeline_stream", False, rule, dtype=",".join(sorted(set(dtypes))))
        try:
            ref_chunks = [np.asarray(x) for x in self.eager_pipeline.run(self._stream_request())]
            stats = self.engine_set.stats
            stats.reset()
            eng_chunks = [np.asarray(x) for x in self.engine_pipeline.run(self._stream_request())]
            summary = stats.summary()
        except Exception as e:  # noqa: BLE001
            c.note = f"error: {type(e).__name__}: {e}"
            return [c]
        ref_len = [int(x.size) for x in ref_chunks]
        eng_len = [int(x.size) for x in eng_chunks]
        ref, eng = np.concatenate(ref_chunks), np.concatenate(eng_chunks)
        m = compare(torch.from_numpy(ref), torch.from_numpy(eng))
        c.metrics = m
        c.batch, c.lengths = 1, ref_len
        c.details = {"chunk_lengths_eager": ref_len, "chunk_lengths_engine": eng_len,
                     "engine_calls": summary["hits"], "fallback_calls": summary["fallbacks"],
                     "fallback_reasons": {k: v["fallback_reasons"] for k, v in summary["stages"].items()}}
        problems = []
        if ref_len != eng_len:
            problems.append(f"chunk lengths differ: engine {eng_len} vs eager {ref_len}")
        elif len(ref_len) > 1:
            bounds = np.cumsum(ref_len)[:-1]
            d_ref = np.diff(ref.astype(np.float64))
            d_eng = np.diff(eng.astype(np.float64))
            dev = np.abs(np.abs(d_eng) - np.abs(d_ref))
            at = bounds - 1  # d[k-1] = a[k] - a[k-1]: the jump into the first sample of the next chunk
            away = np.ones(dev.size, bool)
            away[at] = False
            p99 = float(np.quantile(dev[away], 0.99)) if away.any() else 0.0
            limit = max(2 * wav_bound, BOUNDARY_P99_FACTOR * p99)
            jumps = [{"sample": int(k + 1), "jump_engine": float(abs(d_eng[k])), "jump_eager": float(abs(d_ref[k])),
                      "deviation": float(dev[k])} for k in at]
            c.details.update(boundaries=jumps, boundary_limit=limit)
            bad = [j for j in jumps if j["deviation"] > limit]
            if bad:
                problems.append(f"discontinuity at chunk boundary sample(s) {[j['sample'] for j in bad]} "
                                f"(jump deviation {max(j['deviation'] for j in bad):.3e} > {limit:.3e})")
        else:
            c.details["boundaries"] = []
            c.note = "one chunk only: no boundary to check"
        if m["snr_db"] < min_snr:
            problems.append(f"audio SNR {m['snr_db']:.1f} dB < {min_snr:g} dB")
        if summary["hits"] == 0:
            c.note = "; ".join(x for x in (c.note, "no DiT call of this request hit a bucket (all eager)") if x)
        c.passed = not problems
        if problems:
            c.note = "; ".join(problems + ([c.note] if c.note else []))
        return [c]

    @torch.inference_mode()
    def check_hift_batch(self) -> list[Check]:
        """Padded HiFT batch vs the same rows alone (the tail rule): per HiFT engine, its largest bucket of >= 2 rows
        filled with ragged rows. Offline rows go through the runtime's HiFT wrapper when it has one (it recomputes
        the tails: whole rows compared), else through the engine with the tail rule."""
        hift = self.models.hift
        vocoder = self.engine_pipeline.backends.hift_offline
        out = []
        for spec in self.manifest.engines:
            if spec.stage != "hift":
                continue
            finalize = spec.mode == "offline"
            rule = engine_rule("hift", spec.dtype)
            name = f"hift/{spec.mode} padded batch vs rows alone"
            multi = [parse_key(k) for k in spec.buckets if parse_key(k).batch >= 2]
            if not multi:
                out.append(Check(name, "hift_batch", True, rule.describe(), "hift", spec.mode, dtype=spec.dtype,
                                 note="skipped: no bucket of 2 or more rows"))
                continue
            bucket = max(multi, key=lambda b: (b.batch, b.length))
            table = self.engine_set.tables[("hift", spec.mode)]
            lo, hi = dict(bucket_cases(bucket, table.max_padding_waste, self._hift_min_len(finalize)))["min_len"][0], \
                bucket.length
            lengths = [int(round(hi - (hi - lo) * i / (bucket.batch - 1))) for i in range(bucket.batch)]
            c = Check(name, "hift_batch", False, rule.describe(), "hift", spec.mode, bucket.key, "ragged", spec.dtype,
                      len(lengths), lengths)
            try:
                mels = hift_case_mels(hift, lengths, self.seed + 13)
                refs = [hift.inference(m.unsqueeze(0), finalize)[0][0] for m in mels]
                got = None
                if vocoder is not None and hasattr(vocoder, "inference_batch") and finalize:
                    before = self._hift_hits()
                    got = vocoder.inference_batch(mels, finalize=True)
                    if self._hift_hits() > before:
                        c.note = "through the runtime's HiFT wrapper (tails recomputed): whole rows compared"
                    else:
                        got = None  # the wrapper ran it eagerly: compare the engine itself instead
                if got is None:
                    got = run_hift_engine(self.engine_set.runners[("hift", spec.mode)], hift, bucket, mels, finalize)
                    if finalize:
                        tail_err = 0.0
                        for i, n in enumerate(lengths):
                            if n < bucket.length:
                                t_ref, t_got = refs[i][-WAV_SAMPLES_PER_FRAME:], got[i][-WAV_SAMPLES_PER_FRAME:]
                                tail_err = max(tail_err, float((t_ref.float() - t_got.float()).abs().max()))
                                refs[i], got[i] = refs[i][:-WAV_SAMPLES_PER_FRAME], got[i][:-WAV_SAMPLES_PER_FRAME]
                        c.details["tail_max_abs_err"] = tail_err
                        c.note = (f"engine directly, tail rule: last {WAV_SAMPLES_PER_FRAME} samples of padded rows "
                                  f"left out (they differ by {tail_err:.3e} before the runtime recomputes them)")
                    else:
                        c.note = "non-final rows: exact as cropped"
                lens_ok = [int(g.numel()) for g in got] == [int(r.numel()) for r in refs]
                m = compare(torch.cat([r.float().flatten() for r in refs]),
                            torch.cat([g.float().flatten() for g in got])) if lens_ok else \
                    compare(torch.zeros(1), torch.zeros(2))
                c.metrics = m
                c.passed = lens_ok and rule.passed(m)
                if not c.passed:
                    c.note = "; ".join(x for x in (rule.why(m), "" if lens_ok else "row lengths differ", c.note) if x)
            except Exception as e:  # noqa: BLE001
                c.note = f"error: {type(e).__name__}: {e}"
            out.append(c)
        return out

    def _hift_hits(self) -> int:
        st = self.engine_set.stats.summary()["stages"].get("hift/offline")
        return st["hits"] if st else 0


def _np_dtype(dtype: str):
    return {"float32": np.float32, "float16": np.float16}.get(dtype, np.float32)


def run_parity(folder: str, model: str | None = None, device: str | None = None, **kw) -> ParityReport:
    """Load the eager models (default: the manifest's model source) and check the engine set in `folder`."""
    from ..engines.manifest import Manifest
    from ..runtime.models.loading import load_models

    man = Manifest.load(folder)
    device = device or man.device
    models = load_models(model or man.model.get("source") or "tiny", device=device)
    return ParityChecker(models, folder, device, **kw).run()
