"""The frontend step's per-voice memo (scheduling/prepare.VoiceMemo): a saved voice's prompt upload, host ids, digest
and LM prompt embeddings are made once and give the values the uncached path gives; a replaced or edited tensor is
never served stale; the step's operation count drops (each torch call is a GIL hand-off on a busy server). CPU, tiny
model."""
from __future__ import annotations

import gc

import pytest
import torch

from cosytrt.engines.errors import InputError
from cosytrt.runtime.models.frontend import PromptFeatures
from cosytrt.runtime.scheduling.handle import RequestHandle
from cosytrt.runtime.scheduling.prepare import VoiceMemo, flow_prompt, lm_input
from cosytrt.runtime.scheduling.state import RequestState
from cosytrt.runtime.stages.flow_cache import prompt_digest
from cosytrt.runtime.stages.request import Request, RequestMetrics, prepare_inputs
from cosytrt.tools.bench.op_count import OpCounter


def _state(text="Hello there, my friend."):
    q = Request(text, stream=True)
    return RequestState(q, RequestHandle(q, RequestMetrics(request_id=q.request_id, stream=True), lambda h: None))


def test_memo_hits_stale_and_dead_entries():
    memo = VoiceMemo(capacity=2)
    a, b = torch.arange(4), torch.ones(3)
    made = []

    def make(tag):
        made.append(tag)
        return tag

    assert memo.get("k", (a, b), lambda: make(1)) == 1
    assert memo.get("k", (a, b), lambda: make(2)) == 1 and memo.hits == 1  # same tensors, unchanged
    a.add_(1)                                                               # edited in place: made anew
    assert memo.get("k", (a, b), lambda: make(3)) == 3
    assert memo.get("other", (a, b), lambda: make(4)) == 4                  # another kind: its own entry
    c = torch.zeros(2)
    memo.get("k", (c,), lambda: make(5))                                    # capacity 2: the oldest goes
    assert len(memo.entries) == 2 and ("k", id(a), id(b)) not in memo.entries
    del c
    gc.collect()
    memo.get("k", (b,), lambda: make(6))                                    # the freed tensor's entry is purged
    assert all(all(r() is not None for r in e[0]) for e in memo.entries.values())
    empty = torch.zeros(0)
    assert memo.get("k", (empty,), lambda: make(7)) == 7 and memo.get("k", (empty,), lambda: make(8)) == 8
    assert made == [1, 3, 4, 5, 6, 7, 8]


def test_saved_voice_prepared_once_same_values(tiny_tts):
    p = tiny_tts.pipeline
    lm = p.models.llm
    memo = VoiceMemo()
    first, second = _state(), _state("Another sentence for the same voice.")
    for r in (first, second):
        inputs = prepare_inputs(p.frontend, r.req, p.default_speaker)
        flow_prompt(r, inputs, "cpu", memo)
        lm_input(r, inputs, lm, "cpu", memo)
        # the uncached path's values, exactly
        ids = inputs.flow_prompt_tokens.reshape(-1).long()
        assert torch.equal(r.prompt_ids, ids)
        assert r.prompt_digest == prompt_digest(ids, inputs.flow_prompt_mel, inputs.embedding)
        with torch.inference_mode():
            ref = lm.build_lm_input(inputs.text_ids, inputs.prompt_speech_tokens)
        assert torch.equal(r.lm_input, ref)
    assert memo.hits == 2 and memo.misses == 2  # flow prompt and LM prompt speech: made for the first request only
    assert all(x is y for x, y in zip(first.prompt, second.prompt))
    # new LM weights (loaded in place): the prompt speech embeddings are made anew, not served stale
    w = lm.speech_embedding.weight
    old = w.detach().clone()
    try:
        with torch.no_grad():
            w.mul_(2.0)
        third = _state()
        inputs = prepare_inputs(p.frontend, third.req, p.default_speaker)
        lm_input(third, inputs, lm, "cpu", memo)
        with torch.inference_mode():
            assert torch.equal(third.lm_input, lm.build_lm_input(inputs.text_ids, inputs.prompt_speech_tokens))
    finally:
        with torch.no_grad():
            w.copy_(old)


def test_edited_voice_not_served_stale(tiny_tts):
    p = tiny_tts.pipeline
    spk = p.default_speaker
    feats = PromptFeatures(spk.features.speech_tokens.clone(), spk.features.mel.clone(),
                           spk.features.embedding.clone())
    memo = VoiceMemo()
    r1, r2 = _state(), _state()
    inputs = p.frontend.zero_shot("Hello there.", spk.prompt_text, features=feats)
    flow_prompt(r1, inputs, "cpu", memo)
    feats.mel.mul_(0.5)  # the same tensor object, new content
    inputs = p.frontend.zero_shot("Hello there.", spk.prompt_text, features=feats)
    flow_prompt(r2, inputs, "cpu", memo)
    assert r1.prompt_digest != r2.prompt_digest and memo.hits == 0
    feats.speech_tokens[0] = 10 ** 6  # the frontend's own check is memoized per version too: an edit is rechecked
    with pytest.raises(InputError, match="speech_tokens outside"):
        p.frontend.zero_shot("Hello there.", spk.prompt_text, features=feats)


def test_frontend_step_operation_count(tiny_tts):
    """A saved voice's second request costs the frontend step about a quarter of the torch calls of its first
    (47 -> 11 when written): under load each one waits for the GIL behind the AR, DiT and HiFT threads."""
    sch = tiny_tts.scheduler
    sch._prepare(_state())  # the voice's first request: memo filled
    with OpCounter() as ops:
        sch._prepare(_state("A second request of the same voice."))
    assert ops.total <= 16, ops.ops


def test_own_prompt_audio_stays_out_of_the_memo(tiny_tts):
    """A request with its own reference audio is prepared without the memo (used once: it would only evict the
    saved voices' entries); a saved voice's request goes through it."""
    from cosytrt.runtime.stages.request import default_voice_wav

    sch = tiny_tts.scheduler
    sch.voices.entries.clear()
    q = Request("Hello there.", prompt_wav=default_voice_wav(16000, 1.0), prompt_sr=16000, prompt_text="A voice.")
    r = RequestState(q, RequestHandle(q, RequestMetrics(request_id=q.request_id), lambda h: None))
    sch._prepare(r)
    assert not sch.voices.entries and r.prompt_digest is not None
    sch._prepare(_state())
    assert len(sch.voices.entries) == 2  # the default voice: flow prompt and LM prompt speech


def test_prompt_text_ids_memo_is_bounded_and_exact(tiny_tts, monkeypatch):
    """The frontend keeps the token ids of the prompt texts it saw last (at most _PROMPT_MEMO), the same ids the
    tokenizer gives; the oldest goes first, a reused one counts as new."""
    from cosytrt.runtime.models import frontend as fe_mod

    fe = tiny_tts.pipeline.frontend
    monkeypatch.setattr(fe_mod, "_PROMPT_MEMO", 2)
    fe.__dict__.pop("_prompt_ids", None)
    for text in ("first voice.", "second voice.", "first voice.", "third voice."):
        assert fe._encode_prompt(text) == tuple(fe.tokenizer.encode(text))
    assert list(fe._prompt_ids) == ["first voice.", "third voice."]
    fe.__dict__.pop("_prompt_ids", None)
