"""A bucket profile derived from recorded (or simulated) call shapes.

Per stage and mode, a grid of batch rungs x length rungs (the profile's `{batch: [...], frames: [...]}` form) that
covers the calls within the profile's max_padding_waste, with at most `max_buckets` buckets:

* lengths for a set of batch rungs: a call of b rows and n frames lands in the smallest batch rung B >= b, so a length
  rung L covers it when n <= L <= waste * b * n / B: an interval per call shape. The fewest rungs that hit every
  interval is the classic greedy (sort by right end, take the right end, rounded down to a multiple of 8 when that
  still covers); when that needs more than max_buckets / |batches| rungs, the rungs are picked greedily by calls
  covered instead;
* batch rungs: every subset of the batches the calls use (with the largest; a x1.5 ladder of them when there are more
  than 10) is tried; among the few covering the most calls with the fewest buckets, the rest of the bucket budget
  goes to length rungs that cut the padded work most (each at least 1 %), and the least padded work wins.

`derive_profile(calls, base)` keeps everything else of `base` (model, dtypes, options, the AR stage) and replaces the
DiT and HiFT grids of the stage/modes the calls use; `write_profile` writes it as YAML with a header comment saying
how it was derived, and `runtime/stages/profile.py` loads it like any shipped profile.
"""
from __future__ import annotations

from collections import Counter

import yaml

from ..engines.buckets import CFG_ROWS


def _smallest_rung(b: int, batches: list[int]) -> int | None:
    return next((B for B in batches if B >= b), None)


def _intervals(shapes: dict, batches: list[int], waste: float) -> list[tuple[int, int, int]]:
    """(lo, hi, calls) per shape: the length rungs that cover it at its batch rung (empty ones left out)."""
    out = []
    for (b, n), w in shapes.items():
        B = _smallest_rung(b, batches)
        if B is None:
            continue
        hi = int(waste * b * n / B + 1e-9)
        if hi >= n:
            out.append((n, hi, w))
    return out


def _rung(lo: int, hi: int) -> int:
    r = hi - hi % 8
    return r if r >= lo else hi


def length_rungs(intervals: list[tuple[int, int, int]], k: int | None = None) -> list[int]:
    """Fewest points hitting every interval (greedy by right end); with `k`, at most k points, greedily by calls."""
    if not intervals:
        return []
    pts: list[int] = []
    for lo, hi, _ in sorted(intervals, key=lambda x: (x[1], x[0])):
        if not any(lo <= p <= hi for p in pts):
            pts.append(_rung(lo, hi))
    if k is None or len(pts) <= k:
        return sorted(pts)
    cands = sorted({_rung(lo, hi) for lo, hi, _ in intervals} | {hi for _, hi, _ in intervals})
    left, chosen = list(intervals), []
    for _ in range(k):
        best = max(cands, key=lambda p: (sum(w for lo, hi, w in left if lo <= p <= hi), -p))
        gain = [iv for iv in left if iv[0] <= best <= iv[1]]
        if not gain:
            break
        chosen.append(best)
        left = [iv for iv in left if not iv[0] <= best <= iv[1]]
    return sorted(chosen)


def _padded(shapes: dict, batches: list[int], ls: list[int], waste: float) -> int:
    """Padded work (B x L summed over calls) of the covered shapes in the grid, each in its cheapest bucket."""
    total = 0
    for (b, n), w in shapes.items():
        costs = [B * L for B in batches for L in ls if B >= b and L >= n and B * L <= waste * b * n + 1e-9]
        if costs:
            total += w * min(costs)
    return total


