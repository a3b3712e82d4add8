"""Scale-out on Ray Serve: the runtime's stages as deployments, behind the same OpenAI-compatible ingress as
`trtbuild serve`.

    app = build_app("profiles/cluster-example.yaml")   # a ray.serve.Application
    serve.run(app, name="cosytrt", route_prefix="/")   # or: trtbuild serve --cluster ray --config FILE

Deployments (names as `serve status` shows them):

* Frontend (CPU): a request -> `LMRequestInputs` (text ids, prompt tokens / mel / speaker embedding); voice uploads.
* AR: an `ARStage`, the scheduler's continuous-batching AR loop with its own KV slots (and decode CUDA graphs).
  It streams each request's speech tokens back as they are produced, flushed at the points where token2wav can use
  them: the hop schedule of streaming (first hop + look-ahead, then 50, 100, ... tokens), or once at the end.
* Token2Wav: a `Token2WavStage`, the scheduler's DiT and HiFT stages (chunk-aligned DiT batches, batched HiFT, the
  replica's own engine set). A request is ONE streaming call to one replica, and that call pulls the tokens from AR
  itself, so the request's flow / HiFT stream state never leaves the replica (no affinity map is needed).
* Ingress: `create_app` (runtime/server.py) over `ClusterTTS`, a TTS facade whose `submit` drives the cluster.

A request: ingress -> Frontend.prepare -> Token2Wav.synthesize (stream) <- AR.generate (stream); PCM chunks flow back
chunk by chunk. A replica that dies fails only the requests it held: their clients get `ReplicaFailedError` (HTTP 500
naming the stage) and Ray Serve's controller replaces the replica. Ray is imported only inside functions.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch

from .config import ClusterConfig, StageConfig, load_cluster_config
from ...engines.errors import InputError, RejectedError
from ..models.frontend import LMRequestInputs, SavedSpeaker
from ..scheduling.request import Request, RequestMetrics, prepare_inputs
from ..scheduling.scheduler import RequestHandle, Scheduler, SchedulerConfig
from ..stages.token2wav import HOP_SCALE, LOOKAHEAD, TOKEN_HOP, TOKEN_MAX_HOP, first_hop

log = logging.getLogger("cosytrt.cluster")

CLUSTER_EXTRA = "cosytrt[cluster]"
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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


# ------------------------------------------------------------------------------------------------ stage engines

@dataclass
class _StageRequest(Request):
    """A Request plus its frontend output, and the token2wav stage's feeding state."""

    inputs: LMRequestInputs | None = None
    pending: list = field(default_factory=list)  # tokens received, not yet in the request's token list
    lm_done: bool = False
    prepared: bool = False
    final_queued: bool = False


def _stage_request(req: Request, inputs: LMRequestInputs) -> _StageRequest:
    if inputs is None:
        raise InputError(f"request {req.request_id}: a stage request needs the frontend's LM inputs")
    return _StageRequest(**{f.name: getattr(req, f.name) for f in dataclasses.fields(Request)}, inputs=inputs)


def hop_flush_points(prompt_tokens: int):
    """Token counts at which a streaming request's hops fire (`StreamState.ready`): first hop + look-ahead, then
    hops of 50, 100, 100, ... tokens."""
    offset, base, hop = 0, TOKEN_HOP, first_hop(prompt_tokens)
    while True:
        yield offset + hop + LOOKAHEAD
        offset += hop
        base = min(TOKEN_MAX_HOP, base * HOP_SCALE)
        hop = base


