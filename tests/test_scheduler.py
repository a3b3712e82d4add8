"""Scheduler: batched multi-request runs give each request's single-request audio; streaming order; cancel, reject,
failure isolation, drain. CPU, tiny model, short prompts to stay fast."""
from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from cosytrt.engines.errors import RejectedError, RequestTooLongError
from cosytrt.runtime.stages.request import default_voice_wav, prepare_inputs
from cosytrt.runtime.models.sampling import generate
from cosytrt.runtime.scheduling.scheduler import RequestHandle, Scheduler, SchedulerConfig
from cosytrt.runtime.scheduling.stage_clock import StageClock
from cosytrt.runtime.tts import TTS, make_request

SPF = 480  # samples per mel frame
ATOL = 1e-5
BATCHED_ATOL = 2e-3     # golden HiFT wav tolerance
BATCHED_SNR_DB = 50.0


@pytest.fixture(scope="module")
def tts():
    t = TTS.load("tiny", scheduler=SchedulerConfig(dit_max_wait_ms=20, hift_max_wait_ms=10))
    yield t
    t.close()


@pytest.fixture(scope="module")
def speakers(tts):
    """Two short voices (25 and 40 prompt tokens) so that rows are ragged and hops are not in lockstep."""
    return [tts.make_speaker(default_voice_wav(16000, 1.0), "Short voice.", 16000),
            tts.make_speaker(default_voice_wav(16000, 1.6), "A bit longer voice.", 16000)]


def reference(tts, req) -> list[np.ndarray]:
    return list(tts.pipeline.run(req))


def submit_from_threads(submit, reqs) -> list[RequestHandle]:
    handles = [None] * len(reqs)

    def go(i):
        handles[i] = submit(reqs[i])

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return handles


SPECS = [("Hello there.", 1, False, dict(force_tokens=40)),
         ("Another one here!", 2, True, dict(force_tokens=70)),
         ("Third text, sampled freely.", 3, False, dict(max_tokens=60)),
         ("Fourth, streaming and sampled.", 4, True, dict(max_tokens=90, min_tokens=40)),
         ("Fifth one, offline.", 5, False, dict(force_tokens=55)),
         ("Sixth and last, streaming.", 6, True, dict(force_tokens=45))]


def reference_tokens(tts, req) -> list[int]:
    p = tts.pipeline
    inputs = prepare_inputs(p.frontend, req, p.default_speaker)
    lm_input = p.models.llm.build_lm_input(inputs.text_ids, inputs.prompt_speech_tokens)
    return list(generate(p.models.llm, lm_input, inputs.text_len, req.sampling))


@pytest.fixture(scope="module")
def mixed(tts, speakers):
    """Six mixed requests (stream / offline, two voices, different seeds and lengths) and their eager references."""
    reqs = [make_request(text, speaker=speakers[i % 2], seed=seed, stream=stream, **kw)
            for i, (text, seed, stream, kw) in enumerate(SPECS)]
    return reqs, [reference(tts, r) for r in reqs], [reference_tokens(tts, r) for r in reqs]


def check_common(handles, outs, reqs, refs, ref_tokens, sample_rate):
    for req, h, chunks, ref, toks in zip(reqs, handles, outs, refs, ref_tokens):
        assert h.tokens == toks, f"request {req.request_id}: tokens differ from the single-request decode"
        assert len(chunks) == len(ref), f"request {req.request_id}: {len(chunks)} chunks, reference {len(ref)}"
        assert [c.shape for c in chunks] == [c.shape for c in ref]
        assert all(c.dtype == np.float32 for c in chunks)
        m = h.metrics
        assert m.error is None and m.ttfa is not None and m.t_ar > 0 and m.t_dit > 0 and m.t_vocoder > 0
        assert len(m.chunk_times) == len(chunks) and m.chunk_times == sorted(m.chunk_times)
        assert m.audio_seconds == pytest.approx(sum(c.size for c in chunks) / sample_rate)
    assert any(len(c) > 1 for c in outs)  # some stream really produced several chunks


