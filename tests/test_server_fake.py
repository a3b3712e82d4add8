"""runtime/serving/ over a fake TTS whose requests are held by a gate: readiness, API key, backpressure, runtime
rejection, client disconnects, drain, runtime counters, internal errors, the voice store and settings. Deterministic
and fast (no model)."""
import asyncio
import json
import os
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("python_multipart")
from fastapi.testclient import TestClient  # noqa: E402
from server_helpers import (SR, FakeTTS, assert_error, fake_client, in_flight, parse_metrics,  # noqa: E402
                            speech_count, wait_ready)

from cosytrt.runtime.serving.app import ServerSettings, wav_header  # noqa: E402
from cosytrt.runtime.serving.voices import VoiceStore  # noqa: E402


@pytest.fixture(scope="module")
def tts(tiny_tts):
    return tiny_tts


def test_health_503_until_warm(tmp_path):
    fake = FakeTTS(free=0)
    app, client = fake_client(tmp_path, fake)
    real_submit = fake.submit

    def slow_warmup(text, **kw):  # the warm-up request waits for the gate too
        h = real_submit(text, **kw)
        h.free = 0
        return h

    fake.submit = slow_warmup
    with client:
        time.sleep(0.1)
        r = client.get("/health")
        assert r.status_code == 503 and r.json() == {"status": "loading"}
        assert_error(client.post("/v1/audio/speech", json={"model": "x", "input": "hi", "voice": "default"}), 503,
                     code="not_ready")
        assert parse_metrics(client.get("/metrics").text)["cosytrt_ready"] == 0
        fake.gate.set()
        wait_ready(client, 5)
        assert client.get("/health").json() == {"status": "ready"}
        assert client.post("/v1/audio/speech", json={"model": "x", "input": "hi", "voice": "default"}).status_code == 200


def test_api_key(tmp_path):
    fake = FakeTTS()
    _, client = fake_client(tmp_path, fake, api_key="sekret")
    with client:
        wait_ready(client, 5)
        body = {"model": "x", "input": "hi", "voice": "default"}
        assert_error(client.post("/v1/audio/speech", json=body), 401, code="invalid_api_key")
        assert_error(client.post("/v1/audio/speech", json=body, headers={"Authorization": "Bearer wrong"}), 401)
        assert_error(client.get("/v1/voices", headers={"Authorization": "sekret"}), 401)
        assert_error(client.delete("/v1/voices/x"), 401)
        assert client.post("/v1/audio/speech", json=body, headers={"Authorization": "Bearer sekret"}).status_code \
            == 200
        assert client.get("/v1/voices", headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200


def test_backpressure_429_and_queue_timeout_503(tmp_path):
    fake = FakeTTS(free=0)
    app, client = fake_client(tmp_path, fake, max_in_flight=1, max_queue=1, queue_timeout_s=0.5)
    body = {"model": "x", "input": "hold", "voice": "default", "response_format": "pcm"}
    with client:
        wait_ready(client, 5)
        results = {}

        def post(key):
            results[key] = client.post("/v1/audio/speech", json=body)

        a = threading.Thread(target=post, args=("a",))
        a.start()
        while in_flight(app) < 1:
            time.sleep(0.005)
        b = threading.Thread(target=post, args=("b",))
        b.start()
        while app.state.server.admission.waiting < 1:
            time.sleep(0.005)
        m = parse_metrics(client.get("/metrics").text)
        assert m["cosytrt_requests_in_flight"] == 1 and m["cosytrt_queue_depth"] == 1
        t0 = time.monotonic()
        assert_error(client.post("/v1/audio/speech", json=body), 429, code="too_many_requests")
        assert time.monotonic() - t0 < 0.4  # rejected at once, not after the queue timeout
        b.join(5)
        err = assert_error(results["b"], 503, code="queue_timeout")
        assert err["type"] == "server_error" and results["b"].headers["retry-after"] == "1"
        fake.gate.set()
        a.join(5)
        assert results["a"].status_code == 200 and len(results["a"].content) == 3 * 480 * 2
        assert in_flight(app) == 0
        m = parse_metrics(client.get("/metrics").text)
        assert (speech_count(m, 200), speech_count(m, 429), speech_count(m, 503)) == (1, 1, 1)


def test_runtime_rejection_is_429(tmp_path):
    fake = FakeTTS(reject=True)
    app, client = fake_client(tmp_path, fake)
    with client:
        wait_ready(client, 5)
        err = assert_error(client.post("/v1/audio/speech", json={"model": "x", "input": "hi", "voice": "default"}), 429,
                           code="overloaded")
        assert err["type"] == "rate_limit_error" and "max_in_flight=3" in err["message"]
        assert in_flight(app) == 0


async def _drive(app, body: dict, disconnect_after_body: bool):
    """Call the ASGI app directly; the client disconnects after the first body bytes (or right after sending)."""
    raw = json.dumps(body).encode()
    sent, got_body, request_sent = [], asyncio.Event(), False

    async def receive():
        nonlocal request_sent
        if not request_sent:
            request_sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        if disconnect_after_body:
            await got_body.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if message["type"] == "http.response.body" and message.get("body"):
            got_body.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/audio/speech", "raw_path": b"/v1/audio/speech",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 5000), "server": ("testserver", 80),
             "headers": [(b"host", b"testserver"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(raw)).encode())]}
    await asyncio.wait_for(app(scope, receive, send), 10)
    return sent


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_cancels_request(tmp_path, stream):
    fake = FakeTTS(free=1)  # one chunk at once, the rest never (the gate stays shut)
    app, client = fake_client(tmp_path, fake)
    with client:
        wait_ready(client, 5)
        sent = client.portal.call(_drive, app, {"model": "x", "input": "bye", "voice": "default", "stream": stream}, stream)
        handle = fake.handles[-1]
        assert handle.text == "bye" and handle.cancelled.is_set()
        assert in_flight(app) == 0
        status = next(m["status"] for m in sent if m["type"] == "http.response.start")
        assert status == (200 if stream else 499)
        if stream:
            assert sent[1]["body"] == wav_header(SR, None)
        m = parse_metrics(client.get("/metrics").text)
        assert m['cosytrt_speech_requests_total{outcome="cancelled"}'] == 1
        assert m["cosytrt_requests_in_flight"] == 0


