"""Named voices for the server: saved speakers in one folder, plus the model's built-in voice.

A voice id matches `VOICE_ID_PATTERN` and is stored as `<voices_dir>/<id>.safetensors` (the `save_speaker` format),
so an id can never name a path outside the folder. The built-in voice `default` (and the OpenAI voice names, unless
a stored voice takes the name) is the model's own speaker, when it has one (the tiny model does).
"""
from __future__ import annotations

import os
import re
import tempfile
import threading
import time
from dataclasses import dataclass

from ...engines.errors import InputError
from ..models.frontend import SavedSpeaker, load_speaker, save_speaker

VOICE_ID_PATTERN = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")  # always used with fullmatch ("$" passes "x\n")
VOICE_SUFFIX = ".safetensors"
BUILTIN_VOICE = "default"
OPENAI_VOICES = ("alloy", "ash", "ballad", "cedar", "coral", "echo", "fable", "marin", "nova", "onyx", "sage",
                 "shimmer", "verse")


class VoiceNotFoundError(InputError):
    """A well-formed voice id that names no voice."""


class VoiceExistsError(InputError):
    """A voice with this id is already stored (or the id is reserved)."""


class VoiceLimitError(InputError):
    """The voices folder holds `max_voices` voices already."""


@dataclass
class VoiceInfo:
    id: str
    prompt_text: str
    created_at: int
    builtin: bool = False

    def to_dict(self) -> dict:
        return {"id": self.id, "object": "voice", "name": self.id, "prompt_text": self.prompt_text,
                "created_at": self.created_at, "builtin": self.builtin}


def check_voice_id(voice_id) -> str:
    """The id itself when it matches `VOICE_ID_PATTERN`, else InputError naming it."""
    if not isinstance(voice_id, str) or not VOICE_ID_PATTERN.fullmatch(voice_id):
        raise InputError(f"voice id {voice_id!r} is invalid: use 1-64 characters of a-z, 0-9, '_' and '-', starting "
                         f"with a letter or digit")
    return voice_id


class VoiceStore:
    """Saved speakers in `root` (created when missing), cached in memory after the first load. Thread-safe."""

    def __init__(self, root: str, builtin: SavedSpeaker | None = None, max_voices: int | None = None):
        self.root = os.path.abspath(os.path.expanduser(root))
        self.max_voices = max_voices
        os.makedirs(self.root, exist_ok=True)
        self.builtin = builtin
        self._started = int(time.time())
        self._cache: dict[str, SavedSpeaker] = {}
        self._lock = threading.Lock()

    def path(self, voice_id: str) -> str:
        """The file of a (validated) id, checked to lie directly inside the folder."""
        check_voice_id(voice_id)
        path = os.path.join(self.root, voice_id + VOICE_SUFFIX)
        if os.path.dirname(os.path.realpath(path)) != os.path.realpath(self.root):
            raise InputError(f"voice id {voice_id!r} resolves outside the voices folder")
        return path

    def is_builtin(self, voice_id: str) -> bool:
        return self.builtin is not None and (voice_id == BUILTIN_VOICE or voice_id in OPENAI_VOICES)

    def get(self, voice_id: str) -> SavedSpeaker:
        """A stored voice, else the built-in one for `default` / an OpenAI name; VoiceNotFoundError otherwise."""
        path = self.path(voice_id)
        with self._lock:
            spk = self._cache.get(voice_id)
        if spk is not None:
            return spk
        if voice_id != BUILTIN_VOICE and os.path.isfile(path):
            spk = load_speaker(path)
            with self._lock:
                self._cache[voice_id] = spk
            return spk
        if self.is_builtin(voice_id):
            return self.builtin
        raise VoiceNotFoundError(f"voice {voice_id!r} not found")

    def add(self, voice_id: str, speaker: SavedSpeaker) -> VoiceInfo:
        """Store a new voice (atomically); VoiceExistsError when the id is taken or reserved."""
        path = self.path(voice_id)
        if voice_id == BUILTIN_VOICE:
            raise VoiceExistsError(f"voice id {BUILTIN_VOICE!r} is reserved for the built-in voice")
        with self._lock:
            if os.path.exists(path):
                raise VoiceExistsError(f"voice {voice_id!r} already exists")
            if self.max_voices is not None and self.count() >= self.max_voices:
                raise VoiceLimitError(f"the server stores at most {self.max_voices} voices; delete one first")
            fd, tmp = tempfile.mkstemp(prefix=".upload-", suffix=VOICE_SUFFIX, dir=self.root)
            os.close(fd)
            try:
                save_speaker(tmp, speaker.features, speaker.prompt_text)
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            self._cache[voice_id] = speaker
        return VoiceInfo(voice_id, speaker.prompt_text, int(os.path.getmtime(path)))

    def delete(self, voice_id: str) -> None:
        path = self.path(voice_id)
        with self._lock:
            if not os.path.isfile(path):
                if self.is_builtin(voice_id):
                    raise VoiceExistsError(f"voice {voice_id!r} is built in and cannot be deleted")
                raise VoiceNotFoundError(f"voice {voice_id!r} not found")
            os.unlink(path)
            self._cache.pop(voice_id, None)

    def count(self) -> int:
        """Stored voices (files in the folder with a valid id)."""
        return sum(1 for n in os.listdir(self.root)
                   if n.endswith(VOICE_SUFFIX) and VOICE_ID_PATTERN.fullmatch(n[: -len(VOICE_SUFFIX)]))

    def list(self) -> list[VoiceInfo]:
        """The built-in voice (when there is one) and every stored voice, sorted by id."""
        out = [VoiceInfo(BUILTIN_VOICE, self.builtin.prompt_text, self._started, True)] if self.builtin else []
        for name in sorted(os.listdir(self.root)):
            voice_id = name[: -len(VOICE_SUFFIX)]
            if not name.endswith(VOICE_SUFFIX) or not VOICE_ID_PATTERN.fullmatch(voice_id):
                continue
            path = os.path.join(self.root, name)
            try:
                text = self.get(voice_id).prompt_text
            except InputError:
                continue  # not a readable speaker file: skipped, not fatal
            out.append(VoiceInfo(voice_id, text, int(os.path.getmtime(path))))
        return out
