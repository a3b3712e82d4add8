"""`trtbuild serve`: an OpenAI-compatible speech server over one shared `TTS`.

    app = create_app(tts, ServerSettings(voices_dir="voices"))   # FastAPI app (tests, embedding)
    serve(ServerSettings(model="tiny", port=8000))                # load, warm up, run uvicorn

Endpoints: `POST /v1/audio/speech` (OpenAI request shape, see request.py; wav | pcm | flac | mp3 | opus | aac;
`stream` or `stream_format: "audio"` for chunked wav / pcm, `stream_format: "sse"` for OpenAI's audio-delta events;
long input is split into sentences synthesised in order as one response), `POST /v1/audio/speech/batch`
(sglang-omni's batch shape), `WS /v1/audio/speech/stream` (text in pieces, audio per sentence),
`POST/GET /v1/voices` (alias `/v1/audio/voices`), `DELETE /v1/voices/{id}`,
`GET /v1/models`, `GET /health` (200 once loaded and warmed, 503 when the runtime died) and `GET /metrics`.

FastAPI / uvicorn / python-multipart (the `serve` extra) are imported only inside `create_app` / `serve`, so the rest
of cosytrt imports without them. Errors have OpenAI's shape: {"error": {"message", "type", "param", "code"}}.
"""
import asyncio
import functools
import logging
import math
import time

from ...engines.errors import CosytrtError
from .encoding import pcm16, wav_header  # noqa: F401 (re-exported: tests, clients)
from .errors import APIError, from_runtime_error
from .http import REQUEST_ID, RequestIdFilter, host_name, request_id, route_label
from .jobs import _ClientGone, segment_text  # noqa: F401 (segment_text: tests)
from .routes_batch import add_batch_routes
from .routes_ops import add_ops_routes
from .routes_speech import add_speech_routes
from .routes_voices import add_voice_routes
from .routes_ws import add_ws_routes, ws_max_bytes
from .settings import LOOPBACK_HOSTS, ServerSettings, missing_serve_packages
from .state import ServerState
from .streaming import ClientStalled, bounded_send

__all__ = ["create_app", "serve", "ServerSettings", "missing_serve_packages", "pcm16", "wav_header", "APIError"]

log = logging.getLogger("cosytrt.server")


