"""runtime/serving/ in process (Starlette TestClient) over the tiny model: every endpoint and every error.

Audio tests run the tiny model through the real scheduler and compare the server's bytes with the same request
submitted to the TTS directly (16-bit PCM, exact). The fake-runtime tests (backpressure, readiness, disconnect,
drain) are in test_server_fake.py; the issue #19 defects in test_server_hardening.py; peer clients' request shapes in
test_server_compat.py."""
import base64
import io
import json
import os
import re
import struct
import subprocess
import sys

import numpy as np
import pytest
import soundfile as sf

pytest.importorskip("fastapi")
pytest.importorskip("python_multipart")
from fastapi.testclient import TestClient  # noqa: E402
from server_helpers import (SAMPLES_PER_TOKEN, SR, assert_error, direct_pcm, parse_metrics,  # noqa: E402,F401
                            read_wav, speech_count, wait_ready)

from cosytrt.runtime.stages.request import default_voice_wav  # noqa: E402
from cosytrt.runtime.serving.app import ServerSettings, create_app  # noqa: E402
from cosytrt.runtime.serving.encoding import aac_available  # noqa: E402
from cosytrt.runtime.serving.voices import VoiceStore  # noqa: E402


# ------------------------------------------------------------------------------------------------ tiny model

@pytest.fixture(scope="module")
def tts(tiny_tts):
    return tiny_tts


@pytest.fixture(scope="module")
def voices_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("voices")


@pytest.fixture(scope="module")
def client(tts, voices_dir):
    app = create_app(tts, ServerSettings(voices_dir=str(voices_dir), max_input_chars=300, max_upload_mb=0.5,
                                         allowed_hosts=["testserver"]))
    with TestClient(app) as c:
        wait_ready(c)
        yield c



def test_health_ready(client):
    r = client.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ready"}


def test_speech_wav_force_tokens_matches_runtime(client, tts):
    r = client.post("/v1/audio/speech", json={"model": "cosyvoice3", "input": "Hello there.", "voice": "default",
                                              "seed": 3, "force_tokens": 12})
    assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
    assert r.headers["x-speech-tokens"] == "12"
    samples, sr, info = read_wav(r.content)
    assert sr == SR and info.channels == 1 and info.subtype == "PCM_16"
    assert samples.shape == (12 * SAMPLES_PER_TOKEN,)  # 12 tokens = 0.48 s
    assert np.abs(samples).max() > 0
    assert r.content[44:] == direct_pcm(tts, "Hello there.", seed=3, force_tokens=12)
    assert struct.unpack("<I", r.content[40:44])[0] == 2 * samples.size  # exact sizes when not streaming


def test_speech_max_tokens_length_matches_tokens(client):
    r = client.post("/v1/audio/speech", json={"model": "x", "input": "Short one.", "voice": "default", "seed": 5,
                                              "max_tokens": 15})
    assert r.status_code == 200
    tokens = int(r.headers["x-speech-tokens"])
    assert 1 <= tokens <= 15
    samples, _, _ = read_wav(r.content)
    assert samples.size == tokens * SAMPLES_PER_TOKEN
    assert float(r.headers["x-audio-seconds"]) == pytest.approx(tokens / 25, abs=1e-4)


def test_pcm_and_flac_same_samples_as_wav(client):
    body = {"model": "x", "input": "Formats.", "voice": "default", "seed": 7, "force_tokens": 8, "speed": 1.0}
    wav = client.post("/v1/audio/speech", json=body)
    pcm = client.post("/v1/audio/speech", json={**body, "response_format": "pcm"})
    flac = client.post("/v1/audio/speech", json={**body, "response_format": "flac"})
    assert [x.status_code for x in (wav, pcm, flac)] == [200, 200, 200]
    assert pcm.headers["content-type"] == "audio/pcm" and flac.headers["content-type"] == "audio/flac"
    assert pcm.content == wav.content[44:] and len(pcm.content) == 2 * 8 * SAMPLES_PER_TOKEN
    fl, sr, info = read_wav(flac.content)
    assert sr == SR and info.format == "FLAC"
    assert np.array_equal(fl, np.frombuffer(pcm.content, "<i2"))


