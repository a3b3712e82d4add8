"""What the listeners of an open-loop cell hear: playback underruns and stalls of a chunk timeline, and the cell's
summary from its per-request records. Pure functions (no model, no clock): the driver in open_loop.py records the
timelines, tests/test_bench_open_loop.py checks the math on hand-made ones."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Sequence

OK, FAILED, UNFINISHED, NOT_SUBMITTED, SHED = "ok", "failed", "unfinished", "not_submitted", "shed"


def underruns(arrivals: Sequence[float], durations: Sequence[float], tolerance_s: float = 0.0) -> tuple[int, float]:
    """Playback of one stream: it starts when the first chunk arrives and plays the chunks back to back, each as
    soon as the audio before it has finished playing and it has arrived. An underrun is a chunk that arrives after
    the audio before it finished playing (by more than `tolerance_s`); playback stalls until it arrives.
    Returns (underruns, stall seconds). `arrivals` in seconds (non-decreasing), `durations` in audio seconds."""
    if len(arrivals) != len(durations):
        raise ValueError(f"underruns: {len(arrivals)} arrival times for {len(durations)} chunk durations")
    if not arrivals:
        return 0, 0.0
    end = arrivals[0] + durations[0]  # when the audio delivered so far has finished playing
    n, stall = 0, 0.0
    for t, d in zip(arrivals[1:], durations[1:]):
        if t - end > tolerance_s:
            n += 1
            stall += t - end
        end = max(end, t) + d
    return n, stall


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), None for no values."""
    v = sorted(float(x) for x in values if x is not None and math.isfinite(x))
    if not v:
        return None
    k = (len(v) - 1) * q / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def distribution(values: Sequence[float]) -> dict:
    return {"p50": percentile(values, 50), "p95": percentile(values, 95), "p99": percentile(values, 99),
            "max": max(values) if values else None, "n": len(values)}


@dataclass
class RequestRecord:
    """One request of an open-loop cell; times in seconds after the start of the cell."""
    arrival: float                       # when it was due (the Poisson arrival time)
    audio_s: float                       # its forced audio length
    stream: bool
    chunk_t: list = field(default_factory=list)  # when each chunk reached the caller's handle
    chunk_s: list = field(default_factory=list)  # audio seconds of each chunk
    status: str = OK                     # ok / failed / unfinished (cut at the end of the cell) / not_submitted /
    #                                      shed (refused at submit by load shedding: no audio owed, no TTFA)
    error: str | None = None
    marks: dict = field(default_factory=dict)  # RequestMetrics.marks: seconds after submit (see ttfa_parts)
    ttfa_s: float | None = None          # RequestMetrics.ttfa: first chunk, seconds after submit


def wait_or_cancel(handles: Sequence, deadline: float) -> set:
    """The end of an open-loop cell: wait for each submitted handle (None: never submitted) until `deadline`
    (`time.perf_counter()`), cancel those still running then; returns their indices (counted unfinished). A handle
    that failed is left for its record to tell."""
    cut = set()
    for i, h in enumerate(handles):
        if h is None:
            continue
        try:
            h.result(timeout=max(0.0, deadline - time.perf_counter()))
        except TimeoutError:
            cut.add(i)
            h.cancel()
        except Exception:  # noqa: BLE001 - its error is recorded by the caller
            pass
    return cut


# time to first audio split at RequestMetrics.marks: (part, mark it starts at, mark it ends at); None = submit / ttfa
TTFA_PARTS = (("tokenizer", None, "tokenized"), ("frontend", "tokenized", "frontend_done"),
              ("admission", "frontend_done", "prefill"), ("ar", "prefill", "dit_queued"),
              ("dit_wait", "dit_queued", "dit_start"), ("dit", "dit_start", "dit_end"), ("vocoder", "dit_end", None))
_TTFA_MARKS = tuple(dict.fromkeys(m for _, a, b in TTFA_PARTS for m in (a, b) if m is not None))


def ttfa_parts(records: Sequence[RequestRecord]) -> dict:
    """Where the first audio's time went, over the streams that have every mark: per part (the text frontend, the
    prompt features / LM input / uploads, the wait for a KV slot and the AR loop, AR up to the first hop, DiT queue
    wait, the first DiT job, vocoder + copy to the host) p50 / p95 / p99 / max of its seconds, and its share of the
    summed time to first audio."""
    rows = []
    for r in records:
        m = r.marks or {}
        if not r.stream or r.ttfa_s is None or any(k not in m for k in _TTFA_MARKS):
            continue
        rows.append({name: (r.ttfa_s if b is None else m[b]) - (0.0 if a is None else m[a])
                     for name, a, b in TTFA_PARTS})
    total = sum(sum(x.values()) for x in rows)
    return {name: {**distribution([x[name] for x in rows]),
                   "share": sum(x[name] for x in rows) / total if total > 0 else None}
            for name, _, _ in TTFA_PARTS} if rows else {}


