"""How one Euler step of prefix-cached streaming DiT hops runs: eagerly, or by replaying a CUDA graph per bucket.

A cached hop (stages/flow_hops.py) runs `DiT.forward_cached` once per Euler step on its rows' new frames against
their cached prefix K/V. Everything a step needs lives in device memory that outlives the call, addressed by a small
integer table per row (`meta`, uploaded once per step):

* the rows' solver state in a `SolveArena` slot (noisy mel x, mu, cond, speaker row), written once when the hop
  starts;
* the prefix K/V in the pool's pages (`flow_cache.PageStore`), named by the row's page table, and the conv input
  tails in a tail slot.

`hop_step` gathers the rows' inputs from the arena and their prefix from the pages, calls the estimator, writes the
new frames' K/V to the pages the hop reserved (uncommitted frames to the sink page), the conv tails at the hop's commit
points to their reserved slots, and applies the Euler update with CFG to x in the arena. So a step costs the host one
small upload and one call whatever the rows' prefix lengths: no per-segment or per-row copies (before this layout a
step-level call of 8 streams with 8 committed hops each dispatched ~860 small ops from the DiT thread,
benchmarks/dit_step_host_ops.py).

`CachedHopGraphs` captures `hop_step` (around the eager or torch.compile'd `forward_cached`) per (requests, new frames,
prefix frames) bucket of a profile's `dit.cached` grid; `EagerHops` runs it directly. Rows are laid out with request
b's conditional row at batch index b and its unconditional row at R + b (R = the call's rows: the request count
eagerly, the bucket's in a graph); new frames right-padded to N, prefix frames to P (masked), padded rows read zeros
and write only to the sinks. Padding never changes a valid row: rows are independent, the convolutions are causal,
padded keys are masked out of attention (exactness: tests/test_flow_hop_graphs.py). Rows may be at different Euler
steps (t, the prefix's K/V and tails per row and step), which step-level DiT scheduling uses.
"""
from __future__ import annotations

import gc
import math
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from ...engines.cuda_graphs import GraphCache, indexed_device, upload
from .flow_cache import TRASH, ZERO, PageStore

_INPUTS = ("x", "mask", "mu", "t", "spks", "cond", "offsets", "k_all", "v_all", "prefix_valid", "tail1", "tail2")

# a row's table: arena slot, Euler step, first new frame (= prefix frames), new frames, tail slot read, then two
# (tail slot written, at new-frame index) commit points, then the prefix page table, then the new frames' pages
META = 9
PAD_HEAD = (0, 0, 0, 0, ZERO, TRASH, 0, TRASH, 0)


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


def input_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype of a forward_cached input: long offsets, a bool prefix mask, the model's dtype elsewhere."""
    return torch.long if name == "offsets" else torch.bool if name == "prefix_valid" else dtype


def hop_shapes(dit, b: int, n: int, p: int) -> dict:
    """forward_cached's input shapes for b requests (2b rows), n new frames, p prefix frames (p = 0: no prefix
    mask; k_all / v_all hold the p prefix frames and then the n new ones)."""
    c = dit.cfg
    D, K1 = c.heads * c.dim_head, dit.input_embed.conv_pos_embed.kernel_size - 1
    R = 2 * b
    shapes = {"x": (R, c.mel_dim, n), "mask": (R, 1, n), "mu": (R, c.mu_dim, n), "t": (R,), "spks": (R, c.spk_dim),
              "cond": (R, c.mel_dim, n), "offsets": (R,), "k_all": (c.depth, R, p + n, D),
              "v_all": (c.depth, R, p + n, D), "prefix_valid": (R, p), "tail1": (R, K1, c.dim),
              "tail2": (R, K1, c.dim)}
    if p == 0:
        del shapes["prefix_valid"]
    return shapes


# ------------------------------------------------------------------------------------------------ solver state

