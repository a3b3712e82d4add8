"""Bucket coverage: replay a workload through the runtime (TTS + an engine set) and report how its stage calls fit.

The workload runs through the runtime's own scheduler, so the call shapes are the ones batching really makes. Every
bucketed stage call (the engine set's ShapeStats: hits and eager fallbacks) is recorded with its shape.

Workload JSONL, one request per line (a JSON object):
  text            the text to speak, or
  text_tokens     a length instead: a filler passage cut to about this many text tokens of the model's tokenizer
  speech_tokens   optional: force this many speech tokens (reproducible shapes; default: the LM decides)
  prompt_seconds  optional: synthetic reference audio of this length (the audio frontend runs); null / absent: no
                  reference audio (the model's built-in voice, else a saved speaker made once)
  stream          optional bool (default false)
  group           optional: requests of one group are submitted together (concurrently); groups run one after
                  another in file order (default: each line is its own group)
  concurrency     optional int (default 1): submit this many copies of the line (seeds seed, seed+1, ...) in its group
  seed            optional int (default 0)
  arrival_s       optional number >= 0: open-loop replay, each request submitted this many seconds after the start
                  (then every line needs it, and groups only label requests)
Unknown fields are errors (InputError naming the line and field).

`open_loop_workload(spec)`: the bench's open-loop traffic (tools/bench/workload.py: Poisson arrivals at a rate,
log-normal mixed lengths, a stream fraction; `trtbuild coverage --open-loop rate=8,duration=30,seed=0`), each request
in the saved-speaker voice with about a quarter as many text tokens as speech tokens.

The built-in matrix (`default_matrix`): text short / medium / long x stream / offline x reference audio yes / no x
concurrency 1 / 8 / 32, each cell one group. `scale` multiplies the concurrency and speech-token counts; `quick`
is a small matrix for CPU runs and tests.

report.json (`build_report`):
  engines, backend, device, model, max_padding_waste
  workload        {source, requests, groups, wall_seconds, failed: [{group, error}]}
  totals          {calls, hits, fallbacks, hit_rate, seconds, fallback_seconds}
  stages          {"dit/stream": {calls, hits, fallbacks, work, padded_work, seconds, fallback_seconds,
                   fallback_time_share, fallback_work_share, waste: {mean, p95, max} (bucketed calls),
                   buckets: [{key, calls, share_of_calls, share_of_work, waste: {mean, p95, max}, seconds}] (every
                   bucket of the engine, unused ones with 0 calls),
                   fallback_shapes: [{b, n, count, reason, seconds, suggested_bucket}], has_engine}, ...}
  suggestions     {"dit/stream": {fallback_buckets: [{key, batch, length, covers_calls, covers_shapes}],
                   uncovered: [[b, n], ...], waste_buckets: [{key, batch, length, saved_work, saved_share,
                   calls}]}, ...}
  shapes          [{stage_mode, b, n, bucket (null: eager), calls}] every distinct call shape
  stages_without_engines  stage/modes whose calls bypass the buckets (no engine in the set)
  heatmap         file name of the PNG, or null
Work of a call = b x n (rows x frames); padded work = the bucket's run cost (batch x run length) or b x n eagerly.
Suggestions: the fallback shapes are rounded up to a ladder (the engine's own batches and lengths plus powers of two
and a 1.25x length ladder); greedily the candidate covering the most uncovered fallback calls within the waste limit
is added until all are covered (fewest buckets, ties to the cheapest). Then, optionally, buckets that cut padding:
the candidate saving the most padded work on calls whose waste exceeds `waste_target`, while it saves >= 1%.
"""
from __future__ import annotations

import json
import math
import os
import threading
import time
from collections import defaultdict
from dataclasses import dataclass

from ..engines.buckets import CFG_ROWS, Bucket, BucketTable
from ..engines.errors import InputError

