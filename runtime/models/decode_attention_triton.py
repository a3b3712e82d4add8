"""Split-KV ("flash-decoding") attention for the LM's decode step, two Triton kernels (CUDA), behind
`CosyVoice3LM.decode_attention_impl = "split_kv"` (`SchedulerConfig.ar_decode_attention`).

Why (issue #18, BENCHMARKS run 56): at 12 req/s of mixed streams on an H100 the heaviest kernel of the whole process
was the AR's decode attention (cuDNN's fused SDPA, ~165 ms of every 2 s), ~0.7 ms of the AR's ~1.8 ms of kernels per
step. A decode step has one query per row: the fused kernel is built for long queries and gets one block per (row,
kv head) — 32 blocks for 16 rows on a 132-SM GPU, each walking the whole padded KV rung under the mask — so it is
latency-bound far above what reading K and V costs (~3 µs a layer at 16 rows and 1024 keys).

Here the keys are cut into fixed splits of SPLIT positions. Kernel 1 runs one program per (split, kv head, row): the
row's G query heads (padded to 16 rows) against that split's keys as one tile, both products on tensor cores
(`tl.dot`, fp32 accumulation; the probabilities rounded to the cache's dtype before the PV product, as the fused
kernels do; fp32 inputs keep IEEE fp32 products), keys past the row's own last position masked and never read, and
writes the split's (max, sum, unnormalised output). A split wholly past the row's end does nothing. Kernel 2, one
program per (kv head, row), merges the row's splits left to right. Work and parallelism follow each row's own length;
the splits sit at fixed absolute key positions, so a row's value does not depend on the other rows of the call nor on
the padded KV rung (the same reduction order alone or batched). The kernels are defined on first use (not at import),
so TRITON_INTERPRET=1 set by a test first runs them on CPU tensors (tests/test_decode_attention_triton.py).

History: the first version (session 20) walked each split in blocks of 16 keys with an online softmax on CUDA cores
(broadcast products of 8 padded query rows). On an H100 (BENCHMARKS run 58, `benchmarks/split_kv_gpu_check.py`) its
values held (bf16 max error 4e-3 against the fp32 reference, a row's bits the same alone and beside others) but it
was slower than the fused SDPA except at batch 1 with 1024+ keys: 18 / 45 / 150 µs per layer at batch 1 / 16 / 64 and
256 / 1024 / 1024 keys against SDPA's 15 / 28 / 31 µs, and at 12 req/s the LM with it delivered 71.4 vs 74.0 audio s/s
(run 59). The fused kernel's time barely grows with the batch, yet it stays ~10x above what reading K and V costs at
16 rows. This version (one tensor-core tile per split, no inner loop; run 62, H100) takes 4.7 / 10.5 / 20.6 µs per
layer at batch 1 / 16 / 64 and 256 / 1024 / 1024 keys against SDPA's 15.3 / 27.6 / 30.4 (2.5-3.2x faster up to 16
rows, even at 64 rows and 2048 keys), with the same values and row invariance; the uncompiled full-size LM's step is
6-7 % shorter with it. In the compiled variant at 12 req/s of mixed streams on an H200 it delivered 1.12x the audio of
SDPA (run 63), so the scheduler takes it on CUDA by default (`SchedulerConfig.ar_decode_attention` "auto").

The decode step calls `split_kv_decode_attention_slots`: the kernels read each row's K / V in place from its slot of
the cache (`rows=`), where gathering `cache[slots, :, :n]` first was one more copy of every row's K / V per layer
(Inductor's gather kernel, ~20 µs a layer call in run 63's profile, as long as the attention itself); the same bits.
"""
from __future__ import annotations

import functools
import math

import torch

# whether Triton imports / whether the kernels run for a tensor (also this module's API)
from .bi_attention_triton import available, runs_on  # noqa: F401

SPLIT = 64   # key positions per split: one program reads them as one tile
MIN_ROWS = 16  # query rows per program at least (tl.dot's smallest M): G query heads padded up to this


