"""The AR worker: admission -> batched prefill / decode through an `ARRunner` -> batched sampling -> tokens out.

One thread. Every iteration admits waiting requests (`policies.admit`: one batched prefill of rows of different
lengths into free KV slots), runs ONE decode step for all running rows and ONE `sample_batch` for them (one host
sync) — or, with `ar_decode_steps` = K, K steps sampled on the device in one runner call (`_decode_steps`: one
upload, one replay and one read-back per K tokens; the host then books the K steps one by one, as single steps
would). Finished rows free their slot at once; new requests join at the next step (continuous batching). After each
step it hands every row that got a token to its `TokenSink` (`tokens(r, done)`): in one process the token2wav
worker (which turns due hops and the end into DiT jobs), in the cluster the AR replica's token stream.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable, Protocol

import torch

from ..models.sampling import PackedRows, book, draw_batch, pack_rows, select_packed
from ..stages.ar_runner import ARRunner, PrefillRow
from .config import SchedulerConfig
from .policies import admit, ar_step_due
from .stage_clock import StageClock, StepTimer
from .state import RequestState
from .stats import ARCounters

HOLD_POLL_S = 0.001  # a first-audio hold re-checks its requests this often (ar_first_audio_hold_ms)
PACE_POLL_S = 0.005  # a pacing wait re-checks its requests at least this often (ar_pace_lead_s)
STEP_EMA = 0.1       # weight of the latest decode step in the step-time estimate pacing uses


_STEP_LOCKS = threading.Lock()


def step_lock(runner) -> threading.Lock:
    """The lock of `runner`'s steps: every AR worker over one runner (a TTS's scheduler draining in `reconfigure`
    beside the next one, a benchmark's `make_scheduler`, the AR process's sessions) takes a whole step — its runner
    call, whose graph input and output buffers are the runner's, and the sampling that reads the output — in turn,
    and graphs are captured for a new scheduler between steps. Uncontended with one worker."""
    with _STEP_LOCKS:
        lock = getattr(runner, "step_lock", None)
        if lock is None:
            lock = threading.Lock()
            try:
                runner.step_lock = lock
            except AttributeError:  # a runner that takes no attributes: this worker's own lock
                pass
        return lock


def runner_stats(runner) -> dict:
    """An AR runner's own numbers (slots, graph replays, ...), or its size where it keeps none."""
    return runner.stats() if hasattr(runner, "stats") else {"slots": runner.max_batch, "max_len": runner.max_len}


class Stopped(Exception):
    """Raised inside a worker loop when its scheduler stops."""


class TokenSink(Protocol):
    def tokens(self, r: RequestState, done: bool) -> None:
        """`r.tokens` grew by one token (or the LM finished: `done`). Called on the AR thread after each step."""

    def flush(self) -> None:
        """The step is over: hand on what `tokens` collected."""