class ARStage(Scheduler):
    """The scheduler's AR alone. `submit_inputs(req, inputs)` takes the frontend's output; the handle's chunks are
    int64 arrays of new speech tokens (at the hop points when streaming, one array at the end otherwise). The DiT and
    HiFT workers stay idle."""

    def submit_inputs(self, req: Request, inputs: LMRequestInputs) -> RequestHandle:
        return self.submit(_stage_request(req, inputs))

    _kv_slots_name = "the AR replica's KV-cache slots"
    _kv_len_setting = "scheduler.ar_max_len of the AR stage"

    def _prepare(self, r) -> None:  # the frontend ran remotely: only build the LM input here
        inputs = r.req.inputs
        if inputs is None:
            raise InputError(f"request {r.req.request_id}: the AR stage takes requests from submit_inputs")
        t0 = time.perf_counter()
        dev = self.device
        with torch.inference_mode():
            r.lm_input = self.lm.build_lm_input(inputs.text_ids.to(dev), inputs.prompt_speech_tokens.to(dev))
        self._fence_inputs(r)
        self._prepare_policy(r, inputs)
        r.flush = hop_flush_points(int(inputs.flow_prompt_tokens.numel())) if r.req.stream else None
        r.next_flush = next(r.flush) if r.flush is not None else None
        r.sent = 0
        r.metrics.t_tokenizer = time.perf_counter() - t0

    def _final_job(self, r):
        return r  # no DiT here: `_sample` finishes the request once its last tokens are out

    def _sample(self, results, t0: float, jobs: list) -> None:
        finished: list = []
        super()._sample(results, t0, finished)
        done = {id(r) for r in finished}
        for r, _ in results:
            self._flush(r, id(r) in done)
        for r in finished:
            self._finish(r, None)

    def _flush(self, r, final: bool) -> None:
        n = len(r.tokens)
        if n > r.sent and (final or (r.next_flush is not None and n >= r.next_flush)):
            r.handle._put(np.asarray(r.tokens[r.sent:], dtype=np.int64))
            r.sent = n
        while r.next_flush is not None and r.next_flush <= n:
            r.next_flush = next(r.flush)


class Token2WavStage(Scheduler):
    """The scheduler's DiT and HiFT stages fed with speech tokens from outside: `open(req, inputs)` -> handle (PCM
    chunks), then `feed(handle, tokens)` as tokens arrive and `feed(handle, None, final=True)` when the LM is done.
    Hop and final DiT jobs are made exactly as the scheduler's AR makes them, so the audio is the same."""

    def __init__(self, pipeline, config: SchedulerConfig | None = None):
        self._feed_lock = threading.RLock()
        self._open: set[int] = set()  # requests whose final DiT job is not queued yet
        cfg = dataclasses.replace(config or SchedulerConfig(), ar_max_batch=1, ar_max_len=1, cuda_graphs=False)
        super().__init__(pipeline, cfg)

    def open(self, req: Request, inputs: LMRequestInputs) -> RequestHandle:
        self.pipeline._check_noise(inputs, req)  # RequestTooLongError before any model work
        return self.submit(_stage_request(req, inputs))

    def feed(self, handle: RequestHandle, tokens, final: bool = False, ar_metrics: dict | None = None) -> None:
        r = self._live.get(id(handle))
        if r is None:
            return
        with self._feed_lock:
            if tokens is not None:
                r.req.pending.extend(int(t) for t in np.asarray(tokens).reshape(-1))
            if ar_metrics:
                r.metrics.t_ar = float(ar_metrics.get("t_ar", 0.0))
                r.metrics.t_queue = float(ar_metrics.get("t_queue", 0.0))
            if final:
                r.req.lm_done = True
        self._queue_jobs(r)

    def fail(self, handle: RequestHandle, error: BaseException) -> None:
        r = self._live.get(id(handle))
        if r is not None:
            self._finish(r, error)

    def _queue_jobs(self, r) -> None:
        with self._feed_lock:
            q = r.req
            if not q.prepared or r.dead:
                return
            if q.pending:
                r.tokens.extend(q.pending)
                q.pending.clear()
            jobs = []
            if r.state is not None:
                while r.state.ready(len(r.tokens)):
                    jobs.append(self._hop_job(r))
            if q.lm_done and not q.final_queued:
                q.final_queued = True
                r.metrics.tokens = len(r.tokens)
                r.handle.tokens = list(r.tokens)
                jobs.append(self._final_job(r))
                self._open.discard(id(r.handle))
            if jobs:  # queued under the feed lock: a request's jobs enter the DiT queue in order
                with self._dit_cond:
                    self._dit_queue.extend(jobs)
                    self._dit_cond.notify_all()

    def _run_frontend(self, r) -> None:  # the flow prompt onto the device and the stream state, then any tokens
        try:
            with self._feed_lock:
                if r.dead:
                    return
                self._open.add(id(r.handle))
            inputs = r.req.inputs
            dev = self.device
            r.prompt = (inputs.flow_prompt_tokens.to(dev), inputs.flow_prompt_mel.to(dev), inputs.embedding.to(dev))
            if r.req.stream:
                r.state = self.t2w.start(*r.prompt)
            with self._feed_lock:
                r.req.prepared = True
            self._queue_jobs(r)
        except BaseException as e:
            self._finish(r, e)
        finally:
            with self._lock:
                self._frontend_pending -= 1

    def _finish(self, r, error, cancelled: bool = False) -> None:
        super()._finish(r, error, cancelled)
        with self._feed_lock:
            self._open.discard(id(r.handle))

    def _ar_active(self) -> bool:  # more DiT jobs can come while a request still expects tokens
        return bool(self._frontend_pending or self._open)


