"""Shared pieces of the `trtbuild` subcommands: argument types, quiet exporters, audio output by extension."""
from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import re
import warnings

BACKEND_CHOICES = ("auto", "tensorrt", "onnxruntime", "aoti", "compiled")
_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?)$")
# --out extension -> soundfile (format, subtype)
AUDIO_FORMATS = {".wav": ("WAV", "PCM_16"), ".flac": ("FLAC", "PCM_16"), ".mp3": ("MP3", "MPEG_LAYER_III"),
                 ".opus": ("OGG", "OPUS"), ".ogg": ("OGG", "VORBIS")}


def read_jsonl(path: str, label: str = ""):
    """(line number, "LABEL PATH:N", value) for every line of a JSONL file that is not blank or a # comment;
    InputError naming the line when one is not valid JSON."""
    import json

    from ..engines.errors import InputError

    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{label}{path!r}: cannot read it: {e}") from None
    for n, raw in enumerate(lines, 1):
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        where = f"{label}{path}:{n}"
        try:
            yield n, where, json.loads(raw)
        except ValueError as e:
            raise InputError(f"{where}: not valid JSON ({e})") from None


def device_arg(value: str) -> str:
    """argparse type: `cpu`, `cuda` or `cuda:N` (anything else is a usage error, not a torch traceback)."""
    if not _DEVICE_RE.match(value):
        raise argparse.ArgumentTypeError(f"invalid device {value!r} (choose cpu, cuda or cuda:N)")
    return value


def port_arg(value: str) -> int:
    """argparse type: a TCP port 1..65535 (a usage error, not a bind() traceback after the model has loaded)."""
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port {value!r} (an integer 1..65535)") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"invalid port {port} (an integer 1..65535)")
    return port


def check_file_out(path: str, flag: str) -> None:
    """Before any work: a file `path` can be written (its folder exists and is writable, and it is not a folder)."""
    from ..engines.errors import InputError

    if os.path.isdir(path):
        raise InputError(f"{flag} {path!r} is a folder, not a file")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise InputError(f"{flag} {path!r}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise InputError(f"{flag} {path!r}: folder {folder} is not writable")


def add_device(p, default: str | None = "cpu", help_extra: str = "") -> None:
    p.add_argument("--device", default=default, type=device_arg, metavar="{cpu,cuda,cuda:N}",
                   help=f"cpu | cuda | cuda:N{help_extra}")


def check_audio_out(path: str) -> tuple[str, str]:
    """Before any synthesis: the format for `path`'s extension (wav, flac, mp3, opus, ogg) and a writable folder."""
    from ..engines.errors import InputError

    ext = os.path.splitext(path)[1].lower()
    if ext not in AUDIO_FORMATS:
        raise InputError(f"--out {path!r}: unknown audio extension {ext or '(none)'!r} (use "
                         f"{', '.join(AUDIO_FORMATS)})")
    fmt, subtype = AUDIO_FORMATS[ext]
    import soundfile as sf

    if fmt not in sf.available_formats() or subtype not in sf.available_subtypes(fmt):
        raise InputError(f"--out {path!r}: this libsndfile cannot write {ext} ({fmt}/{subtype}); use .wav or .flac")
    check_file_out(path, "--out")
    return fmt, subtype


def write_audio(path: str, wav, sample_rate: int) -> None:
    import numpy as np
    import soundfile as sf

    fmt, subtype = check_audio_out(path)
    pcm = np.clip(np.asarray(wav, dtype=np.float32), -1.0, 1.0)
    if fmt == "OGG" and subtype == "OPUS" and sample_rate not in (8000, 12000, 16000, 24000, 48000):
        from ..engines.errors import InputError

        raise InputError(f"opus needs 8/12/16/24/48 kHz audio, not {sample_rate} Hz")
    sf.write(path, pcm, sample_rate, format=fmt, subtype=subtype)


@contextlib.contextmanager
def quiet_exporters(verbose: bool = False):
    """Keep torch.export / torch.onnx / inductor warnings and log lines out of the progress output (`--verbose`
    shows them)."""
    if verbose:
        yield
        return
    names = ("torch", "torch.export", "torch.onnx", "torch._dynamo", "torch._inductor", "torch.fx",
             "torch.fx.experimental.symbolic_shapes", "onnxscript", "onnx_ir")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for lg, lv in zip(loggers, levels):
                lg.setLevel(lv)


@contextlib.contextmanager
def captured_stdout(enabled: bool):
    """With `enabled` (e.g. --json), what library code prints goes to a buffer, not stdout (returned as a list)."""
    if not enabled:
        yield []
        return
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        yield [buf]
