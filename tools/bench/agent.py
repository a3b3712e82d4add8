"""Voice-agent cells (`trtbuild bench --suite agent`): conversations on the websocket endpoint, as a voice agent
drives it. Sessions arrive as a Poisson process; each streams an LLM-like reply into `WS /v1/audio/speech/stream`
(word pieces at `words_per_s`, sentences of `words` words ending in '.', then input.done) and plays the audio it
gets back from the first byte on, sentence after sentence. A real uvicorn server (serve()'s own configuration) runs
over the bench's TTS in a thread; the clients are `websockets` coroutines in this process.

What a listener of a voice agent suffers, per session (analyse()):
- sentence TTFA: first audio of a sentence after its text was complete (the '.' and the space after it sent);
- avoidable stalls: playback ran dry although the next audio's text had been complete before it did — a stall
  the server could have prevented (a sentence boundary: the next sentence started too late; or a chunk inside a
  sentence came late). Gaps while the LLM had not yet sent the text are counted apart (text-bound seconds).
A/B over server settings (`parse_settings`: e.g. `ws_lookahead=0`, `ws_lookahead=1+ws_buffer_hints=0`): each
setting runs the rate sweep with its own server over the same TTS.

Pure parts (plan_sessions, analyse, summarize_agent) are tested on the CPU (tests/test_bench_agent.py), the driver
with the tiny model."""
from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time
from dataclasses import dataclass, field

from .gil_probe import GilProbe
from .gpu_util import GpuUtilProbe
from .open_loop import scheduler_stats, stats_delta
from .playback import distribution


@dataclass(frozen=True)
class AgentSpec:
    rate: float = 0.5              # sessions per second
    duration_s: float = 20.0       # seconds of session arrivals per cell
    seed: int = 0
    sentences: tuple = (2, 5)      # sentences per reply (inclusive range)
    words: tuple = (6, 16)         # words per sentence
    sentence_s: tuple = (1.5, 4.0)  # audio seconds per sentence of a session (forced tokens; drawn per session)
    words_per_s: float = 12.0      # the LLM's text speed (~30 tokens/s)

    def at_rate(self, rate: float) -> "AgentSpec":
        return AgentSpec(rate, self.duration_s, self.seed, self.sentences, self.words, self.sentence_s,
                         self.words_per_s)


@dataclass
class SessionPlan:
    arrival: float
    sentences: list[str]
    force_tokens: int  # per sentence (the session's config applies to each)
    seed: int


def plan_sessions(spec: AgentSpec) -> list[SessionPlan]:
    """Seeded Poisson arrivals over `duration_s` and each session's reply."""
    rng = random.Random(spec.seed)
    t, out = 0.0, []
    while True:
        t += rng.expovariate(spec.rate)
        if t >= spec.duration_s:
            return out
        n = rng.randint(*spec.sentences)
        sentences = [" ".join("word" for _ in range(rng.randint(*spec.words))) + "." for _ in range(n)]
        seconds = rng.uniform(*spec.sentence_s)
        out.append(SessionPlan(t, sentences, max(1, round(seconds * 25)), rng.randrange(1 << 30)))


@dataclass
class SessionRecord:
    plan: SessionPlan
    text_complete: list = field(default_factory=list)  # per sentence: when its text was complete (s after cell start)
    chunks: list = field(default_factory=list)          # (arrival s, audio s, sentence index)
    error: str | None = None
    done: bool = False


def analyse(rec: SessionRecord) -> dict:
    """Sentence TTFAs, avoidable stalls (count, seconds) and text-bound gap seconds of one session's playback."""
    firsts: dict[int, float] = {}
    for t, _, i in rec.chunks:
        firsts.setdefault(i, t)
    ttfa = [firsts[i] - rec.text_complete[i] for i in sorted(firsts) if i < len(rec.text_complete)]
    end, stalls, stall_s, text_bound_s, seen = None, 0, 0.0, 0.0, set()
    for t, d, i in rec.chunks:
        first_of_sentence = i not in seen
        seen.add(i)
        if end is None:
            end = t + d
            continue
        if t > end:
            gap = t - end
            ready = rec.text_complete[i] if i < len(rec.text_complete) else 0.0
            if first_of_sentence and ready > end:  # the LLM had not sent it yet when playback ran dry: the gap up
                text_bound_s += min(gap, ready - end)  # to then is the LLM's, the rest the sentence's own TTFA
            else:
                stalls += 1
                stall_s += gap
        end = max(end, t) + d
    return {"sentence_ttfa": ttfa, "stalls": stalls, "stall_s": stall_s, "text_bound_s": text_bound_s,
            "audio_s": sum(d for _, d, _ in rec.chunks)}


