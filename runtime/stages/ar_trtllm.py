"""The AR runner on TensorRT-LLM: the `ARRunner` protocol (runtime/stages/ar_runner.py) over a TensorRT-LLM engine
of the merged-vocab Qwen2 checkpoint (build/hf_export.py -> build/trtllm.py), through its Executor API.

Written against the documented API of `tensorrt_llm.bindings.executor` (TensorRT-LLM <= 1.2, the TensorRT-engine
backend): `Executor(engine_dir, ModelType.DECODER_ONLY, ExecutorConfig)`, `Request`, `SamplingConfig`,
`OutputConfig(return_generation_logits=...)`, `KvCacheConfig(enable_block_reuse=...)`, `enqueue_requests`,
`await_responses`, `Response.result.generation_logits`. `tensorrt_llm` is imported lazily and is not installed in
cosytrt's CI: that path has NOT RUN; the bookkeeping, id mapping and argument building below are tested on the CPU
with a stand-in executor (tests/test_ar_trtllm.py).

How the scheduler's step protocol maps onto the executor. The scheduler samples every token itself (cosytrt's RAS
sampler, per request), so the runner has to hand it per-step logits and take the sampled token back:
* every `prefill` / `decode` call is one batch of executor requests with `max_tokens=1` and
  `return_generation_logits=True`: the request's input is the slot's whole merged-vocab history (prompt ids, then
  every token fed so far), and its generation logits are the logits after that history, i.e. the last-position
  logits the protocol returns. TensorRT-LLM's own sampled token (greedy) is discarded.
* KV-cache block reuse (`enable_block_reuse`, engine built with paged context FMHA) keeps the history's KV blocks
  between calls, so a step recomputes only the tokens past the last full block (< tokens_per_block), not the
  history. This is stateless on the executor side: no request sits in the executor between calls, so the
  scheduler's order (prefill of new rows while others are mid-generation) cannot deadlock a callback, which an
  in-flight request driven step by step through a blocking logits post-processor would.
* ids in and out (`runtime/models/merged_vocab.py`, read from the export's `cosytrt_metadata.json`): the engine has
  no input-embedding path here (a prompt table would need `--max_prompt_embedding_table_size` and p-tuning ids), so
  the prompt comes as merged-vocab ids: the scheduler asks the runner for them (`prompt_ids(text_ids,
  prompt_speech_ids)`, one id per position of the LM input embeddings) and hands them over in `PrefillRow.ids`; a
  fed speech token s becomes `speech_token_offset + s`; the engine's logits [padded_vocab] are cut to the speech
  columns, so column i is speech id i, as the torch runner returns them and the sampler indexes them.
"""
from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass, field

import torch

from ...engines.errors import BackendUnavailableError, EngineSetError, InputError
from ..models.merged_vocab import MergedVocab


def import_executor_api():
    """`tensorrt_llm.bindings.executor` (lazily); BackendUnavailableError when TensorRT-LLM is not installed."""
    try:
        import tensorrt_llm.bindings.executor as api  # noqa: PLC0415 - lazy on purpose
    except ImportError as e:
        raise BackendUnavailableError("trtllm", "tensorrt_llm", str(e)) from None
    return api


