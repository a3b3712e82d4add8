"""Reference audio by URL (runtime/serving/fetch.py: off by default, host allow-list, public addresses only, no
redirects, size cap, timeout) against a local HTTP server; and reference decoding stays off the event loop."""
import http.server
import io
import threading

import numpy as np
import pytest
import soundfile as sf

pytest.importorskip("fastapi")
pytest.importorskip("python_multipart")
from server_helpers import FakeTTS, assert_error, fake_client, wait_ready  # noqa: E402

from cosytrt.runtime.serving.errors import APIError  # noqa: E402
from cosytrt.runtime.serving.fetch import fetch_ref_audio, host_allowed, public_address  # noqa: E402


def _wav(seconds=0.5, sr=16000) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, np.full(int(seconds * sr), 0.1, np.float32), sr, format="WAV", subtype="PCM_16")
    return buf.getvalue()


WAV = _wav()
RELEASE = threading.Event()  # the /stall route waits for it


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        if self.path == "/ref.wav":
            self.send_response(200)
            self.send_header("Content-Type", "audio/wav")
            self.send_header("Content-Length", str(len(WAV)))
            self.end_headers()
            self.wfile.write(WAV)
        elif self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "http://169.254.169.254/latest/meta-data/")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path == "/big":
            self.send_response(200)
            self.send_header("Content-Length", str(10 * len(WAV)))
            self.end_headers()
        elif self.path == "/big-chunked":  # no Content-Length: the cap applies while reading
            self.send_response(200)
            self.end_headers()
            self.wfile.write(WAV * 10)
            self.close_connection = True
        elif self.path == "/stall":
            self.send_response(200)
            self.send_header("Content-Length", str(len(WAV)))
            self.end_headers()
            self.wfile.write(WAV[:100])
            self.wfile.flush()
            RELEASE.wait(20)
        else:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()


@pytest.fixture(scope="module")
def origin():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.daemon_threads = True
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    RELEASE.set()
    srv.shutdown()
    srv.server_close()


def _refused(fn, status, code):
    with pytest.raises(APIError) as e:
        fn()
    assert e.value.status == status and e.value.code == code, (e.value.status, e.value.code, e.value.message)
    return e.value.message


def test_address_and_host_rules():
    for ip in ("127.0.0.1", "10.1.2.3", "192.168.0.1", "172.16.0.1", "169.254.169.254", "100.64.0.1", "0.0.0.0",
               "::1", "fe80::1", "fc00::1", "::ffff:127.0.0.1", "224.0.0.1", "192.0.2.1"):
        assert not public_address(ip), ip
    for ip in ("8.8.8.8", "2606:4700:4700::1111"):
        assert public_address(ip), ip
    assert host_allowed("cdn.example.com", ["*.example.com"]) and not host_allowed("example.com", ["*.example.com"])
    assert host_allowed("Example.COM.", ["example.com"]) and not host_allowed("evil-example.com", ["example.com"])
    assert not host_allowed("example.com.evil.org", ["example.com"])


def test_fetch_rules(origin):
    ok = dict(allowed_hosts=["127.0.0.1"], cap=len(WAV), timeout=10, private_ok=True)
    assert fetch_ref_audio(origin + "/ref.wav", **ok) == WAV
    msg = _refused(lambda: fetch_ref_audio(origin + "/ref.wav", **{**ok, "allowed_hosts": None}), 400,
                   "url_not_allowed")
    assert "--ref-audio-hosts" in msg
    _refused(lambda: fetch_ref_audio(origin + "/ref.wav", **{**ok, "allowed_hosts": ["example.com"]}), 400,
             "url_not_allowed")
    msg = _refused(lambda: fetch_ref_audio(origin + "/ref.wav", **{**ok, "private_ok": False}), 400, "url_not_allowed")
    assert "non-public" in msg  # loopback: refused unless the operator says the network is trusted
    _refused(lambda: fetch_ref_audio("ftp://127.0.0.1/ref.wav", **ok), 400, "url_not_allowed")
    _refused(lambda: fetch_ref_audio(origin.replace("http://", "http://user:pw@") + "/ref.wav", **ok), 400,
             "url_not_allowed")
    _refused(lambda: fetch_ref_audio(origin + "/redirect", **ok), 400, "url_redirect")  # never followed
    _refused(lambda: fetch_ref_audio(origin + "/missing", **ok), 400, "ref_audio_unreachable")
    _refused(lambda: fetch_ref_audio(origin + "/big", **ok), 413, "payload_too_large")
    _refused(lambda: fetch_ref_audio(origin + "/big-chunked", **ok), 413, "payload_too_large")
    _refused(lambda: fetch_ref_audio(origin + "/stall", **{**ok, "timeout": 0.3}), 408, "ref_audio_timeout")


