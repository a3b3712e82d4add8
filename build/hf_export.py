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
No tokenizer is written.
"""
from __future__ import annotations

import json
import os

import torch

from cosytrt.runtime.models.config import NUM_SPECIAL, SOS, SPEECH_TOKEN_SIZE, TASK_ID
from cosytrt.engines.errors import InputError, ModelDirError

METADATA_FILE = "cosytrt_metadata.json"
SPEECH_VOCAB = SPEECH_TOKEN_SIZE + NUM_SPECIAL  # 6761
from cosytrt.engines.dtypes import DTYPE_NAMES as _DTYPE_NAMES  # noqa: E402


def padded_vocab_size(text_vocab: int, speech_vocab: int, multiple: int = 128) -> int:
    n = text_vocab + speech_vocab
    return -(-n // multiple) * multiple


def speech_token_to_merged_id(token, text_vocab_size: int):
    """Speech id (0..6760; int or tensor) -> merged-vocab id."""
    if isinstance(token, int) and not (0 <= token < SPEECH_VOCAB):
        raise InputError(f"speech token {token} out of range [0, {SPEECH_VOCAB})")
    return token + text_vocab_size


def merged_id_to_speech_token(merged_id, text_vocab_size: int):
    """Merged-vocab id (int or tensor) -> speech id (0..6760)."""
    if isinstance(merged_id, int) and not (text_vocab_size <= merged_id < text_vocab_size + SPEECH_VOCAB):
        raise InputError(f"merged id {merged_id} is not a speech token (range [{text_vocab_size}, "
                         f"{text_vocab_size + SPEECH_VOCAB}))")
    return merged_id - text_vocab_size


def merged_prompt_ids(text_ids, prompt_speech_ids, text_vocab_size: int, sos: int = SOS,
                      task_id: int = TASK_ID) -> torch.Tensor:
    """The LM prompt [sos, text..., task_id, prompt_speech...] as merged-vocab input ids [L] (long)."""
    text = torch.as_tensor(text_ids, dtype=torch.long).reshape(-1)
    speech = torch.as_tensor(prompt_speech_ids if prompt_speech_ids is not None else [], dtype=torch.long).reshape(-1)
    if text.numel() and (int(text.min()) < 0 or int(text.max()) >= text_vocab_size):
        raise InputError(f"merged_prompt_ids: text id out of range [0, {text_vocab_size})")
    special = torch.tensor([sos, task_id], dtype=torch.long) + text_vocab_size
    return torch.cat([special[:1], text, special[1:], speech + text_vocab_size])


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
    n_speech = lm.config.speech_vocab
    text_vocab = q.vocab_size if text_vocab is None else text_vocab
    if not (0 < text_vocab <= q.vocab_size):
        raise InputError(f"export_merged_hf: text_vocab {text_vocab} must be in (0, {q.vocab_size}]")
    vocab = padded_vocab_size(text_vocab, n_speech)
    off = text_vocab
    tok = lm.config.speech_token_size
    ids = {"sos_id": off + lm.config.sos, "eos_id": off + lm.config.eos, "task_id": off + lm.config.task_id,
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
        "text_vocab_size": text_vocab,
        "speech_token_offset": off,
        "speech_token_size": tok,
        "speech_vocab_size": n_speech,
        "padded_vocab_size": vocab,
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
