"""The cached hop's DiT attention reading the prefix's K / V in place from the flow prefix store's pages
(`SchedulerConfig.dit_paged_prefix`, auto: on with CUDA and Triton since run 66; otherwise the cached hops gather the
prefix into one buffer first, `stages/flow_hop_calls.py`).

Why: a cached hop's Euler step attends its new frames over the request's cached prefix. The default step first
gathers every layer's prefix K / V rows from the page store into a [rows, prefix + new, D] buffer per layer, then
runs SDPA over it: in run 64 (H100, 8 requests x 200 new frames over 1500 cached) that gather was 30 % of the step's
kernel time. Here the attention takes the call's row table instead (for each CFG row and prefix position, the store
row holding that frame's K / V at this Euler step) and reads the prefix through it, as the LM's split-KV decode
kernels read each request's KV slot: no gather, no buffer of prefix size.

What is computed, per CFG row b, head h and new frame t (`reference` is the same in torch, and what runs where the
Triton kernel does not: CPU tensors without Triton's interpreter): softmax over the keys
  - prefix positions p < plen[b] (the row's own cached frames: every one of them lies in a chunk left of the new
    frames, so all are visible), read from store row rows[b, p];
  - new frames u < nvalid[b] with u // chunk <= t // chunk (block-causal in static chunks, the new frames starting
    on a chunk boundary),
of q·k / sqrt(head dim), times v. A new frame past nvalid[b] (padding) gets what SDPA gives it under
`DiT.forward_cached`'s mask where it has any key (its chunk's valid keys and the prefix), zeros where it has none
(SDPA's mask opens such a row to every key instead); the DiT masks padded frames' attention output to zero either
way (`key_valid`), so no value past nvalid reaches anything.

The kernel: one program per (block of BM new frames, head, CFG row), an online softmax over the prefix in blocks of
BN keys (stopping at the row's own plen: nothing depends on the call's padded prefix length or on other rows), then
over the new frames up to the block's last visible chunk; tensor-core dots with fp32 accumulation. Values: the
gathered SDPA's up to the order of the fp32 reduction (tests/test_hop_attention.py, through Triton's interpreter).
"""
from __future__ import annotations

import functools
import math
import os

import torch
import torch.nn.functional as F

from .bi_attention_triton import available, runs_on

LOG2E = 1.4426950408889634  # the kernel's softmax runs in base 2 (exp2), its scores scaled by log2(e)


def _tiles(text: str) -> tuple[int, int, int]:
    """COSYTRT_HOP_ATTN_TILES = "BMxBNxWARPS" (new frames per program, keys per loop step, warps), read at import:
    the tile for GPU A/B runs (benchmarks/hop_attention_tiles.py times several in one process)."""
    try:
        bm, bn, w = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"COSYTRT_HOP_ATTN_TILES={text!r}: want BMxBNxWARPS, e.g. 64x64x4") from None
    if any(v < 1 or v & (v - 1) for v in (bm, bn, w)) or bm < 16 or bn < 16:
        raise ValueError(f"COSYTRT_HOP_ATTN_TILES={text!r}: powers of two, BM and BN at least 16")
    return bm, bn, w


BM, BN, WARPS = _tiles(os.environ.get("COSYTRT_HOP_ATTN_TILES", "64x64x4"))


def compiled_on(device: torch.device) -> bool:
    """Whether the kernel runs compiled for tensors on `device` (CUDA with Triton; the interpreter's CPU runs are
    for tests only): where `SchedulerConfig.dit_paged_prefix`'s auto turns the paged form on."""
    return device.type == "cuda" and available()


def _check(q, k_new, v_new, store_k, store_v, rows, plen, nvalid, heads):
    B, T, D = q.shape
    if k_new.shape != (B, T, D) or v_new.shape != (B, T, D):
        raise ValueError(f"hop attention: new K / V {tuple(k_new.shape)} / {tuple(v_new.shape)} for queries "
                         f"{tuple(q.shape)}")
    if store_k.dim() != 2 or store_k.shape[1] != D or store_v.shape != store_k.shape:
        raise ValueError(f"hop attention: store K / V {tuple(store_k.shape)} / {tuple(store_v.shape)}, want [rows, {D}]")
    if rows.dim() != 2 or rows.shape[0] != B or plen.shape != (B,) or nvalid.shape != (B,):
        raise ValueError(f"hop attention: row table {tuple(rows.shape)}, plen {tuple(plen.shape)}, nvalid "
                         f"{tuple(nvalid.shape)} for {B} rows")
    if D % heads:
        raise ValueError(f"hop attention: {D} channels in {heads} heads")


