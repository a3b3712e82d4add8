"""`trtbuild serve`: an OpenAI-compatible speech server over one shared `TTS`.

    app = create_app(tts, ServerSettings(voices_dir="voices"))   # FastAPI app (tests, embedding)
    serve(ServerSettings(model="tiny", port=8000))                # load, warm up, run uvicorn

Endpoints: `POST /v1/audio/speech` (OpenAI request shape, see request.py; wav | pcm | flac | mp3 | opus; `stream`
or `stream_format: "audio"` for chunked wav / pcm, `stream_format: "sse"` for OpenAI's audio-delta events; long
input is split into sentences synthesised in order as one response), `POST/GET /v1/voices` (alias
`/v1/audio/voices`), `DELETE /v1/voices/{id}`, `GET /v1/models`, `GET /health` (200 once loaded and warmed, 503 when
the runtime died) and `GET /metrics` (Prometheus).

FastAPI / uvicorn / python-multipart (the `serve` extra) are imported only inside `create_app` / `serve`, so the rest
of cosytrt imports without them. Errors have OpenAI's shape: {"error": {"message", "type", "param", "code"}}.
"""
import asyncio
import base64
import hmac
import json
import logging
import math
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ...engines.errors import CosytrtError, InputError
from .admission import Admission
from .encoding import MEDIA_TYPES, decode_upload, encode_audio, pcm16, pcm_headers, ref_audio_bytes, wav_header
from .errors import APIError, from_runtime_error, invalid
from .metrics import ServerMetrics
from .jobs import SpeechJob, _ClientGone, segment_text  # noqa: F401 (segment_text: tests)
from .settings import LOOPBACK_HOSTS, ServerSettings, missing_serve_packages
from .voices import VoiceExistsError, VoiceLimitError, VoiceNotFoundError, VoiceStore, check_voice_id

__all__ = ["create_app", "serve", "ServerSettings", "missing_serve_packages", "pcm16", "wav_header", "APIError"]

log = logging.getLogger("cosytrt.server")

BIG_BODY = 1 << 20  # bodies above 1 MiB (uploads, inline reference audio) are read a few at a time


async def read_body_capped(request, cap: int, what: str, timeout: float, big: asyncio.Semaphore | None = None) \
        -> bytes:
    """The request body, or 413 as soon as it is known to exceed `cap` bytes (Content-Length or while reading),
    408 when it does not arrive within `timeout` seconds, _ClientGone when the client disconnects. Bodies over
    BIG_BODY (or of unknown length) hold one of `big`'s slots while they are read (429 when none frees in time), so
    concurrent uploads cannot hold unbounded memory."""
    from starlette.requests import ClientDisconnect

    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            n = int(declared)
        except ValueError:
            raise invalid(f"bad Content-Length header {declared[:40]!r}", None, "bad_header") from None
        if n > cap:
            raise APIError(413, f"{what} is {n} bytes; at most {cap} are accepted", code="payload_too_large")

    async def read():
        parts, total = [], 0
        async for chunk in request.stream():
            total += len(chunk)
            if total > cap:
                raise APIError(413, f"{what} exceeds {cap} bytes", code="payload_too_large")
            parts.append(chunk)
        return b"".join(parts)

    held = False
    if big is not None and (declared is None or int(declared) > BIG_BODY):
        try:
            await asyncio.wait_for(big.acquire(), timeout)
        except asyncio.TimeoutError:
            raise APIError(429, "too many large uploads in progress", code="too_many_requests",
                           headers={"Retry-After": "1"}) from None
        held = True
    try:
        return await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"{what} did not arrive within {timeout:g} s", code="request_timeout") from None
    except ClientDisconnect:
        raise _ClientGone from None
    finally:
        if held:
            big.release()


def check_content_type(request, *allowed: str) -> None:
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype not in allowed:
        raise APIError(415, f"Content-Type must be {' or '.join(allowed)}, got {ctype or 'none'!r}",
                       code="unsupported_media_type")


# ------------------------------------------------------------------------------------------------ server state

