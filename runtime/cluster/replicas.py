"""The Ray Serve deployments of the cluster (plain classes; `app.build_app` turns them into deployments, so importing
this module needs no Ray): Frontend, AR and Token2Wav replicas over the stage engines of `stages.py`, and the
ingress's `ClusterTTS`, the TTS facade whose `submit` drives a request through them."""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from types import SimpleNamespace

import torch

from ...engines.errors import InputError, RejectedError
from ..models.frontend import LMRequestInputs, SavedSpeaker
from ..scheduling.admission import AdmissionControl, Ticket
from ..scheduling.handle import RequestHandle
from ..stages.request import Request, RequestMetrics, prepare_inputs
from .config import StageConfig
from .loading import load_frontend, load_stage_pipeline
from .stages import ARStage, Token2WavStage


class ReplicaFailedError(RuntimeError):
    """A replica died (or became unreachable) while it held the request."""


def missing_cluster_packages() -> list[str]:
    """pip names of what `--cluster ray` needs and cannot import ([] when Ray Serve imports)."""
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        return ["ray[serve]"]
    return []


def _setup_replica(stage: StageConfig) -> None:
    if stage.torch_threads:
        torch.set_num_threads(stage.torch_threads)


def _replica_name() -> str:
    try:
        import ray

        return ray.get_runtime_context().get_actor_name() or "local"
    except Exception:  # noqa: BLE001 - outside Ray
        return "local"


def client_error(e: BaseException, request_id, stage: str) -> BaseException:
    """The error a caller should see for `e`, raised by a call into `stage`: the runtime's own error unwrapped from
    Ray's wrapper, a dead or unreachable replica as ReplicaFailedError, Serve backpressure as RejectedError."""
    from ray.exceptions import RayActorError, RayTaskError

    while isinstance(e, RayTaskError) and getattr(e, "cause", None) is not None:
        e = e.cause
    what = f"request {request_id}" if request_id is not None else "the call"
    if isinstance(e, RayActorError):
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return ReplicaFailedError(f"{what} failed: the {stage} replica running it died or became unreachable "
                                  f"({type(e).__name__}: {detail}); Ray Serve replaces the replica, retry the request")
    try:
        from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
    except ImportError:  # pragma: no cover - older Ray
        return e
    if isinstance(e, BackPressureError):
        return RejectedError(f"{what}: the {stage} deployment is at capacity ({e})")
    if isinstance(e, DeploymentUnavailableError):
        return ReplicaFailedError(f"{what} failed: the {stage} deployment is unavailable ({e})")
    return e


async def _submit_in_thread(fn, *args):
    """`fn(*args)` -> RequestHandle in a thread (a scheduler may wait for space); cancelled -> the handle too."""
    fut = asyncio.get_running_loop().run_in_executor(None, fn, *args)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        fut.add_done_callback(lambda f: f.cancelled() or f.exception() or f.result().cancel())
        raise


class FrontendReplica:
    def __init__(self, model: str, stage: StageConfig):
        _setup_replica(stage)
        self.frontend, self.default_speaker, self.sample_rate = load_frontend(model)

    def prepare(self, req: Request) -> LMRequestInputs:
        return prepare_inputs(self.frontend, req, self.default_speaker)

    def make_speaker(self, wav, prompt_text: str, prompt_sr: int | None) -> SavedSpeaker:
        return SavedSpeaker(features=self.frontend.prompt_features(wav, prompt_sr), prompt_text=prompt_text)

    def info(self) -> dict:
        return {"sample_rate": self.sample_rate, "default_speaker": self.default_speaker}


class ARReplica:
    def __init__(self, model: str, stage: StageConfig):
        _setup_replica(stage)
        self.name = _replica_name()
        self.stage = ARStage(load_stage_pipeline(model, stage, ("llm",)), stage.scheduler_config())

    async def generate(self, req: Request, inputs: LMRequestInputs):
        """Stream int64 token arrays, then one dict of the request's AR metrics."""
        h = await _submit_in_thread(self.stage.submit_inputs, req, inputs)
        try:
            async for tokens in h.achunks():
                yield tokens
            m = h.metrics
            yield {"t_ar": m.t_ar, "t_queue": m.t_queue, "tokens": m.tokens}
        finally:
            h.cancel()  # no-op when finished; stops the request when the caller went away

    def stats(self) -> dict:
        return {"replica": self.name, **self.stage.stats()}


