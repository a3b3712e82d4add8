"""The Triton form of the batch-invariant attention (runtime/models/bi_attention_triton.py), run on CPU through
Triton's interpreter: same values as the torch form (within fp32 rounding: online vs two-pass softmax), a row's output
bit-identical alone, beside other rows, padded to 64 rows and at a longer KV rung, for decode (one query) and
prefill (every position). CI has no Triton (the CPU torch wheel does not bring it): skipped there with the reason;
the GPU check (benchmarks/batch_invariance_gpu.py) runs the compiled kernel."""
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel is first defined (it is defined on first use)
triton = pytest.importorskip("triton", reason="Triton is not installed (the CPU torch wheel does not bring it)")

from cosytrt.runtime.models import batch_invariant as bi  # noqa: E402
from cosytrt.runtime.models import bi_attention_triton as tri  # noqa: E402

KVH, G, HD = 2, 7, 16


def _case(b, nq, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, KVH, nq, G, HD, generator=g)
    k = torch.randn(b, KVH, n, HD, generator=g)
    v = torch.randn(b, KVH, n, HD, generator=g)
    return q, k, v


def _torch_form(q, k, v, q_pos, kv_len, monkeypatch):
    monkeypatch.setattr(bi, "ATTENTION_IMPL", "torch")
    return bi.attention(q, k, v, q_pos, kv_len, 64)


def test_triton_matches_torch_form_decode_and_prefill(monkeypatch):
    q, k, v = _case(3, 1, 96)
    q_pos = torch.tensor([[40], [95], [0]])
    kv_len = q_pos[:, 0] + 1
    out = tri.attention(q, k, v, q_pos, kv_len)
    torch.testing.assert_close(out, _torch_form(q, k, v, q_pos, kv_len, monkeypatch), rtol=1e-5, atol=1e-5)
    q, k, v = _case(2, 70, 70, seed=1)  # prefill: every position of right-padded rows of lengths 70 and 33
    q_pos = torch.arange(70)[None].expand(2, 70)
    kv_len = torch.tensor([70, 33])
    out = tri.attention(q, k, v, q_pos, kv_len)
    ref = _torch_form(q, k, v, q_pos, kv_len, monkeypatch)
    torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[1, :, :33], ref[1, :, :33], rtol=1e-5, atol=1e-5)


def test_triton_row_bits_do_not_depend_on_neighbours_padding_or_rung():
    q, k, v = _case(64, 1, 256, seed=2)
    q_pos = (torch.arange(64) * 3 + 7)[:, None]
    kv_len = q_pos[:, 0] + 1
    full = tri.attention(q, k, v, q_pos, kv_len)
    alone = tri.attention(q[5:6], k[5:6, :, :64], v[5:6, :, :64], q_pos[5:6], kv_len[5:6])  # shorter rung
    assert torch.equal(full[5], alone[0])
    pair = tri.attention(q[[5, 0]], k[[5, 0]], v[[5, 0]], q_pos[[5, 0]], kv_len[[5, 0]])
    assert torch.equal(pair[0], alone[0])


def test_dispatch_uses_triton_when_forced(monkeypatch):
    q, k, v = _case(2, 1, 40, seed=3)
    q_pos, kv_len = torch.tensor([[39], [12]]), torch.tensor([40, 13])
    monkeypatch.setattr(bi, "ATTENTION_IMPL", "triton")
    assert torch.equal(bi.attention(q, k, v, q_pos, kv_len, 64), tri.attention(q, k, v, q_pos, kv_len))


# ------------------------------------------------------------------ rms_norm / silu_mul (bi_norm_triton.py)

def test_triton_rms_norm_and_silu_mul_match_torch_forms_and_rows_are_independent(monkeypatch):
    from cosytrt.runtime.models import bi_norm_triton as trn

    g = torch.Generator().manual_seed(4)
    x = torch.randn(70, 96, generator=g)
    w = torch.randn(96, generator=g)
    monkeypatch.setattr(bi, "NORM_IMPL", "torch")
    ref = bi.rms_norm(x, w, 1e-6, 64)
    got = trn.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(trn.rms_norm(x[5:6], w, 1e-6)[0], got[5])          # a row alone = the row among 70
    gate, up = torch.randn(3, 5, 200, generator=g), torch.randn(3, 5, 200, generator=g)
    torch.testing.assert_close(trn.silu_mul(gate, up), bi.silu(gate) * up, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(bi, "NORM_IMPL", "triton")
    assert torch.equal(bi.rms_norm(x, w, 1e-6, 64), got)
    assert torch.equal(bi.silu_mul(gate, up), trn.silu_mul(gate, up))
