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
        proc.kill()
        with pytest.raises(Exception, match="AR process"):
            h.result(timeout=30)
        assert _wait(lambda: not t.health()[0])
        assert "AR process" in t.health()[1] and "exit code -9" in t.health()[1]
    finally:
        t.close(drain_timeout_s=5)
    assert not proc.is_alive()


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
