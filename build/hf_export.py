"""Export CosyVoice3LM as a merged-vocab HF `Qwen2ForCausalLM` checkpoint (for TensorRT-LLM, vLLM, HF).

Merged vocab layout (`V_text` = text vocab, default the Qwen config's `vocab_size`, 151936 for the release):
- ids [0, V_text): text tokens (embed_tokens rows copied);
- ids [V_text, V_text + 6761): speech tokens 0..6760 (embed rows = `speech_embedding`), i.e. merged id = V_text + speech id;
  sos = V_text + 6561, eos = V_text + 6562, task_id = V_text + 6563, fill = V_text + 6564;
- padding rows up to a multiple of 128 (zero).
`lm_head` is untied: speech rows = `llm_decoder`, every other row (text and padding) is ZERO. Qwen2 has no lm_head
bias, so those rows give logit 0 rather than -inf: a consumer must sample only from the speech rows
(`speech_token_offset` .. `+6761` in `cosytrt_metadata.json`), as the cosytrt runtime does; stock TRT-LLM/HF
sampling needs a logits processor / bad-words list for the text ids to be strictly safe.
The prompt can be given as `input_ids` in the merged vocab (`merged_prompt_ids`), so no prompt embeddings are needed.
No tokenizer is written. The layout and the id mapping both ways are `runtime.models.merged_vocab.MergedVocab`
(also what the TensorRT-LLM AR runner reads back from `cosytrt_metadata.json`).
"""
from __future__ import annotations

import json
import os

import torch

from cosytrt.engines.dtypes import DTYPE_NAMES as _DTYPE_NAMES
from cosytrt.engines.errors import InputError, ModelDirError
from cosytrt.runtime.models.config import EOS, NUM_SPECIAL, SOS, SPEECH_TOKEN_SIZE, TASK_ID
from cosytrt.runtime.models.merged_vocab import METADATA_FILE, MergedVocab, padded_vocab_size  # noqa: F401

SPEECH_VOCAB = SPEECH_TOKEN_SIZE + NUM_SPECIAL  # 6761


def _layout(text_vocab_size: int) -> MergedVocab:
    """The released model's layout with the speech ids at `text_vocab_size` (the helpers below take only that)."""
    off = int(text_vocab_size)
    return MergedVocab(off, off, SPEECH_VOCAB, padded_vocab_size(off, SPEECH_VOCAB), off + SOS, off + EOS,
                       off + TASK_ID)


def speech_token_to_merged_id(token, text_vocab_size: int):
    """Speech id (0..6760; int or tensor) -> merged-vocab id."""
    return _layout(text_vocab_size).to_merged(token)


def merged_id_to_speech_token(merged_id, text_vocab_size: int):
    """Merged-vocab id (int or tensor) -> speech id (0..6760)."""
    return _layout(text_vocab_size).to_speech(merged_id)


def merged_prompt_ids(text_ids, prompt_speech_ids, text_vocab_size: int) -> torch.Tensor:
    """The LM prompt [sos, text..., task_id, prompt_speech...] as merged-vocab input ids [L] (long)."""
    return _layout(text_vocab_size).prompt_ids(text_ids, prompt_speech_ids)


def _hf_config(q, vocab: int, ids: dict, dtype_name: str) -> dict:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": q.hidden_size,
        "intermediate_size": q.intermediate_size,
        "num_hidden_layers": q.num_hidden_layers,
        "num_attention_heads": q.num_attention_heads,
        "num_key_value_heads": q.num_key_value_heads,
        "hidden_act": "silu",
        "max_position_embeddings": q.max_position_embeddings,
        "rms_norm_eps": q.rms_norm_eps,
        "rope_theta": q.rope_theta,
        "rope_scaling": None,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "sliding_window": q.max_position_embeddings,
        "max_window_layers": q.num_hidden_layers,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": ids["sos_id"],
        "eos_token_id": ids["eos_id"],
        "pad_token_id": ids["eos_id"],
        "torch_dtype": dtype_name,
    }


def export_merged_hf(lm, out_dir: str, dtype: torch.dtype = torch.float32, text_vocab: int | None = None) -> dict:
    """Write config.json, model.safetensors, generation_config.json and cosytrt_metadata.json; return the metadata.

    `text_vocab` (default: the Qwen `vocab_size`) is where the speech rows start; a smaller value (e.g. the
    tokenizer length, as upstream's converter uses) overwrites the unused text rows above it."""
    from safetensors.torch import save_file

    if dtype not in _DTYPE_NAMES:
        raise InputError(f"export_merged_hf: unsupported dtype {dtype} (float32, float16 or bfloat16)")
    q = lm.config.qwen
    try:
        layout = MergedVocab.for_lm(lm.config, text_vocab)
    except InputError as e:
        raise InputError(f"export_merged_hf: {e}") from None
    text_vocab, off, n_speech, vocab = (layout.text_vocab_size, layout.speech_token_offset, layout.speech_vocab_size,
                                        layout.padded_vocab_size)
    tok = lm.config.speech_token_size
    ids = {"sos_id": layout.sos_id, "eos_id": layout.eos_id, "task_id": layout.task_id,
           "fill_id": off + lm.config.fill_token}

    sd = {k: v.detach().float().cpu() for k, v in lm.state_dict().items()}
    prefix = "llm.model.model."
    h = q.hidden_size
    embed = torch.zeros(vocab, h)
    embed[:text_vocab] = sd[prefix + "embed_tokens.weight"][:text_vocab]
    embed[off:off + n_speech] = sd["speech_embedding.weight"]
    lm_head = torch.zeros(vocab, h)
    lm_head[off:off + n_speech] = sd["llm_decoder.weight"]

    tensors = {"model.embed_tokens.weight": embed, "lm_head.weight": lm_head}
    for k, v in sd.items():
        if k.startswith(prefix) and k != prefix + "embed_tokens.weight":
            tensors["model." + k[len(prefix):]] = v
    tensors = {k: v.to(dtype).contiguous().clone() for k, v in tensors.items()}

    os.makedirs(out_dir, exist_ok=True)
    dtype_name = _DTYPE_NAMES[dtype]
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(_hf_config(q, vocab, ids, dtype_name), f, indent=2)
    gen = {"bos_token_id": ids["sos_id"], "eos_token_id": ids["eos_id"], "pad_token_id": ids["eos_id"],
           "do_sample": True, "temperature": 1.0, "top_p": lm.config.top_p, "top_k": lm.config.top_k}
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
    meta = {
        "format": "cosytrt-merged-qwen2",
        **layout.metadata(),
        "speech_token_size": tok,
        **ids,
        "stop_token_ids": list(range(off + tok, off + n_speech)),
        "lm_head_non_speech_rows": "zero",
        "hidden_size": h,
        "dtype": dtype_name,
    }
    with open(os.path.join(out_dir, METADATA_FILE), "w") as f:
        json.dump(meta, f, indent=2)
    return meta


def read_metadata(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, METADATA_FILE)
    if not os.path.isfile(path):
        raise ModelDirError(f"{hf_dir}: not a cosytrt merged HF export (no {METADATA_FILE})")
    with open(path) as f:
        return json.load(f)
