"""How one cached streaming DiT hop calls the estimator: eagerly, or by replaying a CUDA graph per bucket.

A cached hop (stages/flow_hops.py) runs `DiT.forward_cached` once per Euler step on its rows' new frames against
their cached prefix K/V. Eagerly that is ~22 layers x ~30 small kernels per step, launch-bound on a GPU, while the
whole-history hop it replaces replays one CUDA graph per step. `CachedHopGraphs` captures `forward_cached` per
(requests, new frames, prefix frames) bucket of a profile's `dit.cached` grid, with every input in static buffers
shared by all buckets (views of one allocation per input, sized for the largest bucket: the prefix K/V alone is
depth x 2 rows x prefix x dim per request), so a hop copies its rows into the buffers and replays.

Both kinds hand the hop a `HopCall`: the call's input tensors, laid out with request b's conditional row at batch
index b and its unconditional row at R + b (R = the call's row count: the request count eagerly, the bucket's in a
graph), new frames right-padded to N, prefix frames right-padded to P (`prefix_valid` masks the padding, padded rows
have an all-zero mask). Padding never changes a valid row: rows are independent, the convolutions are causal, padded
keys are masked out of attention (exactness: tests/test_flow_hop_graphs.py). Rows may be at different Euler steps
(t per row; each row's prefix K/V and tails are loaded for its own step), which step-level DiT scheduling uses.
"""
from __future__ import annotations

import gc
import math
import threading
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from ...engines.cuda_graphs import GraphCache

_INPUTS = ("x", "mask", "mu", "t", "spks", "cond", "offsets", "kp", "vp", "prefix_valid", "tail1", "tail2",
           "k_out", "v_out")


@dataclass(frozen=True)
class CachedGrid:
    """The buckets of cached-hop graphs: requests per call (CFG rows = 2x), new frames per request and cached prefix
    frames (0 = the no-prefix graph of a first hop). A hop runs in the smallest bucket that fits each."""
    batch: tuple
    frames: tuple
    prefix: tuple

    def __post_init__(self):
        for name in ("batch", "frames", "prefix"):
            v = tuple(sorted(set(getattr(self, name))))
            lo = 0 if name == "prefix" else 1
            if not v or any(not isinstance(i, int) or isinstance(i, bool) or i < lo for i in v):
                raise ValueError(f"cached grid {name} must be a non-empty list of ints >= {lo}, got "
                                 f"{getattr(self, name)!r}")
            object.__setattr__(self, name, v)

    def select(self, b: int, n: int, p: int) -> Optional[tuple]:
        """The smallest (requests, frames, prefix) bucket holding b requests of n new frames after p cached ones."""
        pick = [next((v for v in vals if v >= want), None)
                for vals, want in ((self.batch, b), (self.frames, n), (self.prefix, p))]
        return None if None in pick else tuple(pick)

    def keys(self) -> list:
        return [(b, n, p) for b in self.batch for n in self.frames for p in self.prefix]

    def to_dict(self) -> dict:
        return {"batch": list(self.batch), "frames": list(self.frames), "prefix": list(self.prefix)}


class HopCall:
    """The estimator inputs of one cached hop (see the module doc for the layout) and how to run them.

    `fresh`: the per-row inputs that stay fixed over a row's Euler steps (mu, cond, mask, spks, offsets,
    prefix_valid) must be filled: False when the same rows, in the same order, used this call's buffers last (a hop's
    ten steps, or stepped rows whose batch did not change), so a step only loads what changes per step."""
    rows: int
    frames: int
    prefix: int
    fresh: bool = True

    def reset(self) -> None:
        """Zero everything a hop fills per row (a graph's buffers still hold the previous hop)."""
        for name in ("x", "mask", "mu", "spks", "cond", "offsets", "tail1", "tail2"):
            getattr(self, name).zero_()
        if self.prefix_valid is not None:
            self.prefix_valid.zero_()

    def load_prefix(self, b: int, s: int, prefix) -> None:
        """Request b's cached prefix K/V of Euler step s (`flow_cache.Prefix`: segments with k / v [steps, depth,
        2 (cond, uncond), frames, D]), copied segment by segment to frames [0, prefix.frames) of its rows."""
        for dst, name in ((self.kp, "k"), (self.vp, "v")):
            L, _, P, D = dst.shape
            rows = dst.view(L, 2, self.rows, P, D)
            for seg in prefix.segments:
                rows[:, :, b, seg.start:seg.start + seg.n] = getattr(seg, name)[s]

    def load_tails(self, b: int, s: int, prefix) -> None:
        """Request b's conv input tails of Euler step s (left at zero at stream start: the left zero padding)."""
        for name in ("tail1", "tail2"):
            dst = getattr(self, name)
            dst.view(2, self.rows, *dst.shape[1:])[:, b] = getattr(prefix, name)[s]

    def run(self):  # pragma: no cover - interface
        """One estimator call. Returns (velocity [2R, 80, N], in1, in2 [2R, K-1+N, D]) in the call's layout, and
        leaves this call's K/V in k_out / v_out [depth, 2R, N, D] — all borrowed until the next call."""
        raise NotImplementedError

    def kv_rows(self, b: int, n: int):
        """Request b's K and V of the last call as [depth, 2 (cond, uncond), n, D] views of k_out / v_out."""
        L, _, N, D = self.k_out.shape
        return tuple(t.view(L, 2, self.rows, N, D)[:, :, b, :n] for t in (self.k_out, self.v_out))