def test_shutdown_drains_in_flight(tmp_path):
    fake = FakeTTS(free=0)
    app, client = fake_client(tmp_path, fake, drain_timeout_s=5.0)
    results = {}
    with client:
        wait_ready(client, 5)
        t = threading.Thread(target=lambda: results.setdefault("r", client.post(
            "/v1/audio/speech", json={"model": "x", "input": "finish me", "voice": "default"})))
        t.start()
        while in_flight(app) < 1:
            time.sleep(0.005)
        threading.Timer(0.3, fake.gate.set).start()
        t0 = time.monotonic()
        client.portal.call(app.state.server.drain)  # what the lifespan runs at shutdown
        waited = time.monotonic() - t0
        t.join(5)
        assert 0.25 < waited < 4.0
        assert results["r"].status_code == 200 and not fake.handles[-1].cancelled.is_set()
        assert client.get("/health").status_code == 503
        assert_error(client.post("/v1/audio/speech", json={"model": "x", "input": "late", "voice": "default"}), 503,
                     code="shutting_down")


def test_shutdown_drain_timeout_cancels(tmp_path):
    fake = FakeTTS(free=0)
    app, client = fake_client(tmp_path, fake, drain_timeout_s=0.3)
    results = {}
    with client:
        wait_ready(client, 5)
        t = threading.Thread(target=lambda: results.setdefault("r", client.post(
            "/v1/audio/speech", json={"model": "x", "input": "stuck", "voice": "default"})))
        t.start()
        while in_flight(app) < 1:
            time.sleep(0.005)
        t0 = time.monotonic()
        client.portal.call(app.state.server.drain)
        assert 0.25 < time.monotonic() - t0 < 2.0
        t.join(5)
        assert fake.handles[-1].cancelled.is_set()
        assert_error(results["r"], 503, code="shutting_down")
        assert in_flight(app) == 0