class SolveArena:
    """Cached-hop rows' solver state between Euler steps, one slot per row: x (the noisy mel), mu, cond
    [slots, 80, frames] and the speaker row spks [slots, 80]. Slot 0 is the padding rows' (zeros). A `growable`
    arena (eager calls only: nothing captured its addresses) grows to fit; a fixed one (a graph set's) says no."""

    def __init__(self, slots: int, frames: int, mel_dim: int, spk_dim: int, device, dtype, growable: bool):
        self.growable = growable
        self.mel_dim, self.spk_dim, self.device, self.dtype = mel_dim, spk_dim, indexed_device(device), dtype
        self._lock = threading.Lock()
        self._alloc(slots, frames)
        self.free = list(range(slots, 0, -1))

    def _alloc(self, slots: int, frames: int) -> None:
        with torch.inference_mode():
            old = getattr(self, "x", None)
            new = [torch.zeros(slots + 1, self.mel_dim, frames, device=self.device, dtype=self.dtype) for _ in range(3)]
            spks = torch.zeros(slots + 1, self.spk_dim, device=self.device, dtype=self.dtype)
            if old is not None:
                s, f = old.shape[0], min(old.shape[2], frames)
                for dst, src in zip(new, (self.x, self.mu, self.cond)):
                    dst[:s, :, :f] = src[:, :, :f]
                spks[:s] = self.spks
            self.x, self.mu, self.cond = new
            self.spks = spks
        self.slots, self.frames = slots, frames

    def take(self, n: int) -> Optional[int]:
        """A free slot for a row of n new frames, or None (a fixed arena that is full or too short)."""
        with self._lock:
            if n > self.frames or not self.free:
                if not self.growable:
                    return None
                more = 0 if self.free else self.slots
                self._alloc(self.slots + more, max(n, self.frames))
                self.free.extend(range(self.slots, self.slots - more, -1))
            return self.free.pop()

    def give(self, slot: int) -> None:
        with self._lock:
            self.free.append(slot)

    def load(self, slot: int, x: torch.Tensor, mu: torch.Tensor, cond: torch.Tensor, spks: torch.Tensor) -> None:
        """A row's fixed inputs and starting noise [80, n] (the rest of the slot zeroed)."""
        n = x.shape[1]
        with torch.inference_mode():
            for dst, src in ((self.x, x), (self.mu, mu), (self.cond, cond)):
                dst[slot, :, :n] = src
                dst[slot, :, n:] = 0
            self.spks[slot] = spks

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.x, self.mu, self.cond, self.spks))


# ------------------------------------------------------------------------------------------------- the step

@dataclass
class StepConsts:
    """What every step reads besides its rows: the Euler table on the device (t and dt of each step, as the whole
    solve's recurrence reaches them) and the CFG rate."""
    ts: torch.Tensor
    dts: torch.Tensor
    cfg_rate: float


def frame_windows(z: torch.Tensor, at: torch.Tensor, k: int) -> torch.Tensor:
    """z [2R, T, dim] (CFG-major rows: row r and row R + r belong to request r) -> [2R, k, dim]: each row's frames
    at[r] .. at[r] + k - 1. One index_select over the flattened frames (an index per frame row of `dim` values, where
    `z.gather(1, index expanded over dim)` reads an index per element: ~48 µs a call on an H100 under load, run 59's
    kernel profile); the same values."""
    rows, t, dim = z.shape
    start = torch.cat((at, at)) + torch.arange(rows, device=z.device) * t
    flat = (start.unsqueeze(1) + torch.arange(k, device=z.device)).reshape(-1)
    return z.reshape(rows * t, dim).index_select(0, flat).view(rows, k, dim)


WIDE_MOVES = True  # `wide` on (the default since session 24); benchmarks/dit_step_gpu.py turns it off for its A/B


def wide(t: torch.Tensor) -> torch.Tensor:
    """`t` viewed as 8-byte elements along its last dim where that dim allows it (unit stride, whole 8-byte words):
    the same bits, so a gather / index_copy of rows moves them 8 bytes per element instead of 2. The prefix gather
    below ran as `_scatter_gather_elementwise_kernel<..., OpaqueType<2>>` at ~30 % of a long-prefix step's kernel time
    (8 requests x 200 new frames over 1500 cached, H100, BENCHMARKS.md run 64)."""
    if not WIDE_MOVES or t.element_size() >= 8 or t.stride(-1) != 1 or (t.shape[-1] * t.element_size()) % 8:
        return t
    return t.view(torch.int64)


