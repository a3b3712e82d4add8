"""The library API against bad arguments and failing neighbours (an audit as a production caller would use it): each
bad option raises the project's InputError naming it — never a TypeError / RuntimeError from deep inside, nor
silent garbage such as NaN audio — and a request whose sampling fails mid-decode fails alone, the others keeping
the tokens they get alone. CPU, tiny model."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from cosytrt.engines.errors import InputError
from cosytrt.runtime.models import audio, sampling
from cosytrt.runtime.models.frontend import SavedSpeaker
from cosytrt.runtime.stages.request import default_voice_wav


@pytest.fixture(scope="module")
def tts(one_torch_thread, tiny_tts):
    return tiny_tts


@pytest.fixture(scope="module")
def speaker(tts):
    return tts.make_speaker(default_voice_wav(16000, 1.0), "Short voice.", 16000)


@pytest.mark.parametrize("bad", [dict(seed=1.5), dict(seed=float("nan")), dict(seed="7"), dict(seed=True),
                                 dict(seed=-1), dict(seed=2 ** 70), dict(top_p="0.5"), dict(top_p=None),
                                 dict(top_k=True), dict(win_size=True), dict(tau_r=float("nan")),
                                 dict(tau_r=float("inf")), dict(tau_r=None), dict(greedy="no")])
def test_bad_sampling_options_raise_input_error_at_submit(tts, bad):
    name = next(iter(bad))
    with pytest.raises(InputError, match=name):
        tts.submit("Hello there.", force_tokens=5, **bad)


def test_good_seeds_still_work(tts):
    a = tts.synthesize("Hello there.", seed=np.int64(3), force_tokens=5)
    b = tts.synthesize("Hello there.", seed=3, force_tokens=5)
    np.testing.assert_array_equal(a, b)
    assert tts.synthesize("Hello there.", seed=2 ** 64 - 1, force_tokens=5).size


@pytest.mark.parametrize("field", ["text", "prompt_text", "instruct"])
def test_text_that_is_not_unicode_raises_input_error(tts, speaker, field):
    kw = dict(text="Hello there.", prompt_wav=default_voice_wav(16000, 1.0), prompt_sr=16000,
              prompt_text="Short voice.")
    kw[field] = "bad \ud800 surrogate"
    with pytest.raises(InputError, match="surrogate"):
        tts.submit(**kw, force_tokens=5).result(timeout=30)


@pytest.mark.parametrize("sr", [0, 0.0, float("nan"), 1.5, 16000.5, "x"])
def test_bad_prompt_sample_rate_is_refused(tts, sr):
    with pytest.raises(InputError, match="sample rate"):
        tts.synthesize("Hello there.", prompt_wav=default_voice_wav(16000, 1.0), prompt_sr=sr,
                       prompt_text="Short voice.", force_tokens=5)


def test_prompt_duration_checked_before_resampling(monkeypatch):
    """A wrong, tiny sample rate (1 Hz for 16 kHz samples: 16000 s of audio) is refused before soxr makes hundreds of
    millions of samples."""
    def no_resample(*a, **kw):
        raise AssertionError("resampled a prompt that is too long")

    monkeypatch.setattr(audio, "resample", no_resample)
    with pytest.raises(InputError, match="16000.00 s"):
        audio.load_wav(default_voice_wav(16000, 1.0), 16000, sr=1, max_seconds=30.0)


def test_prompt_arrays_edge_cases(tts):
    v = default_voice_wav(16000, 1.0)
    for empty in (np.zeros((0, 2), np.float32), np.zeros((2, 0), np.float32)):
        with pytest.raises(InputError, match="empty"):
            audio.load_wav(empty, 16000)
    bf16 = audio.load_wav(torch.from_numpy(v).bfloat16(), 16000)  # a torch dtype numpy lacks
    np.testing.assert_allclose(bf16, v, atol=1e-2)
    # float samples far past full scale (int16 values as floats; 3e38 overflowed the fbank into "mel energy is nan")
    for loud in (v * 32767.0, v * 3e38):
        with pytest.raises(InputError, match=r"\[-1, 1\].*peak"):
            audio.load_wav(loud.astype(np.float32), 16000)
    np.testing.assert_allclose(audio.load_wav(v * 1.5, 16000), v * 1.5, atol=1e-6)  # a little headroom is audio


def test_saved_speaker_with_non_finite_features_is_refused(tts, speaker):
    f = speaker.features
    for bad in (dict(mel=torch.full_like(f.mel, float("nan"))), dict(mel=torch.full_like(f.mel, float("inf"))),
                dict(embedding=torch.full_like(f.embedding, float("nan")))):
        spk = SavedSpeaker(dataclasses.replace(f, **bad), "Short voice.")
        with pytest.raises(InputError, match="NaN or Inf"):
            tts.synthesize("Hello there.", speaker=spk, force_tokens=5)
    spk = SavedSpeaker(dataclasses.replace(f, embedding=f.embedding.numpy()), "Short voice.")
    with pytest.raises(InputError, match="embedding"):
        tts.synthesize("Hello there.", speaker=spk, force_tokens=5)


def test_bad_speaker_objects_are_refused(tts, speaker):
    with pytest.raises(InputError, match="prompt_text"):
        tts.make_speaker(default_voice_wav(16000, 1.0), 5, 16000)
    with pytest.raises(InputError, match="prompt_text"):
        SavedSpeaker(speaker.features, None)
    with pytest.raises(InputError, match="speaker"):
        tts.submit("Hello there.", speaker={"voice": 1})


def test_a_row_failing_in_the_ar_sampling_fails_alone(tts, speaker, monkeypatch):
    """One request's sampling raising mid-decode (in the batch's draw, or in its own bookkeeping) fails that request
    alone; the rows batched with it keep exactly the tokens they get alone (no token booked twice, no uniform
    lost)."""
    specs = [dict(text=f"Good request number {i}.", seed=i, force_tokens=20 + 5 * i, speaker=speaker)
             for i in range(3)]
    alone = []
    for s in specs:
        h = tts.submit(**s)
        h.result(timeout=60)
        alone.append(h.tokens)
    real_accept, real_select = sampling.TokenPolicy.accept, sampling.select_packed

    def accept(self, tok):
        if self.params.seed == 777 and len(self.history) == 6:
            raise RuntimeError("injected accept failure")
        return real_accept(self, tok)

    def select(logits, packed):
        if logits.shape[0] > 1 and 778 in select.seeds():
            raise RuntimeError("injected batch draw failure")
        return real_select(logits, packed)

    live = []
    select.seeds = lambda: {r.req.sampling.seed for r in live}
    monkeypatch.setattr(sampling.TokenPolicy, "accept", accept)
    monkeypatch.setattr(sampling, "select_packed", select)
    sched = tts.scheduler
    for bad_seed in (777, 778):
        handles = [tts.submit(**s) for s in specs[:1]]
        handles.append(tts.submit("The failing one.", speaker=speaker, seed=bad_seed, force_tokens=40))
        handles += [tts.submit(**s) for s in specs[1:]]
        live[:] = [sched.requests.get(h) for h in handles]
        live[:] = [r for r in live if r is not None]
        outcome = []
        for h in handles:
            try:
                h.result(timeout=60)
                outcome.append(h.tokens)
            except RuntimeError as e:
                outcome.append(str(e))
        if bad_seed == 777:
            assert outcome[1] == "injected accept failure"
        good = outcome[:1] + outcome[2:]
        assert good == alone, bad_seed
    assert sched.stats()["in_flight"] == 0


def test_stream_checks_its_options_at_the_call(tts):
    """`tts.stream(...)` / `tts.astream(...)` raise a bad option's InputError where they are called (they were
    generators: the error came at the first `next()`, away from the call that caused it); a stream made and never
    iterated submits nothing."""
    import asyncio

    with pytest.raises(InputError, match="speed"):
        tts.stream("Hello there.", speed=-1)
    with pytest.raises(InputError, match="seed"):
        tts.astream("Hello there.", seed=-1)
    def seen():
        s = tts.scheduler.stats()
        return sum(s[k] for k in ("in_flight", "completed", "failed", "cancelled", "rejected"))
    before = seen()
    unused = tts.stream("Hello there.", seed=1, force_tokens=5)
    assert seen() == before
    del unused
    ref = tts.synthesize("Hello there.", seed=1, force_tokens=5)
    np.testing.assert_allclose(np.concatenate(list(tts.stream("Hello there.", seed=1, force_tokens=5))), ref,
                               atol=1e-4)

    async def collect():
        return [c async for c in tts.astream("Hello there.", seed=1, force_tokens=5)]
    assert np.concatenate(asyncio.run(collect())).size == ref.size


def test_prompt_text_without_prompt_audio_is_refused(tts, speaker):
    """A transcript or sample rate with no prompt audio was silently ignored (a caller may expect `prompt_text` to
    replace a saved speaker's transcript): refused, naming the field."""
    with pytest.raises(InputError, match="prompt_text.*saved speaker"):
        tts.submit("Hello there.", speaker=speaker, prompt_text="Another transcript.", force_tokens=5)
    with pytest.raises(InputError, match="prompt_sr"):
        tts.submit("Hello there.", prompt_sr=16000, force_tokens=5)
    assert tts.synthesize("Hello there.", speaker=speaker, prompt_text="", force_tokens=5).size  # empty: nothing given


def test_save_speaker_write_errors_are_input_errors(tts, speaker, tmp_path):
    """A missing folder or a folder as the target raised safetensors' own error from deep inside."""
    from cosytrt.runtime.models.frontend import save_speaker

    for bad in (str(tmp_path / "missing" / "spk.safetensors"), str(tmp_path)):
        with pytest.raises(InputError, match="cannot write speaker file"):
            save_speaker(bad, speaker.features, speaker.prompt_text)
    ok = str(tmp_path / "spk.safetensors")
    save_speaker(ok, speaker.features, speaker.prompt_text)
    from cosytrt.runtime.models.frontend import load_speaker
    assert load_speaker(ok).prompt_text == speaker.prompt_text
