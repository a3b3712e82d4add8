"""A synthesis request, its per-request metrics, and the frontend step that turns it into model inputs."""
from __future__ import annotations

import dataclasses
import itertools
import os
import time
from dataclasses import dataclass, field

import numpy as np

from ...engines.errors import InputError
from ..models.frontend import Frontend, LMRequestInputs, SavedSpeaker, load_speaker
from ..models.sampling import SamplingParams

_ids = itertools.count(1)


@dataclass
class Request:
    """What a user asks for. Exactly one voice source: prompt audio, a saved speaker, or the model's default voice.

    Modes: zero-shot (prompt audio + `prompt_text`), cross-lingual (prompt audio, no transcript), instruct
    (`instruct` text ending in <|endofprompt|>, optional prompt audio for the flow)."""

    text: str
    prompt_wav: object = None  # path or np.ndarray
    prompt_sr: int | None = None
    prompt_text: str | None = None
    instruct: str | None = None
    speaker: object = None  # SavedSpeaker or a path to a saved-speaker file
    stream: bool = False
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: int = field(default_factory=lambda: next(_ids))
    speed: float = 1.0  # offline only: the final mel is linearly resampled to frames / speed (upstream's way)
    # seconds of audio the listener still has buffered from earlier requests (a conversation's next sentence): the
    # scheduler's playback-slack priority counts it, so work for a listener with audio in hand yields to one without.
    # Ordering only: the audio is the same.
    buffered_s: float = 0.0

    def __post_init__(self):
        if not isinstance(self.text, str) or not self.text.strip():
            raise InputError("request text is empty")
        if self.prompt_wav is not None and self.speaker is not None:
            raise InputError("give either prompt audio or a saved speaker, not both")
        if self.prompt_wav is None and (self.prompt_text or self.prompt_sr is not None):
            name = "prompt_text" if self.prompt_text else "prompt_sr"
            raise InputError(f"{name} describes prompt audio, and no prompt_wav is given"
                             + (" (a saved speaker carries its own transcript)" if self.speaker is not None else ""))
        if self.speaker is not None and not isinstance(self.speaker, (SavedSpeaker, str, os.PathLike)):
            raise InputError(f"speaker must be a SavedSpeaker or the path of a saved-speaker file, got "
                             f"{type(self.speaker).__name__}")
        if isinstance(self.speed, bool) or not isinstance(self.speed, (int, float)) or not 0.25 <= self.speed <= 4.0:
            raise InputError(f"speed must be a number in [0.25, 4], got {self.speed!r}")
        if (isinstance(self.buffered_s, bool) or not isinstance(self.buffered_s, (int, float))
                or not 0.0 <= self.buffered_s < 3600.0):
            raise InputError(f"buffered_s must be a number of seconds in [0, 3600), got {self.buffered_s!r}")
        if self.stream and self.speed != 1.0:
            raise InputError("speed changes only apply offline (upstream resamples the whole mel): use stream=False")

    def without_voice(self) -> "Request":
        """This request with no voice source (no prompt audio, its transcript and rate, no saved speaker): what a
        stage past the frontend needs, once the frontend has turned the voice into LM / flow inputs."""
        return dataclasses.replace(self, prompt_wav=None, prompt_sr=None, prompt_text=None, speaker=None)


@dataclass
class RequestMetrics:
    """Per-request timings in seconds; filled by whichever path runs the request."""

    request_id: int = 0
    stream: bool = False
    t_submit: float = field(default_factory=time.perf_counter)
    t_tokenizer: float = 0.0
    t_ar: float = 0.0
    t_dit: float = 0.0
    t_vocoder: float = 0.0
    t_queue: float = 0.0
    ttfa: float | None = None  # time to first audio
    chunk_times: list = field(default_factory=list)  # arrival times of chunks, relative to submit
    total: float = 0.0
    tokens: int = 0
    audio_seconds: float = 0.0
    error: str | None = None
    buffered_s: float = 0.0  # the request's `buffered_s` hint (playback_slack)
    # the metrics of the request whose audio the same listener hears right before this one's (TTS.submit(after=...)):
    # playback_slack chains them
    follows: "RequestMetrics | None" = field(default=None, repr=False, compare=False)
    # Where the first audio's time went: seconds after submit at which the request's AR prefill started ("prefill"),
    # its first DiT job was queued ("dit_queued"), started ("dit_start") and handed its mel on ("dit_end"); with
    # `ttfa` they split time to first audio into frontend + queue, AR, DiT wait, DiT, vocoder + copy
    marks: dict = field(default_factory=dict)

    @property
    def rtf(self) -> float:
        return self.total / self.audio_seconds if self.audio_seconds > 0 else float("inf")

    @property
    def inter_chunk(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    def mark(self, name: str, t: float | None = None) -> None:
        """Record event `name` (first occurrence only) at perf_counter time `t` (default now)."""
        if name not in self.marks:
            self.marks[name] = (time.perf_counter() if t is None else t) - self.t_submit

    def mark_chunk(self, samples: int, sample_rate: int) -> None:
        now = time.perf_counter() - self.t_submit
        if self.ttfa is None:
            self.ttfa = now
        self.chunk_times.append(now)
        self.audio_seconds += samples / sample_rate

    def to_dict(self) -> dict:
        return {"request_id": self.request_id, "stream": self.stream, "T_tokenizer": self.t_tokenizer,
                "T_AR": self.t_ar, "T_DiT": self.t_dit, "T_vocoder": self.t_vocoder, "T_queue": self.t_queue,
                "ttfa": self.ttfa, "inter_chunk": self.inter_chunk, "total": self.total, "tokens": self.tokens,
                "audio_seconds": self.audio_seconds, "rtf": self.rtf if self.audio_seconds else None,
                "error": self.error, "marks": dict(self.marks)}


def default_voice_wav(sr: int = 16000, seconds: float = 3.0) -> np.ndarray:
    """A deterministic synthetic voice-like prompt (harmonic glide with a syllable envelope) for the tiny model."""
    t = np.arange(int(sr * seconds)) / sr
    f0 = 140.0 + 30.0 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / sr
    wav = sum(np.sin(k * phase) / k for k in range(1, 8))
    env = 0.5 * (1 - np.cos(2 * np.pi * 3.0 * t))
    return (0.2 * wav * env / np.max(np.abs(wav))).astype(np.float32)


def prepare_inputs(frontend: Frontend, req: Request, default_speaker: SavedSpeaker | None) -> LMRequestInputs:
    """Run the frontend for one request (the T_tokenizer part)."""
    if req.speaker is not None:
        spk = load_speaker(req.speaker) if isinstance(req.speaker, str) else req.speaker
        if req.instruct:
            return frontend.instruct(req.text, req.instruct, features=spk.features)
        return frontend.from_speaker(req.text, spk)
    if req.prompt_wav is not None:
        if req.instruct:
            return frontend.instruct(req.text, req.instruct, req.prompt_wav, req.prompt_sr)
        if req.prompt_text:
            return frontend.zero_shot(req.text, req.prompt_text, req.prompt_wav, req.prompt_sr)
        return frontend.cross_lingual(req.text, req.prompt_wav, req.prompt_sr)
    if default_speaker is None:
        raise InputError("this model has no built-in voice: give prompt audio (with its transcript) or a saved "
                         "speaker")
    if req.instruct:
        return frontend.instruct(req.text, req.instruct, features=default_speaker.features)
    return frontend.from_speaker(req.text, default_speaker)