def prefix_mask(prefix_valid: torch.Tensor, valid: torch.Tensor, chunk: int) -> torch.Tensor:
    """The attention mask of new frames after a cached prefix [B, 1, T, P + T] (True = may attend): every valid
    prefix position (prefix_valid [B, P]), and the valid new frames (valid [B, T]) block-causally in `chunk`-frame
    chunks (the new frames start on a chunk boundary); a query row with no allowed key is opened to every key, as
    `attention_mask` does, so SDPA gives no NaN. What `DiT.forward_cached` attends with over a gathered prefix."""
    B, T = valid.shape
    t = torch.arange(T, device=valid.device)
    own = (t.unsqueeze(0) < (t // chunk + 1).unsqueeze(1) * chunk).unsqueeze(0) & valid.unsqueeze(1)  # [B, T, T]
    allowed = torch.cat((prefix_valid.unsqueeze(1).expand(B, T, -1), own), dim=-1).unsqueeze(1)
    return allowed | ~allowed.any(dim=-1, keepdim=True)


def reference(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, store_k: torch.Tensor,
              store_v: torch.Tensor, rows: torch.Tensor, plen: torch.Tensor, nvalid: torch.Tensor, heads: int,
              chunk: int) -> torch.Tensor:
    """The gathered form: the prefix rows gathered from the store before the new frames' K / V, the mask of
    `DiT.forward_cached`, SDPA. q, k_new, v_new [B, T, D] (post-RoPE); store_k / store_v [store rows, D]; rows [B, P]
    (long); plen, nvalid [B] (long). Returns [B, T, D]."""
    _check(q, k_new, v_new, store_k, store_v, rows, plen, nvalid, heads)
    B, T, D = q.shape
    P = rows.shape[1]
    dev = q.device
    k = torch.cat((store_k.index_select(0, rows.reshape(-1)).view(B, P, D), k_new), dim=1)
    v = torch.cat((store_v.index_select(0, rows.reshape(-1)).view(B, P, D), v_new), dim=1)
    pre = torch.arange(P, device=dev).unsqueeze(0) < plen.unsqueeze(1)                    # [B, P]
    mask = prefix_mask(pre, torch.arange(T, device=dev).unsqueeze(0) < nvalid.unsqueeze(1), chunk)
    hd = D // heads
    qh, kh, vh = (z.view(B, -1, heads, hd).transpose(1, 2) for z in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
    return out.transpose(1, 2).reshape(B, T, D)


@functools.lru_cache(maxsize=1)
def _kernel():
    """The Triton kernel (hop_attention_kernel.py, imported on first use: Triton is optional)."""
    from .hop_attention_kernel import hop_attention_kernel

    return hop_attention_kernel


def supports(q: torch.Tensor, store_k: torch.Tensor, heads: int) -> bool:
    """Whether the kernel takes these: Triton runs for the tensors, a power-of-two head dim of at least 16 (tl.dot),
    unit stride along the channels."""
    hd = q.shape[-1] // heads
    return (runs_on(q) and q.dim() == 3 and hd >= 16 and not hd & (hd - 1) and q.shape[-1] == hd * heads
            and store_k.stride(-1) == 1)


def triton_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, store_k: torch.Tensor,
                     store_v: torch.Tensor, rows: torch.Tensor, plen: torch.Tensor, nvalid: torch.Tensor, heads: int,
                     chunk: int, block_m: int | None = None, block_n: int | None = None,
                     num_warps: int | None = None) -> torch.Tensor:
    """`reference`'s values (module docstring) by the Triton kernel, the prefix read in place; the tile: the
    module's BM / BN / WARPS unless given."""
    block_m, block_n, num_warps = block_m or BM, block_n or BN, num_warps or WARPS
    _check(q, k_new, v_new, store_k, store_v, rows, plen, nvalid, heads)
    if not supports(q, store_k, heads):
        raise ValueError(f"hop attention kernel: queries {tuple(q.shape)} on {q.device} in {heads} heads (head dim "
                         "a power of two >= 16, Triton for the device)")
    B, T, D = q.shape
    hd = D // heads
    o = torch.empty((B, T, D), dtype=q.dtype, device=q.device)
    if B == 0 or T == 0:
        return o
    for z in (q, k_new, v_new, store_v):
        if z.stride(-1) != 1:
            raise ValueError("hop attention kernel: the channels must have unit stride")
    if store_v.stride(0) != store_k.stride(0):
        raise ValueError("hop attention kernel: the store's K and V need the same row stride")
    rows = rows.contiguous() if rows.shape[1] else rows.new_zeros((B, 1))
    _kernel()[(-(-T // block_m), heads, B)](
        q, k_new, v_new, store_k, store_v, rows, plen, nvalid, o, T, LOG2E / math.sqrt(hd),
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        store_k.stride(0), rows.stride(0), o.stride(0), o.stride(1),
        HD=hd, CHUNK=chunk, BLOCK_M=block_m, BLOCK_N=block_n,
        PREC="ieee" if q.dtype == torch.float32 else "tf32", num_warps=num_warps)
    return o


@torch.library.custom_op("cosytrt::dit_hop_attention", mutates_args=())
def hop_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, store_k: torch.Tensor,
                  store_v: torch.Tensor, rows: torch.Tensor, plen: torch.Tensor, nvalid: torch.Tensor, heads: int,
                  chunk: int) -> torch.Tensor:
    """The op `DiT.forward_cached` calls with a paged prefix (opaque under torch.compile): the Triton kernel where
    it runs for these tensors, else the gathered torch form."""
    if supports(q, store_k, heads):
        q, k_new, v_new = (z if z.stride(-1) == 1 else z.contiguous() for z in (q, k_new, v_new))
        return triton_attention(q, k_new, v_new, store_k, store_v, rows, plen, nvalid, heads, chunk)
    return reference(q, k_new, v_new, store_k, store_v, rows, plen, nvalid, heads, chunk)


@hop_attention.register_fake
def _(q, k_new, v_new, store_k, store_v, rows, plen, nvalid, heads, chunk):
    return torch.empty_like(q, memory_format=torch.contiguous_format)