@functools.lru_cache(maxsize=1)
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def split_kernel(Q, K, V, ROWS, POS, M, L, ACC, g_real, n_keys, n_splits, scale,
                     sq_b, sq_h, sq_g, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n,
                     HD: tl.constexpr, GP: tl.constexpr, SPL: tl.constexpr, PREC: tl.constexpr,
                     INDIRECT: tl.constexpr):
        s_id = tl.program_id(0)
        h = tl.program_id(1)
        b = tl.program_id(2)
        end = tl.minimum(tl.load(POS + b) + 1, n_keys)   # keys 0..position of this row (never past the view)
        lo = s_id * SPL
        if lo < end:                                     # a split past the row's end: nothing to read or write
            if INDIRECT:
                kb = tl.load(ROWS + b)                   # the row of K / V this query row reads (its KV slot)
            else:
                kb = b
            g = tl.arange(0, GP)
            d = tl.arange(0, HD)
            jj = lo + tl.arange(0, SPL)
            jm = jj < end
            gm = g < g_real                                  # the real query heads (the rest pad tl.dot's rows)
            q = tl.load(Q + b * sq_b + h * sq_h + g[:, None] * sq_g + d[None, :], mask=gm[:, None],
                        other=0.0)                                                    # [GP, HD], cache dtype
            kt = tl.load(K + kb * sk_b + h * sk_h + jj[None, :] * sk_n + d[:, None], mask=jm[None, :],
                         other=0.0)                                                   # [HD, SPL]
            s = tl.dot(q, kt, input_precision=PREC) * scale                           # [GP, SPL] fp32
            s = tl.where(jm[None, :], s, float("-inf"))
            m = tl.max(s, axis=1)
            p = tl.exp(s - m[:, None])
            v = tl.load(V + kb * sv_b + h * sv_h + jj[:, None] * sv_n + d[None, :], mask=jm[:, None],
                        other=0.0)                                                    # [SPL, HD]
            acc = tl.dot(p.to(v.dtype), v, input_precision=PREC)                      # [GP, HD] fp32
            base = (b * tl.num_programs(1) + h) * n_splits + s_id                      # [B, kvh, splits] order
            tl.store(M + base * GP + g, m, mask=gm)          # padded rows are never written nor read
            tl.store(L + base * GP + g, tl.sum(p, axis=1), mask=gm)
            tl.store(ACC + (base * GP + g[:, None]) * HD + d[None, :], acc, mask=gm[:, None])

    @triton.jit
    def merge_kernel(POS, M, L, ACC, O, g_real, n_keys, n_splits, so_b, so_h, so_g,
                     HD: tl.constexpr, GP: tl.constexpr, SPL: tl.constexpr):
        h = tl.program_id(0)
        b = tl.program_id(1)
        g = tl.arange(0, GP)
        gm = g < g_real
        d = tl.arange(0, HD)
        end = tl.minimum(tl.load(POS + b) + 1, n_keys)
        used = (end + SPL - 1) // SPL                     # the splits holding keys 0..position
        row = (b * tl.num_programs(0) + h) * n_splits
        m = tl.full([GP], float("-inf"), tl.float32)
        total = tl.full([GP], 0.0, tl.float32)
        acc = tl.full([GP, HD], 0.0, tl.float32)
        for s_id in range(0, used):
            base = row + s_id
            m_s = tl.load(M + base * GP + g, mask=gm, other=0.0)
            m_new = tl.maximum(m, m_s)
            a_old = tl.exp(m - m_new)
            a_s = tl.exp(m_s - m_new)
            total = total * a_old + tl.load(L + base * GP + g, mask=gm, other=1.0) * a_s
            acc = acc * a_old[:, None] + tl.load(ACC + (base * GP + g[:, None]) * HD + d[None, :], mask=gm[:, None],
                                                 other=0.0) * a_s[:, None]
            m = m_new
        out = acc / total[:, None]
        tl.store(O + b * so_b + h * so_h + g[:, None] * so_g + d[None, :], out.to(O.dtype.element_ty),
                 mask=gm[:, None])

    return split_kernel, merge_kernel


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `attention` takes these tensors: a power-of-two head dim of at least 16, unit last strides."""
    hd = q.shape[-1]
    return (hd >= 16 and not hd & (hd - 1)
            and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The op's value in plain torch (fp32): q [B, kvh, G, hd], k / v [B, kvh, n, hd], row b attends keys
    0..positions[b]. The CPU path when the kernels do not run."""
    n = k.shape[2]
    keep = torch.arange(n, device=k.device)[None, :] <= positions.to(k.device)[:, None]        # [B, n]
    scores = torch.einsum("bhgd,bhnd->bhgn", q.float(), k.float()) * q.shape[-1] ** -0.5
    probs = torch.softmax(scores.masked_fill(~keep[:, None, None, :], float("-inf")), dim=-1)
    return torch.einsum("bhgn,bhnd->bhgd", probs, v.float()).to(q.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
              rows: torch.Tensor | None = None, n_keys: int | None = None) -> torch.Tensor:
    """q [B, kvh, G, hd] (G query heads per kv head), k / v [B, kvh, n, hd] (any strides with a unit last one, e.g.
    a view of the slot cache), positions [B] (row b attends keys 0..positions[b]; a position >= n attends all n, as
    the mask would) -> [B, kvh, G, hd]. The head dim must be a power of two, at least 16 (tl.dot's smallest K).
    `rows` [B] (with `n_keys`): k / v are the whole slot cache [slots, kvh, max_len, hd] and query row b reads its
    K / V in place from row rows[b], keys 0..min(positions[b], n_keys - 1) — the same values as gathering
    `k[rows, :, :n_keys]` first, without that copy (a read and write of every row's K / V, every layer)."""
    b, kvh, g, hd = q.shape
    n = k.shape[2] if rows is None else int(n_keys)
    if not supports(q, k, v):
        raise ValueError(f"split-KV decode attention: head dim {hd} must be a power of two >= 16 with unit stride")
    if rows is not None and not 0 < n <= k.shape[2]:
        raise ValueError(f"split-KV decode attention: n_keys {n} outside 1..{k.shape[2]}")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    gp = max(MIN_ROWS, 1 << (g - 1).bit_length())
    splits = -(-n // SPLIT)
    m = torch.empty((b, kvh, splits, gp), dtype=torch.float32, device=q.device)
    lse = torch.empty_like(m)
    acc = torch.empty((b, kvh, splits, gp, hd), dtype=torch.float32, device=q.device)
    pos = positions.to(device=q.device, dtype=torch.int64).contiguous()
    indirect = rows is not None
    rows = rows.to(device=q.device, dtype=torch.int64).contiguous() if indirect else pos  # (unread when direct)
    split_kernel, merge_kernel = _kernels()
    split_kernel[(splits, kvh, b)](
        q, k, v, rows, pos, m, lse, acc, g, n, splits, 1.0 / math.sqrt(hd),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), HD=hd, GP=gp, SPL=SPLIT,
        PREC="ieee" if q.dtype == torch.float32 else "tf32", INDIRECT=indirect, num_warps=4)
    merge_kernel[(kvh, b)](pos, m, lse, acc, out, g, n, splits, out.stride(0), out.stride(1), out.stride(2),
                           HD=hd, GP=gp, SPL=SPLIT, num_warps=4)
    return out


