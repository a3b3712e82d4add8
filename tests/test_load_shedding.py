"""Load shedding (`SchedulerConfig.shed_lag_s`): while a live stream is further behind its listener than the limit —
an underrun that deep, or a first audio awaited that long — a new request is refused at once with `OverloadedError`
(HTTP 503 "overloaded" with Retry-After), counted; a later segment under a lease or a conversation's next sentence
(`after`) is never shed; the lag is in stats and /metrics; the open-loop bench counts shed requests apart."""
from __future__ import annotations

import time

import pytest

from cosytrt.engines.errors import InputError, RejectedError
from cosytrt.runtime.scheduling.admission import OverloadedError
from cosytrt.runtime.scheduling.config import SchedulerConfig
from cosytrt.runtime.scheduling.lifecycle import Lifecycle
from cosytrt.runtime.stages.request import Request


def _req(stream: bool = True) -> Request:
    return Request(text="Shed me, maybe.", stream=stream)


def test_lag_of_a_first_audio_waited_for_and_of_an_underrun():
    lc = Lifecycle(SchedulerConfig())
    assert lc.worst_stream_lag() == 0.0
    r = lc.admit(_req())
    now = time.perf_counter()
    r.metrics.t_submit = now - 0.8               # its listener has waited 0.8 s for the first audio
    assert lc.worst_stream_lag(now) == pytest.approx(0.8)
    r.metrics.ttfa = 0.3                          # first chunk 0.3 s after submit, 0.2 s of audio so far:
    r.metrics.audio_seconds = 0.2                 # played from 0.5 s ago, so 0.3 s behind
    assert lc.worst_stream_lag(now) == pytest.approx(0.3)
    r.metrics.audio_seconds = 2.0                 # ahead of its listener: not behind at all
    assert lc.worst_stream_lag(now) == 0.0
    off = lc.admit(_req(stream=False))            # an offline request is not a listener waiting
    off.metrics.t_submit = now - 10.0
    assert lc.worst_stream_lag(now) == 0.0


def test_new_requests_are_shed_while_a_stream_is_behind():
    lc = Lifecycle(SchedulerConfig(shed_lag_s=0.5))
    r = lc.admit(_req())
    r.metrics.t_submit = time.perf_counter() - 2.0   # waited 2 s for its first audio
    with pytest.raises(OverloadedError, match=r"overloaded: a stream in flight is 2\.\d\d s behind .*shed_lag_s 0\.5"):
        lc.admit(_req())
    with pytest.raises(OverloadedError):
        lc.admit(_req(stream=False))                 # offline requests too: they use the same stages
    assert lc.admission.counts["shed"] == 2 and lc.counts["rejected"] == 2 and lc.in_flight == 1
    assert issubclass(OverloadedError, RejectedError)
    # a later segment of an admitted request (its ticket) and a conversation's next sentence are not shed
    ticket = lc.admission.admit("segment", shed=False)   # (the server got it before the stream fell behind)
    seg = lc.admit(_req(), lease=ticket)
    nxt = lc.admit(_req(), after=r.handle)
    assert lc.in_flight == 3 and lc.admission.counts["shed"] == 2
    # once the stream has its audio (not behind any more), new requests are admitted again
    for x in (r, seg, nxt):
        x.metrics.ttfa, x.metrics.audio_seconds = 0.1, 60.0
    lc.admit(_req())
    ticket.release()
    # off (0, the default): never shed
    lc0 = Lifecycle(SchedulerConfig())
    lc0.admit(_req()).metrics.t_submit = time.perf_counter() - 60.0
    lc0.admit(_req())
    assert lc0.admission.counts["shed"] == 0 and lc0.admission.overload is None


def test_shed_lag_must_be_a_finite_number_not_below_zero():
    for bad in (-1.0, float("nan"), float("inf"), "1", True):
        with pytest.raises(InputError, match="shed_lag_s"):
            SchedulerConfig(shed_lag_s=bad)


def test_scheduler_sheds_and_reports_the_lag(one_torch_thread, tiny_tts):
    """Through a real scheduler (tiny model): with a stream held behind (its metrics aged), submit refuses at once;
    stats() carries `shed` and `stream_lag_s`."""
    from cosytrt.runtime.scheduling.scheduler import Scheduler
    from cosytrt.runtime.tts import make_request

    sched = Scheduler(tiny_tts.pipeline, SchedulerConfig(shed_lag_s=0.25))
    try:
        h = sched.submit(make_request("A stream that falls behind.", stream=True, seed=1, max_tokens=40))
        h.metrics.t_submit -= 5.0          # as if it had waited 5 s (it is behind whatever it has delivered)
        with pytest.raises(OverloadedError):
            sched.submit(make_request("Refused.", seed=2, max_tokens=10))
        st = sched.stats()
        assert st["shed"] == 1 and st["stream_lag_s"] > 0.25
        h.result(timeout=120)
        assert sched.stats()["stream_lag_s"] == 0.0     # nothing live
        sched.submit(make_request("Admitted again.", seed=3, max_tokens=10)).result(timeout=120)
    finally:
        sched.close()