FILLER = ("The quick brown fox jumps over the lazy dog while the river keeps running past the old mill, and "
          "every evening the people of the valley gather to tell long stories about the seasons, the harvest, "
          "the travellers who came and went, and the songs that nobody remembers how to finish. ")

_FIELDS = ("text", "text_tokens", "speech_tokens", "prompt_seconds", "stream", "group", "concurrency", "seed",
           "arrival_s")


@dataclass(frozen=True)
class WorkloadRequest:
    text: str | None = None
    text_tokens: int | None = None
    speech_tokens: int | None = None
    prompt_seconds: float | None = None
    stream: bool = False
    group: str = ""
    seed: int = 0
    arrival_s: float | None = None  # open-loop replay: submit at this time after the start


# ------------------------------------------------------------------------------------------------------ workload

def _int_field(d: dict, k: str, where: str, lo: int) -> int | None:
    v = d.get(k)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise InputError(f"{where}: field {k!r} must be an integer >= {lo}, got {v!r}")
    return v


def parse_request(d, where: str, default_group: str) -> list[WorkloadRequest]:
    """One workload line (already JSON-decoded) -> its requests (concurrency copies)."""
    if not isinstance(d, dict):
        raise InputError(f"{where}: a workload line must be a JSON object, got {type(d).__name__}")
    unknown = sorted(set(d) - set(_FIELDS))
    if unknown:
        raise InputError(f"{where}: unknown field(s) {unknown} (fields: {', '.join(_FIELDS)})")
    text, tt = d.get("text"), _int_field(d, "text_tokens", where, 1)
    if (text is None) == (tt is None):
        raise InputError(f"{where}: give exactly one of 'text' and 'text_tokens'")
    if text is not None and (not isinstance(text, str) or not text.strip()):
        raise InputError(f"{where}: field 'text' must be a non-empty string, got {text!r}")
    ps = d.get("prompt_seconds")
    if ps is not None and (isinstance(ps, bool) or not isinstance(ps, (int, float)) or not 0 < ps <= 30):
        raise InputError(f"{where}: field 'prompt_seconds' must be a number in (0, 30] or null, got {ps!r}")
    stream = d.get("stream", False)
    if not isinstance(stream, bool):
        raise InputError(f"{where}: field 'stream' must be true or false, got {stream!r}")
    group = d.get("group", default_group)
    if not isinstance(group, (str, int)) or isinstance(group, bool):
        raise InputError(f"{where}: field 'group' must be a string or an integer, got {group!r}")
    conc = _int_field(d, "concurrency", where, 1) or 1
    seed = _int_field(d, "seed", where, 0) or 0
    st = _int_field(d, "speech_tokens", where, 1)
    at = d.get("arrival_s")
    if at is not None and (isinstance(at, bool) or not isinstance(at, (int, float)) or not 0 <= at < math.inf):
        raise InputError(f"{where}: field 'arrival_s' must be a number >= 0 or null, got {at!r}")
    return [WorkloadRequest(text, tt, st, None if ps is None else float(ps), stream, str(group), seed + i,
                            None if at is None else float(at)) for i in range(conc)]


def load_workload(path: str) -> list[WorkloadRequest]:
    if not os.path.isfile(path):
        raise InputError(f"workload file not found: {path}")
    out: list[WorkloadRequest] = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            where = f"{path}:{i}"
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{where}: not valid JSON ({e.msg})") from None
            out += parse_request(d, where, f"line{i}")
    if not out:
        raise InputError(f"workload file {path} holds no requests")
    timed = sum(r.arrival_s is not None for r in out)
    if 0 < timed < len(out):
        raise InputError(f"workload file {path}: give arrival_s on every line or on none ({timed} of {len(out)} "
                         "requests have one)")
    return out