# ------------------------------------------------------------------------------------------------ loading

def load_stage_models(source: str, device: str = "cpu", dtype: torch.dtype | None = None,
                      parts=("llm", "flow", "hift")):
    """`load_models`, but only `parts` get weights (on `device`); the other models are built on the meta device, so
    an AR replica holds no flow / HiFT and a token2wav replica no LM. The weights hash covers all three files, so
    engine sets built for the model still match."""
    from ..models.checkpoint import read_state_dict
    from ..models.loading import CHECKPOINTS, CosyVoice3Models, build_modules, check_device, hash_files, resolve_source

    check_device(device)
    kind, d, config = resolve_source(source)
    paths = [os.path.join(d, f) for f in CHECKPOINTS]
    mods = []
    for name, meta, path in zip(("llm", "flow", "hift"), build_modules(config, "meta"), paths):
        if name not in parts:
            mods.append(meta)
            continue
        m = type(meta)(getattr(config, name)).eval()
        m.load_checkpoint(read_state_dict(path))
        mods.append(m.to(device=device) if name == "hift" else m.to(device=device, dtype=dtype))
    return CosyVoice3Models(config=config, llm=mods[0], flow=mods[1], hift=mods[2],
                            source=source if kind == "tiny" else d, model_dir=d, weights_hash=hash_files(paths))


def load_stage_pipeline(source: str, stage: StageConfig, parts):
    from ..stages.pipeline import Pipeline

    models = load_stage_models(source, stage.device, _DTYPES.get(stage.dtype), parts)
    pipeline = Pipeline(models, frontend=None, default_speaker=None)
    real = {"llm": models.llm, "flow": models.flow, "hift": models.hift}[parts[0]]
    pipeline.device = next(real.parameters()).device
    return pipeline


def load_frontend(source: str):
    """(Frontend, built-in voice or None, sample rate) without loading any model weights."""
    from ..models.loading import CosyVoice3Models, resolve_source
    from ..stages.pipeline import make_frontend

    kind, d, config = resolve_source(source)
    models = CosyVoice3Models(config=config, llm=None, flow=None, hift=None, source=source if kind == "tiny" else d,
                              model_dir=d, weights_hash="")
    frontend, speaker = make_frontend(models)
    return frontend, speaker, int(config.sample_rate)


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


# ------------------------------------------------------------------------------------------------ deployments
# Plain classes; `build_app` turns them into Ray Serve deployments (so importing this module needs no Ray).

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
        ar_inputs = dataclasses.replace(inputs, flow_prompt_mel=inputs.flow_prompt_mel[:0],
                                        embedding=inputs.embedding[:0])  # AR needs neither
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


def _slim(req: Request) -> Request:
    """The request without its voice (the frontend has turned it into LM inputs)."""
    return dataclasses.replace(req, prompt_wav=None, speaker=None)


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

    # ---------------------------------------------------------------- TTS surface
    def submit(self, text, **kw) -> RequestHandle:
        from ..tts import make_request

        if isinstance(text, Request):
            if kw:
                raise InputError(f"submit(Request) takes no further options, got {sorted(kw)}")
            req = text
        else:
            req = make_request(text, **kw)
        if self._closed:
            raise RejectedError(f"request {req.request_id}: the server is shutting down")
        handle = RequestHandle(req, RequestMetrics(request_id=req.request_id, stream=req.stream), self._cancel)
        key = id(handle)
        with self._lock:
            fut = asyncio.run_coroutine_threadsafe(self._drive(req, handle), self.loop)
            self._tasks[key] = fut
        fut.add_done_callback(lambda _: self._forget(key))
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
            call = self.token2wav.options(stream=True).synthesize.remote(_slim(req), inputs)
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
        from ..serving import ServerSettings, create_app

        info = await self._frontend.info.remote()
        self.tts = ClusterTTS(self._frontend, self._token2wav, info, asyncio.get_running_loop())
        return create_app(self.tts, ServerSettings(**self._settings), owns_tts=True)


