"""The streaming hop schedule of CosyVoice3 (upstream `CosyVoice2Model.tts`), written once.

A streaming request turns its speech tokens into audio in hops: the first hop is padded so that prompt + hop ends on
a 50-frame chunk boundary (25 tokens), later hops grow x2 up to 100 tokens. A hop fires once offset + hop + 3
look-ahead tokens exist; its DiT call sees all tokens so far plus the look-ahead and keeps the mel of the hop. The
final call (the LM has stopped) covers everything left.

`HopSchedule` is one request's position in it: token2wav's `StreamState`, the AR worker's hop jobs, the cluster's
token flush points and the build's `streaming_schedule` (the calls a request of known length makes) all use it.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...engines.errors import InputError

TOKEN_HOP = 25        # upstream token_hop_len
TOKEN_MAX_HOP = 100   # upstream token_max_hop_len
HOP_SCALE = 2         # upstream stream_scale_factor
LOOKAHEAD = 3         # upstream pre_lookahead_len
TOKEN_MEL_RATIO = 2   # mel frames per speech token


def first_hop(prompt_tokens: int, hop: int = TOKEN_HOP) -> int:
    """First hop = hop + pad, with pad making prompt + hop end on a chunk boundary (25 tokens = 50 frames)."""
    pad = -(-prompt_tokens // hop) * hop - prompt_tokens
    return hop + pad


class HopSchedule:
    """Where one streaming request is in the hop schedule: `offset` tokens are already mel, `hop` is the next hop."""

    def __init__(self, prompt_tokens: int, token_hop_len: int = TOKEN_HOP, token_max_hop_len: int = TOKEN_MAX_HOP,
                 scale: int = HOP_SCALE, lookahead: int = LOOKAHEAD):
        self.max_hop, self.scale, self.lookahead = token_max_hop_len, scale, lookahead
        self.offset = 0                   # generated tokens already turned into mel
        self.base_hop = token_hop_len     # grows x scale up to max_hop
        self.hop = first_hop(prompt_tokens, token_hop_len)
        self.finished = False

    def ready(self, n_tokens: int) -> bool:
        """A hop fires when n_tokens - offset >= hop + look-ahead (never after the final call)."""
        return not self.finished and n_tokens - self.offset >= self.hop + self.lookahead

    def advance(self) -> tuple[int, int]:
        """Take the next hop: returns (offset, upto): its new mel covers tokens [offset, upto), its DiT call sees the
        first upto + lookahead tokens."""
        offset, upto = self.offset, self.offset + self.hop
        self.offset = upto
        self.base_hop = min(self.max_hop, self.base_hop * self.scale)
        self.hop = self.base_hop
        return offset, upto

    def finish(self, n_tokens: int) -> int:
        """The final call over all `n_tokens`; returns the offset its new mel starts at."""
        offset = self.offset
        self.offset = n_tokens
        self.finished = True
        return offset

    def next_fire(self) -> int:
        """The token count at which the next hop fires."""
        return self.offset + self.hop + self.lookahead


@dataclass(frozen=True)
class StreamCall:
    """One call of the upstream CosyVoice3 streaming loop (CosyVoice2Model.tts + CosyVoice3Model.token2wav)."""
    index: int
    token_offset: int    # target tokens already turned into audio before this call
    hop: int             # target tokens this call turns into audio (final: all the rest)
    dit_tokens: int      # target tokens the DiT sees: offset + hop + look-ahead (final: all)
    dit_frames: int      # DiT call length: (prompt + dit_tokens - look-ahead) * ratio (look-ahead gives no frames)
    hift_frames: int     # HiFT input: the whole mel cache so far, this call's mel included
    new_mel_frames: int  # mel frames this call adds to the cache
    final: bool


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def streaming_schedule(prompt_tokens: int, total_tokens: int, *, token_hop_len: int = TOKEN_HOP,
                       token_max_hop_len: int = TOKEN_MAX_HOP, stream_scale_factor: int = HOP_SCALE,
                       pre_lookahead_len: int = LOOKAHEAD, token_mel_ratio: int = TOKEN_MEL_RATIO) -> list[StreamCall]:
    """The calls a streaming request of `prompt_tokens` + `total_tokens` (target) speech tokens makes (the shapes a
    profile's streaming buckets must cover). HiFT frames count the whole mel cache, as upstream re-runs it."""
    for name, v, lo in (("prompt_tokens", prompt_tokens, 0), ("total_tokens", total_tokens, 1),
                        ("token_hop_len", token_hop_len, 1), ("token_max_hop_len", token_max_hop_len, 1),
                        ("stream_scale_factor", stream_scale_factor, 1), ("pre_lookahead_len", pre_lookahead_len, 0),
                        ("token_mel_ratio", token_mel_ratio, 1)):
        if not _is_int(v) or v < lo:
            raise InputError(f"streaming_schedule: {name} must be an integer >= {lo}, got {v!r}")
    P, N, r = prompt_tokens, total_tokens, token_mel_ratio
    hops = HopSchedule(P, token_hop_len, token_max_hop_len, stream_scale_factor, pre_lookahead_len)
    calls: list[StreamCall] = []
    while hops.ready(N):
        offset, upto = hops.advance()
        # the look-ahead tokens are PreLookahead context only: the DiT runs on (P + upto) * r frames
        calls.append(StreamCall(len(calls), offset, upto - offset, upto + pre_lookahead_len, (P + upto) * r,
                                upto * r, (upto - offset) * r, False))
    offset = hops.finish(N)
    calls.append(StreamCall(len(calls), offset, N - offset, N, (P + N) * r, N * r, (N - offset) * r, True))
    return calls


def streaming_call_frames(prompt_tokens: int, total_tokens: int, stage: str = "dit", **schedule) -> list[int]:
    """Per call of a streaming request: DiT mel frames (stage='dit') or HiFT input mel frames (stage='hift').

    P=20, 120 target tokens: dit [100, 200, 280], hift [60, 160, 240]."""
    from ...engines.errors import BucketError

    calls = streaming_schedule(prompt_tokens, total_tokens, **schedule)
    if stage == "dit":
        return [c.dit_frames for c in calls]
    if stage == "hift":
        return [c.hift_frames for c in calls]
    raise BucketError(f"streaming_call_frames: stage must be 'dit' or 'hift', got {stage!r}")