def test_runtime_counters_from_tts_metrics(tmp_path):
    fake = FakeTTS()
    fake.stats = {"requests": 3, "stages": {
        "in_flight": 2, "queues": {"frontend": 1, "ar_waiting": 2, "dit": 0},
        "shapes": {"calls": 5, "hits": 4, "fallbacks": 1, "stages": {
            "dit/stream": {"calls": 3, "hits": 3, "fallbacks": 0, "waste": {"samples": [1.0, 1.25, 1.5]}},
            "hift/offline": {"calls": 2, "hits": 1, "fallbacks": 1, "waste": {"samples": [1.0]}}}}}}
    _, client = fake_client(tmp_path, fake)
    with client:
        wait_ready(client, 5)
        m = parse_metrics(client.get("/metrics").text)
    assert m['cosytrt_bucket_hits_total{stage="dit/stream"}'] == 3
    assert m['cosytrt_bucket_hits_total{stage="hift/offline"}'] == 1
    assert m['cosytrt_bucket_pads_total{stage="dit/stream"}'] == 2
    assert m['cosytrt_eager_fallbacks_total{stage="hift/offline"}'] == 1
    assert m["cosytrt_runtime_requests_in_flight"] == 2 and m["cosytrt_queue_depth"] == 3
    assert m['cosytrt_runtime_queue_depth{queue="ar_waiting"}'] == 2
    assert m['cosytrt_dit_frames_total{kind="computed"}'] == 0 and m["cosytrt_flow_cache_fallbacks_total"] == 0
    assert not any(k.startswith("cosytrt_flow_cache_bytes") for k in m)  # no pool in these stats
    assert not any(k.startswith("cosytrt_ar_") for k in m)  # no AR counters in these stats
    fake.stats = {"bucket_hits": 7, "scheduler": {"eager_fallbacks": {"llm": 2}, "busy_s": {"ar": 1.5, "dit": 2.0},
                                                  "dit": {"frames_computed": 900, "frames_reused": 400,
                                                          "cache_fallbacks": 3,
                                                          "flow_cache": {"bytes_used": 5e8, "budget_bytes": 4e9,
                                                                         "peak_bytes": 3.9e9, "pages": 44}},
                                                  "host_s": {"ar": {"wall_s": 3.0, "cpu_s": 1.25}},
                                                  "ar": {"decode_steps": 100, "decode_rows": 750, "pace_wait_s": 2.5,
                                                         "first_audio_hold_s": 0.0, "multi_step_calls": 20}}}
    with client:
        m = parse_metrics(client.get("/metrics").text)
    assert m["cosytrt_bucket_hits_total"] == 7 and m["cosytrt_bucket_pads_total"] == 0
    assert m['cosytrt_eager_fallbacks_total{stage="llm"}'] == 2
    assert m['cosytrt_dit_frames_total{kind="computed"}'] == 900 and m['cosytrt_dit_frames_total{kind="reused"}'] == 400
    assert m["cosytrt_flow_cache_fallbacks_total"] == 3
    assert m['cosytrt_flow_cache_bytes{kind="used"}'] == 5e8 and m['cosytrt_flow_cache_bytes{kind="peak"}'] == 3.9e9
    assert m['cosytrt_flow_cache_bytes{kind="budget"}'] == 4e9
    assert m['cosytrt_stage_busy_seconds_total{stage="dit"}'] == 2.0
    assert m['cosytrt_ar_decode_total{kind="steps"}'] == 100 and m['cosytrt_ar_decode_total{kind="rows"}'] == 750
    assert m['cosytrt_ar_wait_seconds_total{kind="pace"}'] == 2.5
    assert m['cosytrt_ar_wait_seconds_total{kind="first_audio_hold"}'] == 0
    assert m['cosytrt_ar_decode_total{kind="multi_step_calls"}'] == 20
    assert m['cosytrt_stage_host_seconds_total{stage="ar",kind="wall"}'] == 3.0
    assert m['cosytrt_stage_host_seconds_total{stage="ar",kind="cpu"}'] == 1.25
    assert not any(k.startswith("cosytrt_gpu_memory_bytes") for k in m)  # no CUDA in this process


