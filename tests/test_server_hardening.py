"""Issue #19's ten defects, each with the request that showed it (in process: Starlette TestClient, or the ASGI app
driven directly); the tiny model where audio matters, a fake TTS elsewhere."""
import asyncio
import io
import json
import logging
import os
import struct
import threading
import time

import numpy as np
import pytest
import soundfile as sf

pytest.importorskip("fastapi")
pytest.importorskip("python_multipart")
from fastapi.testclient import TestClient  # noqa: E402
from server_helpers import (SAMPLES_PER_TOKEN, SR, FakeTTS, assert_error, direct_pcm, fake_client,  # noqa: E402
                         parse_metrics, read_wav, wait_ready)

from cosytrt.runtime.serving.app import ServerSettings, create_app, segment_text  # noqa: E402
from cosytrt.runtime.serving.encoding import decode_upload  # noqa: E402

BODY = {"model": "cosyvoice3", "input": "Hello there.", "voice": "default"}


def wav_bytes(samples, sr, channels=1, fmt="WAV", subtype="PCM_16"):
    buf = io.BytesIO()
    data = np.zeros((len(samples), channels), np.float32) + np.asarray(samples, np.float32)[:, None]
    sf.write(buf, data, sr, format=fmt, subtype=subtype)
    return buf.getvalue()


def raw_wav(sr: int, n_bytes: int, channels: int = 1) -> bytes:
    """A hand-made WAV header declaring `sr` Hz, followed by n_bytes of 16-bit silence."""
    return (b"RIFF" + struct.pack("<I", 36 + n_bytes) + b"WAVE" + b"fmt " +
            struct.pack("<IHHIIHH", 16, 1, channels, sr, 2 * sr * channels, 2 * channels, 16) + b"data" +
            struct.pack("<I", n_bytes) + b"\0" * n_bytes)


@pytest.fixture(scope="module")
def tts(tiny_tts):
    return tiny_tts


@pytest.fixture(scope="module")
def client(tts, tmp_path_factory):
    app = create_app(tts, ServerSettings(voices_dir=str(tmp_path_factory.mktemp("voices")), max_input_chars=2000,
                                         max_upload_mb=1.0, allowed_hosts=["testserver"], max_voices=2,
                                         max_transcript_chars=50))
    with TestClient(app) as c:
        wait_ready(c)
        yield c


# ------------------------------------------------------------------------------------------------ 1: uploads

def test_1_absurd_sample_rate_refused_from_the_header(client, monkeypatch):
    """A 20 KB WAV declaring 1 Hz (hours of audio once resampled) is refused before any sample is decoded."""
    def no_decode(*a, **k):
        raise AssertionError("samples were decoded")

    monkeypatch.setattr(sf.SoundFile, "read", no_decode)
    r = client.post("/v1/voices", files={"audio": ("x.wav", raw_wav(1, 20_000))})
    err = assert_error(r, 400, "audio", "invalid_audio")
    assert "1 Hz" in err["message"]
    r = client.post("/v1/audio/speech", json={**BODY, "ref_audio": "data:audio/wav;base64," +
                                              __import__("base64").b64encode(raw_wav(1, 20_000)).decode()})
    assert_error(r, 400, "ref_audio", "invalid_audio")


def test_1_long_multichannel_flac_refused_from_the_header(monkeypatch):
    """237 KB of 8-channel FLAC silence is minutes of audio: refused from the header (duration, channels)."""
    flac = wav_bytes(np.zeros(8000 * 120), 8000, channels=8, fmt="FLAC")
    assert len(flac) < 400_000
    monkeypatch.setattr(sf.SoundFile, "read", lambda *a, **k: (_ for _ in ()).throw(AssertionError("decoded")))
    with pytest.raises(Exception) as e:
        decode_upload(flac, max_seconds=30, max_sample_rate=192000, max_channels=8)
    assert e.value.status == 400 and e.value.code == "audio_too_long"
    with pytest.raises(Exception) as e:
        decode_upload(wav_bytes(np.zeros(800), 8000, channels=9), max_seconds=30, max_sample_rate=192000,
                      max_channels=8)
    assert e.value.status == 400 and "channels" in e.value.message


def test_1_decode_reads_at_most_the_limit():
    samples, sr = decode_upload(wav_bytes(np.full(16000, 0.5), 16000), max_seconds=1.0, max_sample_rate=48000,
                                max_channels=2)
    assert sr == 16000 and samples.shape == (16000,) and np.allclose(samples, 0.5, atol=1e-4)


# ------------------------------------------------------------------------------------------------ 2: odd bodies

