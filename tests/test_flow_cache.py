"""Flow prefix KV cache (runtime/stages/flow_cache.py): a prefix-cached stream equals the whole-history stream on every
hop; the speaker prompt cache; batched cached hops of several requests equal each alone; pool overflow falls back
(counted); a changed input invalidates; the golden streaming vectors pass with the cache. CPU, fp32, tiny model."""
import os

import pytest
import torch
from safetensors.torch import load_file

from cosytrt.runtime.models.checkpoint import read_state_dict
from cosytrt.runtime.models.config import config_from_golden_json
from cosytrt.runtime.models.flow import Flow, FlowInput
from cosytrt.runtime.stages.flow_cache import (FlowCachePool, bytes_per_frame, model_fingerprint,
                                               prompt_cacheable_frames, prompt_key)
from cosytrt.runtime.stages.flow_hops import flow_rows
from cosytrt.runtime.stages.token2wav import LOOKAHEAD, TOKEN_MAX_HOP, first_hop

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "golden")
CACHE_TOL = 1e-5   # fp32 mel: reduction order of shorter GEMMs / attention (measured ~1.5e-6); golden FLOW_TOL is 1e-3
BATCH_TOL = 1e-4   # as tests/test_flow.py's ragged batches
BIG = 1 << 30


@pytest.fixture(scope="module")
def flow(one_torch_thread):
    cfg = config_from_golden_json(os.path.join(GOLDEN, "config.json")).flow
    return Flow(cfg).eval().load_checkpoint(read_state_dict(os.path.join(GOLDEN, "flow.pt")))


@pytest.fixture(scope="module")
def vectors():
    return load_file(os.path.join(GOLDEN, "vectors.safetensors"))


def make_prompt(flow, P: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, flow.cfg.vocab_size, (P,), generator=g), torch.randn(2 * P, 80, generator=g),
            torch.randn(192, generator=g))