def test_concurrent_requests_exact_with_batched_ar(tts, mixed):
    """AR continuously batched across the six requests, DiT / HiFT one request per call: the audio is the eager
    single-request audio (<= 1e-5), which checks the hop schedule, slicing, ordering and stream state exactly."""
    reqs, refs, ref_tokens = mixed
    sched = Scheduler(tts.pipeline, SchedulerConfig(dit_max_requests=1, hift_max_batch=1))
    try:
        handles = submit_from_threads(sched.submit, reqs)
        outs = [list(h.chunks(timeout=120)) for h in handles]
        st = sched.stats()
    finally:
        sched.close()
    assert st["in_flight"] == 0 and st["completed"] == 6
    assert st["ar"]["batched_decode_steps"] > 0 and st["ar"]["max_decode_batch"] >= 2
    check_common(handles, outs, reqs, refs, ref_tokens, tts.sample_rate)
    for chunks, ref in zip(outs, refs):
        for a, b in zip(chunks, ref):
            np.testing.assert_allclose(a, b, rtol=0, atol=ATOL)


def snr_db(ref: np.ndarray, out: np.ndarray) -> float:
    err = float(((ref - out) ** 2).sum())
    return float("inf") if err == 0 else 10 * np.log10(float((ref ** 2).sum()) / err)


def assert_streams_match(outs, refs) -> None:
    """Each request's chunks have the reference's shapes and its audio matches within the batching bounds."""
    for chunks, ref in zip(outs, refs):
        assert [c.shape for c in chunks] == [c.shape for c in ref]
        a, b = np.concatenate(chunks), np.concatenate(ref)
        assert np.abs(a - b).max() <= BATCHED_ATOL and snr_db(b, a) >= BATCHED_SNR_DB


def hold_hift_for_a_pair(monkeypatch, timeout_s: float = 10.0) -> None:
    """The HiFT thread waits (up to `timeout_s`) until chunks of two streams are ready before its first call (streams
    advance in one `push_batch`), so that the test sees a batched vocoder call whatever the machine's timing (with the
    10 ms batching window alone, a slow CI core sometimes found one ready job at every call)."""
    from cosytrt.runtime.scheduling import token2wav_worker
    from cosytrt.runtime.scheduling.policies import first_per_request
    real, deadline, paired = token2wav_worker.pick_hift_jobs, time.monotonic() + timeout_s, []

    def held(queue, cfg, now, more_coming):
        streams = [j for j in first_per_request(queue) if j.r.stream is not None]
        if not paired and len(streams) < 2 and time.monotonic() < deadline:
            return [], 0.002
        paired.append(True)
        return real(queue, cfg, now, more_coming)

    monkeypatch.setattr(token2wav_worker, "pick_hift_jobs", held)


def test_concurrent_requests_fully_batched(tts, mixed, monkeypatch):
    """Every stage batched (through TTS.submit from threads): tokens identical, audio equal up to the float noise of
    batched GEMMs (mel ~1e-6, which HiFT's f0 -> phase integration amplifies to ~1e-4 in the waveform)."""
    reqs, refs, ref_tokens = mixed
    hold_hift_for_a_pair(monkeypatch)
    before = tts.scheduler.stats()
    handles = submit_from_threads(tts.submit, reqs)
    outs = [list(h.chunks(timeout=120)) for h in handles]
    st = tts.scheduler.stats()
    assert st["in_flight"] == 0 and st["completed"] - before["completed"] == 6
    assert st["ar"]["batched_decode_steps"] > before["ar"]["batched_decode_steps"]
    assert st["dit"]["max_batch"] >= 2 and st["hift"]["max_batch"] >= 2
    assert all(st["busy_s"][s] > before["busy_s"].get(s, 0.0) for s in ("ar", "dit", "hift"))
    check_common(handles, outs, reqs, refs, ref_tokens, tts.sample_rate)
    for chunks, ref in zip(outs, refs):
        a, b = np.concatenate(chunks), np.concatenate(ref)
        assert np.abs(a - b).max() <= BATCHED_ATOL
        assert snr_db(b, a) >= BATCHED_SNR_DB