@pytest.mark.parametrize("raw,param", [
    (b'{"model": "x", "input": "hi \\ud800", "voice": "default"}', "input"),
    (b'{"model": "x", "input": "hi", "seed": ' + b"9" * 5000 + b"}", "body"),
    (b'{"model": "x", "input": "hi", "x": ' + b"[" * 20000 + b"]" * 20000 + b"}", "body"),
    (b"[" * 20000 + b"]" * 20000, "body"),
    (b"\xff\xfe not utf-8", "body"),
])
def test_2_odd_bodies_are_400_with_the_openai_shape(client, raw, param):
    r = client.post("/v1/audio/speech", content=raw, headers={"content-type": "application/json"})
    err = assert_error(r, 400, param)
    assert err["type"] == "invalid_request_error" and "Traceback" not in err["message"]


# ------------------------------------------------------------------------------------------------ 3: cross-site

def test_3_simple_cross_site_content_types_are_refused(client):
    raw = json.dumps(BODY)
    for ctype in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"content-type": ctype} if ctype else {}
        assert_error(client.post("/v1/audio/speech", content=raw, headers=headers), 415,
                     code="unsupported_media_type")
    assert_error(client.post("/v1/voices", content=b"a=b", headers={"content-type": "text/plain"}), 415)
    assert client.post("/v1/audio/speech", content=raw,
                       headers={"content-type": "application/json; charset=utf-8"}).status_code == 200


def test_3_host_header_checked_on_loopback(tmp_path):
    fake = FakeTTS()
    app = create_app(fake, ServerSettings(voices_dir=str(tmp_path / "v")))  # default: loopback names only
    with TestClient(app, base_url="http://127.0.0.1:8000") as c:
        wait_ready(c, 5)
        assert c.post("/v1/audio/speech", json=BODY).status_code == 200
        for host in ("evil.example", "attacker.com:8000", "127.0.0.1.nip.io"):
            assert_error(c.post("/v1/audio/speech", json=BODY, headers={"host": host}), 421, code="invalid_host")
        assert c.get("/health", headers={"host": "localhost:8000"}).status_code == 200
        assert c.get("/health", headers={"host": "[::1]:8000"}).status_code == 200
    app = create_app(fake, ServerSettings(voices_dir=str(tmp_path / "v"), allowed_hosts="*"))
    with TestClient(app, base_url="http://anything.example") as c:
        wait_ready(c, 5)
        assert c.get("/health").status_code == 200
    assert ServerSettings(host="0.0.0.0").host_names() is None  # public bind: the operator sets --allowed-hosts


# ------------------------------------------------------------------------------------------------ 4: voices

def test_4_voice_ids_full_match_caps_and_admission(client, tts):
    prompt = wav_bytes(np.sin(np.arange(16000 * 2) / 9.0) * 0.3, 16000)
    r = client.post("/v1/voices", files={"audio": ("v.wav", prompt)}, data={"name": "nl\n"})
    assert_error(r, 400, "name")
    root = client.app.state.server.voices.root
    assert not [n for n in os.listdir(root) if "\n" in n]
    assert_error(client.post("/v1/audio/speech", json={**BODY, "voice": "default\n"}), 400, "voice")
    assert_error(client.delete("/v1/voices/nl%0A"), 400, "voice_id")
    assert_error(client.post("/v1/voices", files={"audio": ("v.wav", prompt)}, data={"text": "x" * 51}), 400, "text",
                 "transcript_too_long")
    assert_error(client.post("/v1/audio/speech", json={**BODY, "ref_audio": "AAAA", "ref_text": "y" * 51}), 400,
                 "ref_text")
    for name in ("one", "two"):
        assert client.post("/v1/voices", files={"audio": ("v.wav", prompt)}, data={"name": name}).status_code == 201
    assert_error(client.post("/v1/voices", files={"audio": ("v.wav", prompt)}, data={"name": "three"}), 409, "name",
                 "voice_limit")
    for name in ("one", "two"):
        assert client.delete(f"/v1/voices/{name}").status_code == 200


def test_4_uploads_go_through_admission(tmp_path):
    fake = FakeTTS(free=0)
    fake.make_speaker = lambda wav, text, sr: pytest.fail("no slot was free: the upload must not run")
    app, c = fake_client(tmp_path, fake, max_in_flight=1, max_queue=0)
    prompt = wav_bytes(np.zeros(16000), 16000)
    with c:
        wait_ready(c, 5)
        t = threading.Thread(target=lambda: c.post("/v1/audio/speech", json=BODY))
        t.start()
        while app.state.server.admission.in_flight < 1:
            time.sleep(0.005)
        assert_error(c.post("/v1/voices", files={"audio": ("v.wav", prompt)}, data={"name": "held"}), 429,
                     code="too_many_requests")
        fake.gate.set()
        t.join(5)


