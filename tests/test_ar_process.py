"""The AR in a process of its own (`SchedulerConfig.ar_process`, runtime/scheduling/ar_process.py): the same tokens
and audio as one process, cancels free the child's KV slots, a request's error comes back as itself, the child's
death fails the live requests (not a hang) and marks the TTS unhealthy, close() ends the child. CPU, tiny model."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from cosytrt.engines.errors import InputError, RequestTooLongError
from cosytrt.runtime.scheduling.ar_process import ARProcess
from cosytrt.runtime.scheduling.scheduler import AR_RUNNER_FIELDS, SchedulerConfig
from cosytrt.runtime.stages.request import default_voice_wav
from cosytrt.runtime.tts import TTS, make_request

ATOL = 1e-5
EXACT = dict(dit_max_requests=1, hift_max_batch=1)  # one request per DiT / HiFT call: the eager audio, exactly
MAX_LEN = 1300  # KV positions: below what the noise buffers allow (~1400 tokens), so the child's own check can fail


@pytest.fixture(scope="module")
def tts():
    t = TTS.load("tiny", scheduler=SchedulerConfig(ar_process=True, ar_max_len=MAX_LEN, **EXACT))
    yield t
    t.close()


@pytest.fixture(scope="module")
def speaker(tts):
    return tts.make_speaker(default_voice_wav(16000, 1.2), "A short voice.", 16000)


SPECS = [("Hello there.", 1, False, dict(force_tokens=40)),
         ("Another one here!", 2, True, dict(force_tokens=70)),
         ("Third text, sampled freely.", 3, False, dict(max_tokens=60)),
         ("Fourth, streaming and sampled.", 4, True, dict(max_tokens=90, min_tokens=40))]


def _reqs(speaker):
    return [make_request(text, speaker=speaker, seed=seed, stream=stream, **kw) for text, seed, stream, kw in SPECS]


def _pid_exists(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def _wait(cond, timeout_s=30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_same_tokens_and_audio_as_one_process(tts, speaker):
    """Four concurrent requests (streams and offline, AR batched in the child): each request's tokens are the
    single-request decode's and its chunks the eager pipeline's (<= 1e-5), as in one process."""
    reqs = _reqs(speaker)
    refs = [list(tts.pipeline.run(r)) for r in reqs]
    handles = [None] * len(reqs)

    def go(i):
        handles[i] = tts.submit(reqs[i])
    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    outs = [list(h.chunks(timeout=120)) for h in handles]
    st = tts.scheduler.stats()
    assert st["ar"]["max_decode_batch"] >= 2  # the child batched them (its counters, asked over the pipe)
    assert st["ar"]["process_pid"] == tts.ar_runner.proc.pid
    assert st["busy_s"]["ar"] > 0 and st["busy_s"]["dit"] > 0
    for req, h, chunks, ref in zip(reqs, handles, outs, refs):
        assert h.error is None
        assert len(chunks) == len(ref)
        for a, b in zip(chunks, ref):
            np.testing.assert_allclose(a, b, rtol=0, atol=ATOL)
        m = h.metrics
        assert m.tokens == len(h.tokens) and m.t_ar > 0 and "prefill" in m.marks and m.ttfa is not None
    assert any(len(c) > 1 for c in outs)  # a stream's hops came back before its end


def test_zero_shot_prompt_audio(tts):
    """A request with its own prompt audio and transcript: the child gets it without the voice (the frontend ran
    here) and the audio is the eager pipeline's."""
    req = make_request("Zero shot.", prompt_wav=default_voice_wav(16000, 1.0), prompt_sr=16000,
                       prompt_text="A voice.", seed=9, force_tokens=30)
    ref = np.concatenate(list(tts.pipeline.run(req)))
    np.testing.assert_allclose(tts.submit(req).result(timeout=120), ref, rtol=0, atol=ATOL)


