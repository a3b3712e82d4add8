"""Audio in and out of the server: response encodings and bounded decoding of uploaded reference audio.

Out: wav / pcm (16-bit mono, built here), ulaw / alaw (G.711 at 8 kHz for telephony, built here), flac / mp3 / opus
(libsndfile through soundfile), aac (ADTS, FFmpeg's native AAC encoder through PyAV, the optional `aac` extra: `pip
install cosytrt[aac]`; without it a clear 400 naming the extra; libsndfile has no AAC encoder); any of them at another
sample rate through `Resampler` (soxr).
In: the header is read first (`soundfile.info`, no samples decoded) and the duration, channel count and sample rate
are checked against the limits before anything is decoded; decoding then reads at most the allowed frames."""
from __future__ import annotations

import base64
import binascii
import io
import os
import re
import struct
from urllib.parse import unquote, urlparse

import numpy as np

from ...engines.errors import InputError
from ..models.audio import check_peak
from .errors import APIError, invalid

UNKNOWN_LENGTH = 0xFFFFFFFF
RESPONSE_FORMATS = ("wav", "pcm", "flac", "mp3", "opus", "aac", "ulaw", "alaw")
STREAM_FORMATS = ("wav", "pcm", "ulaw", "alaw")
RAW_FORMATS = ("pcm", "ulaw", "alaw")  # headerless sample streams (the websocket session sends one of these)
G711_FORMATS = ("ulaw", "alaw")  # telephony: 8-bit G.711 at 8 kHz (Twilio / SIP media streams)
MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac", "mp3": "audio/mpeg",
               "opus": "audio/ogg; codecs=opus", "aac": "audio/aac", "ulaw": "audio/basic",
               "alaw": "audio/x-alaw-basic"}
SOUNDFILE_FORMATS = {"flac": ("FLAC", "PCM_16"), "mp3": ("MP3", "MPEG_LAYER_III"), "opus": ("OGG", "OPUS")}
MIN_SAMPLE_RATE = 8000
MAX_OUTPUT_SAMPLE_RATE = 48000
# the rates each lossy encoder takes (wav / pcm / flac: any rate in [MIN_SAMPLE_RATE, MAX_OUTPUT_SAMPLE_RATE])
_MPEG_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)
ENCODER_SAMPLE_RATES = {"mp3": _MPEG_RATES, "aac": _MPEG_RATES, "opus": (8000, 12000, 16000, 24000, 48000),
                        "ulaw": (8000,), "alaw": (8000,)}
_ULAW_SEG_END = np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF])
_ALAW_SEG_END = np.array([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF])


def pcm16(wav: np.ndarray) -> bytes:
    """float32 samples in [-1, 1] -> 16-bit little-endian PCM bytes."""
    x = np.clip(np.asarray(wav, dtype=np.float32).reshape(-1), -1.0, 1.0)
    return np.rint(x * 32767.0).astype("<i2").tobytes()


def g711(pcm: np.ndarray, law: str) -> bytes:
    """16-bit samples -> G.711 bytes ("ulaw": mu-law, "alaw": A-law), the ITU / Sun reference arithmetic (what
    Python's former audioop.lin2ulaw / lin2alaw computed: tested against it where it exists)."""
    x = np.asarray(pcm, dtype=np.int16).astype(np.int32)
    if law == "ulaw":
        v = x >> 2
        mask = np.where(v < 0, 0x7F, 0xFF)
        v = np.minimum(np.abs(v), 8159) + 0x21
        seg = np.searchsorted(_ULAW_SEG_END, v)  # first segment whose end >= v
        code = (np.minimum(seg, 7) << 4) | ((v >> (np.minimum(seg, 7) + 1)) & 0xF)
        code = np.where(seg >= 8, 0x7F, code) ^ mask
    elif law == "alaw":
        v = x >> 3
        neg = v < 0
        mask = np.where(neg, 0x55, 0xD5)
        v = np.where(neg, -v - 1, v)
        seg = np.searchsorted(_ALAW_SEG_END, v)
        s7 = np.minimum(seg, 7)
        code = (s7 << 4) | np.where(s7 < 2, (v >> 1) & 0xF, (v >> s7) & 0xF)
        code = np.where(seg >= 8, 0x7F, code) ^ mask
    else:
        raise ValueError(f"unknown G.711 law {law!r}")
    return code.astype(np.uint8).tobytes()


def raw_audio(wav: np.ndarray, fmt: str) -> bytes:
    """float32 samples -> the sample bytes of `fmt` ("wav" / "pcm": 16-bit little-endian; "ulaw" / "alaw": G.711)."""
    if fmt in G711_FORMATS:
        return g711(np.frombuffer(pcm16(wav), dtype="<i2"), fmt)
    return pcm16(wav)


def wav_header(sample_rate: int, num_samples: int | None) -> bytes:
    """44-byte RIFF/WAVE header for 16-bit mono PCM; `num_samples=None` writes 0xFFFFFFFF sizes (streaming)."""
    if num_samples is None:
        riff_size = data_size = UNKNOWN_LENGTH
    else:
        data_size = 2 * num_samples
        riff_size = 36 + data_size
    return (b"RIFF" + struct.pack("<I", riff_size) + b"WAVE" + b"fmt " +
            struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, 2 * sample_rate, 2, 16) + b"data" +
            struct.pack("<I", data_size))


