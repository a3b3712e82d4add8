"""Defects a hostile or careless client could trigger, found by an audit of the server (runtime/serving/), each with
the request that showed it: an unbounded `instructions` field, bare base64 MP3 taken for a file path, float
reference audio far out of range making a NaN voice, a binary websocket frame answered as an internal error, a
websocket client's messages queued without bound, and a streamed response whose client stopped reading holding its
slot for ever (and a websocket session's client, its session)."""
import asyncio
import base64
import contextlib
import io
import json
import time

import numpy as np
import pytest
import soundfile as sf

pytest.importorskip("fastapi")
pytest.importorskip("python_multipart")
from fastapi.testclient import TestClient  # noqa: E402
from server_helpers import FakeTTS, assert_error, fake_client, serving, wait_ready, ws_events  # noqa: E402

from cosytrt.runtime.serving import routes_ws  # noqa: E402
from cosytrt.runtime.serving.app import ServerSettings, create_app  # noqa: E402
from cosytrt.runtime.serving.encoding import decode_upload, ref_audio_bytes  # noqa: E402
from cosytrt.runtime.serving.streaming import ClientStalled, audio_stream_response, bounded_send  # noqa: E402

BODY = {"model": "cosyvoice3", "input": "Hello there.", "voice": "default"}
WS = "/v1/audio/speech/stream"
CONFIG = {"type": "session.config", "model": "x", "voice": "default", "response_format": "pcm", "stream_audio": True}


def audio_bytes(samples, sr=16000, fmt="WAV", subtype="PCM_16") -> bytes:
    buf = io.BytesIO()
    sf.write(buf, np.asarray(samples, np.float32), sr, format=fmt, subtype=subtype)
    return buf.getvalue()


# ------------------------------------------------------------------------------------------------ instructions

def test_instructions_are_bounded_like_the_input(tmp_path):
    """`instructions` (or `instruct`) of 10 MB was tokenised by the runtime (12 s of CPU holding a slot) before a
    413; it is bounded by --max-input-chars as `input` is: 400 before admission, also in a websocket config."""
    fake = FakeTTS()
    with serving(tmp_path, fake, max_input_chars=100) as (app, c):
        for name in ("instructions", "instruct"):
            err = assert_error(c.post("/v1/audio/speech", json={**BODY, name: "x" * 101}), 400, name, "input_too_long")
            assert "101" in err["message"]
        assert c.post("/v1/audio/speech", json={**BODY, "instructions": "x" * 100}).status_code == 200
        with c.websocket_connect(WS) as ws:
            ws.send_json({**CONFIG, "instructions": "x" * 101})
            got = ws_events(ws)
        assert got[0][1]["error"]["code"] == "input_too_long" and got[0][1]["error"]["status"] == 400
        assert [h.text for h in fake.handles] == ["Warm up.", "Hello there."]


# ------------------------------------------------------------------------------------------------ reference audio

def test_bare_base64_mp3_is_not_taken_for_a_file_path(tmp_path):
    """Bare base64 of an MP3 (frame sync 0xFFF) starts with "//": it was read as an absolute path (400
    file_not_allowed, or a file lookup with --ref-audio-dir) instead of being decoded."""
    mp3 = audio_bytes(np.zeros(8000), 16000, fmt="MP3", subtype="MPEG_LAYER_III")
    b64 = base64.b64encode(mp3).decode()
    assert b64.startswith("//")
    for ref_dir in (None, str(tmp_path)):
        assert ref_audio_bytes(b64, ref_dir=ref_dir, cap=1 << 20) == mp3
    (tmp_path / "ref.wav").write_bytes(b"RIFF")
    assert ref_audio_bytes(str(tmp_path / "ref.wav"), ref_dir=str(tmp_path), cap=1 << 20) == b"RIFF"  # paths still


@pytest.mark.parametrize("peak", [1e30, 32767.0, float("inf"), float("nan")])
def test_reference_audio_far_out_of_range_is_refused(tmp_path, peak):
    """A float WAV with samples of 1e30 (finite: the runtime's NaN / Inf check passes it) overflowed the prompt's mel
    into inf: the stored voice was NaN and every request with it answered silence. Refused from the samples, for
    uploads and inline references alike."""
    wav = audio_bytes(np.full(16000, peak), subtype="FLOAT")
    with pytest.raises(Exception) as e:
        decode_upload(wav, max_seconds=30, max_sample_rate=96000, max_channels=2)
    assert e.value.status == 400 and e.value.code == "invalid_audio"
    fake = FakeTTS()
    fake.make_speaker = lambda *a: pytest.fail("the frontend ran on out-of-range audio")
    with serving(tmp_path, fake) as (app, c):
        assert_error(c.post("/v1/voices", files={"audio": ("x.wav", wav)}, data={"name": "loud"}), 400, "audio",
                     "invalid_audio")
        r = c.post("/v1/audio/speech", json={**BODY, "ref_audio": base64.b64encode(wav).decode()})
        assert_error(r, 400, "ref_audio", "invalid_audio")
    # integer-scaled float exports (|x| up to 32768) are refused as the runtime refuses them (features 32768x too
    # loud); a little headroom past full scale is audio
    with pytest.raises(Exception, match="divide by 32768"):
        decode_upload(audio_bytes(np.full(16000, 32767.0), subtype="FLOAT"), max_seconds=30, max_sample_rate=96000,
                      max_channels=2)
    samples, _ = decode_upload(audio_bytes(np.full(16000, 1.5), subtype="FLOAT"), max_seconds=30,
                               max_sample_rate=96000, max_channels=2)
    assert np.allclose(samples, 1.5)


