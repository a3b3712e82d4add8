"""The batch-invariant LM attention as one Triton kernel (CUDA), for `batch_invariant.attention`.

Why a kernel of its own: the torch form of that op is exact on CPU, but on the H200 a decode step padded to 64 rows
gave a row logits 7.8e-3 away from the same row in a 2-row step, in the eager and eager + CUDA-graph forms (issue
#20, BENCHMARKS run 20). Its linears and norms run in fixed 64-row tiles, so the attention's batched matmuls remain:
cuBLAS picks their kernel (split-K included) from the batch count, which is rows x kv heads x key blocks — it depends
on the other rows and on the KV rung.

Here one program computes one (row, kv head, query position): its G query heads against that row's own keys, in
blocks of BLOCK keys, with an online softmax, left to right, up to the row's own last visible key. Nothing in a
program depends on the grid (the other rows) nor on the padded KV length n (the loop stops at the row's own length),
so a row's output is the same bits whatever shares the call, on every path that calls the op (eager, CUDA graph,
torch.compile: the op is opaque). Computed in fp32 from the cache's dtype, as the torch form.

The kernel is defined on first use (not at import), so TRITON_INTERPRET=1 set by a test before the first call runs
it on CPU tensors (tests/test_batch_invariance.py).
"""
import functools
import math
import os

import torch

BLOCK = 32  # keys per loop step (registers: G_PAD x BLOCK x head_dim fp32 products per program)


def available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def runs_on(t: torch.Tensor) -> bool:
    """Whether this project's Triton kernels run for this tensor: CUDA with Triton, or any device under Triton's
    interpreter (TRITON_INTERPRET=1: the CPU tests)."""
    return available() and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


@functools.lru_cache(maxsize=1)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def bi_attention_kernel(Q, K, V, O, QPOS, KVLEN, nq, g_real, scale,
                            sq_b, sq_h, sq_t, sq_g, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, so_b, so_h, so_t, so_g,
                            HD: tl.constexpr, GP: tl.constexpr, BLK: tl.constexpr):
        t = tl.program_id(0)
        h = tl.program_id(1)
        b = tl.program_id(2)
        g = tl.arange(0, GP)
        d = tl.arange(0, HD)
        j = tl.arange(0, BLK)
        gm = g < g_real
        q = tl.load(Q + b * sq_b + h * sq_h + t * sq_t + g[:, None] * sq_g + d[None, :], mask=gm[:, None],
                    other=0.0).to(tl.float32)
        end = tl.minimum(tl.load(QPOS + b * nq + t) + 1, tl.load(KVLEN + b))
        m = tl.full([GP], float("-inf"), tl.float32)
        total = tl.full([GP], 0.0, tl.float32)
        acc = tl.full([GP, HD], 0.0, tl.float32)
        for start in range(0, end, BLK):
            jj = start + j
            jm = jj < end
            k = tl.load(K + b * sk_b + h * sk_h + jj[:, None] * sk_n + d[None, :], mask=jm[:, None],
                        other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale                 # [GP, BLK]
            s = tl.where(jm[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)                                                  # first block: exp(-inf) = 0
            p = tl.exp(s - m_new[:, None])
            total = total * alpha + tl.sum(p, axis=1)
            v = tl.load(V + b * sv_b + h * sv_h + jj[:, None] * sv_n + d[None, :], mask=jm[:, None],
                        other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)   # [GP, HD]
            m = m_new
        out = acc / total[:, None]
        tl.store(O + b * so_b + h * so_h + t * so_t + g[:, None] * so_g + d[None, :],
                 out.to(O.dtype.element_ty), mask=gm[:, None])

    return bi_attention_kernel


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernel takes these tensors: CUDA, a power-of-two head dim with unit stride."""
    hd = q.shape[-1]
    return (q.is_cuda and hd >= 2 and not hd & (hd - 1)
            and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, kv_len: torch.Tensor
              ) -> torch.Tensor:
    """Same contract as `batch_invariant.attention` (q [B, kvh, Q, G, hd]; k / v [B, kvh, n, hd]; q_pos [B, Q];
    kv_len [B]); the head dim must be a power of two and contiguous."""
    b, kvh, nq, g, hd = q.shape
    if hd & (hd - 1) or q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError(f"bi attention kernel: head dim {hd} must be a power of two with unit stride")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    q_pos = q_pos.to(torch.int64).contiguous()
    kv_len = kv_len.to(torch.int64).contiguous()
    gp = max(2, 1 << (g - 1).bit_length())
    _kernel()[(nq, kvh, b)](
        q, k, v, out, q_pos, kv_len, nq, g, 1.0 / math.sqrt(hd),
        q.stride(0), q.stride(1), q.stride(2), q.stride(3), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2), out.stride(3),
        HD=hd, GP=gp, BLK=BLOCK, num_warps=4)
    return out