def _grid(shapes: dict, batches: list[int], waste: float, max_buckets: int) -> tuple[list[int], int]:
    ivs = _intervals(shapes, batches, waste)
    ls = length_rungs(ivs, max(1, max_buckets // len(batches)))
    covered = sum(w for lo, hi, w in ivs if any(lo <= p <= hi for p in ls))
    return ls, covered


def _refine(shapes: dict, batches: list[int], ls: list[int], waste: float, max_buckets: int) -> list[int]:
    """Spend the rest of the bucket budget on length rungs that cut the padded work most (each >= 1 %)."""
    ls = list(ls)
    cands = sorted({n + (-n) % 8 for _, n in shapes})
    cur = _padded(shapes, batches, ls, waste)
    while (len(ls) + 1) * len(batches) <= max_buckets:
        best = min((c for c in cands if c not in ls), default=None,
                   key=lambda c: _padded(shapes, batches, sorted(ls + [c]), waste))
        if best is None:
            break
        new = _padded(shapes, batches, sorted(ls + [best]), waste)
        if cur - new < 0.01 * cur:
            break
        ls, cur = sorted(ls + [best]), new
    return ls


def _batch_sets(batches: list[int], exhaustive: int = 10):
    """Candidate batch-rung sets, each holding the largest batch: every subset for up to `exhaustive` batches, else
    the subsets of a x1.5-ish ladder of them plus the full set."""
    top, rest = batches[-1], batches[:-1]
    if len(rest) >= exhaustive:
        ladder, v = [], rest[0]
        for b in rest:
            if b >= v:
                ladder.append(b)
                v = b * 1.5
        rest = ladder[-(exhaustive - 1):]
        yield batches
    for mask in range(1 << len(rest)):
        yield [b for i, b in enumerate(rest) if mask >> i & 1] + [top]


def derive_grid(stage: str, shapes: dict, waste: float = 1.5, max_buckets: int = 32) -> dict:
    """{batch, frames, covered_calls, calls} for call shapes {(b, n): calls} of one stage/mode."""
    step = CFG_ROWS if stage == "dit" else 1
    batches = sorted({b + (-b) % step for b, _ in shapes})
    total = sum(shapes.values())
    if not batches:
        return {"batch": [], "frames": [], "covered_calls": 0, "calls": 0}
    scored = []
    for trial in _batch_sets(batches):
        ls, cov = _grid(shapes, trial, waste, max_buckets)
        scored.append(((cov, -len(trial) * len(ls), -sum(trial)), trial, ls, cov))
    scored.sort(key=lambda x: x[0], reverse=True)
    best = None
    for _, trial, ls, cov in [x for x in scored if x[3] == scored[0][3]][:6]:  # full coverage first, then padding
        ls = _refine(shapes, trial, ls, waste, max_buckets)
        key = (cov, -_padded(shapes, trial, ls, waste), -len(trial) * len(ls))
        if best is None or key > best[0]:
            best = (key, trial, ls, cov)
    _, batches, ls, cov = best
    return {"batch": batches, "frames": ls, "covered_calls": cov, "calls": total}


def _chunk_rungs(values: list[int], ratio: float, chunk: int) -> list[int]:
    """Fewest rungs (multiples of `chunk` where that still covers) so that every value v has one in [v, v * ratio]."""
    pts: list[int] = []
    for v in sorted(set(values)):
        if not any(v <= q <= v * ratio for q in pts):
            hi = int(v * ratio)
            r = hi - hi % chunk
            pts.append(r if r >= v else v)
    return pts


def derive_cached_grid(calls: list[tuple], max_graphs: int = 64, chunk: int = 50, ceiling: int | None = None) -> dict:
    """A cached-hop grid {batch, frames, prefix, graphs, calls} for cached-hop calls [(requests, new frames, prefix
    frames)] (`coverage_sim.CachedHops.calls`) that holds every call, with at most `max_graphs` graphs (the product
    of the three ladders) where it can: batch = powers of two up to the largest call (graphs are replayed for every
    Euler step, so the few batch sizes all matter); new frames = each distinct value (hops add whole chunks: few
    values) unless that needs more than a quarter of the budget, then rungs within x1.25; prefix = 0 (a first hop)
    and rungs within xR of every prefix, R the smallest of 1.1, 1.2, ... that fits the budget, plus `ceiling` (the
    old grid's longest prefix) when that is longer than every call's: the traffic's longest streams are its rarest,
    and a step whose longest row no bucket holds runs eagerly with all its rows."""
    if not calls:
        return {"batch": [], "frames": [], "prefix": [], "graphs": 0, "calls": 0}
    top = max(b for b, _, _ in calls)
    batch = sorted({1 << k for k in range(top.bit_length()) if 1 << k < top} | {top})
    news = sorted({n for _, n, _ in calls})
    frames = news if len(batch) * len(news) <= max_graphs // 4 else _chunk_rungs(news, 1.25, chunk)
    prefixes = [p for _, _, p in calls if p > 0]
    ratio, prefix = 1.1, []
    while True:
        prefix = sorted(({0} if any(p == 0 for _, _, p in calls) else set()) | set(_chunk_rungs(prefixes, ratio,
                                                                                                  chunk)))
        if ceiling is not None and (not prefix or ceiling > prefix[-1]):
            prefix.append(ceiling)
        if len(batch) * len(frames) * max(1, len(prefix)) <= max_graphs or ratio >= 4:
            break
        ratio = round(ratio + 0.1, 2)
    if not prefix:
        prefix = [0]
    return {"batch": batch, "frames": frames, "prefix": prefix, "prefix_ratio": ratio,
            "graphs": len(batch) * len(frames) * len(prefix), "calls": len(calls)}


def derive_profile(calls: list[tuple], base, max_buckets: int = 32, waste: float | None = None,
                   description: str | None = None, cached_calls: list[tuple] | None = None,
                   max_cached_graphs: int = 64) -> tuple[dict, dict]:
    """(profile dict, per stage/mode derivation summary) from `calls` (CallRecorder / simulate tuples) and the
    `base` Profile, whose non-derived parts are kept. `cached_calls` (simulated cached-hop calls): dit.cached is
    derived from them too (`derive_cached_grid`), summary key "dit/cached"."""
    d = base.to_dict()
    waste = float(waste if waste is not None else d.get("max_padding_waste", 1.5))
    shapes: dict = {}
    for stage, mode, b, n, *_ in calls:
        shapes.setdefault((stage, mode), Counter())[(int(b), int(n))] += 1
    summary = {}
    for (stage, mode), cnt in sorted(shapes.items()):
        if stage not in ("dit", "hift"):
            continue
        sd = d["stages"].setdefault(stage, {})
        g = derive_grid(stage, dict(cnt), min(waste, float(sd.get("max_padding_waste", waste))), max_buckets)
        if g["frames"]:
            sd[mode] = {"batch": g["batch"], "frames": g["frames"]}
        summary[f"{stage}/{mode}"] = g
    if cached_calls:
        old = base.cached_grid
        g = derive_cached_grid(cached_calls, max_cached_graphs, ceiling=max(old.prefix) if old is not None else None)
        d["stages"].setdefault("dit", {})["cached"] = {k: g[k] for k in ("batch", "frames", "prefix")}
        summary["dit/cached"] = g
    d["max_padding_waste"] = waste
    if description:
        d["description"] = description
    return d, summary


def write_profile(profile: dict, path: str, header: str) -> str:
    """The profile as YAML under a '# '-commented header; the file loads with runtime.stages.profile.load_profile."""
    from ..runtime.stages.profile import load_profile

    import textwrap

    lines = [w for line in header.strip("\n").splitlines() for w in (textwrap.wrap(line, 116) or [""])]
    text = "".join(f"# {line}".rstrip() + "\n" for line in lines)
    body = yaml.safe_dump(profile, sort_keys=False, default_flow_style=None, width=118)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text + body)
    load_profile(path)  # refuse to leave a file the runtime cannot load
    return path
