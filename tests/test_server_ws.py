"""WS /v1/audio/speech/stream (runtime/serving/routes_ws.py) with the fake TTS: sentences start before the text is
complete, bad sessions get an error event, and the handshake is checked (API key, Origin, admission). The peer
harness's own scripts are replayed against the tiny model in test_server_compat.py."""
import contextlib
import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("python_multipart")
from server_helpers import FakeTTS, fake_client, wait_ready  # noqa: E402
from starlette.websockets import WebSocketDisconnect  # noqa: E402

PATH = "/v1/audio/speech/stream"
CONFIG = {"type": "session.config", "model": "x", "voice": "default", "response_format": "pcm",
          "stream_audio": True, "split_granularity": "sentence"}


@contextlib.contextmanager
def serving(tmp_path, fake, **settings):
    """(app, client) of a server over `fake`, ready."""
    app, c = fake_client(tmp_path, fake, **settings)
    with c:
        wait_ready(c, 5)
        yield app, c


def say(ws, text):
    """A whole reply: its text, then input.done."""
    ws.send_json({"type": "input.text", "text": text})
    ws.send_json({"type": "input.done"})


@contextlib.contextmanager
def configured(c, config=CONFIG):
    """An open session on client `c`, its config sent and acknowledged."""
    with c.websocket_connect(PATH) as ws:
        ws.send_json(config)
        events(ws, "session.configured")
        yield ws


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
    with serving(tmp_path, fake) as (app, c):
        with c.websocket_connect(PATH) as ws:
            ws.send_json(CONFIG)
            assert events(ws, "session.configured")[-1][1]["stream_audio"] is True
            ws.send_json({"type": "input.text", "text": "Hello wor"})
            ws.send_json({"type": "input.text", "text": "ld. And then"})
            got = events(ws, "audio.done")  # the first sentence, before input.done
            assert got[0][1]["sentence_text"] == "Hello world." and got[0][1]["format"] == "pcm"
            assert [k for k, _ in got[1:-1]] == ["binary"] * 3  # each runtime chunk as it comes (stream_audio)
            assert got[-1][1]["total_bytes"] == 3 * 480 * 2
            say(ws, " more")
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
    with serving(tmp_path, FakeTTS()) as (app, c):
        with c.websocket_connect(PATH) as ws:
            ws.send_json(first)
            got = events(ws, "error")
            err = got[-1][1]
            assert err["error"]["code"] == code and err["error"]["message"] and err["error"]["status"] == 400
            assert events(ws, "never")[-1] == ("close", 1008)


def test_handshake_checks_key_and_origin(tmp_path):
    with serving(tmp_path, FakeTTS(), api_key="sekret") as (app, c):
        with pytest.raises(WebSocketDisconnect) as e:
            with c.websocket_connect(PATH):
                pass
        assert e.value.code == 1008
        with c.websocket_connect(PATH, headers={"Authorization": "Bearer sekret"}) as ws:
            ws.send_json(CONFIG)
            assert events(ws, "session.configured")
    with serving(tmp_path / "b", FakeTTS()) as (app, c):
        with pytest.raises(WebSocketDisconnect):  # a page elsewhere cannot drive a keyless localhost server
            with c.websocket_connect(PATH, headers={"Origin": "http://evil.example"}):
                pass
        with c.websocket_connect(PATH, headers={"Origin": "http://testserver:8000"}) as ws:
            ws.send_json(CONFIG)
            assert events(ws, "session.configured")


def first_sentence_error(c) -> tuple:
    """A new session's first sentence refused: (its error event's code, status)."""
    with c.websocket_connect(PATH) as ws:
        ws.send_json(CONFIG)
        say(ws, "Hi.")
        err = events(ws, "error")[-1][1]["error"]
    return err["code"], err["status"]


def test_sentence_refused_by_admission_is_an_error_event(tmp_path):
    fake = FakeTTS()
    with serving(tmp_path, fake, max_in_flight=1, max_queue=0) as (app, c):
        held = app.state.server.admission.admit("someone else")
        try:
            assert first_sentence_error(c) == ("too_many_requests", 429)
        finally:
            held.release()


