"""The /v1/audio/speech body: bounded JSON parsing, a pydantic model of the fields, and the mapping to runtime
options.

OpenAI's fields (`model` required, `input`, `voice` (optional here: the model's default voice), `response_format`,
`speed`, `instructions`, `stream_format`) plus ours (`seed`, `stream`, `instruct`, `max_tokens`, `force_tokens`,
`ref_audio` / `ref_text` inline cloning, `sample_rate` of the output: 8–48 kHz, e.g. 8000 for telephony) and an
allow-list of extras that peer clients and benchmarks send (vllm-omni, sglang-omni): `max_new_tokens` (=
`max_tokens`), `language`, `task_type`, `top_p`, `top_k`, and knobs accepted but not used (`temperature`,
`repetition_penalty`, ...). `strict` turns the extras off (400 on any unknown field)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from .encoding import (G711_FORMATS, RESPONSE_FORMATS, STREAM_FORMATS, check_response_format,
                       check_sample_rate)
from .errors import APIError, invalid
from .settings import ServerSettings
from .voices import check_voice_id

LANGUAGES = {"auto", "chinese", "english", "japanese", "korean", "german", "french", "russian", "portuguese",
             "spanish", "italian", "cantonese", "zh", "en", "ja", "jp", "ko", "de", "fr", "ru", "pt", "es", "it", "yue"}
TASK_TYPES = ("Base", "CustomVoice", "VoiceDesign")
IGNORED_EXTRAS = ("temperature", "repetition_penalty", "extra_params", "initial_codec_chunk_frames",
                  "x_vector_only_mode", "ignore_eos", "user", "min_p", "presence_penalty", "frequency_penalty")
MAPPED_EXTRAS = ("max_new_tokens", "language", "task_type", "top_p", "top_k", "references")
Number = Union[StrictInt, StrictFloat]


class VoiceRef(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: StrictStr


class Reference(BaseModel):
    model_config = ConfigDict(extra="allow")
    audio_path: Optional[StrictStr] = None
    audio: Optional[StrictStr] = None
    text: Optional[StrictStr] = None


class SpeechBody(BaseModel):
    """The fields we know; `extra="allow"` keeps the rest for the allow-list check."""
    model_config = ConfigDict(extra="allow")

    model: StrictStr
    input: StrictStr
    voice: Optional[Union[StrictStr, VoiceRef]] = None
    response_format: StrictStr = "wav"
    speed: Number = 1.0
    seed: Optional[StrictInt] = Field(default=None, ge=0, lt=2 ** 63)
    instruct: Optional[StrictStr] = None
    instructions: Optional[StrictStr] = None
    stream: StrictBool = False
    stream_format: Optional[StrictStr] = None
    max_tokens: Optional[StrictInt] = Field(default=None, ge=1, le=1 << 20)
    force_tokens: Optional[StrictInt] = Field(default=None, ge=1, le=1 << 20)
    ref_audio: Optional[StrictStr] = None
    ref_text: Optional[StrictStr] = None
    sample_rate: Optional[StrictInt] = None
    # allow-listed extras that change something
    max_new_tokens: Optional[StrictInt] = Field(default=None, ge=1, le=1 << 20)
    language: Optional[StrictStr] = None
    task_type: Optional[StrictStr] = None
    top_p: Optional[Number] = Field(default=None, gt=0, le=1)
    top_k: Optional[StrictInt] = Field(default=None, ge=1, le=100000)
    references: Optional[list[Reference]] = Field(default=None, max_length=1)


CORE_FIELDS = {"model", "input", "voice", "response_format", "speed", "seed", "instruct", "instructions", "stream",
               "stream_format", "max_tokens", "force_tokens", "ref_audio", "ref_text", "sample_rate"}


@dataclass
class SpeechParams:
    input: str
    voice: str | None
    response_format: str = "wav"
    stream: bool = False
    sse: bool = False
    sse_wav: bool = False      # SSE events each carrying one small WAV (ServerSettings.stream_wav_sse)
    speed: float = 1.0
    ref_audio: str | None = None
    ref_text: str = ""
    sample_rate: int | None = None  # the output's rate when not the model's (resampled with soxr)
    options: dict = field(default_factory=dict)  # seed, instruct, max_tokens, force_tokens, top_p, top_k
    ignored: list[str] = field(default_factory=list)


def json_depth_ok(raw: bytes, limit: int) -> bool:
    """True when no array / object nests deeper than `limit` (a linear scan; strings skipped)."""
    depth, in_str, esc = 0, False, False
    for b in raw:
        if in_str:
            if esc:
                esc = False
            elif b == 0x5C:
                esc = True
            elif b == 0x22:
                in_str = False
        elif b == 0x22:
            in_str = True
        elif b in (0x5B, 0x7B):
            depth += 1
            if depth > limit:
                return False
        elif b in (0x5D, 0x7D):
            depth -= 1
    return True


def _check_text(v: Any, where: str) -> None:
    """Every string must be encodable (a lone surrogate such as "\\ud800" is valid JSON but not text)."""
    if isinstance(v, str):
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            raise invalid(f"'{where}' contains an unpaired surrogate (not valid Unicode text)", where,
                          "invalid_text") from None
    elif isinstance(v, dict):
        for k, x in v.items():
            _check_text(k, where)
            _check_text(x, where if where != "body" else str(k))
    elif isinstance(v, list):
        for x in v:
            _check_text(x, where)


def load_json(raw: bytes, settings: ServerSettings) -> Any:
    """The JSON body as UTF-8 (a BOM allowed; a lone surrogate's bytes pass here and are refused by name below),
    nesting checked on the same bytes before it is parsed. Not UTF-16 / UTF-32, which `json.loads` would detect on
    bytes: their quote and bracket bytes are not what the depth scan reads (a UTF-16 body slipped past it)."""
    try:
        text = raw.decode("utf-8-sig", "surrogatepass")
    except UnicodeDecodeError as e:
        raise invalid(f"the request body is not UTF-8 text (byte {e.start})", "body", "invalid_json") from None
    if not json_depth_ok(raw, settings.max_json_depth):
        raise invalid(f"the JSON body nests deeper than {settings.max_json_depth} levels", "body", "invalid_json")
    try:
        body = json.loads(text)
        _check_text(body, "body")
    except (ValueError, RecursionError) as e:  # JSONDecodeError, int digit limit
        raise invalid(f"the request body is not valid JSON: {str(e)[:200]}", "body", "invalid_json") from None
    return body


_PYDANTIC_CODES = {"missing": "missing_required"}


def _from_validation(e: ValidationError) -> APIError:
    err = e.errors(include_url=False)[0]
    loc = err.get("loc") or ()
    name = str(loc[0]) if loc else "body"
    kind = err.get("type", "")
    if kind == "missing":
        hint = {"model": " (the model name, e.g. 'cosyvoice3')", "input": " (the text to speak)"}.get(name, "")
        return invalid(f"'{name}' is required{hint}", name, "missing_required")
    got = err.get("input")
    shown = json.dumps(got)[:80] if isinstance(got, (str, int, float, bool, type(None))) else type(got).__name__
    code = "invalid_type" if kind.endswith("_type") or kind in ("model_type", "union_tag_invalid") else "invalid_value"
    return invalid(f"'{name}': {err.get('msg', 'invalid value')} (got {shown})", name, code)


def parse_speech_request(body, settings: ServerSettings) -> SpeechParams:
    """Validate the JSON body of /v1/audio/speech; APIError (400 / 413) naming the field."""
    if not isinstance(body, dict):
        raise invalid(f"request body must be a JSON object, got {type(body).__name__}", "body", "invalid_type")
    allowed = CORE_FIELDS if settings.strict else CORE_FIELDS | set(MAPPED_EXTRAS) | set(IGNORED_EXTRAS)
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise invalid(f"unknown field(s): {', '.join(unknown)}; supported: {', '.join(sorted(allowed))}",
                      unknown[0], "unknown_parameter")
    try:
        b = SpeechBody.model_validate(body)
    except ValidationError as e:
        raise _from_validation(e) from None
    text = b.input
    if not text.strip():
        raise invalid("'input' is empty", "input")
    if len(text) > settings.max_input_chars:
        raise APIError(400, f"'input' is {len(text)} characters long; at most {settings.max_input_chars} are "
                            f"allowed", param="input", code="input_too_long")
    voice = b.voice.id if isinstance(b.voice, VoiceRef) else b.voice
    if voice is not None:
        try:
            check_voice_id(voice)
        except Exception as e:  # noqa: BLE001 - InputError
            raise invalid(str(e), "voice") from None
    fmt = b.response_format
    if fmt not in RESPONSE_FORMATS:
        raise invalid(f"response_format {fmt!r} is not supported; use one of {', '.join(RESPONSE_FORMATS)}",
                      "response_format", "unsupported_value")
    check_response_format(fmt)
    sample_rate = b.sample_rate if b.sample_rate is not None else (8000 if fmt in G711_FORMATS else None)
    if sample_rate is not None:
        check_sample_rate(sample_rate, fmt)
    speed = float(b.speed)
    if not 0.25 <= speed <= 4.0:
        raise invalid(f"speed must be in [0.25, 4], got {b.speed}", "speed")
    if b.stream_format not in (None, "audio", "sse"):
        raise invalid(f"stream_format {b.stream_format!r} is not supported; use 'audio' or 'sse'", "stream_format",
                      "unsupported_value")
    sse = b.stream_format == "sse"
    stream = b.stream or b.stream_format is not None
    # older sglang-omni seedtts --stream clients send stream=true + wav and read SSE events of WAV chunks: opt-in,
    # since OpenAI-style clients send the same body and read a chunked WAV
    sse_wav = settings.stream_wav_sse and stream and b.stream_format is None and fmt == "wav"
    if stream and fmt not in STREAM_FORMATS:
        raise invalid(f"streaming supports response_format {', '.join(STREAM_FORMATS)}, not {fmt!r}",
                      "response_format", "unsupported_value")
    if stream and speed != 1.0:
        raise invalid("speed applies offline only (as upstream, the whole mel is resampled): send stream=false or "
                      "speed 1.0", "speed", "unsupported_value")
    if b.language is not None and b.language.lower() not in LANGUAGES:
        raise invalid(f"language {b.language!r} is not supported", "language", "unsupported_value")
    if b.task_type is not None and b.task_type not in TASK_TYPES:
        raise invalid(f"task_type {b.task_type!r} is not supported; use one of {', '.join(TASK_TYPES)}",
                      "task_type", "unsupported_value")
    options: dict = {}
    if b.seed is not None:
        options["seed"] = b.seed
    if b.instruct and b.instructions:
        raise invalid("give 'instruct' or 'instructions', not both", "instructions")
    instruct = b.instruct or b.instructions
    if instruct:
        if len(instruct) > settings.max_input_chars:  # tokenised with the input: bounded alike
            name = "instruct" if b.instruct else "instructions"
            raise APIError(400, f"'{name}' is {len(instruct)} characters long; at most {settings.max_input_chars} are "
                                f"allowed", param=name, code="input_too_long")
        options["instruct"] = instruct
    if b.max_tokens is not None and b.max_new_tokens is not None and b.max_tokens != b.max_new_tokens:
        raise invalid("give 'max_tokens' or 'max_new_tokens', not both", "max_new_tokens")
    cap = b.max_tokens if b.max_tokens is not None else b.max_new_tokens
    if cap is not None:
        options["max_tokens"] = cap
    if b.force_tokens is not None:
        options["force_tokens"] = b.force_tokens
    if b.top_p is not None:
        options["top_p"] = float(b.top_p)
    if b.top_k is not None:
        options["top_k"] = b.top_k
    ref_audio, ref_text = b.ref_audio, b.ref_text or ""
    if b.references:
        r = b.references[0]
        ref_audio = ref_audio or r.audio_path or r.audio
        ref_text = ref_text or r.text or ""
    if ref_text and ref_audio is None:
        raise invalid("'ref_text' needs 'ref_audio' (the reference audio it transcribes)", "ref_audio",
                      "missing_required")
    if len(ref_text) > settings.max_transcript_chars:
        raise invalid(f"'ref_text' is {len(ref_text)} characters; at most {settings.max_transcript_chars}",
                      "ref_text", "transcript_too_long")
    ignored = sorted(k for k in body if k in IGNORED_EXTRAS)
    return SpeechParams(input=text, voice=voice, response_format=fmt, stream=stream, sse=sse, sse_wav=sse_wav,
                        speed=speed, sample_rate=sample_rate,
                        ref_audio=ref_audio, ref_text=ref_text, options=options, ignored=ignored)
