"""The DiT's grouped convolution (conv position embedding: C channels in G groups, kernel K, no padding, stride 1) as
one Triton kernel: `COSYTRT_DIT_CONV=triton` (opt-in until measured on a GPU; runtime/models/dit_conv.py).

Why: run 64's profile of the compiled cached-hop step (H100, BENCHMARKS.md) shows cuDNN running each of the DiT's two
grouped convolutions as 16 launches of `cutlass_tensorop_bf16_s16816fprop_analytic` (one per group, ~33 µs each) plus
layout conversions (`nchwToNhwc` / `nhwcToNchw`): ~1.3-1.5 ms of a one-request step's ~3.2 ms of kernels, for ~1
GFLOP. Here one program computes BT output frames x the CG channels of one group for one row: K tensor-core dots of
[BT, CG] x [CG, CG] (the input window shifted by k, the tap-k weights), fp32 accumulation, bias, one store. The input
is read through its strides, so the DiT's [B, C, T] views of [B, T, C] tensors (what `forward_cached` passes) need no
transposing copy; the output is written the same way by default (a [B, C, T_out] view of [B, T_out, C] memory, as
the channels-last cuDNN conv returns it): run 65 found the kernel 2.2-6.6x faster than cuDNN alone but the step
1.02-1.12x slower with a contiguous [B, C, T_out] output, which the DiT's next ops (Mish, `transpose(1, 2)`, the
residual add) then read transposed.

Values: the same convolution up to the order of the fp32 accumulation (tests/test_dit_conv_triton.py checks it
against F.conv1d through Triton's interpreter on CPU, fp32 and fp16, contiguous and transposed inputs).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

# whether Triton imports / whether the kernel runs for a tensor (also this module's API)
from .bi_attention_triton import available, runs_on  # noqa: F401

BLOCK_T = 64  # output frames per program


def supports(x: torch.Tensor, weight: torch.Tensor, groups: int) -> bool:
    """Whether `grouped_conv1d` takes these: channels per group a power of two of at least 16 (tl.dot's smallest
    K / N), the same count in and out."""
    cin_g = weight.shape[1]
    cout_g = weight.shape[0] // groups
    return x.dim() == 3 and cin_g == cout_g and cin_g >= 16 and not cin_g & (cin_g - 1) and \
        x.shape[1] == cin_g * groups


@functools.lru_cache(maxsize=1)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def conv_kernel(X, W, BIAS, Y, t_out, sx_b, sx_c, sx_t, sy_b, sy_c, sy_t,
                    K: tl.constexpr, CG: tl.constexpr, BT: tl.constexpr, HAS_BIAS: tl.constexpr,
                    PREC: tl.constexpr):
        tile = tl.program_id(0)
        g = tl.program_id(1)
        b = tl.program_id(2)
        t = tile * BT + tl.arange(0, BT)                       # output frames of this program
        c = tl.arange(0, CG)
        tm = t < t_out
        x_base = X + b * sx_b + (g * CG + c)[None, :] * sx_c   # [1, CG] input channels of group g
        # W: the weights as [G, K, CG (in), CG (out)] (`tap_major`), so a tap's [ci, co] tile is contiguous
        w_base = W + g * (K * CG * CG) + c[:, None] * CG + c[None, :]
        acc = tl.full([BT, CG], 0.0, tl.float32)
        for k in range(K):
            xk = tl.load(x_base + (t + k)[:, None] * sx_t, mask=tm[:, None], other=0.0)   # [BT, CG(ci)]
            wk = tl.load(w_base + k * (CG * CG))                                        # [CG(ci), CG(co)]
            acc += tl.dot(xk, wk, input_precision=PREC)
        if HAS_BIAS:
            acc += tl.load(BIAS + g * CG + c).to(tl.float32)[None, :]
        tl.store(Y + b * sy_b + (g * CG + c)[None, :] * sy_c + t[:, None] * sy_t, acc.to(Y.dtype.element_ty),
                 mask=tm[:, None])

    return conv_kernel


_TAP_MAJOR: dict = {}  # (weight's data_ptr, version, shape, dtype, device) -> (the weight, its [G, K, CG, CG] copy)


def tap_major(weight: torch.Tensor, groups: int) -> torch.Tensor:
    """weight [C, CG, K] as [G, K, CG (in), CG (out)], contiguous: made once per weight tensor and kept while that
    tensor is unchanged (the entry holds the weight, so its address cannot be reused by another tensor), except
    while a CUDA graph is being captured, where a missing copy is made inside the graph (a copy kept from a capture
    would live in the graph's private memory)."""
    c, cg, k = weight.shape
    try:
        version = weight._version
    except RuntimeError:  # an inference tensor keeps no version counter (weights made under inference_mode)
        version = -1
    key = (weight.data_ptr(), version, tuple(weight.shape), weight.dtype, str(weight.device))
    if key in _TAP_MAJOR:
        return _TAP_MAJOR[key][1]
    copy = weight.detach().view(groups, c // groups, cg, k).permute(0, 3, 2, 1).contiguous()
    if not (weight.is_cuda and torch.cuda.is_current_stream_capturing()):
        if len(_TAP_MAJOR) > 64:  # a long-lived process that replaces weights: drop the old copies
            _TAP_MAJOR.clear()
        _TAP_MAJOR[key] = (weight, copy)
    return copy


def grouped_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], groups: int,
                   block_t: int = BLOCK_T, num_warps: int = 4, time_major: bool = True) -> torch.Tensor:
    """F.conv1d(x, weight, bias, groups=groups) (no padding, stride 1) for x [B, C, T] (any strides), weight
    [C, C/groups, K] -> [B, C, T - K + 1], laid out time-major (a view of [B, T - K + 1, C] memory, the DiT's layout)
    or, `time_major=False`, contiguous as F.conv1d returns it. `block_t` / `num_warps`: the tile
    (benchmarks/dit_conv_check.py times 64 and 128 frames per program: each program reads every tap's weight tile
    once)."""
    if not supports(x, weight, groups):
        raise ValueError(f"Triton grouped conv: {x.shape[1]} channels in {groups} groups of weight "
                         f"{tuple(weight.shape)} (channels per group must be a power of two >= 16, in = out)")
    b, c, t_in = x.shape
    k = weight.shape[2]
    t_out = t_in - k + 1
    if time_major:
        y = torch.empty((b, max(t_out, 0), c), dtype=x.dtype, device=x.device).transpose(1, 2)
    else:
        y = torch.empty((b, c, max(t_out, 0)), dtype=x.dtype, device=x.device)
    if b == 0 or t_out <= 0:
        return y
    w = tap_major(weight, groups)
    has_bias = bias is not None
    _kernel()[(-(-t_out // block_t), groups, b)](
        x, w, bias.contiguous() if has_bias else w, y, t_out,
        x.stride(0), x.stride(1), x.stride(2), y.stride(0), y.stride(1), y.stride(2),
        K=k, CG=c // groups, BT=block_t, HAS_BIAS=has_bias,
        PREC="ieee" if x.dtype == torch.float32 else "tf32", num_warps=num_warps)
    return y
