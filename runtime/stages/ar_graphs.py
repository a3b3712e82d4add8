"""CUDA graphs for the AR decode step: one graph per (batch bucket, KV-length rung), replayed every step.

A decode call of b rows runs in the smallest captured batch B >= b; the B - b padding rows write into a scratch KV
slot that no request owns (position 0, token 0), so real rows are unaffected. The KV length attended is the smallest
rung >= the longest position + 1 (a static int, so the graph's shapes are fixed).

With a `StaticSampler` the graphs also hold the step's sampling (`run_sampled`: the packed host values go up with
the step's inputs, one replay, one read of the ids), so a decode step costs the AR thread a few host operations
instead of the sampler's ~35 kernel launches beside the DiT and vocoder threads.

With `steps` = K > 1 a graph holds K decode steps, each sampled on the device and fed its own ids as the next step's
tokens (`decode_steps`; `run_steps`): the AR thread's per-step host work — the inputs' upload, the replay, the
read-back and its wait — is paid once per K tokens (`SchedulerConfig.ar_decode_steps`). Under load that host work,
not the GPU, set the AR's pace (BENCHMARKS.md runs 47 and 51-53: ~0.85 ms of kernels in a 4-8 ms step).
"""
from __future__ import annotations

import bisect

import torch

from ...engines.cuda_graphs import GraphCache
from ..models.sampling import PackedRows, StaticSampler, ids_to_host


def _sampled(logits: torch.Tensor, rows: torch.Tensor, sampler: StaticSampler) -> tuple[torch.Tensor, torch.Tensor]:
    return logits, sampler(logits, rows)


def decode_steps(decode, sampler: StaticSampler, tokens: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                 rows: torch.Tensor) -> torch.Tensor:
    """K decode steps of B rows in fixed shapes (a CUDA graph holds them; the CPU runs them eagerly): step k samples
    with `rows[k]` ([K, B, 7 + width], `StaticSampler.rows` of a multi-step `PackedRows`: the step's uniforms and
    stop modes) and the RAS window the steps before it left (the first step's from `rows[0]`; each step's id is
    shifted in at the right, the oldest dropped: the last `width` sampled ids, as the host's history gives them),
    then feeds its ids back as the next step's tokens at the next positions. `decode(tokens, slots, positions)` ->
    logits [B, V]. Returns the ids [K, B]. A row that samples a stop id runs on to the end of the call (its K/V past
    the stop are never read: the slot is released); the host keeps only what `TokenPolicy.accept` takes."""
    n = rows.shape[2] - sampler.width  # the per-step columns before the window
    window = rows[0, :, n:]
    out = []
    for k in range(rows.shape[0]):
        ids = sampler(decode(tokens, slots, positions), torch.cat([rows[k, :, :n], window], dim=1))
        out.append(ids)
        window = torch.cat([window[:, 1:], ids[:, None].to(window.dtype)], dim=1)
        tokens, positions = ids, positions + 1
    return torch.stack(out)


