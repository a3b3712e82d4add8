"""Coverage replay: submit a workload through the runtime's own scheduler (so the call shapes are the ones batching
really makes) and record every bucketed stage call of the engine set's ShapeStats (hits and eager fallbacks) with
its shape."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from ..engines.errors import InputError
from .coverage_workload import WorkloadRequest, text_of_tokens


class CallRecorder:
    """Records every ShapeStats.record call (stage, mode, b, n, bucket key or None, seconds, reason) of one stats
    object, by wrapping its `record` method on the instance; `detach()` restores it."""

    def __init__(self, stats):
        self.stats = stats
        self.calls: list[tuple] = []
        self._lock = threading.Lock()
        self._orig = stats.record

        def record(stage, mode, b, n, bucket, seconds, reason=None, split_part=False):
            # a split call (BucketTable.plan) is recorded as its chunks: what the stage really ran
            self._orig(stage, mode, b, n, bucket, seconds, reason=reason, split_part=split_part)
            with self._lock:
                self.calls.append((stage, mode, int(b), int(n), bucket.key if bucket is not None else None,
                                   float(seconds), reason))

        stats.record = record

    def detach(self) -> None:
        self.stats.__dict__.pop("record", None)


@dataclass
class ReplayResult:
    calls: list[tuple]
    requests: int
    groups: int
    wall_seconds: float
    failed: list[dict]


def _speaker_for_no_reference(tts):
    if tts.pipeline.default_speaker is not None:
        return tts.pipeline.default_speaker
    from ..runtime.stages.request import default_voice_wav

    return tts.make_speaker(default_voice_wav(16000, 3.0), "", 16000)


def replay(tts, requests: list[WorkloadRequest], timeout_s: float = 600.0, progress: bool = False) -> ReplayResult:
    """Submit each group's requests together through `tts` (its scheduler) and wait for them; groups in order."""
    from ..runtime.stages.request import default_voice_wav

    es = tts.pipeline.backends.engine_set
    if es is None:
        raise InputError("coverage needs a TTS loaded with an engine set (TTS.load(..., engines=DIR))")
    tok = tts.pipeline.frontend.tokenizer
    timed = sum(r.arrival_s is not None for r in requests)
    if 0 < timed < len(requests):
        raise InputError("coverage replay: give every request an arrival time or none")
    groups: dict[str, list[WorkloadRequest]] = {}
    if timed:  # open loop: one wave, each request submitted at its arrival time
        groups = {"open-loop": sorted(requests, key=lambda r: r.arrival_s)}
    else:
        for r in requests:
            groups.setdefault(r.group, []).append(r)
    speaker = None
    wavs: dict[float, object] = {}
    es.stats.reset()
    rec = CallRecorder(es.stats)
    failed = []
    t0 = time.perf_counter()
    it = groups.items()
    if progress:
        from tqdm import tqdm

        it = tqdm(it, total=len(groups), desc="replaying workload", unit="group")
    try:
        for name, reqs in it:
            handles = []
            t_wave = time.perf_counter()
            for r in reqs:
                if r.arrival_s is not None:
                    time.sleep(max(0.0, t_wave + r.arrival_s - time.perf_counter()))
                kw = {"stream": r.stream, "seed": r.seed}
                if r.speech_tokens is not None:
                    kw["force_tokens"] = r.speech_tokens
                if r.prompt_seconds is None:
                    speaker = speaker or _speaker_for_no_reference(tts)
                    kw["speaker"] = speaker
                else:
                    if r.prompt_seconds not in wavs:
                        wavs[r.prompt_seconds] = default_voice_wav(16000, r.prompt_seconds)
                    kw.update(prompt_wav=wavs[r.prompt_seconds], prompt_sr=16000)
                text = r.text if r.text is not None else text_of_tokens(tok, r.text_tokens)
                try:
                    handles.append(_submit(tts, text, kw))
                except Exception as e:  # noqa: BLE001 - a rejected request is reported, the replay goes on
                    failed.append({"group": name, "error": f"{type(e).__name__}: {e}"})
            for h in handles:
                try:
                    h.result(timeout_s)
                except Exception as e:  # noqa: BLE001
                    failed.append({"group": name, "error": f"{type(e).__name__}: {e}"})
    finally:
        rec.detach()
    n_groups = len({r.group for r in requests}) if timed else len(groups)
    return ReplayResult(rec.calls, len(requests), n_groups, time.perf_counter() - t0, failed)


class _ThreadHandle:
    """A handle over one thread calling tts.synthesize (for a TTS without `submit`)."""

    def __init__(self, tts, text, kw):
        self.error, self.out = None, None

        def go():
            try:
                self.out = tts.synthesize(text, **kw)
            except Exception as e:  # noqa: BLE001
                self.error = e

        self.thread = threading.Thread(target=go, daemon=True)
        self.thread.start()

    def result(self, timeout=None):
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise TimeoutError(f"request did not finish within {timeout} s")
        if self.error is not None:
            raise self.error
        return self.out


def _submit(tts, text: str, kw: dict):
    if hasattr(tts, "submit"):
        return tts.submit(text, **kw)
    return _ThreadHandle(tts, text, kw)
