"""runtime/compat: upstream CosyVoice3 call shapes over cosytrt's TTS (same audio for the same seed), spk2info.pt
import, model ids resolved like upstream (huggingface_hub.snapshot_download) and offline-safe."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import soundfile as sf
import torch

from cosytrt.runtime.compat.cosyvoice import (AutoModel, CosyVoice3, change_speed, load_spk2info,
                                              resolve_model_dir)
from cosytrt.engines.errors import InputError, ModelDirError
from cosytrt.runtime.stages.request import default_voice_wav

TEXT = "Hello from the adapter."
KW = {"force_tokens": 30}


@pytest.fixture(scope="module")
def prompt_path(tmp_path_factory):
    p = str(tmp_path_factory.mktemp("compat") / "prompt.wav")
    sf.write(p, default_voice_wav(16000, 2.0), 16000)
    return p


@pytest.fixture(scope="module")
def cv(tiny_tts):
    return CosyVoice3(tts=tiny_tts, seed=7)


def _one(gen) -> torch.Tensor:
    outs = list(gen)
    for o in outs:
        assert set(o) == {"tts_speech"} and o["tts_speech"].dim() == 2 and o["tts_speech"].shape[0] == 1
        assert o["tts_speech"].dtype == torch.float32
    return torch.cat([o["tts_speech"] for o in outs], dim=1)


def test_zero_shot_equals_tts_for_the_same_seed(cv, tiny_tts, prompt_path, monkeypatch):
    monkeypatch.setattr(type(cv.tts), "synthesize", _with_force(type(cv.tts).synthesize))
    got = _one(cv.inference_zero_shot(TEXT, "A transcript.", prompt_path))
    ref = tiny_tts.synthesize(TEXT, prompt_wav=prompt_path, prompt_text="A transcript.", seed=7, **KW)
    assert got.shape == (1, ref.size) and torch.equal(got[0], torch.from_numpy(ref))


def test_stream_yields_chunks_equal_to_tts_stream(cv, tiny_tts, prompt_path, monkeypatch):
    monkeypatch.setattr(type(cv.tts), "stream", _with_force(type(cv.tts).stream))
    outs = list(cv.inference_cross_lingual(TEXT, prompt_path, stream=True, seed=3))
    ref = list(tiny_tts.stream(TEXT, prompt_wav=prompt_path, seed=3, **KW))
    assert len(outs) == len(ref) > 1
    for o, r in zip(outs, ref):
        assert torch.equal(o["tts_speech"], torch.from_numpy(np.asarray(r)).reshape(1, -1))


def test_instruct2_and_16k_tensor_prompt_equal_tts(cv, tiny_tts, monkeypatch):
    monkeypatch.setattr(type(cv.tts), "synthesize", _with_force(type(cv.tts).synthesize))
    wav = default_voice_wav(16000, 2.0)
    instr = "You are a helpful assistant. Speak slowly.<|endofprompt|>"
    got = _one(cv.inference_instruct2(TEXT, instr, torch.from_numpy(wav).unsqueeze(0)))  # prompt_speech_16k [1, N]
    ref = tiny_tts.synthesize(TEXT, instruct=instr, prompt_wav=wav, prompt_sr=16000, seed=7, **KW)
    assert torch.equal(got[0], torch.from_numpy(ref))


def test_speed_stretches_non_stream_only(cv, prompt_path, monkeypatch):
    monkeypatch.setattr(type(cv.tts), "synthesize", _with_force(type(cv.tts).synthesize))
    normal = _one(cv.inference_cross_lingual(TEXT, prompt_path))
    fast = _one(cv.inference_cross_lingual(TEXT, prompt_path, speed=1.5))
    assert abs(fast.shape[1] - normal.shape[1] / 1.5) <= 1
    with pytest.raises(InputError, match="stream=False"):
        list(cv.inference_cross_lingual(TEXT, prompt_path, stream=True, speed=1.5))
    with pytest.raises(InputError, match="speed"):
        list(cv.inference_cross_lingual(TEXT, prompt_path, speed=5))


def test_change_speed_keeps_pitch():
    sr = 24000
    t = np.arange(sr) / sr
    tone = np.sin(2 * np.pi * 440 * t).astype(np.float32)
    out = change_speed(tone, 2.0)
    assert abs(out.size - sr / 2) <= 1
    spec = np.abs(np.fft.rfft(out[2048:-2048]))
    peak_hz = np.argmax(spec) * sr / (out.size - 4096)
    assert abs(peak_hz - 440) < 10


def test_saved_speakers_and_sft(cv, tiny_tts, prompt_path, monkeypatch):
    monkeypatch.setattr(type(cv.tts), "synthesize", _with_force(type(cv.tts).synthesize))
    assert cv.add_zero_shot_spk("A transcript.", prompt_path, "alice")
    assert "alice" in cv.list_available_spks()
    a = _one(cv.inference_zero_shot(TEXT, "", "", zero_shot_spk_id="alice"))
    b = _one(cv.inference_sft(TEXT, "alice"))
    ref = tiny_tts.synthesize(TEXT, speaker=cv.spk2info["alice"], seed=7, **KW)
    assert torch.equal(a[0], torch.from_numpy(ref)) and torch.equal(b[0], a[0])
    with pytest.raises(InputError, match="unknown speaker 'bob'"):
        list(cv.inference_sft(TEXT, "bob"))


def test_inference_vc_converts_the_source_tokens(cv, prompt_path):
    src = default_voice_wav(16000, 1.2)
    n_tokens = cv.tts.pipeline.frontend.speech_tokens(src).size
    out = _one(cv.inference_vc(src, prompt_path))
    assert out.shape[1] == n_tokens * 960 and torch.isfinite(out).all()
    chunks = list(cv.inference_vc(src, prompt_path, stream=True))
    assert sum(c["tts_speech"].shape[1] for c in chunks) == n_tokens * 960


def test_cosyvoice1_instruct_and_unknown_kwargs(cv, tiny_tts):
    with pytest.raises(NotImplementedError, match="inference_instruct2"):
        cv.inference_instruct(TEXT, "spk", "instr")
    with pytest.raises(TypeError, match="bogus"):
        CosyVoice3(tts=tiny_tts, bogus=1)
    CosyVoice3(tts=tiny_tts, load_trt=True, fp16=True, load_vllm=False)  # upstream flags accepted, ignored


def _upstream_entry(tts, prompt_text: str) -> dict:
    """An entry as upstream's add_zero_shot_spk stores it (batch dims, token ids for the transcript)."""
    f = tts.make_speaker(default_voice_wav(16000, 2.0), prompt_text, 16000).features
    n = f.speech_tokens.numel()
    ids = torch.tensor([tts.pipeline.frontend.tokenizer.encode(prompt_text)], dtype=torch.int32)
    return {"prompt_text": ids, "prompt_text_len": torch.tensor([ids.shape[1]]),
            "llm_prompt_speech_token": f.speech_tokens[None].int(), "llm_prompt_speech_token_len": torch.tensor([n]),
            "flow_prompt_speech_token": f.speech_tokens[None].int(), "flow_prompt_speech_token_len": torch.tensor([n]),
            "prompt_speech_feat": f.mel[None], "prompt_speech_feat_len": torch.tensor([2 * n]),
            "llm_embedding": f.embedding[None], "flow_embedding": f.embedding[None]}


