"""The scheduler: wires the workers with named queues and owns the request lifecycle.

A request after `Scheduler.submit`:

    submit ─> Lifecycle.admit (AdmissionControl) ─> FrontendPool (prepare: tokenizer, LM input, flow prompt, policy)
      ─> ARWorker.waiting   (admission queue)  ─> ARWorker: prefill / decode via the ARRunner, sample_batch
      ─> Token2WavWorker.tokens (hop / final DiT jobs) ─> .dit queue ─> DiT thread (flow.inference_batch)
      ─> .hift queue ─> HiFT thread (push_batch / offline vocoder) ─> .transfers (CUDA D2H) ─> RequestHandle

Per request the audio is exactly what `Pipeline.run` gives for the same seed: every batched call is exact per row and
each request's jobs run strictly in order (one job per request per batch). A request that raises in any stage fails
alone. Timings: T_AR, T_DiT and T_vocoder are each request's share of the batched calls it took part in (call time /
rows in the call), T_queue is submit -> AR admission minus T_tokenizer.

A Scheduler is cheap to build over an existing `ARRunner` and `StageBackends` (the graphs, caches and engines live
there): to compare batching policies, build one Scheduler per SchedulerConfig over the same runner and backends.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable

import torch

from ...engines.errors import InputError
from ..stages.ar_runner import ARRunner, default_max_len
from ..stages.backends import StageBackends
from .admission import AdmissionControl, Ticket
from .ar_process import ARProcess, RemoteARWorker
from .ar_runners import enable_for, torch_ar_runner
from .ar_worker import ARWorker, Stopped
from .config import SchedulerConfig
from .handle import RequestHandle
from .lifecycle import FrontendPool, Lifecycle
from .policies import POLICIES, dit_order, playback_slack  # noqa: F401 - re-exported
from .prepare import VoiceMemo, flow_prompt, lm_input, runner_ids, token_policy
from ..stages.request import Request, RequestMetrics, prepare_inputs
from .stage_clock import StageClock
from .state import RequestState
from .stats import QueueDepths, SchedulerStats
from .token2wav_worker import Token2WavWorker

__all__ = ["Scheduler", "SchedulerConfig", "RequestHandle", "POLICIES", "AR_RUNNER_FIELDS", "ar_runner_differences",
           "make_ar_runner", "start_workers", "collect_stats"]


# the SchedulerConfig fields make_ar_runner reads: schedulers over one AR runner must agree on them
AR_RUNNER_FIELDS = ("ar_decode_attention", "ar_graph_batches", "ar_max_batch", "ar_max_len", "ar_max_prefill_tokens",
                    "ar_prefill_graph_batches", "ar_prefill_graph_lengths", "ar_process", "batch_invariant", "compile",
                    "cuda_graphs")


def ar_runner_differences(a: SchedulerConfig, b: SchedulerConfig) -> list[str]:
    """The AR_RUNNER_FIELDS on which two configs differ (empty: one AR runner serves both)."""
    return [f for f in AR_RUNNER_FIELDS if getattr(a, f) != getattr(b, f)]


def make_ar_runner(models, config: SchedulerConfig, device, engine_set=None, compile_cache: str | None = None):
    """The AR runner a SchedulerConfig describes: the PyTorch LM (KV slots, CUDA-graph ladders, compile), the
    TensorRT-LLM engine of `engine_set` (an opened engine set, `StageBackends.engine_set`) when its manifest says
    `ar_runner: trtllm` (the set was checked for it when opened), or with `ar_process` an `ARProcess`: the PyTorch
    LM's runner in a child process (`compile_cache`: a file of the child's compiled code, loaded there first)."""
    cfg = config
    max_len = cfg.ar_max_len or default_max_len(models)
    if engine_set is not None:
        from ..stages.engine_set import LoadedEngineSet

        if isinstance(engine_set, LoadedEngineSet) and engine_set.ar_runner == "trtllm":
            if cfg.ar_process:
                raise InputError("SchedulerConfig.ar_process runs the PyTorch LM in a process of its own; this engine "
                                 "set's AR is a TensorRT-LLM engine (its executor has its own workers): leave "
                                 "ar_process off")
            from ..stages.ar_trtllm import TrtllmARRunner

            return TrtllmARRunner.from_engine_set(engine_set.folder, engine_set.manifest, cfg.ar_max_batch,
                                                  max_len, device)
    if cfg.ar_process:  # the LM and this runner in a child process (ar_process.py; its torch_ar_runner there)
        return ARProcess(models.llm, cfg, device, max_len, compile_cache)
    return torch_ar_runner(models.llm, cfg, device, max_len)


FAST_GIL_SWITCH_S = 0.0005
_FAST_GIL = {"users": 0, "saved": None}
_FAST_GIL_LOCK = threading.Lock()


def use_fast_gil_switch(delta: int) -> None:
    """`SchedulerConfig.fast_gil_switch`: a scheduler registers (+1) when it starts and unregisters (-1) when it
    closes; while any is registered the interpreter switches threads every FAST_GIL_SWITCH_S at most
    (`sys.setswitchinterval`), and the interval from before the first comes back when the last closes — whatever
    order overlapping schedulers close in."""
    import sys

    with _FAST_GIL_LOCK:
        if delta > 0:
            if _FAST_GIL["users"] == 0:
                _FAST_GIL["saved"] = sys.getswitchinterval()
                sys.setswitchinterval(min(_FAST_GIL["saved"], FAST_GIL_SWITCH_S))
            _FAST_GIL["users"] += 1
        elif _FAST_GIL["users"] > 0:
            _FAST_GIL["users"] -= 1
            if _FAST_GIL["users"] == 0:
                sys.setswitchinterval(_FAST_GIL["saved"])
                _FAST_GIL["saved"] = None


def start_workers(loops: list[tuple[str, Callable[[], None]]], lifecycle: Lifecycle) -> list[threading.Thread]:
    """One daemon thread per worker loop; a loop that dies of an unexpected error fails every live request."""
    def guard(loop):
        try:
            loop()
        except Stopped:
            pass
        except BaseException as e:  # a scheduler bug: nobody must wait forever
            lifecycle.fail_all(RuntimeError(f"scheduler worker {threading.current_thread().name} died: {e!r}"),
                               dead=f"worker {threading.current_thread().name} died: {e!r}")
            raise
    threads = [threading.Thread(target=guard, args=(fn,), name=f"cosytrt-{name}", daemon=True) for name, fn in loops]
    for t in threads:
        t.start()
    return threads


def compile_count() -> int:
    from ..stages.compiled import compiled_graph_count

    return compiled_graph_count()


def collect_stats(lifecycle: Lifecycle, frontend: FrontendPool, clock: StageClock,
                  ar: "ARWorker | RemoteARWorker | None" = None,
                  t2w: Token2WavWorker | None = None, backends: StageBackends | None = None,
                  compiles_at_start: int | None = None) -> SchedulerStats:
    """The typed stats of a wiring of workers (absent workers count zero)."""
    lc = lifecycle
    with lc.lock:
        st = SchedulerStats(in_flight=lc.in_flight, closing=lc.closing, **lc.counts)
    st.admission = lc.admission.snapshot()
    st.shed = st.admission.get("shed", 0)  # the admission control's (the server's refusals too)
    st.stream_lag_s = lc.worst_stream_lag()
    st.queues = QueueDepths(frontend=frontend.pending)
    snap = ar.snapshot() if ar is not None else {}  # (the AR process's, asked there, under ar_process)
    if ar is not None:
        st.queues.ar_waiting, st.queues.ar_running = snap["waiting"], snap["running"]
        st.ar_runner, st.ar = snap["runner"], snap["counters"]
    if t2w is not None:
        st.queues.dit, st.queues.hift, st.queues.output = len(t2w.dit), len(t2w.hift_queue), len(t2w.transfers)
        st.dit, st.hift = t2w.dit_counters, t2w.hift_counters
    if backends is not None and backends.shape_stats is not None:
        st.shapes = backends.shape_stats.summary()
    # compile=True: torch.compile graphs compiled since the scheduler was ready (each stalled serving; expected 0)
    st.compiles_since_start = 0 if compiles_at_start is None else compile_count() - compiles_at_start
    st.busy_s = {**clock.busy_s(), **snap.get("busy_s", {})}  # CUDA: GPU time of each stage's batches; CPU: wall
    st.host_s = {**clock.host_s(), **snap.get("host_s", {})}  # the worker threads' wall / CPU seconds inside them
    st.waits_s = clock.waits_s()  # and their waits outside them (DiT fence, idle DiT / HiFT threads)
    return st


def kv_form(cfg: SchedulerConfig, device: torch.device) -> str:
    """The cached hops' K / V form (`CachedHopGraphs.use_kv_form`) for this config: `dit_paged_prefix` (None: where
    the paged attention's Triton kernel runs on `device`), else per-layer inputs or the stacked form."""
    paged = cfg.dit_paged_prefix
    if paged is None:
        from ..models import hop_attention

        paged = hop_attention.compiled_on(device)
    return "paged" if paged else "layers" if cfg.dit_kv_layer_inputs else "stacked"


