"""Frontend-side steps that prepare a request for its workers (run in the frontend pool, one request at a time)."""
from __future__ import annotations

import torch

from ...engines.cuda_graphs import upload
from ...engines.errors import EngineSetError, RequestTooLongError
from ..models.sampling import TokenPolicy
from .state import RequestState


def lm_input(r: RequestState, inputs, lm, device) -> None:
    """The request's LM input embeddings on the device (ids checked on the host, uploaded without blocking); on CUDA
    an event marks the end of this thread's work on them and on the flow prompt (the AR stream waits for it before
    the prefill, the DiT's before the first hop)."""
    with torch.inference_mode():
        r.lm_input = lm.build_lm_input(inputs.text_ids, inputs.prompt_speech_tokens)
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


def flow_prompt(r: RequestState, inputs, device) -> None:
    """The flow prompt (tokens, mel, speaker embedding) on the device, plus what the DiT thread needs of it on the
    host: the prompt's token ids and its content digest (so its DiT calls never read the prompt back)."""
    from ..stages.flow_cache import prompt_digest

    tok, mel, emb = inputs.flow_prompt_tokens, inputs.flow_prompt_mel, inputs.embedding
    r.prompt_ids = tok.reshape(-1).long().cpu()
    r.prompt_digest = prompt_digest(r.prompt_ids, mel.cpu(), emb.cpu())
    r.prompt = tuple(upload(t, device) for t in (tok, mel, emb))


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
