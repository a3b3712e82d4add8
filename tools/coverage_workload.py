"""Coverage workloads: the requests `trtbuild coverage` replays (a JSONL file, the built-in matrix or generated
open-loop traffic).

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
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

from ..engines.errors import InputError
from ._cli import read_jsonl

FILLER = ("The quick brown fox jumps over the lazy dog while the river keeps running past the old mill, and "
          "every evening the people of the valley gather to tell long stories about the seasons, the harvest, "
          "the travellers who came and went, and the songs that nobody remembers how to finish. ")

# bounds of a workload line, so a typo cannot exhaust memory (a list of a billion requests, a filler text of a
# trillion tokens) or run a simulation for ever: the LM's context (32768 positions) bounds the text and speech tokens
MAX_CONCURRENCY = 4096
MAX_TOKENS = 32768
MAX_REQUESTS = 100_000

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



def _int_field(d: dict, k: str, where: str, lo: int, hi: int | None = None) -> int | None:
    v = d.get(k)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        bound = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise InputError(f"{where}: field {k!r} must be an integer {bound}, got {v!r}")
    return v


def parse_request(d, where: str, default_group: str) -> list[WorkloadRequest]:
    """One workload line (already JSON-decoded) -> its requests (concurrency copies)."""
    if not isinstance(d, dict):
        raise InputError(f"{where}: a workload line must be a JSON object, got {type(d).__name__}")
    unknown = sorted(set(d) - set(_FIELDS))
    if unknown:
        raise InputError(f"{where}: unknown field(s) {unknown} (fields: {', '.join(_FIELDS)})")
    text, tt = d.get("text"), _int_field(d, "text_tokens", where, 1, MAX_TOKENS)
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
    conc = _int_field(d, "concurrency", where, 1, MAX_CONCURRENCY) or 1
    seed = _int_field(d, "seed", where, 0) or 0
    st = _int_field(d, "speech_tokens", where, 1, MAX_TOKENS)
    at = d.get("arrival_s")
    if at is not None and (isinstance(at, bool) or not isinstance(at, (int, float)) or not 0 <= at < math.inf):
        raise InputError(f"{where}: field 'arrival_s' must be a number >= 0 or null, got {at!r}")
    return [WorkloadRequest(text, tt, st, None if ps is None else float(ps), stream, str(group), seed + i,
                            None if at is None else float(at)) for i in range(conc)]


def load_workload(path: str) -> list[WorkloadRequest]:
    if not os.path.isfile(path):
        raise InputError(f"workload file not found: {path}")
    out: list[WorkloadRequest] = []
    for i, where, d in read_jsonl(path):
        out += parse_request(d, where, f"line{i}")
        if len(out) > MAX_REQUESTS:
            raise InputError(f"{where}: the workload holds more than {MAX_REQUESTS} requests")
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

    if spec.rate * spec.duration_s > MAX_REQUESTS:
        raise InputError(f"open-loop rate x duration is {spec.rate * spec.duration_s:g} requests; at most "
                         f"{MAX_REQUESTS}")
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