def open_loop_workload(spec) -> list[WorkloadRequest]:
    """The open-loop arrivals of `spec` (a tools.bench.workload.OpenLoopSpec) as timed workload requests."""
    from .bench.workload import generate

    return [WorkloadRequest(None, max(4, a.tokens // 4), a.tokens, None, a.stream, "open-loop", a.seed, a.t)
            for a in generate(spec)]


MATRIX_TEXTS = {"short": (12, 50), "medium": (40, 150), "long": (120, 450)}  # (text tokens, speech tokens)
MATRIX_CONCURRENCY = (1, 8, 32)
QUICK_TEXTS = {"short": (8, 30), "medium": (16, 60), "long": (32, 100)}
QUICK_CONCURRENCY = (1, 2, 4)


def default_matrix(scale: float = 1.0, quick: bool = False) -> list[WorkloadRequest]:
    """text short/medium/long x stream/offline x reference audio yes/no x concurrency, one group per cell."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale <= 16:
        raise InputError(f"matrix scale must be a number in (0, 16], got {scale!r}")
    texts, concs = (QUICK_TEXTS, QUICK_CONCURRENCY) if quick else (MATRIX_TEXTS, MATRIX_CONCURRENCY)
    prompt = 1.0 if quick else 3.0
    out = []
    for name, (tt, st) in texts.items():
        for stream in (True, False):
            for ref in (True, False):
                for c in concs:
                    n = max(1, round(c * scale))
                    group = f"{name}/{'stream' if stream else 'offline'}/{'ref' if ref else 'noref'}/c{c}"
                    out += [WorkloadRequest(None, tt, max(8, round(st * scale)), prompt if ref else None, stream,
                                            group, i) for i in range(n)]
    return out


def text_of_tokens(tokenizer, n: int) -> str:
    """A filler passage cut to about `n` tokens of `tokenizer`."""
    words = (FILLER * (1 + n // 20)).split()
    lo, hi = 1, len(words)
    while lo < hi:  # fewest words with >= n tokens
        mid = (lo + hi) // 2
        if len(tokenizer.encode(" ".join(words[:mid]))) >= n:
            hi = mid
        else:
            lo = mid + 1
    return " ".join(words[:lo])


# -------------------------------------------------------------------------------------------------------- replay

class CallRecorder:
    """Records every ShapeStats.record call (stage, mode, b, n, bucket key or None, seconds, reason) of one stats
    object, by wrapping its `record` method on the instance; `detach()` restores it."""

    def __init__(self, stats):
        self.stats = stats
        self.calls: list[tuple] = []
        self._lock = threading.Lock()
        self._orig = stats.record

        def record(stage, mode, b, n, bucket, seconds, reason=None):
            self._orig(stage, mode, b, n, bucket, seconds, reason=reason)
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


# -------------------------------------------------------------------------------------------------------- report

def _stats(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p95": None, "max": None}
    s = sorted(values)
    return {"mean": sum(s) / len(s), "p95": s[min(len(s) - 1, int(0.95 * len(s)))], "max": s[-1]}


def batch_ladder(stage: str, existing: list[int], top: int) -> list[int]:
    """The engine's batches plus powers of two (even for the DiT's CFG rows) up to the first one >= top."""
    step = CFG_ROWS if stage == "dit" else 1
    ladder = set(existing)
    b = step
    while True:
        ladder.add(b)
        if b >= top:
            break
        b *= 2
    return sorted(ladder)


def length_ladder(existing: list[int], top: int, quantum: int = 16) -> list[int]:
    """The engine's lengths plus a 1.25x ladder from 4 x quantum (rounded up to the quantum) to the first rung
    >= top."""
    ladder = set(existing)
    v = float(quantum * 4)
    while True:
        r = int(math.ceil(v / quantum) * quantum)
        ladder.add(r)
        if r >= top:
            break
        v *= 1.25
    return sorted(ladder)


def _round_up(x: int, ladder: list[int], k: int = 3) -> list[int]:
    return [v for v in ladder if v >= x][:k]


def suggest_buckets(stage: str, mode: str, fallback_shapes: dict[tuple[int, int], int], existing: list[Bucket],
                    max_padding_waste: float, max_length: int | None = None, hit_shapes: dict | None = None,
                    waste_target: float | None = 1.25, max_waste_buckets: int = 3) -> dict:
    """Fewest extra static buckets covering every fallback shape within the waste limit (greedy set cover over
    ladder-rounded candidates); then up to `max_waste_buckets` that cut the padded work of calls above
    `waste_target`. hit_shapes: {(b, n): (count, current run cost per call)}."""
    step = CFG_ROWS if stage == "dit" else 1
    shapes = dict(fallback_shapes)
    hit_shapes = hit_shapes or {}
    all_b = [b for b, _ in shapes] + [b for b, _ in hit_shapes]
    all_n = [n for _, n in shapes] + [n for _, n in hit_shapes]
    if not all_b:
        return {"fallback_buckets": [], "uncovered": [], "waste_buckets": []}
    top_n = max(all_n)
    bl = batch_ladder(stage, [bk.batch for bk in existing], max(all_b))
    ll = length_ladder([bk.length for bk in existing], top_n)

    def ok(B, L, b, n):
        return b <= B and n <= L and B * L <= max_padding_waste * b * n + 1e-9

    def candidates(pts):
        """Each shape rounded up to the ladder (3 rungs each way, lengths also to a multiple of 16); the exact
        (even) batch only where no ladder batch fits within the waste limit."""
        cands = set()
        for b, n in pts:
            b_even = b + (-b) % step
            lens = [L for L in _round_up(n, ll) + [n + (-n) % 16] if max_length is None or L <= max_length]
            mine = {(B, L) for B in _round_up(b_even, bl) for L in lens}
            if not any(ok(B, L, b, n) for B, L in mine):
                mine |= {(b_even, L) for L in lens}
            cands |= mine
        return sorted(cands, key=lambda c: (c[0] * c[1], c))

    chosen, uncovered = [], set(shapes)
    cands = candidates(shapes)
    while uncovered:
        best, best_cov = None, []
        for B, L in cands:
            cov = [s for s in uncovered if ok(B, L, *s)]
            gain = sum(shapes[s] for s in cov)
            if cov and (best is None or gain > sum(shapes[s] for s in best_cov)):
                best, best_cov = (B, L), cov
        if best is None:
            break
        uncovered -= set(best_cov)
        chosen.append({"key": Bucket(stage, mode, *best).key, "batch": best[0], "length": best[1],
                       "covers_calls": sum(shapes[s] for s in best_cov),
                       "covers_shapes": sorted([list(s) for s in best_cov])})

    waste_buckets = []
    if waste_target is not None and hit_shapes:
        cost = {s: c for s, (_, c) in hit_shapes.items()}
        total = sum(cnt * s[0] * s[1] for s, (cnt, _) in hit_shapes.items())
        high = [s for s, (cnt, c) in hit_shapes.items() if c > waste_target * s[0] * s[1]]
        wc = candidates(high)
        for _ in range(max_waste_buckets):
            best, best_gain, best_calls = None, 0, 0
            for B, L in wc:
                gain, calls = 0, 0
                for s, (cnt, _) in hit_shapes.items():
                    if ok(B, L, *s) and B * L < cost[s]:
                        gain += cnt * (cost[s] - B * L)
                        calls += cnt
                if gain > best_gain:
                    best, best_gain, best_calls = (B, L), gain, calls
            if best is None or best_gain < 0.01 * total:
                break
            for s in hit_shapes:
                if ok(*best, *s):
                    cost[s] = min(cost[s], best[0] * best[1])
            waste_buckets.append({"key": Bucket(stage, mode, *best).key, "batch": best[0], "length": best[1],
                                  "saved_work": best_gain, "saved_share": best_gain / total, "calls": best_calls})
    return {"fallback_buckets": chosen, "uncovered": sorted([list(s) for s in uncovered]),
            "waste_buckets": waste_buckets}


def build_report(calls: list[tuple], tables: dict[tuple[str, str], BucketTable], meta: dict | None = None,
                 max_lengths: dict[str, int] | None = None, waste_target: float | None = 1.25) -> dict:
    """The coverage report (see the module docstring) from recorded calls and the engine set's bucket tables."""
    meta = dict(meta or {})
    by_sm: dict[str, list[tuple]] = defaultdict(list)
    for c in calls:
        by_sm[f"{c[0]}/{c[1]}"].append(c)
    for (s, m) in tables:
        by_sm.setdefault(f"{s}/{m}", [])
    stages, suggestions, shapes = {}, {}, []
    waste_limit = None
    for sm in sorted(by_sm):
        stage, mode = sm.split("/")
        cs = by_sm[sm]
        table = tables.get((stage, mode))
        limit = table.max_padding_waste if table is not None else float(meta.get("max_padding_waste", 1.5))
        waste_limit = limit if waste_limit is None else waste_limit
        buckets = {bk.key: bk for bk in table} if table is not None else {}
        work = sum(b * n for _, _, b, n, _, _, _ in cs)
        seconds = sum(c[5] for c in cs)
        per_bucket: dict[str, list[tuple]] = defaultdict(list)
        fb: dict[tuple, dict] = {}
        hit_shapes: dict[tuple[int, int], list] = {}
        padded = 0
        wastes = []
        shape_count: dict[tuple, int] = defaultdict(int)
        for (_, _, b, n, key, sec, reason) in cs:
            shape_count[(b, n, key)] += 1
            if key is None:
                padded += b * n
                r = _reason_code(reason)
                e = fb.setdefault((b, n, r), {"b": b, "n": n, "count": 0, "reason": r, "seconds": 0.0,
                                              "suggested_bucket": None})
                e["count"] += 1
                e["seconds"] += sec
                continue
            bk = buckets.get(key)
            run_cost = bk.run_cost(n) if bk is not None else b * n
            padded += run_cost
            wastes.append(run_cost / (b * n))
            per_bucket[key].append((b, n, sec, run_cost))
            h = hit_shapes.setdefault((b, n), [0, run_cost])
            h[0] += 1
        for (b, n, key), k in sorted(shape_count.items(), key=lambda x: (x[0][0], x[0][1], str(x[0][2]))):
            shapes.append({"stage_mode": sm, "b": b, "n": n, "bucket": key, "calls": k})
        rows = []
        for key in list(buckets) + sorted(k for k in per_bucket if k not in buckets):
            lst = per_bucket.get(key, [])
            w = sum(b * n for b, n, _, _ in lst)
            rows.append({"key": key, "calls": len(lst), "share_of_calls": len(lst) / len(cs) if cs else 0.0,
                         "share_of_work": w / work if work else 0.0,
                         "waste": _stats([rc / (b * n) for b, n, _, rc in lst]),
                         "seconds": sum(s for _, _, s, _ in lst)})
        fallbacks = sorted(fb.values(), key=lambda e: (-e["count"], e["b"], e["n"]))
        fb_calls = sum(e["count"] for e in fallbacks)
        fb_sec = sum(e["seconds"] for e in fallbacks)
        fixable = defaultdict(int)
        for e in fallbacks:
            if e["reason"] in ("no_cover", "waste", "no_engine", "empty_table"):
                fixable[(e["b"], e["n"])] += e["count"]
        max_len = (max_lengths or {}).get(stage)
        sug = suggest_buckets(stage, mode, dict(fixable), list(buckets.values()), limit, max_len,
                              {s: tuple(v) for s, v in hit_shapes.items()}, waste_target)
        cover = {}
        for s in sug["fallback_buckets"]:
            for b, n in s["covers_shapes"]:
                cover.setdefault((b, n), s["key"])
        for e in fallbacks:
            e["suggested_bucket"] = cover.get((e["b"], e["n"]))
        stages[sm] = {"calls": len(cs), "hits": len(cs) - fb_calls, "fallbacks": fb_calls, "work": work,
                      "padded_work": padded, "seconds": seconds, "fallback_seconds": fb_sec,
                      "fallback_time_share": fb_sec / seconds if seconds else 0.0,
                      "fallback_work_share": (sum(e["b"] * e["n"] * e["count"] for e in fallbacks) / work
                                              if work else 0.0),
                      "waste": _stats(wastes), "buckets": rows, "fallback_shapes": fallbacks,
                      "has_engine": table is not None}
        suggestions[sm] = sug
    n_calls = sum(s["calls"] for s in stages.values())
    hits = sum(s["hits"] for s in stages.values())
    seconds = sum(s["seconds"] for s in stages.values())
    report = {**meta,
              "max_padding_waste": waste_limit if waste_limit is not None else meta.get("max_padding_waste"),
              "totals": {"calls": n_calls, "hits": hits, "fallbacks": n_calls - hits,
                         "hit_rate": hits / n_calls if n_calls else None, "seconds": seconds,
                         "fallback_seconds": sum(s["fallback_seconds"] for s in stages.values())},
              "stages": stages, "suggestions": suggestions, "shapes": shapes,
              "stages_without_engines": sorted(sm for sm, s in stages.items() if not s["has_engine"]),
              "heatmap": None}
    return report


def _reason_code(reason: str | None) -> str:
    """ShapeStats reasons -> short codes: no_cover, waste, empty_table, no_engine, engine_error, other."""
    if reason in ("no_cover", "waste", "empty_table"):
        return reason
    if reason and reason.startswith("no engine"):
        return "no_engine"
    if reason and reason.startswith("engine error"):
        return "engine_error"
    return reason or "unspecified"


# ------------------------------------------------------------------------------------------------------- heatmap

def plot_provenance(report: dict) -> str:
    """Title line of a plot: engine set, backend, cosytrt commit and the device (GPU name on CUDA)."""
    import subprocess

    commit = "unknown commit"
    try:
        here = os.path.dirname(os.path.realpath(__file__))
        commit = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                timeout=5).stdout.strip() or commit
    except (OSError, subprocess.SubprocessError):
        pass
    device = str(report.get("device", "cpu"))
    if device.startswith("cuda"):
        try:
            import torch

            device = f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
        except Exception:  # noqa: BLE001 - a title never fails the report
            pass
    return (f"engine set {os.path.basename(os.path.normpath(str(report.get('engines', '?'))))} "
            f"({report.get('backend', '?')}), cosytrt {commit}, {device}")