class DecodeGraphs:
    """`decode(tokens, slots, positions, kv_len=...)` is the LM's decode step, eager or compiled (`compiled.py`)."""

    def __init__(self, decode, batches: list[int], kv_lens: list[int], scratch_slot: int, device,
                 sampler: StaticSampler | None = None, steps: int = 1):
        if steps > 1 and sampler is None:
            raise ValueError("DecodeGraphs: multi-step graphs sample on the device: pass a sampler")
        self.steps = steps
        self.batches = sorted(set(batches))
        self.kv_lens = sorted(set(kv_lens))
        self.scratch = scratch_slot
        self.device = torch.device(device)
        self.sampler = sampler
        self.graphs: dict[int, GraphCache] = {}
        for kv in self.kv_lens:
            if sampler is None:
                fn = lambda t, s, p, kv=kv: decode(t, s, p, kv_len=kv)  # noqa: E731
            elif steps > 1:
                fn = lambda t, s, p, rows, kv=kv: decode_steps(  # noqa: E731
                    lambda t_, s_, p_: decode(t_, s_, p_, kv_len=kv), sampler, t, s, p, rows)
            else:
                fn = lambda t, s, p, rows, kv=kv: _sampled(decode(t, s, p, kv_len=kv), rows, sampler)  # noqa: E731
            # a multi-step graph's decode is the single-step graphs' compiled function, already warm: one warm-up
            # run before its capture, not two (each runs K steps; the sampled single-step set took 35 s to capture
            # in run 50's set-up, H200, a K-step set is expected near K times that)
            cache = GraphCache(fn, self.device, warmup=1 if steps > 1 else 2)
            for B in sorted(self.batches, reverse=True):
                t = torch.zeros(B, dtype=torch.long, device=self.device)
                s = torch.full((B,), scratch_slot, dtype=torch.long, device=self.device)
                p = torch.zeros(B, dtype=torch.long, device=self.device)
                extra = () if sampler is None else (sampler.example_rows(B, steps).to(self.device),)
                cache.capture(B, (t, s, p) + extra)
            self.graphs[kv] = cache
        self.replays = self.sampled = 0
        self._idle: dict[int, torch.Tensor] = {}

    def fits(self, b: int, kv_len: int) -> bool:
        return b <= self.batches[-1] and kv_len <= self.kv_lens[-1]

    def _bucket(self, b: int, need_kv: int) -> tuple[int, int]:
        """(batch bucket, KV rung) of a call of b rows attending need_kv positions (`fits` first)."""
        return (self.batches[bisect.bisect_left(self.batches, b)],
                self.kv_lens[bisect.bisect_left(self.kv_lens, need_kv)])

    def __call__(self, tokens: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, need_kv: int):
        b = tokens.shape[0]
        B, kv = self._bucket(b, need_kv)
        if B > b:
            pad = B - b
            tokens = torch.cat([tokens, tokens.new_zeros(pad)])
            slots = torch.cat([slots, slots.new_full((pad,), self.scratch)])
            positions = torch.cat([positions, positions.new_zeros(pad)])
        self.replays += 1
        return self._logits(self.graphs[kv].run(B, tokens, slots, positions, *self._idle_rows(B)))[:b]

    def run_host(self, tokens: list[int], slots: list[int], positions: list[int], need_kv: int) -> torch.Tensor:
        """`__call__` from host lists (the AR worker's per-step inputs): the padded columns are ONE [3, B] int64
        host tensor (pinned on CUDA) whose rows the graph cache copies straight into its static inputs
        (non-blocking): no per-column upload with its host sync, no device-side padding kernels."""
        B, kv, host = self._host(tokens, slots, positions, need_kv)
        self.replays += 1
        return self._logits(self.graphs[kv].run(B, host[0], host[1], host[2], *self._idle_rows(B)))[:len(tokens)]

    def run_sampled(self, tokens: list[int], slots: list[int], positions: list[int], need_kv: int,
                    packed: PackedRows) -> tuple[torch.Tensor, list[int]]:
        """`run_host` with the step's sampling in the graph (`self.sampler.fits(packed)` first): (logits, ids)."""
        B, kv, host = self._host(tokens, slots, positions, need_kv)
        rows = self.sampler.rows(packed, B, pin=self.device.type == "cuda")
        self.replays += 1
        self.sampled += 1
        logits, ids = self.graphs[kv].run(B, host[0], host[1], host[2], rows)
        return logits[:len(tokens)], ids_to_host(ids[:len(tokens)])

    def run_steps(self, tokens: list[int], slots: list[int], positions: list[int], need_kv: int,
                  packed: PackedRows) -> list[list[int]]:
        """The multi-step graphs' call (`steps` > 1, `packed.steps` the same, `fits(len(tokens), need_kv)` with
        need_kv = the longest position + steps): the ids of every step, [steps][rows]."""
        B, kv, host = self._host(tokens, slots, positions, need_kv)
        rows = self.sampler.rows(packed, B, pin=self.device.type == "cuda")
        self.replays += 1
        self.sampled += self.steps
        ids = self.graphs[kv].run(B, host[0], host[1], host[2], rows)
        return ids_to_host(ids[:, :len(tokens)])

    def _host(self, tokens: list[int], slots: list[int], positions: list[int], need_kv: int):
        b = len(tokens)
        B, kv = self._bucket(b, need_kv)
        pad = B - b
        host = torch.tensor([tokens + [0] * pad, slots + [self.scratch] * pad, positions + [0] * pad],
                            dtype=torch.long, pin_memory=self.device.type == "cuda")
        return B, kv, host

    def _logits(self, out):
        return out if self.sampler is None else out[0]

    def _idle_rows(self, B: int) -> tuple:
        """A graph with a sampler called for its logits alone: the sampler's inputs are padding rows (made once)."""
        if self.sampler is None:
            return ()
        rows = self._idle.get(B)
        if rows is None:
            rows = self._idle[B] = self.sampler.example_rows(B).to(self.device)
        return (rows,)


class PrefillGraphs:
    """CUDA graphs for the AR prefill: one graph per (batch bucket, padded length), replayed for every admission.

    `prefill(embeds [B, T, H], lengths [B], slots [B])` is the LM's prefill, eager or compiled. A call of b rows and
    t positions runs in the smallest captured (B >= b, T >= t): padding rows get length 1 and the scratch slot,
    padding positions are zeros past each row's length (masked, and their K/V are overwritten by decode before any
    read). A 150-token prefill is launch-bound (about 500 kernels): the graph turns those into one launch.
    Captured largest first; only (B, T) with B * T <= max_tokens."""

    def __init__(self, prefill, batches: list[int], lengths: list[int], max_tokens: int, hidden: int, dtype,
                 scratch_slot: int, device):
        self.batches = sorted(set(batches))
        self.lengths = sorted(set(lengths))
        self.max_tokens = max_tokens
        self.scratch = scratch_slot
        self.device = torch.device(device)
        self.cache = GraphCache(prefill, self.device)
        self.keys = sorted(((B, T) for B in self.batches for T in self.lengths if B * T <= max_tokens),
                           key=lambda k: -k[0] * k[1])
        for B, T in self.keys:
            self.cache.capture((B, T), (torch.zeros(B, T, hidden, dtype=dtype, device=self.device),
                                        torch.ones(B, dtype=torch.long, device=self.device),
                                        torch.full((B,), scratch_slot, dtype=torch.long, device=self.device)))
        self.replays = 0

    def bucket(self, b: int, t: int) -> tuple[int, int] | None:
        """The cheapest captured (B, T) that holds b rows of t positions, or None."""
        fits = [(B, T) for B, T in self.keys if B >= b and T >= t]
        return min(fits, key=lambda k: (k[0] * k[1], k[1])) if fits else None

    def __call__(self, embeds: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        b, t, _ = embeds.shape
        key = self.bucket(b, t)
        if key is None:
            raise ValueError(f"no prefill graph holds {b} rows x {t} positions")  # callers check bucket() first
        B, T = key
        embeds = torch.nn.functional.pad(embeds, (0, 0, 0, T - t, 0, B - b))
        lengths = torch.cat([lengths, lengths.new_ones(B - b)])
        slots = torch.cat([slots, slots.new_full((B - b,), self.scratch)])
        self.replays += 1
        return self.cache.run(key, embeds, lengths, slots)[:b]
