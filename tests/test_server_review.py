"""Defects found by a second audit of the server (session 32), each with the request that showed it: a long input's
segments all put in the runtime at once under one admission ticket (and a batch's items), text normalisation and large
websocket messages on the event loop, connections without a request head held for ever, one metrics series per
invented HTTP method, the JSON depth bound bypassed by a UTF-16 body, websocket sentences neither split nor normalised
(a 413 where HTTP said 200), an inline reference decoded once per sentence and accepted at config even when
unreadable, and a list as split_granularity answered with an internal error."""
import asyncio
import base64
import io
import json
import re

import numpy as np
import pytest
import soundfile as sf

pytest.importorskip("fastapi")
pytest.importorskip("python_multipart")
from server_helpers import FakeTTS, fake_client, live_server, serving, wait_ready, ws_events  # noqa: E402

from cosytrt.engines.errors import RequestTooLongError  # noqa: E402

BODY = {"model": "cosyvoice3", "input": "Hello there.", "voice": "default"}
WS = "/v1/audio/speech/stream"
CONFIG = {"type": "session.config", "model": "x", "voice": "default", "response_format": "pcm", "stream_audio": True}


def on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False


# 1 ------------------------------------------------------------------------------------------------------------------
def test_text_normalisation_runs_off_the_event_loop(tmp_path, monkeypatch):
    """segment_text (wetext normalisation: up to ~2.3 s of CPU for a 4096-char input such as "1." * 2048) runs on
    the event loop in /v1/audio/speech and once per item in /v1/audio/speech/batch: one 33 KB batch of 8 such items
    kept /health from answering for 11 s."""
    from cosytrt.runtime.serving import jobs

    calls = []

    def spy(text):
        calls.append(on_event_loop())
        return text

    monkeypatch.setattr(jobs, "normalize", spy)
    with serving(tmp_path) as (app, c):
        assert c.post("/v1/audio/speech", json={**BODY, "input": "It costs $5."}).status_code == 200
        r = c.post("/v1/audio/speech/batch", json={"model": "x", "voice": "default", "items": [{"input": "Room 5."}]})
        assert r.status_code == 200 and r.json()["succeeded"] == 1
    assert len(calls) == 2
    assert not any(calls), "normalisation ran on the event loop (blocks every other request)"


# 2 ------------------------------------------------------------------------------------------------------------------
def test_metrics_method_label_is_bounded(tmp_path):
    """Any token is a valid HTTP method to uvicorn/h11; every distinct one a client sends became a new
    cosytrt_http_requests_total series (unbounded memory and /metrics size)."""
    with serving(tmp_path) as (app, c):
        for i in range(200):
            assert c.request(f"X{i}", "/health").status_code == 405
        text = c.get("/metrics").text
    methods = set(re.findall(r'cosytrt_http_requests_total\{method="([^"]*)"', text))
    assert len(methods) <= 10, f"{len(methods)} method label values"


# 3 ------------------------------------------------------------------------------------------------------------------
class ShortOnlyTTS(FakeTTS):
    """Like the real model: a text past its fixed buffers is RequestTooLongError (the tiny model: ~100 chars)."""

    def submit(self, text, **kw):
        if len(text) > 40:
            raise RequestTooLongError(f"request needs more mel frames than the buffers hold ({len(text)} chars)")
        return super().submit(text, **kw)


def test_websocket_sentence_is_segmented_like_http(tmp_path):
    """/v1/audio/speech splits a long sentence into segments that fit the model (segment_text); the websocket
    session submits each sentence whole, so a sentence HTTP speaks fine is a 413 error event that ends the session
    (verified with the real tiny model: a 98-char sentence, 200 over HTTP, 413 + close 1008 over WS). The sentence
    is not normalised either ("$5" reaches the model as is)."""
    sentence = ("The first part opens the story, the second part follows it closely, "
                "and then the third part ends it.")
    fake = ShortOnlyTTS()
    with serving(tmp_path, fake, max_segment_units=8) as (app, c):
        assert c.post("/v1/audio/speech", json={**BODY, "input": sentence}).status_code == 200
        with c.websocket_connect(WS) as ws:
            ws.send_json(CONFIG)
            ws.send_json({"type": "input.text", "text": sentence + " "})
            ws.send_json({"type": "input.done"})
            got = ws_events(ws)
    assert [k for k, _ in got if k == "error"] == [], got[-2]
    assert got[-2][0] == "session.done" and got[-1] == ("close", 1000)


