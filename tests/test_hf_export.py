"""Merged-vocab HF Qwen2 export (loaded back with transformers) and the TensorRT-LLM command lines."""
import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file

from cosytrt.build import trtllm
from cosytrt.build.hf_export import (export_merged_hf, merged_id_to_speech_token, merged_prompt_ids,
                                     padded_vocab_size, read_metadata, speech_token_to_merged_id)
from cosytrt.build.trtllm import build_trtllm_engine, trtllm_commands
from cosytrt.engines.errors import BackendUnavailableError, InputError, ModelDirError

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "golden")
TOL = 1e-4


@pytest.fixture(scope="module")
def vectors(golden_vectors):
    return golden_vectors


@pytest.fixture(scope="module")
def lm(golden_lm):
    return golden_lm


@pytest.fixture(scope="module")
def exported(lm, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("hf"))
    return out, export_merged_hf(lm, out)


def test_metadata_and_files(exported, lm):
    out, meta = exported
    for name in ("config.json", "model.safetensors", "generation_config.json", "cosytrt_metadata.json"):
        assert os.path.isfile(os.path.join(out, name))
    assert meta == read_metadata(out)
    off = 512
    assert meta["text_vocab_size"] == meta["speech_token_offset"] == off
    assert meta["padded_vocab_size"] == 7296 == padded_vocab_size(512, 6761) and 7296 % 128 == 0
    assert (meta["sos_id"], meta["eos_id"], meta["task_id"], meta["fill_id"]) == (off + 6561, off + 6562,
                                                                                 off + 6563, off + 6564)
    assert meta["stop_token_ids"] == list(range(off + 6561, off + 6761))
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["vocab_size"] == 7296 and cfg["tie_word_embeddings"] is False and cfg["eos_token_id"] == off + 6562
    with open(os.path.join(out, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == off + 6562
    w = load_file(os.path.join(out, "model.safetensors"))
    assert torch.equal(w["model.embed_tokens.weight"][:off], lm.backbone.embed_tokens.weight)
    assert torch.equal(w["model.embed_tokens.weight"][off:off + 6761], lm.speech_embedding.weight)
    assert torch.equal(w["lm_head.weight"][off:off + 6761], lm.llm_decoder.weight)
    assert w["lm_head.weight"][:off].abs().max() == 0 and w["lm_head.weight"][off + 6761:].abs().max() == 0
    assert len(w) == 2 + 1 + 2 * 12            # embed, lm_head, norm, 12 tensors per layer


def test_transformers_loads_export_and_matches(exported, lm, vectors):
    transformers = pytest.importorskip("transformers")
    out, meta = exported
    off = meta["speech_token_offset"]
    hf = transformers.Qwen2ForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        ours = lm.logits(lm.forward_hidden(vectors["llm.lm_input"]))
        by_embeds = hf(inputs_embeds=vectors["llm.lm_input"]).logits
        ids = torch.cat([merged_prompt_ids(vectors["llm.text"], vectors["llm.prompt_speech"], off),
                         speech_token_to_merged_id(vectors["llm.target_speech"][0], off)])[None]
        by_ids = hf(input_ids=ids).logits
    assert by_embeds.shape[-1] == 7296
    assert (by_embeds[..., off:off + 6761] - ours).abs().max() <= TOL
    assert (by_ids[..., off:off + 6761] - ours).abs().max() <= TOL
    assert (by_ids[..., off:off + 6761] - vectors["llm.logits"]).abs().max() <= TOL
    assert by_ids[..., :off].abs().max() == 0            # zero text rows -> logit exactly 0


def test_id_helpers():
    assert speech_token_to_merged_id(0, 151936) == 151936
    assert speech_token_to_merged_id(6562, 151936) == 151936 + 6562
    assert merged_id_to_speech_token(151936 + 6760, 151936) == 6760
    t = torch.tensor([3, 6561])
    assert torch.equal(merged_id_to_speech_token(speech_token_to_merged_id(t, 100), 100), t)
    with pytest.raises(InputError):
        speech_token_to_merged_id(6761, 100)
    with pytest.raises(InputError):
        merged_id_to_speech_token(99, 100)
    ids = merged_prompt_ids([5, 6], [7], 100)
    assert ids.tolist() == [100 + 6561, 5, 6, 100 + 6563, 107]
    with pytest.raises(InputError):
        merged_prompt_ids([100], [], 100)


def test_text_vocab_override_and_bf16(lm, tmp_path):
    meta = export_merged_hf(lm, str(tmp_path), dtype=torch.bfloat16, text_vocab=500)
    assert meta["speech_token_offset"] == 500 and meta["padded_vocab_size"] == 7296 and meta["dtype"] == "bfloat16"
    w = load_file(os.path.join(tmp_path, "model.safetensors"))
    assert all(v.dtype == torch.bfloat16 for v in w.values())
    assert torch.equal(w["model.embed_tokens.weight"][500:500 + 6761], lm.speech_embedding.weight.bfloat16())
    with pytest.raises(InputError):
        export_merged_hf(lm, str(tmp_path), text_vocab=513)
    with pytest.raises(InputError):
        export_merged_hf(lm, str(tmp_path), dtype=torch.int8)
    with pytest.raises(ModelDirError):
        read_metadata(str(tmp_path / "nothing"))


# ---------------------------------------------------------------- TensorRT-LLM

def test_trtllm_command_lines():
    convert, build = trtllm_commands("/m/hf", "/m/ckpt", "/m/engine", python="python3")
    assert convert[:2] == ["python3", "-c"]
    assert convert[2] == ("from tensorrt_llm.models import QWenForCausalLM; "
                          "m = QWenForCausalLM.from_hugging_face('/m/hf', dtype='bfloat16'); "
                          "m.save_checkpoint('/m/ckpt', save_config=True)")
    compile(convert[2], "<convert>", "exec")
    assert build == ["trtllm-build", "--checkpoint_dir", "/m/ckpt", "--output_dir", "/m/engine",
                     "--max_batch_size", "64", "--max_num_tokens", "32768", "--max_input_len", "2048",
                     "--max_seq_len", "4096", "--gemm_plugin", "bfloat16",
                     # what the AR runner needs (runtime/stages/ar_trtllm.py)
                     "--gather_generation_logits", "--use_paged_context_fmha", "enable", "--tokens_per_block", "16"]
    _, b16 = trtllm_commands("a", "b", "c", dtype="float16", max_batch_size=16, max_num_tokens=8192,
                             max_input_len=1024, max_seq_len=3072, runner_flags=False)
    assert b16[b16.index("--max_batch_size") + 1] == "16" and b16[-1] == "float16"
    assert b16[b16.index("--max_input_len") + 1] == "1024" and b16[b16.index("--max_seq_len") + 1] == "3072"
    assert trtllm_commands("a", "b", "c")[0][0] == sys.executable


@pytest.mark.parametrize("kw", [dict(dtype="int8"), dict(max_batch_size=0), dict(max_input_len=4096),
                                dict(max_num_tokens="1")])
def test_trtllm_bad_options(kw):
    with pytest.raises(InputError):
        trtllm_commands("a", "b", "c", **kw)


def test_build_without_tensorrt_llm_raises(tmp_path, monkeypatch):
    monkeypatch.setattr(trtllm.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(BackendUnavailableError) as e:
        build_trtllm_engine(str(tmp_path), str(tmp_path / "ckpt"), str(tmp_path / "eng"))
    assert e.value.backend == "trtllm" and e.value.package == "tensorrt_llm"


def test_build_rejects_trtllm_without_engine_backend(tmp_path, monkeypatch):
    monkeypatch.setattr(trtllm.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr("importlib.metadata.version", lambda name: "1.3.0")
    with pytest.raises(BackendUnavailableError, match="1.3.0"):
        build_trtllm_engine(str(tmp_path), str(tmp_path / "ckpt"), str(tmp_path / "eng"))