# ------------------------------------------------------------------------------------------------ websocket

@pytest.mark.parametrize("after_config", [False, True])
def test_binary_websocket_frame_is_a_400_event(tmp_path, caplog, after_config):
    """A binary frame (before or after the config) was answered with a 500 internal_error event, close 1011, and a
    logged traceback (KeyError 'text'): it is a 400 invalid_type event and close 1008."""
    with serving(tmp_path) as (app, c):
        with c.websocket_connect(WS) as ws:
            if after_config:
                ws.send_json(CONFIG)
            ws.send_bytes(b'{"type": "input.done"}')
            got = ws_events(ws)
        err = got[-2][1]["error"]
        assert err["status"] == 400 and err["code"] == "invalid_type" and got[-1] == ("close", 1008)
        assert "internal error" not in caplog.text
        assert app.state.server.ws_sessions == 0


def test_websocket_messages_are_not_queued_without_bound(tmp_path, monkeypatch):
    """While the session waits to send audio to a client that does not read, the client's further messages were
    read and queued without bound (400k tiny messages: +100 MB); the server now reads at most WS_INBOX_MAX ahead."""
    from starlette.websockets import WebSocket

    monkeypatch.setattr(routes_ws, "WS_INBOX_MAX", 4)
    received = []
    held = {}
    real_receive, real_send_bytes = WebSocket.receive, WebSocket.send_bytes

    async def receive(self):
        msg = await real_receive(self)
        received.append(msg)
        return msg

    async def send_bytes(self, data):  # the client does not read: the first audio send waits
        if "gate" not in held:
            held["gate"] = asyncio.Event()
            await held["gate"].wait()
        await real_send_bytes(self, data)

    monkeypatch.setattr(WebSocket, "receive", receive)
    monkeypatch.setattr(WebSocket, "send_bytes", send_bytes)
    with serving(tmp_path) as (app, c):
        with c.websocket_connect(WS) as ws:
            ws.send_json(CONFIG)
            ws.send_json({"type": "input.text", "text": "Hello there. "})
            assert ws_events_until(ws, "audio.start")
            deadline = time.monotonic() + 5
            while "gate" not in held:
                assert time.monotonic() < deadline
                time.sleep(0.005)
            n0 = len(received)
            try:
                for _ in range(50):
                    ws.send_json({"type": "input.flush"})
                time.sleep(0.2)
                assert len(received) - n0 <= 4 + 2  # the inbox, the reader's message in hand, the session loop's
            finally:
                app_loop_set(held["gate"])
            ws.send_json({"type": "input.done"})
            got = ws_events(ws)
        assert got[-2][0] == "session.done" and got[-1] == ("close", 1000)
        assert len(received) - n0 >= 51


def ws_events_until(ws, kind):
    while True:
        msg = ws.receive()
        if msg.get("text") is not None and json.loads(msg["text"])["type"] == kind:
            return True


def app_loop_set(event: asyncio.Event):
    """Set an asyncio.Event of the app's event loop (the TestClient runs it in another thread)."""
    event._loop.call_soon_threadsafe(event.set)


# ------------------------------------------------------------------------------------------------ streamed responses

def test_stalled_stream_client_is_dropped_and_its_slot_freed():
    """A streamed response whose client stopped reading held its admission slot and runtime request for ever (8 such
    clients: every other request 503 after the queue timeout); a send that does not complete within send_timeout_s
    ends the response and finishes the job."""
    finished = []

    async def body():
        for _ in range(1000):
            yield b"\0" * 960

    async def run():
        sent = []

        async def client(message):
            sent.append(message)
            if len(sent) > 3:
                await asyncio.Event().wait()  # the client's window is full, for ever

        async def send(message):  # what the server's guard makes of every send
            await bounded_send(client(message), 0.1)

        async def receive():
            await asyncio.Event().wait()

        resp = audio_stream_response(body(), finished.append, media_type="audio/pcm")
        scope = {"type": "http", "asgi": {"spec_version": "2.3"}, "method": "POST", "path": "/v1/audio/speech"}
        with pytest.raises(ClientStalled):
            await asyncio.wait_for(resp(scope, receive, send), 5)
        return sent

    t0 = time.monotonic()
    sent = asyncio.run(run())
    assert finished == ["cancelled"] and len(sent) == 4 and time.monotonic() - t0 < 2


