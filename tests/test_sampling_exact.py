"""Issue #18: the sampler's faster form picks exactly the ids of the one before it.

Changed: the top-k of the probs through one topk over unique int64 keys instead of a stable sort of the whole vocab;
uniforms drawn DRAW_BLOCK steps at a time from each request's generator; the host values uploaded from one flat list;
stop masks as one fill when the rows agree; on the CPU the repeat resample only for the repeated rows. The reference
below is the code of commit 0a7edd4 (`_ref_*`, verbatim but for names): both run side by side on logits full of ties
(bf16-rounded and coarsely quantized), for many seeds, parameter mixes and changing batch compositions, and must give
the same ids at every step. generate() on the golden tiny LM must give the token sequences recorded with that code.
"""
import math
import os
import random

import pytest
import torch

from cosytrt.runtime.models.config import config_from_golden_json
from cosytrt.runtime.models.llm import CosyVoice3LM
from cosytrt.runtime.models.sampling import (DRAW_BLOCK, SamplingParams, StaticSampler, TokenPolicy, generate,
                                             pack_rows, ras_sample, ras_select, sample_batch, select_packed,
                                             sorted_head)

V = 6761
GOLDEN = os.path.join(os.path.dirname(__file__), "data", "golden")


# ---------------------------------------------------------------- the reference (commit 0a7edd4)

def _ref_inverse_cdf(weights, u):
    cdf = weights.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).clamp_(max=weights.shape[-1] - 1)


def _ref_nucleus_keep(sorted_probs, top_p, top_k):
    cum = sorted_probs.cumsum(dim=-1)
    before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)
    pos = torch.arange(sorted_probs.shape[-1], device=sorted_probs.device)
    return (before < top_p[:, None]) & (pos[None] < top_k[:, None])


def _ref_ras_select(scores, top_p, top_k, greedy, uniforms, window, repeat_min, max_top_k=None):
    probs = scores.softmax(dim=-1)
    sorted_p, sorted_idx = probs.sort(dim=-1, descending=True, stable=True)
    k = sorted_p.shape[-1] if max_top_k is None else min(max_top_k, sorted_p.shape[-1])
    head = sorted_p[:, :k]
    head = head * _ref_nucleus_keep(head, top_p, top_k)
    nucleus_id = sorted_idx.gather(1, _ref_inverse_cdf(head, uniforms[:, 0]))
    repeated = (window == nucleus_id).sum(dim=-1, keepdim=True) >= repeat_min[:, None]
    rest = scores.scatter(1, nucleus_id, float("-inf")).softmax(dim=-1)
    resample_id = _ref_inverse_cdf(rest, uniforms[:, 1])
    ids = torch.where(repeated, resample_id, nucleus_id)
    ids = torch.where(greedy[:, None], scores.argmax(dim=-1, keepdim=True), ids)
    return ids[:, 0]


def _ref_row_params(params, history, stop_mode, width):
    window = history[-params.win_size:]
    return ([params.top_p, params.top_k, math.ceil(params.win_size * params.tau_r), params.greedy, stop_mode]
            + [-1] * (width - len(window)) + window)


def _ref_sample_ids(logits, policies, gens):
    """The old `sample_ids`; `gens[id(p)]`: the reference's own generator per policy (two uniforms per step)."""
    stop = policies[0].speech_token_size
    width = max(p.params.win_size for p in policies)
    uniforms = torch.stack([torch.rand(2, generator=gens[id(p)]) for p in policies])
    rows = torch.cat([uniforms, torch.tensor([_ref_row_params(p.params, p.history, p.stop_mask_mode(), width)
                                              for p in policies], dtype=torch.float32)], dim=1).to(logits.device)
    mode = rows[:, 6:7]
    col = torch.arange(logits.shape[1], device=logits.device)[None]
    masked = ((mode == 2) & (col >= stop)) | ((mode == 1) & (col == stop))
    scores = logits.float().masked_fill(masked, float("-inf"))
    return _ref_ras_select(scores, rows[:, 2], rows[:, 3].long(), rows[:, 5] > 0, rows[:, 0:2], rows[:, 7:].long(),
                           rows[:, 4], max(p.params.top_k for p in policies)).tolist()