# ------------------------------------------------------------------------------------------------ 5: disconnects

async def _upload(app, chunks, timeout=10):
    """POST /v1/voices with the body given piecewise; None in `chunks` = the client disconnects there."""
    sent, queue = [], list(chunks)

    async def receive():
        if not queue:
            await asyncio.sleep(3600)
        part = queue.pop(0)
        if part is None:
            return {"type": "http.disconnect"}
        if part == "stall":
            await asyncio.sleep(3600)
        return {"type": "http.request", "body": part, "more_body": bool(queue)}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/voices", "raw_path": b"/v1/voices", "query_string": b"", "root_path": "",
             "client": ("127.0.0.1", 5000), "server": ("testserver", 80),
             "headers": [(b"host", b"testserver"), (b"content-type", b"multipart/form-data; boundary=zz")]}
    await asyncio.wait_for(app(scope, receive, send), timeout)
    return next(m["status"] for m in sent if m["type"] == "http.response.start")


def test_5_disconnect_during_upload_is_not_a_500(tmp_path, caplog):
    app, c = fake_client(tmp_path, FakeTTS())
    with c, caplog.at_level(logging.ERROR):
        wait_ready(c, 5)
        status = c.portal.call(_upload, app, [b"--zz\r\n", None])
        assert status == 499
        m = parse_metrics(c.get("/metrics").text)
        assert not [k for k in m if 'status="500"' in k]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_5_stalled_body_times_out(tmp_path):
    app, c = fake_client(tmp_path, FakeTTS(), body_timeout_s=0.2)
    with c:
        wait_ready(c, 5)
        assert c.portal.call(_upload, app, [b"--zz\r\n", "stall"]) == 408


# ------------------------------------------------------------------------------------------------ 6: key, docs

def test_6_docs_hidden_with_a_key_and_key_from_file_or_env(tmp_path, monkeypatch):
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    _, c = fake_client(tmp_path, FakeTTS(), api_key_file=str(key_file))
    with c:
        wait_ready(c, 5)
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert c.get(path).status_code == 404
        assert c.post("/v1/audio/speech", json=BODY, headers={"Authorization": "Bearer from-file"}).status_code \
            == 200
        assert_error(c.post("/v1/audio/speech", json=BODY), 401, code="invalid_api_key")
    _, c = fake_client(tmp_path, FakeTTS())
    with c:
        assert c.get("/openapi.json").status_code == 200  # keyless local default: still documented
    monkeypatch.setenv("COSYTRT_API_KEY", "from-env")
    assert ServerSettings().resolve_api_key() == "from-env"
    with pytest.raises(Exception, match="cannot read the API key file"):
        ServerSettings(api_key_file=str(tmp_path / "missing")).resolve_api_key()


# ------------------------------------------------------------------------------------------------ 7: history

def test_7_tts_history_is_a_bounded_window(tts):
    from cosytrt.runtime.tts import TTS

    t = TTS(tts.pipeline, history_window=2)
    try:
        for i in range(3):
            t.synthesize("Hi.", seed=i, force_tokens=2, speaker=tts.pipeline.default_speaker)
        assert len(t._history) == 2 and t.requests_finished == 3
        assert t.metrics()["requests"] == 2
    finally:
        t.close()


# ------------------------------------------------------------------------------------------------ 8: dead worker

def test_8_dead_scheduler_worker_makes_health_fail(tmp_path, tts):
    from cosytrt.runtime.tts import TTS

    t = TTS(tts.pipeline)
    app = create_app(t, ServerSettings(voices_dir=str(tmp_path / "v"), allowed_hosts=["testserver"],
                                       warmup_tokens=2), owns_tts=True)
    with TestClient(app) as c:
        wait_ready(c)
        assert c.get("/health").json() == {"status": "ready"}

        def boom():
            raise RuntimeError("worker bug")

        from cosytrt.runtime.scheduling.scheduler import start_workers

        (th,) = start_workers([("boom", boom)], t.scheduler.requests)  # a worker loop that dies of a bug
        th.join(5)
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "failed" and "worker bug" in r.json()["error"]
        assert parse_metrics(c.get("/metrics").text)["cosytrt_ready"] == 0
        assert_error(c.post("/v1/audio/speech", json=BODY), 503, code="runtime_failed")


def test_8_fake_runtime_health(tmp_path):
    fake = FakeTTS()
    fake.health = lambda: (False, "dit worker died")
    _, c = fake_client(tmp_path, fake)
    with c:
        time.sleep(0.2)
        r = c.get("/health")
        assert r.status_code == 503


# ------------------------------------------------------------------------------------------------ 9: zero tokens