class ServerState:
    def __init__(self, tts, settings: ServerSettings, owns_tts: bool):
        self.tts = tts
        self.settings = settings
        self.owns_tts = owns_tts
        self.api_key = settings.resolve_api_key()
        self.metrics = ServerMetrics()
        self.voices = VoiceStore(settings.voices_dir, getattr(getattr(tts, "pipeline", None), "default_speaker",
                                                              None), max_voices=settings.max_voices)
        # submit() may block while the runtime is full: never on the event loop, and never on the default pool
        self.executor = ThreadPoolExecutor(max_workers=settings.max_in_flight + 1, thread_name_prefix="cosytrt-submit")
        # decoding uploads: its own small pool, so a flood of uploads cannot take the submit threads
        self.decoder = ThreadPoolExecutor(max_workers=2, thread_name_prefix="cosytrt-decode")
        self.admission: Admission | None = None
        self.warmed = False
        self.status = "loading"
        self.error: str | None = None
        self.draining = False
        self.jobs: set[SpeechJob] = set()
        self.big_bodies = asyncio.Semaphore(max(2, settings.max_in_flight))

    @property
    def ready(self) -> bool:
        return self.warmed and not self.draining and self.runtime_health()[0]

    def runtime_health(self) -> tuple[bool, str | None]:
        health = getattr(self.tts, "health", None)
        if health is None:
            return True, None
        try:
            return health()
        except Exception as e:  # noqa: BLE001
            return False, f"{type(e).__name__}: {e}"

    def health_body(self) -> tuple[dict, bool]:
        ok, why = self.runtime_health()
        if self.warmed and not self.draining and not ok:
            return {"status": "failed", "error": f"the runtime stopped: {why}"}, False
        body = {"status": self.status}
        if self.error:
            body["error"] = self.error
        return body, self.ready

    @property
    def sample_rate(self) -> int:
        return int(self.tts.sample_rate)

    def runtime_stats(self) -> dict | None:
        try:
            stats = self.tts.metrics()
            return stats if isinstance(stats, dict) else None
        except Exception:  # noqa: BLE001 - metrics must never break /metrics
            log.exception("tts.metrics() failed")
            return None

    def decode(self, data: bytes, param: str):
        s = self.settings
        return decode_upload(data, max_seconds=s.max_prompt_seconds, max_sample_rate=s.max_sample_rate,
                             max_channels=s.max_channels, param=param)

    async def warm_up(self) -> None:
        try:
            speaker = self.voices.builtin
            if speaker is None:
                from ..stages.request import default_voice_wav

                speaker = await asyncio.get_running_loop().run_in_executor(
                    None, lambda: self.tts.make_speaker(default_voice_wav(16000), "", 16000))
            if self.settings.warmup:
                t0 = time.perf_counter()
                job = SpeechJob(self.tts, ["Warm up."], {"speaker": speaker, "seed": 0,
                                                         "max_tokens": self.settings.warmup_tokens}, False)
                await job.start(self.executor)
                async for _ in job.chunks():
                    pass
                log.info("warm-up synthesis took %.2f s", time.perf_counter() - t0)
            self.warmed, self.status = True, "ready"
        except Exception as e:  # noqa: BLE001 - reported by /health
            log.exception("warm-up failed")
            self.status, self.error = "failed", f"{type(e).__name__}: {e}"

    async def drain(self) -> None:
        self.draining, self.status = True, "draining"
        deadline = time.monotonic() + self.settings.drain_timeout_s
        while self.admission is not None and self.admission.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for job in list(self.jobs):
            job.cancel()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.decoder.shutdown(wait=False, cancel_futures=True)
        if self.owns_tts:
            await asyncio.get_running_loop().run_in_executor(None, self.tts.close)


ROUTES = ("/v1/audio/speech", "/v1/voices", "/v1/audio/voices", "/v1/models", "/health", "/metrics")


def _route_label(path: str) -> str:
    if path.startswith(("/v1/voices/", "/v1/audio/voices/")):
        return "/v1/voices/{id}"
    return path if path in ROUTES else "other"


def _host_name(host: str) -> str:
    host = host.strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


# ------------------------------------------------------------------------------------------------ the app

