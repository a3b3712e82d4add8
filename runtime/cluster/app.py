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

import dataclasses
import logging
import os
import time

from ...engines.errors import InputError
from .config import ClusterConfig, StageConfig, load_cluster_config
from .loading import load_frontend, load_stage_models, load_stage_pipeline
from .replicas import (ARReplica, ClusterTTS, FrontendReplica, IngressReplica, ReplicaFailedError, Token2WavReplica,
                       client_error, missing_cluster_packages)
from .stages import ARStage, Token2WavStage, hop_flush_points

log = logging.getLogger("cosytrt.cluster")

CLUSTER_EXTRA = "cosytrt[cluster]"


def as_cluster_config(config) -> ClusterConfig:
    """A ClusterConfig from a ClusterConfig, a YAML path, a dict ({"config": PATH} as `serve run
    cosytrt.runtime.cluster.app:build_app config=PATH` passes it, or the YAML's content), or None (defaults)."""
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
    from ..serving.app import ServerSettings

    base = dataclasses.asdict(settings) if settings is not None else {}
    merged = {**base, **config.server}
    ServerSettings(**merged)  # validate
    return merged


def build_app(config=None, settings=None):
    """The Ray Serve application (ingress -> frontend, token2wav -> AR) for a cluster config (see
    `as_cluster_config`); `settings`: base ServerSettings of the ingress."""
    from ray import serve

    from ..serving.app import ServerSettings

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

    from ..serving.app import ServerSettings

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
           "as_cluster_config", "client_error", "FrontendReplica", "ARReplica", "Token2WavReplica", "IngressReplica"]
