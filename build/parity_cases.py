"""Parity inputs and engine calls: the seeded cases per bucket, DiT / HiFT engine feeds, and Polygraphy's
Comparator over an eager runner vs ONNX Runtime / TensorRT (build/parity.py runs the checks)."""
from __future__ import annotations

import math
import os

import numpy as np
import torch

from ..engines.buckets import Bucket
from ..engines.errors import EngineSetError

from .parity_metrics import Rule, compare


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
                       rule: Rule) -> tuple[bool, str, dict]:
    """Polygraphy Comparator: an eager runner vs each (name, runner) target on one feed. Returns (passed, note,
    metrics): `metrics` the worst target output's max abs / rel error, cosine and SNR (as `compare`; {} if none)."""
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
        return True, "polygraphy has no SNR/cosine compare functions here: skipped", {}
    runners = [EagerRunner()] + [r for _, r in targets]
    with G_LOGGER.verbosity(G_LOGGER.CRITICAL):
        results = Comparator.run(runners, data_loader=[{k: np.ascontiguousarray(v) for k, v in feed.items()}])
        acc = Comparator.compare_accuracy(results, compare_func=funcs,
                                          comparisons=[(0, i) for i in range(1, len(runners))])
    note = "eager-runner vs " + ", ".join(n for n, _ in targets)
    metrics = comparator_metrics(results)
    if metrics:
        note += f" (worst output: max |err| {metrics['max_abs_err']:.3e}, SNR {metrics['snr_db']:.1f} dB)"
    return bool(acc), note, metrics


def comparator_metrics(results) -> dict:
    """The worst (largest max |err|) of `compare` over every output of every target runner against the first runner
    (the eager one) in Polygraphy `RunResults`; {} when there is nothing to compare."""
    pairs = list(results.items()) if hasattr(results, "items") else list(results)
    if len(pairs) < 2 or not pairs[0][1]:
        return {}
    ref = pairs[0][1][0]
    worst: dict = {}
    for _, iters in pairs[1:]:
        if not iters:
            continue
        out = iters[0]
        for name in ref.keys():
            if name not in out.keys():
                continue
            m = compare(torch.from_numpy(np.asarray(ref[name], dtype=np.float64)),
                        torch.from_numpy(np.asarray(out[name], dtype=np.float64)))
            if not worst or m["max_abs_err"] > worst["max_abs_err"]:
                worst = m
    return worst


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
