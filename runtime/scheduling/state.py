"""Per-request scheduler state (`RequestState`) and the jobs that carry a request between workers.

A request's jobs run strictly in order: each queue takes at most one job per request into a batch
(`first_per_request`), so a request's DiT and HiFT calls see its stream state in sequence.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..models.sampling import TokenPolicy
from ..stages.hop_schedule import LOOKAHEAD, TOKEN_MEL_RATIO, HopSchedule
from ..stages.token2wav import StreamState
from .handle import RequestHandle
from ..stages.request import Request


class RequestState:
    """Scheduler-side state of one request, from `submit` to its last chunk."""

    def __init__(self, req: Request, handle: RequestHandle, inputs=None):
        self.req = req
        self.handle = handle
        self.metrics = handle.metrics
        self.inputs = inputs                      # the frontend's LMRequestInputs when computed elsewhere (cluster)
        #                                           or used elsewhere (the AR process: ar_process.py)
        self.noise_room: int | None = None        # the AR process: tokens the noise buffers leave (token_policy's)
        self.lm_input: torch.Tensor | None = None
        self.lm_ids: torch.Tensor | None = None   # the prompt as the AR runner's input ids (None: embeddings only)
        self.inputs_ready = None                  # CUDA: event after the frontend thread built lm_input / prompt
        self.prompt_fenced = False                # CUDA: the DiT's stream waited for inputs_ready (prompt in use)
        self.prompt: tuple | None = None          # flow prompt (tokens [P], mel [2P, 80], embedding [192])
        self.prompt_ids: torch.Tensor | None = None  # the prompt's token ids on the host (checked by the DiT worker)
        self.prompt_digest: str | None = None     # flow_cache.prompt_digest of the prompt
        self.policy: TokenPolicy | None = None
        self.stream: StreamState | None = None    # token2wav streaming state (streaming requests only)
        self.flush: HopSchedule | None = None     # cluster AR: where streaming tokens are flushed to token2wav
        self.sent = 0                             # cluster AR: tokens flushed so far
        self.tokens: list[int] = []
        self.slot: int | None = None              # KV slot while the AR runs it
        self.pos = 0                              # next KV position
        self.dit_jobs = 0                         # DiT jobs made so far
        self.first_job_t: float | None = None     # when its first DiT job was made (perf_counter)

    @property
    def dead(self) -> bool:
        return self.handle.done()

    def take_flushed(self, done: bool) -> list[int] | None:
        """An AR whose tokens go elsewhere (the cluster's AR replica, the AR process): the tokens made since the last
        flush when the LM is `done` or the stream's next flush point (`flush`, its hop schedule) is reached, else
        None; the flush schedule is advanced past the tokens made."""
        n = len(self.tokens)
        out = None
        if n > self.sent and (done or (self.flush is not None and self.flush.ready(n))):
            out, self.sent = self.tokens[self.sent:n], n
        while self.flush is not None and self.flush.ready(n):
            self.flush.advance()
        return out


@dataclass
class DitJob:
    r: RequestState
    tokens: torch.Tensor   # generated tokens for this call [N], on the host (the DiT worker moves them)
    streaming: bool
    finalize: bool
    mel_from: int          # new mel starts at this output frame (2 * stream offset)
    frames: int            # mel frames of the call (prompt + tokens), for grouping
    t_enqueue: float
    first: bool = False    # the request's first DiT job (the one its first audio waits for)
    # a streaming hop that started when its request's final was already queued behind it with no hop between: no
    # later hop reads its frames, so it commits none to the flow prefix pool (`FlowInput.commit`)
    last_hop: bool = False

    @property
    def kind(self) -> tuple[bool, bool]:
        return self.streaming, self.finalize


@dataclass
class HiftJob:
    r: RequestState
    mel: torch.Tensor      # [1, 80, n] new mel
    final: bool
    t_enqueue: float
    ready: object = None   # CUDA event after the DiT work that made `mel` (SchedulerConfig.hift_own_stream)


def hop_job(r: RequestState) -> DitJob:
    """A non-final streaming call; advances the request's hop schedule as `Token2Wav.step` does."""
    offset, upto = r.stream.hops.advance()
    tokens = torch.tensor(r.tokens[:upto + LOOKAHEAD], dtype=torch.long)
    return DitJob(r, tokens, True, False, TOKEN_MEL_RATIO * offset, TOKEN_MEL_RATIO * (r.prompt[0].numel() + upto),
                  time.perf_counter(), _first(r))


def _first(r: RequestState) -> bool:
    first = r.dit_jobs == 0
    if first:
        r.first_job_t = time.perf_counter()
    r.dit_jobs += 1
    return first


def final_job(r: RequestState) -> DitJob:
    """The last call: all tokens, full attention, finalize (streaming: keep the mel past the last hop)."""
    n = len(r.tokens)
    mel_from = 0 if r.stream is None else TOKEN_MEL_RATIO * r.stream.hops.finish(n)
    return DitJob(r, torch.tensor(r.tokens, dtype=torch.long), False, True, mel_from,
                  TOKEN_MEL_RATIO * (r.prompt[0].numel() + n), time.perf_counter(), _first(r))


def first_per_request(jobs: list) -> list:
    """Jobs that are the oldest queued job of their request (a request's jobs must run in order)."""
    seen, out = set(), []
    for j in jobs:
        if id(j.r) not in seen:
            seen.add(id(j.r))
            out.append(j)
    return out


def run_rows(call, rows: list, fail, single=None, before_retry=None) -> list[tuple]:
    """Run `call(rows)` -> one result per row as one batch; if the batch raises, retry row by row (`single(row)`,
    default `call([row])[0]`; `before_retry(row)` first) so only the failing rows fail (`fail(row, error)`).
    Returns (row, result) for the rows that did not fail."""
    try:
        return list(zip(rows, call(rows)))
    except Exception as e:
        if len(rows) == 1:
            fail(rows[0], e)
            return []
    single = single or (lambda row: call([row])[0])
    out = []
    for row in rows:
        if before_retry is not None:
            before_retry(row)
        try:
            out.append((row, single(row)))
        except Exception as e:
            fail(row, e)
    return out