def test_stream_order_and_offline_sample_count(tts, speakers):
    n = 80
    req_s = make_request("Stream me in order.", speaker=speakers[0], seed=7, stream=True, force_tokens=n)
    req_o = make_request("Stream me in order.", speaker=speakers[0], seed=7, stream=False, force_tokens=n)
    chunks = list(tts.stream("Stream me in order.", speaker=speakers[0], seed=7, force_tokens=n))
    ref = reference(tts, req_s)
    assert len(chunks) == len(ref) >= 3
    np.testing.assert_allclose(np.concatenate(chunks), np.concatenate(ref), rtol=0, atol=ATOL)
    for a, b in zip(chunks, ref):  # in order: chunk i is the reference's chunk i
        assert a.shape == b.shape
    wav = tts.synthesize_request(req_o)[0]
    assert wav.size == np.concatenate(chunks).size == 2 * n * SPF
    np.testing.assert_allclose(wav, np.concatenate(reference(tts, req_o)), rtol=0, atol=ATOL)


def test_async_streams_match_threaded(tts, speakers):
    kw = [dict(speaker=speakers[0], seed=11, force_tokens=50), dict(speaker=speakers[1], seed=12, force_tokens=40)]

    async def collect(k):
        return [c async for c in tts.astream("Async speech.", **k)]

    async def main():
        return await asyncio.gather(*(collect(k) for k in kw))

    outs = asyncio.run(main())
    for k, chunks in zip(kw, outs):
        ref = reference(tts, make_request("Async speech.", stream=True, **k))
        assert [c.shape for c in chunks] == [c.shape for c in ref]
        a, b = np.concatenate(chunks), np.concatenate(ref)  # the two may share DiT / HiFT calls: float noise
        assert np.abs(a - b).max() <= BATCHED_ATOL and snr_db(b, a) >= BATCHED_SNR_DB


def test_too_long_request_fails_before_model_work(tts, speakers):
    h = tts.submit("Far too long.", speaker=speakers[0], force_tokens=2000)
    with pytest.raises(RequestTooLongError):
        h.result(timeout=30)
    assert tts.scheduler.stats()["in_flight"] == 0


def _wait(pred, timeout=30.0):
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def test_cancel_frees_slot_and_reject_when_full(tts, speakers):
    sched = Scheduler(tts.pipeline, SchedulerConfig(ar_max_batch=1, max_in_flight=1, on_full="reject"))
    try:
        long = sched.submit(make_request("A long request to cancel.", speaker=speakers[0], stream=True,
                                         force_tokens=1400))
        _wait(lambda: sched.stats()["queues"]["ar_running"] == 1)
        assert sched.stats()["ar"]["free_slots"] == 0
        with pytest.raises(RejectedError):  # max_in_flight=1 and on_full="reject"
            sched.submit(make_request("Rejected.", speaker=speakers[0], force_tokens=30))
        assert sched.stats()["rejected"] == 1
        next(long.chunks(timeout=60))  # it is producing audio
        long.cancel()
        with pytest.raises(RejectedError):
            long.result()
        st = sched.stats()
        assert st["in_flight"] == 0 and st["cancelled"] == 1
        # the single slot is freed at the next AR step and reused by the next request
        req = make_request("Next one.", speaker=speakers[0], seed=3, force_tokens=30)
        wav = sched.submit(req).result(timeout=60)
        st = sched.stats()
        assert st["ar"]["slot_allocations"] == 2 and st["ar"]["free_slots"] == 1 and st["completed"] == 1
        np.testing.assert_allclose(wav, np.concatenate(reference(tts, req)), rtol=0, atol=ATOL)
    finally:
        sched.close(drain_timeout_s=5)