class Token2WavReplica:
    def __init__(self, model: str, stage: StageConfig, ar):
        _setup_replica(stage)
        self.name = _replica_name()
        pipeline = load_stage_pipeline(model, stage, ("flow", "hift"))
        if stage.engines:
            from ..stages.engine_set import attach_engine_set

            attach_engine_set(pipeline, stage.engines)
        self.stage = Token2WavStage(pipeline, stage.scheduler_config())
        self.ar = ar

    async def synthesize(self, req: Request, inputs: LMRequestInputs):
        """Stream float32 PCM chunks, then one dict of the request's metrics; the tokens come from AR."""
        h = await _submit_in_thread(self.stage.open, req, inputs)
        feeder = asyncio.ensure_future(self._pull_tokens(h, req, inputs))
        try:
            async for pcm in h.achunks():
                yield pcm
            m = h.metrics
            yield {"tokens": m.tokens, "t_ar": m.t_ar, "t_queue": m.t_queue, "t_dit": m.t_dit,
                   "t_vocoder": m.t_vocoder, "replica": self.name}
        finally:
            feeder.cancel()  # no-op when done
            h.cancel()

    async def _pull_tokens(self, h: RequestHandle, req: Request, inputs: LMRequestInputs) -> None:
        ar_inputs = inputs.lm_only()
        gen = self.ar.options(stream=True).generate.remote(req, ar_inputs)
        metrics: dict = {}
        try:
            async for item in gen:
                if isinstance(item, dict):
                    metrics = item
                else:
                    self.stage.feed(h, item)
            self.stage.feed(h, None, final=True, ar_metrics=metrics)
        except asyncio.CancelledError:
            gen.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - fails this request only
            self.stage.fail(h, client_error(e, req.request_id, "AR"))

    def info(self) -> dict:
        st = self.stage.stats()
        return {"replica": self.name, "in_flight": st["in_flight"]}

    def stats(self) -> dict:
        return {"replica": self.name, **self.stage.stats()}


