"""Multi-stage request scheduler: frontend pool → AR (continuous batching) → DiT (chunk-aligned batches) → HiFT
(length-aware batches) → per-request output queues.

Every stage is one worker thread fed by a queue (the frontend is a small thread pool):

* AR: each request owns one static KV-cache slot (`KVSlots`). Every iteration admits waiting requests (one batched
  prefill of rows of different lengths), runs ONE `lm.decode` for all running rows and ONE `sample_batch` for them
  (one host sync). Finished rows free their slot at once; new requests join at the next step. A streaming request
  emits a DiT job whenever its hop schedule fires (`StreamState.ready`), and a final job when the LM stops; an
  offline request emits one final job.
* DiT: builds each call around the job of the request with the least playback slack (`dit_order`: a request
  that has no audio yet, or whose listener has caught up, before streams with audio buffered), takes ready jobs of
  its kind ((streaming, finalize) = (True, False) for hops, (False, True) for finals), length-grouped, at most
  `dit_max_requests`, waiting at most `dit_max_wait_ms` after that job was queued (and only while the AR can still
  produce jobs), and runs ONE `flow.inference_batch` per group. Jobs from requests in
  lockstep reach their hop boundaries in the same AR step, so they are queued together (chunk-aligned dispatch).
* HiFT: streaming jobs advance the requests' `HiFTStream`s together (`push_batch`); offline finals are grouped with
  `group_by_length` and run with `hift.inference_batch` (exact per row).
* Output: PCM chunks go to the request's `RequestHandle`. On CUDA the device→host copy runs on a side stream into
  pinned memory and a chunk is handed over once its event has completed (polled), so the next HiFT batch launches
  before the previous audio reaches the host.

Per request the audio is exactly what `Pipeline.run` gives for the same seed: every batched call is exact per row and
each request's jobs run strictly in order (one job per request per batch). A request that raises in any stage fails
alone: a failing batched call is retried row by row. Timings: T_AR, T_DiT and T_vocoder are each request's share of
the batched calls it took part in (call time / rows in the call), T_queue is submit → AR admission minus T_tokenizer.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Callable, Iterator

import numpy as np
import torch

from ...engines.buckets import group_by_length
from ..stages.compiled import compiled_graph_count
from ...engines.errors import InputError, RejectedError, RequestTooLongError
from ..models.flow import FlowInput
from ..models.hift_stream import push_batch
from ..stages.kv_slots import KVSlots
from ..models.llm import REDUCE_ATTENTION_MAX_ROWS
from .request import Request, RequestMetrics, prepare_inputs
from ..models.sampling import TokenPolicy, sample_batch
from .stage_clock import StageClock
from ..stages.token2wav import HOP_SCALE, LOOKAHEAD, TOKEN_MAX_HOP, StreamState

_KV_LEN_STEP = 256  # decode attends to the cache rounded up to this many positions
_MIN_COMPILED_ROWS = 2  # compiled LM calls get >= 2 rows (padding rows -> scratch slot): dynamo specializes batch 1


POLICIES = ("continuous_batching", "dit_chunk_aligned", "dit_slack_priority", "hift_length_aware", "async_d2h")


@dataclass
class SchedulerConfig:
    max_in_flight: int = 64           # requests admitted and not finished
    on_full: str = "wait"             # "wait" (up to submit_timeout_s) or "reject" when max_in_flight is reached
    submit_timeout_s: float = 30.0
    ar_max_batch: int = 32            # KV-cache slots = most requests decoding together
    ar_max_prefill_tokens: int = 4096  # padded tokens (rows x longest) of one batched prefill
    ar_max_len: int | None = None     # KV positions per slot; None: from the noise buffers (see Scheduler)
    dit_max_requests: int = 8         # requests per DiT call (CFG rows = 2x)
    dit_max_wait_ms: float = 5.0
    hift_max_batch: int = 16
    hift_max_wait_ms: float = 5.0
    hift_max_frames: int = 8192       # rows x longest mel frames of one offline HiFT call
    max_padding_waste: float = 1.5    # padded work / real work allowed when grouping DiT and HiFT rows
    frontend_workers: int = 2
    cuda_graphs: bool = True          # on CUDA: capture the AR decode step per batch bucket and KV-length rung
    compile: bool = False             # torch.compile the AR prefill and decode step (before the CUDA-graph capture)
    # The batching policies, each switchable off to measure what it buys (`trtbuild bench --suite features`):
    continuous_batching: bool = True  # off: admit new requests only when no request is decoding (static batches)
    dit_chunk_aligned: bool = True    # off: one request per DiT call, dispatched at once (no cross-request batches)
    dit_slack_priority: bool = True   # off: each DiT call is built around the oldest queued job (see playback_slack)
    hift_length_aware: bool = True    # off: offline HiFT batches in arrival order, no padding-waste limit
    async_d2h: bool = True            # off (CUDA): each chunk's device-to-host copy blocks the HiFT worker
    ar_graph_batches: tuple = (1, 2, 4, 8, 16, 32, 64)
    ar_prefill_graph_batches: tuple = (1, 2, 4, 8)     # on CUDA: prefill captured per (rows, padded length)
    ar_prefill_graph_lengths: tuple = (64, 128, 256, 384, 512)
    # Flow prefix KV cache (stages/flow_cache.py): non-final DiT hops compute only their new frames; a saved speaker's
    # prompt chunks are computed once (flow_prompt_cache). Budget in bytes (None: 25 % of the GPU, at most 24 GiB;
    # 1 GiB on CPU); a hop that does not fit runs as today (stats()["dit"]["cache_fallbacks"]).
    flow_prefix_cache: bool = True
    flow_prompt_cache: bool = True
    flow_cache_budget_bytes: int | None = None
    # A request's tokens do not depend on the other requests batched with it, nor on the padded bucket / KV rung
    # (same seed, same tokens; issue #20). The LM then runs batch-invariant kernels (runtime/models/batch_invariant.py).
    batch_invariant: bool = True

    def __post_init__(self):
        if self.on_full not in ("wait", "reject"):
            raise InputError(f"SchedulerConfig.on_full must be 'wait' or 'reject', got {self.on_full!r}")
        for name in ("max_in_flight", "ar_max_batch", "ar_max_prefill_tokens", "dit_max_requests", "hift_max_batch",
                     "hift_max_frames", "frontend_workers"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InputError(f"SchedulerConfig.{name} must be a positive int, got {v!r}")
        if self.ar_max_len is not None and (not isinstance(self.ar_max_len, int) or self.ar_max_len < 1):
            raise InputError(f"SchedulerConfig.ar_max_len must be a positive int or None, got {self.ar_max_len!r}")
        for name in ("submit_timeout_s", "dit_max_wait_ms", "hift_max_wait_ms"):
            if getattr(self, name) < 0:
                raise InputError(f"SchedulerConfig.{name} must be >= 0, got {getattr(self, name)!r}")
        b = self.flow_cache_budget_bytes
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 0):
            raise InputError(f"SchedulerConfig.flow_cache_budget_bytes must be None or an int >= 0, got {b!r}")
        if self.max_padding_waste < 1:
            raise InputError(f"SchedulerConfig.max_padding_waste must be >= 1, got {self.max_padding_waste!r}")


# ---------------------------------------------------------------------------------------------------------- handle

class RequestHandle:
    """The caller's side of one request: its PCM chunks (float32, in order), its metrics, cancel."""

    def __init__(self, request: Request, metrics: RequestMetrics, cancel: Callable[["RequestHandle"], None]):
        self.request = request
        self.request_id = request.request_id
        self.metrics = metrics
        self.error: BaseException | None = None
        self.tokens: list[int] | None = None  # the generated speech tokens, once the LM has finished
        self._cancel = cancel
        self._cond = threading.Condition()
        self._chunks: list[np.ndarray] = []
        self._done = False
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    # ---------------------------------------------------------------- scheduler side
    def _notify(self) -> None:
        self._cond.notify_all()
        for loop, ev in self._waiters:
            try:
                loop.call_soon_threadsafe(ev.set)
            except RuntimeError:  # loop closed
                pass

    def _put(self, chunk: np.ndarray) -> None:
        with self._cond:
            if not self._done:
                self._chunks.append(chunk)
                self._notify()

    def _finish(self, error: BaseException | None = None, stamp: Callable[[], None] | None = None) -> bool:
        """Mark done (with `error` if it failed), calling `stamp()` first; False when it was already done."""
        with self._cond:
            if self._done:
                return False
            if stamp is not None:
                stamp()
            self._done = True
            self.error = error
            self._notify()
            return True

    # ---------------------------------------------------------------- caller side
    def done(self) -> bool:
        return self._done

    def cancel(self) -> None:
        """Stop the request: its handle raises RejectedError, every stage drops it, its KV slot frees at the next
        AR step. No effect once it is done."""
        if not self._done:
            self._cancel(self)

    def _next(self, i: int, deadline: float | None) -> np.ndarray | None:
        with self._cond:
            while i >= len(self._chunks) and not self._done:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"request {self.request_id}: no audio within the timeout")
                self._cond.wait(left)
            if i < len(self._chunks):
                return self._chunks[i]
            if self.error is not None:
                raise self.error
            return None

    def chunks(self, timeout: float | None = None) -> Iterator[np.ndarray]:
        """PCM chunks in order as they arrive; `timeout` bounds each wait. Raises the request's error if it failed."""
        i = 0
        while True:
            c = self._next(i, None if timeout is None else time.monotonic() + timeout)
            if c is None:
                return
            i += 1
            yield c

    async def achunks(self):
        """Async version of `chunks()` (no executor thread per waiting request)."""
        loop = asyncio.get_running_loop()
        ev = asyncio.Event()
        with self._cond:
            self._waiters.append((loop, ev))
        try:
            i = 0
            while True:
                with self._cond:
                    if i < len(self._chunks):
                        c = self._chunks[i]
                    elif self._done:
                        if self.error is not None:
                            raise self.error
                        return
                    else:
                        c = None
                        ev.clear()
                if c is None:
                    await ev.wait()
                    continue
                i += 1
                yield c
        finally:
            with self._cond:
                self._waiters.remove((loop, ev))

    def result(self, timeout: float | None = None) -> np.ndarray:
        """The whole waveform (all chunks concatenated) once the request is done."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._done:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
                self._cond.wait(left)
            if self.error is not None:
                raise self.error
            return np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.float32)


# ------------------------------------------------------------------------------------------------- internal state

class _Req:
    """Scheduler-side state of one request."""

    def __init__(self, req: Request, handle: RequestHandle):
        self.req = req
        self.handle = handle
        self.metrics = handle.metrics
        self.lm_input: torch.Tensor | None = None
        self.inputs_ready = None                  # CUDA: event after the frontend thread built lm_input / prompt
        self.prompt: tuple | None = None          # flow prompt (tokens [P], mel [2P, 80], embedding [192])
        self.policy: TokenPolicy | None = None
        self.state: StreamState | None = None     # streaming requests only
        self.tokens: list[int] = []
        self.slot: int | None = None
        self.pos = 0                              # next KV position

    @property
    def dead(self) -> bool:
        return self.handle.done()


@dataclass
class _DitJob:
    r: _Req
    tokens: torch.Tensor   # generated tokens for this call [N], on the host (the DiT worker moves them)
    streaming: bool
    finalize: bool
    mel_from: int          # new mel starts at this output frame (2 * stream offset)
    frames: int            # mel frames of the call (prompt + tokens), for grouping
    t_enqueue: float

    @property
    def kind(self) -> tuple[bool, bool]:
        return self.streaming, self.finalize


@dataclass
class _HiftJob:
    r: _Req
    mel: torch.Tensor      # [1, 80, n] new mel
    final: bool
    t_enqueue: float


def _first_per_request(jobs):
    """Jobs that are the oldest queued job of their request (a request's jobs must run in order)."""
    seen, out = set(), []
    for j in jobs:
        if id(j.r) not in seen:
            seen.add(id(j.r))
            out.append(j)
    return out


def playback_slack(m: RequestMetrics, now: float) -> float:
    """How far ahead of its listener a request is, in seconds: the audio it has delivered minus the time since its
    first chunk (a client plays from the first chunk on). Before its first chunk (and for offline requests, which
    deliver one chunk at the end) it is minus the time since submission: the longer a request has waited, the
    more urgent it is."""
    if m.ttfa is None:
        return -(now - m.t_submit)
    return m.audio_seconds - (now - m.t_submit - m.ttfa)


def dit_order(ready: list, now: float, slack_priority: bool) -> list:
    """The ready DiT jobs (one per request, in queue order) in the order the next call considers them: the first is
    the job the call is built around, the rest join it when of its kind and of similar length. `slack_priority`:
    least playback slack first (each request's slack read once), so a new request's first hop goes ahead of the
    later hops of streams that still have audio buffered (lower time to first audio under load, as sglang-omni
    ranks its streams) and an underrunning stream goes first of all; ties keep queue order. Otherwise queue order
    (the oldest job first)."""
    if not slack_priority:
        return list(ready)
    slack = [playback_slack(j.r.metrics, now) for j in ready]
    return [ready[i] for i in sorted(range(len(ready)), key=lambda i: (slack[i], i))]


class _Stop(Exception):
    pass


# ------------------------------------------------------------------------------------------------------ scheduler

class Scheduler:
    """Runs many requests through one `Pipeline`'s models with batching across requests (see module docstring).

    `on_finish(metrics)` (optional) is called once per request when it completes, fails or is cancelled."""

    def __init__(self, pipeline, config: SchedulerConfig | None = None,
                 on_finish: Callable[[RequestMetrics], None] | None = None):
        self.pipeline = pipeline
        self.config = cfg = config or SchedulerConfig()
        self.on_finish = on_finish
        models = pipeline.models
        self.lm, self.flow, self.hift = models.llm, models.flow, models.hift
        self.t2w = pipeline.token2wav
        self.sample_rate = pipeline.sample_rate
        self.device = pipeline.device

        limit = min(self.flow.max_frames, getattr(self.hift, "max_frames", None) or self.hift.noise_frames)
        if cfg.ar_max_len is None:  # prompt + output tokens are bounded by the noise buffers; text adds some more
            max_pos = getattr(models.config.llm.qwen, "max_position_embeddings", None) or 1 << 30
            self.ar_max_len = min(max_pos, -(-(limit // 2 + 512) // _KV_LEN_STEP) * _KV_LEN_STEP)
        else:
            self.ar_max_len = cfg.ar_max_len
        use_graphs = cfg.cuda_graphs and torch.device(self.device).type == "cuda"
        self.lm.batch_invariant = cfg.batch_invariant  # before any compile / graph capture of its calls
        self.slots = KVSlots(self.lm, cfg.ar_max_batch, self.ar_max_len, scratch=use_graphs or cfg.compile)
        self._decode, self._prefill = self.lm.decode, self.lm.prefill
        if cfg.compile:
            from ..stages.compiled import compile_fn

            self._decode, self._prefill = compile_fn(self.lm.decode), compile_fn(self.lm.prefill)
        self.decode_graphs = self.prefill_graphs = None
        if use_graphs:
            from ..stages.ar_graphs import DecodeGraphs, PrefillGraphs

            batches = [b for b in cfg.ar_graph_batches if b < cfg.ar_max_batch] + [cfg.ar_max_batch]
            if cfg.compile:  # batch 1 runs in the batch-2 graph (one padding row): no batch-1 compile
                batches = sorted({max(b, _MIN_COMPILED_ROWS) for b in batches})
            rungs, kv = [], 256
            while kv < self.ar_max_len:
                rungs.append(kv)
                kv *= 2
            rungs.append(self.ar_max_len)
            self.decode_graphs = DecodeGraphs(self._decode, batches, rungs, self.slots.scratch_slot, self.device)
            rows = [b for b in cfg.ar_prefill_graph_batches if b <= cfg.ar_max_batch]
            if cfg.compile:
                rows = sorted({max(b, _MIN_COMPILED_ROWS) for b in rows})
            self.prefill_graphs = PrefillGraphs(
                self._prefill, rows, [t for t in cfg.ar_prefill_graph_lengths if t <= self.ar_max_len],
                cfg.ar_max_prefill_tokens, self.lm.config.qwen.hidden_size, self.lm.dtype, self.slots.scratch_slot,
                self.device)
        if cfg.compile:
            self._warm_compiled()
        if torch.device(self.device).type == "cuda":
            from ..models.hift_stream import warm_decode_windows

            warm_decode_windows(self.hift, batches=tuple(b for b in (1, 2, 4, 8, 16) if b <= cfg.hift_max_batch))

        self._lock = threading.Lock()
        self._space = threading.Condition(self._lock)   # backpressure: in_flight < max_in_flight
        self._live: dict[int, _Req] = {}
        self._in_flight = 0
        self._closing = False
        self._dead: str | None = None  # set when a worker thread died (see _guard)
        self._stop = False
        self._counts = dict(completed=0, failed=0, cancelled=0, rejected=0)
        self._stage = dict(ar_prefill_calls=0, ar_prefill_rows=0, ar_decode_steps=0, ar_decode_rows=0,
                           ar_max_decode_batch=0, ar_batched_decode_steps=0,
                           dit_calls=0, dit_rows=0, dit_max_batch=0, dit_frames_uncached=0,
                           hift_calls=0, hift_rows=0, hift_max_batch=0)

        self._frontend = ThreadPoolExecutor(cfg.frontend_workers, thread_name_prefix="cosytrt-frontend")
        self._frontend_pending = 0
        self._ar_cond = threading.Condition()
        self._ar_waiting: deque[_Req] = deque()
        self._running: list[_Req] = []                  # AR thread only
        self._dit_cond = threading.Condition()
        self._dit_queue: list[_DitJob] = []
        self._dit_busy = False
        self._hift_cond = threading.Condition()
        self._hift_queue: list[_HiftJob] = []
        self._transfers: deque = deque()               # CUDA: (r, host, event, final, t_launch, rows), FIFO

        self.flow_cache = None  # FlowCachePool shared by the streams' prefix states
        if cfg.flow_prefix_cache:
            from ..stages.flow_cache import FlowCachePool, default_budget

            budget = cfg.flow_cache_budget_bytes
            self.flow_cache = FlowCachePool(default_budget(self.device) if budget is None else budget,
                                            prompt_cache=cfg.flow_prompt_cache)
        self._cuda = self.device.type == "cuda"
        self.clock = StageClock(self._cuda)              # busy time per stage (stats()["busy_s"])
        self._copy_stream = torch.cuda.Stream(self.device) if self._cuda else None
        # The AR worker runs on its own stream: its per-step host sync (the sampled tokens) then waits for its own
        # kernels only, not for DiT / HiFT batches queued by the other workers, and its graphs overlap theirs on the
        # GPU. Its only device inputs from other threads are lm_input (fenced by `inputs_ready`); what it hands on
        # (DiT job tokens) stays on the host.
        self._ar_stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._compiles_at_start = compiled_graph_count() if cfg.compile else None
        self._threads = [threading.Thread(target=self._guard, args=(fn,), name=f"cosytrt-{name}", daemon=True)
                         for name, fn in (("ar", self._ar_loop), ("dit", self._dit_loop), ("hift", self._hift_loop))]
        for t in self._threads:
            t.start()

    def _warm_compiled(self) -> None:
        """Compile now, not under load: run the compiled prefill (and, without decode graphs, the decode step at
        the smallest padded batch and one row more: the two decode specializations, see `llm.decode_attention`) into
        the scratch slot (decode graphs compile while they are captured)."""
        dev, n = self.device, _MIN_COMPILED_ROWS
        with torch.inference_mode():  # as the AR worker's tensors are (dynamo guards on inference-ness)
            rows = torch.full((n,), self.slots.scratch_slot, device=dev)
            embeds = torch.zeros(n, 8, self.lm.config.qwen.hidden_size, device=dev, dtype=self.lm.dtype)
            self._prefill(embeds, torch.full((n,), 8, device=dev), rows)
            if self.decode_graphs is None:
                for b in (n, max(n, REDUCE_ATTENTION_MAX_ROWS) + 1):  # the reduce-form rows and the SDPA rows
                    self._decode(torch.zeros(b, dtype=torch.long, device=dev),
                                 torch.full((b,), self.slots.scratch_slot, device=dev),
                                 torch.full((b,), 8, device=dev), kv_len=min(_KV_LEN_STEP, self.ar_max_len))

    # ================================================================== public API
    def submit(self, req: Request) -> RequestHandle:
        """Queue a request; returns at once (or after waiting for space, see `SchedulerConfig.on_full`).

        Raises RejectedError when the scheduler is closed or full. Input errors (bad prompt, too long for the noise
        buffers: RequestTooLongError) are raised by the handle, before any model work."""
        if not isinstance(req, Request):
            raise InputError(f"Scheduler.submit takes a Request, got {type(req).__name__}")
        m = RequestMetrics(request_id=req.request_id, stream=req.stream)
        cfg = self.config
        with self._space:
            if self._closing:
                raise RejectedError(f"request {req.request_id}: the scheduler is closed")
            if self._in_flight >= cfg.max_in_flight:
                if cfg.on_full == "reject":
                    self._counts["rejected"] += 1
                    raise RejectedError(f"request {req.request_id}: {self._in_flight} requests in flight "
                                        f"(max_in_flight={cfg.max_in_flight})")
                ok = self._space.wait_for(lambda: self._in_flight < cfg.max_in_flight or self._closing,
                                          cfg.submit_timeout_s)
                if self._closing or not ok:
                    self._counts["rejected"] += 1
                    why = "the scheduler is closed" if self._closing else \
                        f"still {self._in_flight} requests in flight after waiting {cfg.submit_timeout_s} s"
                    raise RejectedError(f"request {req.request_id}: {why} (max_in_flight={cfg.max_in_flight})")
            self._in_flight += 1
            handle = RequestHandle(req, m, self._cancel)
            r = _Req(req, handle)
            self._live[id(handle)] = r
            self._frontend_pending += 1
        try:
            self._frontend.submit(self._run_frontend, r)
        except RuntimeError:  # the pool was shut down by a close() that gave up draining
            with self._lock:
                self._frontend_pending -= 1
            err = RejectedError(f"request {req.request_id}: the scheduler is closed")
            self._finish(r, err)
            raise err from None
        return handle

    def set_policies(self, **flags: bool) -> None:
        """Switch batching policies of a running scheduler (`continuous_batching`, `dit_chunk_aligned`,
        `dit_slack_priority`, `hift_length_aware`, `async_d2h`): each worker reads the config once per decision, so
        the change applies from the next admission / DiT group / HiFT group / chunk copy on. Lets a benchmark compare
        the policies on one scheduler, with the same graphs and caches."""
        bad = sorted(set(flags) - set(POLICIES))
        if bad:
            raise InputError(f"set_policies: unknown polic{'y' if len(bad) == 1 else 'ies'} {bad}; use {POLICIES}")
        for name, value in flags.items():
            if not isinstance(value, bool):
                raise InputError(f"set_policies: {name} must be True or False, got {value!r}")
        self.config = replace(self.config, **flags)

    @property
    def healthy(self) -> bool:
        """False once a worker thread has died (the scheduler then rejects every submit) or it is closing."""
        return self._dead is None and not self._closing

    @property
    def failure(self) -> str | None:
        """Why the scheduler is not healthy: the dead worker's error, else None."""
        return self._dead

    def stats(self) -> dict:
        with self._lock:
            out = {"in_flight": self._in_flight, "closing": self._closing, **self._counts}
            stage = dict(self._stage)
        out["queues"] = {"frontend": self._frontend_pending, "ar_waiting": len(self._ar_waiting),
                         "ar_running": len(self._running), "dit": len(self._dit_queue),
                         "hift": len(self._hift_queue), "output": len(self._transfers)}
        out["ar"] = {"slots": self.slots.slots, "free_slots": self.slots.free, "max_len": self.ar_max_len,
                     "decode_graph_replays": self.decode_graphs.replays if self.decode_graphs else 0,
                     "prefill_graph_replays": self.prefill_graphs.replays if self.prefill_graphs else 0,
                     "slot_allocations": self.slots.allocations,
                     **{k[3:]: v for k, v in stage.items() if k.startswith("ar_")}}
        for s in ("dit", "hift"):
            out[s] = {k[len(s) + 1:]: v for k, v in stage.items() if k.startswith(s + "_")}
        # DiT frames per CFG row and Euler step: computed (whole-history rows + cached hops' new frames), reused from
        # the flow prefix cache, hops that fell back (pool full)
        fc = self.flow_cache.stats() if self.flow_cache is not None else {}
        uncached = out["dit"].pop("frames_uncached")
        out["dit"].update(frames_computed=uncached + fc.get("frames_computed", 0),
                          frames_reused=fc.get("frames_reused", 0), cache_fallbacks=fc.get("fallback_hops", 0),
                          flow_cache=fc)
        es = getattr(self.pipeline, "engine_set", None)
        if es is not None and hasattr(es, "stats"):
            out["shapes"] = es.stats.summary()  # bucket hits / padding / eager fallbacks of the engine calls
        # compile=True: torch.compile graphs compiled in this process since this scheduler was ready (each one
        # stalled serving while it compiled; expected 0)
        out["compiles_since_start"] = (0 if self._compiles_at_start is None
                                       else compiled_graph_count() - self._compiles_at_start)
        # busy seconds per stage (CUDA: GPU time of its batches; CPU: wall time), see stage_clock
        out["busy_s"] = self.clock.busy_s()
        return out

    def close(self, drain_timeout_s: float = 30.0) -> None:
        """Stop accepting requests, let in-flight ones finish (up to `drain_timeout_s`), then stop the workers;
        requests still unfinished then fail with RejectedError."""
        with self._space:
            self._closing = True
            self._space.notify_all()
            self._space.wait_for(lambda: self._in_flight == 0, drain_timeout_s)
            left = list(self._live.values())
        for r in left:
            self._finish(r, RejectedError(f"request {r.req.request_id}: the scheduler closed before it finished"))
        self._stop = True
        for c in (self._ar_cond, self._dit_cond, self._hift_cond):
            with c:
                c.notify_all()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=10)
        self._frontend.shutdown(wait=False, cancel_futures=True)

    # ================================================================== request lifecycle
    def _cancel(self, handle: RequestHandle) -> None:
        r = self._live.get(id(handle))
        if r is not None:
            self._finish(r, RejectedError(f"request {handle.request_id} was cancelled"), cancelled=True)

    def _finish(self, r: _Req, error: BaseException | None, cancelled: bool = False) -> None:
        """Complete (error None) or fail one request; the first call wins."""
        m = r.metrics

        def stamp():
            m.total = time.perf_counter() - m.t_submit
            if error is not None:
                m.error = f"{type(error).__name__}: {error}"
        if not r.handle._finish(error, stamp):
            return
        if r.state is not None and r.state.flow_cache is not None:
            r.state.flow_cache.close()
        with self._space:
            self._live.pop(id(r.handle), None)
            self._in_flight -= 1
            self._counts["cancelled" if cancelled else "failed" if error is not None else "completed"] += 1
            self._space.notify_all()
        with self._ar_cond:  # the AR worker frees the slot of a dead running row
            self._ar_cond.notify_all()
        if self.on_finish is not None:
            self.on_finish(m)

    def _guard(self, loop) -> None:
        """Run a worker loop; an unexpected error fails every live request instead of hanging them."""
        try:
            loop()
        except _Stop:
            pass
        except BaseException as e:  # a scheduler bug: nobody must wait forever
            with self._space:
                self._closing = True  # later submits are rejected
                self._dead = f"worker {threading.current_thread().name} died: {e!r}"
                self._space.notify_all()
            for r in list(self._live.values()):
                self._finish(r, RuntimeError(f"scheduler worker {threading.current_thread().name} died: {e!r}"))
            raise

    def _sync(self) -> None:
        if self._cuda:
            ev = torch.cuda.Event()
            ev.record()
            ev.synchronize()

    # ================================================================== frontend
    def _run_frontend(self, r: _Req) -> None:
        self._frontend_job(r, self._prepare)

    def _frontend_job(self, r: _Req, prepare) -> None:
        """Run `prepare(r)` in the frontend pool, then queue the request for AR admission; failures fail r alone."""
        try:
            if r.dead:
                return
            prepare(r)
            with self._ar_cond:
                self._ar_waiting.append(r)
                self._ar_cond.notify_all()
        except BaseException as e:
            self._finish(r, e)
        finally:
            with self._lock:
                self._frontend_pending -= 1

    def _prepare(self, r: _Req) -> None:
        t0 = time.perf_counter()
        inputs = prepare_inputs(self.pipeline.frontend, r.req, self.pipeline.default_speaker)
        r.metrics.t_tokenizer = time.perf_counter() - t0
        dev = self.device
        with torch.inference_mode():
            r.lm_input = self.lm.build_lm_input(inputs.text_ids.to(dev), inputs.prompt_speech_tokens.to(dev))
        r.prompt = (inputs.flow_prompt_tokens.to(dev), inputs.flow_prompt_mel.to(dev), inputs.embedding.to(dev))
        self._fence_inputs(r)
        self.pipeline._check_noise(inputs, r.req)
        self._prepare_policy(r, inputs)
        if r.req.stream:
            r.state = self.t2w.start(*r.prompt)
            r.state.flow_cache = None if self.flow_cache is None else self.flow_cache.new_state()

    def _fence_inputs(self, r: _Req) -> None:
        """CUDA: mark the end of this (frontend) thread's work on the request's device inputs; the AR stream waits
        for it before the prefill."""
        if self._cuda:
            r.inputs_ready = torch.cuda.Event()
            r.inputs_ready.record()

    # where the KV-length error sends the user (the cluster's AR stage words it for its YAML)
    _kv_slots_name = "the KV-cache slots"
    _kv_len_setting = "SchedulerConfig.ar_max_len"

    def _prepare_policy(self, r: _Req, inputs) -> None:
        """The request's TokenPolicy, and the check that its longest output fits a KV-cache slot."""
        r.policy = TokenPolicy(inputs.text_len, r.req.sampling, self.lm.config.speech_token_size)
        sp = r.req.sampling
        if sp.force_tokens is None and sp.max_tokens is not None:  # a cap: clamp it to the buffers, never refuse
            noise_room = getattr(self.pipeline, "noise_room", None)
            room = self.ar_max_len - r.lm_input.shape[0]
            if noise_room is not None and hasattr(inputs, "flow_prompt_tokens"):
                room = min(room, noise_room(inputs))
            if room >= 1 and r.policy.max_len > room:
                r.policy.max_len = room
                r.policy.min_len = min(r.policy.min_len, room)
        need = r.lm_input.shape[0] + r.policy.max_len
        if need > self.ar_max_len:
            raise RequestTooLongError(
                f"request {r.req.request_id} needs up to {need} LM positions ({r.lm_input.shape[0]} input + "
                f"{r.policy.max_len} generated) but {self._kv_slots_name} hold {self.ar_max_len}: shorten the text "
                f"or the prompt, set max_tokens, or raise {self._kv_len_setting}")

    # ================================================================== AR
    def _ar_loop(self) -> None:
        with torch.inference_mode(), torch.cuda.stream(self._ar_stream):  # stream None (CPU): no-op
            while True:
                with self._ar_cond:
                    while not self._stop and not self._ar_waiting and not self._running:
                        self._ar_cond.wait()
                    if self._stop:
                        raise _Stop
                    admit = self._take_admissions()
                self.slots.install()
                jobs: list[_DitJob] = []
                with self.clock.span("ar"):
                    if admit:
                        self._ar_prefill(admit, jobs)
                    if self._running:
                        self._ar_decode(jobs)
                if jobs:
                    with self._dit_cond:
                        self._dit_queue.extend(jobs)
                        self._dit_cond.notify_all()

    def _drop_dead(self) -> None:
        """Free the slots of cancelled / failed running rows."""
        alive = []
        for r in self._running:
            if r.dead:
                self._release(r)
            else:
                alive.append(r)
        self._running = alive

    def _release(self, r: _Req) -> None:
        if r.slot is not None:
            self.slots.release(r.slot)
            r.slot = None

    def _take_admissions(self) -> list[_Req]:
        """Waiting requests that get a slot now, within the prefill token budget (always at least one)."""
        out, longest = [], 0
        self._drop_dead()
        if self._running and not self.config.continuous_batching:
            return out
        while self._ar_waiting and self.slots.free:
            r = self._ar_waiting[0]
            if r.dead:
                self._ar_waiting.popleft()
                continue
            n = max(longest, r.lm_input.shape[0])
            if out and n * (len(out) + 1) > self.config.ar_max_prefill_tokens:
                break
            self._ar_waiting.popleft()
            r.slot = self.slots.allocate()
            out.append(r)
            longest = n
        return out

    def _padded(self, values: list[list[int]], pad: list[int]) -> list[torch.Tensor]:
        """Per-row int columns as device tensors; a compiled LM gets padding rows (`pad`: their values; the slot
        column pads with the scratch slot) up to _MIN_COMPILED_ROWS."""
        extra = max(0, _MIN_COMPILED_ROWS - len(values[0])) if self.config.compile else 0
        return [torch.tensor(col + [p] * extra, device=self.device) for col, p in zip(values, pad)]

    def _prefill_call(self, rows: list[_Req]) -> torch.Tensor:
        lengths = [r.lm_input.shape[0] for r in rows]
        lengths_t, slots = self._padded([lengths, [r.slot for r in rows]], [1, self.slots.scratch_slot])
        width, hidden = max(lengths), rows[0].lm_input.shape[1]
        embeds = torch.zeros(lengths_t.shape[0], width, hidden, device=self.device, dtype=self.lm.dtype)
        for i, r in enumerate(rows):
            embeds[i, :lengths[i]] = r.lm_input.to(self.lm.dtype)
        if self.prefill_graphs is not None and self.prefill_graphs.bucket(len(lengths_t), width) is not None:
            return self.prefill_graphs(embeds, lengths_t, slots)[:len(rows)]
        return self._prefill(embeds, lengths_t, slots)[:len(rows)]

    def _decode_call(self, rows: list[_Req]) -> torch.Tensor:
        need = max(r.pos for r in rows) + 1
        cols = [[r.policy.next_input for r in rows], [r.slot for r in rows], [r.pos for r in rows]]
        if self.decode_graphs is not None and self.decode_graphs.fits(len(rows), need):
            return self.decode_graphs(*(torch.tensor(c, device=self.device) for c in cols), need)
        kv_len = min(self.ar_max_len, -(-need // _KV_LEN_STEP) * _KV_LEN_STEP)
        tokens, slots, positions = self._padded(cols, [0, self.slots.scratch_slot, 0])
        return self._decode(tokens, slots, positions, kv_len=kv_len)[:len(rows)]

    def _batched(self, call, rows: list[_Req]) -> list[tuple[_Req, torch.Tensor]]:
        """`call(rows)` -> logits [B, V]; if the batch raises, retry row by row so only failing rows fail."""
        try:
            logits = call(rows)
            return [(r, logits[i]) for i, r in enumerate(rows)]
        except Exception as e:
            if len(rows) == 1:
                self._fail_ar(rows[0], e)
                return []
        out = []
        for r in rows:
            try:
                out.append((r, call([r])[0].clone()))  # a graph's output buffer is reused by the next call
            except Exception as e:
                self._fail_ar(r, e)
        return out

    def _fail_ar(self, r: _Req, e: BaseException) -> None:
        self._release(r)
        if r in self._running:
            self._running.remove(r)
        self._finish(r, e)

    def _ar_prefill(self, rows: list[_Req], jobs: list) -> None:
        t0 = time.perf_counter()
        for r in rows:
            if r.inputs_ready is not None:
                torch.cuda.current_stream().wait_event(r.inputs_ready)
        for r in rows:
            r.metrics.t_queue = max(0.0, t0 - r.metrics.t_submit - r.metrics.t_tokenizer)
        results = self._batched(self._prefill_call, rows)
        for r, _ in results:
            r.pos = r.lm_input.shape[0]
            self._running.append(r)
        self._sample(results, t0, jobs)
        with self._lock:
            self._stage["ar_prefill_calls"] += 1
            self._stage["ar_prefill_rows"] += len(rows)

    def _ar_decode(self, jobs: list) -> None:
        rows = list(self._running)
        t0 = time.perf_counter()
        results = self._batched(self._decode_call, rows)
        for r, _ in results:
            r.pos += 1
        self._sample(results, t0, jobs)
        with self._lock:
            st = self._stage
            st["ar_decode_steps"] += 1
            st["ar_decode_rows"] += len(rows)
            st["ar_max_decode_batch"] = max(st["ar_max_decode_batch"], len(rows))
            st["ar_batched_decode_steps"] += len(rows) > 1

    def _policy_steps(self, results: list[tuple[_Req, torch.Tensor]]) -> list[tuple[_Req, int | None, bool]]:
        """One `sample_batch` for all rows (one host sync); if it raises, `TokenPolicy.step` row by row so only
        failing rows fail. Returns (row, token or None, finished) for the rows that did not fail."""
        if not results:
            return []
        try:
            steps = sample_batch(torch.stack([logits for _, logits in results]), [r.policy for r, _ in results])
            return [(r, tok, done) for (r, _), (tok, done) in zip(results, steps)]
        except Exception as e:
            if len(results) == 1:
                self._fail_ar(results[0][0], e)
                return []
        out = []
        for r, logits in results:
            try:
                out.append((r, *r.policy.step(logits)))
            except Exception as e:
                self._fail_ar(r, e)
        return out

    def _sample(self, results: list[tuple[_Req, torch.Tensor]], t0: float, jobs: list) -> None:
        """One batched sampling step for all rows; queue hop / final DiT jobs; free the slots of finished rows."""
        for r, tok, done in self._policy_steps(results):
            try:
                if tok is not None:
                    r.tokens.append(tok)
                    if r.state is not None and r.state.ready(len(r.tokens)):
                        jobs.append(self._hop_job(r))
                if done:
                    self._release(r)
                    self._running.remove(r)
                    r.metrics.tokens = len(r.tokens)
                    r.handle.tokens = list(r.tokens)
                    if r.tokens:
                        jobs.append(self._final_job(r))
                    else:  # the LM stopped at once: no frames to vocode, so empty audio (not a flow error)
                        self._finish(r, None)
            except Exception as e:
                self._fail_ar(r, e)
        if results:
            share = (time.perf_counter() - t0) / len(results)
            for r, _ in results:
                r.metrics.t_ar += share

    def _hop_job(self, r: _Req) -> _DitJob:
        """A non-final streaming call; advances the hop schedule as `Token2Wav.step` does."""
        st = r.state
        upto = st.offset + st.hop
        tokens = torch.tensor(r.tokens[:upto + LOOKAHEAD], dtype=torch.long)
        job = _DitJob(r, tokens, True, False, 2 * st.offset, 2 * (r.prompt[0].numel() + upto), time.perf_counter())
        st.offset = upto
        st.base_hop = min(TOKEN_MAX_HOP, st.base_hop * HOP_SCALE)
        st.hop = st.base_hop
        return job

    def _final_job(self, r: _Req) -> _DitJob:
        """The last call: all tokens, full attention, finalize (streaming: keep the mel past the last hop)."""
        n = len(r.tokens)
        tokens = torch.tensor(r.tokens, dtype=torch.long)
        mel_from = 0
        if r.state is not None:
            mel_from = 2 * r.state.offset
            r.state.offset = n
            r.state.finished = True
        return _DitJob(r, tokens, False, True, mel_from, 2 * (r.prompt[0].numel() + n), time.perf_counter())

    def _ar_active(self) -> bool:
        """Can more DiT jobs arrive soon?"""
        return bool(self._running or self._ar_waiting or self._frontend_pending)

    # ================================================================== DiT
    def _dit_loop(self) -> None:
        with torch.inference_mode():
            while True:
                group = self._next_dit_group()
                try:
                    self._run_dit(group)
                finally:
                    with self._dit_cond:
                        self._dit_busy = False

    def _next_dit_group(self) -> list[_DitJob]:
        with self._dit_cond:
            while True:
                cfg = self.config  # per decision: `set_policies` may switch it while this worker waits
                if self._stop:
                    raise _Stop
                self._dit_queue = [j for j in self._dit_queue if not j.r.dead]
                ready = _first_per_request(self._dit_queue)
                if not ready:
                    self._dit_cond.wait()
                    continue
                order = dit_order(ready, time.perf_counter(), cfg.dit_slack_priority)
                anchor = order[0]
                if not cfg.dit_chunk_aligned:
                    self._dit_queue = [j for j in self._dit_queue if j is not anchor]
                    self._dit_busy = True
                    return [anchor]
                same = [j for j in order if j.kind == anchor.kind]  # anchor first; equal lengths group by urgency
                groups = group_by_length([j.frames for j in same], cfg.dit_max_requests, cfg.max_padding_waste)
                group = [same[i] for i in next(g for g in groups if 0 in g)]
                left = anchor.t_enqueue + cfg.dit_max_wait_ms / 1e3 - time.perf_counter()
                if len(same) < cfg.dit_max_requests and left > 0 and self._ar_active():
                    self._dit_cond.wait(left)
                    continue
                taken = {id(j) for j in group}
                self._dit_queue = [j for j in self._dit_queue if id(j) not in taken]
                self._dit_busy = True
                return group

    def _estimator(self, streaming: bool):
        """The pipeline's DiT estimator for this mode (a callable, or a {"stream"|"offline": callable} dict)."""
        est = getattr(self.t2w, "estimator", None)
        if isinstance(est, dict):
            est = est.get("stream" if streaming else "offline")
        return est

    def _flow_call(self, group: list[_DitJob]) -> list[torch.Tensor]:
        streaming, finalize = group[0].kind
        est = self._estimator(streaming)
        kw = {} if est is None else {"estimator": est}
        caches = [None if j.r.state is None else j.r.state.flow_cache for j in group]
        if finalize:  # the final hop is a full-attention pass over everything: free the prefix
            for c in caches:
                if c is not None:
                    c.close()
        rows = [FlowInput(j.tokens.to(self.device), *j.r.prompt, finalize=finalize, cache=c)
                for j, c in zip(group, caches)]
        with self._lock:  # frames of whole-history rows (the cache counts its own rows' frames)
            self._stage["dit_frames_uncached"] += sum(j.frames for j, c in zip(group, caches) if c is None or c.closed)
        return self.flow.inference_batch(rows, streaming=streaming, finalize=finalize, **kw)

    def _run_dit(self, group: list[_DitJob]) -> None:
        t0 = time.perf_counter()
        with self.clock.span("dit"):
            results = self._rowwise(self._flow_call, group)
        self._sync()
        if not results:
            return
        share = (time.perf_counter() - t0) / len(group)
        now = time.perf_counter()
        out = []
        for j, mel in results:
            j.r.metrics.t_dit += share
            if j.r.state is not None:
                j.r.state.chunks += 1
            mel = mel[:, :, j.mel_from:]
            speed = getattr(j.r.req, "speed", 1.0)
            if j.finalize and j.r.state is None and speed != 1.0 and mel.shape[-1] > 0:  # offline, as upstream
                mel = torch.nn.functional.interpolate(mel, size=max(1, int(mel.shape[-1] / speed)), mode="linear")
            out.append(_HiftJob(j.r, mel, j.finalize, now))
        with self._lock:
            st = self._stage
            st["dit_calls"] += 1
            st["dit_rows"] += len(group)
            st["dit_max_batch"] = max(st["dit_max_batch"], len(group))
        with self._hift_cond:
            self._hift_queue.extend(out)
            self._hift_cond.notify_all()

    def _rowwise(self, call, jobs: list, before_retry=None) -> list[tuple]:
        """`call(jobs)` -> one result per job; if the batch raises, retry job by job so only failing ones fail."""
        try:
            return list(zip(jobs, call(jobs)))
        except Exception as e:
            if len(jobs) == 1:
                self._finish(jobs[0].r, e)
                return []
        out = []
        for j in jobs:
            if before_retry is not None:
                before_retry(j)
            try:
                out.append((j, call([j])[0]))
            except Exception as e:
                self._finish(j.r, e)
        return out

    # ================================================================== HiFT
    def _hift_loop(self) -> None:
        with torch.inference_mode():
            while True:
                jobs = self._next_hift_jobs()
                if jobs:
                    with self.clock.span("hift"):
                        self._run_hift(jobs)
                self._drain_transfers()

    def _dit_active(self) -> bool:
        return bool(self._dit_busy or self._dit_queue)

    def _next_hift_jobs(self) -> list[_HiftJob]:
        with self._hift_cond:
            while True:
                cfg = self.config  # per decision (see _next_dit_group)
                self._drain_transfers()
                if self._stop:
                    raise _Stop
                self._hift_queue = [j for j in self._hift_queue if not j.r.dead]
                ready = _first_per_request(self._hift_queue)
                poll = 0.0005 if self._transfers else None  # CUDA copies in flight: poll their events
                if not ready:
                    self._hift_cond.wait(poll)
                    continue
                left = ready[0].t_enqueue + cfg.hift_max_wait_ms / 1e3 - time.perf_counter()
                if len(ready) < cfg.hift_max_batch and left > 0 and self._dit_active():
                    self._hift_cond.wait(left if poll is None else min(left, poll))
                    continue
                streams = [j for j in ready if j.r.state is not None][:cfg.hift_max_batch]
                offline = [j for j in ready if j.r.state is None]
                taken = {id(j) for j in streams + offline}
                self._hift_queue = [j for j in self._hift_queue if id(j) not in taken]
                return streams + offline

    def _run_hift(self, jobs: list[_HiftJob]) -> None:
        cfg = self.config
        streams = [j for j in jobs if j.r.state is not None]
        offline = [j for j in jobs if j.r.state is None]
        if streams:
            snapshots = {id(j): vars(j.r.state.hift_stream).copy() for j in streams}

            def restore(j):  # push_batch only rebinds attributes, so a shallow copy undoes a failed batch
                vars(j.r.state.hift_stream).update(snapshots[id(j)])

            def push(group):
                return push_batch([j.r.state.hift_stream for j in group], [j.mel for j in group],
                                  [j.final for j in group])
            self._vocode(push, streams, restore)
        if offline:
            lengths = [j.mel.shape[2] for j in offline]
            # an engine set may route offline HiFT through `token2wav.hift_runner` (same inference_batch API)
            vocoder = getattr(self.t2w, "hift_runner", None) or self.hift
            for idx in group_by_length(lengths, cfg.hift_max_batch, cfg.max_padding_waste, cfg.hift_max_frames,
                                       length_aware=cfg.hift_length_aware):
                self._vocode(lambda g: vocoder.inference_batch([j.mel for j in g], finalize=True),
                             [offline[i] for i in idx])

    def _vocode(self, call, group: list[_HiftJob], restore=None) -> None:
        t0 = time.perf_counter()
        results = self._rowwise(call, group, restore)
        with self._lock:
            st = self._stage
            st["hift_calls"] += 1
            st["hift_rows"] += len(group)
            st["hift_max_batch"] = max(st["hift_max_batch"], len(group))
        for j, wav in results:
            self._output(j.r, wav.reshape(-1), j.final, t0, len(group))

    # ================================================================== output
    def _output(self, r: _Req, wav: torch.Tensor, final: bool, t_launch: float, rows: int) -> None:
        if not self._cuda or not self.config.async_d2h:
            r.metrics.t_vocoder += (time.perf_counter() - t_launch) / rows
            self._deliver(r, wav.detach().float().cpu().numpy().reshape(-1), final)
            return
        wav = wav.detach().float()
        host = torch.empty(wav.shape, dtype=torch.float32, pin_memory=True)
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copy_stream):
            host.copy_(wav, non_blocking=True)
            wav.record_stream(self._copy_stream)
            ev = torch.cuda.Event()
            ev.record(self._copy_stream)
        self._transfers.append((r, host, ev, final, t_launch, rows))

    def _drain_transfers(self) -> None:
        """Hand over the chunks whose device→host copy has completed (copies complete in FIFO order)."""
        while self._transfers and self._transfers[0][2].query():
            r, host, _, final, t_launch, rows = self._transfers.popleft()
            r.metrics.t_vocoder += (time.perf_counter() - t_launch) / rows
            self._deliver(r, host.numpy().copy(), final)

    def _deliver(self, r: _Req, pcm: np.ndarray, final: bool) -> None:
        if r.dead:
            return
        r.metrics.mark_chunk(pcm.size, self.sample_rate)
        r.handle._put(pcm)
        if final:
            self._finish(r, None)