def test_stream_wav_unknown_length_header(client, tts):
    body = {"model": "x", "input": "Streaming now.", "voice": "default", "seed": 11, "force_tokens": 40,
            "stream": True}
    with client.stream("POST", "/v1/audio/speech", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
        data = b"".join(r.iter_bytes())
    assert "content-length" not in r.headers  # chunked
    assert data[:4] == b"RIFF" and data[4:8] == b"\xff\xff\xff\xff" and data[40:44] == b"\xff\xff\xff\xff"
    samples, sr, _ = read_wav(data)
    assert sr == SR and samples.size == 40 * SAMPLES_PER_TOKEN
    ref = direct_pcm(tts, "Streaming now.", stream=True, seed=11, force_tokens=40)
    assert data[44:] == ref


def test_stream_sse_and_pcm(client):
    body = {"model": "x", "input": "Events.", "voice": "default", "seed": 2, "force_tokens": 30,
            "response_format": "pcm"}
    raw = client.post("/v1/audio/speech", json={**body, "stream": True})
    sse = client.post("/v1/audio/speech", json={**body, "stream_format": "sse"})
    assert raw.status_code == 200 and raw.headers["content-type"] == "audio/pcm"
    assert sse.status_code == 200 and sse.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(block[len("data: "):]) for block in sse.text.strip().split("\n\n")]
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1)
    assert events[-1]["type"] == "speech.audio.done" and events[-1]["usage"]["output_tokens"] == 30
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert audio == raw.content and len(audio) == 2 * 30 * SAMPLES_PER_TOKEN


def test_sample_rate_resamples_whole_and_streamed_alike(client, tts):
    """`sample_rate` (telephony 8 kHz, 16 kHz, 44.1 kHz): the model's audio resampled with soxr, whole or streamed
    (the streamed bytes are exactly those of resampling the whole stream: soxr's streaming resampler is exact);
    the headers name the rate."""
    from cosytrt.runtime.serving.encoding import Resampler, pcm16

    def native(stream):
        h = tts.submit("Telephony.", stream=stream, speaker=tts.pipeline.default_speaker, seed=6, force_tokens=30)
        return np.concatenate(list(h.chunks(timeout=60)))

    offline, streaming = native(False), native(True)
    body = {"model": "x", "input": "Telephony.", "voice": "default", "seed": 6, "force_tokens": 30}
    for rate in (8000, 16000, 44100):
        whole = client.post("/v1/audio/speech", json={**body, "sample_rate": rate})
        assert whole.status_code == 200, whole.text
        samples, sr, _ = read_wav(whole.content)
        assert sr == rate and samples.size == int(np.ceil(offline.size * rate / SR))
        assert whole.content[44:] == pcm16(Resampler(SR, rate).whole(offline))
        streamed = client.post("/v1/audio/speech", json={**body, "sample_rate": rate, "stream": True,
                                                         "response_format": "pcm"})
        assert streamed.status_code == 200 and streamed.headers["x-sample-rate"] == str(rate)
        assert streamed.content == pcm16(Resampler(SR, rate).whole(streaming))
    mp3 = client.post("/v1/audio/speech", json={**body, "sample_rate": 16000, "response_format": "mp3"})
    assert mp3.status_code == 200 and sf.info(io.BytesIO(mp3.content)).samplerate == 16000
    batch = client.post("/v1/audio/speech/batch", json={"model": "x", "voice": "default", "seed": 6,
                                                        "items": [{"input": "Telephony.", "force_tokens": 30,
                                                                   "sample_rate": 8000}]})
    item = batch.json()["results"][0]
    assert item["status"] == "ok" and item["sample_rate"] == 8000
    assert base64.b64decode(item["audio_data"]) == client.post(
        "/v1/audio/speech", json={**body, "sample_rate": 8000}).content


