"""The library entry point: `from cosytrt.runtime import TTS`.

    tts = TTS.load(model="tiny", engines=None, device="cpu")
    wav = tts.synthesize("Hello there.", seed=0)            # float32 PCM at tts.sample_rate
    for chunk in tts.stream("Hello there.", seed=0): ...     # streaming PCM chunks
    h = tts.submit("Hello there.", seed=0); wav = h.result()  # a RequestHandle (also chunks() / achunks())

Every request runs through one `Scheduler` (created on first use), so concurrent callers (threads or asyncio) are
batched together. `tts.pipeline` stays the eager single-request reference path.
"""
from __future__ import annotations

import collections
import threading
from typing import AsyncIterator, Iterator

import numpy as np
import torch

from ..engines.errors import InputError
from .models.frontend import SavedSpeaker, save_speaker
from .stages.pipeline import Pipeline, make_frontend
from .stages.request import Request, RequestMetrics
from .models.sampling import SamplingParams
from .scheduling.admission import AdmissionControl, Ticket
from .scheduling.config import SchedulerConfig
from .scheduling.handle import RequestHandle
from .scheduling.scheduler import Scheduler

HISTORY_WINDOW = 4096  # finished requests kept for metrics() / export_metrics() (a sliding window)

_SAMPLING_KEYS = {"top_p", "top_k", "win_size", "tau_r", "seed", "greedy", "max_tokens", "min_tokens", "force_tokens"}


def make_request(text: str, *, prompt_wav=None, prompt_sr=None, prompt_text=None, instruct=None, speaker=None,
                 stream: bool = False, speed: float = 1.0, buffered_s: float = 0.0, **sampling) -> Request:
    unknown = set(sampling) - _SAMPLING_KEYS
    if unknown:
        raise InputError(f"unknown synthesis option(s): {sorted(unknown)}")
    return Request(text=text, prompt_wav=prompt_wav, prompt_sr=prompt_sr, prompt_text=prompt_text,
                   instruct=instruct, speaker=speaker, stream=stream, sampling=SamplingParams(**sampling), speed=speed,
                   buffered_s=buffered_s)