def test_the_server_path_is_shed_at_its_ticket(tiny_tts):
    """The HTTP server takes its ticket from the runtime's admission control first (then submits under it): that
    ticket is where it is shed — `admit_async` asks the hook; a conversation's next sentence (`shed=False`) and
    `try_admit` (a session's look-ahead, free slots only) are not shed."""
    import asyncio

    from cosytrt.runtime.scheduling.admission import AdmissionControl

    ac = AdmissionControl(4)
    reason = ["the runtime is overloaded: test"]
    ac.overload = lambda: reason[0]

    async def main():
        with pytest.raises(OverloadedError, match="speech request: the runtime is overloaded: test"):
            await ac.admit_async("speech request")
        t = await ac.admit_async("websocket sentence", shed=False)
        t.release()
        reason[0] = None
        (await ac.admit_async("speech request")).release()

    asyncio.run(main())
    reason[0] = "busy"
    with pytest.raises(OverloadedError):
        ac.admit("x")
    t = ac.try_admit()
    assert t is not None and ac.counts["shed"] == 2 and ac.snapshot()["shed"] == 2
    t.release()


def test_server_maps_overload_to_503_with_retry_after():
    from cosytrt.runtime.serving.errors import from_runtime_error

    e = from_runtime_error(OverloadedError("request x: the runtime is overloaded"))
    assert e.status == 503 and e.code == "overloaded" and e.headers["Retry-After"] == "2"


def test_metrics_expose_lag_and_shed():
    from cosytrt.runtime.serving.metrics import runtime_view

    v = runtime_view({"scheduler": {"in_flight": 3, "queues": {}, "shed": 4, "stream_lag_s": 1.25}})
    assert v["shed"] == 4 and v["stream_lag_s"] == 1.25


def test_bench_counts_shed_requests_apart():
    """The open-loop bench: a request refused by shedding is `shed` (no TTFA censoring, no audio owed), not failed;
    the saturation rule compares the delivered audio with what the admitted requests were owed."""
    from cosytrt.tools.bench.open_loop import _record
    from cosytrt.tools.bench.playback import SHED, saturated, summarize
    from cosytrt.tools.bench.workload import Arrival

    a = Arrival(index=0, t=1.0, tokens=100, stream=True, seed=0)     # 4 s of audio
    rec = _record(a, None, 0.0, 24000, "OverloadedError: the runtime is overloaded", False)
    assert rec.status == SHED
    s = summarize([rec], duration_s=10.0, end_t=12.0)
    assert s["shed"] == 1 and s["shed_audio_s"] == 4.0 and s["failed"] == 0 and s["ttfa"]["n"] == 0
    cell = {**s, "duration_s": 10.0}
    assert saturated(cell) is None


def test_http_speech_request_is_shed_with_503(one_torch_thread, tiny_tts, tmp_path):
    """The real server over a TTS whose scheduler sheds: while a stream in flight is behind, POST /v1/audio/speech
    answers 503 `overloaded` (OpenAI error shape, Retry-After), /metrics shows the lag and the refusal; once nothing
    is behind it serves again."""
    from dataclasses import replace

    from fastapi.testclient import TestClient
    from server_helpers import assert_error, parse_metrics, wait_ready

    from cosytrt.runtime.serving.app import ServerSettings, create_app
    from cosytrt.runtime.tts import make_request

    tts = tiny_tts
    base = tts.scheduler_config
    tts.reconfigure(replace(base, shed_lag_s=0.25))
    try:
        app = create_app(tts, ServerSettings(voices_dir=str(tmp_path / "v"), allowed_hosts=["testserver"],
                                             warmup=False))
        body = {"model": "x", "input": "Hi.", "voice": "default", "force_tokens": 2, "response_format": "pcm"}
        with TestClient(app) as c:
            wait_ready(c)
            h = tts.submit(make_request("Behind.", stream=True, seed=1, max_tokens=40))
            h.metrics.t_submit -= 5.0
            r = c.post("/v1/audio/speech", json=body)
            err = assert_error(r, 503, code="overloaded")
            assert err["type"] == "server_error" and "behind its listener" in err["message"]
            assert r.headers["retry-after"] == "2"
            m = parse_metrics(c.get("/metrics").text)
            assert m["cosytrt_requests_shed_total"] == 1 and m["cosytrt_stream_lag_seconds"] > 0.25
            h.result(timeout=120)
            r = c.post("/v1/audio/speech", json=body)
            assert r.status_code == 200 and len(r.content) > 0
    finally:
        tts.reconfigure(base)
