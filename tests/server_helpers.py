"""Shared helpers for the server tests: response checks, Prometheus parsing, and a fake TTS whose requests are
held by a gate (deterministic backpressure / readiness / disconnect / drain tests)."""
import asyncio
import contextlib
import io
import json
import re
import threading
import time
from types import SimpleNamespace

import numpy as np
import soundfile as sf
from fastapi.testclient import TestClient

from cosytrt.engines.errors import RejectedError
from cosytrt.runtime.stages.request import RequestMetrics
from cosytrt.runtime.serving.app import ServerSettings, create_app, pcm16

SR = 24000
SAMPLES_PER_TOKEN = SR // 25  # 25 speech tokens per second


def wait_ready(client, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if client.get("/health").status_code == 200:
            return
        time.sleep(0.02)
    raise AssertionError(f"server not ready: {client.get('/health').json()}")


def read_wav(data: bytes):
    info = sf.info(io.BytesIO(data))
    samples, sr = sf.read(io.BytesIO(data), dtype="int16")
    return samples, sr, info


def assert_error(r, status, param=None, code=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def parse_metrics(text: str) -> dict:
    """Prometheus text -> {'name{labels}': value}; asserts every line is well-formed."""
    out = {}
    label = r'[a-zA-Z_][a-zA-Z0-9_]*="[^"]*"'
    sample = re.compile(rf"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{{{label}(,{label})*\}})? (-?[0-9.e+-]+|\+Inf|NaN)$")
    for line in text.strip().splitlines():
        if line.startswith("#"):
            assert re.match(r"^# (HELP|TYPE) [a-zA-Z_:][a-zA-Z0-9_:]* .+$", line), line
            continue
        m = sample.match(line)
        assert m, f"bad exposition line: {line!r}"
        out[m.group(1) + (m.group(2) or "")] = float(m.group(4))
    return out


def speech_count(metrics: dict, status: int | None = None) -> float:
    return sum(v for k, v in metrics.items() if k.startswith("cosytrt_http_requests_total{")
               and 'route="/v1/audio/speech"' in k and (status is None or f'status="{status}"' in k))



def direct_pcm(tts, text, stream=False, speaker=None, **opts) -> bytes:
    """The same request submitted to the TTS directly, as 16-bit PCM."""
    h = tts.submit(text, stream=stream, speaker=speaker or tts.pipeline.default_speaker, **opts)
    return b"".join(pcm16(c) for c in h.chunks(timeout=60))


class FakeHandle:
    """Chunks of constant value `value`; the first `free` chunks come at once, the rest after `gate` is set."""

    def __init__(self, tts, text, stream, gate, free, chunks=3):
        self.tts, self.text, self.stream, self.gate, self.free, self.n = tts, text, stream, gate, free, chunks
        self.cancelled = threading.Event()
        self.metrics = RequestMetrics(stream=stream)
        self._done = False

    def done(self):
        return self._done

    def cancel(self):
        self.cancelled.set()

    async def achunks(self):
        for i in range(self.n):
            while i >= self.free and not self.gate.is_set():
                if self.cancelled.is_set():
                    raise RejectedError("cancelled")
                await asyncio.sleep(0.005)
            if self.cancelled.is_set():
                raise RejectedError("cancelled")
            yield np.full(self.tts.chunk_samples, 0.25, np.float32)
        m = self.metrics
        m.t_tokenizer, m.t_ar, m.t_dit, m.t_vocoder, m.ttfa, m.tokens = 0.001, 0.02, 0.03, 0.01, 0.04, self.n
        m.audio_seconds, m.total = self.n * self.tts.chunk_samples / SR, 0.06
        self._done = True


class FakePipeline:
    default_speaker = SimpleNamespace(prompt_text="The fake voice.")


class FakeTTS:
    sample_rate = SR

    def __init__(self, free=3, reject=False, chunk_samples=480):
        self.pipeline = FakePipeline()
        self.chunk_samples = chunk_samples
        self.gate = threading.Event()
        self.free = free
        self.reject = reject
        self.handles: list[FakeHandle] = []
        self.stats = {"requests": 0}

    def submit(self, text, *, stream=False, speaker=None, **opts):
        if self.reject and text != "Warm up.":
            raise RejectedError("3 requests in flight (max_in_flight=3)")
        h = FakeHandle(self, text, stream, self.gate, self.free if text != "Warm up." else 99)
        h.opts = opts
        self.handles.append(h)
        return h

    def metrics(self):
        return self.stats

    def close(self):
        pass


def fake_client(tmp_path, fake, **settings):
    settings.setdefault("allowed_hosts", ["testserver"])  # Starlette's TestClient sends Host: testserver
    app = create_app(fake, ServerSettings(voices_dir=str(tmp_path / "voices"), **settings))
    return app, TestClient(app)


def in_flight(app):
    return app.state.server.admission.in_flight


@contextlib.contextmanager
def serving(tmp_path, fake=None, **settings):
    """(app, TestClient) over a fake TTS whose chunks come at once, ready."""
    fake = fake or FakeTTS()
    fake.gate.set()
    app, c = fake_client(tmp_path, fake, **settings)
    with c:
        wait_ready(c, 5)
        yield app, c


def ws_events(ws):
    """Every event until the server closes the socket: [(type, event)], binary frames as ("binary", n)."""
    out = []
    while True:
        msg = ws.receive()
        if msg["type"] == "websocket.close":
            return out + [("close", msg.get("code"))]
        if msg.get("bytes") is not None:
            out.append(("binary", len(msg["bytes"])))
            continue
        e = json.loads(msg["text"])
        out.append((e["type"], e))


@contextlib.contextmanager
def live_server(fake, settings: ServerSettings):
    """The app over `fake` served by uvicorn with `serve`'s own configuration (`uvicorn_config`; give `port=0` in
    `settings`) in a thread; yields the port it listens on, stops it at the end."""
    import uvicorn

    from cosytrt.runtime.serving.app import uvicorn_config

    server = uvicorn.Server(uvicorn_config(create_app(fake, settings), settings, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        th.join(10)