class ARWorker:
    """Runs the LM for every admitted request. Queue in: `waiting` (the admission queue, `put`)."""

    def __init__(self, runner: ARRunner, config: SchedulerConfig, sink: TokenSink,
                 fail: Callable[[RequestState, BaseException], None], clock: StageClock, device):
        self.runner = runner
        self.config = config
        self.sink = sink
        self.fail = fail
        self.clock = clock
        self.device = torch.device(device)
        self.cond = threading.Condition()
        self.waiting: deque[RequestState] = deque()   # admission queue: frontend done, no KV slot yet
        self.running: list[RequestState] = []         # in a KV slot (AR thread only)
        self.counters = ARCounters()
        self.timer = StepTimer(self.device.type == "cuda", self.counters)  # every 8th step's anatomy
        self.stopped = False
        self.step_lock = step_lock(runner)
        self.step_s = 0.003  # decode step wall time, moving average (ar_pace_lead_s)
        # the runner samples the decode step itself (`ar_graph_sampling`: in its decode graphs on CUDA)
        self.graph_sampler = getattr(runner, "graph_sampler", None) if config.ar_graph_sampling else None
        # `ar_decode_steps` > 1: decode that many steps per runner call where the runner can (`decode_steps_n`)
        self.steps_per_call = (getattr(runner, "decode_steps_n", 1)
                               if config.ar_decode_steps > 1 and getattr(runner, "step_sampler", None) else 1)
        # On CUDA the worker runs on its own stream: its per-step host sync (the sampled tokens) then waits for its
        # own kernels only, not for DiT / HiFT batches queued by the other workers, and its graphs overlap theirs.
        # Its only device inputs from other threads are lm_input (fenced by `inputs_ready`); what it hands on
        # (tokens) stays on the host.
        # With `ar_stream_priority` it is the device's highest-priority stream (-100 maps to the highest valid one).
        self.stream = None
        if self.device.type == "cuda":
            self.stream = torch.cuda.Stream(self.device, priority=-100 if config.ar_stream_priority else 0)

    # ---------------------------------------------------------------- other threads
    def put(self, r: RequestState) -> None:
        with self.cond:
            self.waiting.append(r)
            self.cond.notify_all()

    def wake(self) -> None:
        """A request died (its slot frees at the next step) or the scheduler stops."""
        with self.cond:
            self.cond.notify_all()

    def stop(self) -> None:
        self.stopped = True
        self.wake()

    def active(self) -> bool:
        """Can more tokens come soon?"""
        return bool(self.running or self.waiting)

    def snapshot(self) -> dict:
        """What the scheduler's stats read of this worker: queue lengths, the runner's stats, the counters."""
        return {"waiting": len(self.waiting), "running": len(self.running), "runner": runner_stats(self.runner),
                "counters": self.counters}

    # ---------------------------------------------------------------- the loop
    def loop(self) -> None:
        with torch.inference_mode(), torch.cuda.stream(self.stream):  # stream None (CPU): no-op
            while True:
                with self.cond:
                    while not self.stopped and not self.waiting and not self.running:
                        self.cond.wait()
                    if self.stopped:
                        raise Stopped
                    admitted = self._admit()
                if admitted:
                    with self.step_lock, self.clock.span("ar"):
                        self._prefill(admitted)
                    self.sink.flush()
                if not self.running or self._hold_for_first_audio() or self._pace():
                    continue  # (after a hold: admission first again)
                with self.step_lock, self.clock.span("ar"):
                    self._decode()
                self.sink.flush()

    def _hold_for_first_audio(self) -> bool:
        """`ar_first_audio_hold_ms`: wait a little (True) instead of decoding while a stream this worker decodes
        waits for its first audio after its first DiT job was made — unless a running stream still needs tokens
        for its first hop, a request waits for admission, or the hold's time after that first job is over."""
        hold = self.config.ar_first_audio_hold_ms
        if hold <= 0 or self.waiting:
            return False
        deadline = None
        for r in self.running:
            if r.stream is None or r.dead:
                continue
            if r.dit_jobs == 0:
                return False  # its first audio needs more tokens: decode
            if r.metrics.ttfa is None and r.first_job_t is not None:
                end = r.first_job_t + hold / 1e3
                deadline = end if deadline is None else min(deadline, end)
        t0 = time.perf_counter()
        if deadline is None or t0 >= deadline:
            return False
        self._wait(t0, min(deadline - t0, HOLD_POLL_S), self.counters.hold)
        return True

    def _pace(self) -> bool:
        """`ar_pace_lead_s`: wait (True) instead of decoding while every running stream is far enough ahead of its
        listener (`policies.ar_step_due`); never while a request waits for admission."""
        lead = self.config.ar_pace_lead_s
        if lead <= 0 or self.waiting:
            return False
        t0 = time.perf_counter()
        due, wait = ar_step_due(self.running, t0, lead, self.step_s)
        if due:
            return False
        self._wait(t0, PACE_POLL_S if wait is None else min(wait, PACE_POLL_S), self.counters.pace)
        return True

    def _wait(self, t0: float, seconds: float, count) -> None:
        """Wait up to `seconds` instead of a decode step (a new request or the scheduler's stop ends it early), then
        `count` the seconds since `t0`."""
        with self.cond:
            if not self.waiting and not self.stopped:
                self.cond.wait(seconds)
        count(time.perf_counter() - t0)

    def _admit(self) -> list[RequestState]:
        """Free the slots of dead running rows; give waiting requests a slot (see `policies.admit`)."""
        alive = []
        for r in self.running:
            if r.dead:
                self._release(r)
            else:
                alive.append(r)
        self.running = alive
        self.waiting = deque(r for r in self.waiting if not r.dead)
        n = admit(self.waiting, len(self.running), self.runner.max_batch - len(self.running), self.config)
        out = []
        for _ in range(n):
            slot = self.runner.allocate()
            if slot is None:
                break
            r = self.waiting.popleft()
            r.slot = slot
            out.append(r)
        return out

    def _release(self, r: RequestState) -> None:
        if r.slot is not None:
            self.runner.release(r.slot)
            r.slot = None

    def _fail(self, r: RequestState, e: BaseException) -> None:
        self._release(r)
        if r in self.running:
            self.running.remove(r)
        self.fail(r, e)

    def _logits(self, call, rows: list[RequestState]) -> tuple[list[RequestState], torch.Tensor | None]:
        """`call(rows)` -> (rows, their logits [B, V]) as one batch; if it raises, row by row, so only the failing
        rows fail: (the rows that did not, their logits stacked). The batch's logits go to the sampling as they are
        (no per-row split and re-stack)."""
        try:
            return rows, call(rows)
        except Exception as e:
            if len(rows) == 1:
                self._fail(rows[0], e)
                return [], None
        ok, logits = [], []
        for r in rows:
            try:
                logits.append(call([r])[0].clone())   # a graph's output buffer is reused by the next call
                ok.append(r)
            except Exception as e:
                self._fail(r, e)
        return ok, torch.stack(logits) if logits else None

    def _prefill(self, rows: list[RequestState]) -> None:
        t0 = time.perf_counter()
        for r in rows:
            if r.inputs_ready is not None:  # lm_input was made on the frontend's stream
                torch.cuda.current_stream().wait_event(r.inputs_ready)
                r.lm_input.record_stream(torch.cuda.current_stream())
        for r in rows:
            r.metrics.t_queue = max(0.0, t0 - r.metrics.t_submit - r.metrics.t_tokenizer)
            r.metrics.mark("prefill", t0)
        rows_ok, logits = self._logits(
            lambda rs: self.runner.prefill([PrefillRow(r.slot, r.lm_input, r.lm_ids) for r in rs]), rows)
        for r in rows_ok:
            r.pos = r.lm_input.shape[0]
            self.running.append(r)
        self._sample(rows_ok, logits, t0)
        self.counters.prefill(len(rows))

    def _decode(self) -> None:
        rows = list(self.running)
        if self.steps_per_call > 1:
            many, few = self._split_for_steps(rows)
            if many and self._decode_steps(many):
                # the rows the device sampler does not hold keep pace in single steps (one request's top_k 50 must
                # not take every other row off multi-step calls)
                for _ in range(self.steps_per_call):
                    few = [r for r in few if r.slot is not None and not r.policy.finished]
                    if not few:
                        break
                    self._decode_rows(few)
                return
        self._decode_rows(rows)

    def _split_for_steps(self, rows: list[RequestState]) -> tuple[list[RequestState], list[RequestState]]:
        """(rows a multi-step call can take, the others): a row the device sampler `holds` that is not at its length
        limit (`sample_batch` finishes such a row without a draw). The first group's calls still need its largest
        top_k to be the sampler's (`StaticSampler.fits_steps`, checked by `_decode_steps`)."""
        sampler = self.runner.step_sampler
        many, few = [], []
        for r in rows:
            p = r.policy
            ok = not p.finished and p.num_sampled < p.max_len and sampler.holds(p)
            (many if ok else few).append(r)
        return many, few

    def _decode_rows(self, rows: list[RequestState]) -> None:
        """One decode step of `rows` (one runner call) and its sampling."""
        t0 = time.perf_counter()

        def inputs(rs):  # a decode call's tokens, slots, positions
            return [r.policy.next_input for r in rs], [r.slot for r in rs], [r.pos for r in rs]

        def decode(rs):
            return self.runner.decode(*inputs(rs))

        packed, ids = self._pack(rows), None
        tok = self.timer.start()
        if packed is None:
            rows_ok, logits = self._logits(decode, rows)
        else:
            try:
                logits, ids = self.runner.decode_sampled(*inputs(rows), packed)
                rows_ok = rows
            except Exception:  # as `_logits` does (the rows one by one), each row keeping the uniforms it drew
                index = {id(r): i for i, r in enumerate(rows)}
                rows_ok, logits = self._logits(decode, rows)
                packed = packed.subset([index[id(r)] for r in rows_ok])
        self.timer.launched(tok)
        for r in rows_ok:
            r.pos += 1
        self._sample(rows_ok, logits, t0, ids, packed)
        self.timer.end(tok)
        self.counters.decode(len(rows))
        self.step_s += STEP_EMA * (time.perf_counter() - t0 - self.step_s)

    def _charge(self, rows: list[RequestState], t0: float) -> float:
        """The seconds since `t0`, each row charged its share as AR time."""
        dt = time.perf_counter() - t0
        for r in rows:
            r.metrics.t_ar += dt / len(rows)
        return dt

    def _decode_steps(self, rows: list[RequestState]) -> bool:
        """`steps_per_call` decode steps for `rows` (from `_split_for_steps`) in one runner call (`ar_decode_steps`),
        or False (nothing drawn, nothing run: the single step takes them) when they could not take them: a batch
        the device sampler does not fit (its largest top_k not the sampler's), no room in the KV slots or graphs
        for the steps, or the call failed (its uniforms given back first). The K steps' ids are booked step by step
        as single steps book them (`accept`, the sink per token): a row that stops mid-call drops out, the ids after
        it are unused."""
        runner, k = self.runner, self.steps_per_call
        policies = [r.policy for r in rows]
        if (not runner.step_sampler.fits_steps(policies)
                or not runner.can_decode_steps(len(rows), max(r.pos for r in rows) + 1)):
            return False
        t0 = time.perf_counter()
        try:
            packed = pack_rows(policies, runner.step_sampler.vocab, steps=k)  # raises before drawing anything
        except Exception:
            return False
        try:
            ids = runner.decode_steps([p.next_input for p in policies], [r.slot for r in rows],
                                      [r.pos for r in rows], packed)
        except Exception:
            packed.undraw(policies)
            return False
        live = set(range(len(rows)))
        for step in ids:
            pairs = [(rows[i], step[i]) for i in sorted(live)]
            if not pairs:
                break
            for r, _ in pairs:
                r.pos += 1
            booked = self._per_row(pairs, lambda r, tok: r.policy.accept(tok))
            self._emit(booked)
            still = {id(r) for r, (_, done) in booked if not done and r.slot is not None}
            live = {i for i in live if id(rows[i]) in still}
            self.counters.decode(len(pairs))
        self.counters.multi_step_calls += 1
        self.step_s += STEP_EMA * (self._charge(rows, t0) / k - self.step_s)
        return True

    def _pack(self, rows: list[RequestState]) -> PackedRows | None:
        """The step's sampling inputs when the runner samples (`graph_sampler`; its uniforms drawn now), else None:
        no sampler, a row at its length limit (`sample_batch` finishes it without a draw) or a policy that does not
        check out (`sample_batch` fails that row alone)."""
        if self.graph_sampler is None:
            return None
        policies = [r.policy for r in rows]
        if any(p.finished or p.num_sampled >= p.max_len for p in policies):
            return None
        try:
            return pack_rows(policies, self.graph_sampler.vocab)
        except Exception:
            return None

    def _per_row(self, pairs, fn) -> list:
        """[(r, fn(r, x))] for the (row, x) pairs; a row whose `fn` raises fails alone."""
        out = []
        for r, x in pairs:
            try:
                out.append((r, fn(r, x)))
            except Exception as e:
                self._fail(r, e)
        return out

    def _sample(self, rows: list[RequestState], logits: torch.Tensor | None, t0: float,
                ids: list[int] | None = None, packed: PackedRows | None = None) -> None:
        """One `sample_batch` for all rows (`draw_batch`, one host sync, then each row's `book`; `TokenPolicy.step`
        row by row if the draw raises, a row whose bookkeeping raises failing alone), or the ids
        the runner sampled (`ids`), or `select_packed` of the rows' packed values; append the tokens, free the slots
        of finished rows, hand the rows to the sink."""
        if not rows:
            return
        policies = [r.policy for r in rows]
        if ids is None and packed is not None:
            try:
                ids = select_packed(logits, packed)
            except Exception:  # sample_batch's draw below, with the uniforms this one drew given back
                packed.undraw(policies)
        if ids is None:
            try:
                ids = draw_batch(logits, policies)
            except Exception:  # row by row (`draw_batch` gave every row's uniforms back): the failing rows fail
                ids = None
        if ids is not None:  # a row whose bookkeeping raises fails alone (the others' tokens booked once)
            steps = self._per_row(zip(rows, ids), lambda r, tok: book(r.policy, tok))
        else:
            steps = self._per_row(zip(rows, logits), lambda r, lg: r.policy.step(lg))
        self._emit(steps)
        self._charge(rows, t0)

    def _emit(self, steps: list) -> None:
        """The sampled (row, (token or None, done)) pairs: append the tokens, free the slots of finished rows, hand
        the rows to the sink."""
        finished = False
        for r, (tok, done) in steps:
            try:
                if tok is not None:
                    r.tokens.append(tok)
                if done:
                    self._release(r)
                    finished = True
                self.sink.tokens(r, done)
            except Exception as e:
                self._fail(r, e)
        if finished:
            self.running = [r for r in self.running if r.slot is not None]
