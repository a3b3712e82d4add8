"""The token2wav worker: speech tokens -> DiT jobs -> (DiT thread) mel -> (HiFT thread) PCM -> the request's handle.

* `tokens(r, done)` (its TokenSink side, called by the AR worker or a remote token source) turns the hops that are
  due (`HopSchedule`) and the end of the LM into DiT jobs for the `dit` queue; a request's jobs enter it in order.
* DiT thread: `policies.pick_dit_group` builds each call; ONE `flow.inference_batch` per group (the estimator of
  the call's mode from `StageBackends`); the new mel goes to the `hift` queue.
* HiFT thread: streaming jobs advance the requests' `HiFTStream`s together (`push_batch`); offline finals are
  grouped by length and run with the offline vocoder (`StageBackends.hift_offline` or the eager HiFT).
* Output: PCM chunks go to the request's `RequestHandle`. On CUDA the device->host copy runs on a side stream into
  pinned memory and a chunk is handed over once its event has completed (polled), so the next HiFT batch launches
  before the previous audio reaches the host (`async_d2h`).

Every batched call is exact per row and a failing batch is retried row by row (`run_rows`), so a request that
raises fails alone. T_DiT and T_vocoder are each request's share of the batched calls it took part in.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

import numpy as np
import torch

from ..models.flow import FlowInput, check_token_ids
from ..models.hift_stream import push_batch
from ...engines.cuda_graphs import upload
from ..stages.backends import StageBackends
from ..stages.flow_hops import (CachedSolve, cached_dit_fn, finish_cached, flow_rows, hop_runner, plan_hops,
                                release_plans, start_cached, step_cached)
from ..stages.token2wav import Token2Wav, speed_mel
from .ar_worker import Stopped
from .config import SchedulerConfig
from ..stages.flow_steps import FlowStepper
from .policies import hift_offline_groups, pick_dit_group, pick_dit_step, pick_hift_jobs
from .stage_clock import StageClock
from .state import DitJob, HiftJob, RequestState, final_job, first_per_request, hop_job, run_rows
from .stats import BatchCounters, DitCounters


class Token2WavWorker:
    """DiT + HiFT + output for many requests. Queues: `dit` (DitJob), `hift` (HiftJob), `transfers` (D2H copies).

    `more_tokens()`: can more DiT jobs arrive soon (the DiT waits for a fuller batch only then);
    `finish(r, error)`: complete (error None, after its last chunk) or fail a request."""

    def __init__(self, models, backends: StageBackends, config: SchedulerConfig, sample_rate: int, device,
                 clock: StageClock, finish: Callable[[RequestState, BaseException | None], None],
                 more_tokens: Callable[[], bool], flow_cache=None, green=None):
        self.flow, self.hift = models.flow, models.hift
        self.backends = backends
        self.token2wav = Token2Wav(self.flow, self.hift, backends, flow_cache=flow_cache)
        self.config = config
        self.sample_rate = sample_rate
        self.device = torch.device(device)
        self.clock = clock
        self.finish = finish
        self.more_tokens = more_tokens
        self.dit_cond = threading.Condition()
        self.dit: list[DitJob] = []
        self.dit_busy = False
        self.stepper = FlowStepper(self.flow)
        # step-level DiT: id(job) -> (job, its solver state: CachedSolve or FlowSteps) mid-solve
        self.active: dict[int, tuple[DitJob, object]] = {}
        self._hops = None        # the DiT thread's eager cached-hop runner, without cached-hop graphs (`_hop_runner`)
        self._in_flight: deque = deque()  # CUDA events of the DiT steps launched and not yet waited for (`_fence`)
        self.hift_cond = threading.Condition()
        self.hift_queue: list[HiftJob] = []
        self.transfers: deque = deque()  # CUDA: (r, host, event, final, t_launch, rows), FIFO
        self._hift_in_flight: deque = deque()  # CUDA events of vocoder calls launched, not yet waited for
        self.dit_counters, self.hift_counters = DitCounters(), BatchCounters()
        self.stopped = False
        self._pending: list[DitJob] = []  # jobs made by `tokens` in this AR step, queued by `flush`
        self._cuda = self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(self.device) if self._cuda else None
        # dit_green_reserve_sms: the DiT thread and the HiFT thread launch on the streams of an SM partition (`green`:
        # a sm_partition.GreenPartition, its streams made without a priority; the ones the scheduler captured the
        # DiT's and the vocoder's graphs on). Otherwise the DiT on the device's default stream and, with
        # hift_own_stream, the HiFT thread on a stream of its own (None: the DiT's)
        if green is not None:
            self._dit_stream, self._hift_stream = green.dit, green.hift
        else:
            self._dit_stream = None
            self._hift_stream = (torch.cuda.Stream(self.device, priority=-100)
                                 if self._cuda and config.hift_own_stream else None)
        if self._cuda:
            from ..models.hift_stream import warm_decode_windows

            warm_decode_windows(self.hift, batches=tuple(b for b in (1, 2, 4, 8, 16) if b <= config.hift_max_batch))

    # ---------------------------------------------------------------- requests in
    def start(self, r: RequestState) -> None:
        """Before its first tokens: the request's streaming state (prompt on the device already)."""
        if r.req.stream:
            r.stream = self.token2wav.start(*r.prompt)

    def tokens(self, r: RequestState, done: bool) -> None:
        """TokenSink: queue the hops now due and, when the LM is `done`, the final call (from `flush`)."""
        while r.stream is not None and r.stream.ready(len(r.tokens)):
            self._pending.append(hop_job(r))
        if done:
            r.metrics.tokens = len(r.tokens)
            r.handle.tokens = list(r.tokens)
            if r.tokens:
                self._pending.append(final_job(r))
            else:  # the LM stopped at once: no frames to vocode, so empty audio (not a flow error)
                self.finish(r, None)

    def flush(self) -> None:
        jobs, self._pending = self._pending, []
        for j in jobs:
            if j.first:
                j.r.metrics.mark("dit_queued", j.t_enqueue)
        if jobs:
            with self.dit_cond:
                self.dit.extend(jobs)
                self.dit_cond.notify_all()

    def stop(self) -> None:
        self.stopped = True
        for c in (self.dit_cond, self.hift_cond):
            with c:
                c.notify_all()

    def wake(self) -> None:
        with self.dit_cond:
            self.dit_cond.notify_all()

    # ---------------------------------------------------------------- DiT thread
    def dit_loop(self) -> None:
        if self._dit_stream is not None:  # what the set-up left on the default stream (pages, warm-ups) first
            self._dit_stream.wait_stream(torch.cuda.default_stream(self.device))
        with torch.inference_mode(), torch.cuda.stream(self._dit_stream):  # None: the current (default) stream
            while True:
                how, group = self._next_dit_work()
                try:
                    if how == "step":
                        self._run_dit_step(group)
                    else:
                        self._run_dit(group)
                finally:
                    with self.dit_cond:
                        self.dit_busy = bool(self.active)

    @staticmethod
    def _job_cache(job: DitJob):
        """The job's open flow prefix cache, or None. A final hop is a full-attention pass over everything: its
        request's prefix is freed here and it runs without one."""
        cache = None if job.r.stream is None else job.r.stream.flow_cache
        if cache is not None and job.finalize:
            cache.close()
        return None if cache is None or cache.closed else cache

    def describe(self, job: DitJob) -> tuple[str, int]:
        """(kind, cost) of a DiT job for batching: kind "cached" (a streaming hop the flow prefix cache serves: new
        frames against the cached prefix, `forward_cached`), "stream" (a whole-history streaming hop) or "offline"
        (finals and offline requests: full attention); rows of one kind share a call. Cost = the frames it computes
        per CFG row (a cached hop: those past its committed prefix). Mid-solve jobs report their solver's kind."""
        act = self.active.get(id(job))
        if act is not None:
            st = act[1]
            if isinstance(st, CachedSolve):
                return "cached", st.n
            return ("stream" if st.streaming else "offline"), st.row.frames
        if not job.streaming:
            return "offline", job.frames
        cache = None if job.r.stream is None else job.r.stream.flow_cache
        if not job.finalize and cache is not None and not cache.closed:
            return "cached", max(1, job.frames - cache.frames)
        return "stream", job.frames

    def _cap(self, kind: str) -> int:
        """Most requests in one DiT call of `kind`: cached hops up to the largest cached-hop graph bucket."""
        cap = self.config.dit_max_requests
        hops = self.backends.dit_cached
        if kind == "cached" and hops is not None and getattr(hops, "grid", None) is not None:
            cap = min(cap, max(hops.grid.batch))
        return cap

    def _next_dit_work(self) -> tuple[str, list[DitJob]]:
        with self.dit_cond:
            while True:
                if self.stopped:
                    raise Stopped
                self.dit = [j for j in self.dit if not j.r.dead]
                for key in [k for k, (j, _) in self.active.items() if j.r.dead]:
                    self._drop_active(key)
                self._free_prefixes_of_finals()
                now = time.perf_counter()
                if self.config.dit_step_level:
                    group, wait = pick_dit_step(self.dit, [j for j, _ in self.active.values()], self.config, now,
                                                self.more_tokens(), self.describe, self._cap)
                    how = "step"
                else:
                    group, wait = pick_dit_group(self.dit, self.config, now, self.more_tokens(), self.describe,
                                                 self._cap)
                    how = "whole"
                if group:
                    taken = {id(j) for j in group}
                    self.dit = [j for j in self.dit if id(j) not in taken]
                    self._mark_last_hops(group)
                    self.dit_busy = True
                    return how, group
                with self.clock.wait("dit_idle"):
                    self.dit_cond.wait(wait)

    def _mark_last_hops(self, group: list[DitJob]) -> None:
        """(DiT thread, under dit_cond.) A streaming hop that starts now while its request's final is queued with no
        other hop of it left in the queue is the last hop before that final: no later call reads its frames' K/V
        (the final is a full-attention pass over everything), so it commits none to the prefix pool
        (`DitJob.last_hop`). With the AR running ahead of the DiT under load most streams' last hop starts after
        their LM has finished. The same audio."""
        starting = [j for j in group if j.streaming and not j.finalize and id(j) not in self.active]
        if not starting:
            return
        final_next = {id(j.r) for j in self._finals_next()}
        for j in starting:
            if id(j.r) in final_next:
                j.last_hop = True

    def _finals_next(self) -> list[DitJob]:
        """The queued finals that are their request's next queued job (its hops, queued before it, are all taken)."""
        return [j for j in first_per_request(self.dit) if j.finalize]

    def _free_prefixes_of_finals(self) -> None:
        """(DiT thread, under dit_cond.) A stream whose next queued job is its final and that has no hop in flight
        will not read its flow prefix again (the final is a full-attention pass over everything): give its pages
        back now, not when the final starts — finals can wait behind other streams' hops at load, and a full pool
        lets new hops commit nothing (their later hops recompute those frames; run 44: 67 such hops at 12 req/s).
        The same audio."""
        busy = {id(j.r) for j, _ in self.active.values()}
        for j in self._finals_next():
            cache = None if j.r.stream is None else j.r.stream.flow_cache
            if cache is not None and not cache.closed and id(j.r) not in busy:
                cache.close()
                self.dit_counters.prefixes_freed_early += 1

    def _flow_input(self, j: DitJob, cache=None) -> FlowInput:
        """The job's FlowInput with what the host knows (ids checked here, host ids, prompt digest): its DiT calls
        then read nothing back from the device."""
        r = j.r
        if r.inputs_ready is not None and not r.prompt_fenced:  # made on the frontend's stream: wait, keep alive
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(r.inputs_ready)
            for t in r.prompt:
                t.record_stream(stream)
            r.prompt_fenced = True
        ids_checked = r.prompt_ids is not None
        host_ids = None
        if ids_checked:
            check_token_ids(j.tokens, self.flow.cfg.vocab_size)
            host_ids = torch.cat((r.prompt_ids, j.tokens.long()))
        return FlowInput(upload(j.tokens, self.device), *r.prompt, finalize=j.finalize, cache=cache,
                         ids_checked=ids_checked, host_ids=host_ids, prompt_digest=r.prompt_digest,
                         commit=not j.last_hop)

    def _flow_call(self, group: list[DitJob]) -> list[torch.Tensor]:
        """One DiT call for `group` (one kind): prefix-cached hops compute only their new frames (`flow_rows`)."""
        streaming, finalize = group[0].kind
        caches = [self._job_cache(j) for j in group]
        rows = [self._flow_input(j, c) for j, c in zip(group, caches)]
        self.dit_counters.frames_uncached += sum(j.frames for j, c in zip(group, caches) if c is None)
        return flow_rows(self.flow, rows, streaming, self.backends.estimator(streaming), finalize=finalize,
                         hops=self.backends.dit_cached)

    def _run_dit(self, group: list[DitJob]) -> None:
        t0 = time.perf_counter()
        for j in group:
            if j.first:
                j.r.metrics.mark("dit_start", t0)
        with self.clock.span("dit"):
            results = run_rows(self._flow_call, group, self._fail_job)
        if self._cuda:
            with self.clock.wait("dit_fence"):
                self._sync()
        if results:
            self._dit_done(results, (time.perf_counter() - t0) / len(group))
        self.dit_counters.add(len(group))
        self.dit_counters.call(self.describe(group[0])[0], len(group), 1)

    # ------------------------------------------------------------- step-level DiT (SchedulerConfig.dit_step_level)
    def _start_job(self, j: DitJob):
        """The solver state of a job that starts now: a `CachedSolve` (a hop the prefix cache serves), else
        `FlowSteps` (whole-history hop, final, offline request). None when it failed (the request fails)."""
        cache = self._job_cache(j)
        try:
            inp = self._flow_input(j, cache)
            if cache is not None:
                row = self.flow.prepare_row(inp.token, inp.prompt_token, inp.prompt_feat, inp.embedding, False,
                                            inp.ids_checked)
                plans, whole = plan_hops(self.flow, [inp], [row])
                if plans:
                    try:
                        return start_cached(self.flow, plans[0], self._hop_runner())
                    except BaseException:
                        release_plans(plans)
                        raise
            self.dit_counters.frames_uncached += j.frames
            return self.stepper.start(inp, j.streaming, j.finalize)
        except Exception as e:
            self._fail_job(j, e)
            return None

    def _drop_active(self, key: int) -> None:
        _, st = self.active.pop(key)
        if isinstance(st, CachedSolve):
            st.release()

    def _run_dit_step(self, group: list[DitJob]) -> None:
        """One Euler step for the rows of `group` that share the first row's kind (the queued ones start now; rows
        of another kind, e.g. a hop the pool could not serve, wait for their own step); rows that finish their
        last step go on to HiFT. No host sync per step: at most two steps are in flight (`_fence`)."""
        t0 = time.perf_counter()
        rows = []
        for j in group:
            if id(j) not in self.active:
                if j.first:
                    j.r.metrics.mark("dit_start", t0)
                st = self._start_job(j)
                if st is None:
                    continue
                self.active[id(j)] = (j, st)
            rows.append(self.active[id(j)])
        if not rows:
            return
        kind = self.describe(rows[0][0])[0]
        rows = [p for p in rows if self.describe(p[0])[0] == kind]
        if kind == "cached":
            hops = self._hop_runner()

            def step(pairs):  # (a row-by-row retry skips rows a failed batch had already finished)
                live = [st for _, st in pairs if not st.done]
                if live:
                    step_cached(self.flow, live, hops)
                return [None] * len(pairs)
        else:
            est = self.backends.estimator(kind == "stream")

            def step(pairs):
                self.stepper.step([st for _, st in pairs], est)
                return [None] * len(pairs)

        def fail(pair, e):
            self._drop_active(id(pair[0]))
            self._fail_job(pair[0], e)

        with self.clock.span("dit"):
            ok = run_rows(step, rows, fail)
        done = []
        share = (time.perf_counter() - t0) / len(rows)
        for (j, st), _ in ok:
            j.r.metrics.t_dit += share
            if st.done:
                del self.active[id(j)]
                try:
                    if isinstance(st, CachedSolve):  # the whole row's mel: keep the output frames, as FlowSteps
                        row = st.plan.row
                        mel = finish_cached(self.flow, [st])[0][:, :, row.prompt_frames:row.frames]
                    else:
                        mel = st.mel()
                except Exception as e:
                    self._fail_job(j, e)
                    continue
                done.append((j, mel))
        self.dit_counters.add(len(rows))
        self.dit_counters.call(kind, len(rows), 1, steps=True)
        self._fence()
        if done:
            self._dit_done(done, 0.0)

    def _hop_runner(self):
        """What runs cached hops: the backends' cached-hop graphs, else eager calls of the pipeline's DiT variant
        (`flow_hops.hop_runner`: the flow's runner for this thread, the DiT thread; kept here, off the step path)."""
        if self.backends.dit_cached is not None:
            return self.backends.dit_cached
        if self._hops is None:
            self._hops = hop_runner(self.flow, None, cached_dit_fn(self.flow, self.backends.estimator(True)))
        return self._hops

    def _fence(self) -> None:
        """CUDA: let the host run `dit_steps_ahead` DiT steps ahead of the GPU (it plans the next step while the
        launched ones run), never more (a newly ready hop must not queue behind many launched steps). The mel of a
        finished row goes to the HiFT thread before its last step has completed on the GPU: HiFT runs on the same
        stream, after it (or waits for it by event: `hift_own_stream`)."""
        if self._cuda:
            self._bound_in_flight(self._in_flight, self.config.dit_steps_ahead, "dit_fence")

    def _bound_in_flight(self, in_flight: deque, ahead: int, wait: str, after_wait=None) -> None:
        """Record an event on the current stream into `in_flight`, then wait (counted as `wait` in the clock) for the
        oldest events until at most `ahead` remain, calling `after_wait` after each: the DiT's and the vocoder's
        fences."""
        ev = torch.cuda.Event()
        ev.record()
        in_flight.append(ev)
        if len(in_flight) > ahead:
            with self.clock.wait(wait):
                while len(in_flight) > ahead:
                    in_flight.popleft().synchronize()
                    if after_wait is not None:
                        after_wait()

    def _dit_done(self, results: list[tuple[DitJob, torch.Tensor]], share: float) -> None:
        """Finished DiT jobs: their new mel to the HiFT queue."""
        now = time.perf_counter()
        out = []
        for j, mel in results:
            j.r.metrics.t_dit += share
            if j.first:
                j.r.metrics.mark("dit_end", now)
            if j.r.stream is not None:
                j.r.stream.chunks += 1
            mel = mel[:, :, j.mel_from:]
            if j.finalize and j.r.stream is None:  # offline: `Request.speed`, as upstream (and Pipeline.run)
                mel = speed_mel(mel, getattr(j.r.req, "speed", 1.0))
            out.append(HiftJob(j.r, mel, j.finalize, now))
        if self._hift_stream is not None and out:  # one event after the work that made these mels
            ev = torch.cuda.Event()
            ev.record()
            for h in out:
                h.ready = ev
        with self.hift_cond:
            self.hift_queue.extend(out)
            self.hift_cond.notify_all()

    def _fail_job(self, job, e: BaseException) -> None:
        self.finish(job.r, e)

    def _sync(self) -> None:
        if self._cuda:
            ev = torch.cuda.Event()
            ev.record()
            ev.synchronize()

    # ---------------------------------------------------------------- HiFT thread
    def hift_loop(self) -> None:
        if self._dit_stream is not None:  # an SM partition's streams: the set-up's default-stream work first
            self._hift_stream.wait_stream(torch.cuda.default_stream(self.device))
        with torch.inference_mode(), torch.cuda.stream(self._hift_stream):  # None: the current (default) stream
            while True:
                jobs = self._next_hift_jobs()
                if jobs:
                    with self.clock.span("hift"):
                        self._run_hift(jobs)
                    self._hift_fence()
                self._drain_transfers()

    def _hift_fence(self) -> None:
        """CUDA with `hift_calls_ahead` > 0: at most that many vocoder calls launched and not yet seen complete; the
        host waits for the oldest (handing over the chunks whose copies completed meanwhile), so the rest of the
        ready windows queue on the host, where `pick_hift_jobs` orders and groups them, not on the GPU stream."""
        ahead = self.config.hift_calls_ahead
        if self._cuda and ahead > 0:  # events on the HiFT thread's stream (hift_loop's current stream)
            self._bound_in_flight(self._hift_in_flight, ahead, "hift_fence", self._drain_transfers)

    def _dit_active(self) -> bool:
        return bool(self.dit_busy or self.dit or self.active)

    def _next_hift_jobs(self) -> list[HiftJob]:
        with self.hift_cond:
            while True:
                self._drain_transfers()
                if self.stopped:
                    raise Stopped
                self.hift_queue = [j for j in self.hift_queue if not j.r.dead]
                jobs, wait = pick_hift_jobs(self.hift_queue, self.config, time.perf_counter(), self._dit_active())
                if jobs:
                    taken = {id(j) for j in jobs}
                    self.hift_queue = [j for j in self.hift_queue if id(j) not in taken]
                    return jobs
                if self.transfers:  # CUDA copies in flight: poll their events
                    wait = 0.0005 if wait is None else min(wait, 0.0005)
                with self.clock.wait("hift_idle"):
                    self.hift_cond.wait(wait)

    def _run_hift(self, jobs: list[HiftJob]) -> None:
        if self._hift_stream is not None:  # the mels come from the DiT's stream: wait for exactly their steps
            for j in jobs:
                if j.ready is not None:
                    self._hift_stream.wait_event(j.ready)
                j.mel.record_stream(self._hift_stream)  # not reused by the DiT's allocations while HiFT reads it
        streams = [j for j in jobs if j.r.stream is not None]
        offline = [j for j in jobs if j.r.stream is None]
        if streams:
            snapshots = {id(j): vars(j.r.stream.hift_stream).copy() for j in streams}

            def restore(j):  # push_batch only rebinds attributes, so a shallow copy undoes a failed batch
                vars(j.r.stream.hift_stream).update(snapshots[id(j)])

            def push(group):
                return push_batch([j.r.stream.hift_stream for j in group], [j.mel for j in group],
                                  [j.final for j in group])
            self._vocode(push, streams, restore)
        if offline:
            vocoder = self.backends.hift_offline or self.hift
            for idx in hift_offline_groups([j.mel.shape[2] for j in offline], self.config):
                self._vocode(lambda g: vocoder.inference_batch([j.mel for j in g], finalize=True),
                             [offline[i] for i in idx])

    def _vocode(self, call, group: list[HiftJob], restore=None) -> None:
        t0 = time.perf_counter()
        results = run_rows(call, group, self._fail_job, before_retry=restore)
        self.hift_counters.add(len(group))
        for j, wav in results:
            self._output(j.r, wav.reshape(-1), j.final, t0, len(group))

    # ---------------------------------------------------------------- output
    def _output(self, r: RequestState, wav: torch.Tensor, final: bool, t_launch: float, rows: int) -> None:
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
        self.transfers.append((r, host, ev, final, t_launch, rows))

    def _drain_transfers(self) -> None:
        """Hand over the chunks whose device->host copy has completed (copies complete in FIFO order)."""
        while self.transfers and self.transfers[0][2].query():
            r, host, _, final, t_launch, rows = self.transfers.popleft()
            r.metrics.t_vocoder += (time.perf_counter() - t_launch) / rows
            self._deliver(r, host.numpy().copy(), final)

    def _deliver(self, r: RequestState, pcm: np.ndarray, final: bool) -> None:
        if r.dead:
            return
        r.metrics.mark_chunk(pcm.size, self.sample_rate)
        r.handle._put(pcm)
        if final:
            self.finish(r, None)
