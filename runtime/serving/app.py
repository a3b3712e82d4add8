"""`trtbuild serve`: an OpenAI-compatible speech server over one shared `TTS`.

    app = create_app(tts, ServerSettings(voices_dir="voices"))   # FastAPI app (tests, embedding)
    serve(ServerSettings(model="tiny", port=8000))                # load, warm up, run uvicorn

Endpoints: `POST /v1/audio/speech` (OpenAI request shape; wav | pcm | flac; `stream` for chunked audio, or
`stream_format: "sse"` for OpenAI's audio-delta events), `POST/GET /v1/voices`, `DELETE /v1/voices/{id}`,
`GET /health` (200 once loaded and warmed) and `GET /metrics` (Prometheus text format).

FastAPI / uvicorn / python-multipart (the `serve` extra) are imported only inside `create_app` / `serve`, so the rest
of cosytrt imports without them. Errors have OpenAI's shape: {"error": {"message", "type", "param", "code"}}.
"""
import asyncio
import base64
import hmac
import io
import json
import logging
import math
import os
import struct
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AsyncIterator

import numpy as np

from ...engines.errors import CosytrtError, InputError, RejectedError, RequestTooLongError
from .voices import VoiceExistsError, VoiceNotFoundError, VoiceStore, check_voice_id

log = logging.getLogger("cosytrt.server")

SERVE_PACKAGES = ((("fastapi",), "fastapi"), (("uvicorn",), "uvicorn"),
                  (("python_multipart", "multipart"), "python-multipart"))  # (import names, pip name)
RESPONSE_FORMATS = ("wav", "pcm", "flac")
MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac"}
SPEECH_FIELDS = {"model", "input", "voice", "response_format", "speed", "seed", "instruct", "instructions", "stream",
                 "stream_format", "max_tokens", "force_tokens"}
UNKNOWN_LENGTH = 0xFFFFFFFF


