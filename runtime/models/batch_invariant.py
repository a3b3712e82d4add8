"""Batch-invariant LM kernels: a request's logits do not depend on the rows that share its prefill or decode step,
nor on the padded batch bucket or KV-length rung it runs in (issue #20: same seed, same audio, whatever else is in
the batch).

Why batched logits drift: a GEMM's kernel (and so each output's reduction order) is picked from its shape, and the
number of rows is part of the shape (CPU MKL runs one row as a GEMV, two or more as a GEMM; cuBLAS picks tiles and
split-K from M); norms and softmax sums are reductions whose strategy depends on the tensor size; the decode
attention reads a KV length that depends on the longest row; and a sampled token flips on a last-bit difference.

The rule here: every reduction the LM runs is either a kernel call of a FIXED shape, whatever the batch, or a
reduction whose per-output order cannot depend on the batch / rung:

- `linear`: rows are cut into tiles of exactly `rows` rows (the last one zero-padded) and each tile is one F.linear
  call, so every call has the same (M, K, N) and the same kernel; a row's result does not depend on its neighbours
  nor on where it sits in the tile (checked on CPU by tests/test_batch_invariance.py; the GPU script checks cuBLAS).
  Decode GEMMs are weight-bandwidth bound, so a batch-1 step padded to 64 rows costs about what one row does (the
  serving scheduler decodes at most 64 rows: one tile).
- `rms_norm`: the mean of squares is taken per tile of `rows` rows (fixed shape).
- `silu`: x / (1 + exp(-x)) (F.silu's CPU kernel computes a vector body and a scalar tail differently, so an
  element's value depended on its index in the tensor; exp, add and divide do not).
- `attention`: one code path for decode and prefill, all batch sizes: keys are split into blocks of `block`
  positions (the last block zero-padded); the softmax max is taken over the whole row (max is exact in any order),
  each block's sums (sum p, p @ V) are reductions of a fixed size `block`, and the block partials are added left to
  right. Masked positions give p = exp(-inf) = 0 exactly, so a block past the row's last real position adds exactly
  0: the result is the same for every KV rung and padded length (no dependence on the padded KV length), and each
  prefill row attends at its own length. On CUDA that torch form still hands cuBLAS batched matmuls whose batch count
  (rows x kv heads x key blocks) depends on the other rows, and cuBLAS picks its kernel from it (a 64-row decode step
  moved a row's logits by 7.8e-3 on the H200), so there the op runs `bi_attention_triton`'s kernel instead: one
  program per (row, kv head, query), keys in fixed blocks up to the row's own length (`ATTENTION_IMPL`). Decode
  steps on CUDA take the split-KV kernels instead (`DECODE_ATTENTION`), invariant the same way and faster.

Each is a torch custom op: torch.compile keeps them opaque (Inductor fuses only the elementwise work around them, and
does not re-derive its own reduction strategy), so the eager, CUDA-graph and compiled paths run the same kernels.
The LM uses them when `CosyVoice3LM.batch_invariant` is on (`SchedulerConfig.batch_invariant`, default off).
"""
import functools
import logging
import math
import os
from typing import Optional

import torch
import torch.nn.functional as F

from . import bi_attention_triton as _triton_attn
from . import bi_norm_triton as _triton_norm
from . import decode_attention_triton as _split_kv
from .rope import apply_rope, rope_cos_sin