class ClusterTTS:
    """What `create_app` uses of a TTS (submit, make_speaker, metrics, close, sample_rate, pipeline.default_speaker),
    over the cluster's deployments. Lives in the ingress replica; requests run as tasks on its event loop `loop`.
    `submit` / `make_speaker` must be called from other threads (create_app does)."""

    def __init__(self, frontend, token2wav, info: dict, loop: asyncio.AbstractEventLoop, history: int = 100_000):
        self.frontend = frontend
        self.token2wav = token2wav
        self.loop = loop
        self.sample_rate = int(info["sample_rate"])
        self.pipeline = SimpleNamespace(default_speaker=info.get("default_speaker"))
        self.engines = None
        self._lock = threading.Lock()
        self._tasks: dict[int, object] = {}
        self._history: deque[RequestMetrics] = deque(maxlen=history)
        self._closed = False
        # admission of the cluster's requests (the ingress server configures it with its flags and asks it); each
        # stage replica's scheduler keeps its own max_in_flight as that replica's capacity
        self.admission = AdmissionControl(64)

    # ---------------------------------------------------------------- TTS surface
    def submit(self, text, *, lease: Ticket | None = None, after=None, **kw) -> RequestHandle:
        """Like `TTS.submit`: admitted by `self.admission` unless the caller holds a ticket of it (`lease`). `after`
        (a scheduling hint of one process's scheduler) is accepted and not used: the stages run on other replicas."""
        from ..tts import make_request

        if isinstance(text, Request):
            if kw:
                raise InputError(f"submit(Request) takes no further options, got {sorted(kw)}")
            req = text
        else:
            req = make_request(text, **kw)
        if self._closed:
            raise RejectedError(f"request {req.request_id}: the server is shutting down")
        if lease is not None and (not isinstance(lease, Ticket) or lease.control is not self.admission):
            raise InputError("lease must be a ticket of this ClusterTTS's admission control")
        ticket = self.admission.admit(f"request {req.request_id}") if lease is None else None
        metrics = RequestMetrics(request_id=req.request_id, stream=req.stream, buffered_s=req.buffered_s)
        handle = RequestHandle(req, metrics, self._cancel)
        key = id(handle)
        with self._lock:
            fut = asyncio.run_coroutine_threadsafe(self._drive(req, handle), self.loop)
            self._tasks[key] = fut

        def done(_):
            self._forget(key)
            if ticket is not None:
                ticket.release()
        fut.add_done_callback(done)
        return handle

    def make_speaker(self, prompt_wav, prompt_text: str = "", prompt_sr: int | None = None) -> SavedSpeaker:
        return asyncio.run_coroutine_threadsafe(
            self._call(self.frontend.make_speaker, prompt_wav, prompt_text, prompt_sr), self.loop).result()

    def metrics(self) -> dict:
        from ..scheduling.metrics import aggregate

        with self._lock:
            history = list(self._history)
            n = len(self._tasks)
        return aggregate(history, {"in_flight": n, "queues": {}})

    def close(self, drain_timeout_s: float = 30.0) -> None:
        """Stop taking requests; requests still running after `drain_timeout_s` are cancelled."""
        self._closed = True
        deadline = time.monotonic() + drain_timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._tasks:
                    return
            time.sleep(0.05)
        with self._lock:
            left = list(self._tasks.values())
        for fut in left:
            fut.cancel()

    # ---------------------------------------------------------------- internals
    def _forget(self, key: int) -> None:
        with self._lock:
            self._tasks.pop(key, None)

    def _done(self, handle: RequestHandle, error: BaseException | None) -> bool:
        m = handle.metrics

        def stamp():
            m.total = time.perf_counter() - m.t_submit
            if error is not None:
                m.error = f"{type(error).__name__}: {error}"
        if not handle._finish(error, stamp):
            return False
        with self._lock:
            self._history.append(m)
        return True

    def _cancel(self, handle: RequestHandle) -> None:
        self._done(handle, RejectedError(f"request {handle.request_id} was cancelled"))
        with self._lock:
            fut = self._tasks.get(id(handle))
        if fut is not None:
            fut.cancel()

    async def _call(self, method, *args):
        try:
            return await method.remote(*args)
        except Exception as e:  # noqa: BLE001
            raise client_error(e, None, "frontend") from None

    async def _drive(self, req: Request, handle: RequestHandle) -> None:
        m = handle.metrics
        stage, call = "frontend", None
        try:
            t0 = time.perf_counter()
            call = self.frontend.prepare.remote(req)
            inputs = await call
            m.t_tokenizer = time.perf_counter() - t0
            stage = "token2wav"
            call = self.token2wav.options(stream=True).synthesize.remote(req.without_voice(), inputs)
            async for item in call:
                if isinstance(item, dict):
                    m.tokens = int(item.get("tokens", 0))
                    for k in ("t_ar", "t_queue", "t_dit", "t_vocoder"):
                        setattr(m, k, float(item.get(k, 0.0)))
                else:
                    m.mark_chunk(item.size, self.sample_rate)
                    handle._put(item)
            self._done(handle, None)
        except asyncio.CancelledError:  # the client went away: stop the remote calls (token2wav cancels AR)
            if call is not None:
                call.cancel()
            self._done(handle, RejectedError(f"request {req.request_id} was cancelled"))
            raise
        except Exception as e:  # noqa: BLE001 - this request fails, with a clear error
            self._done(handle, client_error(e, req.request_id, stage))


class IngressReplica:
    """The HTTP ingress: runtime/server.py's app over a `ClusterTTS` (built at replica start, on its event loop)."""

    def __init__(self, frontend, token2wav, settings: dict):
        self._frontend = frontend
        self._token2wav = token2wav
        self._settings = dict(settings)
        self.tts: ClusterTTS | None = None

    async def __serve_build_asgi_app__(self):
        from ..serving.app import ServerSettings, create_app

        info = await self._frontend.info.remote()
        self.tts = ClusterTTS(self._frontend, self._token2wav, info, asyncio.get_running_loop())
        return create_app(self.tts, ServerSettings(**self._settings), owns_tts=True)
