"""Replays the request shapes peer clients and benchmarks send (recorded in tests/data/peer_requests/*.json from
their request code: vllm-omni's `vllm bench serve --backend openai-audio-speech` and CosyVoice3 example client,
sglang-omni's benchmark_tts_seedtts.py and benchmark_tts_serving.py) against the tiny model, and checks the status
and the audio each one gets."""
import base64
import glob
import io
import json
import os
import time

import pytest
import soundfile as sf

pytest.importorskip("fastapi")
pytest.importorskip("python_multipart")
from fastapi.testclient import TestClient  # noqa: E402
from server_helpers import SR, assert_error, wait_ready  # noqa: E402

from cosytrt.runtime.stages.request import default_voice_wav  # noqa: E402
from cosytrt.runtime.serving.app import ServerSettings, create_app  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
FILES = sorted(glob.glob(os.path.join(HERE, "data", "peer_requests", "*.json")))
CASES = [(os.path.basename(f)[:-5], entry) for f in FILES for entry in json.load(open(f, encoding="utf-8"))["requests"]]
TOKEN_CAP = 6  # the tiny model's LM is random: a few tokens per request keeps the replay fast
LONG_TEXT = ("A regional support lead records a detailed incident narrative. The report includes ticket identifiers "
             "and handoff notes. One caller read a long policy number twice. The final section asks for a calm pace.")


class CappedTTS:
    """The tiny TTS with every request capped at TOKEN_CAP speech tokens, and at least one (the HTTP bodies are
    untouched)."""

    def __init__(self, tts):
        self._tts = tts

    def submit(self, text, **kw):
        if "force_tokens" not in kw:
            kw["max_tokens"] = min(kw.get("max_tokens") or TOKEN_CAP, TOKEN_CAP)
            if kw.get("min_tokens") is None:  # unseeded bodies: the random LM's first token was a stop token in ~5 %
                kw["min_tokens"] = 1          # of requests, and an empty answer failed the "no audio" check
        return self._tts.submit(text, **kw)

    def __getattr__(self, name):
        return getattr(self._tts, name)


@pytest.fixture(scope="module")
def env(tiny_tts, tmp_path_factory):
    ref_dir = tmp_path_factory.mktemp("refs")
    buf = io.BytesIO()
    sf.write(buf, default_voice_wav(16000, seconds=2.0) * 0.9, 16000, format="WAV", subtype="PCM_16")
    wav = buf.getvalue()
    ref_path = ref_dir / "prompt-wavs" / "ref.wav"
    ref_path.parent.mkdir()
    ref_path.write_bytes(wav)
    subs = {"$MODEL": "cosyvoice3", "$REF_DATA_URI": "data:audio/wav;base64," + base64.b64encode(wav).decode(),
            "$REF_B64": base64.b64encode(wav).decode(), "$REF_PATH": str(ref_path),
            "$REF_FILE_URI": ref_path.as_uri(), "$LONG_TEXT": LONG_TEXT, "$OVER_LIMIT_TEXT": "Too long. " * 512}
    files = {"$REF_WAV_BYTES": wav, "$GARBAGE_BYTES": b"RIFF....WAVEgarbage" * 50}
    app = create_app(CappedTTS(tiny_tts), ServerSettings(voices_dir=str(tmp_path_factory.mktemp("voices")),
                                                         allowed_hosts=["testserver"], ref_audio_dir=str(ref_dir)))
    with TestClient(app) as c:
        wait_ready(c)
        yield c, subs, files


def fill(v, subs):
    if isinstance(v, str):
        return subs.get(v, v)
    if isinstance(v, dict):
        return {k: fill(x, subs) for k, x in v.items()}
    if isinstance(v, list):
        return [fill(x, subs) for x in v]
    return v