class TTS:
    """CosyVoice3 synthesis over eager models or an engine set; thread-safe, every request goes through the
    scheduler."""

    def __init__(self, pipeline: Pipeline, engines: str | None = None, scheduler: SchedulerConfig | None = None,
                 history_window: int = HISTORY_WINDOW):
        self.pipeline = pipeline
        self.engines = engines
        self.sample_rate = pipeline.sample_rate
        self.scheduler_config = scheduler or SchedulerConfig()
        # the single-request path (pipeline.run) decodes with the scheduler's LM kernels: one seed, one token stream
        llm = getattr(getattr(pipeline, "models", None), "llm", None)
        if llm is not None and hasattr(llm, "batch_invariant"):
            llm.batch_invariant = self.scheduler_config.batch_invariant
        if llm is not None and hasattr(llm, "decode_attention_impl"):
            llm.decode_attention_impl = self.scheduler_config.decode_attention_for(getattr(pipeline, "device", "cpu"))
        # the one admission control of this TTS: its scheduler admits through it, and so does a server over it
        self.admission = AdmissionControl.from_config(self.scheduler_config)
        self._scheduler: Scheduler | None = None
        self._ar_runner = None
        self.ar_compile_cache: str | None = None  # ar_process: the AR process's own compile cache file (TTS.load)
        self._lock = threading.Lock()
        # the last `history_window` finished requests: memory and metrics() cost stay bounded on a long-running server
        self._history: collections.deque[RequestMetrics] = collections.deque(maxlen=max(1, int(history_window)))
        self.requests_finished = 0  # every request ever finished (the window drops the oldest)

    @classmethod
    def load(cls, model: str = "tiny", engines: str | None = None, device: str = "cpu",
             dtype: torch.dtype | None = None, scheduler: SchedulerConfig | None = None,
             cuda_graphs: bool | str = True, compile: bool | str = False,
             compile_cache: str | None = None) -> "TTS":
        """`cuda_graphs` (CUDA only): capture the eager DiT / offline HiFT per bucket of a profile when no engine set
        is given (True: `h200-graphs` for full-size models, `tiny` otherwise; or a profile name/path). AR decode graphs
        are the scheduler's (SchedulerConfig.cuda_graphs). `compile`: torch.compile the AR prefill / decode step and
        (without an engine set) the DiT; on CUDA the compiled functions are what the graphs capture; "regional" (or
        "whole", = True): how the DiT is compiled (`stages.compiled.set_compile_scope`, process-wide); "ar": the LM
        only, the DiT / HiFT as eager modules in CUDA graphs (the benchmarks' `graphs_ar` variant: BENCHMARKS.md runs
        29-39; a shorter start-up). Everything is
        compiled here, not at the first request (minutes for the full-size model on a cold cache); `compile_cache`
        (a file) is loaded first when it exists and (re)written afterwards, so restarts reuse the compiled code (with
        `SchedulerConfig.ar_process`, the AR process's own compiled code goes to `compile_cache + ".ar"`).
        `engines` may also be a `compiled` engine set (`trtbuild build --backend compiled`): its cache is checked and
        loaded first, then the model is compiled with the set's CUDA-graph profile and dtype (cache hits: no
        Inductor compile work at start-up)."""
        import dataclasses

        from .stages.compiled import AR_ONLY, set_compile_scope

        ar_only = compile == AR_ONLY  # the LM only; the DiT / HiFT stay eager modules (in CUDA graphs on CUDA)
        if isinstance(compile, str) and not ar_only:
            set_compile_scope(compile)
        compile = bool(compile)
        compiled_set = None
        if engines is not None:  # a `compiled` set (torch.compile's cache): loaded first, then compile as usual
            from .stages.engine_set import open_compiled_set

            compiled_set = open_compiled_set(engines, device)
            if compiled_set is not None:
                compile, cuda_graphs = True, compiled_set.profile_path
                dtype = dtype if dtype is not None or not str(device).startswith("cuda") else compiled_set.dtype
        if compile_cache is not None:
            if not compile:
                raise InputError("compile_cache needs compile=True")
            import os

            from .stages.compiled import load_compile_cache

            if os.path.isfile(compile_cache):
                load_compile_cache(compile_cache)
        pipeline = Pipeline.load(model, device=device, dtype=dtype)
        models = pipeline.models
        if compiled_set is not None:
            compiled_set.check_model(models)
            pipeline.compiled_set = compiled_set
        if engines is not None and compiled_set is None:
            from .stages.engine_set import engine_set_backends

            pipeline.set_backends(engine_set_backends(models, engines, str(pipeline.device)))
        elif cuda_graphs and pipeline.device.type == "cuda":
            from .stages.engine_set import cuda_graph_backends
            from .stages.profile import load_profile

            name = cuda_graphs if isinstance(cuda_graphs, str) else (
                "h200-graphs" if models.config.flow.dit.dim >= 1024 else "tiny")
            pipeline.set_backends(cuda_graph_backends(models, pipeline.device, load_profile(name),
                                                      compile=compile and not ar_only))
        elif compile and not ar_only:
            from .stages.compiled import compiled_backends

            pipeline.set_backends(compiled_backends(models))
        if not compile:
            return cls(pipeline, engines, scheduler)
        tts = cls(pipeline, engines, dataclasses.replace(scheduler or SchedulerConfig(), compile=True))
        if compile_cache is not None:  # ar_process: the AR process compiles the LM; its code has a file of its own
            tts.ar_compile_cache = compile_cache + ".ar"
        tts.synthesize("Warm up.", seed=0, force_tokens=8)  # starts the scheduler: every compile happens now
        list(tts.stream("Warm up.", seed=0, force_tokens=8))
        with tts._lock:  # the warm-up (compile time) is not serving: keep it out of metrics()
            tts._history.clear()
        if compile_cache is not None:
            from .stages.compiled import save_compile_cache

            save_compile_cache(compile_cache)
            if tts.scheduler_config.ar_process:
                tts.ar_runner.save_compile_cache(tts.ar_compile_cache)
        return tts

    @property
    def scheduler(self) -> Scheduler:
        """The request scheduler (started on first use)."""
        with self._lock:
            if self._scheduler is None:
                self._scheduler = Scheduler(self.pipeline, self.scheduler_config, self._record, runner=self.ar_runner,
                                            admission=self.admission)
            return self._scheduler

    @property
    def ar_runner(self):
        """The AR runner (KV slots, decode / prefill graphs, compiled LM) every scheduler of this TTS runs on;
        built with the first scheduler, closed by `close()`."""
        if self._ar_runner is None:
            from .scheduling.scheduler import make_ar_runner

            self._ar_runner = make_ar_runner(self.pipeline.models, self.scheduler_config, self.pipeline.device,
                                             self.pipeline.backends.engine_set, self.ar_compile_cache)
        return self._ar_runner

    def reconfigure(self, config: SchedulerConfig, drain_timeout_s: float = 30.0) -> None:
        """Finish the requests in flight and stop the scheduler; the next request starts one with `config` over the
        same AR runner (its decode / prefill graphs and compiled LM) and stage backends — an A/B over scheduling
        settings without building them again. InputError naming the fields when `config` would need another AR
        runner (`scheduler.AR_RUNNER_FIELDS` differ): close() and load a new TTS for that. The admission limits
        (max_in_flight, max_waiting, ...) stay this TTS's."""
        from .scheduling.scheduler import ar_runner_differences

        with self._lock:
            if self._ar_runner is not None:
                bad = ar_runner_differences(config, self.scheduler_config)
                if bad:
                    raise InputError(f"TTS.reconfigure: {', '.join(bad)} would need another AR runner; close() this "
                                     "TTS and load a new one for that")
            sched, self._scheduler = self._scheduler, None
            self.scheduler_config = config
        if sched is not None:
            sched.close(drain_timeout_s)

    def make_scheduler(self, config: SchedulerConfig | None = None, backends=None, on_finish=None) -> Scheduler:
        """A Scheduler over this TTS's AR runner and (default) stage backends: cheap, so a benchmark builds one per
        SchedulerConfig (its AR fields must match the runner's) or per StageBackends variant."""
        return Scheduler(self.pipeline, config or self.scheduler_config, on_finish, runner=self.ar_runner,
                         backends=backends)

    def _record(self, m: RequestMetrics) -> None:
        with self._lock:
            self._history.append(m)
            self.requests_finished += 1

    def health(self) -> tuple[bool, str | None]:
        """(True, None) while the scheduler can take requests (or has not started yet); (False, why) once one of its
        worker threads died, the AR process died (`ar_process`), or it is shutting down."""
        with self._lock:
            sched, runner = self._scheduler, self._ar_runner
        dead = getattr(runner, "dead", None)  # an AR process that died (between schedulers too)
        if dead:
            return False, dead
        if sched is None or getattr(sched, "healthy", True):
            return True, None
        return False, getattr(sched, "failure", None) or "the scheduler is closing"

    # ------------------------------------------------------------------ voices
    def make_speaker(self, prompt_wav, prompt_text: str = "", prompt_sr: int | None = None) -> SavedSpeaker:
        feats = self.pipeline.frontend.prompt_features(prompt_wav, prompt_sr)
        return SavedSpeaker(features=feats, prompt_text=prompt_text)

    def save_speaker(self, path: str, prompt_wav, prompt_text: str = "", prompt_sr: int | None = None) -> SavedSpeaker:
        spk = self.make_speaker(prompt_wav, prompt_text, prompt_sr)
        save_speaker(path, spk.features, spk.prompt_text)
        return spk

    # ------------------------------------------------------------------ synthesis
    def submit(self, text: str | Request, *, lease: Ticket | None = None, after: RequestHandle | None = None,
               **kw) -> RequestHandle:
        """Queue one request (text + options, or a ready `Request`); returns its RequestHandle once admitted
        (`self.admission`: waits or raises RejectedError when full). `lease`: a ticket of `self.admission` the caller
        holds (`tts.admission.admit()`), under which this request takes no slot of its own (the server runs one HTTP
        request as several runtime requests under one ticket). `after`: the handle of the request the same listener
        hears right before this one (a conversation's previous sentence): a scheduling hint, the audio is the same."""
        if after is not None and not isinstance(after, RequestHandle):
            raise InputError(f"after must be a RequestHandle of this TTS, got {type(after).__name__}")
        if isinstance(text, Request):
            if kw:
                raise InputError(f"submit(Request) takes no further options, got {sorted(kw)}")
            return self.scheduler.submit(text, lease=lease, after=after)
        return self.scheduler.submit(make_request(text, **kw), lease=lease, after=after)

    def synthesize_request(self, req: Request) -> tuple[np.ndarray, RequestMetrics]:
        h = self.submit(req)
        return h.result(), h.metrics

    def synthesize(self, text: str, **kw) -> np.ndarray:
        kw.pop("stream", None)
        return self.submit(make_request(text, **kw)).result()

    def stream(self, text: str, **kw) -> Iterator[np.ndarray]:
        """The request's audio chunks as they are made. Its options are checked here (InputError at the call, not at
        the first `next()`); it is submitted when the iteration starts, and cancelled if the caller stops early."""
        kw.pop("stream", None)
        return self._chunks(make_request(text, stream=True, **kw))

    def _chunks(self, req: Request) -> Iterator[np.ndarray]:
        h = self.submit(req)
        try:
            yield from h.chunks()
        finally:
            h.cancel()  # no-op when finished; stops the request when the caller stops early

    def astream(self, text: str, **kw) -> AsyncIterator[np.ndarray]:
        """`stream` for asyncio (`async for chunk in tts.astream(...)`); options checked at the call, as there."""
        kw.pop("stream", None)
        return self._achunks(make_request(text, stream=True, **kw))

    async def _achunks(self, req: Request) -> AsyncIterator[np.ndarray]:
        import asyncio

        h = await asyncio.get_running_loop().run_in_executor(None, self.submit, req)  # may wait for space
        try:
            async for chunk in h.achunks():
                yield chunk
        finally:
            h.cancel()

    def metrics(self) -> dict:
        from .scheduling.metrics import aggregate

        with self._lock:
            history = list(self._history)
            sched = self._scheduler
        return aggregate(history, sched.stats() if sched is not None else None)

    def export_metrics(self, path: str) -> None:
        """Write the aggregates and every request's metrics as JSON."""
        from .scheduling.metrics import to_json

        with self._lock:
            history = list(self._history)
            sched = self._scheduler
        to_json(history, path, sched.stats() if sched is not None else None)

    def close(self, drain_timeout_s: float = 30.0, close_backends: bool = True) -> None:
        """Finish in-flight requests (up to `drain_timeout_s`), stop the scheduler, close the AR runner and (unless
        `close_backends` is False: a pipeline shared with another TTS, as the bench does) the stage backends'
        runners. Later calls start a new scheduler and AR runner; engine runners stay closed (load a new TTS to serve
        with engines again)."""
        with self._lock:
            sched, self._scheduler = self._scheduler, None
            runner, self._ar_runner = self._ar_runner, None
        if sched is not None:
            sched.close(drain_timeout_s)
        if runner is not None:
            runner.close()
        if close_backends:
            self.pipeline.backends.close()

    def __enter__(self) -> "TTS":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