# 4 ------------------------------------------------------------------------------------------------------------------
def _wav(n=16000, sr=16000) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, (np.sin(np.arange(n) / 9.0) * 0.3).astype(np.float32), sr, format="WAV")
    return buf.getvalue()


def test_websocket_inline_reference_is_decoded_once_per_session(tmp_path):
    """A session config with an inline `ref_audio` (up to ~14 MB of base64) is re-read, re-decoded and re-run
    through the speaker frontend for EVERY sentence: a session of N one-word sentences makes N speaker extractions
    of up to 30 s of audio. It is also not checked at config time (session.configured, then the error)."""
    fake = FakeTTS()
    extractions = []

    def make_speaker(wav, text, sr):
        extractions.append(len(wav))
        return fake.pipeline.default_speaker

    fake.make_speaker = make_speaker
    ref = "data:audio/wav;base64," + base64.b64encode(_wav()).decode()
    with serving(tmp_path, fake) as (app, c):
        with c.websocket_connect(WS) as ws:
            ws.send_json({k: v for k, v in {**CONFIG, "ref_audio": ref, "ref_text": "Ref."}.items() if k != "voice"})
            ws.send_json({"type": "input.text", "text": "One. Two. Three. Four. "})
            ws.send_json({"type": "input.done"})
            got = ws_events(ws)
    assert got[-2][0] == "session.done" and got[-2][1]["total_sentences"] == 4
    assert len(extractions) == 1, f"the reference was extracted {len(extractions)} times for one session"


def test_websocket_bad_inline_reference_is_refused_at_config(tmp_path):
    with serving(tmp_path) as (app, c):
        with c.websocket_connect(WS) as ws:
            ws.send_json({**CONFIG, "ref_audio": "not base64 !!"})
            ws.send_json({"type": "input.done"})
            first = ws_events(ws)
    assert first[0][0] == "error", f"the session was configured with an unreadable ref_audio: {first[0]}"


# 5 ------------------------------------------------------------------------------------------------------------------
def test_large_websocket_message_is_parsed_off_the_event_loop(tmp_path, monkeypatch):
    """HTTP parses bodies over 1 MiB off the event loop (routes_speech: "an inline reference: parse it off the event
    loop"); a websocket message of up to ws_max_bytes (~14 MB by default) is depth-scanned and json-parsed on it
    (~0.2 s of loop time per 14 MB message, repeatable by any client)."""
    from cosytrt.runtime.serving import request as request_mod

    calls = []
    real = request_mod.load_json

    def spy(raw, settings):
        calls.append((len(raw), on_event_loop()))
        return real(raw, settings)

    monkeypatch.setattr(request_mod, "load_json", spy)
    ref = base64.b64encode(b"\0" * (2 << 20)).decode()  # a 2.7 MB config (an inline reference)
    with serving(tmp_path) as (app, c):
        with c.websocket_connect(WS) as ws:
            ws.send_json({**CONFIG, "ref_audio": ref})
            ws.send_json({"type": "input.done"})
            ws_events(ws)
    big = [on_loop for n, on_loop in calls if n > (1 << 20)]
    assert big and not any(big), "a >1 MiB websocket message was parsed on the event loop"


# 6 ------------------------------------------------------------------------------------------------------------------
def test_websocket_config_unhashable_granularity_is_a_400(tmp_path, caplog):
    """`split_granularity` of a list or object: `granularity not in _ENDS` raises TypeError (unhashable) -> a 500
    internal_error event, close 1011 and a logged traceback."""
    with serving(tmp_path) as (app, c):
        for bad in (["sentence"], {"a": 1}):
            with c.websocket_connect(WS) as ws:
                ws.send_json({**CONFIG, "split_granularity": bad})
                got = ws_events(ws)
            err = got[0][1]["error"]
            assert err["status"] == 400 and err["param"] == "split_granularity", err
            assert got[-1] == ("close", 1008)
    assert "internal error" not in caplog.text