def test_tokens_match_the_in_process_scheduler(tts, speaker):
    """The same request through a TTS without ar_process: the same token list (the child's LM has the weights bit for
    bit, the sampling the same seed)."""
    one = TTS.load("tiny", scheduler=SchedulerConfig(**EXACT))
    try:
        for req in _reqs(speaker)[:2]:
            a, b = one.submit(req), tts.submit(req)
            wa, wb = a.result(timeout=120), b.result(timeout=120)
            assert a.tokens == b.tokens
            np.testing.assert_array_equal(wa, wb)
    finally:
        one.close()


def test_cancel_frees_the_child_slot(tts):
    h = tts.submit("A long stream to cancel.", seed=3, stream=True, force_tokens=1100)
    next(iter(h.chunks(timeout=60)))  # its first hop came back: it holds a KV slot in the child
    h.cancel()
    slots = tts.ar_runner.max_batch
    assert _wait(lambda: tts.scheduler.stats()["ar"]["free_slots"] == slots)
    assert tts.synthesize("Still serving.", seed=1, force_tokens=20).size > 0


def test_request_error_comes_back_as_itself(tts):
    """A request too long for the child's KV slots (not for the noise buffers, checked here first) fails with the
    runtime's own error, raised in the child and pickled back, alone."""
    assert tts.ar_runner.max_len == MAX_LEN
    ok = tts.submit("Fine.", seed=2, force_tokens=30)
    bad = tts.submit("Too long.", seed=2, force_tokens=MAX_LEN - 20)
    with pytest.raises(RequestTooLongError, match="KV-cache slots"):
        bad.result(timeout=60)
    assert ok.result(timeout=60).size > 0


def test_a_signal_to_the_process_group_leaves_the_drain_to_the_parent(tts):
    """SIGTERM / SIGINT to the child (a service manager or a Ctrl-C reaches the whole process group): it keeps serving;
    the parent ends it when it closes (or it sees the pipe end if the parent dies)."""
    import os
    import signal

    pid = tts.ar_runner.proc.pid
    h = tts.submit("Still running.", seed=4, stream=True, force_tokens=200)
    os.kill(pid, signal.SIGTERM)
    os.kill(pid, signal.SIGINT)
    assert h.result(timeout=60).size > 0 and h.error is None
    assert tts.ar_runner.proc.is_alive() and tts.health()[0]


def test_config_checks_and_runner_field():
    assert "ar_process" in AR_RUNNER_FIELDS
    with pytest.raises(InputError, match="ar_pace_lead_s"):
        SchedulerConfig(ar_process=True, ar_pace_lead_s=1.0)
    with pytest.raises(InputError, match="ar_first_audio_hold_ms"):
        SchedulerConfig(ar_process=True, ar_first_audio_hold_ms=5)


def test_reconfigure_keeps_the_process(tts):
    import dataclasses

    pid = tts.ar_runner.proc.pid
    base = tts.scheduler_config
    tts.reconfigure(dataclasses.replace(base, dit_max_wait_ms=3.0))
    assert tts.synthesize("Again.", seed=5, force_tokens=20).size > 0
    assert tts.ar_runner.proc.pid == pid and tts.ar_runner.proc.is_alive()
    with pytest.raises(InputError, match="ar_process"):
        tts.reconfigure(dataclasses.replace(base, ar_process=False))
    tts.reconfigure(base)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the AR thread's re-raise
def test_child_death_fails_live_requests_and_close_ends_it():
    """The AR process killed mid-request: the request fails with an error naming the AR process (no hang), the
    TTS reports itself unhealthy, and close() returns."""
    t = TTS.load("tiny", scheduler=SchedulerConfig(ar_process=True))
    try:
        h = t.submit("A long stream.", seed=1, stream=True, force_tokens=1100)
        next(iter(h.chunks(timeout=60)))
        proc = t.ar_runner.proc
        pid = proc.pid
        proc.kill()
        with pytest.raises(Exception, match="AR process"):
            h.result(timeout=30)
        assert _wait(lambda: not t.health()[0])
        assert "AR process" in t.health()[1] and "exit code -9" in t.health()[1]
    finally:
        t.close(drain_timeout_s=5)
    assert not _pid_exists(pid)  # reaped, and its process handle closed (no descriptors left open)


