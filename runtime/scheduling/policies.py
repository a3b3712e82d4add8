"""The batching decisions, apart from the threads that carry them out.

* admission (`admit`): which waiting requests get a KV slot this AR step;
* AR pacing (`ar_step_due`): whether the next decode step is due or every stream is far enough ahead;
* DiT (`dit_order`, `pick_dit_group`): which ready DiT jobs form the next call, or how long to wait for more;
* HiFT (`pick_hift_jobs`, `hift_offline_groups`): which vocoder jobs run now, and how offline ones are grouped.

Each policy of POLICIES is a SchedulerConfig flag that can be switched off to measure what it buys.
"""
from __future__ import annotations

from ...engines.buckets import group_by_length
from .config import SchedulerConfig
from ..stages.request import RequestMetrics
from .state import first_per_request

POLICIES = ("continuous_batching", "dit_chunk_aligned", "dit_slack_priority", "hift_length_aware", "async_d2h")


def admit(waiting, running: int, free_slots: int, cfg: SchedulerConfig) -> int:
    """How many requests from the head of `waiting` (live ones, in order) get a slot now: as many as there are free
    slots, within the padded-token budget of one batched prefill (always at least one); none while requests are
    decoding when continuous batching is off (static batches)."""
    if running and not cfg.continuous_batching:
        return 0
    n, longest = 0, 0
    for r in waiting:
        if n >= free_slots:
            break
        width = max(longest, r.lm_input.shape[0])
        if n and width * (n + 1) > cfg.ar_max_prefill_tokens:
            break
        n, longest = n + 1, width
    return n


_CHAIN = 8  # requests of one listener followed back at most (a conversation's earlier sentences)
SPEECH_TOKENS_PER_S = 25  # CosyVoice3's speech tokens (one token = 0.04 s of audio)


def _still_to_come(m: RequestMetrics) -> float:
    """Audio seconds a running request will still deliver, as far as known: once its LM has finished
    (`tokens` set) the rest of its tokens' audio, before that nothing yet (a lower bound)."""
    return max(0.0, m.tokens / SPEECH_TOKENS_PER_S - m.audio_seconds) if m.tokens else 0.0


def _needed_from(m: RequestMetrics, depth: int = 0) -> float | None:
    """When the listener runs out of the audio that plays before `m` (perf_counter time): its submission plus the
    `buffered_s` it came with, or later the end of the request it follows; None while that one is still producing."""
    t = m.t_submit + m.buffered_s
    prev = m.follows
    if prev is not None and depth < _CHAIN:
        if not prev.total:
            return None  # still producing
        if prev.ttfa is not None:  # it delivered audio (one that ended without any does not count)
            start = _playback_start(prev, depth + 1)
            if start is None:
                return None
            t = max(t, start + prev.audio_seconds)
    return t


def _playback_start(m: RequestMetrics, depth: int = 0) -> float | None:
    need = _needed_from(m, depth)
    return None if need is None else max(m.t_submit + m.ttfa, need)


def playback_slack(m: RequestMetrics, now: float, depth: int = 0) -> float:
    """How far ahead of its listener a request is, in seconds: the audio it has delivered minus the time since its
    playback began. A client plays from the first chunk on — or, for a request that follows others of the same
    listener (`buffered_s` seconds of earlier audio still to play when it came, or `follows`: the request heard right
    before it), from when that earlier audio runs out, if later. Before its first chunk (and for offline requests,
    which deliver one chunk at the end) it is the time until the listener needs it: minus the time since submission
    for a request on its own (the longer it has waited, the more urgent). While the request it follows is still
    producing, it is that one's slack plus the audio that one will still deliver, as far as known (the listener needs
    it after all of that one's audio: otherwise a conversation's next sentence would compete with its current one)."""
    prev = m.follows
    if m.ttfa is None:
        need = _needed_from(m, depth)
        if need is None:
            return playback_slack(prev, now, depth + 1) + _still_to_come(prev)
        return need - now
    start = _playback_start(m, depth)
    if start is None:
        return m.audio_seconds + playback_slack(prev, now, depth + 1) + _still_to_come(prev)
    return m.audio_seconds - (now - start)