# 7 ------------------------------------------------------------------------------------------------------------------
def test_one_request_does_not_put_all_its_segments_in_flight(tmp_path):
    """SpeechJob.start submits EVERY segment of a long input at once under one admission ticket (lease): with the
    tiny model, one "1." * 2048 request (4 KB, within --max-input-chars) had 214 runtime requests in flight while
    admission counted 1, and a concurrent 3-word streaming request's first audio went from 0.08 s to 11.7 s (it
    queued behind all 214). A batch multiplies it by 32. --max-in-flight no longer bounds the runtime."""
    import threading
    import time

    fake = FakeTTS(free=0)  # every request holds at its first chunk until the gate opens
    app, c = fake_client(tmp_path, fake, max_segment_units=8, max_in_flight=2)
    text = " ".join(f"Here is sentence number {w}." for w in "abcdefghijklmnopqrst")  # 20 segments
    res = []
    with c:
        wait_ready(c, 5)
        t = threading.Thread(target=lambda: res.append(c.post("/v1/audio/speech", json={**BODY, "input": text})))
        t.start()
        deadline = time.monotonic() + 5
        while len(fake.handles) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.5)  # let the background submitter run
        live = [h for h in fake.handles if h.text != "Warm up." and not h.done()]
        fake.gate.set()
        t.join(10)
    assert res and res[0].status_code == 200
    assert len(live) <= 4, f"{len(live)} runtime requests in flight for one admitted request (max_in_flight=2)"


# 8 ------------------------------------------------------------------------------------------------------------------
def test_connection_without_a_complete_request_is_closed(tmp_path):
    """`serve` runs uvicorn with no request-head timeout and no connection limit (`uvicorn_config`): a TCP connection
    that sends nothing, or a partial request head, is held for ever (checked: > 20 s, keep-alive 5 s, body timeout
    2 s); enough of them exhaust the process's file descriptors and no one can connect."""
    import socket
    import time

    from cosytrt.runtime.serving.app import ServerSettings

    fake = FakeTTS()
    fake.gate.set()
    settings = ServerSettings(voices_dir=str(tmp_path / "v"), port=0, body_timeout_s=1.0, header_timeout_s=1.0)
    with live_server(fake, settings) as port:
        idle = socket.create_connection(("127.0.0.1", port))
        partial = socket.create_connection(("127.0.0.1", port))
        partial.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        time.sleep(2.5)  # > the header timeout (1 s)
        still_open = []
        for name, s in (("idle", idle), ("partial head", partial)):
            s.settimeout(0.5)
            try:
                if s.recv(100) == b"":
                    continue
            except socket.timeout:
                still_open.append(name)
            except OSError:
                continue
        assert not still_open, f"connections still held after 2.5 s: {still_open}"


# 9 ------------------------------------------------------------------------------------------------------------------
def test_json_depth_limit_holds_for_utf16_bodies(tmp_path):
    """json.loads takes UTF-16/32 bytes, but json_depth_ok scans the raw bytes as if UTF-8: a UTF-16 body with one
    U+2200 in a string (bytes 00 22: a stray '"') makes the scan think the rest is inside a string, so
    --max-json-depth (32) is not enforced (depth 956 answered 200 on Python 3.11). On Python 3.12 / 3.13 json.loads
    parses depths 1000-1500 / 1000-~9000 that `_check_text`'s recursion cannot walk: RecursionError -> 500."""
    from server_helpers import assert_error

    nested = "[" * 200 + "]" * 200
    raw = ('{"model": "x", "input": "Hi \u2200 there.", "voice": "default", "temperature": ' + nested + "}")
    with serving(tmp_path) as (app, c):
        r = c.post("/v1/audio/speech", content=raw.encode("utf-16-le"), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.status_code
    assert_error(r, 400, "body", "invalid_json")


def test_a_batch_runs_a_bounded_number_of_items_at_once(tmp_path):
    """A batch holds one admission slot; its items used to run all at once (32 runtime requests for one slot). Now
    at most --batch-parallel of them are in the runtime."""
    import threading
    import time

    fake = FakeTTS(free=0)
    app, c = fake_client(tmp_path, fake, batch_parallel=3)
    items = [{"input": f"Item number {i}."} for i in range(10)]
    res = []
    with c:
        wait_ready(c, 5)
        t = threading.Thread(target=lambda: res.append(c.post(
            "/v1/audio/speech/batch", json={"model": "x", "voice": "default", "items": items})))
        t.start()
        deadline = time.monotonic() + 5
        while len(fake.handles) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.5)
        live = [h for h in fake.handles if h.text != "Warm up." and not h.done()]
        fake.gate.set()
        t.join(10)
    assert res and res[0].status_code == 200 and res[0].json()["succeeded"] == 10
    assert len(live) == 3, f"{len(live)} items in the runtime at once (batch_parallel=3)"


