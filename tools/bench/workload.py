"""Open-loop workloads: requests arriving as a Poisson process at a rate, audio lengths from a log-normal mix
(clipped), a fraction of them streaming. Seeded plain Python (no model), used by the bench's open-loop cells and by
`trtbuild coverage --open-loop`.

Three independent random streams (arrival gaps, lengths, stream or offline) come from the one seed, so at another
rate the same seed gives the same sequence of lengths and modes, only denser or sparser in time.

Spec string (`parse_open_loop`): comma-separated key=value, e.g. `rate=8,duration=30,seed=0`; keys rate (requests
per second), duration (seconds of arrivals), seed, stream (stream fraction 0..1), lengths (log-normal mix, see
`parse_lengths`), min / max (clip bounds in audio seconds).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace

from ...engines.errors import InputError

TOKENS_PER_S = 25  # speech tokens per second of audio: a forced token count sets the audio length


@dataclass(frozen=True)
class LogNormal:
    """One component of the length mix: median audio seconds, sigma of log(seconds), relative weight."""
    median_s: float
    sigma: float
    weight: float = 1.0


DEFAULT_LENGTHS = (LogNormal(8.0, 0.6),)


@dataclass(frozen=True)
class OpenLoopSpec:
    rate: float                        # requests per second (Poisson)
    duration_s: float                  # arrivals in [0, duration_s)
    seed: int = 0
    stream_fraction: float = 1.0       # probability that a request streams
    lengths: tuple = field(default=DEFAULT_LENGTHS)
    min_s: float = 2.0                 # audio lengths are clipped to [min_s, max_s]
    max_s: float = 40.0

    def __post_init__(self):
        for name in ("rate", "duration_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or not math.isfinite(v):
                raise InputError(f"open-loop {name} must be a positive number, got {v!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise InputError(f"open-loop seed must be an integer, got {self.seed!r}")
        if not 0.0 <= self.stream_fraction <= 1.0:
            raise InputError(f"open-loop stream fraction must be in [0, 1], got {self.stream_fraction!r}")
        if not 0 < self.min_s <= self.max_s:
            raise InputError(f"open-loop length bounds need 0 < min <= max, got {self.min_s!r}, {self.max_s!r}")
        if not self.lengths or any(c.median_s <= 0 or c.sigma < 0 or c.weight <= 0 for c in self.lengths):
            raise InputError("open-loop lengths: each component needs median > 0, sigma >= 0, weight > 0")

    def at_rate(self, rate: float) -> "OpenLoopSpec":
        return replace(self, rate=rate)

    def to_dict(self) -> dict:
        return {"rate": self.rate, "duration_s": self.duration_s, "seed": self.seed,
                "stream_fraction": self.stream_fraction, "min_s": self.min_s, "max_s": self.max_s,
                "lengths": [[c.median_s, c.sigma, c.weight] for c in self.lengths]}


@dataclass(frozen=True)
class Arrival:
    index: int
    t: float          # seconds after the start of the cell
    tokens: int       # forced speech tokens
    stream: bool
    seed: int         # sampling seed of the request

    @property
    def audio_s(self) -> float:
        return self.tokens / TOKENS_PER_S


def parse_lengths(text: str) -> tuple:
    """`MEDIAN:SIGMA[:WEIGHT]` components joined by '+', e.g. `8:0.6` or `6:0.5:0.8+20:0.4:0.2`."""
    comps = []
    for part in text.split("+"):
        bits = part.strip().split(":")
        try:
            if len(bits) not in (2, 3):
                raise ValueError
            comps.append(LogNormal(*(float(b) for b in bits)))
        except ValueError:
            raise InputError(f"open-loop lengths {text!r}: components are MEDIAN:SIGMA[:WEIGHT] joined by '+'") \
                from None
    return tuple(comps)


_KEYS = {"rate": ("rate", float), "duration": ("duration_s", float), "seed": ("seed", int),
         "stream": ("stream_fraction", float), "lengths": ("lengths", parse_lengths), "min": ("min_s", float),
         "max": ("max_s", float)}


def parse_open_loop(text: str) -> OpenLoopSpec:
    """`rate=8,duration=30,seed=0[,stream=F][,lengths=MIX][,min=S][,max=S]` -> OpenLoopSpec."""
    kw: dict = {}
    for item in text.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in _KEYS:
            raise InputError(f"open-loop spec {text!r}: items are key=value with keys {', '.join(_KEYS)}")
        name, conv = _KEYS[key]
        try:
            kw[name] = conv(value.strip())
        except ValueError:
            raise InputError(f"open-loop spec {text!r}: bad value for {key!r}: {value!r}") from None
    for need in ("rate", "duration_s"):
        if need not in kw:
            raise InputError(f"open-loop spec {text!r}: give {need.split('_')[0]}=...")
    return OpenLoopSpec(**kw)


def sample_length_s(rng: random.Random, spec: OpenLoopSpec) -> float:
    total = sum(c.weight for c in spec.lengths)
    u, comp = rng.random() * total, spec.lengths[-1]
    for c in spec.lengths:
        if u < c.weight:
            comp = c
            break
        u -= c.weight
    s = comp.median_s * math.exp(comp.sigma * rng.gauss(0.0, 1.0))
    return min(spec.max_s, max(spec.min_s, s))


def generate(spec: OpenLoopSpec) -> list[Arrival]:
    """The arrivals of `spec`: Poisson at `rate` over [0, duration_s), lengths from the mix rounded to whole tokens
    (still within the bounds), each streaming with probability `stream_fraction`."""
    gaps = random.Random(f"{spec.seed}:arrivals")
    lengths = random.Random(f"{spec.seed}:lengths")
    modes = random.Random(f"{spec.seed}:modes")
    lo, hi = math.ceil(spec.min_s * TOKENS_PER_S), math.floor(spec.max_s * TOKENS_PER_S)
    out: list[Arrival] = []
    t = gaps.expovariate(spec.rate)
    while t < spec.duration_s:
        tokens = min(hi, max(lo, round(sample_length_s(lengths, spec) * TOKENS_PER_S)))
        out.append(Arrival(len(out), t, max(1, tokens), modes.random() < spec.stream_fraction, len(out)))
        t += gaps.expovariate(spec.rate)
    return out


def offered_audio_s_per_s(arrivals: list[Arrival], duration_s: float) -> float:
    return sum(a.audio_s for a in arrivals) / duration_s
