"""Shape buckets shared by the build (which engine shapes to compile) and the runtime (which bucket a call runs in).

A bucket is (stage, mode, batch, length[, min_length]):
- `dit`  (modes `stream`, `offline`): batch = CFG rows (2 per request, always even), length = mel frames of the call.
- `hift` (modes `stream`, `offline`): batch = rows, length = mel frames.
- `ar`   (modes `decode`, `prefill`): decode buckets are batch sizes (length = max KV length, never padded);
  prefill buckets are (batch, prompt tokens).

A *static* bucket (min_length 1, the default) is one engine shape, min = opt = max = (batch, length): a call of
(b, n) with b <= batch and n <= length is right-padded up to it. A *dynamic* bucket (min_length > 1, and every
`ar/decode` bucket) is one engine covering lengths [min_length, length]: it pads the batch, never the length.

Padding waste of a call = padded work / real work = (batch * run_length) / (b * n), where run_length is `length`
for a static bucket and `n` for a dynamic one. `BucketTable.select` picks the cheapest covering bucket and gives
None (the caller runs eagerly) when its waste exceeds the table's limit.
"""
from __future__ import annotations

import math
import re
import threading
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Sequence

from .signatures import SAMPLES_PER_MEL_FRAME
from .errors import BucketError


STAGES = ("ar", "dit", "hift")
STAGE_MODES = {"ar": ("decode", "prefill"), "dit": ("stream", "offline"), "hift": ("stream", "offline")}
CFG_ROWS = 2  # DiT rows per request: conditional + unconditional
DEFAULT_MAX_PADDING_WASTE = 1.5
_EPS = 1e-9

__all__ = [
    "STAGES", "STAGE_MODES", "CFG_ROWS", "DEFAULT_MAX_PADDING_WASTE",
    "Bucket", "parse_key", "BucketTable", "group_by_length", "ShapeStats",
]


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_stage_mode(stage: str, mode: str) -> None:
    """Raise BucketError unless (stage, mode) is one of the known pairs."""
    if stage not in STAGE_MODES:
        raise BucketError(f"unknown stage {stage!r} (stages: {', '.join(STAGES)})")
    if mode not in STAGE_MODES[stage]:
        raise BucketError(f"unknown mode {mode!r} for stage {stage!r} (modes: {', '.join(STAGE_MODES[stage])})")


# ---------------------------------------------------------------------------------------------------------- Bucket