KV_FORMS = ("layers", "stacked", "paged")  # how hop_step hands the prefix K / V to forward_cached (hop_step's kv)


def hop_step(fn: Callable, store: PageStore, arena: SolveArena, meta: torch.Tensor, N: int, P: int,
             consts: StepConsts, bufs: Optional[dict] = None, kv: str = "layers") -> None:
    """One estimator call advancing the rows of `meta` [R, META + ceil(P/C) + ceil(N/C)] (long, on the device) by
    one Euler step each, in place (arena x, the reserved pages and tail slots). `fn` = DiT.forward_cached or its
    compiled form. Per row the arithmetic is the whole solve's: the same noise columns, t / dt values, CFG mix and
    update; padded frames and rows are masked (mask, prefix_valid) and written as zeros or to the sinks. `bufs`:
    flat buffers for the K/V the call attends over ("k_all", "v_all": per layer and row the gathered prefix, then
    the slots the call writes its new frames' K/V into; a graph set shares one of each among its graphs, so their
    memory does not grow with the number of buckets), else fresh tensors. `kv`: "layers" (the default): `fn` gets
    each layer's gathered K / V as a tensor of its own; "stacked": the one [depth, ...] tensor, as before session 24
    (an A/B switch, `SchedulerConfig.dit_kv_layer_inputs`); "paged": no gather — the buffers hold the new frames'
    K / V only and the attention reads the prefix in place from the store through the call's row table
    (models/hop_attention.py, `SchedulerConfig.dit_paged_prefix`)."""
    if kv not in KV_FORMS:
        raise ValueError(f"hop_step: kv must be one of {KV_FORMS}, not {kv!r}")
    R = meta.shape[0]
    S, C, L, D, K1, dim = store.steps, store.chunk, store.depth, store.kv_dim, store.k1, store.dim
    dev = meta.device

    def buf(name: str, shape: tuple) -> torch.Tensor:
        if bufs is None:
            return torch.empty(shape, device=dev, dtype=store.dtype)
        return bufs[name][:math.prod(shape)].view(shape)

    slot, step, start, n = meta[:, 0], meta[:, 1], meta[:, 2], meta[:, 3]
    fr = torch.arange(N, device=dev)
    cfg = torch.arange(2, device=dev)
    valid = fr.unsqueeze(0) < n.unsqueeze(1)  # [R, N]
    x = arena.x[:, :, :N].index_select(0, slot)
    mu = arena.mu[:, :, :N].index_select(0, slot)
    cond = arena.cond[:, :, :N].index_select(0, slot)
    spks = arena.spks.index_select(0, slot)
    mask = valid.unsqueeze(1).to(x.dtype)
    t = consts.ts.index_select(0, step)
    col = META
    prefix_valid = paged = None
    Pk = 0 if kv == "paged" else P  # prefix frames in the K / V buffers
    k_all, v_all = buf("k_all", (L, 2 * R * (Pk + N), D)), buf("v_all", (L, 2 * R * (Pk + N), D))
    if P:
        pages = -(-P // C)
        p = torch.arange(P, device=dev)
        pv = p.unsqueeze(0) < start.unsqueeze(1)  # [R, P]
        page = torch.where(pv, meta[:, col:col + pages].index_select(1, p // C), ZERO)
        rows = ((page * S + step.unsqueeze(1)) * 2).unsqueeze(0) + cfg.view(2, 1, 1)  # [2 (cfg), R, P]
        prefix_rows = rows * C + p % C  # per (cfg, row) and prefix position: the store row holding its K / V
        if kv == "paged":  # the attention reads them there
            paged = (store.k.unbind(0), store.v.unbind(0), prefix_rows.view(2 * R, P), torch.cat((start, start)))
        else:
            # per (cfg, row): the P prefix positions, then N positions the call overwrites with its own K/V (here row
            # 0 of the zero page: one gather fills the buffer the call attends over, no concatenation per layer)
            idx = torch.cat((prefix_rows, rows.new_zeros((2, R, N))), dim=2).reshape(-1)
            torch.index_select(wide(store.k), 1, idx, out=wide(k_all))
            torch.index_select(wide(store.v), 1, idx, out=wide(v_all))
            prefix_valid = torch.cat((pv, pv))
        col += pages
    k_all, v_all = k_all.view(L, 2 * R, Pk + N, D), v_all.view(L, 2 * R, Pk + N, D)

    def tail_rows(slots: torch.Tensor) -> torch.Tensor:  # [2 (conv), 2 (cfg), R] rows of the tail store
        return ((((slots * S + step) * 2).view(1, 1, R) + cfg.view(2, 1, 1)) * 2 + cfg.view(1, 2, 1)).reshape(-1)

    tails = store.tails.index_select(0, tail_rows(meta[:, 4])).view(2, 2 * R, K1, dim)
    zeros = torch.zeros_like(x)
    # each layer's K / V as a tensor of its own (views of the one buffer): under torch.compile a layer's in-place
    # write into a slice of ONE [depth, ...] input was functionalised as a fresh copy of the whole input per layer
    # (depth^2 buffer copies a step: run 63's 40 s cell spent most of the DiT's GPU time in them); per-layer inputs
    # are written in place (tests/test_flow_hop_graphs.py reads the generated code)
    stacked = kv == "stacked"
    vel, in1, in2 = fn(torch.cat((x, x)), torch.cat((mask, mask)), torch.cat((mu, zeros)), torch.cat((t, t)),
                       torch.cat((spks, torch.zeros_like(spks))), torch.cat((cond, zeros)), torch.cat((start, start)),
                       k_all if stacked else k_all.unbind(0), v_all if stacked else v_all.unbind(0),
                       prefix_valid, tails[0], tails[1], paged)
    # the new frames' K/V of this step: to the hop's reserved pages (uncommitted and padded frames: the sink page)
    out_pages = meta[:, col:col + -(-N // C)].index_select(1, fr // C)  # [R, N]
    rows = ((out_pages * S + step.unsqueeze(1)) * 2).unsqueeze(0) + cfg.view(2, 1, 1)
    idx = (rows * C + fr % C).reshape(-1)
    wide(store.k).index_copy_(1, idx, wide(k_all[:, :, Pk:].reshape(L, 2 * R * N, D)))
    wide(store.v).index_copy_(1, idx, wide(v_all[:, :, Pk:].reshape(L, 2 * R * N, D)))
    # the conv input tails at the commit points: in1 / in2 row position m holds frame start - (K-1) + m
    for slot_col, at_col in ((5, 6), (7, 8)):
        at = meta[:, at_col]
        src = torch.stack((frame_windows(in1, at, K1), frame_windows(in2, at, K1)))  # [2 (conv), 2R, K1, dim]
        store.tails.index_copy_(0, tail_rows(meta[:, slot_col]), src.view(-1, K1, dim))
    # the Euler step with CFG, as cfg_euler_step (padded frames stay zero)
    v_mix = (1.0 + consts.cfg_rate) * vel[:R] - consts.cfg_rate * vel[R:]
    dt = consts.dts.index_select(0, step).view(R, 1, 1)
    arena.x[:, :, :N].index_copy_(0, slot, torch.where(valid.unsqueeze(1), x + dt * v_mix, zeros))


def meta_rows(rows: Sequence[tuple], R: int, N: int, P: int, chunk: int) -> torch.Tensor:
    """The [R, META + ceil(P/C) + ceil(N/C)] table of a call: each row (head, prefix pages, new-frame pages) padded
    with the zero page / the sink, then padding rows (CPU, long)."""
    pp, npg = -(-P // chunk), -(-N // chunk)
    flat = []
    for head, prefix, out in rows:
        flat += head
        flat += prefix
        flat += [ZERO] * (pp - len(prefix))
        flat += out
        flat += [TRASH] * (npg - len(out))
    flat += (list(PAD_HEAD) + [ZERO] * pp + [TRASH] * npg) * (R - len(rows))
    return torch.tensor(flat, dtype=torch.long).view(R, META + pp + npg)


# ----------------------------------------------------------------------------------------------------- runners

class EagerHops:
    """Cached-hop steps through `fn` (DiT.forward_cached or its compiled form) at exactly the call's size, solver
    state in a growable arena."""

    def __init__(self, dit, fn: Callable, slots: int = 8):
        self.dit, self.fn, self._slots = dit, fn, slots
        self.arena: Optional[SolveArena] = None
        self.kv = "layers"  # hop_step's kv form (CachedHopGraphs.use_kv_form sets it)

    def take(self, n: int, device, dtype) -> tuple[SolveArena, int]:
        """(arena, slot) for a new row of n new frames."""
        if self.arena is None or self.arena.device != indexed_device(device) or self.arena.dtype != dtype:
            c = self.dit.cfg
            self.arena = SolveArena(self._slots, max(n, 64), c.mel_dim, c.spk_dim, device, dtype, growable=True)
        return self.arena, self.arena.take(n)

    def run(self, store: PageStore, arena: SolveArena, rows: Sequence[tuple], N: int, P: int,
            consts: StepConsts) -> None:
        """One step of `rows` ((head, prefix pages, new-frame pages) per row) of `arena`."""
        meta = upload(meta_rows(rows, len(rows), N, P, store.chunk), arena.device)
        with torch.inference_mode():  # the store and arena are inference tensors
            hop_step(self.fn, store, arena, meta, N, P, consts, kv=self.kv)


# Rows a graph set's fixed arena holds at once (`CachedHopGraphs` slots): every cached hop mid-solve holds one from its
# first Euler step to its last, and past saturation the step-level DiT keeps many started (slack-first: a newly urgent
# hop starts while older ones wait mid-solve), so a small arena sends rows to the eager path exactly when the DiT is
# shortest of time (run 63: 213-235 eager calls at 12 req/s with 64 slots, ~130 streams in flight). A slot is x, mu
# and cond [80, largest new frames] plus a speaker row: ~100 KB at full size in bf16, so 256 slots cost ~25 MB.
GRAPH_ARENA_SLOTS = 256


class CachedHopGraphs:
    """`hop_step` captured as one CUDA graph per bucket of a `CachedGrid`, around the eager `dit.forward_cached` or
    `fn` (its compiled form). The graphs read and write one pool's `PageStore` and this set's own fixed `SolveArena`
    (`slots` rows of up to the grid's largest new frames); rows that do not fit it, and calls no bucket holds, run
    eagerly (`EagerHops`). Buckets are captured on first use or all at once by `capture_all` (the scheduler does it
    at start, after allocating the pool's pages). Without CUDA (tests) a bucket "replays" by calling `hop_step` on
    its static table, which checks everything but the capture itself. `counts`: hits and misses (estimator calls,
    one per Euler step, with / without a bucket) and captures; `capture_failed`: buckets whose capture ran out of
    memory (their calls run eagerly)."""

    def __init__(self, dit, grid: CachedGrid, device, dtype=None, fn: Optional[Callable] = None,
                 graphs: Optional[bool] = None, slots: int = GRAPH_ARENA_SLOTS):
        self.dit, self.grid = dit, grid
        self.fn = fn or dit.forward_cached
        self.device = indexed_device(device)
        self.dtype = dtype or next(dit.parameters()).dtype
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        self._slots = slots
        self._capture_stream = None  # use_capture_stream
        self.cache = GraphCache(None, self.device, warmup=1) if self.graphs else None
        self.entries: dict = {}
        self.counts = dict(hits=0, misses=0, captured=0, capture_failed=0)
        self.shapes: Counter = Counter()  # (requests, new frames, prefix frames) of every call: what a grid must hold
        self.replays: Counter = Counter()  # bucket key -> replays
        self._lock = threading.Lock()
        self.arena: Optional[SolveArena] = None  # allocated with the first bucket or row (none while unused)
        self._meta: Optional[torch.Tensor] = None
        self._bufs: Optional[dict] = None  # the graphs' shared K/V buffers (`hop_step`'s bufs)
        self._store: Optional[PageStore] = None  # the pages the captured graphs read and write
        self._consts: Optional[StepConsts] = None
        self.eager = EagerHops(dit, self.fn)
        self._failed: set = set()
        self.kv = "layers"  # hop_step's kv form, baked into each graph at its capture

    def use_kv_form(self, kv: str) -> None:
        """hop_step's `kv` form from now on (KV_FORMS; graphs captured with another form are dropped)."""
        if kv not in KV_FORMS:
            raise ValueError(f"cached-hop K / V form must be one of {KV_FORMS}, not {kv!r}")
        with self._lock:
            if kv != self.kv:
                self.kv = self.eager.kv = kv
                self._drop_graphs()
                self._bufs = None  # sized for the form (the paged form holds no prefix)

    def use_capture_stream(self, stream) -> None:
        """Capture the graphs on `stream` from now on (None: a stream of the cache's own); graphs captured on
        another are dropped. The scheduler passes its SM partition's DiT stream (dit_green_reserve_sms): only graphs
        captured on a green context's stream run confined to its SMs when replayed there (run 67)."""
        with self._lock:
            if stream is not self._capture_stream:
                self._capture_stream = stream
                self._drop_graphs()

    def _drop_graphs(self) -> None:
        """Forget every captured bucket (and the graphs' memory pool with the old cache); the lock is held."""
        self.entries.clear()
        self._failed.clear()
        if self.cache is not None:
            self.cache = GraphCache(None, self.device, warmup=1, stream=self._capture_stream)

    def _arena(self) -> SolveArena:
        if self.arena is None:
            c = self.dit.cfg
            self.arena = SolveArena(self._slots, max(self.grid.frames), c.mel_dim, c.spk_dim, self.device,
                                    self.dtype, growable=False)
        return self.arena

    def _buffers(self) -> dict:
        """Flat K/V buffers for the largest bucket, shared by every graph (replays never overlap): its prefix and new
        frames, or (the paged form: the attention reads the prefix from the store) its new frames only."""
        if self._bufs is None:
            c = self.dit.cfg
            D, R = c.heads * c.dim_head, 2 * max(self.grid.batch)
            prefix = 0 if self.kv == "paged" else max(self.grid.prefix)
            n = c.depth * R * (prefix + max(self.grid.frames)) * D
            sizes = {"k_all": n, "v_all": n}
            with torch.inference_mode():
                self._bufs = {name: torch.empty(max(1, n), device=self.device, dtype=self.dtype)
                              for name, n in sizes.items()}
        return self._bufs

    @property
    def static_bytes(self) -> int:
        """Bytes of the set's arena, tables and shared K/V buffers (0 until the first bucket or row)."""
        meta = 0 if self._meta is None else self._meta.numel() * 8
        bufs = 0 if self._bufs is None else sum(t.numel() * t.element_size() for t in self._bufs.values())
        return (0 if self.arena is None else self.arena.nbytes) + meta + bufs

    def take(self, n: int, device, dtype) -> tuple[SolveArena, int]:
        if indexed_device(device) == self.device and dtype == self.dtype:
            slot = self._arena().take(n)
            if slot is not None:
                return self.arena, slot
        return self.eager.take(n, device, dtype)

    def bind(self, store: PageStore, consts: StepConsts) -> None:
        """Use `store`'s pages from now on: graphs captured against other pages are dropped."""
        with self._lock:
            if store is not self._store:
                if self._store is not None:  # graphs of the old pages: dropped, with their memory pool
                    self._drop_graphs()
                self._store = store
            self._consts = consts

    def _meta_view(self, key: tuple) -> torch.Tensor:
        C = self._store.chunk
        b, n, p = key
        shape = (b, META + -(-p // C) + -(-n // C))
        with torch.inference_mode():  # an inference tensor, filled in or out of inference mode alike
            if self._meta is None:
                width = META + -(-max(self.grid.prefix) // C) + -(-max(self.grid.frames) // C)
                self._meta = torch.zeros(max(self.grid.batch) * width, dtype=torch.long, device=self.device)
            view = self._meta[:math.prod(shape)].view(shape)
            view.copy_(meta_rows([], b, n, p, C))  # padding rows: what the warm-up / capture runs on
        return view

    def entry(self, key: tuple):
        """(the bucket's table, its replay); None when its capture ran out of memory."""
        with self._lock:
            if key in self._failed:
                return None
            if key not in self.entries:
                arena, store, consts, bufs = self._arena(), self._store, self._consts, self._buffers()
                meta = self._meta_view(key)
                _, n, p = key

                def step(meta=meta, n=n, p=p, kv=self.kv):
                    hop_step(self.fn, store, arena, meta, n, p, consts, bufs, kv)

                if self.cache is None:
                    self.entries[key] = (meta, step)
                else:
                    try:
                        self.cache.capture(key, (), static=True, collect=False, fn=step)
                    except torch.OutOfMemoryError:
                        self._failed.add(key)
                        self.counts["capture_failed"] += 1
                        self.cache.graphs.pop(key, None)
                        torch.cuda.empty_cache()
                        return None
                    self.entries[key] = (meta, lambda key=key: self.cache.run(key))
                self.counts["captured"] += 1
            return self.entries[key]

    def capture_all(self, store: PageStore, consts: StepConsts, progress: bool = False) -> None:
        """Bind `store` and capture every bucket, largest first (smaller graphs reuse the pool)."""
        self.bind(store, consts)
        keys = sorted(self.grid.keys(), key=lambda k: -(k[0] * k[1] * (k[1] + k[2])))
        gc.collect()  # once, not per graph (a collection per capture was a third of the set-up)
        if progress:
            from tqdm import tqdm

            keys = tqdm(keys, desc="capturing cached-hop DiT graphs", unit="graph")
        for k in keys:
            self.entry(k)

    def run(self, store: PageStore, arena: SolveArena, rows: Sequence[tuple], N: int, P: int,
            consts: StepConsts) -> None:
        """One step of `rows` of `arena`: the smallest bucket's graph when the rows are in this set's arena and one
        holds them, else eagerly at the call's size."""
        self.shapes[(len(rows), N, P)] += 1
        key = self.grid.select(len(rows), N, P) if arena is self.arena else None
        if key is not None:
            self.bind(store, consts)
            got = self.entry(key)
            if got is not None:
                meta, replay = got
                b, n, p = key
                host = meta_rows(rows, b, n, p, store.chunk)
                with torch.inference_mode():
                    meta.copy_(host.pin_memory() if self.device.type == "cuda" else host, non_blocking=True)
                replay()
                self.counts["hits"] += 1
                self.replays[key] += 1
                return
        self.counts["misses"] += 1
        self.eager.run(store, arena, rows, N, P, consts)

    def stats(self) -> dict:
        """Counts, the K / V form, the grid, and per call shape "b,n,p" (requests, new frames, prefix frames) and per
        bucket key the calls so far (`trtbuild coverage`'s derive_cached_grid takes the shapes)."""
        return {**self.counts, "kv_form": self.kv, "grid": self.grid.to_dict(), "graphs": self.graphs,
                "static_bytes": self.static_bytes,
                "shapes": {",".join(map(str, k)): v for k, v in sorted(self.shapes.items())},
                "replays": {",".join(map(str, k)): v for k, v in sorted(self.replays.items())}}

    def release(self, store: Optional[PageStore]) -> None:
        """Drop the graphs (and the arena) when they were made for `store`'s pages (its pool is closing)."""
        if store is not None and store is self._store:
            self.close()

    def close(self) -> None:
        self._drop_graphs()  # the graphs and their pool go
        self.arena = self._meta = self._store = self._consts = self._bufs = None
        self.eager.arena = None
