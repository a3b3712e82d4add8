"""Model sources: the tiny default, a golden directory, a real model directory (released layout, tiny sizes)."""
import json
import os
import shutil

import pytest
import torch

from cosytrt.runtime.models.config import config_from_model_dir, full_config
from cosytrt.engines.errors import CheckpointError, ConfigError, ModelDirError
from cosytrt.runtime.models.loading import build_modules, load_models, random_checkpoints

HERE = os.path.dirname(os.path.abspath(__file__))
YAML = os.path.join(HERE, "data", "model_dir", "cosyvoice3.yaml")


def test_full_size_meta_keys_match_released_checkpoints(golden_dir):
    with open(os.path.join(golden_dir, "full_size_state_dict_keys.json")) as f:
        want = json.load(f)
    llm, flow, hift = build_modules(full_config(), device="meta")
    for name, m in (("llm", llm), ("flow", flow), ("hift", hift)):
        got = {k: list(v) for k, v in m.checkpoint_shapes().items()}
        assert got == want[name], name


def test_tiny_is_created_once_and_deterministic():
    a = load_models("tiny")
    b = load_models("tiny")
    assert a.weights_hash == b.weights_hash and a.kind == "tiny"
    for (ka, va), (kb, vb) in zip(a.flow.state_dict().items(), b.flow.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)
    assert os.path.isfile(os.path.join(a.model_dir, "campplus.onnx"))


def test_golden_dir_loads(golden_dir):
    m = load_models(golden_dir)
    assert m.kind == "golden" and m.config.flow.dit.dim == 128


def test_missing_sources_are_named(tmp_path):
    with pytest.raises(ModelDirError, match="not found"):
        load_models(str(tmp_path / "nope"))
    with pytest.raises(ModelDirError, match="neither"):
        load_models(str(tmp_path))
    (tmp_path / "cosyvoice3.yaml").write_text("sample_rate: 24000\n")
    with pytest.raises(ModelDirError, match="llm.pt"):
        load_models(str(tmp_path))


def test_bad_checkpoint_key_is_named(tmp_path, golden_dir):
    for f in ("config.json", "flow.pt", "hift.pt"):
        shutil.copy(os.path.join(golden_dir, f), tmp_path / f)
    sd = torch.load(os.path.join(golden_dir, "llm.pt"), weights_only=True)
    sd.pop("llm_decoder.weight")
    torch.save(sd, tmp_path / "llm.pt")
    with pytest.raises(CheckpointError, match="llm_decoder.weight"):
        load_models(str(tmp_path))


# ------------------------------------------------------------------ a real model directory (released layout)

def _blank_en(d, vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[], show_progress=False)
    tok.train_from_iterator(["You are a helpful assistant.", "Hello there, how are you today?"] * 4, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok)
    hf.add_special_tokens({"eos_token": "<|endoftext|>", "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    hf.save_pretrained(str(d))
    q = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 128, "vocab_size": vocab_size, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
         "max_position_embeddings": 4096, "tie_word_embeddings": True, "architectures": ["Qwen2ForCausalLM"]}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(q, f)


@pytest.fixture(scope="module")
def real_dir(tmp_path_factory):
    from cosytrt.runtime.models.tiny_frontends import write_tiny_frontends

    d = tmp_path_factory.mktemp("Fun-CosyVoice3-tiny")
    shutil.copy(YAML, d / "cosyvoice3.yaml")
    os.makedirs(d / "CosyVoice-BlankEN")
    _blank_en(d / "CosyVoice-BlankEN", vocab_size=1024)
    cfg = config_from_model_dir(str(d))
    for name, sd in random_checkpoints(cfg, seed=7).items():
        torch.save(sd, d / name)
    write_tiny_frontends(str(d))
    return str(d)


def test_yaml_is_read_without_executing_it(real_dir):
    cfg = config_from_model_dir(real_dir)
    assert cfg.flow.dit.dim == 128 and cfg.flow.dit.static_chunk_size == 50 and cfg.flow.pre_channels == 128
    assert cfg.hift.base_channels == 64 and cfg.hift.f0_cond_channels == 64 and cfg.llm.qwen.vocab_size == 1024
    assert cfg.llm.top_k == 25 and cfg.flow.inference_cfg_rate == 0.7


def test_full_yaml_numbers():
    """The released yaml's numbers (dim 1024, depth 22, base 512) give the full config."""
    text = open(YAML).read()
    for a, b in (("channels: 128", "channels: 1024"), ("dim: 128", "dim: 1024"), ("depth: 2", "depth: 22"),
                 ("heads: 4", "heads: 16"), ("dim_head: 32", "dim_head: 64"), ("base_channels: 64", "base_channels: 512"),
                 ("cond_channels: 64", "cond_channels: 512"), ("llm_input_size: 64", "llm_input_size: 896"),
                 ("llm_output_size: 64", "llm_output_size: 896")):
        text = text.replace(a, b)
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        open(os.path.join(d, "cosyvoice3.yaml"), "w").write(text)
        os.makedirs(os.path.join(d, "CosyVoice-BlankEN"))
        q = {k: getattr(full_config().llm.qwen, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                           "num_key_value_heads", "intermediate_size", "vocab_size")}
        json.dump(q, open(os.path.join(d, "CosyVoice-BlankEN", "config.json"), "w"))
        cfg = config_from_model_dir(d)
    full = full_config()
    assert cfg.flow == full.flow and cfg.hift == full.hift and cfg.llm.qwen.hidden_size == 896


@pytest.mark.parametrize("edit, field", [
    ("solver: 'euler'", "solver: 'midpoint'"),
    ("speech_token_size: 6561", "speech_token_size: 4096"),
    ("num_decoding_left_chunks: -1\n\nllm", "num_decoding_left_chunks: 2\n\nllm"),
    ("upsample_rates: [8, 5, 3]", "upsample_rates: [8, 5, 2]"),
])
def test_unsupported_yaml_values_name_the_field(real_dir, tmp_path, edit, field):
    text = open(YAML).read()
    assert edit in text
    (tmp_path / "cosyvoice3.yaml").write_text(text.replace(edit, field))
    shutil.copytree(os.path.join(real_dir, "CosyVoice-BlankEN"), tmp_path / "CosyVoice-BlankEN")
    with pytest.raises(ConfigError) as e:
        config_from_model_dir(str(tmp_path))
    key = field.split(":")[0].strip()
    assert key.split("\n")[-1] in str(e.value) or "upsample" in str(e.value)


def test_real_model_dir_synthesizes(real_dir):
    from cosytrt.runtime.stages.request import default_voice_wav
    from cosytrt.runtime.tts import TTS

    tts = TTS.load(real_dir)
    assert tts.pipeline.models.kind == "real" and tts.pipeline.default_speaker is None
    wav = tts.synthesize("Hello there.", prompt_wav=default_voice_wav(16000, 2.0), prompt_sr=16000,
                         prompt_text="How are you today?", seed=3, force_tokens=30)
    assert wav.dtype.name == "float32" and wav.size == 30 * 960
    tts.close()


def test_real_model_dir_missing_file_is_named(real_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(real_dir, d)
    os.remove(d / "campplus.onnx")
    with pytest.raises(ModelDirError, match="campplus.onnx"):
        load_models(str(d))