# ------------------------------------------------------------------------------------------------ the application

def as_cluster_config(config) -> ClusterConfig:
    """A ClusterConfig from a ClusterConfig, a YAML path, a dict ({"config": PATH} as `serve run
    cosytrt.runtime.cluster:build_app config=PATH` passes it, or the YAML's content), or None (defaults)."""
    if config is None or isinstance(config, ClusterConfig):
        return config or ClusterConfig()
    if isinstance(config, (str, os.PathLike)):
        return load_cluster_config(config)
    if isinstance(config, dict):
        if set(config) == {"config"}:
            return load_cluster_config(config["config"])
        return ClusterConfig.from_dict(config)
    raise InputError(f"cluster config must be a path, a mapping or a ClusterConfig, got {type(config).__name__}")


def ingress_settings(config: ClusterConfig, settings=None) -> dict:
    """ServerSettings fields for the ingress: `settings` (e.g. the CLI's), overridden by the config's `server`."""
    from ..serving import ServerSettings

    base = dataclasses.asdict(settings) if settings is not None else {}
    merged = {**base, **config.server}
    ServerSettings(**merged)  # validate
    return merged


def build_app(config=None, settings=None):
    """The Ray Serve application (ingress -> frontend, token2wav -> AR) for a cluster config (see
    `as_cluster_config`); `settings`: base ServerSettings of the ingress."""
    from ray import serve

    from ..serving import ServerSettings

    cfg = as_cluster_config(config)
    srv = ingress_settings(cfg, settings)
    model = cfg.model or srv.get("model") or "tiny"
    s = ServerSettings(**srv)
    ar_in_flight = cfg.ar.scheduler_config().max_in_flight
    t2w_in_flight = cfg.token2wav.scheduler_config().max_in_flight

    def deployment(cls, name: str, stage: StageConfig, ongoing: int):
        return serve.deployment(cls, name=name).options(**stage.deployment_options(ongoing))

    frontend = deployment(FrontendReplica, "Frontend", cfg.frontend, 64).bind(model, cfg.frontend)
    ar = deployment(ARReplica, "AR", cfg.ar, ar_in_flight).bind(model, cfg.ar)
    token2wav = deployment(Token2WavReplica, "Token2Wav", cfg.token2wav, t2w_in_flight).bind(model, cfg.token2wav, ar)
    ingress = deployment(serve.ingress()(IngressReplica), "Ingress", cfg.ingress,
                         s.max_in_flight + s.max_queue + 8)
    return ingress.bind(frontend, token2wav, srv)


def serve_cluster(config=None, settings=None) -> int:
    """`trtbuild serve --cluster ray`: connect to (or start) Ray, run the application, serve until Ctrl-C / SIGTERM."""
    import signal

    import ray
    from ray import serve

    from ..serving import ServerSettings

    cfg = as_cluster_config(config)
    srv = ServerSettings(**ingress_settings(cfg, settings))
    logging.basicConfig(level=srv.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_app(cfg, srv)
    if srv.host not in ("127.0.0.1", "localhost", "::1") and not srv.api_key:
        log.warning("listening on %s without an API key: anyone who can reach it can use it", srv.host)
    ray.init(address=cfg.ray_address, ignore_reinit_error=True)
    serve.start(http_options={"host": srv.host, "port": srv.port})
    def _on_sigterm(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        serve.run(app, name=cfg.app_name, route_prefix="/")
        log.info("cosytrt on Ray Serve: http://%s:%d (app %r)", srv.host, srv.port, cfg.app_name)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        log.info("shutting down")
    finally:
        try:
            serve.delete(cfg.app_name)
        finally:
            ray.shutdown()
    return 0


__all__ = ["ARStage", "Token2WavStage", "ClusterTTS", "ReplicaFailedError", "build_app", "serve_cluster",
           "load_stage_models", "load_stage_pipeline", "load_frontend", "hop_flush_points", "missing_cluster_packages",
           "as_cluster_config", "client_error"]
