"""The cached hop's attention over a paged prefix (runtime/models/hop_attention.py): the Triton kernel through Triton's
interpreter on CPU against the gathered torch form (which is `DiT.forward_cached`'s mask and SDPA over the gathered
prefix), for ragged prefixes and new frames, padded rows, CFG-sized batches and fp16; a row's output the same bits
whatever else shares the call or however far the call's prefix table is padded. CI has no Triton (the CPU torch wheel
does not bring it): those tests skip there with the reason; the torch form and its equality with the DiT's own
masked SDPA run everywhere."""
import os

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel is first defined (on first use)

from cosytrt.runtime.models import hop_attention as ha  # noqa: E402
from cosytrt.runtime.models.dit import attention_mask  # noqa: E402

H, HD, CHUNK = 2, 16, 25


def _case(B, T, P, NR=500, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    D = H * HD
    q, kn, vn = (torch.randn(B, T, D, generator=g).to(dtype) for _ in range(3))
    sk, sv = (torch.randn(NR, D, generator=g).to(dtype) for _ in range(2))
    rows = torch.randint(0, NR, (B, P), generator=g)
    return q, kn, vn, sk, sv, rows


def _needs_triton():
    if not ha.runs_on(torch.empty(0)):
        pytest.skip("Triton is not installed (the CPU torch wheel does not bring it): the kernel runs on a GPU "
                    "machine or through Triton's interpreter")


def test_reference_is_the_dit_mask_over_the_gathered_prefix():
    """The torch form equals what `DiT.forward_cached` computed before the paged form: the prefix gathered, the
    block-causal mask of the new frames with the prefix visible, SDPA."""
    B, T, P = 3, 60, 80
    q, kn, vn, sk, sv, rows = _case(B, T, P)
    plen, nvalid = torch.tensor([80, 31, 0]), torch.tensor([60, 26, 50])
    out = ha.reference(q, kn, vn, sk, sv, rows, plen, nvalid, H, CHUNK)
    # the DiT's construction (dit.py, forward_cached with a gathered prefix)
    mask = (torch.arange(T).unsqueeze(0) < nvalid.unsqueeze(1)).unsqueeze(1).float()   # [B, 1, T]
    pv = torch.arange(P).unsqueeze(0) < plen.unsqueeze(1)
    own = attention_mask(torch.ones_like(mask), True, CHUNK) & mask.bool().unsqueeze(2)
    allowed = torch.cat((pv[:, None, None, :].expand(-1, 1, T, -1), own.expand(B, 1, T, T)), dim=-1)
    am = allowed | ~allowed.any(dim=-1, keepdim=True)
    k = torch.cat((sk[rows], kn), 1).view(B, P + T, H, HD).transpose(1, 2)
    v = torch.cat((sv[rows], vn), 1).view(B, P + T, H, HD).transpose(1, 2)
    want = F.scaled_dot_product_attention(q.view(B, T, H, HD).transpose(1, 2), k, v, attn_mask=am)
    assert torch.equal(out, want.transpose(1, 2).reshape(B, T, H * HD))


def test_shapes_are_checked():
    q, kn, vn, sk, sv, rows = _case(2, 10, 5)
    with pytest.raises(ValueError, match="row table"):
        ha.reference(q, kn, vn, sk, sv, rows[:1], torch.tensor([5, 5]), torch.tensor([10, 10]), H, CHUNK)
    with pytest.raises(ValueError, match="heads"):
        ha.reference(q, kn, vn, sk, sv, rows, torch.tensor([5, 5]), torch.tensor([10, 10]), 3, CHUNK)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_kernel_equals_the_gathered_form(dtype, tol):
    _needs_triton()
    B, T, P = 4, 70, 130  # T and P not multiples of the kernel's 64-frame blocks; 2 query blocks
    q, kn, vn, sk, sv, rows = _case(B, T, P, dtype=dtype)
    plen, nvalid = torch.tensor([130, 64, 1, 0]), torch.tensor([70, 50, 25, 3])
    out = ha.triton_attention(q, kn, vn, sk, sv, rows, plen, nvalid, H, CHUNK)
    ref = ha.reference(q.float(), kn.float(), vn.float(), sk.float(), sv.float(), rows, plen, nvalid, H, CHUNK)
    for b in range(B):
        n = int(nvalid[b])
        torch.testing.assert_close(out[b, :n].float(), ref[b, :n], rtol=tol, atol=tol)
    assert out.dtype == dtype and out.shape == q.shape


def test_kernel_row_is_independent_of_the_call():
    """A row's output bits do not depend on the other rows, on the call's padded prefix length (its table padded
    with junk past plen) nor on padded new frames past nvalid."""
    _needs_triton()
    q, kn, vn, sk, sv, rows = _case(3, 50, 90, seed=2)
    plen, nvalid = torch.tensor([90, 40, 75]), torch.tensor([50, 30, 45])
    full = ha.triton_attention(q, kn, vn, sk, sv, rows, plen, nvalid, H, CHUNK)
    b = 1
    alone = ha.triton_attention(q[b:b + 1, :30], kn[b:b + 1, :30], vn[b:b + 1, :30], sk, sv, rows[b:b + 1, :40],
                                plen[b:b + 1], nvalid[b:b + 1], H, CHUNK)
    assert torch.equal(alone[0], full[b, :30])


def test_padding_rows_give_zeros_not_nan():
    _needs_triton()
    q, kn, vn, sk, sv, rows = _case(2, 30, 10)
    out = ha.triton_attention(q, kn, vn, sk, sv, rows, torch.tensor([0, 10]), torch.tensor([0, 0]), H, CHUNK)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isfinite(out).all()


def test_op_picks_the_kernel_where_triton_runs():
    """The custom op (what the DiT calls, opaque under torch.compile) takes the kernel under the interpreter and
    gives the gathered form's values."""
    _needs_triton()
    q, kn, vn, sk, sv, rows = _case(2, 40, 60, seed=4)
    plen, nvalid = torch.tensor([60, 20]), torch.tensor([40, 33])
    out = ha.hop_attention(q, kn, vn, sk, sv, rows, plen, nvalid, H, CHUNK)
    assert torch.equal(out, ha.triton_attention(q, kn, vn, sk, sv, rows, plen, nvalid, H, CHUNK))


@pytest.mark.parametrize("tiles", [(16, 16, 1), (32, 128, 4), (128, 32, 8)])
def test_every_tile_gives_the_gathered_form(tiles):
    """The tile (COSYTRT_HOP_ATTN_TILES, or per call: new frames per program, keys per step, warps) changes how the
    kernel walks the keys, not what it computes: smaller and larger blocks than the frames' 25-frame chunks."""
    _needs_triton()
    q, kn, vn, sk, sv, rows = _case(3, 70, 130, seed=4)
    plen, nvalid = torch.tensor([130, 64, 0]), torch.tensor([70, 26, 3])
    out = ha.triton_attention(q, kn, vn, sk, sv, rows, plen, nvalid, H, CHUNK, *tiles)
    ref = ha.reference(q, kn, vn, sk, sv, rows, plen, nvalid, H, CHUNK)
    for b in range(3):
        n = int(nvalid[b])
        torch.testing.assert_close(out[b, :n], ref[b, :n], rtol=1e-5, atol=1e-5)


def test_tile_setting_is_checked():
    assert ha._tiles("128x64x8") == (128, 64, 8)
    for bad in ("64x64", "64x48x4", "8x64x4", "ax64x4"):
        with pytest.raises(ValueError, match="COSYTRT_HOP_ATTN_TILES"):
            ha._tiles(bad)