def write_heatmap(report: dict, tables: dict[tuple[str, str], BucketTable], path: str, bins: int = 24) -> str:
    """batch x length grid per stage/mode, coloured by calls (log scale); cells with eager fallbacks marked with a
    red x; each bucket's coverage outlined."""
    from cosytrt.extras import require

    matplotlib = require("matplotlib", "plot", "the coverage heatmap (--out)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import LogNorm
    from matplotlib.patches import Rectangle

    by_sm: dict[str, list[dict]] = defaultdict(list)
    for s in report["shapes"]:
        by_sm[s["stage_mode"]].append(s)
    panels = [sm for sm in sorted(by_sm)] or ["(no calls)"]
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 2.2 + 1.6 * len(panels)), squeeze=False)
    for ax, sm in zip(axes[:, 0], panels):
        rows = by_sm.get(sm, [])
        if not rows:
            ax.set_title(f"{sm}: no calls")
            ax.axis("off")
            continue
        stage, mode = sm.split("/")
        table = tables.get((stage, mode))
        bucket_lengths = [bk.length for bk in table] if table is not None else []
        batches = sorted({r["b"] for r in rows} | ({bk.batch for bk in table} if table is not None else set()))
        top = max([r["n"] for r in rows] + bucket_lengths)
        width = max(1, math.ceil(top / bins))
        nb = math.ceil(top / width) + 1
        grid = np.zeros((len(batches), nb))
        fallback = np.zeros_like(grid, dtype=bool)
        for r in rows:
            i, j = batches.index(r["b"]), r["n"] // width
            grid[i, j] += r["calls"]
            if r["bucket"] is None:
                fallback[i, j] = True
        masked = np.ma.masked_where(grid == 0, grid)
        vmax = max(10.0, float(grid.max()))
        im = ax.imshow(masked, aspect="auto", origin="lower", cmap="viridis", norm=LogNorm(vmin=1, vmax=vmax),
                       extent=(0, nb * width, -0.5, len(batches) - 0.5), interpolation="nearest")
        ys, xs = np.nonzero(fallback)
        if len(xs):  # legend outside the axes, so it never covers a cell
            ax.scatter((xs + 0.5) * width, ys, marker="x", color="red", s=50, label="eager fallback")
            ax.legend(loc="upper left", bbox_to_anchor=(1.12, 1.0), fontsize=8, borderaxespad=0.0)
        for bk in (table or []):  # what each bucket covers: batch <= B, length <= L (min_length.. if dynamic)
            top_row = max(i for i, b in enumerate(batches) if b <= bk.batch)
            lo = bk.min_length if bk.dynamic else 0
            ax.add_patch(Rectangle((lo, -0.5), bk.length - lo, top_row + 1, fill=False, edgecolor="gray",
                                   linewidth=0.8, linestyle="--"))
        ax.set_yticks(range(len(batches)))
        ax.set_yticklabels([str(b) for b in batches])
        ax.set_ylabel("batch (rows)")
        ax.set_xlabel("length (frames); dashed outlines: buckets (batch <= B, length <= L)")
        st = report["stages"].get(sm, {})
        ax.set_title(f"{sm}: {st.get('calls', 0)} calls, {st.get('fallbacks', 0)} eager fallbacks")
        fig.colorbar(im, ax=ax, label="calls")
    fig.suptitle(plot_provenance(report), fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------------- entry point

def run_coverage(engines: str, requests: list[WorkloadRequest], model: str | None = None, device: str | None = None,
                 out_dir: str | None = None, source: str = "", timeout_s: float = 600.0, progress: bool = False,
                 waste_target: float | None = 1.25, tts=None) -> dict:
    """Load TTS with the engine set (or use `tts`), replay `requests`, build the report; with `out_dir` write
    report.json and heatmap.png there."""
    from ..engines.manifest import Manifest

    man = Manifest.load(engines)
    own = tts is None
    if own:
        from ..runtime.tts import TTS

        tts = TTS.load(model or man.model.get("source") or "tiny", engines=engines, device=device or man.device)
    try:
        res = replay(tts, requests, timeout_s, progress)
    finally:
        if own:
            tts.close()
    es = tts.pipeline.backends.engine_set
    models = tts.pipeline.models
    meta = {"engines": engines, "backend": man.backend, "device": str(tts.pipeline.device),
            "model": str(models.source), "max_padding_waste": float(man.profile.get("max_padding_waste", 1.5)),
            "workload": {"source": source, "requests": res.requests, "groups": res.groups,
                         "wall_seconds": res.wall_seconds, "failed": res.failed}}
    report = build_report(res.calls, es.tables, meta,
                          {"dit": models.flow.max_frames, "hift": models.hift.max_frames}, waste_target)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        write_heatmap(report, es.tables, os.path.join(out_dir, "heatmap.png"))
        report["heatmap"] = "heatmap.png"
        with open(os.path.join(out_dir, "report.json"), "w") as f:
            json.dump(report, f, indent=1)
    return report
