"""The merged vocabulary of the LM exported for TensorRT-LLM / HF (`build/hf_export.py`), and the id mapping between
it and cosytrt's own ids. One place, used by the exporter (build/) and by the TensorRT-LLM AR runner
(runtime/stages/ar_trtllm.py).

cosytrt's LM has two embedding tables: text ids index `embed_tokens` (Qwen2's vocab) and speech ids (0 .. 6760:
6561 FSQ tokens, then sos, eos, task_id, fill and the other specials) index `speech_embedding`; its head
(`llm_decoder`) scores speech ids only. A TensorRT-LLM checkpoint has ONE vocab for the input embedding and the
head, so the export stacks them:

    merged id = text id                          for text tokens      [0, text_vocab)
    merged id = speech_token_offset + speech id  for speech ids       [offset, offset + speech_vocab)
    (rows up to `padded_vocab_size`, a multiple of 128, are zero)

so that, for a runner that takes ids:
- input: the prompt [sos, text..., task_id, prompt speech...] is `prompt_ids(text_ids, prompt_speech_ids)`, one id
  per position of `CosyVoice3LM.build_lm_input` (the same length: the scheduler's KV positions line up), and a fed
  speech token `t` (what the sampler drew) is `to_merged(t)`;
- output: the engine's logits have `padded_vocab_size` columns; `speech_logits` takes the speech columns, so column
  i of the result is speech id i: what cosytrt's sampler (RAS) and the torch runner's logits index.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from ...engines.errors import EngineSetError, InputError

METADATA_FILE = "cosytrt_metadata.json"  # written beside the HF checkpoint by build/hf_export.py
PAD_MULTIPLE = 128


def padded_vocab_size(text_vocab: int, speech_vocab: int, multiple: int = PAD_MULTIPLE) -> int:
    n = text_vocab + speech_vocab
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class MergedVocab:
    """The merged-vocab layout (the `cosytrt_metadata.json` fields) and the id mapping both ways."""

    text_vocab_size: int
    speech_token_offset: int
    speech_vocab_size: int       # speech ids the head scores (6761: 6561 tokens + 200 specials)
    padded_vocab_size: int
    sos_id: int                  # merged ids of the specials
    eos_id: int
    task_id: int

    @staticmethod
    def for_lm(llm_config, text_vocab: int | None = None) -> "MergedVocab":
        """The layout an export of a model with this `LLMConfig` gets (`text_vocab`: where the speech ids start;
        default the Qwen vocab size)."""
        q = llm_config.qwen
        text_vocab = q.vocab_size if text_vocab is None else int(text_vocab)
        if not 0 < text_vocab <= q.vocab_size:
            raise InputError(f"text_vocab {text_vocab} must be in (0, {q.vocab_size}]")
        n = llm_config.speech_vocab
        return MergedVocab(text_vocab, text_vocab, n, padded_vocab_size(text_vocab, n), text_vocab + llm_config.sos,
                           text_vocab + llm_config.eos, text_vocab + llm_config.task_id)

    @staticmethod
    def from_metadata(meta: dict) -> "MergedVocab":
        try:
            v = MergedVocab(text_vocab_size=int(meta["text_vocab_size"]),
                            speech_token_offset=int(meta["speech_token_offset"]),
                            speech_vocab_size=int(meta["speech_vocab_size"]),
                            padded_vocab_size=int(meta["padded_vocab_size"]), sos_id=int(meta["sos_id"]),
                            eos_id=int(meta["eos_id"]), task_id=int(meta["task_id"]))
        except KeyError as e:
            raise EngineSetError(f"merged-vocab metadata lacks {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise EngineSetError(f"merged-vocab metadata: {e}") from None
        if v.speech_token_offset < v.text_vocab_size or v.speech_end > v.padded_vocab_size:
            raise EngineSetError(f"merged-vocab metadata: speech ids [{v.speech_token_offset}, {v.speech_end}) must "
                                 f"lie above the text ids [0, {v.text_vocab_size}) and inside the padded vocab "
                                 f"{v.padded_vocab_size}")
        return v

    @staticmethod
    def load(hf_dir: str) -> "MergedVocab":
        path = os.path.join(hf_dir, METADATA_FILE)
        if not os.path.isfile(path):
            raise EngineSetError(f"{hf_dir}: no {METADATA_FILE} (export the LM with build.hf_export first)")
        with open(path) as f:
            return MergedVocab.from_metadata(json.load(f))

    def metadata(self) -> dict:
        """The layout fields of `cosytrt_metadata.json`."""
        return {"text_vocab_size": self.text_vocab_size, "speech_token_offset": self.speech_token_offset,
                "speech_vocab_size": self.speech_vocab_size, "padded_vocab_size": self.padded_vocab_size,
                "sos_id": self.sos_id, "eos_id": self.eos_id, "task_id": self.task_id}

    @property
    def speech_end(self) -> int:
        return self.speech_token_offset + self.speech_vocab_size

    # ---------------------------------------------------------------- input ids
    def to_merged(self, speech_ids):
        """Speech id(s) (0 .. speech_vocab-1, int or tensor) -> merged id(s)."""
        if isinstance(speech_ids, torch.Tensor):
            if speech_ids.numel() and (int(speech_ids.min()) < 0 or int(speech_ids.max()) >= self.speech_vocab_size):
                raise InputError(f"speech ids out of range [0, {self.speech_vocab_size})")
            return speech_ids.long() + self.speech_token_offset
        if not 0 <= int(speech_ids) < self.speech_vocab_size:
            raise InputError(f"speech token {speech_ids} out of range [0, {self.speech_vocab_size})")
        return self.speech_token_offset + int(speech_ids)

    def to_speech(self, merged_ids):
        """Merged id(s) of speech tokens (int or tensor) -> speech id(s)."""
        if isinstance(merged_ids, torch.Tensor):
            if merged_ids.numel() and (int(merged_ids.min()) < self.speech_token_offset
                                       or int(merged_ids.max()) >= self.speech_end):
                raise InputError(f"merged ids are not all speech ids [{self.speech_token_offset}, {self.speech_end})")
            return merged_ids.long() - self.speech_token_offset
        if not self.speech_token_offset <= int(merged_ids) < self.speech_end:
            raise InputError(f"merged id {merged_ids} is not a speech token (range [{self.speech_token_offset}, "
                             f"{self.speech_end}))")
        return int(merged_ids) - self.speech_token_offset

    def prompt_ids(self, text_ids, prompt_speech_ids=None) -> torch.Tensor:
        """The LM prompt [sos, text..., task_id, prompt speech...] as merged ids [L] (long, CPU): position for
        position what `CosyVoice3LM.build_lm_input(text_ids, prompt_speech_ids)` embeds."""
        text = torch.as_tensor(text_ids, dtype=torch.long).reshape(-1).cpu()
        speech = torch.as_tensor([] if prompt_speech_ids is None else prompt_speech_ids,
                                 dtype=torch.long).reshape(-1).cpu()
        if text.numel() == 0:
            raise InputError("prompt_ids: text_ids is empty")
        if int(text.min()) < 0 or int(text.max()) >= self.text_vocab_size:
            raise InputError(f"prompt_ids: text id out of range [0, {self.text_vocab_size}): "
                             f"min {int(text.min())}, max {int(text.max())}")
        special = torch.tensor([self.sos_id, self.task_id], dtype=torch.long)
        return torch.cat([special[:1], text, special[1:], self.to_merged(speech)])

    # ---------------------------------------------------------------- output logits
    def speech_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Merged-vocab logits [..., >= speech_end] -> the speech columns [..., speech_vocab] (float32): column i
        scores speech id i."""
        if logits.shape[-1] < self.speech_end:
            raise EngineSetError(f"logits have {logits.shape[-1]} columns, the merged vocab needs {self.speech_end}")
        return logits[..., self.speech_token_offset:self.speech_end].float()