def test_failing_request_fails_alone_and_close_drains(tts, speakers, monkeypatch):
    flow = tts.pipeline.models.flow
    real = flow.prepare_row

    def flaky(token, *a, **kw):
        if token.numel() == 33:  # the bad request's tokens (force_tokens=33)
            raise RuntimeError("injected flow failure")
        return real(token, *a, **kw)

    monkeypatch.setattr(flow, "prepare_row", flaky)
    sched = Scheduler(tts.pipeline, SchedulerConfig(dit_max_wait_ms=30))
    good = [make_request(f"Good request {i}.", speaker=speakers[i % 2], seed=i, stream=bool(i % 2),
                         force_tokens=30 + 4 * i) for i in range(3)]
    bad = make_request("Bad request.", speaker=speakers[0], seed=9, force_tokens=33)
    handles = submit_from_threads(sched.submit, good[:2] + [bad] + good[2:])
    sched.close(drain_timeout_s=120)  # drains: every request finishes before the workers stop
    with pytest.raises(RuntimeError, match="injected"):
        handles[2].result()
    assert handles[2].metrics.error and "injected" in handles[2].metrics.error
    st = sched.stats()
    assert st["failed"] == 1 and st["completed"] == 3 and st["in_flight"] == 0 and st["dit"]["max_batch"] >= 2
    monkeypatch.setattr(flow, "prepare_row", real)
    for req, h in zip(good, handles[:2] + handles[3:]):  # intact (batched DiT / HiFT: up to float noise)
        a, b = h.result(), np.concatenate(reference(tts, req))
        assert a.shape == b.shape and np.abs(a - b).max() <= BATCHED_ATOL and snr_db(b, a) >= BATCHED_SNR_DB
    with pytest.raises(RejectedError):
        sched.submit(make_request("After close.", speaker=speakers[0]))


def test_tts_metrics_include_scheduler_stats(tts):
    m = tts.metrics()
    assert m["requests"] >= 6 and m["stages"]["completed"] >= 6
    assert m["T_AR"]["n"] >= 6 and m["ttfa"]["p50"] is not None


def test_export_metrics_json(tmp_path):
    import json

    from cosytrt.runtime.tts import TTS

    with TTS.load("tiny") as tts:
        tts.synthesize("Metrics to a file.", seed=0, force_tokens=10)
        chunks = list(tts.stream("And a stream.", seed=1, force_tokens=30))
        assert len(chunks) >= 2
        path = tmp_path / "m.json"
        tts.export_metrics(str(path))
    d = json.loads(path.read_text())
    assert d["aggregate"]["requests"] == 2 and len(d["requests"]) == 2
    for k in ("T_tokenizer", "T_AR", "T_DiT", "T_vocoder", "T_queue", "ttfa", "rtf"):
        assert set(d["aggregate"][k]) >= {"p50", "p95", "p99"}
    assert d["aggregate"]["stages"]["completed"] == 2


def test_flow_prefix_cache_in_scheduler(tts, speakers):
    """Streams through a scheduler with the flow prefix cache equal Pipeline.run (whole-history hops)
    for the same seed; the stats show the frames reused, a speaker prompt hit for the repeated voice, every DiT frame
    of the hop schedule either computed or reused, and the streams' caches freed (the prompt entry stays)."""
    from cosytrt.runtime.stages.hop_schedule import streaming_call_frames

    n_tokens = (130, 70)
    reqs = [make_request("Cached hops, first.", speaker=speakers[1], seed=21, stream=True, force_tokens=n_tokens[0]),
            make_request("Cached hops, second.", speaker=speakers[1], seed=22, stream=True, force_tokens=n_tokens[1])]
    refs = [reference(tts, r) for r in reqs]
    sched = Scheduler(tts.pipeline, SchedulerConfig(dit_max_requests=1, hift_max_batch=1, flow_prefix_cache=True))
    assert sched.config.flow_prefix_cache
    try:
        outs = [list(sched.submit(r).chunks(timeout=120)) for r in reqs]  # in turn: the second finds the prompt entry
        st = sched.stats()["dit"]
    finally:
        sched.close()
    assert_streams_match(outs, refs)
    assert len(outs[0]) >= 3 and st["frames_reused"] > 0 and st["cache_fallbacks"] == 0
    # each stream's prefix was given back once its final was next with no hop in flight (before the final ran)
    assert st["prefixes_freed_early"] == 2
    fc = st["flow_cache"]
    assert fc["prompt_hits"] == 1 and fc["prompt_entries"] == 1 and 0 < fc["bytes_used"] < fc["peak_bytes"]
    whole = 0
    for r, n in zip(reqs, n_tokens):
        P = int(prepare_inputs(tts.pipeline.frontend, r, tts.pipeline.default_speaker).flow_prompt_tokens.numel())
        whole += sum(streaming_call_frames(P, n))
    assert st["frames_computed"] + st["frames_reused"] == whole


