"""Batch-invariant RMSNorm and SiLU-gate as single Triton kernels (CUDA), for `batch_invariant` (issue #20's price).

Why: with the switch on, an eager decode step costs 1.3–1.7x the plain one on the H200 (run 22) although its GEMMs move
the same weights: the extra time is kernel count. The torch forms of `rms_norm` (fp32 cast, square, mean, rsqrt,
two multiplies, casts: ~7 kernels, twice per layer) and of `silu(gate) * up` (~6) run ~20 extra small kernels per
layer, ~480 per step. Here each is one kernel:

- `rms_norm`: one program per row; the row's sum of squares is one `tl.sum` over a fixed block of the hidden size, so
  its order depends only on the hidden size, never on the number of rows (batch-invariant by construction).
- `silu_mul`: elementwise, no reduction (invariant whatever the launch).

Rounding follows the torch forms (fp32 statistics, the normalised row cast to x's dtype before the weight multiply;
SiLU in fp32 cast to the gate's dtype before the up multiply); values may differ from them in the last bits (another
reduction order, Triton's exp), which the switch does not promise. Defined on first use (TRITON_INTERPRET=1 set by a
test first runs them on CPU tensors). Off until a GPU run has checked them: `batch_invariant.NORM_IMPL`.
"""
import functools

import torch


@functools.lru_cache(maxsize=1)
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def rms_norm_kernel(X, W, Y, n_cols, eps, stride_x, stride_y, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        m = cols < n_cols
        x = tl.load(X + row * stride_x + cols, mask=m, other=0.0)
        xf = x.to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
        w = tl.load(W + cols, mask=m, other=0.0)
        y = (xf * r).to(x.dtype).to(tl.float32) * w.to(tl.float32)
        tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=m)

    @triton.jit
    def silu_mul_kernel(G, U, Y, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        g = tl.load(G + i, mask=m, other=0.0)
        gf = g.to(tl.float32)
        s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
        u = tl.load(U + i, mask=m, other=0.0).to(tl.float32)
        tl.store(Y + i, (s * u).to(Y.dtype.element_ty), mask=m)

    return rms_norm_kernel, silu_mul_kernel


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`batch_invariant.rms_norm`'s value (x [..., H], weight [H]) with one program per row."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    out = torch.empty(flat.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if flat.shape[0]:
        _kernels()[0][(flat.shape[0],)](flat, weight.contiguous(), out, flat.shape[1], float(eps), flat.stride(0),
                                        out.stride(0), BLOCK=max(16, 1 << (flat.shape[1] - 1).bit_length()),
                                        num_warps=4)
    return out.view(shape)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` as `batch_invariant` computes it, one elementwise kernel."""
    g, u = gate.contiguous(), up.contiguous()
    out = torch.empty(g.shape, dtype=torch.promote_types(g.dtype, u.dtype), device=g.device)
    n = g.numel()
    if n:
        block = 1024
        _kernels()[1][(-(-n // block),)](g, u, out, n, BLOCK=block, num_warps=4)
    return out
