"""The AR graph runners' padding rules (runtime/ar_graphs.py), on the CPU: the CUDA graph itself is replaced by a
direct call, so what is checked is what the runners feed the captured function (bucket choice, padding rows into
the scratch slot, zero positions past each row's length) and that real rows come out as the unpadded call's."""
from __future__ import annotations

import pytest
import torch

from cosytrt.runtime.ar_graphs import SAMPLE_WINDOW, DecodeGraphs, PrefillGraphs
from cosytrt.runtime.sampling import SamplingParams, TokenPolicy, pack_rows, sample_ids

ATOL = 1e-5


@pytest.fixture
def lm(golden_lm, direct_ar_graphs):
    golden_lm.setup_cache(5, 257)  # 4 slots + the scratch slot 4
    return golden_lm


def test_prefill_graphs_bucket_choice():
    pg = PrefillGraphs.__new__(PrefillGraphs)
    pg.keys = sorted(((B, T) for B in (1, 2, 4, 8) for T in (64, 128, 256, 512) if B * T <= 1024),
                     key=lambda k: -k[0] * k[1])
    assert pg.bucket(1, 150) == (1, 256)
    assert pg.bucket(3, 64) == (4, 64)
    assert pg.bucket(3, 65) == (4, 128)
    assert pg.bucket(2, 300) == (2, 512)
    assert pg.bucket(4, 300) is None      # 4 x 512 is over the token limit: no graph (eager prefill)
    assert pg.bucket(9, 10) is None


def test_prefill_graphs_pad_rows_and_positions(lm):
    hidden = lm.config.qwen.hidden_size
    pg = PrefillGraphs(lm.prefill, [1, 2, 4], [16, 32], 128, hidden, torch.float32, 4, "cpu")
    assert set(pg.cache.shapes) == {(1, 16), (1, 32), (2, 16), (2, 32), (4, 16), (4, 32)}
    g = torch.Generator().manual_seed(0)
    embeds = torch.randn(3, 20, hidden, generator=g)
    lengths, slots = torch.tensor([20, 13, 7]), torch.tensor([2, 0, 1])
    with torch.inference_mode():
        ref = lm.prefill(embeds, lengths, slots)
        k_ref = lm.backbone.layers[1].self_attn.kv_cache.k.clone()
        lm.backbone.layers[1].self_attn.kv_cache.k.zero_()
        out = pg(embeds, lengths, slots)  # runs as (4 rows, 32 positions)
    assert out.shape == ref.shape and (out - ref).abs().max() <= ATOL
    assert pg.replays == 1
    k = lm.backbone.layers[1].self_attn.kv_cache.k
    for row, slot in enumerate(slots.tolist()):
        n = int(lengths[row])
        assert (k[slot, :, :n] - k_ref[slot, :, :n]).abs().max() <= ATOL  # real positions as unpadded


def _policies(stop: int, vocab: int) -> list[TokenPolicy]:
    """Three rows with RAS history (row 0 repeats one id, so its draw may be resampled), one greedy."""
    out = []
    for i, greedy in enumerate((False, False, True)):
        p = TokenPolicy(10, SamplingParams(seed=i, greedy=greedy), speech_token_size=stop, num_special=vocab - stop)
        for tok in ([7] * 9 if i == 0 else [3, 1, 4, 1, 5]):
            p.accept(tok)
        out.append(p)
    return out


def test_decode_graphs_sample_in_the_graph_and_pad_rows_into_scratch_slot(lm):
    stop = lm.config.speech_token_size
    dg = DecodeGraphs(lm.decode, [2, 4], [64, 128], 4, stop, "cpu")
    assert set(dg.graphs) == {64, 128} and set(dg.graphs[64].shapes) == {2, 4}
    tokens, slots, pos = [5, 9, 11], [0, 1, 2], [3, 70, 8]
    k = lm.backbone.layers[0].self_attn.kv_cache.k
    with torch.inference_mode():
        k[3].fill_(0.5)  # a slot no row owns
        logits = lm.decode(torch.tensor(tokens), torch.tensor(slots), torch.tensor(pos), kv_len=128)
        ref = sample_ids(logits, _policies(stop, logits.shape[1]))
        ids = dg(tokens, slots, pos, pack_rows(_policies(stop, logits.shape[1]), SAMPLE_WINDOW), need_kv=71)
    # 3 rows -> batch 4 (the padding row decodes into the scratch slot 4), 71 positions -> rung 128
    assert ids.tolist() == ref and dg.replays == 1
    assert bool((k[3] == 0.5).all())
    assert dg.fits(4, 128) and not dg.fits(5, 10) and not dg.fits(2, 129)