def test_cached_hop_graphs_in_scheduler(tts, speakers):
    """The scheduler's DiT worker runs prefix-cached hops through the backends' cached-hop buckets (CPU: static
    buffers without the capture), two streams batched together: the audio equals Pipeline.run's; the buckets were
    prepared at start and every cached hop found one."""
    import dataclasses

    from cosytrt.runtime.stages.flow_hop_calls import CachedGrid, CachedHopGraphs

    flow = tts.pipeline.models.flow
    graphs = CachedHopGraphs(flow.estimator, CachedGrid((1, 2), (64, 128, 256, 512), (0, 128, 256, 512, 1024)),
                             "cpu", graphs=False)
    backends = dataclasses.replace(tts.pipeline.backends, dit_cached=graphs, closers=[])
    reqs = [make_request("Graphed hops, first.", speaker=speakers[0], seed=31, stream=True, force_tokens=120),
            make_request("Graphed hops, second.", speaker=speakers[1], seed=32, stream=True, force_tokens=90)]
    refs = [reference(tts, r) for r in reqs]
    flow.__dict__.pop("_cosytrt_fingerprint", None)  # as in a fresh process
    sched = Scheduler(tts.pipeline, SchedulerConfig(dit_max_requests=2, hift_max_batch=2), backends=backends)
    try:  # flow_prefix_cache=None (auto): on, because these backends have cached-hop graphs
        assert sched.flow_prefix_cache and graphs.counts["captured"] == len(graphs.grid.keys())
        assert getattr(flow, "_cosytrt_fingerprint", None) is not None  # hashed at start, not in the first hop
        handles = [sched.submit(r) for r in reqs]
        outs = [list(h.chunks(timeout=120)) for h in handles]
        st = sched.stats()["dit"]
    finally:
        sched.close()
    assert_streams_match(outs, refs)
    hg = st["flow_cache"]["hop_graphs"]
    assert st["frames_reused"] > 0 and hg["hits"] > 0 and hg["misses"] == 0
    assert hg["kv_form"] == "layers"  # dit_paged_prefix auto on the CPU: the per-layer gathered form (stats say which)


@pytest.mark.parametrize("max_active", [0, 1])
def test_step_level_cached_hops_in_scheduler(tts, speakers, max_active):
    """Step-level DiT scheduling with the flow prefix cache and cached-hop buckets (CPU: static buffers without the
    capture): three streams of different lengths and voices plus an offline request, submitted a little apart, so
    hops, finals and first hops of different requests meet mid-solve. Every request's audio equals Pipeline.run's
    (whole-history hops, one request at a time); cached hops ran one Euler step per call; the TTFA breakdown marks
    are in order. The same with `dit_max_active` 1 (one job mid-solve at a time, first hops excepted: ordering
    only)."""
    import dataclasses

    from cosytrt.runtime.stages.flow_hop_calls import CachedGrid, CachedHopGraphs

    flow = tts.pipeline.models.flow
    graphs = CachedHopGraphs(flow.estimator, CachedGrid((1, 2, 4), (64, 128, 256, 512), (0, 128, 256, 512, 1024)),
                             "cpu", graphs=False)
    backends = dataclasses.replace(tts.pipeline.backends, dit_cached=graphs, closers=[])
    reqs = [make_request("Stepped hops, first.", speaker=speakers[0], seed=41, stream=True, force_tokens=140),
            make_request("Stepped hops, second.", speaker=speakers[1], seed=42, stream=True, force_tokens=90),
            make_request("Stepped hops, third.", speaker=speakers[0], seed=43, stream=True, force_tokens=60),
            make_request("Offline beside them.", speaker=speakers[1], seed=44, force_tokens=40)]
    refs = [reference(tts, r) for r in reqs]
    sched = Scheduler(tts.pipeline, SchedulerConfig(dit_max_requests=4, hift_max_batch=4, dit_step_level=True,
                                                    dit_max_active=max_active), backends=backends)
    try:
        handles = []
        for r in reqs:
            handles.append(sched.submit(r))
            time.sleep(0.05)
        outs = [list(h.chunks(timeout=120)) for h in handles]
        st = sched.stats()["dit"]
    finally:
        sched.close()
    assert_streams_match(outs, refs)
    kinds = st["kinds"]
    assert kinds["cached/step"]["calls"] >= 10 and "offline/step" in kinds, kinds
    assert st["frames_reused"] > 0 and st["cache_fallbacks"] == 0
    for h in handles:
        m = h.metrics.marks
        assert 0 <= m["prefill"] <= m["dit_queued"] <= m["dit_start"] <= m["dit_end"] <= h.metrics.ttfa, m



