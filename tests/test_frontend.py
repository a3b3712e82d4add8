"""runtime/frontend.py, runtime/text.py and runtime/tiny_frontends.py on the tiny ONNX frontends."""
import json
import os

import numpy as np
import onnx
import pytest
import soundfile as sf
import torch

from cosytrt.runtime.models import audio
from cosytrt.runtime.models.config import ENDOFPROMPT_TEXT_ID, SPEECH_TOKEN_SIZE
from cosytrt.engines.errors import ConfigError, InputError, ModelDirError
from cosytrt.runtime.models.frontend import (Frontend, LMRequestInputs, PromptFeatures, SavedSpeaker, load_speaker,
                                      save_speaker)
from cosytrt.runtime.models.text import COSYVOICE3_SPECIAL_TOKENS, ENDOFPROMPT, ByteTokenizer, QwenTokenizer
from cosytrt.runtime.models.tiny_frontends import tiny_speech_tokenizer, write_tiny_frontends

PREFIX = "You are a helpful assistant.<|endofprompt|>"


def voice(seconds: float, sr: int, f0: float = 150.0, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = int(round(seconds * sr))
    t = np.arange(n) / sr
    phase = 2 * np.pi * np.cumsum(f0 + 25 * np.sin(2 * np.pi * 1.7 * t)) / sr
    x = sum(np.sin(k * phase) / k for k in range(1, 10)) * (0.6 + 0.4 * np.sin(2 * np.pi * 3.0 * t))
    return (0.2 * x + 0.005 * rng.standard_normal(n)).astype(np.float32)


@pytest.fixture(scope="module")
def onnx_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_frontends")
    write_tiny_frontends(str(d))
    return d


@pytest.fixture(scope="module")
def fe(onnx_dir):
    return Frontend(ByteTokenizer(512), str(onnx_dir / "speech_tokenizer_v3.onnx"), str(onnx_dir / "campplus.onnx"),
                    providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def prompt_wav_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("wav") / "prompt44k.wav"
    sf.write(path, voice(2.0, 44100), 44100, subtype="FLOAT")
    return str(path)


# ---------------------------------------------------------------------------------------------- tiny ONNX

def test_tiny_frontends_are_deterministic(tmp_path):
    a = write_tiny_frontends(str(tmp_path / "a"))
    b = write_tiny_frontends(str(tmp_path / "b"))
    for pa, pb in zip(a, b):
        assert open(pa, "rb").read() == open(pb, "rb").read()
    tok = onnx.load(a[0])
    assert [i.name for i in tok.graph.input] == ["feats", "feats_length"]
    assert onnx.load(a[1]).graph.input[0].name == "input"


@pytest.mark.parametrize("seconds", [1.5, 3.0])
def test_shapes_and_dtypes(fe, seconds):
    wav16k = voice(seconds, 16000)
    tokens = fe.speech_tokens(wav16k)
    n_tok = int(seconds * 100) // 4  # 100 fps log-mel, 4 frames per token -> 25 Hz
    assert tokens.dtype == np.int64 and tokens.shape == (n_tok,)
    assert tokens.min() >= 0 and tokens.max() < SPEECH_TOKEN_SIZE
    assert len(np.unique(tokens)) > 1
    emb = fe.speaker_embedding(wav16k)
    assert emb.dtype == np.float32 and emb.shape == (192,) and np.all(np.isfinite(emb))

    feats = fe.prompt_features(voice(seconds, 24000), 24000)
    assert feats.speech_tokens.dtype == torch.int64 and feats.speech_tokens.shape == (n_tok,)
    assert feats.mel.dtype == torch.float32 and feats.mel.shape == (2 * n_tok, 80)
    assert feats.embedding.dtype == torch.float32 and feats.embedding.shape == (192,)


def test_speaker_embedding_depends_on_voice(fe):
    a = fe.speaker_embedding(voice(2.0, 16000, f0=110.0, seed=1))
    b = fe.speaker_embedding(voice(2.0, 16000, f0=230.0, seed=2))
    assert np.abs(a - b).max() > 1e-3


def test_prompt_features_from_file_match_the_pieces(fe, prompt_wav_path):
    feats = fe.prompt_features(prompt_wav_path)
    wav16k = audio.load_wav(prompt_wav_path, 16000)
    wav24k = audio.load_wav(prompt_wav_path, 24000)
    tokens = fe.speech_tokens(wav16k)
    mel = audio.prompt_mel(wav24k)
    n = min(mel.shape[0] // 2, tokens.shape[0])
    assert n == 50
    assert torch.equal(feats.speech_tokens, torch.from_numpy(tokens[:n]))
    assert torch.equal(feats.mel, mel[:2 * n])
    assert torch.equal(feats.embedding, torch.from_numpy(fe.speaker_embedding(wav16k)))


@pytest.mark.parametrize("frames_per_token,expect_cut", [(2, "tokens"), (8, "mel")])
def test_token_mel_alignment_rule(tmp_path, onnx_dir, frames_per_token, expect_cut):
    """token_len = min(T_mel // 2, T_tok): mel cut to 2 * token_len frames, tokens to token_len."""
    path = tmp_path / "tok.onnx"
    onnx.save(tiny_speech_tokenizer(frames_per_token=frames_per_token), str(path))
    fe = Frontend(ByteTokenizer(), str(path), str(onnx_dir / "campplus.onnx"), providers=["CPUExecutionProvider"])
    wav24k = voice(2.02, 24000)  # 101 mel frames at 24 kHz
    wav16k = audio.load_wav(wav24k, 16000, sr=24000)
    raw_tokens = fe.speech_tokens(wav16k)
    raw_mel = audio.prompt_mel(wav24k)
    assert raw_mel.shape[0] == 101 and raw_tokens.shape[0] == 202 // frames_per_token
    feats = fe.prompt_features(wav24k, 24000)
    n = min(101 // 2, raw_tokens.shape[0])
    assert feats.speech_tokens.shape[0] == n and feats.mel.shape[0] == 2 * n
    if expect_cut == "tokens":  # 50 Hz tokens: 101 of them, 50 kept
        assert n == 50 and raw_tokens.shape[0] > n
    else:  # 12.5 Hz tokens: 25 of them, mel cut from 101 to 50 frames
        assert n == 25 and raw_mel.shape[0] > 2 * n
    assert torch.equal(feats.speech_tokens, torch.from_numpy(raw_tokens[:n]))
    assert torch.equal(feats.mel, raw_mel[:2 * n])


# ---------------------------------------------------------------------------------------------- modes

@pytest.fixture(scope="module")
def feats(fe):
    return fe.prompt_features(voice(1.5, 16000), 16000)


def ids(fe, text):
    return torch.tensor(fe.tokenizer.encode(text), dtype=torch.int64)


def test_zero_shot_text_ids(fe, feats):
    req = fe.zero_shot("Hello there.", "The transcript.", features=feats)
    assert isinstance(req, LMRequestInputs) and req.mode == "zero_shot"
    prompt = ids(fe, PREFIX + "The transcript.")
    target = ids(fe, "Hello there.")
    assert torch.equal(req.text_ids, torch.cat([prompt, target]))
    assert req.prompt_text_len == prompt.numel() and req.text_len == target.numel()
    eop = fe.tokenizer.endofprompt_id
    assert eop == 2 and (req.text_ids == eop).nonzero().flatten().tolist() == [len("You are a helpful assistant.")]
    assert torch.equal(req.prompt_speech_tokens, feats.speech_tokens)
    assert torch.equal(req.flow_prompt_tokens, feats.speech_tokens)
    assert torch.equal(req.flow_prompt_mel, feats.mel) and torch.equal(req.embedding, feats.embedding)
    # an upstream-style prompt that already carries <|endofprompt|> is used as given (no double prefix)
    again = fe.zero_shot("Hello there.", PREFIX + "The transcript.", features=feats)
    assert torch.equal(again.text_ids, req.text_ids)


def test_zero_shot_from_audio_equals_from_features(fe):
    wav = voice(1.5, 16000)
    a = fe.zero_shot("Hi.", "Prompt words.", wav, 16000)
    b = fe.zero_shot("Hi.", "Prompt words.", features=fe.prompt_features(wav, 16000))
    for field in ("text_ids", "prompt_speech_tokens", "flow_prompt_tokens", "flow_prompt_mel", "embedding"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field


def test_cross_lingual_text_ids(fe, feats):
    req = fe.cross_lingual("Bonjour tout le monde.", features=feats)
    assert req.mode == "cross_lingual"
    assert torch.equal(req.text_ids, ids(fe, PREFIX + "Bonjour tout le monde."))
    assert req.prompt_text_len == 0 and req.text_len == req.text_ids.numel()
    assert req.prompt_speech_tokens.numel() == 0 and req.prompt_speech_tokens.dtype == torch.int64
    assert torch.equal(req.flow_prompt_tokens, feats.speech_tokens) and torch.equal(req.flow_prompt_mel, feats.mel)


def test_instruct_text_ids(fe, feats):
    instruction = "You are a helpful assistant. Please speak slowly."
    req = fe.instruct("Good morning.", instruction, features=feats)
    assert req.mode == "instruct"
    prompt = ids(fe, instruction + ENDOFPROMPT)
    assert torch.equal(req.text_ids, torch.cat([prompt, ids(fe, "Good morning.")]))
    assert req.text_ids[prompt.numel() - 1] == fe.tokenizer.endofprompt_id
    assert req.prompt_text_len == prompt.numel() and req.text_len == len("Good morning.")
    assert req.prompt_speech_tokens.numel() == 0
    assert torch.equal(req.flow_prompt_tokens, feats.speech_tokens) and torch.equal(req.embedding, feats.embedding)
    same = fe.instruct("Good morning.", instruction + ENDOFPROMPT, features=feats)
    assert torch.equal(same.text_ids, req.text_ids)
    with pytest.raises(InputError, match="must end with"):
        fe.instruct("Good morning.", "A<|endofprompt|>B", features=feats)


def test_byte_tokenizer_roundtrip():
    tok = ByteTokenizer(512)
    text = "Héllo 世界 [breath] ok" + ENDOFPROMPT + "!"
    out = tok.encode(text)
    assert max(out) < 512 and tok.endofprompt_id in out and 259 + 2 in out  # [breath] after the byte ids
    assert tok.decode(out, skip_special_tokens=False) == text
    assert tok.decode(out) == "Héllo 世界  ok!"
    assert tok.encode("A") == [ord("A") + 3]
    with pytest.raises(ConfigError, match="vocab_size"):
        ByteTokenizer(100)


# ---------------------------------------------------------------------------------------------- saved speakers

def test_saved_speaker_roundtrip(fe, feats, tmp_path):
    path = str(tmp_path / "spk.safetensors")
    save_speaker(path, feats, "Le transcript, 世界.")
    spk = load_speaker(path)
    assert isinstance(spk, SavedSpeaker) and spk.prompt_text == "Le transcript, 世界."
    for field in ("speech_tokens", "mel", "embedding"):
        a, b = getattr(spk.features, field), getattr(feats, field)
        assert a.dtype == b.dtype and torch.equal(a, b), field
    direct = fe.zero_shot("Hi.", "Le transcript, 世界.", features=feats)
    for req in (fe.from_speaker("Hi.", path), fe.from_speaker("Hi.", spk)):
        for field in ("text_ids", "prompt_speech_tokens", "flow_prompt_tokens", "flow_prompt_mel", "embedding"):
            assert torch.equal(getattr(req, field), getattr(direct, field)), field
    with open(path, "rb") as f:  # plain safetensors: an 8-byte header length, then a JSON header
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert json.loads(header["__metadata__"]["cosytrt"])["prompt_text"] == "Le transcript, 世界."


def test_saved_speaker_without_transcript_is_cross_lingual(fe, feats, tmp_path):
    path = str(tmp_path / "voice_only.safetensors")
    save_speaker(path, feats, "")
    req = fe.from_speaker("Hi.", path)
    assert req.mode == "cross_lingual" and req.prompt_speech_tokens.numel() == 0


def test_bad_speaker_files(feats, tmp_path):
    from safetensors.torch import save_file
    with pytest.raises(InputError, match="nope.safetensors"):
        load_speaker(str(tmp_path / "nope.safetensors"))
    plain = str(tmp_path / "plain.safetensors")
    save_file({"x": torch.zeros(2)}, plain)
    with pytest.raises(InputError, match="not a cosytrt speaker"):
        load_speaker(plain)
    with pytest.raises(InputError, match="mel"):
        save_speaker(str(tmp_path / "bad.safetensors"),
                     PromptFeatures(feats.speech_tokens, feats.mel[:-1], feats.embedding), "x")


# ---------------------------------------------------------------------------------------------- errors

def test_empty_text_errors(fe, feats):
    for bad in ("", "   \n"):
        with pytest.raises(InputError, match="tts text is empty"):
            fe.zero_shot(bad, "Transcript.", features=feats)
        with pytest.raises(InputError, match="tts text is empty"):
            fe.cross_lingual(bad, features=feats)
        with pytest.raises(InputError, match="instruction is empty"):
            fe.instruct("Text.", bad, features=feats)
    with pytest.raises(InputError, match="prompt text"):
        fe.zero_shot("Text.", "", features=feats)


def test_prompt_audio_errors(fe, tmp_path):
    with pytest.raises(InputError, match="31.00 s"):
        fe.prompt_features(np.zeros(16000 * 31, np.float32) + 0.01, 16000)
    with pytest.raises(InputError, match="30 s"):
        fe.speech_tokens(np.zeros(16000 * 31, np.float32))
    with pytest.raises(InputError, match="empty"):
        fe.prompt_features(np.zeros(0, np.float32), 16000)
    with pytest.raises(InputError, match="sample rate"):
        fe.prompt_features(np.zeros(16000, np.float32))
    with pytest.raises(InputError, match="reference audio"):
        fe.zero_shot("Text.", "Transcript.")
    path = tmp_path / "empty.wav"
    sf.write(path, np.zeros(0, np.float32), 16000)
    with pytest.raises(InputError, match="empty.wav"):
        fe.zero_shot("Text.", "Transcript.", str(path))


def test_missing_onnx_errors(tmp_path, onnx_dir):
    with pytest.raises(ModelDirError, match="speech_tokenizer_v3.onnx"):
        Frontend(ByteTokenizer(), str(tmp_path / "speech_tokenizer_v3.onnx"), str(onnx_dir / "campplus.onnx"))
    with pytest.raises(ModelDirError, match="campplus.onnx"):
        Frontend(ByteTokenizer(), str(onnx_dir / "speech_tokenizer_v3.onnx"), str(tmp_path / "campplus.onnx"))
    bad = tmp_path / "campplus.onnx"
    bad.write_bytes(b"not an onnx file")
    with pytest.raises(ModelDirError, match="campplus.onnx"):
        Frontend(ByteTokenizer(), str(onnx_dir / "speech_tokenizer_v3.onnx"), str(bad))
    empty_dir = tmp_path / "model"
    empty_dir.mkdir()
    with pytest.raises(ModelDirError, match="lacks speech_tokenizer_v3.onnx, campplus.onnx"):
        Frontend.from_model_dir(str(empty_dir), tokenizer=ByteTokenizer())
    write_tiny_frontends(str(empty_dir))
    os.remove(empty_dir / "campplus.onnx")
    with pytest.raises(ModelDirError, match="lacks campplus.onnx"):
        Frontend.from_model_dir(str(empty_dir), tokenizer=ByteTokenizer())


# ---------------------------------------------------------------------------------------------- Qwen tokenizer

@pytest.fixture(scope="module")
def blank_en(tmp_path_factory):
    """A tiny byte-level BPE saved like CosyVoice-BlankEN: base vocab, then the three Qwen2 specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[], show_progress=False)
    tok.train_from_iterator(["You are a helpful assistant.", "Hello there, how are you today?",
                             "The quick brown fox jumps over the lazy dog."] * 4, trainer)
    base = tok.get_vocab_size()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok)
    hf.add_special_tokens({"eos_token": "<|endoftext|>",
                           "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    d = tmp_path_factory.mktemp("model") / "CosyVoice-BlankEN"
    hf.save_pretrained(str(d))
    return str(d), base


def test_qwen_tokenizer_special_tokens(blank_en):
    path, base = blank_en
    # Qwen2 layout: <|endoftext|> = base, <|im_start|> = base+1, <|im_end|> = base+2, then the CosyVoice3 list
    tok = QwenTokenizer(path, expected_endofprompt_id=base + 3)
    assert tok.endofprompt_id == base + 3
    assert len(tok) == base + 3 + len(COSYVOICE3_SPECIAL_TOKENS) - 2
    out = tok.encode(PREFIX + "Hello [breath] there.")
    assert out.count(base + 3) == 1 and (base + 4) in out  # [breath] follows <|endofprompt|>
    assert tok.decode(out) == "You are a helpful assistant.Hello  there."
    assert tok.decode(out, skip_special_tokens=False) == PREFIX + "Hello [breath] there."
    assert tok.encode("[ǜ]") == [base + 3 + len(COSYVOICE3_SPECIAL_TOKENS) - 3]


def test_qwen_tokenizer_checks_endofprompt_id(blank_en, tmp_path):
    path, _ = blank_en
    with pytest.raises(ConfigError, match=str(ENDOFPROMPT_TEXT_ID)):
        QwenTokenizer(path)
    with pytest.raises(ModelDirError, match="CosyVoice-BlankEN"):
        QwenTokenizer(str(tmp_path / "CosyVoice-BlankEN"))


def test_frontend_from_model_dir(blank_en, tmp_path):
    path, base = blank_en
    model_dir = os.path.dirname(path)
    write_tiny_frontends(model_dir)
    with pytest.raises(ConfigError, match="endofprompt"):  # tiny vocabulary is not the released one
        Frontend.from_model_dir(model_dir)
    fe = Frontend.from_model_dir(model_dir, tokenizer=QwenTokenizer(path, expected_endofprompt_id=base + 3),
                                 providers=["CPUExecutionProvider"])
    req = fe.zero_shot("Hello there.", "How are you today?", voice(1.5, 16000), 16000)
    assert req.text_ids[:req.prompt_text_len].tolist().count(base + 3) == 1


@pytest.mark.skipif(not os.environ.get("COSYTRT_MODEL_DIR"), reason="set COSYTRT_MODEL_DIR to a real model dir")
def test_real_qwen_tokenizer():
    tok = QwenTokenizer(os.path.join(os.environ["COSYTRT_MODEL_DIR"], "CosyVoice-BlankEN"))
    assert tok.endofprompt_id == ENDOFPROMPT_TEXT_ID
    assert tok.encode(ENDOFPROMPT) == [ENDOFPROMPT_TEXT_ID]