def aac_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("av") is not None


def check_response_format(fmt: str) -> None:
    if fmt == "aac" and not aac_available():
        raise invalid("response_format 'aac' is not available: this server has no AAC encoder (install the 'aac' "
                      "extra, PyAV: pip install 'cosytrt[aac]'; or use mp3, opus, flac, wav or pcm)",
                      "response_format", "unsupported_value")


def encode_aac(samples: np.ndarray, sample_rate: int) -> bytes:
    """16-bit mono samples -> AAC-LC in an ADTS stream (what `audio/aac` means), with PyAV."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="adts") as out:
        stream = out.add_stream("aac", rate=sample_rate)
        stream.layout = "mono"
        frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = sample_rate
        for packet in stream.encode(frame):  # PyAV converts to the encoder's float planar frames
            out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


def encode_audio(wav: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    if fmt in G711_FORMATS:
        return raw_audio(wav, fmt)
    pcm = pcm16(wav)
    if fmt == "pcm":
        return pcm
    if fmt == "wav":
        return wav_header(sample_rate, len(pcm) // 2) + pcm
    check_response_format(fmt)
    samples = np.frombuffer(pcm, dtype="<i2")
    if samples.size == 0:  # lossy encoders reject empty input: write one silent sample
        samples = np.zeros(1, "<i2")
    if fmt == "aac":
        return encode_aac(samples, sample_rate)
    import soundfile as sf

    container, subtype = SOUNDFILE_FORMATS[fmt]
    buf = io.BytesIO()
    sf.write(buf, samples, sample_rate, format=container, subtype=subtype)
    return buf.getvalue()


def check_sample_rate(sample_rate: int, fmt: str) -> None:
    """The output rate a request asks for (`sample_rate`): within [8 kHz, 48 kHz] and one the format's encoder
    takes; 400 naming the field otherwise."""
    if not MIN_SAMPLE_RATE <= sample_rate <= MAX_OUTPUT_SAMPLE_RATE:
        raise invalid(f"sample_rate must be in [{MIN_SAMPLE_RATE}, {MAX_OUTPUT_SAMPLE_RATE}] Hz, got {sample_rate}",
                      "sample_rate", "invalid_value")
    rates = ENCODER_SAMPLE_RATES.get(fmt)
    if rates is not None and sample_rate not in rates:
        raise invalid(f"response_format {fmt!r} takes sample_rate {', '.join(map(str, rates))}, not {sample_rate}",
                      "sample_rate", "unsupported_value")


class Resampler:
    """Float32 chunks at `rate_in` -> the same audio at `rate_out` (soxr, HQ), chunk by chunk; the concatenated
    output equals resampling the whole at once (soxr's streaming resampler is exact: tested). `flush()` returns the
    tail the filter still holds. Identity when the rates are equal."""

    def __init__(self, rate_in: int, rate_out: int):
        self.rate_in, self.rate_out = int(rate_in), int(rate_out)
        self._stream = None
        if self.rate_in != self.rate_out:
            import soxr

            self._stream = soxr.ResampleStream(self.rate_in, self.rate_out, 1, dtype="float32", quality="HQ")

    def __call__(self, chunk: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(np.asarray(chunk, dtype=np.float32).reshape(-1))
        return x if self._stream is None else self._stream.resample_chunk(x)

    def flush(self) -> np.ndarray:
        if self._stream is None:
            return np.zeros(0, np.float32)
        return self._stream.resample_chunk(np.zeros(0, np.float32), last=True)

    def whole(self, wav: np.ndarray) -> np.ndarray:
        """All of `wav` at once (then the resampler is spent)."""
        out = self(wav)
        tail = self.flush()
        return np.concatenate([out, tail]) if tail.size else out


def encode_at(wav: np.ndarray, rate_in: int, rate_out: int, fmt: str) -> bytes:
    """`encode_audio` of `wav` (at the model's `rate_in`) at the response's `rate_out`, resampled when they differ.
    Blocking: run it off the event loop."""
    if rate_out != rate_in:
        wav = Resampler(rate_in, rate_out).whole(wav)
    return encode_audio(wav, rate_out, fmt)


def pcm_headers(sample_rate: int, fmt: str = "pcm") -> dict:
    """What raw samples are (peer clients read these): rate, channels, bits (8 for G.711), encoding."""
    return {"X-Sample-Rate": str(sample_rate), "X-Channels": "1", "X-Bit-Depth": "8" if fmt in G711_FORMATS else "16",
            "X-Encoding": {"pcm": "pcm_s16le", "ulaw": "mulaw", "alaw": "alaw"}[fmt]}


# ------------------------------------------------------------------------------------------------ upload decoding

def decode_upload(data: bytes, *, max_seconds: float, max_sample_rate: int, max_channels: int,
                  param: str = "audio") -> tuple[np.ndarray, int]:
    """Uploaded audio bytes (any format libsndfile reads) -> float32 mono samples and their sample rate.

    Checked from the header before decoding: sample rate in [8 kHz, max_sample_rate], channels <= max_channels,
    duration <= max_seconds; then at most that many frames are decoded. Blocking: run it off the event loop."""
    import soundfile as sf

    if not data:
        raise invalid(f"'{param}' is empty", param)
    try:
        info = sf.info(io.BytesIO(data))
    except Exception as e:  # noqa: BLE001 - libsndfile raises several types
        raise invalid(f"'{param}' could not be decoded (WAV, FLAC, OGG or MP3 expected): {e}", param,
                      "invalid_audio") from None
    sr, channels, frames = int(info.samplerate), int(info.channels), int(info.frames)
    if not MIN_SAMPLE_RATE <= sr <= max_sample_rate:
        raise invalid(f"'{param}' declares a sample rate of {sr} Hz; {MIN_SAMPLE_RATE}..{max_sample_rate} Hz is "
                      f"accepted", param, "invalid_audio")
    if not 1 <= channels <= max_channels:
        raise invalid(f"'{param}' has {channels} channels; at most {max_channels} are accepted", param,
                      "invalid_audio")
    limit = int(max_seconds * sr)
    if frames > limit:  # frames may be unknown (0 or huge) for some containers: the read below is capped anyway
        raise invalid(f"'{param}' is {frames / sr:.2f} s long; at most {max_seconds:g} s is accepted", param,
                      "audio_too_long")
    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            samples = f.read(frames=limit + 1, dtype="float32", always_2d=True)
    except Exception as e:  # noqa: BLE001
        raise invalid(f"'{param}' could not be decoded: {e}", param, "invalid_audio") from None
    if samples.shape[0] > limit:
        raise invalid(f"'{param}' is longer than {max_seconds:g} s", param, "audio_too_long")
    if samples.shape[0] == 0:
        raise invalid(f"'{param}' has no samples", param, "invalid_audio")
    try:  # the runtime's own bound, checked here so the error names the field (before the frontend runs)
        check_peak(samples, f"'{param}'")
    except InputError as e:
        raise invalid(str(e), param, "invalid_audio") from None
    return samples.mean(axis=1), sr


_DATA_URI = re.compile(r"data:([\w.+/-]*)(;[\w=.+-]+)*;base64,", re.ASCII)


def ref_audio_bytes(value: str, *, ref_dir: str | None, cap: int, param: str = "ref_audio") -> bytes:
    """`ref_audio` -> the audio file's bytes. Accepted: a `data:<mime>;base64,...` URI, bare base64, or (only when
    `ref_dir` is configured) `file://` URIs / absolute paths of files inside `ref_dir`. http(s) URLs are fetch.py's
    (ServerState.ref_audio_bytes sends them there); here they are refused."""
    if not isinstance(value, str) or not value:
        raise invalid(f"'{param}' must be a non-empty string", param, "invalid_type")
    if value.startswith(("http://", "https://")):
        raise invalid(f"'{param}' URLs are not fetched by this server: send the audio inline (data: URI or base64)",
                      param, "unsupported_value")
    # a path is absolute; bare base64 of MPEG audio (MP3, ADTS AAC: frame sync 0xFFF) starts with "//", no path does
    if value.startswith("file:") or (value.startswith("/") and not value.startswith("//")):
        return _local_ref_audio(value, ref_dir, cap, param)
    m = _DATA_URI.match(value)
    payload = value[m.end():] if m else value
    if value.startswith("data:") and m is None:
        raise invalid(f"'{param}' data URI must be 'data:<mime>;base64,<data>'", param, "invalid_audio")
    if len(payload) > (cap * 4) // 3 + 8:
        raise APIError(413, f"'{param}' exceeds {cap} bytes", param=param, code="payload_too_large")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise invalid(f"'{param}' is not valid base64 (send a data: URI, base64, or a file:// path under the "
                      f"server's --ref-audio-dir)", param, "invalid_audio") from None
    return raw


def _local_ref_audio(value: str, ref_dir: str | None, cap: int, param: str) -> bytes:
    if ref_dir is None:
        raise invalid(f"'{param}' names a local file, but this server reads none (start it with --ref-audio-dir "
                      f"to allow files under one folder)", param, "file_not_allowed")
    if value.startswith("file:"):
        u = urlparse(value)
        if u.netloc not in ("", "localhost"):
            raise invalid(f"'{param}' file URI must be file:///absolute/path", param, "invalid_value")
        path = unquote(u.path)
    else:
        path = value
    root = os.path.realpath(ref_dir)
    real = os.path.realpath(path)
    if os.path.commonpath([root, real]) != root:
        raise invalid(f"'{param}' is outside the server's reference audio folder", param, "file_not_allowed")
    if not os.path.isfile(real):
        raise invalid(f"'{param}' file not found", param, "file_not_found")
    size = os.path.getsize(real)
    if size > cap:
        raise APIError(413, f"'{param}' is {size} bytes; at most {cap} are accepted", param=param,
                       code="payload_too_large")
    with open(real, "rb") as f:
        return f.read(cap + 1)
