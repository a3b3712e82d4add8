"""One admission control (runtime/scheduling/admission.py): the scheduler admits through it, TTS exposes it, and the
server asks the same object (its refusals -> OpenAI-shaped 429 / 503)."""
import asyncio
import threading
import time

import pytest

from cosytrt.engines.errors import InputError
from cosytrt.runtime.scheduling.admission import AdmissionControl, AdmissionTimeoutError, QueueFullError


def _wait_until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


# ------------------------------------------------------------------------------------------------ the control alone

def test_slots_queue_full_and_release():
    a = AdmissionControl(2, max_waiting=0)
    t1, t2 = a.admit(), a.admit()
    assert a.in_flight == 2
    with pytest.raises(QueueFullError, match="max_in_flight=2"):
        a.admit("req x")
    t1.release()
    t1.release()  # idempotent
    assert a.in_flight == 1
    t3 = a.admit()
    t2.release(), t3.release()
    assert a.snapshot()["in_flight"] == 0 and a.snapshot()["queue_full"] == 1


def test_waiters_are_served_in_order_and_time_out():
    a = AdmissionControl(1, max_waiting=2, timeout_s=30)
    held = a.admit()
    order, tickets = [], {}

    def wait(name):
        tickets[name] = a.admit(name)
        order.append(name)

    threads = []
    for name in ("first", "second"):
        threads.append(threading.Thread(target=wait, args=(name,)))
        threads[-1].start()
        _wait_until(lambda: a.waiting == len(threads))
    with pytest.raises(QueueFullError):  # two waiting already
        a.admit("third")
    held.release()
    _wait_until(lambda: order == ["first"])
    assert a.in_flight == 1 and a.waiting == 1
    tickets["first"].release()
    _wait_until(lambda: order == ["first", "second"])
    for t in threads:
        t.join(5)
    with pytest.raises(AdmissionTimeoutError):
        a.admit("late", timeout=0.05)  # "second" still holds the slot
    assert a.waiting == 0 and a.snapshot()["timed_out"] == 1
    tickets["second"].release()


def test_reject_mode_and_configure():
    a = AdmissionControl(1, on_full="reject")
    t = a.admit()
    with pytest.raises(QueueFullError):
        a.admit()
    before = a.configure(max_in_flight=2, on_full="wait")
    assert before["max_in_flight"] == 1 and before["on_full"] == "reject"
    t2 = a.admit()  # the larger limit admits at once
    with pytest.raises(InputError):
        a.configure(max_in_flight=0)
    t.release(), t2.release()


def test_async_waiter_cancelled_leaves_the_queue():
    a = AdmissionControl(1, timeout_s=30)

    async def main():
        held = await a.admit_async()
        waiter = asyncio.ensure_future(a.admit_async("waiter"))
        while a.waiting < 1:
            await asyncio.sleep(0.001)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert a.waiting == 0
        got = asyncio.ensure_future(a.admit_async("next"))
        while a.waiting < 1:
            await asyncio.sleep(0.001)
        held.release()  # handed straight to the waiting coroutine
        ticket = await asyncio.wait_for(got, 5)
        assert a.in_flight == 1 and ticket.waited >= 0
        ticket.release()

    asyncio.run(main())
    assert a.in_flight == 0


# ------------------------------------------------------------------------------------------------ scheduler / TTS

def test_tts_scheduler_admits_through_tts_admission(tiny_tts):
    tts = tiny_tts
    assert tts.scheduler.admission is tts.admission
    spk = tts.pipeline.default_speaker
    before = tts.admission.configure(max_in_flight=1, max_waiting=0)
    try:
        ticket = tts.admission.admit("held by a caller")
        with pytest.raises(QueueFullError):  # the only slot is held: a plain submit is refused
            tts.submit("Hello.", seed=0, force_tokens=2, speaker=spk)
        # under the caller's ticket, requests take no slot of their own
        handles = [tts.submit("Hello.", seed=0, force_tokens=2, speaker=spk, lease=ticket) for _ in range(2)]
        assert all(h.result(timeout=60).size > 0 for h in handles)
        assert tts.admission.in_flight == 1
        ticket.release()
        with pytest.raises(InputError, match="lease"):
            tts.submit("Hello.", force_tokens=2, speaker=spk, lease=ticket)  # released
        assert tts.synthesize("Hello.", seed=0, force_tokens=2, speaker=spk).size > 0
        st = tts.scheduler.stats()
        assert st["admission"]["in_flight"] == 0 and st["admission"]["queue_full"] >= 1 and st["rejected"] >= 1
    finally:
        tts.admission.configure(**before)


# ------------------------------------------------------------------------------------------------ the server asks it

fastapi = pytest.importorskip("fastapi")
pytest.importorskip("python_multipart")


def test_server_asks_the_runtime_admission(tiny_tts, tmp_path):
    from fastapi.testclient import TestClient
    from server_helpers import assert_error, parse_metrics, wait_ready

    from cosytrt.runtime.serving.app import ServerSettings, create_app

    tts = tiny_tts
    limits = tts.admission.limits
    app = create_app(tts, ServerSettings(voices_dir=str(tmp_path / "v"), allowed_hosts=["testserver"], warmup=False,
                                         max_in_flight=1, max_queue=0, queue_timeout_s=0.3))
    body = {"model": "x", "input": "Hi.", "voice": "default", "force_tokens": 2, "response_format": "pcm"}
    with TestClient(app) as c:
        wait_ready(c)
        assert app.state.server.admission is tts.admission  # one control, not a server copy
        assert tts.admission.limits["max_in_flight"] == 1 and tts.admission.limits["max_waiting"] == 0
        held = tts.admission.admit("a library caller")  # e.g. another thread using the same TTS
        try:
            err = assert_error(c.post("/v1/audio/speech", json=body), 429, code="too_many_requests")
            assert err["type"] == "rate_limit_error" and "max_in_flight=1" in err["message"]
            batch = {"model": "x", "voice": "default", "items": [{"input": "Hi.", "force_tokens": 2}]}
            assert_error(c.post("/v1/audio/speech/batch", json=batch), 429, code="too_many_requests")
            m = parse_metrics(c.get("/metrics").text)
            assert m["cosytrt_requests_in_flight"] == 1
            tts.admission.configure(max_waiting=1)
            err = assert_error(c.post("/v1/audio/speech", json=body), 503, code="queue_timeout")
            assert err["type"] == "server_error"
        finally:
            held.release()
        r = c.post("/v1/audio/speech", json=body)
        assert r.status_code == 200 and len(r.content) > 0
        r = c.post("/v1/audio/speech/batch", json={"model": "x", "voice": "default", "items": [
            {"input": "Hi.", "force_tokens": 2}, {"input": "Yo.", "force_tokens": 2, "response_format": "pcm"}]})
        assert r.status_code == 200 and r.json()["succeeded"] == 2  # two items under the one slot (max_in_flight=1)
        assert tts.admission.in_flight == 0
    assert tts.admission.limits == limits  # a shared TTS gets its own limits back at shutdown



def test_try_admit_takes_only_a_free_slot_and_never_queues():
    from cosytrt.runtime.scheduling.admission import AdmissionControl

    a = AdmissionControl(max_in_flight=2, max_waiting=0)
    t1 = a.try_admit()
    t2 = a.try_admit()
    assert t1 is not None and t2 is not None and a.try_admit() is None
    assert a.snapshot()["queue_full"] == 0 and a.waiting == 0  # no refusal counted, nothing queued
    t1.release()
    t3 = a.try_admit()
    assert t3 is not None and a.in_flight == 2
    t2.release()
    t3.release()
    assert a.in_flight == 0
