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
import numpy as np
import torch

from ..engines.buckets import Bucket, parse_key
from .parity_cases import (bucket_cases, dit_case_inputs, hift_case_mels, hift_engine_feeds, polygraphy_compare,
                           polygraphy_targets, run_hift_engine)
from .parity_metrics import (BOUNDARY_P99_FACTOR, FP32_MAX_ABS, WAV_SAMPLES_PER_FRAME, Check, ParityReport, Rule,
                             compare, engine_rule, pipeline_min_snr)




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

        metrics: dict = {}
        try:
            ok, note, metrics = polygraphy_compare(eager_fn, names, np_feed, targets, rule)
            if not ok:
                note = f"Polygraphy Comparator: {note}: outputs differ beyond {rule.describe()}"
        except Exception as e:  # noqa: BLE001
            ok, note = False, f"polygraphy error: {type(e).__name__}: {e}"
        return [Check(name, "polygraphy", ok, rule.describe(), spec.stage, spec.mode, bucket.key, "max_len",
                      spec.dtype, bucket.batch, [width] * bucket.batch, metrics=metrics, note=note)]

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