def summarize_agent(records: list[SessionRecord], wall_s: float) -> dict:
    parts = [analyse(r) for r in records if r.done and r.error is None]
    ttfa = [x for p in parts for x in p["sentence_ttfa"]]
    first = [p["sentence_ttfa"][0] for p in parts if p["sentence_ttfa"]]
    audio = sum(p["audio_s"] for p in parts)
    return {"sessions": len(records), "completed": len(parts),
            "failed": sum(r.error is not None for r in records),
            "unfinished": sum(not r.done and r.error is None for r in records),
            "sentences": sum(len(r.plan.sentences) for r in records),
            "sentence_ttfa": distribution(ttfa), "first_sentence_ttfa": distribution(first),
            "stalled_sessions": sum(p["stalls"] > 0 for p in parts), "stalls": sum(p["stalls"] for p in parts),
            "stall_s": sum(p["stall_s"] for p in parts), "text_bound_s": sum(p["text_bound_s"] for p in parts),
            "audio_s": audio, "audio_s_per_s": audio / wall_s if wall_s > 0 else None, "wall_s": wall_s,
            "errors": sorted({r.error for r in records if r.error})[:5]}


# ------------------------------------------------------------------------------------------------ the driver

async def _session(url: str, plan: SessionPlan, t0: float, words_per_s: float, rec: SessionRecord,
                   timeout_s: float) -> None:
    from websockets.asyncio.client import connect

    def now():
        return time.perf_counter() - t0

    await asyncio.sleep(max(0.0, plan.arrival - now()))
    rec.text_complete = [float("inf")] * len(plan.sentences)
    try:
        async with connect(url, max_size=None, open_timeout=timeout_s) as ws:
            await ws.send(json.dumps({"type": "session.config", "model": "bench", "stream_audio": True,
                                      "force_tokens": plan.force_tokens, "seed": plan.seed}))
            configured = json.loads(await asyncio.wait_for(ws.recv(), timeout_s))
            if configured.get("type") != "session.configured":
                raise RuntimeError(f"session refused: {configured}")
            rate = configured["sample_rate"]

            async def send_text():
                gap = 1.0 / words_per_s
                for i, sentence in enumerate(plan.sentences):
                    for j, word in enumerate(sentence.split(" ")):
                        await ws.send(json.dumps({"type": "input.text", "text": (" " if i or j else "") + word}))
                        if j == 0 and i > 0:
                            rec.text_complete[i - 1] = now()  # the space after the previous '.' is out
                        await asyncio.sleep(gap)
                await ws.send(json.dumps({"type": "input.done"}))
                rec.text_complete[-1] = now()

            sender = asyncio.create_task(send_text())
            index = -1
            while True:
                msg = await asyncio.wait_for(ws.recv(), timeout_s)
                if isinstance(msg, bytes):
                    rec.chunks.append((now(), len(msg) / 2 / rate, index))
                    continue
                event = json.loads(msg)
                if event["type"] == "audio.start":
                    index = event["sentence_index"]
                elif event["type"] == "session.done":
                    rec.done = True
                    break
                elif event["type"] == "error":
                    raise RuntimeError(event["error"]["message"])
            await sender
    except Exception as e:  # noqa: BLE001 - recorded per session
        rec.error = f"{type(e).__name__}: {e}"[:200]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    """uvicorn over `tts` in a thread (the server's own configuration), for one setting."""

    def __init__(self, tts, **settings):
        import uvicorn

        from ...runtime.serving.app import ServerSettings, create_app, uvicorn_config

        self.port = _free_port()
        self.settings = ServerSettings(port=self.port, warmup=False, log_level="warning", **settings)
        self.server = uvicorn.Server(uvicorn_config(create_app(tts, self.settings), self.settings))
        self.thread = threading.Thread(target=self.server.run, name="agent-bench-uvicorn", daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the bench server did not start")
            time.sleep(0.02)
        return f"ws://127.0.0.1:{self.port}/v1/audio/speech/stream"

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)