DECODE_ROWS = 64      # rows per GEMM / norm call in decode steps and for the prefill's last-position logits
PREFILL_ROWS = 256    # token rows per GEMM / norm call in prefill
KV_BLOCK = 256        # keys per attention block (the scheduler's KV rungs are multiples of it)
# "auto": the Triton kernel for CUDA tensors when Triton imports, else the torch form; "torch" / "triton" force one
# (the GPU check compares them). Read when the op runs (also inside compiled graphs: the op is opaque).
ATTENTION_IMPL = os.environ.get("COSYTRT_BI_ATTENTION", "auto")
# Decode steps (one query per row, attending keys 0..its position): "auto" runs them through the split-KV kernels
# (`decode_attention_triton`) on CUDA — fixed 64-key splits at absolute positions, merged left to right up to the
# row's own position, so a row's value depends neither on the other rows nor on the KV rung, by construction and as
# checked on an H100 (BENCHMARKS.md run 62: bit-identical alone and beside other rows; 2.5-3.2x faster than the fused
# SDPA up to 16 rows, where `bi_attention_triton` walks the keys on CUDA cores); "bi": always `attention` below;
# "split_kv": the split-KV kernels wherever they run (Triton's interpreter on CPU: the tests). Read when the step runs.
DECODE_ATTENTION = os.environ.get("COSYTRT_BI_DECODE_ATTENTION", "auto")
# "torch" (default until a GPU run has checked them) / "triton" / "auto": `rms_norm` and the SiLU gate as one Triton
# kernel each on CUDA (bi_norm_triton.py: ~20 fewer kernels per layer, the switch's price in the eager graphs)
NORM_IMPL = os.environ.get("COSYTRT_BI_NORM", "torch")


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    pad = -x.shape[0] % rows
    return F.pad(x, (0, 0, 0, pad)) if pad else x


@torch.library.custom_op("cosytrt::bi_linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], rows: int) -> torch.Tensor:
    """F.linear(x, weight, bias) computed as F.linear calls of exactly `rows` rows each (x [..., K])."""
    lead, k = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, k)
    n = flat.shape[0]
    tiles = _pad_rows(flat, rows).split(rows)
    out = F.linear(tiles[0], weight, bias) if len(tiles) == 1 else torch.cat([F.linear(t, weight, bias) for t in tiles])
    return out[:n].reshape(*lead, weight.shape[0])


