"""A real uvicorn server on 127.0.0.1 (free port, in a thread) over the tiny model, driven by the official `openai`
client and by httpx: plain and streaming synthesis, a bounded 64-request load test, and a mid-stream disconnect."""
import io
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
import soundfile as sf

pytest.importorskip("fastapi")
pytest.importorskip("python_multipart")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from cosytrt.runtime.serving.app import ServerSettings, create_app, pcm16, uvicorn_config  # noqa: E402

SR = 24000
SAMPLES_PER_TOKEN = SR // 25
KEY = "live-test-key"
MAX_LSB_DIFF = 8  # of 32767


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics(url: str) -> dict:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def speech_count(m: dict, status: int | None = None) -> float:
    return sum(v for k, v in m.items() if k.startswith("cosytrt_http_requests_total{")
               and 'route="/v1/audio/speech"' in k and (status is None or f'status="{status}"' in k))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from cosytrt.runtime.tts import TTS

    tts = TTS.load("tiny")
    port = free_port()
    settings = ServerSettings(port=port, api_key=KEY, voices_dir=str(tmp_path_factory.mktemp("voices")),
                              max_in_flight=4, max_queue=8, queue_timeout_s=1.0, drain_timeout_s=5.0)
    app = create_app(tts, settings, owns_tts=True)
    srv = uvicorn.Server(uvicorn_config(app, settings, log_level="warning"))  # serve()'s own configuration
    thread = threading.Thread(target=srv.run, name="uvicorn-test", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline and thread.is_alive(), "server did not become ready"
        time.sleep(0.05)
    yield SimpleNamespace(url=url, app=app, tts=tts)
    srv.should_exit = True
    thread.join(30)
    assert not thread.is_alive(), "uvicorn did not stop"


@pytest.fixture
def client(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    yield c
    c.close()


def direct_pcm(tts, text, stream=False, **opts) -> bytes:
    h = tts.submit(text, stream=stream, speaker=tts.pipeline.default_speaker, **opts)
    return b"".join(pcm16(c) for c in h.chunks(timeout=60))


def test_openai_create(server, client):
    resp = client.audio.speech.create(model="cosyvoice3", voice="default", input="Hello from the live server.",
                                      extra_body={"seed": 1, "force_tokens": 20})
    data = resp.content
    samples, sr = sf.read(io.BytesIO(data), dtype="int16")
    assert sr == SR and samples.ndim == 1 and samples.size == 20 * SAMPLES_PER_TOKEN
    assert data[44:] == direct_pcm(server.tts, "Hello from the live server.", seed=1, force_tokens=20)

    raw = client.audio.speech.with_raw_response.create(model="cosyvoice3", voice="alloy", input="Tokens.",
                                                       response_format="wav", extra_body={"seed": 2, "max_tokens": 12})
    tokens = int(raw.headers["x-speech-tokens"])
    samples, _ = sf.read(io.BytesIO(raw.content), dtype="int16")
    assert 1 <= tokens <= 12 and samples.size == tokens * SAMPLES_PER_TOKEN

    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.audio.speech.create(model="cosyvoice3", voice="default", input="no")
    with pytest.raises(openai.BadRequestError, match="speed"):
        client.audio.speech.create(model="cosyvoice3", voice="default", input="x", speed=4.5)
    from cosytrt.runtime.serving.encoding import aac_available

    if aac_available():  # the 'aac' extra (PyAV) is installed: ADTS AAC
        raw = client.audio.speech.with_raw_response.create(model="cosyvoice3", voice="default", input="x",
                                                           response_format="aac", extra_body={"force_tokens": 4})
        assert raw.headers["content-type"] == "audio/aac" and raw.content[:2] in (b"\xff\xf1", b"\xff\xf9")
    else:
        with pytest.raises(openai.BadRequestError, match="aac"):
            client.audio.speech.create(model="cosyvoice3", voice="default", input="x", response_format="aac")
    with pytest.raises(openai.NotFoundError, match="nobody"):
        client.audio.speech.create(model="cosyvoice3", voice="nobody", input="x")


def test_openai_sdk_formats_and_models(server, client):
    """What the OpenAI SDK (and sglang-omni's SDK scenarios) send: each response_format, speed, and /v1/models."""
    assert [m.id for m in client.models.list().data] == ["tiny"]
    for fmt, container in (("mp3", "MP3"), ("opus", "OGG"), ("flac", "FLAC"), ("wav", "WAV")):
        data = client.audio.speech.create(model="tts-1", voice="alloy", input="Formats.", response_format=fmt,
                                          speed=1.0, extra_body={"seed": 3, "force_tokens": 10}).content
        info = sf.info(io.BytesIO(data))
        assert info.format == container and info.samplerate == SR
    raw = client.audio.speech.with_raw_response.create(model="tts-1", voice="alloy", input="Raw.",
                                                       response_format="pcm", extra_body={"force_tokens": 10})
    assert raw.headers["x-sample-rate"] == str(SR) and raw.headers["x-bit-depth"] == "16"
    assert len(raw.content) == 2 * 10 * SAMPLES_PER_TOKEN
    slow = client.audio.speech.create(model="tts-1", voice="alloy", input="Raw.", response_format="pcm", speed=0.5,
                                      extra_body={"force_tokens": 10}).content
    assert abs(len(slow) - 2 * len(raw.content)) <= 2 * SR // 50  # speed 0.5: twice the mel frames


def test_openai_streaming_response(server, client):
    pieces = []
    t0 = time.perf_counter()
    with client.audio.speech.with_streaming_response.create(
            model="cosyvoice3", voice="default", input="Streaming over HTTP.", response_format="wav",
            extra_body={"stream": True, "seed": 3, "force_tokens": 60}) as resp:
        assert resp.headers["content-type"] == "audio/wav" and "content-length" not in resp.headers
        for piece in resp.iter_bytes():
            pieces.append((time.perf_counter() - t0, piece))
    data = b"".join(p for _, p in pieces)
    print("stream pieces (s, bytes):", [(round(t, 2), len(p)) for t, p in pieces])
    assert data[4:8] == b"\xff\xff\xff\xff" and data[40:44] == b"\xff\xff\xff\xff"
    samples, sr = sf.read(io.BytesIO(data), dtype="int16")
    assert sr == SR and samples.size == 60 * SAMPLES_PER_TOKEN
    assert data[44:] == direct_pcm(server.tts, "Streaming over HTTP.", stream=True, seed=3, force_tokens=60)


def test_load_64_concurrent(server):
    variants = [dict(input=f"Load test sentence number {i}.", seed=100 + i, force_tokens=4 + i, stream=i % 2 == 1,
                     response_format="pcm", voice="default", model="cosyvoice3") for i in range(8)]
    before = metrics(server.url)
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60,
                      limits=httpx.Limits(max_connections=80, max_keepalive_connections=80)) as http:
        def one(k):
            r = http.post("/v1/audio/speech", json=variants[k % len(variants)])
            return k, r.status_code, r.content, r.headers.get("content-type", "")

        t0 = time.monotonic()
        with ThreadPoolExecutor(64) as pool:
            results = list(pool.map(one, range(64)))
        elapsed = time.monotonic() - t0
        after = metrics(server.url)
        refs = [http.post("/v1/audio/speech", json=v).content for v in variants]  # each request alone
    print(f"load: {elapsed:.1f} s, statuses", {s: [x[1] for x in results].count(s) for s in (200, 429, 503)})
    assert elapsed < 90
    assert len(results) == 64 and sorted(k for k, *_ in results) == list(range(64))
    statuses = [s for _, s, _, _ in results]
    assert set(statuses) <= {200, 429, 503}, statuses
    ok = [(k, body) for k, s, body, _ in results if s == 200]
    assert len(ok) >= 4  # at least the first max_in_flight
    for k, s, body, ctype in results:
        if s != 200:
            err = json.loads(body)["error"]
            assert ctype == "application/json" and err["code"] in ("too_many_requests", "queue_timeout", "overloaded")
    for k, body in ok:  # none mixed up: each equals the same request run alone
        v = k % len(variants)
        assert len(body) == 2 * variants[v]["force_tokens"] * SAMPLES_PER_TOKEN
        got, ref = np.frombuffer(body, "<i2").astype(np.int32), np.frombuffer(refs[v], "<i2").astype(np.int32)
        diff = np.abs(got - ref).max()
        print(f"request {k} variant {v}: max diff {diff} LSB")
        # batched rows are not bit-identical to a batch of one on CPU (float summation order): allow a few LSB
        assert diff <= MAX_LSB_DIFF, f"request {k} (variant {v}) differs from the same request run alone by {diff}"
        others = [np.abs(got - np.frombuffer(r, "<i2")).max() for j, r in enumerate(refs)
                  if j != v and len(r) == len(body)]
        assert all(o > 10 * MAX_LSB_DIFF for o in others)  # and is far from every other request's audio
    assert len(set(refs)) == len(refs)
    # /metrics counted every one of them
    assert speech_count(after) - speech_count(before) == 64
    for status in (200, 429, 503):
        assert speech_count(after, status) - speech_count(before, status) == statuses.count(status)
    assert after["cosytrt_requests_in_flight"] == 0 and after["cosytrt_queue_depth"] == 0
    oks = after['cosytrt_speech_requests_total{outcome="ok"}'] - before['cosytrt_speech_requests_total{outcome="ok"}']
    assert oks == len(ok)
    assert after["cosytrt_t_ar_seconds_count"] - before["cosytrt_t_ar_seconds_count"] == len(ok)


def test_disconnect_mid_stream_frees_slot(server):
    before = metrics(server.url)
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
        with http.stream("POST", "/v1/audio/speech", json={"model": "x", "input": "A long streamed answer.", "voice": "default",
                                                           "seed": 5, "force_tokens": 250, "stream": True,
                                                           "response_format": "pcm"}) as r:
            assert r.status_code == 200
            pieces = r.iter_raw()  # keep the iterator: dropping it would close the stream
            first = next(pieces)
            assert len(first) > 0
            m = metrics(server.url)
            assert m["cosytrt_requests_in_flight"] == 1 and m["cosytrt_runtime_requests_in_flight"] == 1
        # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 20
    while True:
        m = metrics(server.url)
        if m["cosytrt_requests_in_flight"] == 0 and m["cosytrt_runtime_requests_in_flight"] == 0:
            break
        assert time.monotonic() < deadline, "the disconnected request still holds its slot"
        time.sleep(0.05)
    cancelled = 'cosytrt_speech_requests_total{outcome="cancelled"}'
    assert m[cancelled] == before[cancelled] + 1
    assert m['cosytrt_speech_requests_total{outcome="ok"}'] == before['cosytrt_speech_requests_total{outcome="ok"}']
    assert server.tts.metrics()["stages"]["cancelled"] >= 1  # the runtime itself dropped the request


def test_websocket_session_barge_in_and_message_cap(server):
    """WS /v1/audio/speech/stream through uvicorn's own WebSocket protocol (the `serve` extra's websockets): audio
    of the first sentence as it is made, a barge-in that frees the runtime, and a message over the cap
    (`ws_max_bytes`) closing the socket with 1009 instead of being buffered."""
    ws_sync = pytest.importorskip("websockets.sync.client")
    from websockets.exceptions import ConnectionClosed

    from cosytrt.runtime.serving.routes_ws import ws_max_bytes

    url = server.url.replace("http://", "ws://") + "/v1/audio/speech/stream"
    auth = {"Authorization": f"Bearer {KEY}"}
    with ws_sync.connect(url, additional_headers=auth, open_timeout=10) as ws:
        ws.send(json.dumps({"type": "session.config", "model": "x", "voice": "default", "stream_audio": True,
                            "seed": 3, "force_tokens": 250, "sample_rate": 16000}))
        assert json.loads(ws.recv(timeout=10))["sample_rate"] == 16000
        ws.send(json.dumps({"type": "input.text", "text": "A long sentence to interrupt. Another one after it."}))
        start = json.loads(ws.recv(timeout=60))
        assert start["type"] == "audio.start" and start["sentence_index"] == 0
        assert isinstance(ws.recv(timeout=60), bytes)  # the first chunk, long before the 10 s sentence ends
        ws.send(json.dumps({"type": "input.cancel"}))
        while True:
            msg = ws.recv(timeout=60)
            if isinstance(msg, str) and json.loads(msg)["type"] == "input.cancelled":
                break
        assert json.loads(msg)["sentence_indices"][0] == 0
        ws.send(json.dumps({"type": "input.done"}))
        assert json.loads(ws.recv(timeout=10))["type"] == "session.done"
    deadline = time.monotonic() + 20
    while metrics(server.url)["cosytrt_runtime_requests_in_flight"] != 0:
        assert time.monotonic() < deadline, "the cancelled sentence still runs"
        time.sleep(0.05)
    with ws_sync.connect(url, additional_headers=auth, open_timeout=10, max_size=None) as ws:
        cap = ws_max_bytes(server.app.state.server.settings)
        ws.send(json.dumps({"type": "session.config", "model": "x", "pad": "x" * cap}))
        with pytest.raises(ConnectionClosed) as e:
            ws.recv(timeout=10)
        assert e.value.rcvd is not None and e.value.rcvd.code == 1009