def summarize(records: Sequence[RequestRecord], duration_s: float, end_t: float, tolerance_s: float = 0.0) -> dict:
    """The open-loop cell's numbers:
    - ttfa (streams): first chunk - arrival; a stream still without audio at the end of the cell counts with
      end_t - arrival (a lower bound, `censored`). offline_latency: last chunk - arrival of offline requests, same rule.
    - inter_chunk_p95: gaps between consecutive chunks of streams.
    - underruns (`underruns()` per stream with audio): requests with >= 1, their fraction of those streams, events,
      stall seconds (total, and the worst request).
    - offered_audio_s_per_s: forced audio of the arrivals / duration; achieved_audio_s_per_s: audio delivered during
      the arrival window [0, duration] / duration (below saturation it trails offered by the lag from arrival to
      audio, about lag / duration); delivered_audio_s_per_s: all delivered audio / end_t (the window and the drain).
    """
    streams = [r for r in records if r.stream]
    offline = [r for r in records if not r.stream]
    counts = {s: sum(1 for r in records if r.status == s) for s in (OK, FAILED, UNFINISHED, NOT_SUBMITTED, SHED)}

    def first_audio(rs, last: bool):
        vals, censored = [], 0
        for r in rs:
            if r.status == OK and r.chunk_t:
                vals.append((r.chunk_t[-1] if last else r.chunk_t[0]) - r.arrival)
            elif not last and r.chunk_t:  # a stream cut short after its first chunk
                vals.append(r.chunk_t[0] - r.arrival)
            elif r.status in (UNFINISHED, NOT_SUBMITTED):
                vals.append(max(0.0, end_t - r.arrival))
                censored += 1
        return vals, censored

    ttfa, ttfa_censored = first_audio(streams, last=False)
    latency, latency_censored = first_audio(offline, last=True)
    gaps = [b - a for r in streams for a, b in zip(r.chunk_t, r.chunk_t[1:])]
    played = [r for r in streams if r.chunk_t]
    per = [underruns(r.chunk_t, r.chunk_s, tolerance_s) for r in played]
    with_underrun = sum(1 for n, _ in per if n)
    # streams cut at the end of the cell while their listener still had audio to play (paced streams: the AR keeps
    # them only a lead ahead, `ar_pace_lead_s`): not behind, only not done yet
    ahead = [r for r, (_, stall) in zip(played, per)
             if r.status == UNFINISHED and r.chunk_t[0] + sum(r.chunk_s) + stall > end_t]
    delivered = sum(sum(r.chunk_s) for r in records)
    in_window = sum(s for r in records for t, s in zip(r.chunk_t, r.chunk_s) if t <= duration_s)
    return {"requests": len(records), "streams": len(streams), "offline": len(offline),
            "completed": counts[OK], "failed": counts[FAILED], "unfinished": counts[UNFINISHED],
            "unfinished_ahead": len(ahead),
            "undelivered_ahead_s": sum(max(0.0, r.audio_s - sum(r.chunk_s)) for r in ahead),
            "not_submitted": counts[NOT_SUBMITTED], "shed": counts[SHED],
            "shed_audio_s": sum(r.audio_s for r in records if r.status == SHED),
            "ttfa": {**distribution(ttfa), "censored": ttfa_censored},
            "ttfa_parts": ttfa_parts(records),
            "offline_latency": {**distribution(latency), "censored": latency_censored},
            "inter_chunk_p95": percentile(gaps, 95),
            "underrun_requests": with_underrun, "underrun_fraction": with_underrun / len(per) if per else None,
            "underrun_events": sum(n for n, _ in per), "stall_s": sum(s for _, s in per),
            "stall_max_s": max((s for _, s in per), default=0.0),
            "offered_audio_s_per_s": sum(r.audio_s for r in records) / duration_s,
            "achieved_audio_s_per_s": in_window / duration_s,
            "delivered_audio_s_per_s": delivered / end_t if end_t > 0 else None,
            "wall_s": end_t}


def saturated(cell: dict, throughput_ratio: float = 0.9, ttfa_p95_s: float = 5.0) -> str | None:
    """Why a cell counts as past saturation (the sweep stops raising the rate), or None: requests still unfinished
    when the drain ended (the backlog did not clear), the audio delivered in all (arrival window and drain) below
    `throughput_ratio` x the audio offered, or TTFA p95 (streams; offline latency without streams) above
    `ttfa_p95_s`. (The window's own achieved audio s/s is not a test: it trails offered by the lag from arrival to
    audio even when every request keeps up — about 20 % for 8 s streams in a 10 s window.)
    Streams cut while their listener still had audio to play (`unfinished_ahead`: paced, not behind) count neither
    as unfinished nor with their audio not yet due (`undelivered_ahead_s`) in the offered audio; requests refused by
    load shedding (`shed`) owe no audio."""
    behind = (cell.get("unfinished") or 0) - (cell.get("unfinished_ahead") or 0)
    if behind > 0:
        return f"{behind} of {cell.get('requests')} requests unfinished after the drain"
    off, dur = cell.get("offered_audio_s_per_s"), cell.get("duration_s")
    got, wall = cell.get("delivered_audio_s_per_s"), cell.get("wall_s")
    due = off * dur - (cell.get("undelivered_ahead_s") or 0.0) - (cell.get("shed_audio_s") or 0.0) if off and dur \
        else None
    if due and got is not None and wall and got * wall < throughput_ratio * due:
        return f"delivered {got * wall:.1f} < {throughput_ratio:g} x offered {due:.1f} audio s"
    p95 = (cell.get("ttfa") or {}).get("p95")
    if p95 is None:
        p95 = (cell.get("offline_latency") or {}).get("p95")
    if p95 is not None and p95 > ttfa_p95_s:
        return f"TTFA p95 {p95:.2f} s > {ttfa_p95_s:g} s"
    return None