def test_first_sentence_shed_is_an_overloaded_error_event_and_later_ones_are_not_shed(tmp_path):
    """Load shedding (the admission control's overload hook, set by a scheduler with shed_lag_s): a session's first
    sentence is refused with an `overloaded` (503) error event; a sentence that follows one already admitted in the
    session is not shed."""
    fake = FakeTTS()
    with serving(tmp_path, fake) as (app, c):
        admission = app.state.server.admission
        admission.overload = lambda: "the runtime is overloaded: test"
        try:
            assert first_sentence_error(c) == ("overloaded", 503)
            admission.overload = None
            with configured(c) as ws:
                ws.send_json({"type": "input.text", "text": "First one. "})
                events(ws, "audio.start")
                admission.overload = lambda: "the runtime is overloaded: test"
                ws.send_json({"type": "input.text", "text": "Second one."})
                ws.send_json({"type": "input.done"})
                got = events(ws, "session.done")
                assert not any(t == "error" for t, _ in got)
                assert sum(1 for t, _ in got if t == "audio.done") >= 1
        finally:
            admission.overload = None


def test_cancel_stops_the_sentence_and_the_session_goes_on(tmp_path):
    """Barge-in: input.cancel while a sentence streams cancels its runtime request (and the one synthesised ahead),
    drops the unfinished text, answers input.cancelled, and the session takes new text with the next index."""
    fake = FakeTTS(free=1)  # each sentence: one chunk at once, the rest held by the gate
    with serving(tmp_path, fake, ws_lookahead=1) as (app, c):
        with configured(c) as ws:
            ws.send_json({"type": "input.text", "text": "First one. Second one. And a half"})
            got = events(ws, "audio.start")
            while ("binary", 960) not in got:
                got.append(events_one(ws))
            wait_submitted(fake, 2)
            ws.send_json({"type": "input.cancel"})
            got = events(ws, "input.cancelled")
            done = [e for k, e in got if k == "audio.done"]
            assert len(done) == 1 and done[0]["sentence_index"] == 0 and done[0]["cancelled"] is True
            assert got[-1][1]["sentence_indices"] == [0, 1]  # the one being sent and the one ahead of it
            sent = [h for h in fake.handles if h.text != "Warm up."]
            assert [h.text for h in sent] == ["First one.", "Second one."]
            assert all(h.cancelled.is_set() for h in sent)
            fake.gate.set()
            say(ws, "After.")
            got = events(ws, "session.done")
            start = [e for k, e in got if k == "audio.start"]
            assert [e["sentence_index"] for e in start] == [2] and start[0]["sentence_text"] == "After."
            assert got[-1][1]["total_sentences"] == 3
        assert app.state.server.admission.in_flight == 0
        assert 'cosytrt_ws_session_events_total{event="cancels"} 1.0' in c.get("/metrics").text


def wait_submitted(fake, n, timeout=5.0):
    import time

    deadline = time.monotonic() + timeout
    while len([h for h in fake.handles if h.text != "Warm up."]) < n and time.monotonic() < deadline:
        time.sleep(0.01)


def events_one(ws):
    msg = ws.receive()
    if msg.get("bytes") is not None:
        return ("binary", len(msg["bytes"]))
    e = json.loads(msg["text"])
    return (e["type"], e)


def test_next_sentence_is_synthesised_while_the_current_one_streams(tmp_path):
    """Look-ahead: the second sentence's runtime request starts while the first is still held, yet its audio comes
    only after the first's audio.done (sentence order)."""
    fake = FakeTTS(free=1)
    with serving(tmp_path, fake, ws_lookahead=1) as (app, c):
        with configured(c) as ws:
            say(ws, "One. Two. Three.")
            events(ws, "audio.start")
            wait_submitted(fake, 2)
            sent = [h.text for h in fake.handles if h.text != "Warm up."]
            assert sent == ["One.", "Two."]  # two in flight, the first not finished (the gate holds it)
            fake.gate.set()
            got = events(ws, "session.done")
            order = [(k, e["sentence_index"]) for k, e in got if k in ("audio.start", "audio.done")]
            assert order == [("audio.done", 0), ("audio.start", 1), ("audio.done", 1), ("audio.start", 2),
                             ("audio.done", 2)]
            assert all(e["total_bytes"] == 3 * 960 for k, e in got if k == "audio.done")
        assert app.state.server.admission.in_flight == 0


def test_look_ahead_takes_only_a_free_slot(tmp_path):
    """With one admission slot the next sentence waits for the current one instead of failing (or queueing ahead of
    other clients)."""
    fake = FakeTTS()
    fake.gate.set()
    with serving(tmp_path, fake, max_in_flight=1, max_queue=0, ws_lookahead=1) as (app, c):
        with c.websocket_connect(PATH) as ws:
            ws.send_json(CONFIG)
            say(ws, "One. Two. Three.")
            got = events(ws, "session.done")
            assert [k for k, _ in got].count("audio.done") == 3 and got[-1][1]["total_sentences"] == 3
        assert app.state.server.admission.snapshot()["queue_full"] == 0


