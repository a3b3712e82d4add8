"""Shape-only coverage: the stage calls a workload makes, simulated without running any model.

A call's shape follows from token counts, the hop schedule and batching: a streaming hop's DiT call runs on
2 (P + upto) frames (`HopSchedule`, whole history: the default `flow_prefix_cache=False`), a final / offline call on
2 (P + N) frames, each for 10 Euler steps at 2 CFG rows per request; streaming HiFT windows follow `push_batch`'s window
arithmetic (`HiFTWindows`, checked against the real `HiFTStream` in tests/test_coverage_profile.py), offline HiFT
takes the whole 2 N frames. Which requests share a call is decided by the runtime's own policies
(`pick_dit_group`, `pick_hift_jobs`, `hift_offline_groups` with a `SchedulerConfig`) on a simulated clock: arrivals at
their times, one AR step per `ar_step_s` for every decoding request (at most `ar_max_batch`), and DiT / HiFT calls that
take the time of a linear cost model (`SimCosts`: a coarse model of the full-size model on one H200, from the
BENCHMARKS.md micro rows; only the order and overlap of events depend on it, not a call's length).

`simulate(requests, ...)` returns call tuples like the ones `CallRecorder` records (bucket None: `rate_calls` assigns
the buckets of a profile), so the report, the heatmap and the profile derivation work on either. Final streaming HiFT
windows are recorded at n + 4 frames, as `BucketedStreamDecoder` records them.

`CachedHops` switches the simulation to the runtime's defaults where a profile has a cached-hop grid: the flow
prefix cache (a non-final hop computes only the frames past its committed prefix, `flow_hops.plan_hops`: commits end
on 50-frame chunks), the speaker prompt cache (a saved voice's whole prompt chunks are computed by its first stream
and reused by the later ones) and, with `step_level`, Euler-step DiT scheduling (`pick_dit_step`: one call per step,
rows at different steps together). Its `calls` collect one (requests, new frames, prefix frames) per cached-hop
estimator call, the shape `CachedGrid.select` sees (`rate_cached`, `coverage_profile.derive_cached_grid`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..engines.buckets import CFG_ROWS
from ..engines.errors import InputError

STEPS = 10            # Euler steps per DiT job
FINAL = "final window"  # reason field of a simulated final HiFT stream window (before rating)
WINDOW_STEP = 16      # runtime/models/hift_stream.py


@dataclass(frozen=True)
class SimCosts:
    """Seconds of the simulated clock (full-size model, compiled + CUDA graphs, one H200; BENCHMARKS.md micro rows:
    DiT step 1.83 ms at 2 x 200 frames, 18.9 ms at 32 x 500; AR decode step ~1.7-2 ms up to batch 32)."""
    ar_step_s: float = 0.002
    ar_prefill_s: float = 0.004
    dit_step_s: float = 0.0015       # per Euler step
    dit_row_frame_s: float = 1.1e-6  # per CFG row x frame per Euler step
    hift_call_s: float = 0.002
    hift_row_frame_s: float = 2e-6
    tick_s: float = 0.001


@dataclass(frozen=True)
class HiFTGeometry:
    """The receptive-field numbers of the streaming vocoder (`HiFT`): the same for the tiny and full configs."""
    context: int = 30          # decode_left_context()
    f0_look: int = 3           # f0_look_right
    f0_left: int = 8           # f0_left_context
    pre_look: int = 4          # conv_pre_look_right

    @property
    def held(self) -> int:
        return self.f0_look + self.pre_look + 1

    @classmethod
    def of(cls, hift) -> "HiFTGeometry":
        return cls(hift.decode_left_context(), hift.f0_look_right, hift.f0_left_context, hift.conv_pre_look_right)


@dataclass
class CachedHops:
    """Simulate prefix-cached hops (see the module doc). `cap`: most requests per cached-hop call (the runtime caps
    them at the grid's largest batch); `prompt_cache`: a saved voice's prompt chunks are reused after its first
    stream; `step_level`: Euler-step DiT scheduling (the runtime's default); `chunk`: the DiT's attention chunk."""
    cap: int = 8
    prompt_cache: bool = True
    step_level: bool = True
    chunk: int = 50
    lookahead: int = 3
    calls: list = field(default_factory=list)

    def prompt_split(self, prompt_tokens: int) -> int:
        """`flow_cache.prompt_cacheable_frames`: whole chunks before 2 * (prompt - look-ahead) frames."""
        limit = 2 * max(0, prompt_tokens - self.lookahead)
        return limit // self.chunk * self.chunk


class HiFTWindows:
    """`HiFTStream`'s bookkeeping in whole frames: `push(n_new, finalize)` -> the decode window length, or None."""

    def __init__(self, g: HiFTGeometry):
        self.g = g
        self.frames = self.emitted = self.mel_start = self.f0_start = self.f0_end = 0
        self.context_frames = g.context + WINDOW_STEP - 1

    def push(self, n_new: int, finalize: bool) -> int | None:
        g = self.g
        self.frames += n_new
        target = self.frames if finalize else max(self.frames - g.f0_look, self.f0_end)
        if target > self.f0_end:
            self.f0_end = self.frames if finalize else self.frames - g.f0_look
        window = None
        out_end = self.frames if finalize else self.frames - g.held
        if out_end > self.emitted and self.frames:
            hi = self.frames if finalize else self.frames - g.f0_look
            lo = max(0, self.emitted - g.context)
            rounded = hi - -(-(hi - lo) // WINDOW_STEP) * WINDOW_STEP
            if rounded >= max(self.mel_start, self.f0_start):
                lo = rounded
            window = hi - lo
            self.emitted = hi if finalize else hi - g.pre_look - 1
        decode_lo = max(0, self.emitted - self.context_frames)
        self.mel_start = max(self.mel_start, max(0, min(decode_lo, self.f0_end - g.f0_left)))
        self.f0_start = max(self.f0_start, max(0, min(decode_lo, self.f0_end - 1)))
        return window


class _Metrics:  # what playback_slack reads
    def __init__(self, t_submit: float):
        self.t_submit, self.ttfa, self.audio_seconds, self.buffered_s, self.follows = t_submit, None, 0.0, 0.0, None


class _Req:
    def __init__(self, i: int, t: float, tokens: int, stream: bool, prompt_tokens: int, g: HiFTGeometry):
        from ..runtime.stages.hop_schedule import HopSchedule

        self.i, self.tokens, self.P = i, tokens, prompt_tokens
        self.metrics = _Metrics(t)
        self.produced = 0
        self.hops = HopSchedule(prompt_tokens) if stream else None
        self.stream = HiFTWindows(g) if stream else None  # pick_hift_jobs: stream jobs have r.stream
        self.committed = 0  # prefix-cached frames (CachedHops)


@dataclass
class _Job:
    r: _Req
    streaming: bool
    finalize: bool
    frames: int          # DiT call frames (DiT job) or new mel frames (HiFT job)
    t_enqueue: float
    new: int = 0         # DiT job: the new mel frames it hands to HiFT
    audio: float = 0.0   # HiFT job: audio seconds it delivered
    start: int | None = None  # cached-hop DiT job: its committed prefix frames (None: a whole-history call)
    steps: int = STEPS   # DiT job: Euler steps left

    @property
    def kind(self) -> tuple[bool, bool]:
        return self.streaming, self.finalize

    @property
    def final(self) -> bool:
        return self.finalize


def simulate(requests, prompt_tokens: int = 75, config=None, costs: SimCosts | None = None,
             geometry: HiFTGeometry | None = None, sample_rate: int = 24000,
             cached: CachedHops | None = None) -> list[tuple]:
    """The stage calls of `requests` (coverage WorkloadRequests with speech_tokens; arrival_s, else all at 0):
    [(stage, mode, b, n, None, seconds, None)], in simulated time order. `cached`: simulate prefix-cached hops (and
    Euler-step scheduling, `cached.step_level`); their estimator calls go to `cached.calls`, not to the list."""
    from ..runtime.scheduling.config import SchedulerConfig
    from ..runtime.scheduling.policies import hift_offline_groups, pick_dit_group, pick_dit_step, pick_hift_jobs

    cfg = config or SchedulerConfig()
    c = costs or SimCosts()
    g = geometry or HiFTGeometry()
    spf_s = 480 / sample_rate
    pending = sorted(((r.arrival_s or 0.0, r) for r in requests), key=lambda x: x[0])
    reqs = [_Req(i, t, max(1, int(r.speech_tokens or 1)), r.stream, prompt_tokens, g)
            for i, (t, r) in enumerate(pending)]
    waiting, decoding, dit_q, hift_q, dit_out, active = [], [], [], [], [], []
    calls: list[tuple] = []
    t, nxt, ar_next, dit_free, hift_free, done = 0.0, 0, 0.0, 0.0, 0.0, 0
    voice = {"warm": False}  # one saved voice: its prompt chunks are cached once its first stream committed them
    split = cached.prompt_split(prompt_tokens) if cached is not None else 0

    def hop_start(j: _Job) -> int:  # flow_hops.plan_hops: the committed prefix, or the cached prompt chunks
        if j.start is not None:
            return j.start
        if j.r.committed == 0 and voice["warm"] and 0 < split <= j.frames // cached.chunk * cached.chunk:
            return split
        return j.r.committed

    def describe(j: _Job) -> tuple:  # token2wav_worker.describe
        if j.start is not None or (cached is not None and j.streaming and not j.finalize):
            return "cached", max(1, j.frames - hop_start(j))
        return ("stream" if j.streaming else "offline"), j.frames

    def cap(kind) -> int:
        return min(cfg.dit_max_requests, cached.cap) if kind == "cached" and cached is not None else \
            cfg.dit_max_requests

    def dit_call(group: list, steps: int) -> float:
        """Record `steps` estimator calls of `group` (one kind); the simulated seconds they take."""
        kind = describe(group[0])[0]
        if kind == "cached":
            for j in group:
                if j.start is None:
                    j.start = hop_start(j)
            n = max(j.frames - j.start for j in group)
            p = max(j.start for j in group)
            cached.calls.extend([(len(group), n, p)] * steps)
            return steps * (c.dit_step_s + c.dit_row_frame_s * CFG_ROWS * len(group) * n)
        b, n = CFG_ROWS * len(group), max(j.frames for j in group)
        step_s = c.dit_step_s + c.dit_row_frame_s * b * n
        calls.extend([("dit", "stream" if kind == "stream" else "offline", b, n, None, step_s, None)] * steps)
        return steps * step_s

    def dit_finished(j: _Job, at: float) -> None:
        if j.start is not None:  # its commit: whole chunks up to its last frame; the first one caches the prompt
            j.r.committed = j.frames // cached.chunk * cached.chunk
            voice["warm"] = voice["warm"] or (cached.prompt_cache and split > 0)
        dit_out.append((at, j))

    while done < len(reqs):
        while nxt < len(reqs) and reqs[nxt].metrics.t_submit <= t:
            waiting.append(reqs[nxt])
            nxt += 1
        if t >= ar_next and (waiting or decoding):
            prefill = False
            while waiting and len(decoding) < cfg.ar_max_batch:
                decoding.append(waiting.pop(0))
                prefill = True
            for r in decoding:
                r.produced += 1
                while r.hops is not None and r.produced < r.tokens and r.hops.ready(r.produced):
                    off, upto = r.hops.advance()
                    dit_q.append(_Job(r, True, False, 2 * (r.P + upto), t, new=2 * (upto - off)))
                if r.produced >= r.tokens:
                    off = r.hops.finish(r.tokens) if r.hops is not None else 0
                    dit_q.append(_Job(r, False, True, 2 * (r.P + r.tokens), t, new=2 * (r.tokens - off)))
            decoding = [r for r in decoding if r.produced < r.tokens]
            ar_next = t + c.ar_step_s + (c.ar_prefill_s if prefill else 0.0)
        if t >= dit_free and (dit_q or active):
            more = bool(waiting or decoding or nxt < len(reqs))
            if cached is not None and cached.step_level:
                group, _ = pick_dit_step(dit_q, active, cfg, t, more, describe, cap)
                if group:
                    taken = {id(j) for j in group}
                    dit_q = [j for j in dit_q if id(j) not in taken]
                    active += [j for j in group if not any(j is a for a in active)]
                    dit_free = t + dit_call(group, 1)
                    for j in group:
                        j.steps -= 1
                        if j.steps == 0:
                            dit_finished(j, dit_free)
                    active = [j for j in active if j.steps > 0]
            else:
                group, _ = pick_dit_group(dit_q, cfg, t, more, describe if cached is not None else None,
                                          cap if cached is not None else None)
                if group:
                    taken = {id(j) for j in group}
                    dit_q = [j for j in dit_q if id(j) not in taken]
                    dit_free = t + dit_call(group, STEPS)
                    for j in group:
                        j.steps = 0
                        dit_finished(j, dit_free)
        for item in [x for x in dit_out if x[0] <= t]:
            dit_out.remove(item)
            j = item[1]
            hift_q.append(_Job(j.r, j.r.stream is not None, j.finalize, j.new, item[0]))
        if t >= hift_free and hift_q:
            jobs, _ = pick_hift_jobs(hift_q, cfg, t, bool(dit_q or dit_out or active or t < dit_free))
            if jobs:
                taken = {id(j) for j in jobs}
                hift_q = [j for j in hift_q if id(j) not in taken]
                dur = 0.0
                streams = [j for j in jobs if j.r.stream is not None]
                groups: dict = {}
                for j in streams:
                    before = j.r.stream.emitted
                    w = j.r.stream.push(j.frames, j.finalize)
                    j.audio = (j.r.stream.emitted - before) * spf_s
                    if w is not None:
                        groups.setdefault((w, j.finalize), []).append(j)
                for (w, fin), grp in groups.items():
                    n = w + g.pre_look if fin else w
                    calls.append(("hift", "stream", len(grp), n, None, c.hift_call_s, FINAL if fin else None))
                    dur += c.hift_call_s + c.hift_row_frame_s * len(grp) * n
                offline = [j for j in jobs if j.r.stream is None]
                for idx in hift_offline_groups([j.frames for j in offline], cfg):
                    n = max(offline[i].frames for i in idx)
                    calls.append(("hift", "offline", len(idx), n, None, c.hift_call_s, None))
                    dur += c.hift_call_s + c.hift_row_frame_s * len(idx) * n
                for j in offline:
                    j.audio = j.frames * spf_s
                hift_free = t + dur
                for j in jobs:
                    m = j.r.metrics
                    if m.ttfa is None and j.audio > 0:
                        m.ttfa = hift_free - m.t_submit
                    m.audio_seconds += j.audio
                    done += bool(j.finalize)
        t = round(t + c.tick_s, 9)
        if t > 1e5:
            raise InputError("coverage simulation did not finish within 1e5 simulated seconds: the workload is "
                             "too large to simulate (fewer or shorter requests)")
    return calls


def rate_calls(calls: list[tuple], tables: dict, finals_eager: bool = False) -> list[tuple]:
    """`calls` with the bucket each would get from `tables` ({(stage, mode): BucketTable}): key or None with the
    miss reason (no table: 'no engine for this mode'). `finals_eager`: simulated final HiFT stream windows fall back
    as they did before BucketedStreamDecoder had a tail runner."""
    out = []
    for stage, mode, b, n, _, sec, why in calls:
        if finals_eager and why == FINAL:
            out.append((stage, mode, b, n, None, sec, "final window (own iSTFT edge)"))
            continue
        table = tables.get((stage, mode))
        if table is None or not len(list(table)):
            out.append((stage, mode, b, n, None, sec, "no engine for this mode"))
            continue
        if stage == "dit":  # BucketedDiT splits a call's rows over buckets before falling back (BucketTable.plan)
            for k, bk in table.plan(b, n):
                out.append((stage, mode, k, n, bk.key if bk is not None else None, sec * k / b,
                            None if bk is not None else table.miss_reason(k, n)))
            continue
        bk = table.select(b, n)
        out.append((stage, mode, b, n, bk.key if bk is not None else None, sec,
                    None if bk is not None else table.miss_reason(b, n)))
    return out


def hit_rates(calls: list[tuple]) -> dict:
    """{stage/mode: {calls, hits, hit_rate}} of rated calls, plus 'total'."""
    out: dict = {}
    for stage, mode, _, _, key, _, _ in calls:
        d = out.setdefault(f"{stage}/{mode}", {"calls": 0, "hits": 0})
        d["calls"] += 1
        d["hits"] += key is not None
    tot = {"calls": sum(d["calls"] for d in out.values()), "hits": sum(d["hits"] for d in out.values())}
    out = dict(sorted(out.items()))
    out["total"] = tot
    for d in out.values():
        d["hit_rate"] = d["hits"] / d["calls"] if d["calls"] else math.nan
    return out


LINEAR_FRAMES = 3072  # cached-hop work model: a frame's linear layers cost about as much as attending 3072 frames


def hop_work(b: int, n: int, p: int) -> int:
    """Relative work of a cached-hop call of b requests, n new frames after p cached ones: per new frame its linear
    layers (~12 d^2 FLOPs per layer, d = 1024) plus attention over the n + p frames (~4 d per frame), i.e.
    b n (3072 + n + p); the in-graph prefix gather adds b p copies, small beside it."""
    return b * n * (LINEAR_FRAMES + n + p)


def rate_cached(calls: list[tuple], grid) -> dict:
    """{calls, hits, hit_rate, work_ratio, graphs} of cached-hop calls [(b, n, p)] in `grid` (a CachedGrid; None:
    no grid, every call eager). work_ratio: padded work / real work of the calls that hit (`hop_work`)."""
    hits, real, padded = 0, 0, 0
    for b, n, p in calls:
        key = grid.select(b, n, p) if grid is not None else None
        if key is not None:
            hits += 1
            real += hop_work(b, n, p)
            padded += hop_work(*key)
    return {"calls": len(calls), "hits": hits, "hit_rate": hits / len(calls) if calls else math.nan,
            "work_ratio": padded / real if real else math.nan, "graphs": len(grid.keys()) if grid is not None else 0}