def test_cache_pressure_cancels_and_voices_soak(tts, speakers):
    """A seeded soak of the cached streaming path under pressure: step-level DiT, prefix and prompt caches in a pool
    too small for every stream (commits that do not fit fall back to whole-history hops), three voices, mixed
    streams / offline / sampled lengths, arrivals spread out and some streams cancelled after their first chunk.
    Every request that ran to the end equals Pipeline.run alone; nothing is left in flight."""
    import dataclasses
    import random

    from cosytrt.runtime.stages.flow_hop_calls import CachedGrid, CachedHopGraphs

    rng = random.Random(4)
    voices = list(speakers) + [tts.make_speaker(default_voice_wav(16000, 2.2), "The longest voice of the three.",
                                                16000)]
    reqs = []
    for i in range(12):
        kw = dict(force_tokens=rng.randint(20, 180)) if rng.random() < 0.7 else dict(max_tokens=rng.randint(30, 150))
        reqs.append(make_request(f"Soak request {i}.", speaker=voices[rng.randrange(3)], seed=300 + i,
                                 stream=rng.random() < 0.75, **kw))
    refs = [reference(tts, r) for r in reqs]
    cancel = {i for i, r in enumerate(reqs) if r.stream and rng.random() < 0.3}
    flow = tts.pipeline.models.flow
    graphs = CachedHopGraphs(flow.estimator, CachedGrid((1, 2, 4), (64, 128, 256), (0, 128, 256, 512)), "cpu",
                             graphs=False)
    backends = dataclasses.replace(tts.pipeline.backends, dit_cached=graphs, closers=[])
    cfg = SchedulerConfig(dit_max_requests=4, hift_max_batch=4, dit_step_level=True, flow_prefix_cache=True,
                          flow_cache_budget_bytes=20_000_000)
    sched = Scheduler(tts.pipeline, cfg, backends=backends)
    outs, errors = [None] * len(reqs), []

    def consume(i, h):
        try:
            chunks = []
            for c in h.chunks(timeout=120):
                chunks.append(c)
                if i in cancel:
                    h.cancel()
                    break
            outs[i] = chunks
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append((i, repr(e)))

    try:
        threads = []
        for i, r in enumerate(reqs):
            time.sleep(rng.random() * 0.15)
            threads.append(threading.Thread(target=consume, args=(i, sched.submit(r))))
            threads[-1].start()
        for t in threads:
            t.join()
        _wait(lambda: sched.stats()["in_flight"] == 0)
        st = sched.stats()["dit"]
    finally:
        sched.close()
    assert not errors
    assert_streams_match([o for i, o in enumerate(outs) if i not in cancel],
                         [r for i, r in enumerate(refs) if i not in cancel])
    # the small pool makes hops fall back under load — unless the last hops' uncommitted pages left enough room (a
    # timing matter: the deterministic overflow cases are tests/test_flow_cache.py's)
    fc = st["flow_cache"]
    assert st["cache_fallbacks"] + fc["uncommitted_last_hops"] > 0, st
    assert st["frames_reused"] > 0 and "cached/step" in st["kinds"], st
    assert st["flow_cache"]["hop_graphs"]["misses"] == 0