def parse_settings(text: str) -> list[tuple[str, dict]]:
    """"ws_lookahead=0,ws_lookahead=1+ws_buffer_hints=0" -> [(label, ServerSettings overrides)]; names must be
    integer or boolean ServerSettings fields (ValueError naming the bad one)."""
    import dataclasses

    from ...runtime.serving.settings import ServerSettings

    kinds = {f.name: f.type for f in dataclasses.fields(ServerSettings)}
    out = []
    for label in (x.strip() for x in text.split(",") if x.strip()):
        overrides = {}
        for pair in label.split("+"):
            name, _, value = pair.partition("=")
            kind = str(kinds.get(name))
            if kind not in ("int", "bool") or not value.isdigit():
                raise ValueError(f"agent setting {pair!r}: give an int or bool server setting as name=number")
            overrides[name] = bool(int(value)) if kind == "bool" else int(value)
        out.append((label, overrides))
    if not out:
        raise ValueError("no agent settings given")
    return out


def run_agent_cell(tts, spec: AgentSpec, overrides: dict | None = None, label: str = "default",
                   max_in_flight: int = 256, timeout_s: float = 120.0) -> dict:
    """One cell: a server with the `overrides` of ServerSettings, the seeded sessions, their summary."""
    plans = plan_sessions(spec)
    records = [SessionRecord(p) for p in plans]
    with _Server(tts, **{"max_in_flight": max_in_flight, "max_queue": max_in_flight,
                         "max_ws_sessions": max(64, 2 * len(plans)), **(overrides or {})}) as url:
        async def main():
            t0 = time.perf_counter()
            await asyncio.gather(*(_session(url, p, t0, spec.words_per_s, r, timeout_s)
                                   for p, r in zip(plans, records)))
            return time.perf_counter() - t0

        before = scheduler_stats(tts)
        cuda = getattr(getattr(tts.pipeline, "device", None), "type", "") == "cuda"
        with GilProbe() as gil, GpuUtilProbe(cuda) as gpu:
            wall = asyncio.run(main())
        busy = stats_delta(before, scheduler_stats(tts), wall)["busy"]
    return {"setting": label, "overrides": dict(overrides or {}), "rate": spec.rate,
            **summarize_agent(records, wall), "busy": busy, "gil_wait_ms": gil.summary(),
            "gpu_util_pct": gpu.summary()}


def bench_agent(cfg, llm, flow, hift, device, bench, variant: str, spec: AgentSpec, rates: list[float],
                settings: list[tuple[str, dict]]) -> dict:
    """Per server setting, the rate sweep over one TTS on the `variant` pipeline; results under
    bench.results["agent"], saved after every cell."""
    from .common import log, make_pipeline, random_models, scheduler_config, start_tts

    out: dict = {"variant": variant, "spec": spec.__dict__, "rates": rates, "cells": []}
    bench.results["agent"] = out
    models = random_models(cfg, llm, flow, hift, getattr(bench.args, "model", "full"))
    pipe = make_pipeline(models, variant, bench.args.graph_profile, getattr(bench.args, "engines", None))
    tts = start_tts(pipe, scheduler_config(variant, max_in_flight=256))
    try:
        for label, overrides in settings:
            for rate in rates:
                if bench.over_budget():
                    log(f"agent: skip {label} at {rate:g} sessions/s (time budget)")
                    break
                cell = run_agent_cell(tts, spec.at_rate(rate), overrides, label)
                out["cells"].append(cell)
                bench.save()
                t = cell["sentence_ttfa"]
                log(f"agent {label}, {rate:g} sessions/s: {cell['completed']}/{cell['sessions']} "
                    f"sessions, sentence TTFA p50 {t['p50']} p95 {t['p95']} s; avoidable stalls {cell['stalls']} "
                    f"in {cell['stalled_sessions']} sessions ({cell['stall_s']:.2f} s); {cell['audio_s_per_s']:.1f} "
                    f"audio s/s; busy " + ", ".join(f"{k} {v:.2f}" for k, v in cell["busy"].items())
                    + f"; GIL wait p95 {cell['gil_wait_ms']['p95']} ms")
    finally:
        tts.close()
    return out