class EagerHopCall(HopCall):
    """Fresh tensors of exactly the hop's size; `fn` = DiT.forward_cached (or its compiled form)."""

    def __init__(self, fn: Callable, shapes: dict, device, dtype, b: int, n: int, p: int):
        self.fn, self.rows, self.frames, self.prefix = fn, b, n, p
        for name in _INPUTS:
            setattr(self, name, torch.zeros(shapes[name], device=device, dtype=input_dtype(name, dtype))
                    if name in shapes else None)

    def run(self):
        return self.fn(self.x, self.mask, self.mu, self.t, self.spks, self.cond, self.offsets, self.kp, self.vp,
                       self.prefix_valid, self.tail1, self.tail2, self.k_out, self.v_out)


def input_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype of a cached-hop input: long offsets, a bool prefix mask, the model's dtype elsewhere."""
    return torch.long if name == "offsets" else torch.bool if name == "prefix_valid" else dtype


def hop_shapes(dit, b: int, n: int, p: int) -> dict:
    """Input shapes of a cached-hop call of b requests (2b rows), n new frames, p prefix frames (p = 0: no prefix
    inputs)."""
    c = dit.cfg
    D, K1 = c.heads * c.dim_head, dit.input_embed.conv_pos_embed.kernel_size - 1
    R = 2 * b
    shapes = {"x": (R, c.mel_dim, n), "mask": (R, 1, n), "mu": (R, c.mu_dim, n), "t": (R,), "spks": (R, c.spk_dim),
              "cond": (R, c.mel_dim, n), "offsets": (R,), "kp": (c.depth, R, p, D), "vp": (c.depth, R, p, D),
              "prefix_valid": (R, p), "tail1": (R, K1, c.dim), "tail2": (R, K1, c.dim),
              "k_out": (c.depth, R, n, D), "v_out": (c.depth, R, n, D)}
    if p == 0:
        for name in ("kp", "vp", "prefix_valid"):
            del shapes[name]
    return shapes


class EagerHops:
    """Cached hops through `fn` (DiT.forward_cached or its compiled form) with exactly-sized tensors; the last call
    is kept for the next one of the same size and rows (`HopCall.fresh`)."""

    def __init__(self, dit, fn: Callable):
        self.dit, self.fn = dit, fn
        self._last = None  # ((b, n, p), rows, call)

    def open(self, b: int, n: int, p: int, device, dtype, rows: Optional[tuple] = None) -> HopCall:
        last = self._last
        if rows is not None and last is not None and last[0] == (b, n, p) and last[1] == rows:
            last[2].fresh = False
            return last[2]
        call = EagerHopCall(self.fn, hop_shapes(self.dit, b, n, p), device, dtype, b, n, p)
        self._last = ((b, n, p), rows, call) if rows is not None else None
        return call


class GraphHopCall(HopCall):
    """A bucket's static buffers (views of the shared ones) and its graph."""

    def __init__(self, key: tuple, views: dict, replay: Callable, fresh: bool):
        self._replay = replay
        self.rows, self.frames, self.prefix = key
        self.fresh = fresh
        for name in _INPUTS:
            setattr(self, name, views.get(name))

    def run(self):
        return self._replay()


