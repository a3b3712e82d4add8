"""Shape templates: how an engine input's dims follow a bucket's (batch, length).

A template is a list of dims, each an int or an expression in `B` (bucket batch) and `T` (bucket length), e.g.
`["B", 80, "T"]` for the DiT's x, or `["B", "T*480", 9]` for HiFT's sine noise. Used to make TensorRT optimization
profiles (min/opt/max per input) and the static buffers of CUDA-graph buckets.
"""
from __future__ import annotations

import re

from .buckets import Bucket
from .errors import EngineSetError

_TERM = re.compile(r"^\s*(B|T|\d+)(\s*\*\s*(\d+))?\s*$")


def resolve_dim(expr, batch: int, length: int) -> int:
    """Evaluate one dim: an int, or a sum of terms `X` / `X*k` with X in {B, T, integer}."""
    if isinstance(expr, int):
        return expr
    total = 0
    for term in str(expr).split("+"):
        m = _TERM.match(term)
        if not m:
            raise EngineSetError(f"bad shape expression {expr!r} (terms are B, T, N, B*k, T*k joined by +)")
        base = {"B": batch, "T": length}.get(m.group(1))
        base = int(m.group(1)) if base is None else base
        total += base * (int(m.group(3)) if m.group(3) else 1)
    return total


def resolve_shape(template: list, batch: int, length: int) -> tuple[int, ...]:
    return tuple(resolve_dim(d, batch, length) for d in template)


def profile_shapes(templates: dict[str, list], bucket: Bucket) -> dict[str, tuple[tuple, tuple, tuple]]:
    """(min, opt, max) per input for one bucket: batch fixed; length fixed for a static bucket (min = opt = max, the
    best kernels), or from min_length to length for a dynamic-range bucket (opt = max)."""
    out = {}
    lo, hi = bucket.length_range
    for name, tpl in templates.items():
        mx = resolve_shape(tpl, bucket.batch, hi)
        mn = resolve_shape(tpl, bucket.batch, lo)
        out[name] = (mn, mx, mx)
    return out


def profile_index(bucket_keys: list[str], bucket: Bucket) -> int:
    """Index of a bucket's optimization profile: its position in the manifest's bucket list."""
    try:
        return bucket_keys.index(bucket.key)
    except ValueError:
        raise EngineSetError(f"bucket {bucket.key!r} is not in this engine (has {bucket_keys})") from None