def test_start_failure_is_the_child_error():
    """A runner the child cannot build (here: a device this machine lacks): ARProcess raises the child's own error
    at once (not a time-out), and no process is left behind."""
    import multiprocessing

    from cosytrt.runtime.stages.pipeline import Pipeline

    p = Pipeline.load("tiny")
    before = set(multiprocessing.active_children())  # (the module's TTS keeps its own child)
    t = time.monotonic()
    with pytest.raises(BaseException, match="(?i)cuda"):
        ARProcess(p.models.llm, SchedulerConfig(ar_process=True), "cuda:7", max_len=256)
    assert time.monotonic() - t < 60
    assert not set(multiprocessing.active_children()) - before


def test_child_exits_when_its_parent_dies(tmp_path):
    """A parent killed without closing (os._exit: no atexit, no close message): the child sees the pipe end and
    exits, so no orphan keeps the GPU's memory."""
    import os
    import subprocess
    import sys

    script = tmp_path / "parent.py"
    script.write_text(
        "import os, sys\n"
        "from cosytrt.runtime import TTS\n"
        "from cosytrt.runtime.scheduling.config import SchedulerConfig\n"
        "if __name__ == '__main__':\n"
        "    t = TTS.load('tiny', scheduler=SchedulerConfig(ar_process=True))\n"
        "    t.synthesize('Hi.', seed=1, force_tokens=10)\n"
        "    print(t.ar_runner.proc.pid, flush=True)\n"
        "    os._exit(0)\n")
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr
    pid = int(p.stdout.strip().splitlines()[-1])

    def gone():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not reaped by init yet) counts as gone
            return f.read().split(")")[-1].split()[0] == "Z"
    assert _wait(gone, 30)


# ------------------------------------------------------------------------------------ several schedulers, one process

def test_a_second_scheduler_beside_the_first(tts):
    """A scheduler made beside the TTS's own (`make_scheduler`, as the serving bench does) is a session of its own in
    the child: both serve, the first after the second closed (the child used to keep one worker: the first's
    request then never finished)."""
    assert tts.synthesize("First.", seed=1, force_tokens=20).size > 0
    s = tts.make_scheduler()
    try:
        assert s.submit(make_request("Second.", seed=1, force_tokens=20)).result(timeout=60).size > 0
        both = [tts.submit("Beside.", seed=2, force_tokens=60), s.submit(make_request("Beside.", seed=2,
                                                                                       force_tokens=60))]
        a, b = (h.result(timeout=60) for h in both)
        np.testing.assert_array_equal(a, b)  # the same request through either session
        assert both[0].tokens == both[1].tokens
    finally:
        s.close()
    assert tts.synthesize("First again.", seed=3, force_tokens=20).size > 0


def test_reconfigure_under_traffic_keeps_both_schedulers_requests(tts):
    """`reconfigure` with a request in flight while a new request starts the next scheduler: the draining one
    finishes (it used to be dropped in the child when the next one attached), and cancelling it does not cancel the
    new scheduler's request (keys are unique across sessions: both used to be key 0)."""
    cfg = tts.scheduler_config
    x = tts.submit("A long stream in flight.", seed=3, stream=True, force_tokens=1000)
    next(iter(x.chunks(timeout=60)))
    th = threading.Thread(target=tts.reconfigure, args=(cfg,), kwargs=dict(drain_timeout_s=60))
    th.start()
    try:
        assert _wait(lambda: tts._scheduler is None)
        y = tts.submit("New request.", seed=1, stream=True, force_tokens=300)  # the next scheduler's first
        next(iter(y.chunks(timeout=60)))
        x.cancel()
        assert y.result(timeout=60).size > 0
        z = tts.submit("Another long stream.", seed=4, stream=True, force_tokens=400)
        next(iter(z.chunks(timeout=60)))
        th.join(60)
        th = threading.Thread(target=tts.reconfigure, args=(cfg,), kwargs=dict(drain_timeout_s=60))
        th.start()
        assert _wait(lambda: tts._scheduler is None)
        assert tts.synthesize("Starts the next one.", seed=1, force_tokens=20).size > 0
        assert z.result(timeout=60).size > 0  # drained, not dropped
    finally:
        th.join(60)