def test_internal_error_is_openai_shaped_500(tmp_path):
    fake = FakeTTS()
    app, client = fake_client(tmp_path, fake)
    with TestClient(app, raise_server_exceptions=False) as client:
        wait_ready(client, 5)

        def broken(text, **kw):
            raise RuntimeError("engine exploded")

        fake.submit = broken
        err = assert_error(client.post("/v1/audio/speech", json={"model": "x", "input": "hi", "voice": "default"}), 500,
                           code="internal_error")
        assert err["type"] == "server_error" and "RuntimeError: engine exploded" in err["message"]
        assert in_flight(app) == 0
        assert speech_count(parse_metrics(client.get("/metrics").text), 500) == 1


def test_voice_store_stays_inside_its_folder(tmp_path, tts):
    from cosytrt.engines.errors import InputError
    from cosytrt.runtime.models.frontend import save_speaker

    store = VoiceStore(str(tmp_path / "voices"), tts.pipeline.default_speaker)
    outside = tmp_path / "outside.safetensors"
    spk = tts.pipeline.default_speaker
    save_speaker(str(outside), spk.features, spk.prompt_text)
    os.symlink(outside, tmp_path / "voices" / "evil.safetensors")
    with pytest.raises(InputError, match="outside the voices folder"):
        store.get("evil")
    for bad in ("..", "../outside", "/etc/passwd", "a/b", "", "x" * 65, "UP"):
        with pytest.raises(InputError, match="invalid"):
            store.path(bad)
    assert store.get("alloy") is spk and store.get("default") is spk
    assert [v.id for v in store.list()] == ["default"]  # the symlink is not listed as a voice


def test_settings_validation():
    from cosytrt.engines.errors import InputError

    with pytest.raises(InputError, match="max_in_flight"):
        ServerSettings(max_in_flight=0)
    with pytest.raises(InputError, match="queue_timeout_s"):
        ServerSettings(queue_timeout_s=0)
    assert ServerSettings().host == "127.0.0.1"
    assert ServerSettings(compile=True, compile_scope="ar").compile_scope == "ar"  # the LM only (graphs_ar)
    with pytest.raises(InputError, match="compile_scope must be one of whole, regional, ar"):
        ServerSettings(compile=True, compile_scope="layers")
    with pytest.raises(InputError, match="compile_scope needs compile"):
        ServerSettings(compile_scope="ar")
    # serve --scheduler NAME=VALUE: SchedulerConfig fields by name and type
    got = ServerSettings(scheduler=["ar_graph_sampling=1", "dit_max_wait_ms=2", "flow_prefix_cache=false",
                                    "ar_max_len=1024"]).scheduler
    assert got == {"ar_graph_sampling": True, "dit_max_wait_ms": 2.0, "flow_prefix_cache": False, "ar_max_len": 1024}
    for bad, msg in ((["nope=1"], "'nope' is not a boolean, numeric or string"), (["max_in_flight=3"], "--max-in-flight"),
                     (["ar_graph_sampling=yes"], "not a valid bool"), (["ar_max_batch=x"], "not a valid int"),
                     (["ar_graph_batches=1"], "not a boolean, numeric or string"), (["on_full=reject"], "--max-queue"), (["ar_max_batch=0"], "ar_max_batch")):
        with pytest.raises(InputError, match=msg):
            ServerSettings(scheduler=bad)


def test_serve_scheduler_flag_reaches_the_settings_and_refuses_bad_names(monkeypatch, capsys):
    """`trtbuild serve --scheduler NAME=VALUE` (repeatable) ends in ServerSettings.scheduler, which `serve` passes to
    the SchedulerConfig; a bad name stops the start with exit 2 and the reason."""
    from cosytrt.runtime import serving
    from cosytrt.tools import serve as serve_cmd
    from cosytrt.tools.trtbuild import main

    seen = []
    monkeypatch.setattr(serving, "serve", lambda settings: seen.append(settings) or 0)
    monkeypatch.setattr(serve_cmd, "_print_model_hashes", lambda model: None)
    assert main(["serve", "--scheduler", "ar_graph_sampling=1", "--scheduler", "hift_own_stream=1"]) == 0
    assert seen[0].scheduler == {"ar_graph_sampling": True, "hift_own_stream": True}
    assert main(["serve", "--scheduler", "nope=1"]) == 2
    assert "'nope' is not a boolean, numeric or string SchedulerConfig field" in capsys.readouterr().err




