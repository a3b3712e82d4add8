"""runtime/cluster.py + runtime/cluster_config.py: the Ray Serve scale-out (CPU, tiny model).

Without Ray: the config (the shipped Triton-layout example, errors naming the key), the stage engines in process
(AR stage -> token2wav stage give the single-process runtime's audio), and `trtbuild serve --cluster ray` exiting 2
naming the package. With Ray (skipped otherwise): a local cluster of 2 frontend, 1 AR and 2 token2wav replicas behind
the HTTP ingress: same audio as the single-process runtime for the same seeds, streaming chunks in order, errors
mapped as by the single-process server, and killing a token2wav replica under load fails exactly the requests it
held while later requests succeed once Ray has replaced it."""
from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cosytrt.runtime.cluster.config import ClusterConfig, load_cluster_config
from cosytrt.engines.errors import InputError

TOL = 2e-3                    # golden HiFT wav tolerance (batched DiT / HiFT rows are not bit-exact)
LSB = 1.0 / 32767             # 16-bit PCM quantisation
TEXT = "Hello there, how are you today?"
SAMPLES_PER_TOKEN = 960       # 24 kHz, 25 tokens / s

CLUSTER = {
    "model": "tiny",
    "server": {"warmup_tokens": 4, "max_in_flight": 16},
    "stages": {
        "frontend": {"replicas": 2, "num_cpus": 0.1, "torch_threads": 1},
        "ar": {"replicas": 1, "num_cpus": 0.1, "torch_threads": 1, "scheduler": {"ar_max_batch": 8}},
        "token2wav": {"replicas": 2, "num_cpus": 0.1, "torch_threads": 1,
                      "scheduler": {"dit_max_wait_ms": 10, "hift_max_wait_ms": 5}},
        "ingress": {"num_cpus": 0.1},
    },
}


# ------------------------------------------------------------------------------------------------ config (no Ray)

def test_example_config_is_the_triton_layout():
    cfg = load_cluster_config("cluster-example")  # the shipped profiles/cluster-example.yaml
    assert cfg.ar.replicas == 1 and cfg.ar.num_gpus == 1 and cfg.ar.device == "cuda"
    t2w = cfg.token2wav
    assert t2w.num_gpus == 1 and t2w.device == "cuda" and t2w.engines
    assert t2w.autoscaling["max_replicas"] >= 2 and t2w.autoscaling["initial_replicas"] >= 2
    assert cfg.frontend.device == "cpu" and cfg.frontend.num_gpus == 0
    opts = t2w.deployment_options(48)
    assert "num_replicas" not in opts and opts["autoscaling_config"]["max_replicas"] == t2w.autoscaling["max_replicas"]
    assert opts["ray_actor_options"] == {"num_cpus": 4.0, "num_gpus": 1.0}
    assert cfg.ar.deployment_options(64) == {"ray_actor_options": {"num_cpus": 4.0, "num_gpus": 1.0},
                                             "max_ongoing_requests": 128, "num_replicas": 1}
    half = ClusterConfig.from_dict({"stages": {"token2wav": {"replicas": 6, "num_gpus": 0.5}}})
    assert half.token2wav.num_gpus == 0.5 and half.token2wav.device == "cuda" and half.token2wav.replicas == 6
    assert ClusterConfig.from_dict({}).token2wav.device == "cpu"