def test_session_sample_rate_and_bad_messages(tmp_path):
    fake = FakeTTS()
    fake.gate.set()
    with serving(tmp_path, fake) as (app, c):
        with c.websocket_connect(PATH) as ws:
            ws.send_json({**CONFIG, "sample_rate": 8000})
            assert events(ws, "session.configured")[-1][1]["sample_rate"] == 8000
            say(ws, "Narrowband.")
            got = events(ws, "session.done")
            start = [e for k, e in got if k == "audio.start"][0]
            done = [e for k, e in got if k == "audio.done"][0]
            assert start["sample_rate"] == 8000 and done["total_bytes"] == 2 * 3 * 480 // 3  # 24 -> 8 kHz
        with c.websocket_connect(PATH) as ws:
            ws.send_json({**CONFIG, "response_format": "ulaw"})
            configured = events(ws, "session.configured")[-1][1]
            assert configured["sample_rate"] == 8000 and configured["response_format"] == "ulaw"
            say(ws, "Telephone.")
            got = events(ws, "session.done")
            start = [e for k, e in got if k == "audio.start"][0]
            done = [e for k, e in got if k == "audio.done"][0]
            assert start["format"] == "ulaw" and done["total_bytes"] == 3 * 480 // 3  # 1 byte per 8 kHz sample
        for bad, code in ((b"{not json", "invalid_json"), (b"[" * 100 + b"]" * 100, "invalid_json")):
            with c.websocket_connect(PATH) as ws:
                ws.send_json(CONFIG)
                events(ws, "session.configured")
                ws.send_text(bad.decode())
                assert events(ws, "error")[-1][1]["error"]["code"] == code
        with c.websocket_connect(PATH) as ws:
            ws.send_json(CONFIG)
            ws.send_json({"type": "input.done"})
            ws.send_json({"type": "input.text", "text": "late"})
            got = events(ws, "never")
            assert got[-1][0] == "close"  # session.done (no sentences) or the error event, then close
        assert app.state.server.admission.in_flight == 0


def test_sessions_are_bounded_in_number_and_idle_time(tmp_path):
    """--max-ws-sessions: a session beyond it gets a 429 error event and close 1013; --ws-idle-timeout-s: a session
    with nothing to synthesise and no message for that long gets a 408 error event and is closed (before its config
    too), while one that is synthesising stays open however long the audio takes."""
    fake = FakeTTS(free=1)
    with serving(tmp_path, fake, max_ws_sessions=1, ws_idle_timeout_s=0.4) as (app, c):
        with c.websocket_connect(PATH) as first:
            first.send_json(CONFIG)
            events(first, "session.configured")
            with c.websocket_connect(PATH) as second:
                got = events(second, "never")
                assert got[0][1]["error"]["code"] == "too_many_sessions" and got[0][1]["error"]["status"] == 429
                assert got[-1] == ("close", 1013)
            first.send_json({"type": "input.text", "text": "Held by the gate. "})
            import time
            time.sleep(0.8)  # longer than the idle timeout, but a sentence is being synthesised
            fake.gate.set()
            got = events(first, "audio.done")
            assert got[-1][1]["total_bytes"] == 3 * 960
            got = events(first, "never")  # then idle: closed
            assert got[-2][1]["error"]["code"] == "session_idle" and got[-2][1]["error"]["status"] == 408
            assert got[-1] == ("close", 1008)
        with c.websocket_connect(PATH) as ws:  # the slot is free again; idle before the config
            got = events(ws, "never")
            assert got[0][1]["error"]["code"] == "session_idle"
        assert app.state.server.ws_sessions == 0 and app.state.server.admission.in_flight == 0
        text = c.get("/metrics").text
        assert "cosytrt_ws_sessions 0" in text
        for event, n in (("opened", 2), ("refused", 1), ("idle_closed", 2), ("sentences", 1)):
            assert f'cosytrt_ws_session_events_total{{event="{event}"}} {float(n)}' in text, event