@contextlib.contextmanager
def stalling_app(tmp_path):
    """An app over a fake TTS with a short send timeout, driven through raw ASGI calls by a client that stops
    reading: (app, its server state, a TestClient for its loop and /metrics, the fake TTS)."""
    fake = FakeTTS(chunk_samples=480)
    fake.gate.set()
    app = create_app(fake, ServerSettings(voices_dir=str(tmp_path / "v"), allowed_hosts=["testserver"],
                                          send_timeout_s=0.2))
    with TestClient(app) as c:
        wait_ready(c, 5)
        yield app, app.state.server, c, fake


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_stalled_client_through_the_server(tmp_path, stream, caplog):
    """The same through the app: the slot comes back once the client has not read for send_timeout_s. A whole
    (non-streamed) response's client that stops reading no longer holds its connection and task for ever either
    (every send of every response is bounded, by the app's guard)."""
    with stalling_app(tmp_path) as (app, state, c, fake):

        async def drive():
            sent = []

            async def send(message):
                sent.append(message)
                if message["type"] == "http.response.body" and message.get("body"):
                    await asyncio.Event().wait()  # reads the headers, then nothing

            body = json.dumps({**BODY, "stream": stream, "response_format": "pcm"}).encode()
            messages = [{"type": "http.request", "body": body, "more_body": False}]

            async def receive():
                if messages:
                    return messages.pop()
                await asyncio.Event().wait()

            scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                     "method": "POST", "scheme": "http", "path": "/v1/audio/speech", "raw_path": b"/v1/audio/speech",
                     "query_string": b"", "root_path": "", "server": ("testserver", 80), "client": ("t", 1),
                     "headers": [(b"host", b"testserver"), (b"content-type", b"application/json"),
                                 (b"content-length", str(len(body)).encode())]}
            await asyncio.wait_for(app(scope, receive, send), 5)
            return sent

        t0 = time.monotonic()
        sent = c.portal.call(drive)
        assert sent[0]["status"] == 200 and time.monotonic() - t0 < 3
        assert state.admission.in_flight == 0 and not state.jobs
        if stream:
            assert fake.handles[-1].cancelled.is_set()
        assert any("response dropped: the client took nothing" in r.getMessage() for r in caplog.records)


def test_stalled_websocket_client_is_dropped_and_its_session_freed(tmp_path):
    """A websocket client that stops reading mid-sentence kept its session (one of --max-ws-sessions: 64 such clients
    would refuse every new session) for ever: the idle timeout does not apply while a sentence is in synthesis. A
    send that does not complete within send_timeout_s ends the session and cancels its sentences."""
    with stalling_app(tmp_path) as (app, state, c, fake):

        async def drive():
            sent = []
            messages = [{"type": "websocket.receive", "text": json.dumps({"type": "input.done"})},
                        {"type": "websocket.receive", "text": json.dumps({"type": "input.text",
                                                                          "text": "A long answer. "})},
                        {"type": "websocket.receive", "text": json.dumps(CONFIG)},
                        {"type": "websocket.connect"}]

            async def send(message):
                sent.append(message)
                if message.get("bytes"):
                    await asyncio.Event().wait()  # the first audio frame is never taken

            async def receive():
                if messages:
                    return messages.pop()
                await asyncio.Event().wait()

            scope = {"type": "websocket", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                     "scheme": "ws", "path": WS, "raw_path": WS.encode(), "query_string": b"", "root_path": "",
                     "server": ("testserver", 80), "client": ("t", 1), "subprotocols": [],
                     "headers": [(b"host", b"testserver")]}
            t0 = time.monotonic()
            await asyncio.wait_for(app(scope, receive, send), 5)
            return sent, time.monotonic() - t0

        sent, took = c.portal.call(drive)
        assert sent[0]["type"] == "websocket.accept" and any(m.get("bytes") for m in sent)
        assert took < 3 and state.ws_sessions == 0
        assert state.admission.in_flight == 0 and not state.jobs
        assert 'cosytrt_ws_session_events_total{event="stalled"} 1.0' in c.get("/metrics").text


def test_server_settings_port_range():
    """A library caller's port 70000 raised OverflowError from bind() once the model had loaded."""
    from cosytrt.engines.errors import InputError

    with pytest.raises(InputError, match="port"):
        ServerSettings(port=70000)
    assert ServerSettings(port=0).port == 0 and ServerSettings(port=65535).port == 65535