@pytest.mark.parametrize("data, match", [
    ({"stages": {"token2wav": {"replica": 2}}}, r"stages\.token2wav: unknown key 'replica'"),
    ({"stages": {"ar": {"replicas": 1, "autoscaling": {"max_replicas": 2}}}}, "not both"),
    ({"stages": {"ar": {"engines": "/e"}}}, r"stages\.ar\.engines: .*only the token2wav stage"),
    ({"stages": {"token2wav": {"device": "cuda"}}}, r"stages\.token2wav\.device: 'cuda' needs num_gpus > 0"),
    ({"stages": {"token2wav": {"num_gpus": 2}}}, r"num_gpus: must be at most 1"),
    ({"stages": {"frontend": {"num_gpus": 0.5}}}, r"stages\.frontend\.num_gpus: the frontend stage runs on CPU"),
    ({"stages": {"ar": {"scheduler": {"ar_max_bach": 4}}}}, r"stages\.ar\.scheduler: unknown key 'ar_max_bach'"),
    ({"stages": {"ar": {"scheduler": {"ar_max_batch": 0}}}}, r"stages\.ar\.scheduler: .*ar_max_batch"),
    ({"stages": {"token2wav": {"autoscaling": {"min_replicas": 3, "max_replicas": 2}}}}, "min_replicas 3 > max"),
    ({"stages": {"ar": {"dtype": "fp8"}}}, r"stages\.ar\.dtype: must be one of"),
    ({"server": {"max_in_flight": 0}}, r"server: .*max_in_flight"),
    ({"stage": {}}, "top level: unknown key 'stage'"),
])
def test_config_errors_name_the_key(data, match):
    with pytest.raises(InputError, match=match):
        ClusterConfig.from_dict(data, "c.yaml")


