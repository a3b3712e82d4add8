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
BATCH_TEXTS = ("Today is a good day.", "The quick brown fox jumps.", "Please read this sentence.")  # (shortened)
TOKEN_CAP = 6  # the tiny model's LM is random: a few tokens per request keeps the replay fast
LONG_TEXT = ("A regional support lead records a detailed incident narrative. The report includes ticket identifiers "
             "and handoff notes. One caller read a long policy number twice. The final section asks for a calm pace.")


class CappedTTS:
    """The tiny TTS with every request capped at TOKEN_CAP speech tokens, and at least one (the HTTP bodies are
    untouched)."""

    def __init__(self, tts):
        self._tts = tts

    def submit(self, text, **kw):
        if kw.get("seed") is None:  # the random tiny LM stops at once for ~4 % of seeds (empty audio): be deterministic
            kw["seed"] = 0
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
            "$REF_FILE_URI": ref_path.as_uri(), "$LONG_TEXT": LONG_TEXT, "$OVER_LIMIT_TEXT": "Too long. " * 512,
            "$REF_URL": "https://huggingface.co/datasets/x/resolve/main/en/prompt-wavs/a.wav",
            "$ITEMS_31_PLUS_BOGUS": [{"input": BATCH_TEXTS[i % len(BATCH_TEXTS)], "response_format": "pcm" if i % 2
                                      else "wav"} for i in range(31)] + [{"input": "", "response_format": "bogus"}],
            "$ITEMS_33": [{"input": BATCH_TEXTS[i % len(BATCH_TEXTS)]} for i in range(33)]}
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
    if method == "WS":
        with client.websocket_connect(path) as ws:
            run_ws_script(ws, fill(case["script"], subs))
        with client.websocket_connect(path) as ws:  # the server still serves a new session afterwards
            run_ws_script(ws, fill(json.load(open(os.path.join(HERE, "data", "peer_requests",
                                                                 "sglang_omni_tts_ws.json")))["requests"][0]["script"],
                                   subs))
        return
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
    if "batch" in expect:
        check_batch(r.json(), fill(case["body"], subs), expect["batch"])


def check_batch(payload: dict, body: dict, expect: dict) -> None:
    """What sglang-omni's batch_client.py checks of a batch answer (read from its code), then each item's audio."""
    items = body["items"]
    assert isinstance(payload["id"], str) and payload["id"]
    assert payload["total"] == len(payload["results"]) == len(items)
    assert payload["succeeded"] + payload["failed"] == payload["total"]
    assert (payload["succeeded"], payload["failed"]) == (expect["succeeded"], expect["failed"])
    failed = set(expect.get("failed_items", []))
    for i, item in enumerate(payload["results"]):
        assert item["index"] == i
        if i in failed:
            assert item["status"] == "error" and item["error"] and item["error"]["message"], item
            continue
        assert item["status"] == "ok", item
        fmt = items[i].get("response_format") or body.get("response_format") or "wav"
        assert item["media_type"].split(";")[0] == {"wav": "audio/wav", "pcm": "audio/pcm"}[fmt]
        data = base64.b64decode(item["audio_data"], validate=True)
        assert data and check_audio(data, fmt, {"x-sample-rate": str(SR), "x-channels": "1", "x-bit-depth": "16"})


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


def test_sglang_seedtts_stream_reads_as_its_client_does(env):
    """sglang-omni's seedtts benchmark with --stream (its current _handle_raw_pcm_streaming_response, read from its
    code): 200, Content-Type audio/pcm, X-Sample-Rate / X-Channels / X-Bit-Depth, raw PCM chunks, whole frames."""
    client, subs, _ = env
    case = next(c for t, c in CASES if t == "sglang_omni_seedtts" and c["name"] == "voice_clone_stream")
    with client.stream("POST", "/v1/audio/speech", json=fill(case["body"], subs)) as s:
        assert s.status_code == 200
        assert s.headers["content-type"].lower().split(";", 1)[0] == "audio/pcm"
        rate, channels, bits = (int(s.headers.get(k, d)) for k, d in
                                (("x-sample-rate", 24000), ("x-channels", 1), ("x-bit-depth", 16)))
        chunks = [c for c in s.iter_bytes() if c]
    assert rate == SR and channels == 1 and bits % 8 == 0
    pcm = b"".join(chunks)
    block_align = channels * bits // 8
    assert chunks and len(pcm) > 0 and len(pcm) % block_align == 0