def _ref_sample_batch(logits, policies, gens):
    """`sample_batch` (its bookkeeping is not what changed) over the previous `sample_ids`."""
    from unittest import mock

    from cosytrt.runtime.models import sampling

    with mock.patch.object(sampling, "sample_ids", lambda lg, ps: _ref_sample_ids(lg, ps, gens)):
        return sampling.sample_batch(logits, policies)


# ---------------------------------------------------------------- logits full of ties, many parameter mixes

def _logits(row: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * row + step)
    x = torch.randn(V, generator=g) * (0.5 + row % 4)
    kind = row % 5
    if kind == 0:
        x = x.to(torch.bfloat16).float()                   # bf16 logits: many equal values
    elif kind == 1:
        x = (x * 2).round() / 2                            # coarse: ties among the top entries too
    elif kind == 2:
        x[[42, 43, 44]] += 12.0                            # three equal peaks: repeats, tied nucleus
        x = x.to(torch.bfloat16).float()
    elif kind == 3:
        x[::3] = float("-inf")                             # masked columns (prob 0, tied)
    else:
        x = torch.zeros(V)                                 # all equal
    if step > 25 + 6 * (row % 8):
        x[6561 + row % 3] += 8.0                           # stop-id mass (6561 is masked before min_len)
    return x


def _params(i: int) -> tuple[SamplingParams, dict]:
    top_k = [1, 2, 5, 25, 100, 7000][i % 6]
    top_p = [0.1, 0.5, 0.8, 0.95, 1.0][i % 5]
    win = [1, 4, 10, 20][i % 4]
    tau = [0.1, 0.3, 1.0][i % 3]
    extra = [dict(), dict(min_tokens=3, max_tokens=70), dict(force_tokens=40 + i % 30), dict(max_tokens=75),
             dict(min_tokens=10, max_tokens=60)][i % 5] if i else dict(force_tokens=3 * DRAW_BLOCK + 5)
    kw = dict(mask_all_stops_before_min=True) if i % 7 == 3 else {}
    return SamplingParams(seed=1000 + i, top_k=top_k, top_p=top_p, win_size=win, tau_r=tau, greedy=i % 11 == 5,
                          **extra), kw


def _policies(n: int) -> list[TokenPolicy]:
    out = []
    for i in range(n):
        params, kw = _params(i)
        out.append(TokenPolicy(4, params, **kw))
    return out


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_same_ids_as_the_reference_in_changing_batches(seed, device):
    """On CUDA (where a GPU is) the sampler takes its CUDA form: the resample of every row, pinned uploads."""
    rng = random.Random(seed)
    n = 22
    new, ref = _policies(n), _policies(n)
    gens = {id(p): p.params.make_generator() for p in ref}
    steps = [0] * n
    calls = 0
    while True:
        live = [i for i in range(n) if not new[i].finished]
        assert live == [i for i in range(n) if not ref[i].finished]
        if not live:
            break
        batch = rng.sample(live, rng.randint(1, len(live)))        # a changing subset, in a changing order
        logits = torch.stack([_logits(i, steps[i]) for i in batch]).to(device)
        before = logits.clone()
        got = sample_batch(logits, [new[i] for i in batch])
        assert torch.equal(logits, before)                          # the caller's logits are not changed
        want = _ref_sample_batch(before, [ref[i] for i in batch], gens)
        assert got == want, (calls, batch)
        for i in batch:
            steps[i] += 1
        calls += 1
    for a, b in zip(new, ref):
        assert a.history == b.history and a.output == b.output
    assert max(steps) > 2 * DRAW_BLOCK                              # rows crossed uniform blocks
    assert sum(len(p.history) for p in new) > 800


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", [0, 3])
def test_static_sampler_same_ids_as_the_reference(seed, device):
    """The fixed-shape sampler of the decode graphs (`StaticSampler`: per-row stop masks, greedy where, every row's
    resample, the window padded to a static width, padding rows up to the graph's batch bucket) picks the reference's
    ids in changing batches; so do `select_packed` and a retry of a subset of the packed rows (no new draws)."""
    rng = random.Random(seed)
    n = 22
    new, ref = _policies(n), _policies(n)
    gens = {id(p): p.params.make_generator() for p in ref}
    steps = [0] * n
    while True:
        live = [i for i in range(n) if not new[i].finished and new[i].num_sampled < new[i].max_len]
        if not live:
            break
        batch = rng.sample(live, rng.randint(1, len(live)))
        logits = torch.stack([_logits(i, steps[i]) for i in batch]).to(device)
        packed = pack_rows([new[i] for i in batch], V)
        sampler = StaticSampler(V, 6561, top_k=packed.max_top_k, width=packed.width + rng.randint(0, 12))
        assert sampler.fits(packed)
        B = len(batch) + rng.randint(0, 5)
        padded = torch.cat([logits, torch.randn(B - len(batch), V, device=device)])
        got = sampler(padded, sampler.rows(packed, B).to(device))[:len(batch)].tolist()
        assert got == select_packed(logits, packed)
        keep = sorted(rng.sample(range(len(batch)), rng.randint(1, len(batch))))
        assert select_packed(logits[keep], packed.subset(keep)) == [got[j] for j in keep]
        want = _ref_sample_ids(logits, [ref[i] for i in batch], gens)
        assert got == want, batch
        for i, tok in zip(batch, got):
            new[i].accept(tok)
            ref[i].accept(tok)
            steps[i] += 1
    assert sum(len(p.history) for p in new) > 800