def create_app(tts, settings: ServerSettings | None = None, *, owns_tts: bool = False):
    """The FastAPI app over one loaded `TTS`. It warms up at startup (/health 503 until done) and drains in-flight
    requests at shutdown; `owns_tts=True` also closes the TTS then.

    (This module has no `from __future__ import annotations`: FastAPI reads the route annotations, and `Request` is
    imported here, lazily.)"""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from .request import load_json, parse_speech_request  # pydantic (a FastAPI dependency)
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    settings = settings or ServerSettings()
    state = ServerState(tts, settings, owns_tts)
    host_names = settings.host_names()

    @asynccontextmanager
    async def lifespan(app):
        state.admission = Admission(settings.max_in_flight, settings.max_queue, settings.queue_timeout_s)
        warm = asyncio.create_task(state.warm_up())
        try:
            yield
        finally:
            if not warm.done():
                warm.cancel()
            await state.drain()

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

    class _Guard:
        """Checks the Host header (DNS rebinding) and counts every HTTP response by route and status (at response
        start, so a disconnect still counts)."""

        def __init__(self, inner):
            self.inner = inner

        async def __call__(self, scope, receive, send):
            if scope["type"] != "http":
                return await self.inner(scope, receive, send)
            started = False

            async def counting_send(message):
                nonlocal started
                if message["type"] == "http.response.start" and not started:
                    started = True
                    state.metrics.count_http(scope["method"], _route_label(scope["path"]), message["status"])
                await send(message)

            if host_names is not None:
                host = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k == b"host"), "")
                if _host_name(host) not in host_names:
                    e = APIError(421, f"Host {host[:64]!r} is not served here (set --allowed-hosts to serve it)",
                                 code="invalid_host")
                    return await error_response(e)(scope, receive, counting_send)
            try:
                await self.inner(scope, receive, counting_send)
            except BaseException:
                if not started:
                    state.metrics.count_http(scope["method"], _route_label(scope["path"]), 500)
                raise

    app.add_middleware(_Guard)

    def check_auth(request: Request) -> None:
        if state.api_key is None:
            return
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), state.api_key.encode()):
            raise APIError(401, "missing or incorrect API key (send 'Authorization: Bearer KEY')",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def check_serving() -> None:
        if state.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        ok, why = state.runtime_health()
        if not ok:
            raise APIError(503, f"the runtime stopped: {why}", code="runtime_failed")
        if not state.ready:
            raise APIError(503, f"the model is not ready ({state.status})", code="not_ready",
                           headers={"Retry-After": "1"})

    # ------------------------------------------------------------------ health / metrics / models
    @app.get("/health")
    async def health():
        body, ok = state.health_body()
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        adm = state.admission
        text = state.metrics.render(in_flight=adm.in_flight if adm else 0, queued=adm.waiting if adm else 0,
                                    ready=state.ready, runtime_stats=state.runtime_stats())
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request):
        check_auth(request)
        return {"object": "list", "data": [{"id": settings.model, "object": "model", "created": 0,
                                            "owned_by": "cosytrt"}]}

    # ------------------------------------------------------------------ voices
    async def list_voices(request: Request):
        check_auth(request)
        voices = await asyncio.get_running_loop().run_in_executor(None, state.voices.list)
        return {"object": "list", "data": [v.to_dict() for v in voices],
                "voices": [v.id for v in voices]}  # "voices": the plain id list some clients read

    async def create_voice(request: Request):
        check_auth(request)
        check_serving()
        check_content_type(request, "multipart/form-data")
        cap = settings.upload_cap
        data = await read_body_capped(request, cap, "the upload", settings.body_timeout_s, state.big_bodies)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return {"type": "http.disconnect"}
            replayed = True
            return {"type": "http.request", "body": data, "more_body": False}

        try:
            form = await Request(request.scope, replay).form(max_files=2, max_fields=8, max_part_size=cap)
        except Exception as e:  # noqa: BLE001 - malformed multipart
            raise invalid(f"the body must be multipart/form-data with an 'audio' file: {e}", "audio",
                          "invalid_multipart") from None
        # field names of OpenAI-style clients and of sglang-omni's harness (audio_sample / ref_text)
        upload = form.get("audio") if form.get("audio") is not None else form.get("audio_sample")
        text = form.get("text") if form.get("text") is not None else form.get("ref_text")
        name = form.get("name")
        if upload is None:
            raise invalid("'audio' (the reference audio file) is required", "audio", "missing_required")
        if isinstance(upload, str):
            raise invalid("'audio' must be a file upload", "audio", "invalid_type")
        for field_name, v in (("text", text), ("name", name)):
            if v is not None and not isinstance(v, str):
                raise invalid(f"'{field_name}' must be a text field", field_name, "invalid_type")
        if text is not None and len(text) > settings.max_transcript_chars:
            raise invalid(f"'text' is {len(text)} characters; at most {settings.max_transcript_chars}", "text",
                          "transcript_too_long")
        voice_id = name if name is not None else f"voice-{uuid.uuid4().hex[:12]}"
        try:
            check_voice_id(voice_id)
        except InputError as e:
            raise invalid(str(e), "name") from None
        if voice_id == "default" or os.path.exists(state.voices.path(voice_id)):
            raise from_runtime_error(VoiceExistsError(f"voice {voice_id!r} already exists"))
        if state.voices.max_voices is not None and state.voices.count() >= state.voices.max_voices:
            raise from_runtime_error(VoiceLimitError(f"the server stores at most {state.voices.max_voices} voices; "
                                                     f"delete one first"))
        raw = await upload.read()
        loop = asyncio.get_running_loop()
        samples, sr = await loop.run_in_executor(state.decoder, state.decode, raw, "audio")
        try:
            async with state.admission.slot():  # the speaker extraction runs the frontend models
                speaker = await loop.run_in_executor(None, lambda: tts.make_speaker(samples, text or "", sr))
            info = await loop.run_in_executor(None, state.voices.add, voice_id, speaker)
        except CosytrtError as e:
            raise from_runtime_error(e, param="name" if isinstance(e, (VoiceExistsError, VoiceLimitError)) else
                                     "audio") from None
        return JSONResponse(info.to_dict(), status_code=201)

    async def delete_voice(voice_id: str, request: Request):
        check_auth(request)
        try:
            check_voice_id(voice_id)
            state.voices.delete(voice_id)
        except VoiceExistsError as e:
            raise APIError(409, str(e), param="voice_id", code="voice_builtin") from None
        except VoiceNotFoundError as e:
            raise APIError(404, str(e), param="voice_id", code="voice_not_found") from None
        except InputError as e:
            raise invalid(str(e), "voice_id") from None
        return {"id": voice_id, "object": "voice", "deleted": True}

    for prefix in ("/v1/voices", "/v1/audio/voices"):
        app.add_api_route(prefix, list_voices, methods=["GET"])
        app.add_api_route(prefix, create_voice, methods=["POST"], status_code=201)
        app.add_api_route(prefix + "/{voice_id}", delete_voice, methods=["DELETE"])

    # ------------------------------------------------------------------ speech
    def _finisher(job: SpeechJob, admission_wait: float):
        done = False

        def finish(outcome: str) -> None:
            nonlocal done
            if done:
                return
            done = True
            if outcome != "ok":
                job.cancel()
            state.jobs.discard(job)
            state.admission.release()
            state.metrics.finish(outcome, job.metrics, admission_wait)

        return finish

    class _AudioStream(StreamingResponse):
        """A streaming response that always finishes its job (disconnect, error or success)."""

        def __init__(self, body, finish, **kw):
            super().__init__(body, **kw)
            self._finish = finish

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                try:
                    await self.body_iterator.aclose()
                finally:
                    self._finish("cancelled")  # a no-op when the body already finished it

    async def until_done_or_gone(coro, request: Request):
        """Await `coro`, but give up (cancel it, raise _ClientGone) when the client disconnects first."""
        task = asyncio.ensure_future(coro)

        async def gone():
            while (await request.receive())["type"] != "http.disconnect":
                pass

        watcher = asyncio.ensure_future(gone())
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            watcher.cancel()
        if not task.done():
            task.cancel()
            raise _ClientGone
        return task.result()

    async def resolve_speaker(params):
        """The speaker of a request: inline `ref_audio` (decoded off the loop, bounded), a stored voice, or the
        model's default voice."""
        loop = asyncio.get_running_loop()
        if params.ref_audio is not None:
            raw = await loop.run_in_executor(state.decoder, lambda: ref_audio_bytes(
                params.ref_audio, ref_dir=settings.ref_audio_dir, cap=settings.upload_cap))
            samples, sr = await loop.run_in_executor(state.decoder, state.decode, raw, "ref_audio")
            try:
                return await loop.run_in_executor(None, lambda: tts.make_speaker(samples, params.ref_text, sr))
            except CosytrtError as e:
                raise from_runtime_error(e, param="ref_audio") from None
        voice = params.voice or "default"
        if voice == "default" and state.voices.builtin is None and not os.path.isfile(state.voices.path(voice)):
            raise invalid("this model has no built-in voice: give 'voice' (a voice saved with POST /v1/voices) or "
                          "'ref_audio' + 'ref_text' (inline cloning)", "voice", "voice_required")
        try:
            return await loop.run_in_executor(None, state.voices.get, voice)
        except CosytrtError as e:
            raise from_runtime_error(e, param="voice") from None

    @app.post("/v1/audio/speech")
    async def speech(request: Request):
        check_auth(request)
        check_serving()
        check_content_type(request, "application/json")
        cap = max(65536, 8 * settings.max_input_chars + 4096, (settings.upload_cap * 4) // 3 + 8192)
        raw = await read_body_capped(request, cap, "the request body", settings.body_timeout_s, state.big_bodies)
        if len(raw) > BIG_BODY:  # an inline reference: parse it off the event loop
            body = await asyncio.get_running_loop().run_in_executor(state.decoder, load_json, raw, settings)
        else:
            body = load_json(raw, settings)
        params = parse_speech_request(body, settings)
        admission_wait = await state.admission.acquire()
        try:
            speaker = await resolve_speaker(params)
        except BaseException:
            state.admission.release()
            raise
        options = {"speaker": speaker, **params.options}
        if params.speed != 1.0:
            options["speed"] = params.speed
        job = SpeechJob(tts, segment_text(params.input, settings, params.options, tts, speaker), options,
                        params.stream)
        finish = _finisher(job, admission_wait)
        sr = state.sample_rate
        extra = {"X-Ignored-Fields": ",".join(params.ignored)} if params.ignored else {}
        if params.response_format == "pcm":
            extra.update(pcm_headers(sr))
        chunks = job.chunks()
        try:
            state.jobs.add(job)
            await job.start(state.executor)
            if params.stream:  # wait for the first chunk, so errors before any audio still get a status code
                try:
                    first = await until_done_or_gone(chunks.__anext__(), request)
                except StopAsyncIteration:
                    first = None
                return _AudioStream(_stream_body(job, params, sr, finish, first, chunks), finish,
                                    media_type="text/event-stream" if params.sse else
                                    MEDIA_TYPES[params.response_format],
                                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **extra})

            async def collect():
                return [c async for c in chunks]

            parts = await until_done_or_gone(collect(), request)
        except _ClientGone:
            finish("cancelled")
            return Response(status_code=499)  # nobody reads it; counted as "client closed request"
        except Exception as e:  # noqa: BLE001 - mapped to an HTTP error
            finish("error")
            if state.draining:
                raise APIError(503, "the server shut down before the request finished", code="shutting_down") \
                    from None
            raise from_runtime_error(e) from None
        except BaseException:
            finish("cancelled")
            raise
        finish("ok")
        wav = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        headers = {"X-Audio-Seconds": f"{wav.size / sr:.4f}", **extra}
        if job.metrics is not None:
            headers["X-Speech-Tokens"] = str(int(getattr(job.metrics, "tokens", 0) or 0))
        loop = asyncio.get_running_loop()
        body = await loop.run_in_executor(None, encode_audio, wav, sr, params.response_format)
        return Response(body, media_type=MEDIA_TYPES[params.response_format], headers=headers)

    async def _stream_body(job: SpeechJob, params, sr: int, finish, first, rest):
        outcome = "cancelled"
        samples = 0

        def encode(data: bytes) -> bytes:
            return _sse_delta(data) if params.sse else data

        try:
            if params.response_format == "wav":
                yield encode(wav_header(sr, None))
            if first is not None:
                data = pcm16(first)
                samples += len(data) // 2
                yield encode(data)
                async for chunk in rest:
                    data = pcm16(chunk)
                    samples += len(data) // 2
                    yield encode(data)
            outcome = "ok"
            if params.sse:
                tokens = int(getattr(job.metrics, "tokens", 0) or 0)
                yield _sse_event({"type": "speech.audio.done",
                                  "usage": {"input_tokens": 0, "output_tokens": tokens, "total_tokens": tokens},
                                  "audio_seconds": samples / sr})
        except Exception:  # noqa: BLE001 - the status line is already sent: end the stream
            outcome = "error"
            log.exception("synthesis failed mid-stream")
        finally:
            finish(outcome)

    return app