def test_9_zero_speech_tokens_is_empty_audio_not_4xx(client, tts, monkeypatch):
    from cosytrt.runtime.scheduling import scheduler as scheduler_mod

    orig = scheduler_mod.token_policy

    def stop_at_once(r, *args, **kw):
        orig(r, *args, **kw)
        r.policy.max_len = r.policy.min_len = 0  # the LM's first step is its last: no speech token

    monkeypatch.setattr(scheduler_mod, "token_policy", stop_at_once)
    r = client.post("/v1/audio/speech", json={**BODY, "seed": 1})
    assert r.status_code == 200, r.text
    samples, sr, _ = read_wav(r.content)
    assert samples.size == 0 and r.headers["x-speech-tokens"] == "0"
    for fmt in ("mp3", "opus", "flac"):
        assert client.post("/v1/audio/speech", json={**BODY, "response_format": fmt}).status_code == 200
    with client.stream("POST", "/v1/audio/speech", json={**BODY, "stream": True, "response_format": "pcm"}) as s:
        assert s.status_code == 200 and b"".join(s.iter_bytes()) == b""


# ------------------------------------------------------------------------------------------------ 10: long input

def test_10_token_cap_above_the_buffers_is_clamped(client):
    r = client.post("/v1/audio/speech", json={**BODY, "seed": 2, "max_tokens": 100_000, "response_format": "pcm"})
    assert r.status_code == 200, r.text
    assert 0 < int(r.headers["x-speech-tokens"]) <= 1500
    r = client.post("/v1/audio/speech", json={**BODY, "seed": 2, "max_new_tokens": 100_000})
    assert r.status_code == 200, r.text


LONG = "The first sentence opens the story. The second one follows it closely. Then the third one ends it."


def test_10_long_input_is_split_and_streamed_as_one_response(client, tts):
    settings = client.app.state.server.settings
    speaker = tts.pipeline.default_speaker
    segments = segment_text(LONG, settings, {}, tts, speaker)
    assert len(segments) >= 2 and " ".join(segments) == LONG
    with pytest.raises(Exception, match="noise buffers"):  # what used to happen: the whole text is too long
        tts.synthesize(LONG, seed=4, speaker=speaker)
    body = {**BODY, "input": LONG, "seed": 4, "response_format": "pcm", "max_tokens": 12}  # 12 per segment: fast
    whole = client.post("/v1/audio/speech", json=body)
    assert whole.status_code == 200, whole.text
    with client.stream("POST", "/v1/audio/speech", json={**body, "stream": True}) as s:
        assert s.status_code == 200
        streamed = b"".join(s.iter_bytes())
    def reference(stream):  # each segment alone, concatenated in order
        return np.concatenate([np.frombuffer(direct_pcm(tts, seg, stream=stream, seed=4, max_tokens=12), "<i2").astype(np.int32)
                               for seg in segments])

    for got, stream in ((whole.content, False), (streamed, True)):
        got, expected = np.frombuffer(got, "<i2").astype(np.int32), reference(stream)
        assert got.size == expected.size  # the segments, in order, as one response
        assert np.abs(got - expected).max() <= 8  # batched rows may differ by a few LSB on CPU
    assert int(whole.headers["x-speech-tokens"]) * SAMPLES_PER_TOKEN == expected.size


def test_10_numbers_dates_symbols_normalized():
    pytest.importorskip("wetext")
    s = ServerSettings()
    out = " ".join(segment_text("It costs $5 on 2024-03-05, 50% off.", s, {}))
    assert "five dollars" in out and "twenty twenty four" in out and "percent" in out
    assert segment_text("价格是100元。", s, {}) == ["价格是一百元。"]
    assert segment_text("Plain words stay as they are.", s, {}) == ["Plain words stay as they are."]
    assert segment_text("Room 5.", ServerSettings(normalize_text=False), {}) == ["Room 5."]


def test_speed_is_applied_offline_as_upstream(client):
    base = client.post("/v1/audio/speech", json={**BODY, "seed": 6, "force_tokens": 20, "response_format": "pcm"})
    fast = client.post("/v1/audio/speech", json={**BODY, "seed": 6, "force_tokens": 20, "response_format": "pcm",
                                                 "speed": 2.0})
    slow = client.post("/v1/audio/speech", json={**BODY, "seed": 6, "force_tokens": 20, "response_format": "pcm",
                                                 "speed": 0.5})
    n = len(base.content) // 2
    assert n == 20 * SAMPLES_PER_TOKEN
    assert abs(len(fast.content) // 2 - n / 2) <= SR // 50 and abs(len(slow.content) // 2 - 2 * n) <= SR // 50