@dataclass
class SlotTable:
    """KV slots of the protocol and each slot's merged-vocab history (what the next request sends)."""

    max_batch: int
    max_len: int
    history: dict[int, list[int]] = field(default_factory=dict)
    _free: list[int] = field(default_factory=list)

    def __post_init__(self):
        if self.max_batch < 1 or self.max_len < 2:
            raise InputError(f"trtllm AR runner: max_batch {self.max_batch} and max_len {self.max_len} must be "
                             ">= 1 and >= 2")
        self._free = list(range(self.max_batch - 1, -1, -1))  # pop() hands out 0 first

    def allocate(self) -> int | None:
        if not self._free:
            return None
        slot = self._free.pop()
        self.history[slot] = []
        return slot

    def release(self, slot: int) -> None:
        if slot not in self.history:
            raise InputError(f"trtllm AR runner: slot {slot} is not allocated")
        del self.history[slot]
        self._free.append(slot)

    @property
    def free(self) -> int:
        return len(self._free)

    def start(self, slot: int, ids: list[int]) -> list[int]:
        self._check(slot)
        if not ids:
            raise InputError("trtllm AR runner: an empty prompt")
        if len(ids) >= self.max_len:
            raise InputError(f"trtllm AR runner: prompt of {len(ids)} tokens leaves no room in max_len "
                             f"{self.max_len}")
        self.history[slot] = list(ids)
        return self.history[slot]

    def feed(self, slot: int, merged_id: int, position: int) -> list[int]:
        """Append the token fed at `position` (the protocol's position: the index the token takes)."""
        self._check(slot)
        h = self.history[slot]
        if not h:
            raise InputError(f"trtllm AR runner: decode on slot {slot} before its prefill")
        if position != len(h):
            raise InputError(f"trtllm AR runner: slot {slot} holds {len(h)} positions, decode asked for position "
                             f"{position}")
        if position + 1 > self.max_len:
            raise InputError(f"trtllm AR runner: slot {slot} is full (max_len {self.max_len})")
        h.append(int(merged_id))
        return h

    def _check(self, slot: int) -> None:
        if slot not in self.history:
            raise InputError(f"trtllm AR runner: slot {slot} is not allocated")


def executor_config_kwargs(max_batch: int, kv_cache_free_gpu_memory_fraction: float = 0.5) -> dict:
    """Arguments of the executor set-up (pure: what `TrtllmARRunner` passes to the bindings)."""
    if not 0.0 < kv_cache_free_gpu_memory_fraction <= 1.0:
        raise InputError(f"kv_cache_free_gpu_memory_fraction {kv_cache_free_gpu_memory_fraction} not in (0, 1]")
    return {"max_beam_width": 1, "max_batch_size": max_batch,
            "kv_cache": {"enable_block_reuse": True,
                         "free_gpu_memory_fraction": kv_cache_free_gpu_memory_fraction}}


def request_kwargs(history: list[int], vocab: MergedVocab, slot: int) -> dict:
    """Arguments of one step's `Request` (pure): the whole history, one new token, its generation logits."""
    return {"input_token_ids": [int(t) for t in history], "max_tokens": 1, "streaming": False,
            "end_id": vocab.eos_id, "pad_id": vocab.eos_id, "client_id": int(slot),
            "sampling": {"beam_width": 1, "top_k": 1},
            "output": {"return_generation_logits": True, "exclude_input_from_output": True}}


def build_request(api, kw: dict):
    """A `Request` of the bindings from `request_kwargs` (SamplingConfig / OutputConfig objects built here)."""
    kw = dict(kw)
    sampling, output = kw.pop("sampling"), kw.pop("output")
    return api.Request(sampling_config=api.SamplingConfig(**sampling), output_config=api.OutputConfig(**output),
                       **kw)


def generation_logits(response) -> torch.Tensor:
    """The [V_padded] logits of a max_tokens=1 response (`result.generation_logits`: [beam, tokens, V])."""
    if response.has_error():
        raise EngineSetError(f"TensorRT-LLM request failed: {response.error_msg}")
    lg = response.result.generation_logits
    if lg is None:
        raise EngineSetError("TensorRT-LLM returned no generation logits: build the engine with "
                             "--gather_generation_logits (build/trtllm.py does)")
    lg = torch.as_tensor(lg)
    return lg.reshape(-1, lg.shape[-1])[0]


