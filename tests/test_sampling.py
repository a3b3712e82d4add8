"""RAS sampling (single and batched: sample_batch == each row alone, one host sync), TokenPolicy (length
limits, stop ids, upstream quirk, silent runs, force_tokens) and generate()."""
import os

import pytest
import torch

from cosytrt.runtime.models.config import SILENT_TOKENS
from cosytrt.engines.errors import InputError
from cosytrt.runtime.models.sampling import (DRAW_BLOCK, MAX_SILENT_RUN, SamplingParams, TokenPolicy, generate, nucleus_keep, ras_sample,
                                      sample_batch, sample_ids)

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "golden")
V = 6761


def _peaked(token: int, high: float = 30.0) -> torch.Tensor:
    """Logits where `token` has essentially all the mass."""
    x = torch.zeros(V)
    x[token] = high
    return x


# ---------------------------------------------------------------- ras_sample / ras_select semantics

def _upstream_nucleus_count(probs, top_p, top_k):
    """Upstream nucleus_sampling's loop: keep while cum_prob (fp32, before adding) < top_p and count < top_k."""
    cum, n = torch.tensor(0.0), 0
    for p in probs.sort(descending=True, stable=True).values:
        if cum < top_p and n < top_k:
            cum = cum + p
            n += 1
        else:
            break
    return n, cum


def test_nucleus_keep_matches_upstream_rule():
    keep = nucleus_keep(torch.tensor([[0.6, 0.3, 0.1], [0.85, 0.1, 0.05], [0.6, 0.3, 0.1], [0.4, 0.35, 0.25]]),
                        torch.tensor([0.8, 0.8, 1.0, 1.0]), torch.tensor([25, 25, 2, 25]))
    assert keep.tolist() == [[True, True, False], [True, False, False], [True, True, False], [True, True, True]]
    g = torch.Generator().manual_seed(0)
    checked = 0
    for i in range(300):
        probs = (torch.randn(1000, generator=g) * (1.0 + i % 7)).softmax(0)
        top_p, top_k = (0.8, 0.5, 0.95, 0.99)[i % 4], (25, 5, 100, 1000)[i % 4]
        n, _ = _upstream_nucleus_count(probs, top_p, top_k)
        sorted_p = probs.sort(descending=True, stable=True).values[None]
        cum = sorted_p.cumsum(-1)[0]
        if (cum[max(n - 2, 0):n] - top_p).abs().min() < 1e-5:
            continue                                   # a rounding tie: fp32 sums in a different order may differ
        assert int(nucleus_keep(sorted_p, torch.tensor([top_p]), torch.tensor([top_k])).sum()) == n, i
        checked += 1
    assert checked > 270


def _small_logits(probs: dict[int, float], v: int = 64) -> torch.Tensor:
    x = torch.full((v,), float("-inf"))
    for i, p in probs.items():
        x[i] = torch.tensor(p).log()
    return x