@dataclass
class ServerSettings:
    model: str = "tiny"
    engines: str | None = None
    device: str = "cpu"
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    voices_dir: str = field(default_factory=lambda: os.path.join(os.path.expanduser("~"), ".cache", "cosytrt",
                                                                 "voices"))
    max_input_chars: int = 4096
    max_upload_mb: float = 10.0
    max_in_flight: int = 8        # requests admitted to the runtime at once
    max_queue: int = 64           # requests waiting for a slot; beyond it: 429
    queue_timeout_s: float = 30.0  # longest wait for a slot; beyond it: 503
    drain_timeout_s: float = 30.0  # shutdown waits this long for in-flight requests
    warmup: bool = True
    warmup_tokens: int = 8
    log_level: str = "info"
    compile: bool = False          # torch.compile the LM and DiT at start-up (TTS.load(compile=True))
    compile_cache: str | None = None  # torch.compile artifacts to reuse / write (needs compile)

    def __post_init__(self):
        for name in ("max_input_chars", "max_in_flight", "port"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if name == "port" else 1):
                raise InputError(f"server setting {name} must be a positive integer, got {v!r}")
        if not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise InputError(f"server setting max_queue must be a non-negative integer, got {self.max_queue!r}")
        for name in ("max_upload_mb", "queue_timeout_s", "drain_timeout_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise InputError(f"server setting {name} must be a positive number, got {v!r}")


def missing_serve_packages() -> list[str]:
    """pip names of the `serve` extra's packages that are not importable."""
    import importlib.util

    return [pip for mods, pip in SERVE_PACKAGES if all(importlib.util.find_spec(m) is None for m in mods)]


# ------------------------------------------------------------------------------------------------ errors

class APIError(Exception):
    """An HTTP error with an OpenAI-shaped JSON body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("server_error" if status >= 500 else "rate_limit_error" if status == 429 else
                             "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _from_runtime_error(e: Exception, param: str | None = None) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, VoiceNotFoundError):
        return APIError(404, str(e), param=param or "voice", code="voice_not_found")
    if isinstance(e, VoiceExistsError):
        return APIError(409, str(e), param=param or "name", code="voice_exists")
    if isinstance(e, RequestTooLongError):
        return APIError(413, str(e), param="input", code="request_too_long")
    if isinstance(e, RejectedError):
        return APIError(429, f"the runtime is at capacity: {e}", code="overloaded", headers={"Retry-After": "1"})
    if isinstance(e, CosytrtError):
        return APIError(422, str(e), param=param, code="invalid_value")
    log.exception("internal error", exc_info=e)
    return APIError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error")


# ------------------------------------------------------------------------------------------------ audio encoding

def pcm16(wav: np.ndarray) -> bytes:
    """float32 samples in [-1, 1] -> 16-bit little-endian PCM bytes."""
    x = np.clip(np.asarray(wav, dtype=np.float32).reshape(-1), -1.0, 1.0)
    return np.rint(x * 32767.0).astype("<i2").tobytes()


def wav_header(sample_rate: int, num_samples: int | None) -> bytes:
    """44-byte RIFF/WAVE header for 16-bit mono PCM; `num_samples=None` writes 0xFFFFFFFF sizes (streaming)."""
    if num_samples is None:
        riff_size = data_size = UNKNOWN_LENGTH
    else:
        data_size = 2 * num_samples
        riff_size = 36 + data_size
    return (b"RIFF" + struct.pack("<I", riff_size) + b"WAVE" + b"fmt " +
            struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, 2 * sample_rate, 2, 16) + b"data" +
            struct.pack("<I", data_size))


def encode_audio(wav: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    pcm = pcm16(wav)
    if fmt == "pcm":
        return pcm
    if fmt == "wav":
        return wav_header(sample_rate, len(pcm) // 2) + pcm
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, np.frombuffer(pcm, dtype="<i2"), sample_rate, format="FLAC", subtype="PCM_16")
    return buf.getvalue()


# ------------------------------------------------------------------------------------------------ metrics

TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RTF_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0, 10.0, 50.0)
HISTOGRAMS = (  # (metric name, RequestMetrics attribute, help, buckets)
    ("cosytrt_t_tokenizer_seconds", "t_tokenizer", "Frontend time (T_tokenizer) per request", TIME_BUCKETS),
    ("cosytrt_t_ar_seconds", "t_ar", "AR LM decode time (T_AR) per request", TIME_BUCKETS),
    ("cosytrt_t_dit_seconds", "t_dit", "Flow / DiT time (T_DiT) per request", TIME_BUCKETS),
    ("cosytrt_t_vocoder_seconds", "t_vocoder", "HiFT vocoder time (T_vocoder) per request", TIME_BUCKETS),
    ("cosytrt_t_queue_seconds", "t_queue", "Queue time (server admission + runtime queue) per request",
     TIME_BUCKETS),
    ("cosytrt_time_to_first_audio_seconds", "ttfa", "Time from submit to the first audio chunk", TIME_BUCKETS),
    ("cosytrt_rtf", "rtf", "Real-time factor (synthesis time / audio duration) per request", RTF_BUCKETS),
)
RUNTIME_COUNTERS = (("cosytrt_bucket_hits_total", "bucket_hits", "Engine calls that found an exact bucket"),
                    ("cosytrt_bucket_pads_total", "bucket_pads", "Engine calls padded up to a larger bucket"),
                    ("cosytrt_eager_fallbacks_total", "eager_fallbacks", "Calls that no bucket fit, run eagerly"))


class Histogram:
    def __init__(self, buckets):
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, v) -> None:
        if v is None or not math.isfinite(v):
            return
        i = next((k for k, b in enumerate(self.bounds) if v <= b), len(self.bounds))
        self.counts[i] += 1
        self.sum += float(v)

    def lines(self, name: str) -> list[str]:
        out, cum = [], 0
        for b, c in zip(self.bounds + (float("inf"),), self.counts):
            cum += c
            out.append(f'{name}_bucket{{le="{"+Inf" if b == float("inf") else repr(float(b))}"}} {cum}')
        return out + [f"{name}_sum {self.sum!r}", f"{name}_count {cum}"]


def _labels(**kw) -> str:
    def esc(v):
        return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in kw.items()) + "}"


def _nested_dicts(d: dict, depth: int = 3):
    yield d
    if depth > 0:
        for v in d.values():
            if isinstance(v, dict):
                yield from _nested_dicts(v, depth - 1)


def runtime_view(stats: dict | None) -> dict:
    """What /metrics takes from `tts.metrics()`: the scheduler's in-flight count and queues, and bucket hits / pads /
    eager fallbacks (explicit `bucket_hits` / `bucket_pads` / `eager_fallbacks` keys, a number or {stage: number},
    else derived from a ShapeStats summary: pads = bucketed calls with padding waste > 1, over its kept samples)."""
    dicts = list(_nested_dicts(stats or {}))
    sched = next((d for d in dicts if "in_flight" in d and isinstance(d.get("queues"), dict)), {})
    shapes = next((d for d in dicts if {"hits", "fallbacks"} <= set(d) and isinstance(d.get("stages"), dict)), None)
    counters = {}
    for key in ("bucket_hits", "bucket_pads", "eager_fallbacks"):
        v = next((d[key] for d in dicts if key in d), None)
        if v is None and shapes is not None:
            v = {}
            for sm, st in shapes["stages"].items():
                if not isinstance(st, dict):
                    continue
                samples = (st.get("waste") or {}).get("samples") or []
                v[sm] = (st.get("hits", 0) if key == "bucket_hits" else st.get("fallbacks", 0)
                         if key == "eager_fallbacks" else sum(1 for w in samples if w > 1 + 1e-9))
        counters[key] = v
    return {"in_flight": _number(sched.get("in_flight")), "queues": sched.get("queues", {}), "counters": counters}


def _number(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


class ServerMetrics:
    """Everything /metrics exposes; updated from the event loop thread."""

    def __init__(self):
        self.lock = threading.Lock()
        self.histograms = {name: Histogram(b) for name, _, _, b in HISTOGRAMS}
        self.http: dict[tuple[str, str, int], int] = {}
        self.outcomes: dict[str, int] = {}
        self.audio_seconds = 0.0
        self.speech_tokens = 0

    def count_http(self, method: str, route: str, status: int) -> None:
        with self.lock:
            k = (method, route, int(status))
            self.http[k] = self.http.get(k, 0) + 1

    def finish(self, outcome: str, m=None, admission_wait: float = 0.0) -> None:
        with self.lock:
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
            if outcome != "ok" or m is None:
                return
            for name, attr, _, _ in HISTOGRAMS:
                v = getattr(m, attr, None)
                if attr == "t_queue":
                    v = (v or 0.0) + admission_wait
                self.histograms[name].observe(_number(v))
            self.audio_seconds += float(getattr(m, "audio_seconds", 0.0) or 0.0)
            self.speech_tokens += int(getattr(m, "tokens", 0) or 0)

    def render(self, *, in_flight: int, queued: int, ready: bool, runtime_stats: dict | None) -> str:
        stats = runtime_stats or {}
        lines: list[str] = []

        def head(name, kind, text):
            lines.extend([f"# HELP {name} {text}", f"# TYPE {name} {kind}"])

        with self.lock:
            for name, _, text, _ in HISTOGRAMS:
                head(name, "histogram", text)
                lines.extend(self.histograms[name].lines(name))
            head("cosytrt_http_requests_total", "counter", "HTTP responses by method, route and status")
            for (method, route, status), n in sorted(self.http.items()):
                lines.append(f"cosytrt_http_requests_total{_labels(method=method, route=route, status=status)} {n}")
            head("cosytrt_speech_requests_total", "counter",
                 "Admitted speech requests by outcome (ok, error, cancelled)")
            for outcome in sorted(set(self.outcomes) | {"ok", "error", "cancelled"}):
                lines.append(f"cosytrt_speech_requests_total{_labels(outcome=outcome)} "
                             f"{self.outcomes.get(outcome, 0)}")
            head("cosytrt_audio_seconds_total", "counter", "Seconds of audio synthesized")
            lines.append(f"cosytrt_audio_seconds_total {self.audio_seconds!r}")
            head("cosytrt_speech_tokens_total", "counter", "Speech tokens generated")
            lines.append(f"cosytrt_speech_tokens_total {self.speech_tokens}")
        view = runtime_view(runtime_stats)
        waiting = sum(int(_number(view["queues"].get(q)) or 0) for q in ("frontend", "ar_waiting"))
        head("cosytrt_requests_in_flight", "gauge", "Speech requests admitted by the server and not finished")
        lines.append(f"cosytrt_requests_in_flight {in_flight}")
        head("cosytrt_queue_depth", "gauge",
             "Requests waiting: for a server slot, plus in the runtime before AR decoding starts")
        lines.append(f"cosytrt_queue_depth {queued + waiting}")
        head("cosytrt_runtime_requests_in_flight", "gauge", "Requests in flight in the runtime scheduler")
        lines.append(f"cosytrt_runtime_requests_in_flight {view['in_flight'] or 0.0!r}")
        head("cosytrt_runtime_queue_depth", "gauge", "Jobs queued per runtime stage")
        for q, n in sorted(view["queues"].items()):
            if _number(n) is not None:
                lines.append(f"cosytrt_runtime_queue_depth{_labels(queue=q)} {_number(n)!r}")
        head("cosytrt_ready", "gauge", "1 once the model is loaded and warmed")
        lines.append(f"cosytrt_ready {int(ready)}")
        for name, key, text in RUNTIME_COUNTERS:
            head(name, "counter", text)
            v = view["counters"][key]
            per_stage = [(k, _number(x)) for k, x in sorted(v.items())] if isinstance(v, dict) else []
            per_stage = [(k, x) for k, x in per_stage if x is not None]
            if per_stage:
                lines.extend(f"{name}{_labels(stage=k)} {x!r}" for k, x in per_stage)
            else:
                lines.append(f"{name} {_number(v) or 0.0!r}")
        return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ admission

class Admission:
    """At most `max_in_flight` admitted requests; up to `max_queue` more wait (429 beyond), each at most
    `timeout` seconds (503 then). Lives on one event loop; create it there."""

    def __init__(self, max_in_flight: int, max_queue: int, timeout: float):
        self.max_in_flight, self.max_queue, self.timeout = max_in_flight, max_queue, timeout
        self.in_flight = 0
        self.waiting = 0
        self._sem = asyncio.Semaphore(max_in_flight)

    async def acquire(self) -> float:
        """Wait for a slot; returns the seconds waited."""
        t0 = time.perf_counter()
        if self._sem.locked() or self.waiting:
            if self.waiting >= self.max_queue:
                raise APIError(429, f"too many requests: {self.in_flight} in flight and {self.waiting} waiting "
                                    f"(limits {self.max_in_flight} / {self.max_queue})", code="too_many_requests",
                               headers={"Retry-After": "1"})
            self.waiting += 1
            try:
                await asyncio.wait_for(self._sem.acquire(), self.timeout)
            except asyncio.TimeoutError:
                raise APIError(503, f"no synthesis slot became free within {self.timeout:g} s",
                               code="queue_timeout", headers={"Retry-After": "1"}) from None
            finally:
                self.waiting -= 1
        else:
            await self._sem.acquire()
        self.in_flight += 1
        return time.perf_counter() - t0

    def release(self) -> None:
        self.in_flight -= 1
        self._sem.release()


# ------------------------------------------------------------------------------------------------ jobs

class _ClientGone(Exception):
    """The client disconnected before its response was ready."""


class SpeechJob:
    """One request on the shared TTS (`tts.submit`), consumed from the event loop."""

    def __init__(self, tts, text: str, options: dict, stream: bool):
        self.tts, self.text, self.options, self.stream = tts, text, options, stream
        self.handle = None
        self.cancelled = False

    @property
    def metrics(self):
        return getattr(self.handle, "metrics", None)

    async def start(self, executor: ThreadPoolExecutor) -> None:
        """Submit (in `executor`: the runtime may wait for space); RejectedError / InputError propagate."""
        fut = asyncio.get_running_loop().run_in_executor(
            executor, lambda: self.tts.submit(self.text, stream=self.stream, **self.options))
        try:
            self.handle = await asyncio.shield(fut)
        except asyncio.CancelledError:  # the caller went away while submitting: cancel the request once it exists
            fut.add_done_callback(lambda f: f.cancelled() or f.exception() or f.result().cancel())
            raise
        if self.cancelled:
            self.handle.cancel()

    async def chunks(self) -> AsyncIterator[np.ndarray]:
        async for c in self.handle.achunks():
            yield c

    def cancel(self) -> None:
        self.cancelled = True
        if self.handle is not None:
            try:
                self.handle.cancel()
            except Exception:  # noqa: BLE001
                log.exception("cancelling a request failed")


# ------------------------------------------------------------------------------------------------ request parsing

@dataclass
class SpeechParams:
    input: str
    voice: str
    response_format: str = "wav"
    stream: bool = False
    sse: bool = False
    options: dict = field(default_factory=dict)  # seed, instruct, max_tokens, force_tokens


def _check_type(body: dict, name: str, types, what: str):
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise APIError(422, f"'{name}' must be {what}, got {json.dumps(v)}", param=name, code="invalid_type")
    if not isinstance(v, types):
        raise APIError(422, f"'{name}' must be {what}, got {type(v).__name__}", param=name, code="invalid_type")
    return v


def parse_speech_request(body, settings: ServerSettings) -> SpeechParams:
    """Validate the JSON body of /v1/audio/speech; APIError (422 / 413) naming the field."""
    if not isinstance(body, dict):
        raise APIError(422, f"request body must be a JSON object, got {type(body).__name__}", param="body",
                       code="invalid_type")
    unknown = sorted(set(body) - SPEECH_FIELDS)
    if unknown:
        raise APIError(422, f"unknown field(s): {', '.join(unknown)}; supported: {', '.join(sorted(SPEECH_FIELDS))}",
                       param=unknown[0], code="unknown_parameter")
    _check_type(body, "model", str, "a string")
    text = _check_type(body, "input", str, "a string")
    if text is None:
        raise APIError(422, "'input' is required (the text to speak)", param="input", code="missing_required")
    if not text.strip():
        raise APIError(422, "'input' is empty", param="input", code="invalid_value")
    if len(text) > settings.max_input_chars:
        raise APIError(413, f"'input' is {len(text)} characters long; at most {settings.max_input_chars} are "
                            f"allowed", param="input", code="input_too_long")
    voice = body.get("voice")
    if isinstance(voice, dict):
        voice = voice.get("id")
    if voice is None:
        raise APIError(422, "'voice' is required (a voice id, e.g. 'default')", param="voice",
                       code="missing_required")
    if not isinstance(voice, str):
        raise APIError(422, f"'voice' must be a string or {{\"id\": ...}}, got {type(voice).__name__}",
                       param="voice", code="invalid_type")
    try:
        check_voice_id(voice)
    except InputError as e:
        raise APIError(422, str(e), param="voice", code="invalid_value") from None
    fmt = _check_type(body, "response_format", str, "a string") or "wav"
    if fmt not in RESPONSE_FORMATS:
        raise APIError(422, f"response_format {fmt!r} is not supported; use one of {', '.join(RESPONSE_FORMATS)}",
                       param="response_format", code="unsupported_value")
    speed = _check_type(body, "speed", (int, float), "a number")
    if speed is not None and float(speed) != 1.0:
        raise APIError(422, f"speed {speed!r} is not supported: only 1.0", param="speed", code="unsupported_value")
    stream = bool(_check_type(body, "stream", bool, "true or false"))
    stream_format = _check_type(body, "stream_format", str, "a string")
    if stream_format not in (None, "audio", "sse"):
        raise APIError(422, f"stream_format {stream_format!r} is not supported; use 'audio' or 'sse'",
                       param="stream_format", code="unsupported_value")
    sse = stream_format == "sse"
    stream = stream or sse
    if stream and fmt == "flac":
        raise APIError(422, "streaming supports response_format 'wav' and 'pcm', not 'flac'",
                       param="response_format", code="unsupported_value")
    options: dict = {}
    seed = _check_type(body, "seed", int, "an integer")
    if seed is not None:
        if not 0 <= seed < 2 ** 63:
            raise APIError(422, f"'seed' must be in [0, 2^63), got {seed}", param="seed", code="invalid_value")
        options["seed"] = seed
    instruct = _check_type(body, "instruct", str, "a string")
    instructions = _check_type(body, "instructions", str, "a string")
    if instruct and instructions:
        raise APIError(422, "give 'instruct' or 'instructions', not both", param="instructions",
                       code="invalid_value")
    if instruct or instructions:
        options["instruct"] = instruct or instructions
    for name in ("max_tokens", "force_tokens"):
        v = _check_type(body, name, int, "an integer")
        if v is not None:
            if v < 1:
                raise APIError(422, f"'{name}' must be >= 1, got {v}", param=name, code="invalid_value")
            options[name] = v
    return SpeechParams(input=text, voice=voice, response_format=fmt, stream=stream, sse=sse, options=options)


async def read_body_capped(request, cap: int, what: str) -> bytes:
    """The request body, or 413 as soon as it is known to exceed `cap` bytes (Content-Length or while reading)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            n = int(declared)
        except ValueError:
            raise APIError(400, f"bad Content-Length header {declared!r}", param=None, code="bad_header") from None
        if n > cap:
            raise APIError(413, f"{what} is {n} bytes; at most {cap} are accepted", param=None,
                           code="payload_too_large")
    parts, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > cap:
            raise APIError(413, f"{what} exceeds {cap} bytes", param=None, code="payload_too_large")
        parts.append(chunk)
    return b"".join(parts)


def decode_upload(data: bytes) -> tuple[np.ndarray, int]:
    """Uploaded audio bytes (any format libsndfile reads) -> float32 mono samples and their sample rate."""
    import soundfile as sf

    if not data:
        raise APIError(422, "'audio' is empty", param="audio", code="invalid_value")
    try:
        samples, sr = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except Exception as e:  # noqa: BLE001 - libsndfile raises several types
        raise APIError(422, f"'audio' could not be decoded (WAV, FLAC or OGG expected): {e}", param="audio",
                       code="invalid_audio") from None
    return samples.mean(axis=1), int(sr)


# ------------------------------------------------------------------------------------------------ server state

class ServerState:
    def __init__(self, tts, settings: ServerSettings, owns_tts: bool):
        self.tts = tts
        self.settings = settings
        self.owns_tts = owns_tts
        self.metrics = ServerMetrics()
        self.voices = VoiceStore(settings.voices_dir, getattr(getattr(tts, "pipeline", None), "default_speaker",
                                                              None))
        # submit() may block while the runtime is full: never on the event loop, and never on the default pool
        self.executor = ThreadPoolExecutor(max_workers=settings.max_in_flight + 1, thread_name_prefix="cosytrt-submit")
        self.admission: Admission | None = None
        self.ready = False
        self.status = "loading"
        self.error: str | None = None
        self.draining = False
        self.jobs: set[SpeechJob] = set()

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

    async def warm_up(self) -> None:
        try:
            speaker = self.voices.builtin
            if speaker is None:
                from ..scheduling.request import default_voice_wav

                speaker = await asyncio.get_running_loop().run_in_executor(
                    None, lambda: self.tts.make_speaker(default_voice_wav(16000), "", 16000))
            if self.settings.warmup:
                t0 = time.perf_counter()
                job = SpeechJob(self.tts, "Warm up.", {"speaker": speaker, "seed": 0,
                                                       "max_tokens": self.settings.warmup_tokens}, False)
                await job.start(self.executor)
                async for _ in job.chunks():
                    pass
                log.info("warm-up synthesis took %.2f s", time.perf_counter() - t0)
            self.ready, self.status = True, "ready"
        except Exception as e:  # noqa: BLE001 - reported by /health
            log.exception("warm-up failed")
            self.status, self.error = "failed", f"{type(e).__name__}: {e}"

    async def drain(self) -> None:
        self.draining, self.ready, self.status = True, False, "draining"
        deadline = time.monotonic() + self.settings.drain_timeout_s
        while self.admission is not None and self.admission.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for job in list(self.jobs):
            job.cancel()
        self.executor.shutdown(wait=False, cancel_futures=True)
        if self.owns_tts:
            await asyncio.get_running_loop().run_in_executor(None, self.tts.close)


def _route_label(path: str) -> str:
    if path.startswith("/v1/voices/"):
        return "/v1/voices/{id}"
    if path in ("/v1/audio/speech", "/v1/voices", "/health", "/metrics"):
        return path
    return "other"


# ------------------------------------------------------------------------------------------------ the app

def create_app(tts, settings: ServerSettings | None = None, *, owns_tts: bool = False):
    """The FastAPI app over one loaded `TTS`. It warms up at startup (/health 503 until done) and drains in-flight
    requests at shutdown; `owns_tts=True` also closes the TTS then.

    (This module has no `from __future__ import annotations`: FastAPI reads the route annotations, and `Request` is
    imported here, lazily.)"""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    settings = settings or ServerSettings()
    state = ServerState(tts, settings, owns_tts)

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

    app = FastAPI(title="cosytrt speech server", version="0.1.0", lifespan=lifespan)
    app.state.server = state

    def error_response(e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return error_response(e)

    @app.exception_handler(CosytrtError)
    async def _cosytrt_error(request, e: CosytrtError):
        return error_response(_from_runtime_error(e))

    @app.exception_handler(Exception)
    async def _internal_error(request, e: Exception):
        return error_response(_from_runtime_error(e))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        return error_response(APIError(e.status_code, str(e.detail), code="not_found" if e.status_code == 404 else
                                       None, headers=getattr(e, "headers", None)))

    class _CountResponses:
        """Counts every HTTP response by route and status (at response start, so a disconnect still counts)."""

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

            try:
                await self.inner(scope, receive, counting_send)
            except BaseException:
                if not started:
                    state.metrics.count_http(scope["method"], _route_label(scope["path"]), 500)
                raise

    app.add_middleware(_CountResponses)

    def check_auth(request: Request) -> None:
        if settings.api_key is None:
            return
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), settings.api_key.encode()):
            raise APIError(401, "missing or incorrect API key (send 'Authorization: Bearer KEY')",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def check_serving() -> None:
        if state.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if not state.ready:
            raise APIError(503, f"the model is not ready ({state.status})", code="not_ready",
                           headers={"Retry-After": "1"})

    # ------------------------------------------------------------------ health / metrics
    @app.get("/health")
    async def health():
        body = {"status": state.status}
        if state.error:
            body["error"] = state.error
        return JSONResponse(body, status_code=200 if state.ready else 503)

    @app.get("/metrics")
    async def metrics():
        adm = state.admission
        text = state.metrics.render(in_flight=adm.in_flight if adm else 0, queued=adm.waiting if adm else 0,
                                    ready=state.ready, runtime_stats=state.runtime_stats())
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    # ------------------------------------------------------------------ voices
    @app.get("/v1/voices")
    async def list_voices(request: Request):
        check_auth(request)
        voices = await asyncio.get_running_loop().run_in_executor(None, state.voices.list)
        return {"object": "list", "data": [v.to_dict() for v in voices]}

    @app.post("/v1/voices", status_code=201)
    async def create_voice(request: Request):
        check_auth(request)
        check_serving()
        cap = int(settings.max_upload_mb * 1024 * 1024)
        data = await read_body_capped(request, cap, "the upload")
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
            raise APIError(422, f"the body must be multipart/form-data with an 'audio' file: {e}", param="audio",
                           code="invalid_multipart") from None
        upload, text, name = form.get("audio"), form.get("text"), form.get("name")
        if upload is None:
            raise APIError(422, "'audio' (the reference audio file) is required", param="audio",
                           code="missing_required")
        if isinstance(upload, str):
            raise APIError(422, "'audio' must be a file upload", param="audio", code="invalid_type")
        for field_name, v in (("text", text), ("name", name)):
            if v is not None and not isinstance(v, str):
                raise APIError(422, f"'{field_name}' must be a text field", param=field_name, code="invalid_type")
        voice_id = name or f"voice-{uuid.uuid4().hex[:12]}"
        try:
            check_voice_id(voice_id)
        except InputError as e:
            raise APIError(422, str(e), param="name", code="invalid_value") from None
        if voice_id == "default" or os.path.exists(state.voices.path(voice_id)):
            raise _from_runtime_error(VoiceExistsError(f"voice {voice_id!r} already exists"))
        samples, sr = decode_upload(await upload.read())
        loop = asyncio.get_running_loop()
        try:
            speaker = await loop.run_in_executor(None, lambda: tts.make_speaker(samples, text or "", sr))
            info = await loop.run_in_executor(None, state.voices.add, voice_id, speaker)
        except CosytrtError as e:
            raise _from_runtime_error(e, param="audio" if not isinstance(e, VoiceExistsError) else "name") from None
        return JSONResponse(info.to_dict(), status_code=201)

    @app.delete("/v1/voices/{voice_id}")
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
            raise APIError(422, str(e), param="voice_id", code="invalid_value") from None
        return {"id": voice_id, "object": "voice", "deleted": True}

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

    @app.post("/v1/audio/speech")
    async def speech(request: Request):
        check_auth(request)
        check_serving()
        raw = await read_body_capped(request, max(65536, 8 * settings.max_input_chars + 4096), "the request body")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(422, f"the request body is not valid JSON: {e}", param="body", code="invalid_json") \
                from None
        params = parse_speech_request(body, settings)
        try:
            speaker = await asyncio.get_running_loop().run_in_executor(None, state.voices.get, params.voice)
        except CosytrtError as e:
            raise _from_runtime_error(e, param="voice") from None
        admission_wait = await state.admission.acquire()
        job = SpeechJob(tts, params.input, {"speaker": speaker, **params.options}, params.stream)
        finish = _finisher(job, admission_wait)
        sr = state.sample_rate
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
                                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

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
            raise _from_runtime_error(e) from None
        except BaseException:
            finish("cancelled")
            raise
        finish("ok")
        wav = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        headers = {"X-Audio-Seconds": f"{wav.size / sr:.4f}"}
        if job.metrics is not None:
            headers["X-Speech-Tokens"] = str(int(getattr(job.metrics, "tokens", 0) or 0))
        return Response(encode_audio(wav, sr, params.response_format),
                        media_type=MEDIA_TYPES[params.response_format], headers=headers)

    async def _stream_body(job: SpeechJob, params: SpeechParams, sr: int, finish, first, rest):
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
    if settings.host not in ("127.0.0.1", "localhost", "::1") and not settings.api_key:
        log.warning("listening on %s without an API key: anyone who can reach it can use it", settings.host)
    app = create_app(tts, settings, owns_tts=owns)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            timeout_graceful_shutdown=int(math.ceil(settings.drain_timeout_s)), lifespan="on")
    uvicorn.Server(config).run()
    return 0