@torch.library.custom_op("cosytrt::split_kv_decode_attention", mutates_args=())
def split_kv_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
                              ) -> torch.Tensor:
    """`attention` as an op torch.compile keeps opaque (the kernels where they run, else `reference`)."""
    if runs_on(q):
        return attention(q, k, v, positions)
    return reference(q, k, v, positions)


@split_kv_decode_attention.register_fake
def _(q, k, v, positions):
    return q.new_empty(q.shape)


@torch.library.custom_op("cosytrt::split_kv_decode_attention_slots", mutates_args=())
def split_kv_decode_attention_slots(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                    slots: torch.Tensor, positions: torch.Tensor, n_keys: int) -> torch.Tensor:
    """`attention` reading each row's K / V in place from the slot cache [slots, kvh, max_len, hd] (row b: slot
    slots[b], keys 0..min(positions[b], n_keys - 1)), kept opaque by torch.compile: the decode step's attention
    without gathering `cache[slots, :, :n_keys]` first (the kernels where they run, else `reference` of that
    gather)."""
    if runs_on(q):
        return attention(q, k_cache, v_cache, positions, rows=slots, n_keys=n_keys)
    idx = slots.to(k_cache.device)
    return reference(q, k_cache[idx, :, :n_keys], v_cache[idx, :, :n_keys], positions)


@split_kv_decode_attention_slots.register_fake
def _(q, k_cache, v_cache, slots, positions, n_keys):
    return q.new_empty(q.shape)