class TrtllmARRunner:
    """`ARRunner` over a TensorRT-LLM engine directory. `executor` / `api`: injected stand-ins (tests); by default
    the engine is loaded with `tensorrt_llm.bindings.executor` (BackendUnavailableError without TensorRT-LLM)."""

    name = "trtllm"

    def __init__(self, engine_dir: str, hf_dir: str, max_batch: int, max_len: int, device="cuda", *,
                 kv_cache_free_gpu_memory_fraction: float = 0.5, timeout_s: float = 60.0, api=None, executor=None):
        self.vocab = MergedVocab.load(hf_dir)
        self.slots = SlotTable(max_batch, max_len)
        self.max_batch, self.max_len = max_batch, max_len
        self.device = torch.device(device)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.api = api if api is not None else import_executor_api()
        self.executor = executor if executor is not None else self._open(engine_dir, kv_cache_free_gpu_memory_fraction)
        self.requests = 0

    @classmethod
    def from_engine_set(cls, folder: str, manifest, max_batch: int, max_len: int, device="cuda",
                        **kw) -> "TrtllmARRunner":
        """The runner of an engine set whose manifest says `ar_runner: trtllm` (build/engine_set.py writes the HF
        export to `ar_hf/` and the engine to `ar_trtllm_engine/`)."""
        hf = os.path.join(folder, manifest.commands.get("ar_hf_checkpoint", "ar_hf"))
        return cls(os.path.join(folder, "ar_trtllm_engine"), hf, max_batch, max_len, device, **kw)

    def _open(self, engine_dir: str, fraction: float):
        if not os.path.isdir(engine_dir):
            raise EngineSetError(f"TensorRT-LLM engine directory not found: {engine_dir} (run the commands the "
                                 "manifest records under commands.trtllm)")
        kw = executor_config_kwargs(self.max_batch, fraction)
        api = self.api
        cfg = api.ExecutorConfig(kw["max_beam_width"])
        cfg.max_batch_size = kw["max_batch_size"]
        cfg.kv_cache_config = api.KvCacheConfig(**kw["kv_cache"])
        return api.Executor(engine_dir, api.ModelType.DECODER_ONLY, cfg)

    # ---------------------------------------------------------------- ARRunner
    def allocate(self) -> int | None:
        return self.slots.allocate()

    def release(self, slot: int) -> None:
        self.slots.release(slot)

    @property
    def free(self) -> int:
        return self.slots.free

    def prompt_ids(self, text_ids, prompt_speech_ids) -> torch.Tensor:
        """The prompt as the engine's merged-vocab ids (what the scheduler puts in `PrefillRow.ids`)."""
        return self.vocab.prompt_ids(text_ids, prompt_speech_ids)

    def prefill(self, rows) -> torch.Tensor:
        histories = []
        for r in rows:
            if r.ids is None:
                raise InputError("the TensorRT-LLM AR runner takes the prompt as merged-vocab ids: PrefillRow.ids "
                                 "is None (the scheduler fills it from the runner's prompt_ids)")
            ids = torch.as_tensor(r.ids).reshape(-1).tolist()
            if r.embeds is not None and len(ids) != r.embeds.shape[0]:
                raise InputError(f"PrefillRow.ids has {len(ids)} ids for {r.embeds.shape[0]} LM input positions: "
                                 "the decode positions would not line up")
            bad = [i for i in ids if not 0 <= i < self.vocab.padded_vocab_size]
            if bad:
                raise InputError(f"merged-vocab id {bad[0]} out of range [0, {self.vocab.padded_vocab_size})")
            histories.append((r.slot, self.slots.start(r.slot, ids)))
        return self._step(histories)

    def decode(self, tokens: list[int], slots: list[int], positions: list[int]) -> torch.Tensor:
        if not len(tokens) == len(slots) == len(positions):
            raise InputError("decode: tokens, slots and positions differ in length")
        histories = [(s, self.slots.feed(s, self.vocab.to_merged(t), p)) for t, s, p in zip(tokens, slots, positions)]
        return self._step(histories)

    def close(self) -> None:
        ex, self.executor = self.executor, None
        if ex is not None and hasattr(ex, "shutdown"):
            ex.shutdown()

    def stats(self) -> dict:
        return {"slots": self.max_batch, "free_slots": self.free, "max_len": self.max_len,
                "executor_requests": self.requests}

    # ---------------------------------------------------------------- one batch of requests
    def _step(self, histories: list[tuple[int, list[int]]]) -> torch.Tensor:
        if self.executor is None:
            raise EngineSetError("the TensorRT-LLM AR runner is closed")
        reqs = [build_request(self.api, request_kwargs(h, self.vocab, slot)) for slot, h in histories]
        ids = list(self.executor.enqueue_requests(reqs))
        self.requests += len(ids)
        out = []
        for rid in ids:
            final = None
            while final is None:
                responses = self.executor.await_responses(rid, self.timeout)
                if not responses:
                    raise EngineSetError(f"TensorRT-LLM: no response to request {rid} within {self.timeout}")
                for resp in responses:
                    if resp.has_error() or resp.result.is_final:
                        final = resp
            out.append(self.vocab.speech_logits(generation_logits(final)))
        return torch.stack(out).to(self.device)