def ar_step_due(rows, now: float, lead_s: float, step_s: float) -> tuple[bool, float | None]:
    """AR pacing (`ar_pace_lead_s`): is the next decode step due now — (True, None) — or not yet: (False, seconds
    until a row needs it, None if none ever will on its own).

    A step is due while any running row needs tokens soon: an offline row (its audio waits for all its tokens), a
    stream before its first DiT job (its first audio waits for tokens), or a stream whose listener reaches the end of
    the audio its hops already cover (hop schedule `offset`, from playback start: `playback_start`, or now while it
    has not started) within `lead_s` plus the steps its next hop still needs (`step_s` each). Rows that are not due
    advance with those that are: a step of 32 rows costs about what a step of 2 does (BENCHMARKS.md run 8: 1.8 vs
    1.5 ms), so pacing makes fewer steps with more rows each instead of running every stream far ahead of its
    listener. Ordering only: with `batch_invariant` the tokens do not change; without it, as with any change of
    which rows share a step."""
    wait = None
    for r in rows:
        if r.dead:
            continue
        st = r.stream
        if st is None or r.dit_jobs == 0:
            return True, None
        hops, m = st.hops, r.metrics
        if hops.finished:
            continue
        start = _playback_start(m) if m.ttfa is not None else None
        start = now if start is None else start
        to_go = max(0, hops.next_fire() - len(r.tokens))
        margin = start + hops.offset / SPEECH_TOKENS_PER_S - now - lead_s - to_go * step_s
        if margin <= 0:
            return True, None
        wait = margin if wait is None else min(wait, margin)
    return False, wait


def dit_order(ready: list, now: float, slack_priority: bool) -> list:
    """The ready DiT jobs (one per request, in queue order) in the order the next call considers them: the first is
    the job the call is built around, the rest join it when of its kind and of similar length. `slack_priority`:
    least playback slack first (each request's slack read once), so a new request's first hop goes ahead of the
    later hops of streams that still have audio buffered (lower time to first audio under load) and an underrunning
    stream goes first of all; ties keep queue order. Otherwise queue order (the oldest job first)."""
    return slack_order(ready, now) if slack_priority else list(ready)


def slack_order(jobs: list, now: float) -> list:
    """`jobs` (each with `.r.metrics`) by least playback slack first (each request's slack read once); ties keep
    their order. The DiT's (`dit_order`) and the vocoder's (`pick_hift_jobs`) priority."""
    slack = [playback_slack(j.r.metrics, now) for j in jobs]
    return [jobs[i] for i in sorted(range(len(jobs)), key=lambda i: (slack[i], i))]


def _job_kind(job) -> tuple[tuple, int]:
    """Without a worker's `describe`: the job's (streaming, finalize) kind and its frames."""
    return job.kind, job.frames


def _first_audio(job) -> bool:
    """A streaming request's first DiT job: its listener has no audio yet."""
    return bool(getattr(job, "first", False)) and getattr(job.r, "stream", None) is not None


def pick_dit_group(queue: list, cfg: SchedulerConfig, now: float, more_coming: bool, describe=None,
                   cap=None, first_audio_now: bool = False) -> tuple[list, float | None]:
    """The next DiT call from the queued jobs: (jobs, None) to run now, or ([], seconds) to wait up to that long
    for more jobs (None: until notified; nothing is ready).

    The call is built around the first job of `dit_order` and takes ready jobs of its kind, grouped by cost (within
    `max_padding_waste`), at most `cap(kind)` (default `dit_max_requests`), waiting at most `dit_max_wait_ms` after
    that job was queued, and only while `more_coming` (the AR can still produce jobs) — with `first_audio_now` not
    when that job is a stream's first (its listener has nothing to play yet). `describe(job)` -> (kind,
    cost): the token2wav worker tells prefix-cached hops (cost: their new frames) from whole-history hops and finals
    (cost: all their frames); default: (streaming, finalize) and the job's frames. Requests in lockstep reach their
    hop boundaries in the same AR step, so their jobs are queued together (chunk-aligned dispatch). Without
    `dit_chunk_aligned`: one job per call, at once."""
    describe = describe or _job_kind
    ready = first_per_request(queue)
    if not ready:
        return [], None
    order = dit_order(ready, now, cfg.dit_slack_priority)
    anchor = order[0]
    if not cfg.dit_chunk_aligned:
        return [anchor], None
    kind = describe(anchor)[0]
    limit = cap(kind) if cap is not None else cfg.dit_max_requests
    same = [j for j in order if describe(j)[0] == kind]  # anchor first; equal costs group by urgency
    groups = group_by_length([describe(j)[1] for j in same], limit, cfg.max_padding_waste)
    group = [same[i] for i in next(g for g in groups if 0 in g)]
    left = anchor.t_enqueue + cfg.dit_max_wait_ms / 1e3 - now
    if len(same) < limit and left > 0 and more_coming and not (first_audio_now and _first_audio(anchor)):
        return [], left
    return group, None