def _frequencies(logits, history, params, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    counts = {}
    for _ in range(n):
        t = ras_sample(logits, history, params, g)
        counts[t] = counts.get(t, 0) + 1
    return {t: c / n for t, c in counts.items()}


def _close(freq, expect, n):
    assert set(freq) == set(expect), (freq, expect)
    for t, p in expect.items():
        assert abs(freq[t] - p) < 4.5 * (p * (1 - p) / n) ** 0.5 + 1e-9, (t, freq[t], p)


def test_nucleus_draw_frequencies():
    n = 3000
    logits = _small_logits({10: 0.6, 20: 0.3, 30: 0.1})
    _close(_frequencies(logits, [], SamplingParams(), n), {10: 2 / 3, 20: 1 / 3}, n)    # renormalised nucleus
    _close(_frequencies(logits, [], SamplingParams(top_p=1.0), n), {10: 0.6, 20: 0.3, 30: 0.1}, n)
    _close(_frequencies(logits, [], SamplingParams(top_p=1.0, top_k=2), n), {10: 2 / 3, 20: 1 / 3}, n)


def test_repeat_resample_frequencies():
    n = 3000
    logits = _small_logits({5: 0.97, 7: 0.0225, 9: 0.0075})     # the nucleus is {5}
    _close(_frequencies(logits, [1, 2], SamplingParams(), n), {5: 1.0}, n)
    # 5 in the window: masked, drawn from the full softmax of the rest (7 : 9 = 3 : 1)
    _close(_frequencies(logits, [1, 5, 2], SamplingParams(), n), {7: 0.75, 9: 0.25}, n)


def test_two_uniforms_per_step_from_the_request_generator():
    """Two uniforms per step from the request's own stream, drawn DRAW_BLOCK steps at a time: after 7 steps the
    generator has given one block and 14 of its numbers are used (test_sampling_exact: the same ids as drawing two
    per step)."""
    pol = TokenPolicy(5, SamplingParams(seed=42, min_tokens=0))
    for s in range(7):
        pol.step(torch.randn(V, generator=torch.Generator().manual_seed(s)))
    ref = torch.Generator().manual_seed(42)
    block = torch.rand(2 * DRAW_BLOCK, generator=ref)
    assert torch.equal(pol.generator.get_state(), ref.get_state())
    assert pol.draw() == block[14:16].tolist()


def test_nucleus_keeps_top_p_and_top_k():
    g = torch.Generator().manual_seed(0)
    logits = torch.full((V,), -1e9)
    logits[[10, 20, 30]] = torch.tensor([0.6, 0.3, 0.1]).log()
    params = SamplingParams()
    drawn = {ras_sample(logits, [], params, g) for _ in range(300)}
    assert drawn == {10, 20}                      # 0.6 then 0.9 >= 0.8: the third id is cut
    assert {ras_sample(logits, [], SamplingParams(top_k=1), g) for _ in range(50)} == {10}
    assert {ras_sample(logits, [], SamplingParams(top_p=1.0), g) for _ in range(500)} == {10, 20, 30}


def test_ras_repeat_rule_resamples():
    g = torch.Generator().manual_seed(0)
    logits = _peaked(100, high=30.0)
    logits[200] = 25.0                            # p(100) ~ 0.993 > top_p: the nucleus is {100} alone
    params = SamplingParams()
    assert ras_sample(logits, [], params, g) == 100
    # 100 in the last win_size ids -> masked, resampled from the full softmax (200 dominates what is left)
    assert ras_sample(logits, [5, 100, 7], params, g) == 200
    # only outside the window: no resampling
    assert ras_sample(logits, [100] + [1] * 10, params, g) == 100
    # tau_r 0.2 -> needs 2 repeats in the window
    assert ras_sample(logits, [100, 3], SamplingParams(tau_r=0.2), g) == 100
    assert ras_sample(logits, [100, 100], SamplingParams(tau_r=0.2), g) == 200


def test_greedy_is_argmax_and_ignores_history():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(V)
    best = int(logits.argmax())
    p = SamplingParams(greedy=True)
    assert all(ras_sample(logits, [best] * 10, p, g) == best for _ in range(5))


def test_sampling_params_validation():
    for bad in (dict(top_p=0.0), dict(top_k=0), dict(win_size=0), dict(max_tokens=0), dict(force_tokens=-1),
                dict(min_tokens=5, max_tokens=3)):
        with pytest.raises(InputError):
            SamplingParams(**bad)


# ---------------------------------------------------------------- TokenPolicy

def _run(policy, logits_fn, limit=1000):
    out, steps = [], 0
    while steps < limit:
        tok, done = policy.step(logits_fn(steps))
        steps += 1
        if tok is not None:
            out.append(tok)
        if done:
            break
    return out, steps


def test_min_len_masks_6561_then_stops():
    pol = TokenPolicy(text_len=3, params=SamplingParams(seed=1))
    assert (pol.min_len, pol.max_len) == (6, 60)

    def logits(step):  # 6561 dominant, then speech id 42
        x = _peaked(6561)
        x[42] = 20.0
        return x
    out, steps = _run(pol, logits)
    assert len(out) == 6 and steps == 7 and pol.finished


def test_upstream_quirk_eos_6562_stops_before_min_len():
    out, steps = _run(TokenPolicy(3, SamplingParams(seed=1)), lambda s: _peaked(6562))
    assert out == [] and steps == 1                       # upstream: ignore_eos masks only 6561
    strict = TokenPolicy(3, SamplingParams(seed=1), mask_all_stops_before_min=True)
    out, _ = _run(strict, lambda s: _peaked(6562) + _peaked(42, 20.0))
    assert len(out) == 6


def test_max_len_and_overrides():
    def logits(step):  # never a stop id; alternate so RAS does not interfere
        return _peaked(10 + step % 50)
    out, _ = _run(TokenPolicy(2, SamplingParams(seed=0)), logits)
    assert len(out) == 40
    out, _ = _run(TokenPolicy(2, SamplingParams(seed=0, max_tokens=7)), logits)
    assert len(out) == 7
    pol = TokenPolicy(2, SamplingParams(seed=0, min_tokens=9))
    out, _ = _run(pol, lambda s: _peaked(6561) + _peaked(10 + s % 50, 20.0))
    assert len(out) == 9


def test_force_tokens_exact_count():
    for n in (1, 13):
        pol = TokenPolicy(1, SamplingParams(seed=0, force_tokens=n))
        out, steps = _run(pol, lambda s: _peaked(6562) + _peaked(7 + s % 50, 5.0))   # stop ids masked
        assert len(out) == n and steps == n and all(t < 6561 for t in out)
    # silent tokens are not dropped under force_tokens
    pol = TokenPolicy(1, SamplingParams(greedy=True, force_tokens=12))
    out, _ = _run(pol, lambda s: _peaked(SILENT_TOKENS[0]))
    assert out == [SILENT_TOKENS[0]] * 12


def test_silent_run_limit_drops_sixth_and_later():
    silent, loud = SILENT_TOKENS[0], 3000
    seq = [silent] * 7 + [loud] + [SILENT_TOKENS[3]] * 2 + [6562]
    pol = TokenPolicy(10, SamplingParams(greedy=True, min_tokens=0))
    emitted, fed = [], []
    for tok_id in seq:
        tok, done = pol.step(_peaked(tok_id))
        if not done:
            fed.append(pol.next_input)
        emitted.append(tok)
        if done:
            break
    assert MAX_SILENT_RUN == 5
    assert emitted == [silent] * 5 + [None, None] + [loud] + [SILENT_TOKENS[3]] * 2 + [None]
    assert fed == seq[:-1]                        # dropped tokens are still fed back to the LM
    assert pol.history == seq[:-1] and pol.output == [t for t in emitted if t is not None]
    with pytest.raises(InputError):
        pol.step(_peaked(1))


def test_policy_seed_reproduces():
    torch.manual_seed(3)
    seq = [torch.randn(V) * 3 for _ in range(30)]

    def run(seed):
        pol = TokenPolicy(20, SamplingParams(seed=seed, min_tokens=0), mask_all_stops_before_min=True)
        return _run(pol, lambda s: seq[s % len(seq)], limit=30)[0]
    assert run(5) == run(5)
    assert run(5) != run(6)


def test_policy_rejects_bad_input():
    with pytest.raises(InputError, match="text_len"):
        TokenPolicy(0, SamplingParams())
    with pytest.raises(InputError, match="6761"):
        TokenPolicy(2).step(torch.zeros(100))


# ---------------------------------------------------------------- sample_batch

MIXED = [dict(text_len=5, params=SamplingParams(seed=1)),
         dict(text_len=5, params=SamplingParams(seed=2, top_p=0.5, top_k=5, min_tokens=3)),
         dict(text_len=3, params=SamplingParams(greedy=True, max_tokens=40)),
         dict(text_len=5, params=SamplingParams(seed=4, top_p=1.0, top_k=100, win_size=4, tau_r=0.5)),
         dict(text_len=1, params=SamplingParams(seed=5, force_tokens=30)),
         dict(text_len=8, params=SamplingParams(seed=6, min_tokens=10, max_tokens=25), mask_all_stops_before_min=True)]


def _mixed_logits(row: int, step: int) -> torch.Tensor:
    """Per (row, step) logits: random, some rows peaked on id 42 (RAS repeats), some stop-id mass."""
    g = torch.Generator().manual_seed(1000 * row + step)
    x = torch.randn(V, generator=g) * (1.0 + row)
    if row in (0, 5):
        x[42] += 40.0                                  # nucleus = {42}: the repeat rule must resample
    x[6561:6563] += 6.0 if step > 15 else 0.0         # 6561 (masked before min_len) and eos 6562
    return x


def _run_alone(i):
    pol = TokenPolicy(**MIXED[i])
    emitted = []
    for s in range(100):
        tok, done = pol.step(_mixed_logits(i, s))
        emitted.append(tok)
        if done:
            return pol, emitted
    raise AssertionError("did not finish")


def test_batched_equals_each_row_alone():
    pols = [TokenPolicy(**kw) for kw in MIXED]
    emitted = [[] for _ in pols]
    steps = [0] * len(pols)
    while True:
        live = [i for i, p in enumerate(pols) if not p.finished]
        if not live:
            break
        logits = torch.stack([_mixed_logits(i, steps[i]) for i in live])
        for i, (tok, done) in zip(live, sample_batch(logits, [pols[i] for i in live])):
            emitted[i].append(tok)
            steps[i] += 1
            assert done == pols[i].finished
    assert len(set(steps)) > 2                         # rows left the batch at different steps
    for i, pol in enumerate(pols):
        alone, alone_emitted = _run_alone(i)
        assert emitted[i] == alone_emitted and pol.history == alone.history, i
        if pol.params.seed is not None:                # same stream: two uniforms per step
            assert torch.equal(pol.generator.get_state(), alone.generator.get_state()), i
    assert len(pols[4].output) == 30 and 10 <= len(pols[5].output) <= 25
    for i in (0, 5):                                   # 42 at most once in any win_size=10 window
        h = pols[i].history
        assert h.count(42) >= 2 and all(h[j:j + 10].count(42) <= 1 for j in range(len(h))), h
    # greedy row = argmax of the masked logits
    g_pol = TokenPolicy(**MIXED[2])
    for s, tok in enumerate(pols[2].history):
        x = _mixed_logits(2, s)
        if s < g_pol.min_len:
            x[6561] = float("-inf")
        assert tok == int(x.argmax())


def test_one_host_sync_per_batch(monkeypatch):
    calls = {}

    def counting(name):
        orig = getattr(torch.Tensor, name)

        def wrapper(self, *a, **k):
            calls[name] = calls.get(name, 0) + 1
            return orig(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, wrapper)
    pols = [TokenPolicy(**kw) for kw in MIXED]
    for p in pols:
        p.history = [42, 7, 42]
        p.draw()       # each policy's block of uniforms (host numbers, once per DRAW_BLOCK steps) before counting
    for name in ("tolist", "item", "__int__", "__float__", "__bool__", "__index__", "numpy", "cpu"):
        counting(name)
    out = sample_batch(torch.stack([_mixed_logits(i, 20) for i in range(len(pols))]), pols)
    assert len(out) == 6
    assert calls == {"tolist": 1}


def test_sample_batch_rejects_bad_input():
    with pytest.raises(InputError, match="logits must be"):
        sample_batch(torch.zeros(3, V), [TokenPolicy(2), TokenPolicy(2)])
    with pytest.raises(InputError, match="6761"):
        sample_ids(torch.zeros(2, 100), [TokenPolicy(2), TokenPolicy(2)])
    with pytest.raises(InputError, match="speech_token_size"):
        sample_ids(torch.zeros(2, 64), [TokenPolicy(2, speech_token_size=60, num_special=4),
                                        TokenPolicy(2, speech_token_size=61, num_special=3)])
    done = TokenPolicy(2, SamplingParams(force_tokens=1, seed=0))
    done.step(torch.zeros(V))
    fresh = TokenPolicy(2, SamplingParams(seed=0))
    with pytest.raises(InputError, match="finished"):
        sample_batch(torch.zeros(2, V), [fresh, done])
    assert fresh.num_sampled == 0 and fresh.generator is None      # nothing drawn before the check failed
    assert sample_batch(torch.zeros(0, V), []) == []


# ---------------------------------------------------------------- generate on the tiny LM

@pytest.fixture(scope="module")
def lm(golden_lm):
    return golden_lm


@pytest.fixture(scope="module")
def lm_input(lm):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        return lm.build_lm_input(torch.randint(0, 512, (12,), generator=g), torch.randint(0, 6561, (9,), generator=g))


def test_generate_same_seed_same_tokens(lm, lm_input):
    p = SamplingParams(seed=11, force_tokens=25)
    a = list(generate(lm, lm_input, text_len=4, params=p))
    b = list(generate(lm, lm_input, text_len=4, params=p))
    c = list(generate(lm, lm_input, text_len=4, params=SamplingParams(seed=12, force_tokens=25)))
    assert len(a) == 25 and a == b and a != c


def test_generate_greedy_matches_full_recompute(lm, lm_input):
    n = 10
    toks = list(generate(lm, lm_input, text_len=4, params=SamplingParams(greedy=True, force_tokens=n)))
    assert toks == list(generate(lm, lm_input, text_len=4, params=SamplingParams(greedy=True, force_tokens=n)))
    # reference: no cache, recompute the whole sequence each step, argmax over the speech ids
    seq, ref = lm_input, []
    with torch.no_grad():
        for _ in range(n):
            logits = lm(seq[None])[0, -1]
            logits[6561:] = float("-inf")
            t = int(logits.argmax())
            ref.append(t)
            seq = torch.cat([seq, lm.embed_speech(torch.tensor([t]))])
    assert toks == ref


def test_generate_respects_length_limits(lm, lm_input):
    out = list(generate(lm, lm_input, text_len=2, params=SamplingParams(seed=0)))
    assert len(out) <= 40
    strict = list(generate(lm, lm_input, text_len=2, params=SamplingParams(seed=0, max_tokens=8),
                           mask_all_stops_before_min=True))
    assert 4 <= len(strict) <= 8                  # min_len = 2 * text_len, max_tokens 8
    assert all(0 <= t < 6561 for t in out + strict)