def test_config_file_errors(tmp_path):
    with pytest.raises(InputError, match="cluster config file not found"):
        load_cluster_config(str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages: [1, 2\n")
    with pytest.raises(InputError, match="bad.yaml: not valid YAML"):
        load_cluster_config(str(bad))


# ------------------------------------------------------------------------------------------------ CLI (no Ray)

def test_cluster_flag_without_ray_exits_2_naming_the_package(monkeypatch, capsys):
    import cosytrt.runtime.serving as server
    from cosytrt.tools.trtbuild import main

    monkeypatch.setattr(server, "missing_serve_packages", lambda: [])  # only Ray is missing here
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    assert main(["serve", "--cluster", "ray", "--config", "cluster-example"]) == 2
    err = capsys.readouterr().err
    assert "--cluster ray needs the Python package ray[serve]" in err and "cosytrt[cluster]" in err
    assert main(["serve", "--config", "x.yaml"]) == 2  # --config alone is a mistake, not ignored
    assert "needs --cluster ray" in capsys.readouterr().err


def test_modules_import_without_ray():
    code = ("import sys\n"
            "sys.modules['ray'] = None\n"
            "import cosytrt.runtime.cluster.app, cosytrt.runtime.cluster.config, cosytrt.runtime.serving\n"
            "import cosytrt.tools.serve, cosytrt.tools.trtbuild\n"
            "from cosytrt.runtime.cluster.app import missing_cluster_packages\n"
            "assert missing_cluster_packages() == ['ray[serve]']\n"
            "assert not [m for m in sys.modules if m.startswith('ray.')]\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr


def test_a_zero_shot_request_passes_to_the_later_stages():
    """The ingress hands token2wav the request without its voice (`Request.without_voice`): a zero-shot request
    (prompt audio + transcript + rate) must survive that (it raised "prompt_text describes prompt audio" when only
    the audio was dropped), keeping what the stages read; and the AR's inputs drop the flow prompt's mel."""
    from cosytrt.runtime.stages.request import default_voice_wav, prepare_inputs
    from cosytrt.runtime.cluster.loading import load_frontend
    from cosytrt.runtime.tts import make_request

    req = make_request(TEXT, prompt_wav=default_voice_wav(16000, 1.0), prompt_sr=16000, prompt_text="A voice.",
                       stream=True, seed=7)
    slim = req.without_voice()
    assert slim.prompt_wav is None and slim.prompt_text is None and slim.prompt_sr is None and slim.speaker is None
    assert (slim.request_id, slim.stream, slim.sampling, slim.text) == (req.request_id, True, req.sampling, TEXT)
    frontend, speaker, _ = load_frontend("tiny")
    inputs = prepare_inputs(frontend, req, speaker)
    lm = inputs.lm_only()
    assert lm.flow_prompt_mel.numel() == 0 and lm.embedding.numel() == 0
    assert lm.flow_prompt_tokens.numel() == inputs.flow_prompt_tokens.numel() > 0
    assert torch.equal(lm.text_ids, inputs.text_ids)


# ------------------------------------------------------------------------------------------------ stages in process

@pytest.fixture(scope="module")
def reference():
    """The single-process runtime (one torch thread, as the replicas use)."""
    from cosytrt.runtime.scheduling.scheduler import SchedulerConfig
    from cosytrt.runtime.tts import TTS

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tts = TTS.load("tiny", scheduler=SchedulerConfig(dit_max_wait_ms=10))
    cache: dict = {}

    def chunks(text=TEXT, stream=False, **opts):
        key = (text, stream, tuple(sorted(opts.items())))
        if key not in cache:
            h = tts.submit(text, stream=stream, speaker=tts.pipeline.default_speaker, **opts)
            cache[key] = (list(h.chunks(timeout=120)), h.metrics.tokens)
        return cache[key]

    yield SimpleNamespace(tts=tts, chunks=chunks)
    tts.close()
    torch.set_num_threads(threads)


def close(a, b) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a - b).max())


def test_stage_engines_match_single_process(reference):
    """ARStage -> Token2WavStage (the replicas' engines), several requests at once: same chunks as the runtime."""
    from cosytrt.runtime.cluster.app import ARStage, Token2WavStage, load_frontend, load_stage_pipeline
    from cosytrt.runtime.cluster.config import StageConfig
    from cosytrt.runtime.stages.request import prepare_inputs
    from cosytrt.runtime.scheduling.scheduler import SchedulerConfig
    from cosytrt.runtime.tts import make_request

    frontend, speaker, sr = load_frontend("tiny")
    assert sr == 24000
    ar_pipe = load_stage_pipeline("tiny", StageConfig(), ("llm",))
    t2w_pipe = load_stage_pipeline("tiny", StageConfig(), ("flow", "hift"))
    assert next(ar_pipe.models.flow.parameters()).is_meta and next(t2w_pipe.models.llm.parameters()).is_meta
    ar = ARStage(ar_pipe, SchedulerConfig(ar_max_batch=4))
    t2w = Token2WavStage(t2w_pipe, SchedulerConfig(dit_max_wait_ms=10))
    cases = [dict(seed=1, stream=True, force_tokens=90), dict(seed=2), dict(seed=3, stream=True),
             dict(seed=4, max_tokens=20)]
    flushes, out = {}, {}

    def run(i, kw):
        req = make_request(TEXT, speaker=speaker, **kw)
        inputs = prepare_inputs(frontend, req, speaker)
        audio = t2w.open(req, inputs)
        tokens = ar.submit_inputs(req, inputs)
        flushes[i] = []
        for batch in tokens.chunks(timeout=120):
            flushes[i].append(batch.size)
            t2w.feed(audio, batch)
        t2w.feed(audio, None, final=True)
        out[i] = (list(audio.chunks(timeout=120)), audio.metrics.tokens)

    try:
        threads = [threading.Thread(target=run, args=(i, kw)) for i, kw in enumerate(cases)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for i, kw in enumerate(cases):
            want, tokens = reference.chunks(**kw)
            got, got_tokens = out[i]
            assert got_tokens == tokens and len(got) == len(want), (kw, [c.size for c in got], [c.size for c in want])
            for a, b in zip(got, want):
                assert close(a, b) <= TOL
        # tokens leave the AR at the hop points of streaming (28 = 25 + 3 look-ahead, then 50), once when offline
        assert flushes[0] == [28, 50, 12] and len(flushes[1]) == 1
        assert ar.stats()["ar"]["max_decode_batch"] >= 2 and ar.stats()["in_flight"] == 0
        assert t2w.stats()["in_flight"] == 0
    finally:
        ar.close()
        t2w.close()


# ------------------------------------------------------------------------------------------------ a local Ray cluster

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(reference, tmp_path_factory):
    ray = pytest.importorskip("ray")
    serve = pytest.importorskip("ray.serve")
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from cosytrt.runtime.cluster.app import build_app

    port = _free_port()
    cfg = json.loads(json.dumps(CLUSTER))
    cfg["server"]["voices_dir"] = str(tmp_path_factory.mktemp("cluster_voices"))
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"COSYTRT_CACHE": os.environ["COSYTRT_CACHE"]}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        t0 = time.monotonic()
        serve.run(build_app(ClusterConfig.from_dict(cfg)), name="cosytrt", route_prefix="/")
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
        while client.get("/health").status_code != 200:
            assert time.monotonic() - t0 < 120, client.get("/health").text
            time.sleep(0.1)
        yield SimpleNamespace(client=client, ray=ray, serve=serve,
                              token2wav=serve.get_deployment_handle("Token2Wav", app_name="cosytrt"),
                              ar=serve.get_deployment_handle("AR", app_name="cosytrt"))
        client.close()
    finally:
        serve.shutdown()
        ray.shutdown()


def speech(client, **body):
    return client.post("/v1/audio/speech", json={"model": "cosyvoice3", "input": TEXT, "voice": "default",
                                                 "response_format": "pcm", **body})


def pcm_floats(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32767.0


def test_cluster_audio_matches_single_process(cluster, reference):
    cases = [dict(seed=11), dict(seed=12, force_tokens=60), dict(seed=13, max_tokens=30), dict(seed=14)]
    with ThreadPoolExecutor(len(cases)) as pool:
        responses = list(pool.map(lambda kw: speech(cluster.client, **kw), cases))
    for kw, r in zip(cases, responses):
        assert r.status_code == 200, r.text
        want, tokens = reference.chunks(**kw)
        assert int(r.headers["x-speech-tokens"]) == tokens
        assert close(pcm_floats(r.content), np.concatenate(want)) <= TOL + LSB
    # the ingress is the single-process server app: its routes and metrics are all there
    assert cluster.client.get("/v1/voices").json()["data"][0]["id"] == "default"
    assert "cosytrt_speech_requests_total{outcome=\"ok\"}" in cluster.client.get("/metrics").text


def test_cluster_streaming_chunks_arrive_in_order(cluster, reference):
    """SSE keeps chunk boundaries: every delta is the runtime's chunk with the same index."""
    cases = [dict(seed=21, force_tokens=90), dict(seed=25, force_tokens=60)]

    def stream(kw):
        events = []
        with cluster.client.stream("POST", "/v1/audio/speech", json={
                "model": "cosyvoice3", "input": TEXT, "voice": "default", "response_format": "pcm",
                "stream_format": "sse", **kw}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append((time.perf_counter(), json.loads(line[6:])))
        return events

    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(stream, cases))
    for kw, events in zip(cases, results):
        want, tokens = reference.chunks(stream=True, **kw)
        deltas = [e for _, e in events if e["type"] == "speech.audio.delta"]
        assert events[-1][1]["type"] == "speech.audio.done"
        assert events[-1][1]["usage"]["output_tokens"] == tokens
        assert len(deltas) == len(want) >= 2
        for d, w in zip(deltas, want):
            assert close(pcm_floats(base64.b64decode(d["audio"])), w) <= TOL + LSB
    assert len(results[0]) == 4  # 3 chunks (hops of 28 and 50 tokens, then the rest) + done


def test_cluster_errors_come_back_unwrapped(cluster):
    r = speech(cluster.client, force_tokens=1500)  # prompt + 1500 tokens > the tiny model's noise buffers
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["code"] == "request_too_long" and "noise buffers" in err["message"]
    assert "Traceback" not in err["message"] and "RayTaskError" not in err["message"]
    r = speech(cluster.client, voice="nobody")
    assert r.status_code == 404 and r.json()["error"]["code"] == "voice_not_found"


def test_client_disconnect_cancels_the_request_on_every_stage(cluster):
    before = cluster.ar.stats.remote().result()
    with cluster.client.stream("POST", "/v1/audio/speech", json={
            "model": "cosyvoice3", "input": TEXT, "voice": "default", "response_format": "pcm",
            "stream_format": "sse", "seed": 5, "force_tokens": 1200}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # the first chunk is here; leaving the block drops the connection
    deadline = time.monotonic() + 60
    while True:
        ar = cluster.ar.stats.remote().result()
        t2w = _replicas(cluster.token2wav, 2)
        if ar["in_flight"] == 0 and sum(i["in_flight"] for i in t2w.values()) == 0:
            break
        assert time.monotonic() < deadline, (ar, t2w)
        time.sleep(0.1)
    assert ar["cancelled"] == before["cancelled"] + 1 and ar["completed"] == before["completed"]
    assert ar["ar"]["decode_steps"] - before["ar"]["decode_steps"] < 1000  # stopped long before 1200 tokens


def _replicas(handle, want: int, avoid: str | None = None, timeout: float = 90.0) -> dict:
    """{replica name: info} once `want` distinct live replicas (none named `avoid`) have answered."""
    seen: dict = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            info = handle.info.remote().result(timeout_s=10)
        except Exception:  # noqa: BLE001 - routed to a replica that just died
            time.sleep(0.2)
            continue
        if info["replica"] != avoid:
            seen[info["replica"]] = info
        if len(seen) >= want:
            return seen
    raise AssertionError(f"only saw replicas {sorted(seen)} within {timeout} s")


def test_killing_a_token2wav_replica_fails_only_its_requests(cluster, reference):
    n, force = 4, 800  # long requests (half a minute of audio), so all are in flight when the replica dies
    bodies = [dict(input=f"Long request number {i}.", seed=100 + i, force_tokens=force) for i in range(n)]
    pool = ThreadPoolExecutor(n)
    futures = [pool.submit(speech, cluster.client, **b) for b in bodies]
    deadline = time.monotonic() + 60
    while True:  # wait until the token2wav replicas hold all n requests
        infos = _replicas(cluster.token2wav, 2)
        if sum(i["in_flight"] for i in infos.values()) == n:
            break
        assert time.monotonic() < deadline and not any(f.done() for f in futures), infos
        time.sleep(0.05)
    victim = max(infos.values(), key=lambda i: i["in_flight"])
    held = victim["in_flight"]
    assert held >= 1
    cluster.ray.kill(cluster.ray.get_actor(victim["replica"], namespace="serve"))
    responses = [f.result(timeout=180) for f in futures]
    pool.shutdown()
    failed = [r for r in responses if r.status_code != 200]
    assert len(failed) == held, [r.status_code for r in responses]
    for r in failed:
        assert r.status_code == 500, r.text
        msg = r.json()["error"]["message"]
        assert "ReplicaFailedError" in msg and "token2wav replica running it died" in msg, msg
    for r in responses:
        if r.status_code == 200:
            assert len(r.content) == 2 * force * SAMPLES_PER_TOKEN
    # Ray replaces the replica; the next requests succeed, with the same audio as before
    fresh = _replicas(cluster.token2wav, 2, avoid=victim["replica"], timeout=120)
    assert victim["replica"] not in fresh
    cases = [dict(seed=11), dict(seed=12, force_tokens=60)]
    with ThreadPoolExecutor(len(cases)) as p:
        again = list(p.map(lambda kw: speech(cluster.client, **kw), cases))
    for kw, r in zip(cases, again):
        assert r.status_code == 200, r.text
        assert close(pcm_floats(r.content), np.concatenate(reference.chunks(**kw)[0])) <= TOL + LSB
