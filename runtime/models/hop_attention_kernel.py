"""The Triton kernel of hop_attention.py (imported only where Triton is installed; hop_attention.py says what it
computes). One program per (block of BLOCK_M new frames, head, CFG row): an online softmax in base 2 over the row's
own prefix, read in place through its row table, then over the new frames block-causally."""
import triton
import triton.language as tl


@triton.jit
def _attend(q, k, v_ptrs, v_mask, ok, m, total, acc, scale, PREC: tl.constexpr):
    """One block of keys of the online softmax: scores q·k (times `scale`, log2 units) where `ok`, the running max
    `m`, sum `total` and output `acc` updated; the block's values are loaded after the scores (as measured in runs
    65-66: less shared memory than loading K and V together). A query with no key yet keeps max -inf without NaN."""
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
    s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_safe)
    pr = tl.exp2(s - m_safe[:, None])
    total = total * alpha + tl.sum(pr, axis=1)
    v = tl.load(v_ptrs, mask=v_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v, input_precision=PREC)
    return m_new, total, acc


@triton.jit
def hop_attention_kernel(Q, KN, VN, SK, SV, ROWS, PLEN, NVALID, O, T, scale,
                         sq_b, sq_t, skn_b, skn_t, svn_b, svn_t, s_row, sr_b, so_b, so_t,
                         HD: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         PREC: tl.constexpr):
    mb = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    t = mb * BLOCK_M + tl.arange(0, BLOCK_M)          # this program's new frames
    d = tl.arange(0, HD)
    j = tl.arange(0, BLOCK_N)
    tm = t < T
    q = tl.load(Q + b * sq_b + t[:, None] * sq_t + h * HD + d[None, :], mask=tm[:, None], other=0.0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, HD], 0.0, tl.float32)
    plen = tl.load(PLEN + b)
    for start in range(0, plen, BLOCK_N):               # the prefix, read in place through the row table
        p = start + j
        pm = p < plen
        r = tl.load(ROWS + b * sr_b + p, mask=pm, other=0)
        k = tl.load(SK + r[:, None] * s_row + h * HD + d[None, :], mask=pm[:, None], other=0.0)
        m, total, acc = _attend(q, k, SV + r[:, None] * s_row + h * HD + d[None, :], pm[:, None], pm[None, :],
                                m, total, acc, scale, PREC)
    nval = tl.load(NVALID + b)
    see = (t // CHUNK + 1) * CHUNK                      # a frame sees the new frames before its chunk's end
    hi = tl.minimum(nval, (tl.minimum(mb * BLOCK_M + BLOCK_M, T) - 1) // CHUNK * CHUNK + CHUNK)
    for start in range(0, hi, BLOCK_N):                 # the new frames, block-causal
        u = start + j
        um = u < nval
        k = tl.load(KN + b * skn_b + u[:, None] * skn_t + h * HD + d[None, :], mask=um[:, None], other=0.0)
        m, total, acc = _attend(q, k, VN + b * svn_b + u[:, None] * svn_t + h * HD + d[None, :], um[:, None],
                                um[None, :] & (u[None, :] < see[:, None]), m, total, acc, scale, PREC)
    out = acc / tl.where(total > 0.0, total, 1.0)[:, None]   # a padded frame with no key at all: zeros
    tl.store(O + b * so_b + t[:, None] * so_t + h * HD + d[None, :], out.to(O.dtype.element_ty), mask=tm[:, None])