def test_static_sampler_fits():
    packed = pack_rows(_policies(3)[:1], V)   # top_k 1, window 1
    assert StaticSampler(V, 6561, top_k=1, width=10).fits(packed)
    assert not StaticSampler(V, 6561, top_k=25, width=10).fits(packed)     # another top_k: sampled from the logits
    assert not StaticSampler(V, 6560, top_k=1, width=10).fits(packed)
    wide = pack_rows([TokenPolicy(4, SamplingParams(seed=0, win_size=20))], V)
    assert not StaticSampler(V, 6561).fits(wide)                           # wider window than the graph's


def test_ras_select_both_resample_forms_match_the_reference():
    """The CUDA form (every row's resample softmax, torch.where) and the CPU form (repeated rows only), on CPU."""
    g = torch.Generator().manual_seed(3)
    B = 40
    scores = torch.stack([_logits(i, 30 + i) for i in range(B)]).log_softmax(dim=-1)
    top_p = torch.tensor([[0.1, 0.5, 0.8, 1.0][i % 4] for i in range(B)])
    top_k = torch.tensor([[1, 3, 25, 200][i % 4] for i in range(B)])
    greedy = torch.tensor([i % 9 == 4 for i in range(B)])
    uniforms = torch.rand(B, 2, generator=g)
    window = torch.randint(0, 50, (B, 10), generator=g)
    window[:, 0] = torch.tensor([42, 43, 44, -1] * (B // 4))
    repeat_min = torch.tensor([[1.0, 2.0][i % 2] for i in range(B)])
    want = _ref_ras_select(scores, top_p, top_k, greedy, uniforms, window, repeat_min, 200)
    for repeated_only in (False, True):
        got = ras_select(scores, top_p, top_k, greedy, uniforms, window, repeat_min, 200, repeated_only=repeated_only)
        assert torch.equal(got, want), repeated_only
        no_greedy = torch.zeros_like(greedy)
        got = ras_select(scores, top_p, top_k, None, uniforms, window, repeat_min, 200, repeated_only=repeated_only)
        assert torch.equal(got, _ref_ras_select(scores, top_p, top_k, no_greedy, uniforms, window, repeat_min, 200))
    assert int((want != _ref_ras_select(scores, top_p, top_k, greedy, uniforms, window.fill_(-1), repeat_min,
                                        200)).sum()) > 0        # some rows did resample


def test_sorted_head_is_the_stable_sort_prefix():
    for n in (1, 2, 3, 100, V):
        for quant in (0.0, 0.5):
            x = torch.randn(4, n, generator=torch.Generator().manual_seed(n))
            if quant:
                x = (x / quant).round() * quant
            x[:, 1::5] = float("-inf")
            if n > 1:
                x[1] = 0.0
            p = x.softmax(dim=-1)
            ref = p.sort(dim=-1, descending=True, stable=True)
            for k in sorted({1, min(7, n), n}):
                vals, idx = sorted_head(p, k)
                assert torch.equal(idx, ref.indices[:, :k]) and torch.equal(vals, ref.values[:, :k]), (n, k)


def test_block_draws_equal_per_step_draws():
    a, b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    block = torch.rand(2 * DRAW_BLOCK, generator=a)
    assert torch.equal(block, torch.cat([torch.rand(2, generator=b) for _ in range(DRAW_BLOCK)]))


def test_ras_sample_matches_the_reference():
    for i in range(30):
        x = _logits(i, i)
        params = _params(i)[0]
        hist = [42, 43, 44, 42][: i % 5]
        g1, g2 = torch.Generator().manual_seed(i), torch.Generator().manual_seed(i)
        got = ras_sample(x, hist, params, g1)
        u = torch.rand(2, generator=g2)[None]
        row = torch.tensor([_ref_row_params(params, hist, 0, params.win_size)], dtype=torch.float32)
        want = _ref_ras_select(x.float()[None], row[:, 0], row[:, 1].long(), row[:, 3] > 0, u, row[:, 5:].long(),
                               row[:, 2], params.top_k)
        assert got == int(want[0]), i


# ---------------------------------------------------------------- pinned tokens of the golden tiny LM

PINNED = [  # (sampling params, text_len 3) -> generate()'s tokens, recorded with commit 0a7edd4's sampler
    (dict(seed=0, force_tokens=40),
     [3474, 2272, 4379, 3122, 1817, 3722, 2450, 3105, 5225, 5196, 2475, 910, 6390, 6337, 1122, 4234, 5990, 214, 4391,
      4760, 4887, 3995, 2962, 6354, 565, 5001, 1840, 3949, 5651, 4953, 1697, 20, 3129, 957, 3271, 6323, 4578, 466, 1637,
      4785]),
    (dict(seed=2, top_k=3, top_p=0.95, force_tokens=40),
     [6337, 1122, 3119, 677, 3846, 731, 269, 1255, 5263, 2765, 3065, 5278, 4978, 3722, 3016, 6378, 2449, 1679, 4151,
      1502, 6372, 5619, 3665, 5001, 1299, 1637, 2170, 4361, 3321, 3688, 3099, 4409, 2300, 2742, 5617, 4649, 5316, 3071,
      4842, 1840]),
    (dict(seed=3, win_size=4, tau_r=0.5, force_tokens=40),
     [3105, 3180, 5592, 5814, 3102, 3119, 2040, 3722, 5368, 3224, 2665, 18, 3846, 5523, 2660, 5210, 1537, 3127, 3550,
      1571, 3127, 1988, 4862, 3016, 5091, 127, 1207, 2164, 1465, 6153, 2765, 5263, 2765, 6354, 6120, 4426, 2962, 3917,
      6137, 6317]),
    (dict(seed=5),
     [1981, 2847, 2639, 3474, 2272, 3688, 3099, 2116, 4950, 5496, 1910, 957, 5844, 4361, 1368, 2300, 5006, 5274, 3649,
      5858]),
    (dict(seed=6, top_p=1.0, top_k=100),
     [2640, 2178, 4761, 2116, 4034, 6452, 6321, 2742, 1693, 5196, 1096, 4783, 2164, 1372, 2449, 639, 5830, 2034, 6036,
      2309, 1952, 2322, 4103, 5491, 3630, 5867, 2282, 2188, 6378, 5746, 2876, 2633, 632, 1618, 1085, 786, 6044, 5579,
      3722, 5260, 6228, 2193, 3799, 4258, 1397, 5812, 2047, 6399, 1279, 1721]),
]


def test_generate_gives_the_pinned_tokens():
    lm = CosyVoice3LM(config_from_golden_json(os.path.join(GOLDEN, "config.json")).llm).eval()
    lm.load_checkpoint(os.path.join(GOLDEN, "llm.pt"))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        lm_input = lm.build_lm_input(torch.randint(0, 512, (12,), generator=g),
                                     torch.randint(0, 6561, (9,), generator=g))
    for kw, tokens in PINNED:
        assert list(generate(lm, lm_input, text_len=3, params=SamplingParams(**kw))) == tokens, kw