def test_interpreter_lock_probe_runs_with_the_server(tmp_path):
    """/metrics' cosytrt_interpreter_lock_wait_seconds: the lock probe starts with the app and stops at shutdown."""
    from cosytrt.runtime.serving.metrics import LockProbe

    app, client = fake_client(tmp_path, FakeTTS())
    with client:
        wait_ready(client, 5)
        probe = app.state.server.metrics.lock_probe
        deadline = time.monotonic() + 5
        while parse_metrics(client.get("/metrics").text).get("cosytrt_interpreter_lock_wait_seconds_count", 0) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert probe._thread is not None and probe._thread.is_alive()
    assert probe._thread is None  # stopped with the app
    seen = []
    with LockProbe(seen.append, interval_s=0.002) as again:
        time.sleep(0.03)
    first = len(seen)
    again.start()  # a stopped probe starts again
    time.sleep(0.03)
    again.stop()
    assert first >= 2 and len(seen) >= first + 2 and min(seen) >= 0.0


def test_inter_chunk_gaps_are_observed_per_gap():
    """/metrics' cosytrt_inter_chunk_seconds: one observation per gap between a streaming request's chunks."""
    from types import SimpleNamespace

    from cosytrt.runtime.serving.metrics import ServerMetrics

    sm = ServerMetrics()
    sm.finish("ok", SimpleNamespace(inter_chunk=[0.1, 0.4, float("nan")], audio_seconds=2.0, tokens=50))
    sm.finish("error", SimpleNamespace(inter_chunk=[9.0]))  # failed requests are not observed
    m = parse_metrics(sm.render(in_flight=0, queued=0, ready=True, runtime_stats=None))
    assert m["cosytrt_inter_chunk_seconds_count"] == 2
    assert m['cosytrt_inter_chunk_seconds_bucket{le="0.25"}'] == 1


def test_serve_builds_the_scheduler_config_with_the_overrides(monkeypatch):
    """`serve()` (no TTS given) loads one whose SchedulerConfig has the admission flags and `settings.scheduler`."""
    import uvicorn

    from cosytrt.runtime import tts as tts_mod
    from cosytrt.runtime.serving import app as app_mod

    loaded = []

    def fake_load(**kw):
        loaded.append(kw)
        return FakeTTS()

    class NoServer:
        def __init__(self, config):
            pass

        def run(self):
            return None

    monkeypatch.setattr(tts_mod.TTS, "load", staticmethod(fake_load))
    monkeypatch.setattr(uvicorn, "Server", NoServer)
    settings = ServerSettings(max_in_flight=5, scheduler=["ar_graph_sampling=1", "dit_max_wait_ms=2"])
    assert app_mod.serve(settings) == 0
    cfg = loaded[0]["scheduler"]
    assert (cfg.max_in_flight, cfg.ar_graph_sampling, cfg.dit_max_wait_ms) == (5, True, 2.0)


def test_cuda_memory_gauges_when_cuda_is_initialised(monkeypatch):
    """/metrics reads the CUDA allocator at scrape time only in a process that initialised CUDA: reserved /
    allocated bytes, allocation retries and OOMs."""
    import torch

    from cosytrt.runtime.serving.metrics import ServerMetrics, cuda_memory

    assert cuda_memory() is None or torch.cuda.is_initialized()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: {"num_alloc_retries": 4, "num_ooms": 1})
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 7e10)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 4.4e10)
    assert cuda_memory() == {"reserved": 7e10, "allocated": 4.4e10, "retries": 4.0, "ooms": 1.0}
    text = ServerMetrics().render(in_flight=0, queued=0, ready=True, runtime_stats={})
    m = parse_metrics(text)
    assert m['cosytrt_gpu_memory_bytes{kind="reserved"}'] == 7e10 and m["cosytrt_cuda_ooms_total"] == 1
    assert m["cosytrt_cuda_alloc_retries_total"] == 4