@linear.register_fake
def _(x, weight, bias, rows):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("cosytrt::bi_rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, rows: int) -> torch.Tensor:
    """`llm.RMSNorm` (fp32 statistics) with the mean of squares taken per tile of `rows` rows."""
    if _use_triton_norm(x):
        return _triton_norm.rms_norm(x, weight, eps)
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    n = flat.shape[0]
    outs = []
    for tile in _pad_rows(flat, rows).split(rows):
        f = tile.float()
        outs.append(weight * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out[:n].reshape(shape)


@rms_norm.register_fake
def _(x, weight, eps, rows):
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


def _use_triton_norm(x: torch.Tensor) -> bool:
    return NORM_IMPL == "triton" or (NORM_IMPL == "auto" and x.is_cuda and _triton_attn.available())


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up: plain ops (which torch.compile fuses) with NORM_IMPL "torch", else an opaque op that runs one
    Triton kernel on CUDA (elementwise either way: no batch dependence)."""
    if NORM_IMPL == "torch":
        return silu(gate) * up
    return _silu_mul_op(gate, up)


@torch.library.custom_op("cosytrt::bi_silu_mul", mutates_args=())
def _silu_mul_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if _use_triton_norm(gate):
        return _triton_norm.silu_mul(gate, up)
    return silu(gate) * up


@_silu_mul_op.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype))


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU from ops whose value per element does not depend on the element's index (computed in fp32)."""
    f = x.float()
    return (f / (1 + torch.exp(-f))).to(x.dtype)


@torch.library.custom_op("cosytrt::bi_attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, kv_len: torch.Tensor,
              block: int) -> torch.Tensor:
    """Grouped-query attention with a reduction order independent of the batch and of the padded KV length.

    q [B, kvh, Q, G, hd] (Q query positions, G query heads per kv head), k / v [B, kvh, n, hd], q_pos [B, Q] (long:
    each query's position), kv_len [B] (long). Query (b, t) attends keys j <= q_pos[b, t] and j < kv_len[b] (key 0
    must be one of them). Returns [B, kvh, Q, G, hd] in q's dtype; computed in fp32."""
    if ATTENTION_IMPL == "triton" or (ATTENTION_IMPL == "auto" and _triton_attn.supports(q, k, v)
                                       and _triton_attn.available()):
        return _triton_attn.attention(q, k, v, q_pos, kv_len)
    if q.is_cuda:
        _warn_torch_form_on_cuda()
    b, kvh, nq, g, hd = q.shape
    n = k.shape[2]
    nb = -(-n // block)
    kf, vf = k.float(), v.float()
    if nb * block > n:
        kf = F.pad(kf, (0, 0, 0, nb * block - n))
        vf = F.pad(vf, (0, 0, 0, nb * block - n))
    qf = q.float().reshape(b, kvh, nq * g, hd)
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * (1.0 / math.sqrt(hd))          # [B, kvh, Q*G, nb*block]
    j = torch.arange(nb * block, device=q.device)
    ok = (j[None, None, :] <= q_pos[:, :, None]) & (j[None, None, :] < kv_len[:, None, None])  # [B, Q, nb*block]
    ok = ok[:, None, :, None, :].expand(b, 1, nq, g, nb * block).reshape(b, 1, nq * g, nb * block)
    scores = scores.masked_fill(~ok, float("-inf"))
    p = torch.exp(scores - scores.amax(dim=-1, keepdim=True))                           # masked -> exactly 0
    p = p.view(b, kvh, nq * g, nb, block)
    sums = p.sum(dim=-1)                                                                # [B, kvh, Q*G, nb]
    outs = torch.matmul(p.transpose(2, 3), vf.view(b, kvh, nb, block, hd))              # [B, kvh, nb, Q*G, hd]
    total, out = sums[..., 0], outs[:, :, 0]
    for i in range(1, nb):  # left to right: blocks past the last real key add exactly 0
        total = total + sums[..., i]
        out = out + outs[:, :, i]
    return (out / total[..., None]).view(b, kvh, nq, g, hd).to(q.dtype)


@functools.lru_cache(maxsize=1)
def _warn_torch_form_on_cuda() -> None:
    logging.getLogger(__name__).warning(
        "batch-invariant attention: the Triton kernel is not available here (Triton missing or an unsupported head "
        "dim), so CUDA runs the torch form, whose batched matmuls cuBLAS may run differently per batch size (a "
        "64-row decode step moved logits by 7.8e-3 on the H200): tokens may depend on the batch")


@attention.register_fake
def _(q, k, v, q_pos, kv_len, block):
    return q.new_empty(q.shape)  # contiguous, as the op returns it


def decode_attention(q: torch.Tensor, cache, slots: Optional[torch.Tensor], n: int, q_pos: torch.Tensor,
                     kv_len: torch.Tensor, block: int) -> torch.Tensor:
    """`attention` for a decode step (q [B, kvh, 1, G, hd]; row b attends keys 0..q_pos[b, 0] = kv_len[b] - 1 of
    the slot cache's row slots[b], or of row b when `slots` is None): the split-KV kernels where `DECODE_ATTENTION`
    picks them and they take the tensors — reading each row's K / V in place from its slot, as the default decode
    step does —, else `attention` over the rows' gathered K / V."""
    mode = DECODE_ATTENTION
    b = q.shape[0]
    if mode == "split_kv" or (mode == "auto" and q.is_cuda):
        q1 = q[:, :, 0]
        if _split_kv.runs_on(q) and _split_kv.supports(q1, cache.k, cache.v):
            if slots is None:
                return _split_kv.split_kv_decode_attention(q1, cache.k[:b, :, :n], cache.v[:b, :, :n],
                                                           q_pos[:, 0])[:, :, None]
            return _split_kv.split_kv_decode_attention_slots(q1, cache.k, cache.v, slots, q_pos[:, 0], n)[:, :, None]
    if slots is None:
        return attention(q, cache.k[:b, :, :n], cache.v[:b, :, :n], q_pos, kv_len, block)
    return attention(q, cache.k[slots, :, :n], cache.v[slots, :, :n], q_pos, kv_len, block)


# ------------------------------------------------------------------------------------------ the LM's two calls

def _layer(layer, x, cos, sin, rows, write, attend, q_pos, kv_len):
    """One decoder layer on x [..., H]; `write(k, v)` stores this step's K/V [B, kvh, Q, hd] and `attend(q)` returns
    the attention of q [B, kvh, Q, G, hd] over the stored keys / values."""
    attn, mlp = layer.self_attn, layer.mlp
    lead = x.shape[:-1]
    b, nq = q_pos.shape
    heads, kvh, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
    h = rms_norm(x, layer.input_layernorm.weight, layer.input_layernorm.eps, rows)
    q, k, v = linear(h, attn.qkv_proj.weight, attn.qkv_proj.bias, rows).split(attn.qkv_proj.split_sizes, dim=-1)
    q = apply_rope(q.reshape(b, nq, heads, hd), cos, sin)
    k = apply_rope(k.reshape(b, nq, kvh, hd), cos, sin)
    write(k.transpose(1, 2), v.reshape(b, nq, kvh, hd).transpose(1, 2))
    q = q.view(b, nq, kvh, heads // kvh, hd).transpose(1, 2)                            # [B, kvh, Q, G, hd]
    out = attend(q)
    out = out.transpose(1, 2).reshape(*lead, heads * hd)
    x = x + linear(out, attn.o_proj.weight, None, rows)
    h = rms_norm(x, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps, rows)
    gate, up = linear(h, mlp.gate_up_proj.weight, None, rows).split(mlp.gate_up_proj.split_sizes, dim=-1)
    return x + linear(silu_mul(gate, up), mlp.down_proj.weight, None, rows)


def prefill(lm, embeds: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor):
    """`CosyVoice3LM.prefill` with batch-invariant kernels: (last-position logits [B, V], hidden [B, T, H])."""
    b, t, _ = embeds.shape
    dev = embeds.device
    lengths = lengths.to(dev)
    qc = lm.config.qwen
    positions = torch.arange(t, device=dev)
    cos, sin = rope_cos_sin(positions, qc.head_dim, qc.rope_theta, embeds.dtype)
    cos, sin = cos[None, :, None], sin[None, :, None]                                  # [1, T, 1, hd]
    q_pos = positions[None].expand(b, t)
    x = embeds
    for layer in lm.backbone.layers:
        cache = layer.self_attn.kv_cache
        fresh = {}

        def write(k, v, cache=cache, fresh=fresh):
            cache.write_prefix(slots, k, v)
            fresh["kv"] = (k, v)

        def attend(q, fresh=fresh):
            return attention(q, *fresh["kv"], q_pos, lengths, KV_BLOCK)

        x = _layer(layer, x, cos, sin, PREFILL_ROWS, write, attend, q_pos, lengths)
    hidden = rms_norm(x, lm.backbone.norm.weight, lm.backbone.norm.eps, PREFILL_ROWS)
    last = hidden[torch.arange(b, device=dev), lengths - 1]
    return linear(last, lm.llm_decoder.weight, None, DECODE_ROWS), hidden


def decode(lm, x: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, n: int, rows_are_slots: bool):
    """`CosyVoice3LM.decode` with batch-invariant kernels on embeddings x [B, H]: (logits [B, V], hidden [B, H])."""
    b = x.shape[0]
    qc = lm.config.qwen
    cos, sin = rope_cos_sin(positions[:, None], qc.head_dim, qc.rope_theta, x.dtype)   # [B, 1, hd]
    cos, sin = cos[:, :, None], sin[:, :, None]                                        # [B, 1, 1, hd]
    q_pos, kv_len = positions[:, None], positions + 1
    for layer in lm.backbone.layers:
        cache = layer.self_attn.kv_cache

        def write(k, v, cache=cache):
            cache.write_one(slots, positions, k, v)

        def attend(q, cache=cache):
            return decode_attention(q, cache, None if rows_are_slots else slots, n, q_pos, kv_len, KV_BLOCK)

        x = _layer(layer, x, cos, sin, DECODE_ROWS, write, attend, q_pos, kv_len)
    hidden = rms_norm(x, lm.backbone.norm.weight, lm.backbone.norm.eps, DECODE_ROWS)
    return linear(hidden, lm.llm_decoder.weight, None, DECODE_ROWS), hidden