def test_last_hop_commits_nothing_in_the_scheduler(tts, speakers, monkeypatch):
    """A stream whose LM finishes while its later hops still wait for the DiT (hops held back here): its last hop
    before the final commits nothing to the prefix pool (counted) and the stream equals Pipeline.run."""
    from cosytrt.runtime.scheduling.token2wav_worker import Token2WavWorker

    real = Token2WavWorker._start_job

    def slow_start(self, j):
        if j.first:
            time.sleep(0.5)  # the AR runs on to the end meanwhile: the later hops and the final queue up
        return real(self, j)

    monkeypatch.setattr(Token2WavWorker, "_start_job", slow_start)
    req = make_request("The last hop commits nothing.", speaker=speakers[0], seed=41, stream=True, force_tokens=130)
    ref = reference(tts, req)
    sched = Scheduler(tts.pipeline, SchedulerConfig(flow_prefix_cache=True, dit_step_level=True))
    try:
        out = list(sched.submit(req).chunks(timeout=120))
        st = sched.stats()["dit"]
    finally:
        sched.close()
    assert_streams_match([out], [ref])
    assert st["flow_cache"]["uncommitted_last_hops"] == 1 and st["cache_fallbacks"] == 0 and st["frames_reused"] > 0


def test_last_hop_before_a_queued_final_is_marked():
    """`_mark_last_hops` (the DiT thread, as it takes a call's jobs): a streaming hop that starts while its request's
    final is queued and no other hop of it is marks `last_hop` (it will commit nothing to the prefix pool); a hop
    with another hop of its request still queued, one whose final is not queued yet, a hop already mid-solve and
    finals / offline jobs are left alone."""
    from types import SimpleNamespace

    from cosytrt.runtime.scheduling.token2wav_worker import Token2WavWorker

    def job(r, final, streaming=True):
        return SimpleNamespace(r=r, finalize=final, streaming=streaming, last_hop=False)

    a, b, c, d, e = (SimpleNamespace(name=n) for n in "abcde")
    last, more, early, mid, fin = job(a, False), job(b, False), job(c, False), job(d, False), job(e, True)
    w = Token2WavWorker.__new__(Token2WavWorker)
    w.active = {id(mid): (mid, object())}
    w.dit = [job(a, True), job(b, False), job(b, True), job(d, True)]
    w._mark_last_hops([last, more, early, mid, fin])
    assert last.last_hop and not more.last_hop and not early.last_hop and not mid.last_hop and not fin.last_hop


def test_prefix_of_a_queued_final_is_freed_before_it_runs():
    """`_free_prefixes_of_finals` (the DiT thread, before it picks the next call): a stream whose oldest queued job
    is its final and that has no hop in flight gives its flow prefix back at once; a stream with a hop still queued
    before its final, or one mid-solve, keeps it; offline requests and closed caches are left alone."""
    from types import SimpleNamespace

    from cosytrt.runtime.scheduling.stats import DitCounters
    from cosytrt.runtime.scheduling.token2wav_worker import Token2WavWorker

    class Cache:
        def __init__(self):
            self.closed = False
            self.closes = 0

        def close(self):
            self.closed = True
            self.closes += 1

    def req(stream=True):
        return SimpleNamespace(stream=SimpleNamespace(flow_cache=Cache()) if stream else None)

    def job(r, final):
        return SimpleNamespace(r=r, finalize=final)

    waiting_final, hop_first, mid_solve, offline = req(), req(), req(), req(stream=False)
    w = Token2WavWorker.__new__(Token2WavWorker)
    w.dit_counters = DitCounters()
    busy = job(mid_solve, False)
    w.active = {id(busy): (busy, object())}
    w.dit = [job(waiting_final, True), job(hop_first, False), job(hop_first, True), job(mid_solve, True),
             job(offline, True)]
    w._free_prefixes_of_finals()
    assert waiting_final.stream.flow_cache.closes == 1
    assert not hop_first.stream.flow_cache.closed and not mid_solve.stream.flow_cache.closed
    assert w.dit_counters.prefixes_freed_early == 1
    w._free_prefixes_of_finals()  # already closed: not again
    assert waiting_final.stream.flow_cache.closes == 1 and w.dit_counters.prefixes_freed_early == 1