def test_g711_telephony_formats(client, tts):
    """response_format ulaw / alaw: 8-bit G.711 at 8 kHz (the default rate for them; another is a 400), whole or
    streamed alike, the raw-sample headers naming the encoding."""
    from cosytrt.runtime.serving.encoding import Resampler, g711, pcm16

    body = {"model": "x", "input": "Call center.", "voice": "default", "seed": 8, "force_tokens": 25}
    h = tts.submit("Call center.", stream=True, speaker=tts.pipeline.default_speaker, seed=8, force_tokens=25)
    at8k = np.frombuffer(pcm16(Resampler(SR, 8000).whole(np.concatenate(list(h.chunks(timeout=60))))), "<i2")
    for law, media in (("ulaw", "audio/basic"), ("alaw", "audio/x-alaw-basic")):
        whole = client.post("/v1/audio/speech", json={**body, "response_format": law})
        assert whole.status_code == 200 and whole.headers["content-type"] == media
        assert whole.headers["x-sample-rate"] == "8000" and whole.headers["x-bit-depth"] == "8"
        assert whole.headers["x-encoding"] == {"ulaw": "mulaw", "alaw": "alaw"}[law]
        assert len(whole.content) == 25 * 8000 // 25  # one byte per 8 kHz sample: 1 s
        streamed = client.post("/v1/audio/speech", json={**body, "response_format": law, "stream": True})
        assert streamed.status_code == 200 and streamed.content == g711(at8k, law)
        assert_error(client.post("/v1/audio/speech", json={**body, "response_format": law, "sample_rate": 16000}),
                     400, "sample_rate")