def check_audio(data: bytes, fmt: str, headers) -> int:
    """Decode the response body as `fmt`; returns its sample count."""
    if fmt == "pcm":
        assert headers["x-sample-rate"] == str(SR) and headers["x-channels"] == "1" and headers["x-bit-depth"] == "16"
        assert len(data) % 2 == 0
        return len(data) // 2
    if fmt == "wav" and data[4:8] == b"\xff\xff\xff\xff":  # streamed: sizes unknown
        return (len(data) - 44) // 2
    info = sf.info(io.BytesIO(data))
    assert info.samplerate == SR and info.channels == 1
    assert {"wav": "WAV", "flac": "FLAC", "mp3": "MP3", "opus": "OGG"}[fmt] == info.format, info
    samples, _ = sf.read(io.BytesIO(data), dtype="float32")
    return samples.shape[0]


@pytest.mark.parametrize("tool,case", CASES, ids=[f"{t}:{c['name']}" for t, c in CASES])
def test_peer_request_shapes(env, tool, case):
    client, subs, files = env
    method, path = case.get("method", "POST"), case.get("path", "/v1/audio/speech")
    expect = case["expect"]
    if "multipart" in case:
        mp = case["multipart"]
        r = client.post(path, data=mp["fields"], files={mp["file_field"]: (mp["filename"], files[mp["file"]],
                                                                           mp["content_type"])})
        if r.status_code == 201:
            client.delete(f"{path}/{r.json()['id']}")
    elif method == "GET":
        r = client.get(path)
    elif method == "DELETE":
        r = client.delete(path)
    else:
        body = fill(case["body"], subs)
        if body.get("stream"):
            with client.stream("POST", path, json=body) as s:
                s.read()
                r = s
        else:
            r = client.post(path, json=body)
    if expect["status"] >= 400:
        assert_error(r, expect["status"])
        return
    assert r.status_code == expect["status"], r.text[:500]
    fmt = expect.get("format")
    if fmt:
        n = check_audio(r.content, fmt, r.headers)
        assert n > 0, "no audio"


def test_peer_files_are_well_formed():
    assert len(FILES) >= 3 and len(CASES) >= 60
    for path in FILES:
        doc = json.load(open(path, encoding="utf-8"))
        assert doc["tool"] and doc["sources"]
        names = [c["name"] for c in doc["requests"]]
        assert len(names) == len(set(names)), path


def test_openai_extras_models_and_voices_alias(env):
    client, subs, _ = env
    m = client.get("/v1/models").json()
    assert m["object"] == "list" and m["data"][0]["id"] == "tiny" and m["data"][0]["object"] == "model"
    assert client.get("/v1/audio/voices").json()["data"][0]["id"] == "default"
    r = client.post("/v1/audio/speech", json={"model": "tts-1", "input": "No voice given.", "response_format": "pcm",
                                              "temperature": 0.5})
    assert r.status_code == 200 and r.headers["x-ignored-fields"] == "temperature"


def test_strict_rejects_vendor_extras(tiny_tts, tmp_path):
    app = create_app(CappedTTS(tiny_tts), ServerSettings(voices_dir=str(tmp_path), allowed_hosts=["testserver"],
                                                         strict=True))
    with TestClient(app) as c:
        wait_ready(c)
        body = {"model": "x", "input": "Strict.", "voice": "default"}
        assert_error(c.post("/v1/audio/speech", json={**body, "max_new_tokens": 5}), 400, "max_new_tokens",
                     "unknown_parameter")
        assert_error(c.post("/v1/audio/speech", json={**body, "language": "English"}), 400, "language")
        assert c.post("/v1/audio/speech", json=body).status_code == 200


def test_model_dir_without_builtin_voice_says_so(tiny_tts, tmp_path):
    class NoVoice(CappedTTS):
        pipeline = type("P", (), {"default_speaker": None, "frontend": None})()

    app = create_app(NoVoice(tiny_tts), ServerSettings(voices_dir=str(tmp_path), allowed_hosts=["testserver"],
                                                       warmup=False))
    with TestClient(app) as c:
        deadline = time.monotonic() + 60
        while c.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        err = assert_error(c.post("/v1/audio/speech", json={"model": "x", "input": "Hi."}), 400, "voice",
                           "voice_required")
        assert "no built-in voice" in err["message"]
        assert_error(c.post("/v1/audio/speech", json={"model": "x", "input": "Hi.", "voice": "alloy"}), 404, "voice")