class Scheduler:
    """Runs many requests through one `Pipeline`'s models with batching across requests (see module docstring).

    `runner`: the AR runner (default: `make_ar_runner` from `config` and the backends' engine set, closed with the
    scheduler); `backends`: what runs DiT / HiFT (default: the pipeline's); `admission`: the control that admits
    requests (default: one from `config`; a TTS passes its own, which its server asks too). `on_finish(metrics)`
    (optional) is called once per request when it completes, fails or is cancelled."""

    def __init__(self, pipeline, config: SchedulerConfig | None = None,
                 on_finish: Callable[[RequestMetrics], None] | None = None, *, runner: ARRunner | None = None,
                 backends: StageBackends | None = None, admission: AdmissionControl | None = None):
        self.pipeline = pipeline
        self.config = cfg = config or SchedulerConfig()
        models = pipeline.models
        self.lm = models.llm
        self.device = torch.device(pipeline.device)
        self.sample_rate = pipeline.sample_rate
        self.backends = backends if backends is not None else pipeline.backends
        self._owns_runner = runner is None
        # where a start's seconds go (stats()["setup_s"]): the AR runner (its compile, decode / prefill graphs), the
        # prefix pool's pages, the cached-hop graphs (a GPU set-up took 80-256 s: BENCHMARKS.md runs 36, 41)
        self.setup_s: dict[str, float] = {}
        self.runner = None
        self.flow_cache = None  # FlowCachePool shared by the streams' prefix states
        # process-wide switches this scheduler registered for, each given back on close (see below)
        self._process_switches: list[Callable[[int], None]] = []
        self._green = None  # the DiT / HiFT streams' SM partition (dit_green_reserve_sms)
        try:
            self._start(models, cfg, runner, on_finish, admission)
        except BaseException:  # a failed start gives back what it took: the process's switches (a DiT conv
            self._release()  # left switched broke every later scheduler of a bench process: run 66)
            raise

    def _start(self, models, cfg: SchedulerConfig, runner, on_finish, admission) -> None:
        """The stages, the caches and graphs, the worker threads (`__init__`; undone by `_release` if it fails)."""
        t = time.perf_counter()
        self.runner = runner if runner is not None else make_ar_runner(models, cfg, self.device,
                                                                       self.backends.engine_set)
        self.remote_ar = isinstance(self.runner, ARProcess)  # the AR in its own process: set up there on attach
        if cfg.ar_process != self.remote_ar:
            raise InputError(f"SchedulerConfig.ar_process is {cfg.ar_process} but the AR runner given is "
                             f"{'' if self.remote_ar else 'not '}an AR process")
        enable_for(self.runner, cfg)
        self.setup_s["ar_runner"] = time.perf_counter() - t
        self.ar_max_len = self.runner.max_len
        self._compiles_at_start = compile_count() if cfg.compile else None

        if cfg.dit_conv:  # before the cached-hop graphs are captured below: they bake the conv implementation in
            from ..models import dit_conv

            self._process_switches.append(dit_conv.use(cfg.dit_conv))
        if cfg.dit_green_reserve_sms:  # the DiT / HiFT streams' SM partition (CUDA only: refused elsewhere), made
            from .sm_partition import green_streams  # before the cached-hop graphs: captured on its DiT stream

            self._green = green_streams(self.device, cfg.dit_green_reserve_sms, cfg.hift_own_stream)
        if self.device.type == "cuda":  # graphs replay confined only where they were captured (run 67): the DiT's
            from ...engines.cuda_graphs import capture_group_on  # and vocoder's go to the partition's streams (or

            g = self._green  # back to streams of their own without one); the cached-hop graphs are captured below
            dit_s, hift_s = (g.dit, g.hift) if g is not None else (None, None)
            t = time.perf_counter()
            if capture_group_on("dit", self.device, dit_s) + capture_group_on("hift", self.device, hift_s):
                self.setup_s["graphs_recaptured"] = time.perf_counter() - t
            if self.backends.dit_cached is not None and hasattr(self.backends.dit_cached, "use_capture_stream"):
                self.backends.dit_cached.use_capture_stream(dit_s)
        use_cache = cfg.flow_prefix_cache
        if use_cache is None:  # auto: where cached hops have CUDA graphs
            use_cache = self.backends.dit_cached is not None
        self.flow_prefix_cache = use_cache
        if use_cache:
            from ..stages.flow_cache import FlowCachePool, default_budget, model_fingerprint
            from ..stages.flow_hops import step_consts

            # the weights fingerprint every cached hop checks its prefix against (hashed once, then memoized): now,
            # not in the first request's first hop (42 ms of its time to first audio at full size on the H200)
            flow = models.flow
            t = time.perf_counter()
            model_fingerprint(flow)
            self.setup_s["flow_fingerprint"] = time.perf_counter() - t
            hops = self.backends.dit_cached
            budget = cfg.flow_cache_budget_bytes
            if budget is None:  # leaves room for the cached-hop graphs, captured below
                budget = default_budget(self.device, graphs_pending=hops is not None)
            t = time.perf_counter()
            self.flow_cache = FlowCachePool(budget, prompt_cache=cfg.flow_prompt_cache)
            store = self.flow_cache.storage(flow)  # the pages, before the graphs that bake in their addresses
            self.setup_s["flow_cache_pages"] = time.perf_counter() - t
            if hops is not None and store is not None:  # capture the graphs now, not in the first requests' hops
                t = time.perf_counter()
                hops.use_kv_form(kv_form(cfg, self.device))
                hops.capture_all(store, step_consts(flow, flow.rand_noise.device, flow.rand_noise.dtype))
                self.setup_s["cached_hop_graphs"] = time.perf_counter() - t
        # process-wide switches this scheduler registered for (CUDA only), each given back on close: the short GIL
        # switch interval (fast_gil_switch) and the event read-back of the sampled ids (ar_event_sync)
        if self.device.type == "cuda":
            from ..models.sampling import use_event_sync

            ar_sync = cfg.ar_event_sync and not self.remote_ar  # (the AR process sets its own)
            for on, use in ((cfg.fast_gil_switch, use_fast_gil_switch), (ar_sync, use_event_sync)):
                if on:
                    use(+1)
                    self._process_switches.append(use)
        self.clock = StageClock(self.device.type == "cuda")  # busy time per stage (stats()["busy_s"])
        # CUDA: the frontend's uploads and LM-input embeddings run on a stream of their own, so a new request's
        # inputs do not queue behind the DiT / HiFT work on the default stream (its AR prefill and first DiT call
        # wait for exactly them, by event)
        self._frontend_stream = (torch.cuda.Stream(self.device, priority=-100) if self.device.type == "cuda"
                                 else None)
        self.voices = VoiceMemo()  # a saved voice's prompt uploads, digest and LM prompt embeddings, made once
        self.requests = Lifecycle(cfg, on_finish, on_dead=self._on_dead, admission=admission)
        self.admission = self.requests.admission
        self.token2wav = Token2WavWorker(models, self.backends, cfg, self.sample_rate, self.device, self.clock,
                                         self.requests.finish, more_tokens=self._more_tokens,
                                         flow_cache=self.flow_cache, green=self._green)
        if self.remote_ar:
            self.ar = RemoteARWorker(self.runner, cfg, self.token2wav, self.requests.finish)
        else:
            self.ar = ARWorker(self.runner, cfg, self.token2wav, self.requests.finish, self.clock, self.device)
        self.frontend = FrontendPool(cfg.frontend_workers, self._prepare, self.ar.put, self.requests.finish)
        self._threads = start_workers([("ar", self.ar.loop), ("dit", self.token2wav.dit_loop),
                                       ("hift", self.token2wav.hift_loop)], self.requests)

    # ================================================================== public API
    def submit(self, req: Request, lease: Ticket | None = None, after: RequestHandle | None = None) -> RequestHandle:
        """Queue a request; returns at once (or after waiting for admission, see `SchedulerConfig.on_full`).
        `lease`: a ticket of `self.admission` the caller holds; the request then takes no slot of its own.
        `after`: the handle of the request whose audio the same listener plays right before this one's (a
        conversation's previous sentence): the DiT's playback-slack priority then knows when this one is needed
        (ordering only, the audio is the same).

        Raises RejectedError when the scheduler is closed or full (admission.py's QueueFullError /
        AdmissionTimeoutError). Input errors (bad prompt, too long for the noise
        buffers: RequestTooLongError) are raised by the handle, before any model work."""
        r = self.requests.admit(req, lease=lease, after=after)
        self.frontend.submit(r)
        return r.handle

    @property
    def healthy(self) -> bool:
        """False once a worker thread has died (the scheduler then rejects every submit) or it is closing."""
        return self.requests.dead is None and not self.requests.closing

    @property
    def failure(self) -> str | None:
        """Why the scheduler is not healthy: the dead worker's error, else None."""
        return self.requests.dead

    def stats(self) -> dict:
        """`typed_stats().to_dict()`: counters, queue depths, AR / DiT / HiFT batch sizes, busy time per stage."""
        return self.typed_stats().to_dict()

    def typed_stats(self) -> SchedulerStats:
        st = collect_stats(self.requests, self.frontend, self.clock, self.ar, self.token2wav, self.backends,
                           self._compiles_at_start)
        st.setup_s = {k: round(v, 3) for k, v in self.setup_s.items()}
        if self._green is not None:
            st.sm_partition = {"dit_hift_sms": self._green.sms, "device_sms": self._green.total_sms}
        if self.flow_cache is not None:
            st.flow_cache = self.flow_cache.stats()
            if self.backends.dit_cached is not None:
                st.flow_cache["hop_graphs"] = self.backends.dit_cached.stats()
        return st

    def close(self, drain_timeout_s: float = 30.0) -> None:
        """Stop accepting requests, let in-flight ones finish (up to `drain_timeout_s`), then stop the workers;
        requests still unfinished then fail with RejectedError. Closes the AR runner if this scheduler built it."""
        self.requests.drain(drain_timeout_s)
        self.ar.stop()
        self.token2wav.stop()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=10)
        self.frontend.shutdown()
        self._release()

    def _release(self) -> None:
        """What the scheduler holds beyond its threads, given back (`close`, or a failed `_start`, which may have
        made only part of it): the AR runner it built, the prefix pool's pages and the cached-hop graphs that read
        them, the process-wide switches."""
        if self._owns_runner and self.runner is not None:
            self.runner.close()
        if self.flow_cache is not None:  # the pages and the cached-hop graphs that read them
            if self.backends.dit_cached is not None:
                self.backends.dit_cached.release(self.flow_cache.store)
            self.flow_cache.close()
        while self._process_switches:
            self._process_switches.pop()(-1)
        if self._green is not None:  # the DiT / HiFT streams' SM partition: its streams drained; the context stays
            self._green.close()     # for the process (sm_partition: the allocator's blocks and the graphs' pools)

    # ================================================================== wiring
    def _on_dead(self, r: RequestState) -> None:
        if r.stream is not None and r.stream.flow_cache is not None:
            r.stream.flow_cache.close()  # its prefix K/V back to the pool
        self.ar.wake()  # the AR worker frees the slot of a dead running row

    def _frontend_stream_ctx(self):
        if self._frontend_stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self._frontend_stream)

    def _more_tokens(self) -> bool:
        """Can more DiT jobs arrive soon?"""
        return bool(self.ar.active() or self.frontend.pending)

    def _prepare(self, r: RequestState) -> None:
        t0 = time.perf_counter()
        inputs = prepare_inputs(self.pipeline.frontend, r.req, self.pipeline.default_speaker)
        r.metrics.t_tokenizer = time.perf_counter() - t0
        r.metrics.mark("tokenized")
        # a saved voice's (or the default voice's) prompt comes back request after request: its per-voice work is
        # memoized; a request's own prompt audio is used once and stays out of the memo
        memo = self.voices if r.req.prompt_wav is None else None
        with self._frontend_stream_ctx():
            flow_prompt(r, inputs, self.device, memo)
            if not self.remote_ar:
                lm_input(r, inputs, self.lm, self.device, memo)
        self.pipeline._check_noise(inputs, r.req)
        room = self.pipeline.noise_room(inputs)
        if self.remote_ar:  # the LM input, its ids and the token policy are made in the AR process
            r.inputs, r.noise_room = inputs, room
        else:
            runner_ids(r, inputs, self.runner)
            token_policy(r, inputs, self.lm, self.ar_max_len, noise_room=room)
        self.token2wav.start(r)
        r.metrics.mark("frontend_done")