def _numbered_events(monkeypatch, tw, log: list):
    """A fake torch.cuda.Event for token2wav_worker `tw`, numbered in creation order; `synchronize` appends
    ("wait", its number) to `log`. Returns the class (its `count`: events made)."""

    class Event:
        count = 0

        def __init__(self):
            Event.count += 1
            self.n = Event.count

        def record(self):
            pass

        def synchronize(self):
            log.append(("wait", self.n))

    monkeypatch.setattr(tw.torch.cuda, "Event", Event)
    return Event


@pytest.mark.parametrize("ahead", [1, 3])
def test_dit_fence_keeps_steps_ahead_in_flight(monkeypatch, ahead):
    """`_fence` (after each step-level DiT call, on CUDA): the host waits for the step launched `dit_steps_ahead`
    calls earlier, oldest first, so at most that many launched steps are not yet seen complete."""
    from collections import deque

    from cosytrt.runtime.scheduling import token2wav_worker as tw

    log = []
    _numbered_events(monkeypatch, tw, log)
    w = tw.Token2WavWorker.__new__(tw.Token2WavWorker)
    w._cuda, w._in_flight, w.config = True, deque(), SchedulerConfig(dit_steps_ahead=ahead)
    w.clock = StageClock(cuda=False)
    for i in range(6):
        w._fence()
        assert len(w._in_flight) == min(i + 1, ahead)
    assert [n for _, n in log] == list(range(1, 7 - ahead))
    assert w.clock.waits_s()["dit_fence"]["count"] == 6 - ahead  # each wait counted (stats()["waits_s"])
    from cosytrt.engines.errors import InputError

    for bad in (0, -1, 1.5):
        with pytest.raises(InputError, match="dit_steps_ahead"):
            SchedulerConfig(dit_steps_ahead=bad)


@pytest.mark.parametrize("ahead", [0, 1, 2])
def test_hift_fence_keeps_calls_ahead_in_flight(monkeypatch, ahead):
    """`_hift_fence` (after each vocoder call, on CUDA): with `hift_calls_ahead` N > 0 the HiFT thread waits for the
    call launched N calls earlier, oldest first, and hands over the chunks whose copies completed after each wait;
    0 (the default) records nothing and never waits (launches stay unbounded, as before)."""
    from collections import deque

    from cosytrt.engines.errors import InputError
    from cosytrt.runtime.scheduling import token2wav_worker as tw

    log = []
    Event = _numbered_events(monkeypatch, tw, log)
    w = tw.Token2WavWorker.__new__(tw.Token2WavWorker)
    w._cuda, w._hift_in_flight, w.config = True, deque(), SchedulerConfig(hift_calls_ahead=ahead)
    w.clock = StageClock(cuda=False)
    w._drain_transfers = lambda: log.append(("drain",))
    for i in range(5):
        w._hift_fence()
        assert len(w._hift_in_flight) == min(i + 1, ahead)
    if ahead == 0:
        assert log == [] and Event.count == 0 and "hift_fence" not in w.clock.waits_s()
    else:
        assert log == [x for n in range(1, 6 - ahead) for x in (("wait", n), ("drain",))]
        assert w.clock.waits_s()["hift_fence"]["count"] == 5 - ahead
    w._cuda = False  # CPU: nothing to wait for
    before = len(log)
    w._hift_fence()
    assert len(log) == before
    for bad in (-1, 1.5, True):
        with pytest.raises(InputError, match="hift_calls_ahead"):
            SchedulerConfig(hift_calls_ahead=bad)


@pytest.mark.parametrize("speed", [0.8, 1.25])
def test_speed_is_the_same_through_the_scheduler_and_alone(tts, speed):
    """`Request.speed` (offline): the scheduler resampled the final mel while the single-request reference
    (`Pipeline.run`) ignored it (52800 vs 42240 samples at 1.25: a config fuzz found it); both now resample it the
    same way (`token2wav.speed_mel`)."""
    req = make_request("Faster or slower.", seed=6, force_tokens=55, speed=speed)
    plain = np.concatenate(list(tts.pipeline.run(make_request("Faster or slower.", seed=6, force_tokens=55))))
    ref = np.concatenate(list(tts.pipeline.run(req)))
    got = tts.submit(req).result(timeout=60)
    assert ref.size != plain.size and abs(ref.size - plain.size / speed) <= 480
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, rtol=0, atol=BATCHED_ATOL)