@dataclass(frozen=True)
class Bucket:
    stage: str
    mode: str
    batch: int
    length: int
    min_length: int = 1

    def __post_init__(self):
        check_stage_mode(self.stage, self.mode)
        for name in ("batch", "length", "min_length"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise BucketError(f"bucket {name} must be a positive integer, got {v!r}")
        if self.min_length > self.length:
            raise BucketError(f"bucket min_length {self.min_length} > length {self.length}")
        if self.stage == "dit" and self.batch % CFG_ROWS:
            raise BucketError(f"dit bucket batch counts CFG rows ({CFG_ROWS} per request) and must be even, "
                              f"got {self.batch}")

    @property
    def key(self) -> str:
        """Stable name: 'dit/stream/b4xt200'; a dynamic range is written 'b2xt4-128'."""
        t = f"{self.min_length}-{self.length}" if self.min_length > 1 else str(self.length)
        return f"{self.stage}/{self.mode}/b{self.batch}xt{t}"

    @property
    def cost(self) -> int:
        return self.batch * self.length

    @property
    def dynamic(self) -> bool:
        """True when one engine covers a length range and calls run at their own length."""
        return self.min_length > 1 or (self.stage == "ar" and self.mode == "decode")

    @property
    def length_range(self) -> tuple[int, int]:
        """(min, max) length of the engine's optimization profile; (length, length) for a static bucket."""
        return (self.min_length, self.length) if self.dynamic else (self.length, self.length)

    @property
    def sort_key(self) -> tuple:
        return (self.cost, self.batch, self.length, self.min_length)

    def covers(self, b: int, n: int) -> bool:
        return 1 <= b <= self.batch and self.min_length <= n <= self.length

    def run_length(self, n: int) -> int:
        """Length the call really runs at: the bucket length (static) or n itself (dynamic)."""
        return n if self.dynamic else self.length

    def run_cost(self, n: int) -> int:
        return self.batch * self.run_length(n)

    def waste(self, b: int, n: int) -> float:
        """Padded work / real work of a call of b rows of (longest) length n."""
        return self.run_cost(n) / (b * n)

    def __str__(self) -> str:
        return self.key


_KEY_RE = re.compile(r"^([a-z]+)/([a-z]+)/b([1-9][0-9]*)xt([1-9][0-9]*)(?:-([1-9][0-9]*))?$")


def parse_key(key: str) -> Bucket:
    """Inverse of Bucket.key; a malformed or unknown key raises BucketError."""
    if not isinstance(key, str):
        raise BucketError(f"bucket key must be a string, got {key!r}")
    m = _KEY_RE.match(key)
    if m is None:
        raise BucketError(f"malformed bucket key {key!r} (expected 'stage/mode/b<batch>xt<length>' or "
                          f"'stage/mode/b<batch>xt<min>-<max>')")
    stage, mode, b, t0, t1 = m.groups()
    try:
        bucket = Bucket(stage, mode, int(b), int(t1), int(t0)) if t1 else Bucket(stage, mode, int(b), int(t0))
    except BucketError as e:
        raise BucketError(f"bad bucket key {key!r}: {e}") from None
    if bucket.key != key:  # e.g. 'b2xt1-128' is the static 'b2xt128'
        raise BucketError(f"bucket key {key!r} is not canonical (write {bucket.key!r})")
    return bucket


# ----------------------------------------------------------------------------------------------------- BucketTable

def _check_call(b, n) -> None:
    if not _is_int(b) or b < 1:
        raise BucketError(f"call batch must be a positive integer, got {b!r}")
    if not _is_int(n) or n < 1:
        raise BucketError(f"call length must be a positive integer, got {n!r}")


def check_waste(w) -> float:
    if isinstance(w, bool) or not isinstance(w, (int, float)) or math.isnan(w) or w < 1:
        raise BucketError(f"max_padding_waste must be a number >= 1, got {w!r}")
    return float(w)


class BucketTable:
    """The buckets of one (stage, mode), sorted by cost, with the runtime's selection rule."""

    def __init__(self, buckets: Iterable[Bucket], max_padding_waste: float = DEFAULT_MAX_PADDING_WASTE):
        self.max_padding_waste = check_waste(max_padding_waste)
        bs = list(buckets)
        for bk in bs:
            if not isinstance(bk, Bucket):
                raise BucketError(f"BucketTable takes Bucket objects, got {bk!r}")
        pairs = {(bk.stage, bk.mode) for bk in bs}
        if len(pairs) > 1:
            raise BucketError(f"a BucketTable holds one stage/mode, got {sorted('/'.join(p) for p in pairs)}")
        seen = set()
        for bk in bs:
            if bk.key in seen:
                raise BucketError(f"duplicate bucket {bk.key}")
            seen.add(bk.key)
        self.buckets: tuple[Bucket, ...] = tuple(sorted(bs, key=lambda x: x.sort_key))
        self.stage, self.mode = next(iter(pairs)) if pairs else (None, None)
        self._by_key = {bk.key: bk for bk in self.buckets}

    def __len__(self) -> int:
        return len(self.buckets)

    def __iter__(self):
        return iter(self.buckets)

    def __contains__(self, key) -> bool:
        return (key.key if isinstance(key, Bucket) else key) in self._by_key

    def __repr__(self) -> str:
        return f"BucketTable({[bk.key for bk in self.buckets]}, max_padding_waste={self.max_padding_waste})"

    def get(self, key: str) -> Bucket:
        try:
            return self._by_key[key]
        except KeyError:
            raise BucketError(f"unknown bucket {key!r} (table has {len(self)}: "
                              f"{', '.join(self._by_key) or 'none'})") from None

    @property
    def max_batch(self) -> int:
        return max((bk.batch for bk in self.buckets), default=0)

    @property
    def max_length(self) -> int:
        return max((bk.length for bk in self.buckets), default=0)

    def covering(self, b: int, n: int) -> list[Bucket]:
        """Every bucket covering (b, n), cheapest run first."""
        _check_call(b, n)
        return sorted((bk for bk in self.buckets if bk.covers(b, n)), key=lambda x: (x.run_cost(n), x.sort_key))

    def select(self, b: int, n: int, allow_waste: bool = False) -> Bucket | None:
        """Cheapest bucket covering (b, n) with waste <= max_padding_waste; None means run eagerly.

        allow_waste=True returns the cheapest covering bucket whatever its waste (None only if none covers)."""
        cands = self.covering(b, n)
        if not cands:
            return None
        best = cands[0]  # least run cost = least waste for this call
        if allow_waste or best.waste(b, n) <= self.max_padding_waste + _EPS:
            return best
        return None

    def plan(self, b: int, n: int) -> list[tuple[int, "Bucket | None"]]:
        """How to run a call of b independent rows of length n: [(rows, bucket or None = eager), ...] in row order.

        One chunk when select(b, n) hits. Otherwise the rows are split (the DiT's rows are independent: per-row
        masks, t, conditions) into chunks that each hit a bucket within the padding-waste limit — most rows per
        chunk first, then the cheapest run — e.g. 6 rows of 620 frames with b2/b4/b8 x t768 buckets (b8 would waste
        1.65x) run as b4 + b2 (1.24x each) instead of eagerly; a remainder no bucket takes runs eagerly. A call
        longer than every bucket cannot be split (one eager chunk)."""
        hit = self.select(b, n)
        if hit is not None:
            return [(b, hit)]
        chunks: list[tuple[int, Bucket | None]] = []
        left = b
        while left > 0:
            best, best_key = None, None
            for bk in self.buckets:
                if not bk.min_length <= n <= bk.length:
                    continue
                k = min(left, bk.batch)
                if bk.waste(k, n) > self.max_padding_waste + _EPS:
                    continue
                key = (-k, bk.run_cost(n), bk.sort_key)
                if best_key is None or key < best_key:
                    best, best_key = bk, key
            if best is None:
                chunks.append((left, None))
                break
            k = min(left, best.batch)
            chunks.append((k, best))
            left -= k
        return chunks

    def miss_reason(self, b: int, n: int) -> str | None:
        """Short code of why select(b, n) is None: 'empty_table', 'no_cover', 'waste'; None when it hits."""
        if not self.buckets:
            return "empty_table"
        cands = self.covering(b, n)
        if not cands:
            return "no_cover"
        return None if cands[0].waste(b, n) <= self.max_padding_waste + _EPS else "waste"

    def explain(self, b: int, n: int) -> str:
        """One line saying which bucket select(b, n) takes, or why none."""
        where = f"{self.stage}/{self.mode}" if self.stage else "empty table"
        head = f"{where} call b={b} n={n}"
        reason = self.miss_reason(b, n)
        if reason == "empty_table":
            return f"{head}: no buckets in this table (eager fallback)"
        if reason == "no_cover":
            minl = min(bk.min_length for bk in self.buckets)
            return (f"{head}: no bucket covers it (largest batch {self.max_batch}, length range "
                    f"{minl}..{self.max_length}) (eager fallback)")
        best = self.covering(b, n)[0]
        w = best.waste(b, n)
        if reason == "waste":
            return (f"{head}: smallest covering bucket {best.key} has padding waste {w:.3f} > limit "
                    f"{self.max_padding_waste:g} (eager fallback; allow_waste=True would take it)")
        return f"{head}: {best.key} (padding waste {w:.3f} <= {self.max_padding_waste:g})"


def group_by_length(lengths: Sequence[int], max_batch: int, max_padding_waste: float = DEFAULT_MAX_PADDING_WASTE,
                    max_frames: int | None = None, length_aware: bool = True) -> list[list[int]]:
    """Length-aware grouping (the HiFT batching policy): index groups that may share one right-padded call.

    Sort by length (ties by index), then greedily grow the current group while, with the next item added,
    longest * n <= max_padding_waste * sum(len), n <= max_batch and n * longest <= max_frames. An item that
    alone exceeds max_frames gets a group of its own. Groups come out shortest first.

    `length_aware=False` (the policy switched off, for comparisons): arrival order, no padding-waste limit, only
    max_batch and max_frames."""
    if not _is_int(max_batch) or max_batch < 1:
        raise BucketError(f"max_batch must be a positive integer, got {max_batch!r}")
    waste = check_waste(max_padding_waste) if length_aware else math.inf
    if max_frames is not None and (not _is_int(max_frames) or max_frames < 1):
        raise BucketError(f"max_frames must be a positive integer or None, got {max_frames!r}")
    for i, n in enumerate(lengths):
        if not _is_int(n) or n < 1:
            raise BucketError(f"group_by_length: length [{i}] must be a positive integer, got {n!r}")
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i)) if length_aware else range(len(lengths))
    groups: list[list[int]] = []
    cur: list[int] = []
    total = longest = 0
    for i in order:
        n_i = lengths[i]
        if cur:
            k = len(cur) + 1
            padded = max(longest, n_i) * k
            fits = (k <= max_batch and padded <= waste * (total + n_i) + _EPS
                    and (max_frames is None or padded <= max_frames))
            if not fits:
                groups.append(cur)
                cur, total, longest = [], 0, 0
        cur.append(i)
        total += n_i
        longest = max(longest, n_i)
    if cur:
        groups.append(cur)
    return groups