def test_a_raising_finish_callback_does_not_stop_the_messages(tts):
    """A scheduler's on_finish that raises (for a request the child failed) used to kill the process's reader thread:
    every later request hung while the scheduler reported itself healthy. Now it is logged and serving goes on."""
    def on_finish(m):
        if m.error:
            raise RuntimeError("metrics sink is down")
    s = tts.make_scheduler(on_finish=on_finish)
    try:
        bad = s.submit(make_request("Too long.", seed=2, force_tokens=MAX_LEN - 20))
        with pytest.raises(RequestTooLongError):
            bad.result(timeout=60)
        assert s.submit(make_request("Next.", seed=1, force_tokens=20)).result(timeout=60).size > 0
        assert s.healthy
    finally:
        s.close(drain_timeout_s=5)


def test_a_request_cancelled_before_the_ar_is_not_decoded(tts, monkeypatch):
    """A request cancelled while its frontend work ran (a client gone) is not sent to the child, as the in-process
    worker drops it before admission (it used to be decoded there to its end, holding a KV slot)."""
    from cosytrt.runtime.scheduling import scheduler as sched_mod

    prepare = sched_mod.Scheduler._prepare

    def prepare_then_gone(self, r):
        prepare(self, r)
        r.handle.cancel()
    monkeypatch.setattr(sched_mod.Scheduler, "_prepare", prepare_then_gone)  # before the scheduler binds it
    s = tts.make_scheduler()
    try:
        hs = [s.submit(make_request("Nobody listens.", seed=i, force_tokens=1100)) for i in range(3)]
        assert _wait(lambda: all(h.done() for h in hs))
        time.sleep(0.3)
        st = s.stats()["ar"]
        assert st["prefill_rows"] == 0 and st["decode_steps"] == 0
    finally:
        monkeypatch.setattr(sched_mod.Scheduler, "_prepare", prepare)
        s.close(drain_timeout_s=5)


def test_close_fails_the_requests_of_a_scheduler_still_attached():
    """The TTS closed while a scheduler made beside it still runs a request: that request fails naming the AR
    process (it used to wait for ever), and the scheduler closes at once."""
    t = TTS.load("tiny", scheduler=SchedulerConfig(ar_process=True))
    s = t.make_scheduler()
    try:
        h = s.submit(make_request("A long stream.", seed=1, stream=True, force_tokens=1100))
        next(iter(h.chunks(timeout=60)))
        t.close(drain_timeout_s=1)
        with pytest.raises(Exception, match="AR process"):
            h.result(timeout=30)
    finally:
        s.close(drain_timeout_s=1)
        t.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_health_reports_a_child_that_died_between_schedulers():
    """The child killed while no scheduler runs (after a reconfigure): every submit fails, and health says so (it
    used to say healthy)."""
    t = TTS.load("tiny", scheduler=SchedulerConfig(ar_process=True))
    try:
        t.synthesize("Hello.", seed=1, force_tokens=10)
        t.reconfigure(t.scheduler_config)
        t.ar_runner.proc.kill()
        assert _wait(lambda: not t.health()[0])
        assert "exit code -9" in t.health()[1]
        with pytest.raises(Exception, match="AR process"):
            t.synthesize("Again.", seed=1, force_tokens=10)
    finally:
        t.close(drain_timeout_s=2)
