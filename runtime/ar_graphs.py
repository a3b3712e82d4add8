"""CUDA graphs for the AR decode step: one graph per (batch bucket, KV-length rung), replayed every step.

A decode call of b rows runs in the smallest captured batch B >= b; the B - b padding rows write into a scratch KV
slot that no request owns (position 0, token 0), so real rows are unaffected. The KV length attended is the smallest
rung >= the longest position + 1 (a static int, so the graph's shapes are fixed).
"""
from __future__ import annotations

import bisect

import torch

from .cuda_graphs import GraphCache


class DecodeGraphs:
    """`decode(tokens, slots, positions, kv_len=...)` is the LM's decode step, eager or compiled (`compiled.py`)."""

    def __init__(self, decode, batches: list[int], kv_lens: list[int], scratch_slot: int, device):
        self.batches = sorted(set(batches))
        self.kv_lens = sorted(set(kv_lens))
        self.scratch = scratch_slot
        self.device = torch.device(device)
        self.graphs: dict[int, GraphCache] = {}
        for kv in self.kv_lens:
            cache = GraphCache(lambda t, s, p, kv=kv: decode(t, s, p, kv_len=kv), self.device)
            for B in sorted(self.batches, reverse=True):
                t = torch.zeros(B, dtype=torch.long, device=self.device)
                s = torch.full((B,), scratch_slot, dtype=torch.long, device=self.device)
                p = torch.zeros(B, dtype=torch.long, device=self.device)
                cache.capture(B, (t, s, p))
            self.graphs[kv] = cache
        self.replays = 0

    def fits(self, b: int, kv_len: int) -> bool:
        return b <= self.batches[-1] and kv_len <= self.kv_lens[-1]

    def __call__(self, tokens: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, need_kv: int):
        b = tokens.shape[0]
        B = self.batches[bisect.bisect_left(self.batches, b)]
        kv = self.kv_lens[bisect.bisect_left(self.kv_lens, need_kv)]
        if B > b:
            pad = B - b
            tokens = torch.cat([tokens, tokens.new_zeros(pad)])
            slots = torch.cat([slots, slots.new_full((pad,), self.scratch)])
            positions = torch.cat([positions, positions.new_zeros(pad)])
        self.replays += 1
        return self.graphs[kv].run(B, tokens, slots, positions)[:b]
