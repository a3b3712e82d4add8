"""Frontend-side steps that prepare a request for its workers (run in the frontend pool, one request at a time)."""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Callable

import torch

from ...engines.cuda_graphs import upload
from ...engines.errors import EngineSetError, RequestTooLongError
from ..models.sampling import TokenPolicy
from ..models.versions import tensor_version
from ..stages.hop_schedule import HopSchedule
from .state import RequestState


class VoiceMemo:
    """The per-voice part of a request's preparation, done once per voice: a saved speaker's prompt tensors are the
    same objects request after request, so their upload, host ids, content digest and the LM's prompt speech
    embeddings are kept (a bounded LRU, entries keyed by the tensors' identity and checked against their storage and
    in-place version, so a replaced or edited tensor is never served stale). The values are those the uncached path
    computes: ordering and operation count change, not the numbers. Shared by the frontend threads (a lock)."""

    def __init__(self, capacity: int = 64):
        self.capacity = capacity
        self.lock = threading.Lock()
        self.entries: OrderedDict = OrderedDict()
        self.dead: list = []  # keys whose tensors were freed (weakref callbacks: no lock there), purged by get()
        self.hits = self.misses = 0

    def get(self, kind: str, tensors: tuple, make: Callable[[], object]):
        """`make()`'s value for these tensors (`kind` names what is made), cached while they live unchanged."""
        if any(t.numel() == 0 for t in tensors):  # nothing worth keeping (and a fresh empty tensor each time)
            return make()
        key = (kind,) + tuple(id(t) for t in tensors)
        stamp = tuple(tensor_version(t) for t in tensors)
        with self.lock:
            while self.dead:  # a request's own prompt audio: its entry goes with its tensors
                self.entries.pop(self.dead.pop(), None)
            e = self.entries.get(key)
            if e is not None and all(ref() is t for ref, t in zip(e[0], tensors)) and e[1] == stamp:
                self.entries.move_to_end(key)
                self.hits += 1
                return e[2]
            self.misses += 1
        value = make()
        with self.lock:
            self.entries[key] = (tuple(weakref.ref(t, lambda _, k=key: self.dead.append(k)) for t in tensors),
                                 stamp, value)
            self.entries.move_to_end(key)
            while len(self.entries) > self.capacity:
                self.entries.popitem(last=False)
        return value


def lm_input(r: RequestState, inputs, lm, device, memo: VoiceMemo | None = None) -> None:
    """The request's LM input embeddings on the device (ids checked on the host, uploaded without blocking; a saved
    voice's prompt speech embeddings from `memo`); on CUDA an event marks the end of this thread's work on them and
    on the flow prompt (the AR stream waits for it before the prefill, the DiT's before the first hop)."""
    with torch.inference_mode():
        speech = inputs.prompt_speech_tokens
        # keyed by the embedding table too: a weight load in place makes them anew
        embeds = (lm.embed_prompt_speech(speech) if memo is None
                  else memo.get("lm_speech", (speech, lm.speech_embedding.weight),
                                lambda: lm.embed_prompt_speech(speech)))
        r.lm_input = lm.build_lm_input(inputs.text_ids, prompt_speech_embeds=embeds)
    if torch.device(device).type == "cuda":
        r.inputs_ready = torch.cuda.Event()
        r.inputs_ready.record()


def runner_ids(r: RequestState, inputs, runner) -> None:
    """The prompt as the AR runner's own input ids (`ARRunner.prompt_ids`: merged-vocab ids for TensorRT-LLM, None
    for the PyTorch LM), one per position of `r.lm_input` (set first), for the prefill's `PrefillRow.ids`."""
    ids = runner.prompt_ids(inputs.text_ids, inputs.prompt_speech_tokens)
    if ids is not None and ids.shape[0] != r.lm_input.shape[0]:
        raise EngineSetError(f"AR runner {type(runner).__name__}: prompt_ids gave {ids.shape[0]} ids for "
                           f"{r.lm_input.shape[0]} LM input positions")
    r.lm_ids = ids


def ar_side(r: RequestState, inputs, lm, runner, device, noise_room: int | None = None,
            slots_name: str = "the KV-cache slots", setting: str = "SchedulerConfig.ar_max_len") -> None:
    """An AR whose frontend ran elsewhere (the cluster's AR replica, the AR process): the request's LM input, its
    runner ids and token policy (`token_policy`'s check, its names and noise room), and for a stream the points at
    which its tokens are flushed to token2wav (its hop schedule)."""
    lm_input(r, inputs, lm, device)
    runner_ids(r, inputs, runner)
    token_policy(r, inputs, lm, runner.max_len, slots_name, setting, noise_room=noise_room)
    if r.req.stream:
        r.flush = HopSchedule(int(inputs.flow_prompt_tokens.numel()))


def flow_prompt(r: RequestState, inputs, device, memo: VoiceMemo | None = None) -> None:
    """The flow prompt (tokens, mel, speaker embedding) on the device, plus what the DiT thread needs of it on the
    host: the prompt's token ids and its content digest (so its DiT calls never read the prompt back). A saved
    voice's come from `memo` (its device tensors are shared by its requests: nothing writes to them)."""
    tensors = (inputs.flow_prompt_tokens, inputs.flow_prompt_mel, inputs.embedding)

    def make():
        from ..stages.flow_cache import prompt_digest

        tok, mel, emb = tensors
        ids = tok.reshape(-1).long().cpu().clone()  # not a view: a memo entry must not keep its key tensor alive
        return ids, prompt_digest(ids, mel.cpu(), emb.cpu()), tuple(upload(t, device) for t in tensors)

    r.prompt_ids, r.prompt_digest, r.prompt = make() if memo is None else memo.get("flow_prompt", tensors, make)


def token_policy(r: RequestState, inputs, lm, max_len: int, slots_name: str = "the KV-cache slots",
                 setting: str = "SchedulerConfig.ar_max_len", noise_room: int | None = None) -> None:
    """The request's TokenPolicy, and the check that its longest output fits a KV-cache slot of `max_len`
    positions (`slots_name` / `setting`: how the error names them). An explicit `max_tokens` cap is clamped to the
    room left in the slot and (`noise_room`) in the fixed noise buffers, never refused; `force_tokens` is not."""
    r.policy = TokenPolicy(inputs.text_len, r.req.sampling, lm.config.speech_token_size)
    sp = r.req.sampling
    if sp.force_tokens is None and sp.max_tokens is not None:
        room = max_len - r.lm_input.shape[0]
        if noise_room is not None:
            room = min(room, noise_room)
        if room >= 1 and r.policy.max_len > room:
            r.policy.max_len = room
            r.policy.min_len = min(r.policy.min_len, room)
    need = r.lm_input.shape[0] + r.policy.max_len
    if need > max_len:
        raise RequestTooLongError(
            f"request {r.req.request_id} needs up to {need} LM positions ({r.lm_input.shape[0]} input + "
            f"{r.policy.max_len} generated) but {slots_name} hold {max_len}: shorten the text "
            f"or the prompt, set max_tokens, or raise {setting}")