def create_app(tts, settings: ServerSettings | None = None, *, owns_tts: bool = False):
    """The FastAPI app over one loaded `TTS`. It warms up at startup (/health 503 until done) and drains in-flight
    requests at shutdown; `owns_tts=True` also closes the TTS then. The routes live in routes_speech.py,
    routes_voices.py and routes_ops.py; what they share (settings, voices, pools, readiness, checks) in state.py."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response
    from starlette.exceptions import HTTPException as StarletteHTTPException

    settings = settings or ServerSettings()
    state = ServerState(tts, settings, owns_tts)
    host_names = settings.host_names()

    @asynccontextmanager
    async def lifespan(app):
        state.configure_admission()
        state.metrics.lock_probe.start()
        warm = asyncio.create_task(state.warm_up())
        try:
            yield
        finally:
            if not warm.done():
                warm.cancel()
            await state.drain()
            state.metrics.lock_probe.stop()

    public_docs = state.api_key is None  # with a key, the API description is not served to anyone
    app = FastAPI(title="cosytrt speech server", version="0.1.0", lifespan=lifespan,
                  docs_url="/docs" if public_docs else None, redoc_url="/redoc" if public_docs else None,
                  openapi_url="/openapi.json" if public_docs else None)
    app.state.server = state

    def error_response(e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return error_response(e)

    @app.exception_handler(CosytrtError)
    async def _cosytrt_error(request, e: CosytrtError):
        return error_response(from_runtime_error(e))

    @app.exception_handler(_ClientGone)
    async def _client_gone(request, e):
        return Response(status_code=499)  # nobody reads it; counted as "client closed request"

    @app.exception_handler(Exception)
    async def _internal_error(request, e: Exception):
        return error_response(from_runtime_error(e))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        return error_response(APIError(e.status_code, str(e.detail), code="not_found" if e.status_code == 404 else
                                       None, headers=getattr(e, "headers", None)))

    def ws_allowed(scope) -> bool:
        """A WebSocket handshake's Host and Origin (any page may open a WebSocket to localhost: its Origin must be
        a served host name too) against the served names; anything goes when those are not restricted."""
        if host_names is None:
            return True
        headers = {k: v.decode("latin-1") for k, v in scope.get("headers", [])}
        if host_name(headers.get(b"host", "")) not in host_names:
            return False
        origin = headers.get(b"origin")
        if origin is None:
            return True  # not a browser
        from urllib.parse import urlsplit

        return host_name(urlsplit(origin).netloc) in host_names

    async def _bounded(send, message):
        await bounded_send(send(message), settings.send_timeout_s)

    class _Guard:
        """Checks the Host header (DNS rebinding), counts every HTTP response by route and status (at response
        start, so a disconnect still counts) and bounds every send to a client (an HTTP response's parts, a
        websocket's messages) by --send-timeout-s: a client that stops reading gets ClientStalled in the route (a
        streamed response finishes its job, a websocket session ends, counted) instead of holding its admission
        slot, runtime request, session or connection for ever; here it ends the response, logged."""

        def __init__(self, inner):
            self.inner = inner

        async def __call__(self, scope, receive, send):
            if scope["type"] in ("http", "websocket"):
                send = functools.partial(_bounded, send)
            try:
                await self._guarded(scope, receive, send)
            except ClientStalled:  # a response's client stopped reading (the connection is closed, incomplete)
                log.warning("response dropped: the client took nothing for %g s (%s %s)", settings.send_timeout_s,
                            scope.get("method", "websocket"), scope.get("path"))

        async def _guarded(self, scope, receive, send):
            if scope["type"] == "websocket":
                if not ws_allowed(scope):  # refuse the handshake (HTTP 403)
                    await receive()  # websocket.connect
                    return await send({"type": "websocket.close", "code": 1008})
                return await self.inner(scope, receive, send)
            if scope["type"] != "http":
                return await self.inner(scope, receive, send)
            started = False
            rid = request_id(scope.get("headers", []))
            token = REQUEST_ID.set(rid)  # the request's tasks and log lines see it

            async def counting_send(message):
                nonlocal started
                if message["type"] == "http.response.start" and not started:
                    started = True
                    message = {**message, "headers": [*message.get("headers", []),
                                                      (b"x-request-id", rid.encode("latin-1"))]}
                    state.metrics.count_http(scope["method"], route_label(scope["path"]), message["status"])
                await send(message)

            try:
                if host_names is not None:
                    host = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k == b"host"), "")
                    if host_name(host) not in host_names:
                        e = APIError(421, f"Host {host[:64]!r} is not served here (set --allowed-hosts to serve it)",
                                     code="invalid_host")
                        return await error_response(e)(scope, receive, counting_send)
                await self.inner(scope, receive, counting_send)
            except BaseException:
                if not started:
                    state.metrics.count_http(scope["method"], route_label(scope["path"]), 500)
                raise
            finally:
                REQUEST_ID.reset(token)

    app.add_middleware(_Guard)
    add_ops_routes(app, state)
    add_voice_routes(app, state)
    add_speech_routes(app, state)
    add_batch_routes(app, state)
    add_ws_routes(app, state)
    return app


# ------------------------------------------------------------------------------------------------ running it

def serve(settings: ServerSettings, tts=None) -> int:
    """Load the model (unless given), then run uvicorn until SIGINT / SIGTERM; returns 0."""
    import uvicorn

    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(RequestIdFilter())
    owns = tts is None
    if tts is None:
        from ..scheduling.scheduler import SchedulerConfig
        from ..tts import TTS

        t0 = time.perf_counter()
        sched = SchedulerConfig(max_in_flight=settings.max_in_flight, max_waiting=settings.max_queue,
                                submit_timeout_s=settings.queue_timeout_s, **settings.scheduler)
        tts = TTS.load(model=settings.model, engines=settings.engines, device=settings.device,
                       scheduler=sched, compile=(settings.compile_scope or True) if settings.compile else False,
                       compile_cache=settings.compile_cache)
        log.info("loaded model %r in %.1f s", settings.model, time.perf_counter() - t0)
    if settings.host not in LOOPBACK_HOSTS and not settings.resolve_api_key():
        log.warning("listening on %s without an API key: anyone who can reach it can use it", settings.host)
    app = create_app(tts, settings, owns_tts=owns)
    uvicorn.Server(uvicorn_config(app, settings)).run()
    return 0


def uvicorn_config(app, settings: ServerSettings, **overrides):
    """The uvicorn configuration `serve` runs with: bounded header and WebSocket message sizes (a websocket message
    larger than a session config with an inline reference closes the socket, 1009), short keep-alive, graceful
    shutdown within the drain timeout."""
    import uvicorn

    kw = dict(host=settings.host, port=settings.port, log_level=settings.log_level,
              timeout_graceful_shutdown=int(math.ceil(settings.drain_timeout_s)), lifespan="on",
              http=head_timeout_protocol(settings.header_timeout_s), limit_concurrency=settings.max_connections,
              h11_max_incomplete_event_size=65536, timeout_keep_alive=5, ws_max_size=ws_max_bytes(settings))
    return uvicorn.Config(app, **{**kw, **overrides})


def head_timeout_protocol(seconds: float):
    """uvicorn's h11 protocol (always h11: its header size bound, `h11_max_incomplete_event_size`, is h11's) with a
    request-head timeout: a connection that has not sent a complete request head within `seconds` of opening, or of
    its previous response, is closed. uvicorn has none: an idle or trickling socket (a byte every few seconds cancels
    its keep-alive timer) was held for ever, and enough of them exhaust the server's descriptors."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeadTimeoutH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_head_timeout()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_head_timeout()

        def _arm_head_timeout(self) -> None:
            self.loop.call_later(seconds, self._head_timeout, self.cycle)

        def _head_timeout(self, cycle) -> None:
            if (self.cycle is cycle and (cycle is None or cycle.response_complete)  # no request since the timer
                    and self.transport.get_protocol() is self  # (not upgraded to a websocket)
                    and not self.transport.is_closing()):
                log.info("closing a connection that sent no complete request head for %g s", seconds)
                self.transport.close()

    return HeadTimeoutH11Protocol