# ------------------------------------------------------------------------------------------------------ ShapeStats

class ShapeStats:
    """Records every stage call (bucketed or eager fallback) for metrics() and the coverage report.

    Thread-safe. Waste samples are kept for the last `max_samples` bucketed calls of each stage/mode; counts,
    sums and maxima are exact."""

    def __init__(self, max_samples: int = 4096):
        self.max_samples = max_samples
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._stages: dict[str, dict] = {}
            self._buckets: dict[str, dict] = {}
            self._misses: dict[tuple, dict] = {}

    def record(self, stage: str, mode: str, b: int, n: int, bucket: Bucket | None, seconds: float,
               reason: str | None = None, split_part: bool = False) -> None:
        """One call of b rows, longest length n, that ran in `bucket` (None: eager, with `reason`); `split_part`:
        one chunk of a larger call that BucketTable.plan split over several buckets (counted in `split_parts`)."""
        check_stage_mode(stage, mode)
        _check_call(b, n)
        if bucket is not None and (bucket.stage, bucket.mode) != (stage, mode):
            raise BucketError(f"ShapeStats.record: bucket {bucket.key} is not a {stage}/{mode} bucket")
        sm = f"{stage}/{mode}"
        seconds = float(seconds)
        with self._lock:
            st = self._stages.setdefault(sm, {"calls": 0, "hits": 0, "fallbacks": 0, "seconds": 0.0,
                                              "waste_sum": 0.0, "waste_max": 0.0,
                                              "waste": deque(maxlen=self.max_samples), "reasons": {},
                                              "split_parts": 0})
            st["calls"] += 1
            st["split_parts"] += bool(split_part)
            st["seconds"] += seconds
            if bucket is not None:
                w = bucket.waste(b, n)
                st["hits"] += 1
                st["waste_sum"] += w
                st["waste_max"] = max(st["waste_max"], w)
                st["waste"].append(w)
                bs = self._buckets.setdefault(bucket.key, {"hits": 0, "seconds": 0.0, "waste_sum": 0.0,
                                                           "waste_max": 0.0})
                bs["hits"] += 1
                bs["seconds"] += seconds
                bs["waste_sum"] += w
                bs["waste_max"] = max(bs["waste_max"], w)
            else:
                r = reason or "unspecified"
                st["fallbacks"] += 1
                st["reasons"][r] = st["reasons"].get(r, 0) + 1
                ms = self._misses.setdefault((sm, b, n), {"count": 0, "seconds": 0.0, "reason": r})
                ms["count"] += 1
                ms["seconds"] += seconds
                ms["reason"] = r

    def summary(self) -> dict:
        """Plain dict: totals, per stage/mode (with waste samples), per bucket, and the eager-fallback shapes."""
        with self._lock:
            stages = {}
            for sm, st in sorted(self._stages.items()):
                samples = list(st["waste"])
                srt = sorted(samples)
                stages[sm] = {
                    "calls": st["calls"], "hits": st["hits"], "fallbacks": st["fallbacks"],
                    "hit_rate": st["hits"] / st["calls"], "seconds": st["seconds"], "split_parts": st["split_parts"],
                    "waste": {"mean": st["waste_sum"] / st["hits"] if st["hits"] else None,
                              "max": st["waste_max"] if st["hits"] else None,
                              "p50": _pct(srt, 0.5), "p95": _pct(srt, 0.95), "samples": samples},
                    "fallback_reasons": dict(sorted(st["reasons"].items())),
                }
            buckets = {k: {"hits": v["hits"], "seconds": v["seconds"], "mean_seconds": v["seconds"] / v["hits"],
                           "mean_waste": v["waste_sum"] / v["hits"], "max_waste": v["waste_max"]}
                       for k, v in sorted(self._buckets.items())}
            fallbacks = [{"stage_mode": sm, "b": b, "n": n, "count": v["count"], "seconds": v["seconds"],
                          "reason": v["reason"]}
                         for (sm, b, n), v in sorted(self._misses.items())]
            calls = sum(s["calls"] for s in stages.values())
            hits = sum(s["hits"] for s in stages.values())
            return {"calls": calls, "hits": hits, "fallbacks": calls - hits,
                    "hit_rate": hits / calls if calls else None,
                    "seconds": sum(s["seconds"] for s in stages.values()),
                    "stages": stages, "buckets": buckets, "fallback_shapes": fallbacks}


def _pct(sorted_vals: list[float], q: float) -> float | None:
    if not sorted_vals:
        return None
    return sorted_vals[min(len(sorted_vals) - 1, int(q * len(sorted_vals)))]
