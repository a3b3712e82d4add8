"""RAS sampling, TokenPolicy (length limits, stop ids, upstream quirk, silent runs, force_tokens) and generate()."""
import os

import pytest
import torch

from cosytrt.runtime.config import SILENT_TOKENS, config_from_golden_json
from cosytrt.runtime.errors import InputError
from cosytrt.runtime.llm import CosyVoice3LM
from cosytrt.runtime.sampling import MAX_SILENT_RUN, SamplingParams, TokenPolicy, generate, ras_sample

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "golden")
V = 6761


def _peaked(token: int, high: float = 30.0) -> torch.Tensor:
    """Logits where `token` has essentially all the mass."""
    x = torch.zeros(V)
    x[token] = high
    return x


# ---------------------------------------------------------------- ras_sample

def _upstream_ras(weighted_scores, decoded_tokens, g, top_p=0.8, top_k=25, win_size=10, tau_r=0.1):
    """Transcription of upstream ras_sampling / nucleus_sampling / random_sampling with an explicit generator."""
    prob, indices = [], []
    cum_prob = 0.0
    sorted_value, sorted_idx = weighted_scores.softmax(dim=0).sort(descending=True, stable=True)
    for i in range(len(sorted_idx)):
        if cum_prob < top_p and len(prob) < top_k:
            cum_prob += sorted_value[i]
            prob.append(sorted_value[i])
            indices.append(sorted_idx[i])
        else:
            break
    prob = torch.tensor(prob).to(weighted_scores)
    indices = torch.tensor(indices, dtype=torch.long)
    top_ids = int(indices[prob.multinomial(1, replacement=True, generator=g)])
    rep_num = (torch.tensor(decoded_tokens[-win_size:]) == top_ids).sum().item()
    if rep_num >= win_size * tau_r:
        weighted_scores = weighted_scores.clone()
        weighted_scores[top_ids] = -float("inf")
        top_ids = int(weighted_scores.softmax(dim=0).multinomial(1, replacement=True, generator=g))
    return top_ids


def test_ras_matches_upstream_draw_for_draw():
    torch.manual_seed(0)
    params = SamplingParams()
    g_ours, g_ref = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    history = []
    for step in range(200):
        scale = 1.0 + 4.0 * (step % 5)             # from flat to peaked distributions
        logp = (torch.randn(V) * scale).log_softmax(0)
        ours = ras_sample(logp, history, params, g_ours)
        ref = _upstream_ras(logp, history, g_ref)
        assert ours == ref, f"step {step}"
        history.append(ours)


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


# ---------------------------------------------------------------- generate on the tiny LM

@pytest.fixture(scope="module")
def lm():
    m = CosyVoice3LM(config_from_golden_json(os.path.join(GOLDEN, "config.json")).llm).eval()
    m.load_checkpoint(os.path.join(GOLDEN, "llm.pt"))
    return m


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
