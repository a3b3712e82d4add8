"""Bucketed stage calls: pick the smallest bucket that fits, pad, run the engine, crop; eager fallback otherwise.

`BucketedDiT` is a drop-in `estimator` for Flow.solve: calls arrive as CFG batches (2B rows) of T frames.
Every call is recorded in a ShapeStats (hits, padding waste, fallbacks with their reason) for metrics() and the
coverage report.
"""
from __future__ import annotations

import time

import torch

from ...engines.buckets import BucketTable, ShapeStats
from .backends import log_fallback_once


class BucketedDiT:
    """estimator(x, mask, mu, t, spks, cond, streaming=...) over per-mode engine runners with an eager fallback."""

    def __init__(self, eager_dit, runners: dict, tables: dict[str, BucketTable], stats: ShapeStats | None = None):
        self.eager = eager_dit
        self.runners = runners  # mode -> EngineRunner
        self.tables = tables  # mode -> BucketTable
        self.stats = stats or ShapeStats()

    def __call__(self, x, mask, mu, t, spks, cond, streaming: bool = False):
        mode = "stream" if streaming else "offline"
        b, _, n = x.shape
        runner = self.runners.get(mode)
        table = self.tables.get(mode)
        t0 = time.perf_counter()
        if runner is None or table is None:
            out = self.eager(x, mask, mu, t, spks, cond, streaming=streaming)
            self.stats.record("dit", mode, b, n, None, time.perf_counter() - t0, reason="no engine for this mode")
            log_fallback_once(f"dit/{mode}", "no engine for this mode")
            return out
        plan = table.plan(b, n)
        if len(plan) == 1:
            return self._chunk(runner, table, plan[0][1], mode, x, mask, mu, t, spks, cond, t0, split=False)
        outs, r0 = [], 0
        for k, bucket in plan:  # rows are independent: each chunk in its own bucket (BucketTable.plan)
            sl = slice(r0, r0 + k)
            outs.append(self._chunk(runner, table, bucket, mode, x[sl], mask[sl], mu[sl], t[sl], spks[sl], cond[sl],
                                    time.perf_counter(), split=True))
            r0 += k
        return torch.cat(outs, dim=0)

    def _chunk(self, runner, table, bucket, mode, x, mask, mu, t, spks, cond, t0, split: bool):
        b, _, n = x.shape
        streaming = mode == "stream"
        if bucket is None:
            out = self.eager(x, mask, mu, t, spks, cond, streaming=streaming)
            self.stats.record("dit", mode, b, n, None, time.perf_counter() - t0, reason=table.miss_reason(b, n),
                              split_part=split)
            log_fallback_once(f"dit/{mode}", "a call shape no bucket covers within the padding-waste limit")
            return out
        try:
            out = self._run(runner, bucket, x, mask, mu, t, spks, cond)
        except Exception as e:  # noqa: BLE001 - an engine failure must not take the request down
            out = self.eager(x, mask, mu, t, spks, cond, streaming=streaming)
            self.stats.record("dit", mode, b, n, None, time.perf_counter() - t0, reason=f"engine error: {e}",
                              split_part=split)
            log_fallback_once(f"dit/{mode}", f"engine error: {type(e).__name__}: {e}")
            return out
        self.stats.record("dit", mode, b, n, bucket, time.perf_counter() - t0, split_part=split)
        return out

    @staticmethod
    def _run(runner, bucket, x, mask, mu, t, spks, cond):
        b, _, n = x.shape
        B, L = bucket.batch, bucket.run_length(n)
        dtype = _engine_dtype(runner, x.dtype)

        def pad(a: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
            shape = (B,) + tuple(a.shape[1:-1]) + ((L,) if a.dim() == 3 else ())
            if a.dim() < 3:
                shape = (B,) + tuple(a.shape[1:])
            out = torch.full(shape, fill, dtype=dtype, device=a.device)
            if a.dim() == 3:
                out[:b, :, :n] = a
            else:
                out[:b] = a
            return out

        m = pad(mask)
        m[b:] = 1.0  # unused batch rows attend to something (no all-masked rows, no NaNs)
        t_in = pad(t)
        t_in[b:] = t[0]
        inputs = {"x": pad(x), "mask": m, "mu": pad(mu), "t": t_in, "spks": pad(spks), "cond": pad(cond)}
        out = runner.run(inputs, bucket)[runner.output_names[0]]
        return out[:b, :, :n].to(x.dtype)


def _engine_dtype(runner, default: torch.dtype) -> torch.dtype:
    from ...engines.dtypes import torch_dtype

    try:
        return torch_dtype(runner.spec.dtype)
    except Exception:  # noqa: BLE001
        return default


class BucketedHiFT:
    """Offline HiFT over engine buckets: `inference_batch(mels, finalize=True)` exact per row (see the tail rule)."""

    def __init__(self, eager_hift, runners: dict, tables: dict[str, BucketTable], stats: ShapeStats | None = None):
        self.hift = eager_hift
        self.runners = runners
        self.tables = tables
        self.stats = stats or ShapeStats()

    def inference_batch(self, mels: list[torch.Tensor], finalize: bool = True) -> list[torch.Tensor]:
        """mels: [80, T_i] each. Runs one engine call on the padded batch when a bucket fits (finalize only; chunk
        calls go to the eager HiFT), then recomputes the last frame of every padded row eagerly: zero padding changes
        only what a padded row's final frame sees (its STFT/iSTFT edge), so each row equals the row run alone."""
        mels = [m[0] if m.ndim == 3 else m for m in mels]
        lengths = [int(m.shape[-1]) for m in mels]
        b, n = len(mels), max(lengths)
        mode = "offline" if finalize else "stream"
        runner, table = self.runners.get(mode), self.tables.get(mode)
        t0 = time.perf_counter()
        bucket = table.select(b, n) if (runner is not None and table is not None and finalize) else None
        if bucket is None:
            reason = "no engine for this mode" if runner is None or not finalize else table.miss_reason(b, n)
            out = self.hift.inference_batch(mels, finalize)
            self.stats.record("hift", mode, b, n, None, time.perf_counter() - t0, reason=reason)
            log_fallback_once(f"hift/{mode}", "no engine for this mode" if runner is None or not finalize else
                              "a call shape no bucket covers within the padding-waste limit")
            return out
        try:
            out = self._run(runner, bucket, mels, lengths)
        except Exception as e:  # noqa: BLE001
            out = self.hift.inference_batch(mels, finalize)
            self.stats.record("hift", mode, b, n, None, time.perf_counter() - t0, reason=f"engine error: {e}")
            log_fallback_once(f"hift/{mode}", f"engine error: {type(e).__name__}: {e}")
            return out
        self.stats.record("hift", mode, b, n, bucket, time.perf_counter() - t0)
        return out

    def _run(self, runner, bucket, mels, lengths):
        h = self.hift
        spf = h.samples_per_frame
        L = bucket.run_length(max(lengths))
        batch = torch.zeros(bucket.batch, mels[0].shape[0], L, dtype=torch.float32, device=mels[0].device)
        for i, m in enumerate(mels):
            batch[i, :, :m.shape[-1]] = m
        h.check_noise(L)
        noise = h.noise_slice(0, L).to(batch.device)
        wav = runner.run({"mel": batch, "sine_noise": noise}, bucket)[runner.output_names[0]]
        out = [wav[i, :t * spf] for i, t in enumerate(lengths)]
        ctx = h.decode_left_context() + 1
        for i, t in enumerate(lengths):
            if t == L:
                continue
            if t <= ctx:  # too short for a window: run the row alone
                out[i] = h.inference(mels[i].unsqueeze(0), True)[0][0]
                continue
            f0 = h.predict_f0(mels[i].unsqueeze(0), True)
            src = h.sine_source(f0)
            tail = h.decode(mels[i][None, :, t - ctx:], src[:, :, (t - ctx) * spf:t * spf], finalize=True)[:, -spf:]
            out[i] = torch.cat([out[i][:-spf], tail[0]])
        return out


class BucketedStreamDecoder:
    """Streaming HiFT windows (the conv stack of `HiFT.decode`) over static buckets, e.g. CUDA graphs.

    Non-final windows are right-padded to the bucket (zeros; unused batch rows zero) and cropped: padding is exact
    there because a non-final decode's output stops 5 frames before the window end (4 conv_pre look-ahead frames and the
    480-sample cut), so no kept sample sees a padded frame.

    Final windows (`finalize=True`) end at their own iSTFT edge. With a `tail` runner they run in the same non-final
    buckets, exactly: the window of n frames is right-padded with zeros to a bucket of >= n + 4 frames, so the 4
    conv_pre look-ahead frames after it are zeros (what finalize pads with) and every sample before the last frame
    equals the final decode (zero padding changes only what the last frame sees: the source STFT's reflect padding and
    the iSTFT edge, the rule of `HiFT.inference_batch`); the last frame's 480 samples come from `tail`, a final decode
    of the window's last `decode_left_context() + 1` frames (one static shape per batch, exact from its last frame).
    Without `tail` (or for a window no longer than the tail window) a final window runs eagerly. Final windows are
    selected and recorded at n + 4 frames (what their bucket must hold)."""

    def __init__(self, hift, run, table: BucketTable, stats: ShapeStats | None = None, tail=None):
        self.hift = hift
        self.run = run  # run(bucket, mel [B, 80, L], source [B, 1, L * 480]) -> wav [B, (L - 5) * 480]
        self.table = table
        self.stats = stats or ShapeStats()
        self.tail = tail  # tail(mel [b, 80, W], source [b, 1, W * 480]) -> final decode [b, W * 480]; W = tail_frames
        self.tail_frames = hift.decode_left_context() + 1

    def __call__(self, mel: torch.Tensor, source: torch.Tensor, finalize: bool) -> torch.Tensor:
        b, _, n = mel.shape
        t0 = time.perf_counter()
        need = n + self.hift.conv_pre_look_right if finalize else n
        if finalize and self.tail is None:
            plan, reason = [(b, None)], "final window (own iSTFT edge)"
        elif finalize and n <= self.tail_frames:
            plan, reason = [(b, None)], "final window no longer than the tail window"
        else:  # one bucket, or the rows (independent streams) split over several (BucketTable.plan), else eager
            plan = self.table.plan(b, need)
            reason = self.table.miss_reason(b, need) if plan[0][1] is None else None
        if len(plan) == 1:
            return self._window(mel, source, finalize, plan[0][1], need, reason, t0, split=False)
        outs, r0 = [], 0
        for k, bucket in plan:  # e.g. 10 streams' windows with buckets of up to 8 rows: 8 + 2, not all eager
            sl = slice(r0, r0 + k)
            outs.append(self._window(mel[sl], source[sl], finalize, bucket, need,
                                     None if bucket is not None else self.table.miss_reason(k, need),
                                     time.perf_counter(), split=True))
            r0 += k
        return torch.cat(outs, dim=0)

    def _window(self, mel, source, finalize: bool, bucket, need: int, reason, t0: float, split: bool):
        """The windows of `mel` [b, 80, n] in `bucket`, or eagerly (bucket None, for `reason`)."""
        b, _, n = mel.shape
        if bucket is None:
            out = self.hift.decode(mel, source, finalize)
            self.stats.record("hift", "stream", b, need, None, time.perf_counter() - t0, reason=reason,
                              split_part=split)
            if not finalize:
                log_fallback_once("hift/stream", "a window shape no bucket covers within the padding-waste limit")
            return out
        spf = self.hift.samples_per_frame
        L = bucket.run_length(need)
        mel_p = mel.new_zeros(bucket.batch, mel.shape[1], L)
        mel_p[:b, :, :n] = mel
        src_p = source.new_zeros(bucket.batch, 1, L * spf)
        src_p[:b, :, :n * spf] = source
        if not finalize:
            keep = self.hift.decode_output_samples(n, finalize=False)
            out = self.run(bucket, mel_p, src_p)[:b, :keep]
        else:
            head = self.run(bucket, mel_p, src_p)[:b, :(n - 1) * spf]
            w = self.tail_frames
            tail = self.tail(mel[:, :, n - w:], source[:, :, (n - w) * spf:])[:, -spf:]
            out = torch.cat([head, tail.to(head.dtype)], dim=1)
        self.stats.record("hift", "stream", b, need, bucket, time.perf_counter() - t0, split_part=split)
        return out