def test_flush_speaks_the_unfinished_text_and_keeps_the_session(tmp_path):
    fake = FakeTTS()
    fake.gate.set()
    with serving(tmp_path, fake) as (app, c):
        with configured(c) as ws:
            ws.send_json({"type": "input.text", "text": "no sentence end here"})
            ws.send_json({"type": "input.flush"})
            got = events(ws, "audio.done")
            assert [e for k, e in got if k == "audio.start"][0]["sentence_text"] == "no sentence end here"
            ws.send_json({"type": "input.flush"})  # nothing buffered: nothing spoken
            say(ws, "Next turn.")
            got = events(ws, "session.done")
            assert [e["sentence_text"] for k, e in got if k == "audio.start"] == ["Next turn."]
            assert got[-1][1]["total_sentences"] == 2


def test_take_complete_waits_for_what_follows_a_period():
    """Text in LLM-token pieces: "3." + "14" is one number, not a sentence end; a period ends a sentence once
    whitespace follows it (or the input ends)."""
    from cosytrt.runtime.serving.routes_ws import take_complete

    assert take_complete("Pi is 3.", "sentence", False) == ([], "Pi is 3.")
    assert take_complete("Pi is 3.14. Next", "sentence", False) == (["Pi is 3.14."], " Next")
    assert take_complete("Done.", "sentence", True) == (["Done."], "")
    assert take_complete("Wow! And", "sentence", False) == (["Wow!"], " And")
    assert take_complete("一句话。下一", "sentence", False) == (["一句话。"], "下一")
    assert take_complete("first, second", "clause", False) == (["first,"], " second")
    assert take_complete("e.g.", "clause", False) == ([], "e.g.")


def test_unfinished_sentence_is_bounded(tmp_path):
    fake = FakeTTS()
    with serving(tmp_path, fake, max_input_chars=50) as (app, c):
        with configured(c) as ws:
            for _ in range(6):
                ws.send_json({"type": "input.text", "text": "word " * 2})
            err = events(ws, "error")[-1][1]
            assert err["error"]["code"] == "input_too_long" and err["error"]["status"] == 400


def test_no_look_ahead_when_switched_off(tmp_path):
    import time

    fake = FakeTTS(free=1)
    with serving(tmp_path, fake, ws_lookahead=0) as (app, c):
        with configured(c) as ws:
            say(ws, "One. Two. Three.")
            events(ws, "audio.start")
            time.sleep(0.3)
            assert [h.text for h in fake.handles if h.text != "Warm up."] == ["One."]
            fake.gate.set()
            assert events(ws, "session.done")[-1][1]["total_sentences"] == 3


def test_next_sentence_tells_the_runtime_what_the_listener_still_has(tmp_path):
    """A session's later sentence is submitted with `buffered_s`: the audio sent and not yet played (the runtime
    then lets a listener with nothing yet go first); none for the first sentence, none with the hints off."""
    for hints in (True, False):
        fake = FakeTTS(chunk_samples=24000)  # 1 s per chunk, 3 per sentence
        fake.gate.set()
        app, c = fake_client(tmp_path / str(hints), fake, ws_lookahead=0, ws_buffer_hints=hints)
        with c:
            wait_ready(c, 5)
            with configured(c) as ws:
                say(ws, "One. Two.")
                events(ws, "session.done")
        first, second = [h for h in fake.handles if h.text != "Warm up."]
        assert "buffered_s" not in first.opts and "after" not in first.opts
        if hints:
            assert 2.0 < second.opts["buffered_s"] <= 3.0  # 3 s sent, a moment of it played
            assert second.opts["after"] is first  # the runtime handle of the sentence heard before it
        else:
            assert "buffered_s" not in second.opts and "after" not in second.opts


def test_a_sentence_refused_after_look_ahead_admission_gives_its_slot_back(tmp_path):
    """A sentence synthesised ahead holds a slot taken at once; when it then fails its own checks (here: too long)
    its slot goes back at once, and the session ends with the error once the sentence before it is done."""
    import time

    fake = FakeTTS(free=1)
    app, c = fake_client(tmp_path, fake, max_input_chars=40, ws_lookahead=1)
    adm = app.state.server.admission
    with c:
        wait_ready(c, 5)
        with configured(c) as ws:
            ws.send_json({"type": "input.text", "text": "Short one. " + "x" * 45 + ". "})
            events(ws, "audio.start")
            time.sleep(0.3)  # the second sentence has been tried meanwhile
            assert adm.in_flight == 1 and adm.snapshot()["admitted"] >= 2
            fake.gate.set()
            got = events(ws, "error")
            assert got[-1][1]["error"]["code"] == "input_too_long"
            assert [e["sentence_index"] for k, e in got if k == "audio.done"] == [0]
        assert adm.in_flight == 0