def test_dns_lookup_has_a_time_limit(monkeypatch):
    """The resolver has no timeout of its own: a lookup that never answers ends the fetch with a 408 at the fetch's
    time limit instead of holding a decode worker."""
    import socket
    import threading

    never = threading.Event()

    def stuck(*a, **kw):
        never.wait(30)
        raise socket.gaierror("unreachable")

    monkeypatch.setattr(socket, "getaddrinfo", stuck)
    try:
        _refused(lambda: fetch_ref_audio("http://slow.example.com/ref.wav", allowed_hosts=["slow.example.com"],
                                         cap=1000, timeout=0.2), 408, "ref_audio_timeout")
    finally:
        never.set()


def test_speech_with_ref_audio_url(origin, tmp_path):
    fake = FakeTTS()
    got = []
    fake.make_speaker = lambda wav, text, sr: got.append((len(wav), text, sr)) or fake.pipeline.default_speaker
    body = {"model": "x", "input": "Hi.", "ref_audio": origin + "/ref.wav", "ref_text": "Ref.",
            "response_format": "pcm"}
    app, c = fake_client(tmp_path / "a", fake, ref_audio_hosts="127.0.0.1", ref_audio_private_ok=True)
    with c:
        wait_ready(c, 5)
        r = c.post("/v1/audio/speech", json=body)
        assert r.status_code == 200, r.text
        assert got == [(8000, "Ref.", 16000)]
        assert_error(c.post("/v1/audio/speech", json={**body, "ref_audio": origin + "/redirect"}), 400, "ref_audio",
                     "url_redirect")
    app, c = fake_client(tmp_path / "b", fake)  # the default: no URL is fetched
    with c:
        wait_ready(c, 5)
        err = assert_error(c.post("/v1/audio/speech", json=body), 400, "ref_audio", "url_not_allowed")
        assert "--ref-audio-hosts" in err["message"]


# ------------------------------------------------------------------------------------------------ off the loop

@pytest.mark.parametrize("route", ["speech", "voices"])
def test_reference_decoding_runs_off_the_event_loop(tmp_path, route):
    """While a (fake, slow) decode of an upload is in progress, /health still answers: the decode is not on the
    event loop. No timing: the decode waits for the test's signal (at most 20 s, only if the server were broken)."""
    import base64

    fake = FakeTTS()
    fake.make_speaker = lambda wav, text, sr: fake.pipeline.default_speaker
    app, c = fake_client(tmp_path, fake)
    started, release, finished = threading.Event(), threading.Event(), threading.Event()

    def slow_decode(data, param):
        started.set()
        release.wait(20)
        finished.set()
        return np.zeros(16000, np.float32), 16000

    with c:
        wait_ready(c, 5)
        app.state.server.decode = slow_decode
        app.state.server.voices.add = lambda voice_id, speaker: type("Info", (), {"to_dict": lambda self: {
            "id": voice_id}})()  # the fake speaker has no features to save
        results = {}

        def upload():
            if route == "speech":
                results["r"] = c.post("/v1/audio/speech", json={
                    "model": "x", "input": "Hi.", "response_format": "pcm", "ref_text": "Ref.",
                    "ref_audio": "data:audio/wav;base64," + base64.b64encode(WAV).decode()})
            else:
                results["r"] = c.post("/v1/voices", files={"audio": ("v.wav", WAV)}, data={"name": "slow"})

        t = threading.Thread(target=upload)
        t.start()
        assert started.wait(20), "the decode never started"
        health = c.get("/health")  # answered while the decode is still blocked
        assert health.status_code == 200 and not finished.is_set()
        release.set()
        t.join(20)
        assert results["r"].status_code in (200, 201), results["r"].text