class _WsReader:
    """Reads a WebSocket session the way sglang-omni's ws_client.py checks it (read from its code)."""

    def __init__(self, ws):
        self.ws, self.open_sentence, self.sentence_bytes, self.signal, self.completed = ws, None, 0, False, 0
        self.rate = None

    def next(self):
        msg = self.ws.receive()
        assert msg["type"] == "websocket.send", msg  # the server did not close early
        if msg.get("bytes") is not None:
            data = msg["bytes"]
            assert self.open_sentence is not None and data and len(data) % 2 == 0, "binary audio outside a sentence"
            self.sentence_bytes += len(data)
            self.signal = self.signal or any(data)
            return "binary"
        event = json.loads(msg["text"])
        kind = event["type"]
        assert kind != "error" and not kind.endswith(".error"), event
        if kind == "session.configured":
            assert event["session_id"] and event["response_format"] == "pcm"
            assert isinstance(event["stream_audio"], bool) and event["split_granularity"] in ("sentence", "clause")
        elif kind == "audio.start":
            assert self.open_sentence is None and event["sentence_index"] >= 0 and event["sentence_text"]
            assert event["format"] == "pcm" and event["sample_rate"] == SR
            self.open_sentence, self.sentence_bytes, self.signal = event["sentence_index"], 0, False
        elif kind == "audio.done":
            assert event["error"] is False and event["sentence_index"] == self.open_sentence
            assert event["total_bytes"] == self.sentence_bytes > 0 and self.signal
            self.open_sentence = None
            self.completed += 1
        elif kind == "session.done":
            assert self.open_sentence is None and event["total_sentences"] == self.completed
        return kind


def run_ws_script(ws, script):
    reader = _WsReader(ws)
    for action in script:
        kind = action["action"]
        if kind == "send_json":
            ws.send_json(action["payload"])
        elif kind == "close":
            ws.close()
            return
        elif kind == "expect":
            while (got := reader.next()) == "session.configured":
                pass
            assert got == action["event"], (got, action)
        else:  # expect_audio_until_done / expect_audio_until_session_done
            end = "audio.done" if kind == "expect_audio_until_done" else "session.done"
            frames = 0
            allowed = ("binary", "session.configured") + (("audio.start", "audio.done") if end == "session.done" else ())
            while (got := reader.next()) != end:
                assert got in allowed, got
                frames += got == "binary"
            assert frames >= action.get("min_binary_frames", 1)


def test_old_sglang_seedtts_stream_reads_sse_wav(tiny_tts, tmp_path):
    """The older sglang-omni seedtts --stream client (benchmarks/benchmarker/utils.py process_sse_line, read from its
    code) sends stream=true + wav and reads `data:` lines whose event has audio.data = one base64 WAV per chunk (the
    duration from each WAV's header) and a usage event; with --stream-wav-sse the server answers that."""
    import wave

    ref = tmp_path / "refs" / "ref.wav"
    ref.parent.mkdir()
    sf.write(str(ref), default_voice_wav(16000, seconds=2.0) * 0.9, 16000, format="WAV", subtype="PCM_16")
    app = create_app(CappedTTS(tiny_tts), ServerSettings(voices_dir=str(tmp_path / "v"), allowed_hosts=["testserver"],
                                                         ref_audio_dir=str(ref.parent), stream_wav_sse=True,
                                                         warmup=False))
    case = next(c for t, c in CASES if t == "sglang_omni_seedtts" and c["name"] == "voice_clone_stream_old_client")
    with TestClient(app) as c:
        wait_ready(c)
        with c.stream("POST", "/v1/audio/speech", json=fill(case["body"], {"$MODEL": "m", "$REF_PATH": str(ref)})) as s:
            assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
            body = s.read().decode()
        seconds, usage, chunks = 0.0, None, 0
        for line in body.split("\n"):
            line = line.strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            audio = event.get("audio")
            if audio is not None and audio.get("data"):
                data = base64.b64decode(audio["data"])
                with wave.open(io.BytesIO(data)) as w:  # a complete WAV per chunk
                    assert w.getframerate() == SR and w.getnchannels() == 1 and w.getsampwidth() == 2
                    assert w.getnframes() == (len(data) - 44) // 2
                    seconds += w.getnframes() / SR
                chunks += 1
            if event.get("usage") is not None:
                usage = event["usage"]
        assert chunks >= 1 and seconds > 0 and usage["completion_tokens"] > 0
        # OpenAI-style clients (explicit stream_format) still get raw chunked audio with the flag on
        r = c.post("/v1/audio/speech", json={"model": "m", "input": "Hi.", "stream_format": "audio", "voice": "default"})
        assert r.status_code == 200 and r.content[:4] == b"RIFF"
