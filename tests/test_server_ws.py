"""WS /v1/audio/speech/stream (runtime/serving/routes_ws.py) with the fake TTS: sentences start before the text is
complete, bad sessions get an error event, and the handshake is checked (API key, Origin, admission). The peer
harness's own scripts are replayed against the tiny model in test_server_compat.py."""
import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("python_multipart")
from server_helpers import FakeTTS, fake_client, wait_ready  # noqa: E402
from starlette.websockets import WebSocketDisconnect  # noqa: E402

PATH = "/v1/audio/speech/stream"
CONFIG = {"type": "session.config", "model": "x", "voice": "default", "response_format": "pcm",
          "stream_audio": True, "split_granularity": "sentence"}


def events(ws, until):
    out = []
    while True:
        msg = ws.receive()
        if msg["type"] == "websocket.close":
            out.append(("close", msg.get("code")))
            return out
        if msg.get("bytes") is not None:
            out.append(("binary", len(msg["bytes"])))
            continue
        e = json.loads(msg["text"])
        out.append((e["type"], e))
        if e["type"] == until:
            return out


def test_sentences_start_before_the_text_is_complete(tmp_path):
    fake = FakeTTS()
    app, c = fake_client(tmp_path, fake)
    with c:
        wait_ready(c, 5)
        with c.websocket_connect(PATH) as ws:
            ws.send_json(CONFIG)
            assert events(ws, "session.configured")[-1][1]["stream_audio"] is True
            ws.send_json({"type": "input.text", "text": "Hello wor"})
            ws.send_json({"type": "input.text", "text": "ld. And then"})
            got = events(ws, "audio.done")  # the first sentence, before input.done
            assert got[0][1]["sentence_text"] == "Hello world." and got[0][1]["format"] == "pcm"
            assert [k for k, _ in got[1:-1]] == ["binary"] * 3  # each runtime chunk as it comes (stream_audio)
            assert got[-1][1]["total_bytes"] == 3 * 480 * 2
            ws.send_json({"type": "input.text", "text": " more"})
            ws.send_json({"type": "input.done"})
            got = events(ws, "session.done")
            assert got[0][1]["sentence_text"] == "And then more" and got[-1][1]["total_sentences"] == 2
            assert events(ws, "never")[-1][0] == "close"
        assert [h.text for h in fake.handles[1:]] == ["Hello world.", "And then more"]
        assert app.state.server.admission.in_flight == 0


@pytest.mark.parametrize("first,code", [
    ({"type": "input.text", "text": "hi"}, "invalid_value"),
    ({**CONFIG, "response_format": "wav"}, "unsupported_value"),
    ({**CONFIG, "split_granularity": "word"}, "unsupported_value"),
    ({**CONFIG, "voice": "../x"}, "invalid_value"),
    ({**CONFIG, "stream_audio": True, "speed": 2.0}, "unsupported_value"),
])
def test_bad_session_gets_an_error_event_and_close(tmp_path, first, code):
    app, c = fake_client(tmp_path, FakeTTS())
    with c:
        wait_ready(c, 5)
        with c.websocket_connect(PATH) as ws:
            ws.send_json(first)
            got = events(ws, "error")
            err = got[-1][1]
            assert err["error"]["code"] == code and err["error"]["message"] and err["error"]["status"] == 400
            assert events(ws, "never")[-1] == ("close", 1008)


def test_handshake_checks_key_and_origin(tmp_path):
    app, c = fake_client(tmp_path, FakeTTS(), api_key="sekret")
    with c:
        wait_ready(c, 5)
        with pytest.raises(WebSocketDisconnect) as e:
            with c.websocket_connect(PATH):
                pass
        assert e.value.code == 1008
        with c.websocket_connect(PATH, headers={"Authorization": "Bearer sekret"}) as ws:
            ws.send_json(CONFIG)
            assert events(ws, "session.configured")
    app, c = fake_client(tmp_path / "b", FakeTTS())
    with c:
        wait_ready(c, 5)
        with pytest.raises(WebSocketDisconnect):  # a page elsewhere cannot drive a keyless localhost server
            with c.websocket_connect(PATH, headers={"Origin": "http://evil.example"}):
                pass
        with c.websocket_connect(PATH, headers={"Origin": "http://testserver:8000"}) as ws:
            ws.send_json(CONFIG)
            assert events(ws, "session.configured")


def test_sentence_refused_by_admission_is_an_error_event(tmp_path):
    fake = FakeTTS()
    app, c = fake_client(tmp_path, fake, max_in_flight=1, max_queue=0)
    with c:
        wait_ready(c, 5)
        held = app.state.server.admission.admit("someone else")
        try:
            with c.websocket_connect(PATH) as ws:
                ws.send_json(CONFIG)
                ws.send_json({"type": "input.text", "text": "Hi."})
                ws.send_json({"type": "input.done"})
                err = events(ws, "error")[-1][1]
                assert err["error"]["code"] == "too_many_requests" and err["error"]["status"] == 429
        finally:
            held.release()