def _sse_event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _sse_delta(data: bytes) -> bytes:
    return _sse_event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")})


# ------------------------------------------------------------------------------------------------ running it

def serve(settings: ServerSettings, tts=None) -> int:
    """Load the model (unless given), then run uvicorn until SIGINT / SIGTERM; returns 0."""
    import uvicorn

    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    owns = tts is None
    if tts is None:
        from ..scheduling.scheduler import SchedulerConfig
        from ..tts import TTS

        t0 = time.perf_counter()
        tts = TTS.load(model=settings.model, engines=settings.engines, device=settings.device,
                       scheduler=SchedulerConfig(max_in_flight=settings.max_in_flight), compile=settings.compile,
                       compile_cache=settings.compile_cache)
        log.info("loaded model %r in %.1f s", settings.model, time.perf_counter() - t0)
    if settings.host not in LOOPBACK_HOSTS and not settings.resolve_api_key():
        log.warning("listening on %s without an API key: anyone who can reach it can use it", settings.host)
    app = create_app(tts, settings, owns_tts=owns)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            timeout_graceful_shutdown=int(math.ceil(settings.drain_timeout_s)), lifespan="on",
                            h11_max_incomplete_event_size=65536, timeout_keep_alive=5)
    uvicorn.Server(config).run()
    return 0