def test_spk2info_in_a_local_snapshot_folder(tiny_tts, tmp_path):
    from cosytrt.runtime.models.loading import ensure_tiny_dir

    snap = tmp_path / "snapshot"
    shutil.copytree(ensure_tiny_dir(), snap)
    table = {"carol": _upstream_entry(tiny_tts, "Carol speaking."), "sft_only": {"embedding": torch.zeros(1, 192)}}
    torch.save(table, snap / "spk2info.pt")
    with pytest.warns(UserWarning, match="sft_only"):
        cv = AutoModel(model_dir=str(snap), device="cpu")
    try:
        assert cv.list_available_spks() == ["carol"]
        spk = cv.spk2info["carol"]
        assert spk.prompt_text == "Carol speaking."
        assert spk.features.mel.shape == (2 * spk.features.speech_tokens.numel(), 80)
        out = _one(cv.inference_sft(TEXT, "carol", seed=1))
        assert out.shape[1] > 0
    finally:
        cv.close()
    with pytest.warns(UserWarning, match="sft_only"):
        voices = load_spk2info(str(snap / "spk2info.pt"), None)
    assert set(voices) == {"carol"} and voices["carol"].prompt_text == ""  # no tokenizer: the voice only


def test_model_id_offline_without_cache_is_a_clear_error(tmp_path, monkeypatch):
    pytest.importorskip("huggingface_hub")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    with pytest.raises(ModelDirError, match="not in the Hugging Face cache and HF_HUB_OFFLINE is set"):
        resolve_model_dir("FunAudioLLM/Fun-CosyVoice3-0.5B-2512")


def test_model_id_found_in_the_cache_offline(tmp_path, monkeypatch):
    hub = pytest.importorskip("huggingface_hub")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    calls = []

    def fake(repo_id, local_files_only=False, **kw):
        calls.append((repo_id, local_files_only))
        return str(tmp_path)

    monkeypatch.setattr(hub, "snapshot_download", fake)
    assert resolve_model_dir("org/model") == str(tmp_path)
    assert calls == [("org/model", True)]  # the cache only: no network request


def test_not_a_folder_nor_an_id(tmp_path):
    with pytest.raises(ModelDirError, match="not found"):
        resolve_model_dir(str(tmp_path / "nope" / "deeper"))
    assert resolve_model_dir(str(tmp_path)) == str(tmp_path)


def _with_force(fn):
    """Wrap TTS.synthesize / TTS.stream so the adapter's calls generate exactly KW's token count (a test speed-up
    that the adapter passes through unchanged: it is what the reference call uses too)."""
    def wrapped(self, text, **kw):
        kw.setdefault("force_tokens", KW["force_tokens"])
        return fn(self, text, **kw)
    return wrapped
