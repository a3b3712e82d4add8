"""Coverage analytics: recorded stage calls + the engine set's bucket tables -> the coverage report (per stage/mode
hits, padding waste, fallbacks and why) and the buckets that would remove the fallbacks or cut the waste.

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

import math
from collections import defaultdict

from ..engines.buckets import CFG_ROWS, Bucket, BucketTable


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
