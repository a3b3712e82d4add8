"""CUDA graphs for the AR: the decode step with its sampling (one graph per (batch bucket, KV-length rung), replayed
every step) and the prefill (one per (rows, padded length)).

A decode step's graph runs the LM's decode AND the RAS sampling of every row (`sampling.select_packed`), so a step
costs the host one upload of a packed [B, C] float32 tensor (token, slot, position, then `sampling.pack_rows`: the
row's two uniforms, parameters and RAS window), one replay and one read of the B sampled ids; the ~25 sampling
kernels that ran eagerly after each replay (each a Python dispatch and a launch) are inside the graph.

A step of b rows runs in the smallest captured batch B >= b; the B - b padding rows write into a scratch KV slot
that no request owns (position 0, token 0) and sample greedily, so real rows are unaffected. The KV length attended
is the smallest rung >= the longest position + 1 (a static int, so the graph's shapes are fixed). Requests whose
sampling does not fit the captured shapes (win_size > SAMPLE_WINDOW or top_k > SAMPLE_TOP_K) take the scheduler's
uncaptured path.
"""
from __future__ import annotations

import bisect

import torch

from .cuda_graphs import GraphCache
from .sampling import padding_rows, select_packed

SAMPLE_WINDOW = 16   # RAS window columns of the packed rows (upstream win_size: 10)
SAMPLE_TOP_K = 64    # sorted probabilities scanned per row (upstream top_k: 25)
_DECODE_COLS = 3     # token, slot, position ahead of the sampling columns


class DecodeGraphs:
    """`decode(tokens, slots, positions, kv_len=...)` is the LM's decode step, eager or compiled (`compiled.py`);
    `stop` the first stop id (speech_token_size)."""

    def __init__(self, decode, batches: list[int], kv_lens: list[int], scratch_slot: int, stop: int, device):
        self.batches = sorted(set(batches))
        self.kv_lens = sorted(set(kv_lens))
        self.scratch = scratch_slot
        self.device = torch.device(device)
        self.graphs: dict[int, GraphCache] = {}
        for kv in self.kv_lens:
            def step(packed, kv=kv):
                tokens, slots, positions = packed[:, :_DECODE_COLS].long().unbind(1)
                logits = decode(tokens, slots, positions, kv_len=kv)
                return select_packed(logits, packed[:, _DECODE_COLS:], stop, SAMPLE_TOP_K)
            cache = GraphCache(step, self.device)
            for B in sorted(self.batches, reverse=True):
                cache.capture(B, (self.pad(self.pad(None, 0), B).to(self.device),))
            self.graphs[kv] = cache
        self.replays = 0

    def fits(self, b: int, kv_len: int) -> bool:
        return b <= self.batches[-1] and kv_len <= self.kv_lens[-1]

    def pad(self, packed: torch.Tensor | None, B: int) -> torch.Tensor:
        """`packed` [b, C] (host; None: no rows) with B - b padding rows: token 0 and position 0 in the scratch
        slot, sampled greedily."""
        n = B - (0 if packed is None else packed.shape[0])
        extra = torch.cat([torch.tensor([[0.0, self.scratch, 0.0]]).expand(n, -1),
                           padding_rows(n, SAMPLE_WINDOW)], dim=1)
        return extra if packed is None else torch.cat([packed, extra])

    def __call__(self, tokens: list[int], slots: list[int], positions: list[int], sampling: torch.Tensor,
                 need_kv: int) -> torch.Tensor:
        """One decode step of b rows: `sampling` = `sampling.pack_rows(policies, SAMPLE_WINDOW)` [b, C] (host).
        Returns the sampled ids [b] (device; the graph's buffer, overwritten by the next step)."""
        b = len(tokens)
        B = self.batches[bisect.bisect_left(self.batches, b)]
        kv = self.kv_lens[bisect.bisect_left(self.kv_lens, need_kv)]
        cols = torch.tensor([tokens, slots, positions], dtype=torch.float32).T
        packed = self.pad(torch.cat([cols, sampling], dim=1), B)
        if self.device.type == "cuda":
            packed = packed.pin_memory()  # the graph's input copy is then asynchronous
        self.replays += 1
        return self.graphs[kv].run(B, packed)[:b]


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