class CachedHopGraphs:
    """`DiT.forward_cached` captured as one CUDA graph per bucket of a `CachedGrid` (eager `dit`, or `fn` for its
    compiled form). Buckets are captured on first use or all at once by `capture_all` (the scheduler does it at
    start when the prefix cache is on). Without CUDA (tests) a bucket "replays" by calling the function on its
    static views, which checks everything but the capture itself. `open` returns None when no bucket fits (the
    hop then runs eagerly); `counts` has hits and misses (estimator calls, one per Euler step, with / without a
    bucket) and captures."""

    def __init__(self, dit, grid: CachedGrid, device, dtype=None, fn: Optional[Callable] = None,
                 graphs: Optional[bool] = None):
        self.dit, self.grid = dit, grid
        self.fn = fn or dit.forward_cached
        self.device = torch.device(device)
        self.dtype = dtype or next(dit.parameters()).dtype
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        self.cache = GraphCache(self.fn, self.device, warmup=1) if self.graphs else None
        self.entries: dict = {}
        self.counts = dict(hits=0, misses=0, captured=0)
        self._lock = threading.Lock()
        self._flat: dict = {}  # the shared static buffers, allocated with the first bucket (none while unused)
        self._bound = None     # (bucket, rows) whose fixed inputs the shared buffers hold (HopCall.fresh)

    def _buffers(self) -> dict:
        if not self._flat:
            big = hop_shapes(self.dit, max(self.grid.batch), max(self.grid.frames), max(self.grid.prefix))
            with torch.inference_mode():
                for name, shape in big.items():
                    self._flat[name] = torch.zeros(math.prod(shape), device=self.device,
                                                   dtype=input_dtype(name, self.dtype))
        return self._flat

    @property
    def static_bytes(self) -> int:
        """Bytes of the shared static buffers (0 until the first bucket is used or captured)."""
        return sum(t.numel() * t.element_size() for t in self._flat.values())

    def _views(self, key: tuple) -> dict:
        b, n, p = key
        flat = self._buffers()
        shapes = hop_shapes(self.dit, b, n, p)
        return {name: flat[name][:math.prod(shape)].view(shape) for name, shape in shapes.items()}

    def _capture(self, key: tuple):
        """(the bucket's views, its replay): a CUDA graph over the views, or (without CUDA) the call itself."""
        views = self._views(key)
        args = tuple(views.get(n) for n in _INPUTS)
        if self.cache is None:
            return views, lambda: self.fn(*args)
        self.cache.capture(key, args, static=True, collect=False)  # capture_all collects once
        return views, lambda: self.cache.run(key)

    def entry(self, key: tuple):
        with self._lock:
            if key not in self.entries:
                self._bound = None  # a capture's warm-up runs write the shared buffers
                self.entries[key] = self._capture(key)
                self.counts["captured"] += 1
            return self.entries[key]

    def capture_all(self, progress: bool = False) -> None:
        """Capture every bucket, largest first (smaller graphs reuse the pool)."""
        keys = sorted(self.grid.keys(), key=lambda k: -(k[0] * k[1] * (k[1] + k[2])))
        gc.collect()  # once, not per graph (a collection per capture was a third of the set-up)
        if progress:
            from tqdm import tqdm

            keys = tqdm(keys, desc="capturing cached-hop DiT graphs", unit="graph")
        for k in keys:
            self.entry(k)

    def open(self, b: int, n: int, p: int, device=None, dtype=None, rows: Optional[tuple] = None) \
            -> Optional[HopCall]:
        """The bucket call for b requests of n new frames after p cached ones, or None (no bucket: eagerly).
        `rows`: ids of the call's rows in order; the call is not `fresh` when the same rows used the shared static
        buffers last in the same bucket (every bucket's views alias the same memory)."""
        key = self.grid.select(b, n, p)
        if key is None or (dtype is not None and dtype != self.dtype):
            self.counts["misses"] += 1
            return None
        self.counts["hits"] += 1
        views, replay = self.entry(key)
        fresh = rows is None or self._bound != (key, rows)
        self._bound = (key, rows) if rows is not None else None
        return GraphHopCall(key, views, replay, fresh)

    def stats(self) -> dict:
        return {**self.counts, "grid": self.grid.to_dict(), "graphs": self.graphs, "static_bytes": self.static_bytes}

    def close(self) -> None:
        self.entries.clear()
        self._flat.clear()
        self._bound = None
        if self.cache is not None:
            self.cache = GraphCache(self.fn, self.device, warmup=1)  # the graphs and their pool go