def make_tokens(flow, n: int, seed: int):
    return torch.randint(0, flow.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def hop_ends(P: int, n_tokens: int) -> list[int]:
    """Token2Wav's non-final hop schedule: generated tokens covered after each hop."""
    out, off, base = [], 0, 25
    hop = first_hop(P, base)
    while n_tokens - off >= hop + LOOKAHEAD:
        off += hop
        out.append(off)
        base = min(TOKEN_MAX_HOP, base * 2)
        hop = base
    return out


def hop(flow, tokens, prompt, upto, cache=None):
    pt, pf, emb = prompt
    return flow_rows(flow, [FlowInput(tokens[:upto + LOOKAHEAD], pt, pf, emb, False, cache)], True)[0]


def golden_stream(flow, vectors, n_tokens: int = 200):
    """The golden prompt, n_tokens random tokens, their hop ends, a fresh pool and a state after the first hop."""
    prompt = (vectors["flow.prompt_token"][0], vectors["flow.prompt_feat"][0], vectors["flow.embedding"][0])
    tokens = make_tokens(flow, n_tokens, 1)
    ends = hop_ends(20, n_tokens)
    pool = FlowCachePool(BIG)
    st = pool.new_state()
    hop(flow, tokens, prompt, ends[0], st)
    return prompt, tokens, ends, pool, st


def max_err(a, b) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


# --------------------------------------------------------------------------------------------------- one stream

def test_cached_stream_equals_whole_history(flow, vectors):
    prompt = (vectors["flow.prompt_token"][0], vectors["flow.prompt_feat"][0], vectors["flow.embedding"][0])
    tokens = make_tokens(flow, 260, 1)
    ends = hop_ends(20, 260)
    assert len(ends) >= 3
    pool = FlowCachePool(BIG)
    st = pool.new_state()
    computed = reused = 0
    for upto in ends:
        ref = hop(flow, tokens, prompt, upto)
        got = hop(flow, tokens, prompt, upto, st)
        assert max_err(got, ref) <= CACHE_TOL, upto
        frames = 2 * (20 + upto)
        assert st.frames == frames  # upstream hops end on chunk boundaries: everything is committed
        computed += frames - reused
        reused = frames
    s = pool.stats()
    whole = sum(2 * (20 + u) for u in ends)
    assert s["frames_computed"] == computed == 2 * (20 + ends[-1]) < whole
    assert s["frames_reused"] == sum(2 * (20 + u) for u in ends[:-1])
    assert s["fallback_hops"] == s["invalidations"] == 0 and s["cached_hops"] == len(ends)
    per_frame = bytes_per_frame(flow)
    assert per_frame == 2 * 2 * 10 * 2 * 128 * 4  # K,V x depth x steps x CFG rows x dim x fp32
    assert s["bytes_used"] >= st.frames * per_frame
    st.close()
    assert pool.stats()["bytes_used"] == 0


def test_full_size_bytes_per_frame():
    from cosytrt.runtime.models.config import FlowConfig
    f = Flow.__new__(Flow)  # only cfg / rand_noise are read
    f.cfg = FlowConfig()
    f.rand_noise = torch.empty(0, dtype=torch.bfloat16)
    assert bytes_per_frame(f) == 2 * 22 * 10 * 2 * 1024 * 2 == 1_802_240  # ~1.8 MB per frame in bf16


def test_partial_last_chunk_is_not_committed(flow, vectors):
    """A hop ending inside a chunk (not upstream's schedule) commits only whole chunks; the next hop recomputes the
    rest and still equals the whole-history hop."""
    prompt = (vectors["flow.prompt_token"][0], vectors["flow.prompt_feat"][0], vectors["flow.embedding"][0])
    tokens = make_tokens(flow, 120, 2)
    st = FlowCachePool(BIG).new_state()
    for upto in (20, 47, 90):  # 80, 134, 220 frames
        assert max_err(hop(flow, tokens, prompt, upto, st), hop(flow, tokens, prompt, upto)) <= CACHE_TOL
        assert st.frames == (2 * (20 + upto)) // 50 * 50


def test_math_sdpa_first_hops_bit_identical(flow, vectors):
    """With the math SDPA backend the cached hop repeats the whole-history arithmetic: hop 1 computes everything,
    hop 2 reuses hop 1's chunks; on this CPU both are bit-identical (later hops differ only where the whole-history
    hop itself differs from the previous hop on the same frames: GEMM blocking of longer inputs)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    prompt = (vectors["flow.prompt_token"][0], vectors["flow.prompt_feat"][0], vectors["flow.embedding"][0])
    tokens = make_tokens(flow, 120, 1)
    st = FlowCachePool(BIG).new_state()
    with sdpa_kernel(SDPBackend.MATH):
        errs = [max_err(hop(flow, tokens, prompt, u, st), hop(flow, tokens, prompt, u)) for u in hop_ends(20, 120)]
    assert errs[0] == 0.0
    assert max(errs) <= CACHE_TOL


# ------------------------------------------------------------------------------------------------- prompt cache

def test_speaker_prompt_cache(flow):
    P = 60
    prompt = make_prompt(flow, P, 7)
    split = prompt_cacheable_frames(flow, P)
    assert split == 100  # 2 * (60 - 3) = 114 frames depend on the prompt only -> 2 whole chunks
    pool = FlowCachePool(BIG)
    # request A: misses, computes everything, registers the prompt chunks
    ta = make_tokens(flow, 200, 3)
    sa = pool.new_state()
    for upto in hop_ends(P, 200)[:2]:
        assert max_err(hop(flow, ta, prompt, upto, sa), hop(flow, ta, prompt, upto)) <= CACHE_TOL
    s = pool.stats()
    assert s["prompt_misses"] == 1 and s["prompt_entries"] == 1 and sa.uses_prompt_entry
    # request B, same speaker, other tokens: starts from the prompt entry
    tb = make_tokens(flow, 200, 4)
    sb = pool.new_state()
    ends = hop_ends(P, 200)
    before = pool.stats()["frames_computed"]
    for i, upto in enumerate(ends):
        assert max_err(hop(flow, tb, prompt, upto, sb), hop(flow, tb, prompt, upto)) <= CACHE_TOL
        if i == 0:
            assert pool.stats()["frames_computed"] - before == 2 * (P + upto) - split
    s = pool.stats()
    assert s["prompt_hits"] == 1 and s["prompt_entries"] == 1
    # another speaker embedding with the same prompt tokens and mel: another key, a miss
    other = (prompt[0], prompt[1], prompt[2] + 1)
    assert prompt_key(flow, *other) != prompt_key(flow, *prompt)
    sc = pool.new_state()
    assert max_err(hop(flow, ta, other, ends[0], sc), hop(flow, ta, other, ends[0])) <= CACHE_TOL
    assert pool.stats()["prompt_misses"] == 2 and pool.stats()["prompt_entries"] == 2
    # closing the streams keeps the (unreferenced) entries, charged to the pool, until evicted
    for st in (sa, sb, sc):
        st.close()
    assert pool.stats()["bytes_used"] > 0
    pool.clear_prompts()
    assert pool.stats()["bytes_used"] == 0


def test_prompt_key_is_content_and_model(flow, vectors):
    prompt = make_prompt(flow, 40, 1)
    copy = tuple(t.clone() for t in prompt)
    assert prompt_key(flow, *prompt) == prompt_key(flow, *copy)
    fp = model_fingerprint(flow)
    other = Flow(flow.cfg).eval()
    other.load_state_dict(flow.state_dict())
    assert model_fingerprint(other) == fp  # same weights and noise, another object
    with torch.no_grad():
        other.estimator.proj_out.bias.add_(1e-3)
    assert model_fingerprint(other) != fp and prompt_key(other, *prompt) != prompt_key(flow, *prompt)
    feat = prompt[1].clone()
    feat[3, 5] += 1e-6
    assert prompt_key(flow, prompt[0], feat, prompt[2]) != prompt_key(flow, *prompt)


def test_prompt_entries_evicted_lru(flow):
    per_frame = bytes_per_frame(flow)
    prompts = [make_prompt(flow, 60, s) for s in (11, 12, 13)]
    tokens = make_tokens(flow, 60, 5)
    # room for two prompt entries (100 frames each) and one stream's own frames
    pool = FlowCachePool(int(per_frame * 2 * 100 * 1.2 + per_frame * 200))
    for p in prompts:
        st = pool.new_state()
        upto = hop_ends(60, 60)[0]
        assert max_err(hop(flow, tokens, p, upto, st), hop(flow, tokens, p, upto)) <= CACHE_TOL
        st.close()
    s = pool.stats()
    assert s["prompt_evictions"] >= 1 and s["prompt_entries"] <= 2
    assert s["bytes_used"] <= pool.budget


# ---------------------------------------------------------------------------------------------- batched hops

def test_batched_cached_hops_equal_alone(flow):
    """Three requests at different hop indices (different prefix lengths, prompt entries, new-frame counts) run one
    hop in one batched call: each row equals its alone cached hop and its whole-history hop; the commits of the
    batched hop are right (the next hops still match)."""
    specs = [(20, 8, 300), (33, 9, 300), (60, 10, 300)]
    prompts = [make_prompt(flow, P, s) for P, s, _ in specs]
    tokens = [make_tokens(flow, n, s + 100) for _, s, n in specs]
    ends = [hop_ends(P, n) for P, _, n in specs]
    pool_a, pool_b = FlowCachePool(BIG), FlowCachePool(BIG)
    sa = [pool_a.new_state() for _ in specs]
    sb = [pool_b.new_state() for _ in specs]
    advance = [2, 1, 0]
    for i, k in enumerate(advance):  # bring each request to its hop index, alone
        for upto in ends[i][:k]:
            hop(flow, tokens[i], prompts[i], upto, sa[i])
            hop(flow, tokens[i], prompts[i], upto, sb[i])
    for rnd in range(2):
        rows = [FlowInput(tokens[i][:ends[i][advance[i] + rnd] + LOOKAHEAD], *prompts[i], False, sa[i])
                for i in range(len(specs))]
        batched = flow_rows(flow, rows, True)
        for i in range(len(specs)):
            upto = ends[i][advance[i] + rnd]
            alone = hop(flow, tokens[i], prompts[i], upto, sb[i])
            whole = hop(flow, tokens[i], prompts[i], upto)
            assert max_err(batched[i], alone) <= BATCH_TOL
            assert max_err(batched[i], whole) <= BATCH_TOL
            assert max_err(alone, whole) <= CACHE_TOL
            assert sa[i].frames == sb[i].frames == 2 * (specs[i][0] + upto)
    assert pool_a.stats()["frames_reused"] == pool_b.stats()["frames_reused"] > 0


def test_mixed_batch_cached_uncached_and_final(flow):
    P = 20
    prompt = make_prompt(flow, P, 21)
    tokens = make_tokens(flow, 140, 22)
    ends = hop_ends(P, 140)
    st = FlowCachePool(BIG).new_state()
    hop(flow, tokens, prompt, ends[0], st)
    rows = [FlowInput(tokens[:ends[1] + LOOKAHEAD], *prompt, False, st),
            FlowInput(tokens[:ends[1] + LOOKAHEAD], *prompt, False)]
    a, b = flow_rows(flow, rows, True)
    assert max_err(a, b) <= CACHE_TOL
    # a finalize row with a cache ignores it (full-history pass)
    fin = flow_rows(flow, [FlowInput(tokens, *prompt, True, st)], False)[0]
    ref = flow_rows(flow, [FlowInput(tokens, *prompt, True)], False)[0]
    assert torch.equal(fin, ref)


# --------------------------------------------------------------------------------------------- pool and safety

def test_pool_overflow_falls_back_and_is_counted(flow, vectors):
    prompt = (vectors["flow.prompt_token"][0], vectors["flow.prompt_feat"][0], vectors["flow.embedding"][0])
    tokens = make_tokens(flow, 260, 1)
    ends = hop_ends(20, 260)
    # no room at all: every hop is today's whole-history hop (the pipeline's estimator path, bit-identical)
    pool = FlowCachePool(0)
    st = pool.new_state()
    for upto in ends:
        assert torch.equal(hop(flow, tokens, prompt, upto, st), hop(flow, tokens, prompt, upto))
    s = pool.stats()
    assert s["fallback_hops"] == s["whole_hops"] == len(ends) and s["frames_reused"] == 0 and s["bytes_used"] == 0
    # room for the first hop only: later hops reuse it but commit nothing (counted), still exact
    per_frame = bytes_per_frame(flow)
    pool = FlowCachePool(per_frame * 130)  # 100 frames + the conv tails (~15 frames' worth at this size)
    st = pool.new_state()
    for upto in ends:
        assert max_err(hop(flow, tokens, prompt, upto, st), hop(flow, tokens, prompt, upto)) <= CACHE_TOL
    s = pool.stats()
    assert st.frames == 100 and s["fallback_hops"] == len(ends) - 1
    assert s["frames_reused"] == 100 * (len(ends) - 1)
    st.close()
    assert pool.stats()["bytes_used"] == 0


def test_last_hop_commits_nothing_and_is_exact(flow, vectors):
    """`FlowInput.commit=False` (the scheduler's last hop before a final): the hop equals the whole-history hop and
    the hop that commits, bit for bit, reserves no page for its new frames (the prefix stays what earlier hops
    committed) and is counted; a first hop with nothing cached yet commits as usual (no prefix to run against)."""
    prompt = (vectors["flow.prompt_token"][0], vectors["flow.prompt_feat"][0], vectors["flow.embedding"][0])
    tokens = make_tokens(flow, 260, 1)
    ends = hop_ends(20, 260)
    pt, pf, emb = prompt

    def last(st, upto, commit):
        return flow_rows(flow, [FlowInput(tokens[:upto + LOOKAHEAD], pt, pf, emb, False, st, commit=commit)], True)[0]

    pool_a, pool_b = FlowCachePool(BIG), FlowCachePool(BIG)
    a, b = pool_a.new_state(), pool_b.new_state()
    assert torch.equal(last(a, ends[0], False), hop(flow, tokens, prompt, ends[0], b))  # first hop: commits anyway
    assert a.frames == b.frames > 0 and pool_a.stats()["uncommitted_last_hops"] == 0
    for upto in ends[1:-1]:
        hop(flow, tokens, prompt, upto, a), hop(flow, tokens, prompt, upto, b)
    before = (a.frames, pool_a.stats()["bytes_used"])
    got, ref = last(a, ends[-1], False), hop(flow, tokens, prompt, ends[-1], b)
    assert torch.equal(got, ref) and max_err(got, hop(flow, tokens, prompt, ends[-1])) <= CACHE_TOL
    assert (a.frames, pool_a.stats()["bytes_used"]) == before and b.frames > a.frames
    assert pool_a.stats()["uncommitted_last_hops"] == 1 and pool_a.stats()["fallback_hops"] == 0
    a.close(), b.close()


def test_changed_input_invalidates(flow, vectors):
    prompt, tokens, ends, pool, st = golden_stream(flow, vectors)
    changed = tokens.clone()
    changed[ends[0] + 1] = (changed[ends[0] + 1] + 1) % flow.cfg.vocab_size  # a look-ahead token of hop 1 changed
    assert max_err(hop(flow, changed, prompt, ends[1], st), hop(flow, changed, prompt, ends[1])) <= CACHE_TOL
    assert pool.stats()["invalidations"] == 1
    other_feat = (prompt[0], prompt[1] + 0.5, prompt[2])
    assert max_err(hop(flow, changed, other_feat, ends[2], st), hop(flow, changed, other_feat, ends[2])) <= CACHE_TOL
    assert pool.stats()["invalidations"] == 2


def test_cancelled_state_frees_and_commits_nothing(flow, vectors):
    prompt, tokens, ends, pool, st = golden_stream(flow, vectors)
    assert pool.stats()["bytes_used"] > 0
    st.close()
    assert pool.stats()["bytes_used"] == 0 and st.frames == 0
    hop(flow, tokens, prompt, ends[1], st)  # a closed state is ignored: whole-history hop
    assert pool.stats()["bytes_used"] == 0
    st2 = pool.new_state()
    hop(flow, tokens, prompt, ends[0], st2)
    del st2  # dropped without close (garbage collected): the pool gets its bytes back
    import gc
    gc.collect()
    assert pool.stats()["bytes_used"] == 0


# ----------------------------------------------------------------------------------------- token2wav / golden

def test_golden_stream_vectors_with_cache(tmp_path):
    from cosytrt.runtime.models.loading import load_models
    from cosytrt.runtime.stages.token2wav import Token2Wav
    from cosytrt.tools.golden import snr_db

    m = load_models(GOLDEN)
    s = load_file(os.path.join(GOLDEN, "stream_vectors.safetensors"))
    m.flow.set_noise(s["stream.rand_noise"])
    m.hift.set_noise(rand_ini=s["stream.rand_ini"], sine_waves=s["stream.sine_waves"])
    pool = FlowCachePool(BIG)
    args = (s["stream.token"][0], s["stream.prompt_token"][0], s["stream.prompt_feat"][0], s["stream.embedding"][0])
    cached = list(Token2Wav(m.flow, m.hift, flow_cache=pool).stream_all(*args))
    plain = list(Token2Wav(m.flow, m.hift).stream_all(*args))
    assert [c.numel() for c in cached] == [int(x) for x in s["stream.chunk_lengths"].tolist()]
    for i, (c, p) in enumerate(zip(cached, plain)):
        ref = s[f"stream.chunk{i}.wav"]
        assert snr_db(ref, c.reshape(ref.shape)) > 60
        assert (c - p).abs().max().item() <= 2e-3  # golden HiFT wav tolerance (f0 phase amplifies ~1e-6 mel)
    st = pool.stats()
    assert st["frames_reused"] > 0 and st["bytes_used"] == 0  # the final hop freed the stream's cache


def test_cached_hops_follow_the_pipelines_dit_variant(flow):
    """Engines / CUDA graphs run whole-history calls only: a cached hop runs the eager DiT's forward_cached, or its
    torch.compile'd form when the pipeline's estimator is compiled (directly or as a bucketed runner's fallback).
    (Not run here: compiling costs minutes on a busy CPU; run by hand it matched the whole-history hops to 2.3e-6
    with two graphs, no prefix / a prefix.)"""
    from types import SimpleNamespace

    from cosytrt.runtime.stages.compiled import CompiledDiT
    from cosytrt.runtime.stages.flow_hops import cached_dit_fn

    eager = cached_dit_fn(flow, None)
    assert eager == flow.estimator.forward_cached
    assert cached_dit_fn(flow, SimpleNamespace(eager=flow.estimator)) == eager  # e.g. BucketedDiT(eager DiT)
    compiled = CompiledDiT.of(flow.estimator)  # lazy: nothing compiles until called
    fn = cached_dit_fn(flow, SimpleNamespace(eager=compiled))
    assert fn != eager and fn is cached_dit_fn(flow, compiled)


def test_closed_pool_takes_no_late_page_ids(flow, vectors):
    """A state that outlives its pool's close (dropped later, garbage collected) gives nothing back into a store:
    the pool stays closed, later hops run whole-history (exact) and reserve nothing."""
    prompt, tokens, ends, pool, st = golden_stream(flow, vectors)
    assert pool.stats()["bytes_used"] > 0
    pool.close()
    st.close()  # late: its page ids must not reach any store
    assert pool.storage(flow) is None and pool.stats()["bytes_used"] == 0
    st2 = pool.new_state()
    assert torch.equal(hop(flow, tokens, prompt, ends[1], st2), hop(flow, tokens, prompt, ends[1]))
    assert pool.stats()["bytes_used"] == 0 and st2.frames == 0