def pick_dit_step(queue: list, active: list, cfg: SchedulerConfig, now: float, more_coming: bool, describe=None,
                  cap=None) -> tuple[list, float | None]:
    """Step-level DiT scheduling (`dit_step_level`): the rows of the next DiT call, which advances each by ONE Euler
    step (queued jobs start with it), like continuous batching of decode steps. `active`: jobs mid-solve.

    Returns (jobs, None) to run now, or ([], wait) when nothing is active and the call is waited for as
    `pick_dit_group` waits — except for a stream's first job, which starts at once: jobs that come later join
    its next step, so waiting for them buys no batching, only latency (5 ms of a first audio's ~120 ms at 1 req/s,
    run 39). The most urgent job (`dit_order` over queued and active jobs) decides the call's kind
    (`describe`: cached hops, whole-history hops and full-attention finals never share a call); rows of that kind,
    active or queued, grouped by cost around it, take the step together, at most `cap(kind)`. So a first hop that
    becomes ready joins at the next step instead of waiting for every step of a long final, and a final makes
    progress as soon as its stream's playback slack is the least. While rows are mid-solve nothing waits. With
    `cfg.dit_max_active` and that many jobs mid-solve, only a stream's first job may start."""
    describe = describe or _job_kind
    if not active:
        return pick_dit_group(queue, cfg, now, more_coming, describe, cap, first_audio_now=cfg.dit_first_now)
    busy = {id(j.r) for j in active}
    ready = [j for j in first_per_request(queue) if id(j.r) not in busy]
    if cfg.dit_max_active and len(active) >= cfg.dit_max_active:
        ready = [j for j in ready if j.first]  # at the bound only a stream's first job starts (`dit_max_active`)
    order = dit_order(ready + list(active), now, cfg.dit_slack_priority)
    anchor = order[0]
    kind = describe(anchor)[0]
    same = [j for j in order if describe(j)[0] == kind] if cfg.dit_chunk_aligned else [anchor]
    limit = cap(kind) if cap is not None else cfg.dit_max_requests
    groups = group_by_length([describe(j)[1] for j in same], limit, cfg.max_padding_waste)
    return [same[i] for i in next(g for g in groups if 0 in g)], None


def pick_hift_jobs(queue: list, cfg: SchedulerConfig, now: float, more_coming: bool) -> tuple[list, float | None]:
    """The next vocoder jobs: (jobs, None) to run now, or ([], seconds | None) to wait. Streaming jobs (at most
    `hift_max_batch`) advance their HiFT streams together; offline finals are grouped by `hift_offline_groups`.
    Waits up to `hift_max_wait_ms` after the oldest ready job for a fuller batch while DiT work is in flight, except
    when a stream's first chunk is ready (its listener is waiting for the first audio). More ready streams than a
    batch holds: `hift_slack_priority` takes the least playback slack first (a first chunk, an underrunning stream),
    as the DiT does (`dit_order`); otherwise queue order."""
    ready = first_per_request(queue)
    if not ready:
        return [], None
    left = ready[0].t_enqueue + cfg.hift_max_wait_ms / 1e3 - now
    first_audio = any(j.r.metrics.ttfa is None and j.r.stream is not None for j in ready)
    if len(ready) < cfg.hift_max_batch and left > 0 and more_coming and not first_audio:
        return [], left
    streams = [j for j in ready if j.r.stream is not None]
    if len(streams) > cfg.hift_max_batch and cfg.hift_slack_priority:
        streams = slack_order(streams, now)
    return streams[:cfg.hift_max_batch] + [j for j in ready if j.r.stream is None], None


def hift_offline_groups(lengths: list[int], cfg: SchedulerConfig) -> list[list[int]]:
    """Offline HiFT calls as index groups of `lengths` (mel frames): length-aware (within the padding-waste and
    frame budgets) or, without `hift_length_aware`, in arrival order."""
    return group_by_length(lengths, cfg.hift_max_batch, cfg.max_padding_waste, cfg.hift_max_frames,
                           length_aware=cfg.hift_length_aware)