def test_g711_matches_the_reference_codec():
    """g711 equals the ITU / Sun reference (Python's audioop, where this Python still has it) on every 16-bit
    value, and decodes back within G.711's quantisation."""
    import warnings

    from cosytrt.runtime.serving.encoding import g711

    x = np.arange(-32768, 32768, dtype=np.int16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        audioop = pytest.importorskip("audioop", reason="audioop left Python in 3.13")
    for law in ("ulaw", "alaw"):
        ours = g711(x, law)
        assert ours == getattr(audioop, f"lin2{law}")(x.tobytes(), 2), law
        back = np.frombuffer(getattr(audioop, f"{law}2lin")(ours, 2), "<i2").astype(int)
        assert np.all(np.abs(back - x) <= np.maximum(16, np.abs(x.astype(int)) // 16)), law


def test_resampler_streams_exactly_like_whole():
    from cosytrt.runtime.serving.encoding import Resampler

    x = (np.random.default_rng(0).standard_normal(24000 * 2) * 0.1).astype(np.float32)
    for rate in (8000, 22050, 24000, 48000):
        whole = Resampler(24000, rate).whole(x)
        r = Resampler(24000, rate)
        cuts = [0, 480, 4000, 4001, 23000, x.size]
        parts = [r(x[a:b]) for a, b in zip(cuts, cuts[1:])] + [r.flush()]
        assert np.array_equal(np.concatenate(parts), whole) and whole.size == int(np.ceil(x.size * rate / 24000))


def test_openai_voice_names_and_instructions(client):
    body = {"model": "tts-1", "input": "Same voice.", "seed": 4, "force_tokens": 6}
    a = client.post("/v1/audio/speech", json={**body, "voice": "alloy"})
    d = client.post("/v1/audio/speech", json={**body, "voice": {"id": "default"}})
    assert a.status_code == d.status_code == 200 and a.content == d.content
    i = client.post("/v1/audio/speech", json={**body, "voice": "default", "instructions": "Speak slowly."})
    assert i.status_code == 200 and read_wav(i.content)[0].size == 6 * SAMPLES_PER_TOKEN


@pytest.mark.parametrize("body,status,param", [
    ({"model": "x", "input": "hi", "voice": "default", "speed": 4.5}, 400, "speed"),
    ({"model": "x", "input": "hi", "voice": "default", "speed": 0.2}, 400, "speed"),
    ({"model": "x", "input": "hi", "voice": "default", "speed": -1.0}, 400, "speed"),
    ({"model": "x", "input": "hi", "voice": "default", "speed": "fast"}, 400, "speed"),
    ({"model": "x", "input": "hi", "speed": 1.5, "stream": True, "response_format": "pcm"}, 400, "speed"),
    ({"model": "x", "voice": "default"}, 400, "input"),
    ({"input": "hi", "voice": "default"}, 400, "model"),
    ({"model": "x", "input": 5, "voice": "default"}, 400, "input"),
    ({"model": "x", "input": "   ", "voice": "default"}, 400, "input"),
    ({"model": "x", "input": "", "voice": "default"}, 400, "input"),
    ({"model": "x", "input": "hi", "voice": 3}, 400, "voice"),
    ({"model": "x", "input": "hi", "voice": "../../etc/passwd"}, 400, "voice"),
    ({"model": "x", "input": "hi", "voice": "/abs/path"}, 400, "voice"),
    ({"model": "x", "input": "hi", "voice": "Default"}, 400, "voice"),
    ({"model": "x", "input": "hi", "voice": "default\n"}, 400, "voice"),
    ({"model": "x", "input": "hi", "voice": "default", "response_format": "bogus"}, 400, "response_format"),
    pytest.param({"model": "x", "input": "hi", "voice": "default", "response_format": "aac"}, 400, "response_format",
                 marks=pytest.mark.skipif(aac_available(), reason="PyAV is installed: aac is encoded")),
    ({"model": "x", "input": "hi", "voice": "default", "response_format": "flac", "stream": True}, 400,
     "response_format"),
    ({"model": "x", "input": "hi", "voice": "default", "response_format": "mp3", "stream_format": "audio"}, 400,
     "response_format"),
    ({"model": "x", "input": "hi", "voice": "default", "stream": "yes"}, 400, "stream"),
    ({"model": "x", "input": "hi", "voice": "default", "stream_format": "ogg"}, 400, "stream_format"),
    ({"model": "x", "input": "hi", "voice": "default", "seed": "1"}, 400, "seed"),
    ({"model": "x", "input": "hi", "voice": "default", "seed": -1}, 400, "seed"),
    ({"model": "x", "input": "hi", "voice": "default", "seed": 2 ** 63}, 400, "seed"),
    ({"model": "x", "input": "hi", "voice": "default", "seed": True}, 400, "seed"),
    ({"model": "x", "input": "hi", "voice": "default", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "x", "input": "hi", "voice": "default", "max_new_tokens": -5}, 400, "max_new_tokens"),
    ({"model": "x", "input": "hi", "voice": "default", "force_tokens": 2.5}, 400, "force_tokens"),
    ({"model": 7, "input": "hi", "voice": "default"}, 400, "model"),
    ({"model": "x", "input": "hi", "voice": "default", "instruct": "a", "instructions": "b"}, 400, "instructions"),
    ({"model": "x", "input": "hi", "voice": "default", "max_token": 5}, 400, "max_token"),
    ({"model": "x", "input": "hi", "voice": "default", "language": "Klingon"}, 400, "language"),
    ({"model": "x", "input": "hi", "voice": "default", "task_type": "NotATask"}, 400, "task_type"),
    ({"model": "x", "input": "hi", "ref_text": "orphan transcript"}, 400, "ref_audio"),
    (["not", "an", "object"], 400, "body"),
    ({"model": "x", "input": "x" * 301, "voice": "default"}, 400, "input"),  # OpenAI: 400 for over-long input
    ({"model": "x", "input": "hi", "voice": "nobody"}, 404, "voice"),
    ({"model": "x", "input": "hi", "voice": "default", "sample_rate": 7999}, 400, "sample_rate"),
    ({"model": "x", "input": "hi", "voice": "default", "sample_rate": 96000}, 400, "sample_rate"),
    ({"model": "x", "input": "hi", "voice": "default", "sample_rate": 16000.0}, 400, "sample_rate"),
    ({"model": "x", "input": "hi", "voice": "default", "sample_rate": 44100, "response_format": "opus"}, 400,
     "sample_rate"),
    ({"model": "x", "input": "hi", "voice": "default", "sample_rate": 10000, "response_format": "mp3"}, 400,
     "sample_rate"),
])
def test_bad_speech_requests(client, body, status, param):
    err = assert_error(client.post("/v1/audio/speech", json=body), status, param)
    assert err["type"] == "invalid_request_error"


def test_malformed_json_and_oversized_body(client):
    r = client.post("/v1/audio/speech", content=b'{"model": "x", "input": "hi", "voice": ', headers={"content-type":
                                                                                      "application/json"})
    assert_error(r, 400, "body", "invalid_json")
    r = client.post("/v1/audio/speech", content=b"x" * 2_000_000, headers={"content-type": "application/json"})
    assert_error(r, 413, code="payload_too_large")


def test_request_too_long_for_buffers_is_413(client):
    r = client.post("/v1/audio/speech", json={"model": "x", "input": "hi", "voice": "default", "force_tokens": 100_000})
    assert_error(r, 413, "input", "request_too_long")
    r = client.post("/v1/audio/speech", json={"model": "x", "input": "hi", "voice": "default", "force_tokens": 100_000,
                                              "stream": True})
    assert_error(r, 413, "input", "request_too_long")  # the first chunk is awaited before the status is sent


def test_unknown_route_openai_error_shape(client):
    assert_error(client.get("/v1/nothing"), 404)
    assert_error(client.get("/v1/audio/speech"), 405)


def test_request_id_header_echoed_or_made(client):
    """Every response carries X-Request-Id: the client's own when it is a plain token (gateways correlate by it),
    else a new one; errors and streamed responses too; the server's log lines name it."""
    import logging

    from cosytrt.runtime.serving.http import REQUEST_ID, RequestIdFilter

    ok = client.get("/health", headers={"X-Request-Id": "gw-42:abc"})
    assert ok.headers["x-request-id"] == "gw-42:abc"
    made = client.get("/health").headers["x-request-id"]
    assert re.fullmatch(r"req-[0-9a-f]{32}", made) and made != client.get("/health").headers["x-request-id"]
    for bad in ("x" * 129, "two words", "new\nline"):
        assert client.get("/health", headers={"X-Request-Id": bad}).headers["x-request-id"].startswith("req-")
    err = client.post("/v1/audio/speech", json={"model": "x"}, headers={"X-Request-Id": "err-1"})
    assert err.status_code == 400 and err.headers["x-request-id"] == "err-1"
    streamed = client.post("/v1/audio/speech", headers={"X-Request-Id": "st-1"},
                           json={"model": "x", "input": "Hi.", "voice": "default", "force_tokens": 5, "stream": True})
    assert streamed.status_code == 200 and streamed.headers["x-request-id"] == "st-1"
    record = logging.LogRecord("cosytrt.server", logging.INFO, __file__, 1, "m", None, None)
    token = REQUEST_ID.set("log-7")  # what the middleware sets for the request's tasks
    try:
        assert RequestIdFilter().filter(record) and record.request_id == "log-7"
    finally:
        REQUEST_ID.reset(token)
    assert RequestIdFilter().filter(record) and record.request_id == "-"


def test_voices_lifecycle(client, tts, voices_dir):
    prompt = default_voice_wav(16000, seconds=2.0) * 0.9
    buf = io.BytesIO()
    sf.write(buf, prompt, 16000, format="WAV", subtype="FLOAT")
    wav_bytes = buf.getvalue()
    r = client.post("/v1/voices", files={"audio": ("me.wav", wav_bytes, "audio/wav")},
                    data={"text": "A test voice.", "name": "alice"})
    assert r.status_code == 201, r.text
    assert r.json()["id"] == "alice" and r.json()["prompt_text"] == "A test voice."
    assert sorted(os.listdir(voices_dir)) == ["alice.safetensors"]
    listed = client.get("/v1/voices").json()
    assert listed["object"] == "list"
    assert [(v["id"], v["builtin"]) for v in listed["data"]] == [("default", True), ("alice", False)]

    # the stored voice is the speaker the TTS computes for the same audio, and survives a new store
    spk = VoiceStore(str(voices_dir)).get("alice")
    ref = tts.make_speaker(prompt, "A test voice.", 16000)
    assert np.array_equal(spk.features.speech_tokens.numpy(), ref.features.speech_tokens.numpy())
    body = {"model": "x", "input": "Cloned.", "voice": "alice", "seed": 9, "force_tokens": 10, "response_format": "pcm"}
    r = client.post("/v1/audio/speech", json=body)
    assert r.status_code == 200
    assert r.content == direct_pcm(tts, "Cloned.", speaker=ref, seed=9, force_tokens=10)
    assert r.content != client.post("/v1/audio/speech", json={**body, "voice": "default"}).content

    # generated id; errors
    r = client.post("/v1/voices", files={"audio": ("v.wav", wav_bytes, "audio/wav")}, data={"text": ""})
    assert r.status_code == 201 and re.match(r"^voice-[0-9a-f]{12}$", r.json()["id"])
    anon = r.json()["id"]
    assert_error(client.post("/v1/voices", files={"audio": ("v.wav", wav_bytes)}, data={"name": "alice"}),
                 409, "name", "voice_exists")
    assert_error(client.post("/v1/voices", files={"audio": ("v.wav", wav_bytes)}, data={"name": "default"}),
                 409, "name")
    for bad in ("Bad Name", "../x", "-x", "a" * 65):
        assert_error(client.post("/v1/voices", files={"audio": ("v.wav", wav_bytes)}, data={"name": bad}),
                     400, "name")
    other = {"other": ("o.txt", b"x")}  # forces multipart/form-data
    assert_error(client.post("/v1/voices", files=other, data={"text": "no audio"}), 400, "audio")
    assert_error(client.post("/v1/voices", files=other, data={"audio": "not a file"}), 400, "audio")
    assert_error(client.post("/v1/voices", data={"text": "no audio"}), 415, code="unsupported_media_type")
    assert_error(client.post("/v1/voices", files={"audio": ("x.wav", b"garbage" * 100)}), 400, "audio",
                 "invalid_audio")
    long_prompt = io.BytesIO()
    sf.write(long_prompt, np.zeros(16000 * 31, np.int16), 16000, format="WAV", subtype="PCM_16")
    assert_error(client.post("/v1/voices", files={"audio": ("long.wav", long_prompt.getvalue())}), 413,
                 code="payload_too_large")  # 0.99 MB > the 0.5 MiB cap
    assert_error(client.post("/v1/voices", content=b"x" * 600_000,
                             headers={"content-type": "multipart/form-data; boundary=zz"}), 413)
    long_prompt = io.BytesIO()
    sf.write(long_prompt, np.zeros(8000 * 31, np.int16), 8000, format="FLAC")  # small file, 31 s: too long
    assert_error(client.post("/v1/voices", files={"audio": ("long.flac", long_prompt.getvalue())}), 400, "audio")

    # delete
    assert client.delete("/v1/voices/alice").json() == {"id": "alice", "object": "voice", "deleted": True}
    assert_error(client.delete("/v1/voices/alice"), 404, "voice_id")
    assert_error(client.post("/v1/audio/speech", json=body), 404, "voice")
    assert_error(client.delete("/v1/voices/default"), 409, "voice_id")
    assert_error(client.delete("/v1/voices/%2e%2e"), 400, "voice_id")
    assert_error(client.delete("/v1/voices/UPPER"), 400, "voice_id")
    assert client.delete(f"/v1/voices/{anon}").status_code == 200
    assert os.listdir(voices_dir) == []
    assert [v["id"] for v in client.get("/v1/voices").json()["data"]] == ["default"]


def test_metrics_exposition(client):
    before = parse_metrics(client.get("/metrics").text)
    r = client.post("/v1/audio/speech", json={"model": "x", "input": "Count me.", "voice": "default", "seed": 1,
                                              "force_tokens": 5})
    assert r.status_code == 200
    client.post("/v1/audio/speech", json={"model": "x", "input": "hi", "voice": "default", "speed": 9})
    text = client.get("/metrics").text
    after = parse_metrics(text)
    assert "# TYPE cosytrt_inter_chunk_seconds histogram" in text
    for h in ("t_tokenizer_seconds", "t_ar_seconds", "t_dit_seconds", "t_vocoder_seconds", "t_queue_seconds",
              "time_to_first_audio_seconds", "rtf"):
        name = f"cosytrt_{h}"
        assert f"# TYPE {name} histogram" in text
        assert after[f"{name}_count"] == before[f"{name}_count"] + 1
        assert after[f'{name}_bucket{{le="+Inf"}}'] == after[f"{name}_count"]
    assert speech_count(after, 200) == speech_count(before, 200) + 1
    assert speech_count(after, 400) == speech_count(before, 400) + 1
    ok = 'cosytrt_speech_requests_total{outcome="ok"}'
    assert after[ok] == before[ok] + 1
    assert after["cosytrt_speech_tokens_total"] == before["cosytrt_speech_tokens_total"] + 5
    assert after["cosytrt_requests_in_flight"] == 0 and after["cosytrt_queue_depth"] == 0
    assert after["cosytrt_ready"] == 1
    for c in ("cosytrt_bucket_hits_total", "cosytrt_bucket_pads_total", "cosytrt_eager_fallbacks_total"):
        assert f"# TYPE {c} counter" in text  # eager tiny model: 0
    assert after["cosytrt_runtime_requests_in_flight"] == 0


# ------------------------------------------------------------------------------------------------ CLI / packaging

def test_server_module_imports_without_fastapi_and_cli_exits_2():
    code = ("import sys\n"
            "for m in ('fastapi', 'uvicorn', 'multipart', 'python_multipart', 'starlette'):\n"
            "    sys.modules[m] = None\n"
            "import cosytrt.runtime.serving, cosytrt.runtime.serving.voices\n"
            "from cosytrt.tools.trtbuild import main\n"
            "sys.exit(main(['serve', '--model', 'tiny']))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "fastapi" in p.stderr and "uvicorn" in p.stderr and "python-multipart" in p.stderr
    assert "cosytrt[serve]" in p.stderr


def test_cli_help_lists_options():
    p = subprocess.run([sys.executable, "-m", "cosytrt.tools.trtbuild", "serve", "--help"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    for opt in ("--model", "--engines", "--host", "--port", "--api-key", "--voices-dir", "--max-input-chars",
                "--max-upload-mb", "--max-in-flight", "--queue-timeout-s", "--api-key-file", "--strict",
                "--allowed-hosts", "--ref-audio-dir", "--max-voices", "--max-transcript-chars", "--body-timeout-s",
                "--no-normalize"):
        assert opt in p.stdout


@pytest.mark.skipif(not aac_available(), reason="PyAV (the 'aac' extra) is not installed")
def test_aac_response_is_adts_aac(client):
    import av

    r = client.post("/v1/audio/speech", json={"model": "x", "input": "Hello there.", "voice": "default", "seed": 3,
                                              "force_tokens": 12, "response_format": "aac"})
    assert r.status_code == 200 and r.headers["content-type"] == "audio/aac"
    assert r.content[:2] in (b"\xff\xf1", b"\xff\xf9")  # ADTS sync word
    with av.open(io.BytesIO(r.content)) as f:
        stream = f.streams.audio[0]
        assert stream.codec_context.name == "aac" and stream.sample_rate == SR
        n = sum(frame.samples for frame in f.decode(audio=0))
    assert n >= 12 * SAMPLES_PER_TOKEN  # the encoder adds priming / padding frames, never drops audio


def test_aac_without_pyav_is_a_clear_400(client, monkeypatch):
    from cosytrt.runtime.serving import encoding

    monkeypatch.setattr(encoding, "aac_available", lambda: False)
    err = assert_error(client.post("/v1/audio/speech", json={"model": "x", "input": "hi", "voice": "default",
                                                             "response_format": "aac"}), 400, "response_format")
    assert "cosytrt[aac]" in err["message"] and "PyAV" in err["message"]
