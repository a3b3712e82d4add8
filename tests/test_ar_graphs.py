"""The AR graph runners' padding rules (runtime/ar_graphs.py), on the CPU: the CUDA graph itself is replaced by a
direct call, so what is checked is what the runners feed the captured function (bucket choice, padding rows into
the scratch slot, zero positions past each row's length) and that real rows come out as the unpadded call's."""
from __future__ import annotations

import pytest
import torch

from cosytrt.runtime.stages import ar_graphs
from cosytrt.runtime.stages.ar_graphs import DecodeGraphs, PrefillGraphs
from graph_stand_in import DirectCall, prefilled_rows

ATOL = 1e-5




@pytest.fixture
def lm(golden_lm, monkeypatch):
    monkeypatch.setattr(ar_graphs, "GraphCache", DirectCall)
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


def test_decode_graphs_pad_rows_into_scratch_slot(lm):
    dg = DecodeGraphs(lm.decode, [2, 4], [64, 128], 4, "cpu")
    assert set(dg.graphs) == {64, 128} and set(dg.graphs[64].shapes) == {2, 4}
    tokens, slots, pos = torch.tensor([5, 9, 11]), torch.tensor([0, 1, 2]), torch.tensor([3, 70, 8])
    with torch.inference_mode():
        ref = lm.decode(tokens, slots, pos, kv_len=128)
        out = dg(tokens, slots, pos, need_kv=71)  # 3 rows -> batch 4, 71 positions -> rung 128
    assert out.shape == ref.shape and (out - ref).abs().max() <= ATOL
    assert dg.fits(4, 128) and not dg.fits(5, 10) and not dg.fits(2, 129)


def test_decode_graphs_run_host_is_the_device_call(lm):
    """`run_host` (the runner's per-step path: one padded [3, B] host tensor into the static inputs) feeds the graph
    what `__call__` does: the same bucket, scratch-slot padding and logits."""
    dg = DecodeGraphs(lm.decode, [2, 4], [64, 128], 4, "cpu")
    seen = []
    for key, cache in dg.graphs.items():
        run = cache.run
        cache.run = lambda B, *x, run=run, key=key: seen.append((key, B, [c.tolist() for c in x])) or run(B, *x)
    with torch.inference_mode():
        ref = dg(torch.tensor([5, 9, 11]), torch.tensor([0, 1, 2]), torch.tensor([3, 70, 8]), need_kv=71)
        out = dg.run_host([5, 9, 11], [0, 1, 2], [3, 70, 8], need_kv=71)
    assert torch.equal(out, ref) and dg.replays == 2
    assert seen[0] == seen[1] == (128, 4, [[5, 9, 11, 0], [0, 1, 2, 4], [3, 70, 8, 0]])


def test_decode_graphs_sample_in_the_graph(lm):
    """With a `StaticSampler` the graph holds decode + sampling: `run_sampled` feeds it the packed rows padded to the
    bucket (the captured shapes) and returns the logits of `run_host` and exactly `select_packed`'s ids of them;
    `run_host` on the same graphs still returns the logits alone."""
    from cosytrt.runtime.models.sampling import (SamplingParams, StaticSampler, TokenPolicy, pack_rows,
                                                 select_packed)

    cfg = lm.config
    sampler = StaticSampler(cfg.speech_vocab, cfg.speech_token_size)
    dg = DecodeGraphs(lm.decode, [2, 4], [64, 128], 4, "cpu", sampler)
    assert dg.graphs[128].shapes[4][3] == (4, 7 + sampler.width)
    policies = [TokenPolicy(4, SamplingParams(seed=s, greedy=s == 2, win_size=4 + s),
                            speech_token_size=cfg.speech_token_size) for s in range(3)]
    for p in policies:
        p.history = [7, 7, 3, 7][:2 + len(p.history)]
    packed = pack_rows(policies, cfg.speech_vocab)
    args = ([5, 9, 11], [0, 1, 2], [3, 70, 8], 71)
    with torch.inference_mode():
        logits, ids = dg.run_sampled(*args, packed)
        ref = dg.run_host(*args)
    assert torch.equal(logits, ref) and logits.shape[0] == 3
    assert ids == select_packed(ref, packed) and dg.sampled == 1 and dg.replays == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA: the graph capture itself needs a GPU")
def test_graph_sampling_on_cuda_equals_sampling_the_logits(golden_lm):
    """On a GPU: `TorchARRunner(graph_sampling=True)` samples inside its decode graphs, and every step's ids are
    exactly `select_packed` of the logits the same replay wrote (batches of 1, 3 and 5 rows: buckets 1, 4 and 8,
    padding rows included), whether the runner was made with it or took it on later (`enable_graph_sampling`: a second
    graph set over the same KV slots); the token streams equal a runner without the sampler in its graphs."""
    import copy

    from cosytrt.runtime.models.sampling import pack_rows, select_packed
    from cosytrt.runtime.stages.ar_runner import TorchARRunner

    cfg = golden_lm.config
    streams = {}
    for mode in ("made with it", "taken on later", "off"):
        sampled = mode != "off"
        lm = copy.deepcopy(golden_lm).to("cuda")
        runner = TorchARRunner(lm, 8, 512, "cuda", graph_sampling=mode == "made with it", graph_batches=(1, 4, 8))
        if mode == "taken on later":
            runner.enable_graph_sampling()
            assert runner.sampled_graphs is not runner.decode_graphs
        policies, slots, pos = prefilled_rows(runner, cfg)
        for step in range(40):
            rows = [0] if step < 10 else [0, 1, 2] if step < 20 else [0, 1, 2, 3, 4]
            rows = [i for i in rows if not policies[i].finished]
            packed = pack_rows([policies[i] for i in rows], cfg.speech_vocab)
            with torch.inference_mode():
                logits, ids = runner.decode_sampled([policies[i].next_input for i in rows], [slots[i] for i in rows],
                                                    [pos[i] for i in rows], packed)
                want = select_packed(logits.clone(), packed)
            if sampled:
                assert ids == want, step
            else:
                assert ids is None
            for i, tok in zip(rows, want):
                policies[i].accept(tok)
                pos[i] += 1
        streams[mode] = [p.history for p in policies]
        if sampled:
            assert runner.sampled_graphs.sampled == 40 and runner.stats()["sampled_graph_replays"] == 40
        runner.close()
    assert streams["made with it"] == streams["taken on later"] == streams["off"]