def test_a_client_gone_while_queued_leaves_the_admission_queue(tmp_path):
    """A client that disconnects while its request waits for admission used to keep its queue place until the queue
    timeout (30 s by default): a flood of such clients filled --max-queue. Now it leaves at once (499)."""
    import threading
    import time

    fake = FakeTTS(free=0)  # the first request holds the one slot until the gate opens
    app, c = fake_client(tmp_path, fake, max_in_flight=1)
    with c:
        wait_ready(c, 5)
        first = []
        t = threading.Thread(target=lambda: first.append(c.post("/v1/audio/speech", json=BODY)))
        t.start()
        state = app.state.server
        deadline = time.monotonic() + 5
        while state.admission.in_flight < 1 and time.monotonic() < deadline:
            time.sleep(0.01)

        async def queued_then_gone():
            body = json.dumps(BODY).encode()
            messages = [{"type": "http.request", "body": body, "more_body": False}]
            sent = []

            async def receive():
                if messages:
                    return messages.pop()
                await asyncio.sleep(0.3)  # queued behind the first request, then the client leaves
                return {"type": "http.disconnect"}

            async def send(message):
                sent.append(message)

            scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                     "method": "POST", "scheme": "http", "path": "/v1/audio/speech", "raw_path": b"/v1/audio/speech",
                     "query_string": b"", "root_path": "", "server": ("testserver", 80), "client": ("t", 1),
                     "headers": [(b"host", b"testserver"), (b"content-type", b"application/json"),
                                 (b"content-length", str(len(body)).encode())]}
            t0 = time.monotonic()
            await asyncio.wait_for(app(scope, receive, send), 5)
            return sent, time.monotonic() - t0

        sent, took = c.portal.call(queued_then_gone)
        assert took < 2 and sent[0]["status"] == 499
        assert state.admission.waiting == 0
        fake.gate.set()
        t.join(10)
    assert first and first[0].status_code == 200


def test_the_head_timeout_spares_websockets_and_requests_in_progress(tmp_path):
    """The request-head timeout closes only connections without a request: a websocket session (upgraded) and a
    request whose response takes longer than the timeout are not cut."""
    import threading
    import time

    import httpx

    ws_sync = pytest.importorskip("websockets.sync.client")
    from cosytrt.runtime.serving.app import ServerSettings

    fake = FakeTTS(free=0)
    settings = ServerSettings(voices_dir=str(tmp_path / "v"), port=0, header_timeout_s=0.5)
    try:
        with live_server(fake, settings) as port:
            with ws_sync.connect(f"ws://127.0.0.1:{port}{WS}", open_timeout=10) as ws:
                time.sleep(1.2)  # > the head timeout, the session open
                ws.send(json.dumps(CONFIG))
                assert json.loads(ws.recv(timeout=10))["type"] == "session.configured"
            threading.Timer(1.2, fake.gate.set).start()  # the response takes longer than the head timeout
            r = httpx.post(f"http://127.0.0.1:{port}/v1/audio/speech", json=BODY, timeout=20)
            assert r.status_code == 200 and len(r.content) > 44
    finally:
        fake.gate.set()
