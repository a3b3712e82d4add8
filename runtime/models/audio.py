"""Audio plumbing for the frontend: loading, resampling and the three feature extractors.

- `load_wav`: any soundfile-readable file (or an array), mixed down to mono, resampled with soxr.
- `prompt_mel`: the 24 kHz, 80-bin log-mel the flow is conditioned on (Matcha `mel_spectrogram`, fmax 12 kHz).
- `whisper_log_mel`: Whisper's 128-bin log-mel at 100 fps, input of `speech_tokenizer_v3.onnx`.
- `kaldi_fbank`: 80-bin Kaldi fbank (torchaudio `kaldi.fbank` defaults), mean-subtracted, input of `campplus.onnx`.
"""
from __future__ import annotations

import functools
import math
import numbers
import os
from typing import Union

import numpy as np
import torch
import torch.nn.functional as F

from ...engines.errors import InputError

AudioInput = Union[str, os.PathLike, np.ndarray, torch.Tensor]

# Prompt mel (cosyvoice3.yaml feat_extractor: matcha mel_spectrogram)
PROMPT_SR = 24000
PROMPT_N_FFT = 1920
PROMPT_HOP = 480
PROMPT_WIN = 1920
PROMPT_N_MELS = 80
PROMPT_FMIN = 0.0
PROMPT_FMAX = 12000.0

# Whisper log-mel (speech tokenizer input)
WHISPER_SR = 16000
WHISPER_N_FFT = 400
WHISPER_HOP = 160

# Kaldi fbank (speaker encoder input)
FBANK_SR = 16000
FBANK_BINS = 80


# ------------------------------------------------------------------------------------------------- loading

def _describe(src) -> str:
    return repr(os.fspath(src)) if isinstance(src, (str, os.PathLike)) else "<audio array>"


def _to_mono(x: np.ndarray, what: str) -> np.ndarray:
    if x.ndim == 1:
        return x
    if x.ndim != 2:
        raise InputError(f"audio {what}: expected 1-D or 2-D (channels) samples, got shape {tuple(x.shape)}")
    if x.size == 0:  # (a mean over an empty axis would be NaN samples)
        return x.reshape(0)
    channel_axis = int(np.argmin(x.shape))  # (frames, channels) from soundfile, (channels, frames) from torch
    return x.mean(axis=channel_axis)


def resample(wav: np.ndarray, sr: int, target_sr: int) -> np.ndarray:
    """Band-limited resampling with soxr (HQ); a no-op when the rates match."""
    if sr == target_sr:
        return wav
    import soxr
    return soxr.resample(wav, sr, target_sr, quality="HQ").astype(np.float32, copy=False)


# Float samples are full scale at 1.0; a peak past this (+18 dBFS) is not audio at that scale
MAX_PEAK = 8.0


def check_peak(wav: np.ndarray, what: str) -> None:
    """InputError unless the float samples' peak is within MAX_PEAK (NaN fails too): int16 values given as floats
    make features 32768x too loud, and near 1e16 the fbank overflows (a NaN voice). The server checks its uploads
    with it before the frontend."""
    peak = float(np.abs(wav).max()) if wav.size else 0.0
    if not peak <= MAX_PEAK:
        raise InputError(f"audio {what}: float samples must be in [-1, 1], got a peak of {peak:.4g} (integer PCM "
                         f"values as floats? divide by 32768)")


def _sample_rate(sr, what: str) -> int:
    """`sr` as a positive int (an integral float too); InputError otherwise (0, NaN, 16000.5, a string)."""
    if isinstance(sr, bool) or not isinstance(sr, numbers.Real) or not math.isfinite(sr) or sr != int(sr) \
            or int(sr) <= 0:
        raise InputError(f"audio {what}: invalid sample rate {sr!r} (a positive whole number of Hz)")
    return int(sr)


def load_wav(path_or_array: AudioInput, target_sr: int, sr: int | None = None,
             max_seconds: float | None = None) -> np.ndarray:
    """Read audio as float32 mono at `target_sr`.

    A path is read with soundfile (any common format and sample rate, multi-channel mixed down). An array
    (numpy or torch; 1-D, or 2-D with a channel axis) is taken at sample rate `sr` (default: already `target_sr`).
    Unreadable, empty or non-finite audio raises InputError naming the source; so does audio longer than
    `max_seconds` (checked before resampling).
    """
    what = _describe(path_or_array)
    if isinstance(path_or_array, (str, os.PathLike)):
        import soundfile as sf
        path = os.fspath(path_or_array)
        if not os.path.isfile(path):
            raise InputError(f"audio file not found: {path!r}")
        try:
            data, file_sr = sf.read(path, dtype="float32", always_2d=True)
        except Exception as e:  # noqa: BLE001 - libsndfile raises several types; re-raised with the file named
            raise InputError(f"cannot read audio file {path!r}: {e}") from None
        wav, src_sr = data.mean(axis=1), _sample_rate(file_sr, what)
    else:
        if isinstance(path_or_array, torch.Tensor):
            t = path_or_array.detach().cpu()
            arr = (t.float() if t.dtype in (torch.bfloat16, torch.float16) else t).numpy()  # numpy has no bfloat16
        elif isinstance(path_or_array, np.ndarray):
            arr = path_or_array
        else:
            raise InputError(f"audio must be a file path or an array, got {type(path_or_array).__name__}")
        if np.issubdtype(arr.dtype, np.integer):
            arr = arr.astype(np.float32) / float(np.iinfo(arr.dtype).max + 1)
        elif not np.issubdtype(arr.dtype, np.floating):
            raise InputError(f"audio {what}: unsupported dtype {arr.dtype}")
        wav, src_sr = _to_mono(np.asarray(arr, dtype=np.float32), what), _sample_rate(
            target_sr if sr is None else sr, what)
    if wav.size == 0:
        raise InputError(f"audio {what} is empty (no samples)")
    if max_seconds is not None and wav.size / src_sr > max_seconds:
        raise InputError(f"audio {what} is {wav.size / src_sr:.2f} s long; at most {max_seconds:.0f} s is supported")
    if not np.all(np.isfinite(wav)):
        raise InputError(f"audio {what} contains NaN or Inf samples")
    check_peak(wav, what)
    wav = np.ascontiguousarray(wav, dtype=np.float32)
    return resample(wav, src_sr, target_sr)


# ------------------------------------------------------------------------------------------------- mel bases

# Slaney's mel scale (librosa's default, htk=False): linear below 1 kHz, logarithmic above
_F_SP = 200.0 / 3
_MIN_LOG_HZ = 1000.0
_MIN_LOG_MEL = _MIN_LOG_HZ / _F_SP
_LOGSTEP = np.log(6.4) / 27.0


def _hz_to_mel_slaney(f: np.ndarray) -> np.ndarray:
    f = np.asarray(f, dtype=np.float64)
    return np.where(f >= _MIN_LOG_HZ, _MIN_LOG_MEL + np.log(np.maximum(f, 1e-10) / _MIN_LOG_HZ) / _LOGSTEP, f / _F_SP)


def _mel_to_hz_slaney(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    return np.where(m >= _MIN_LOG_MEL, _MIN_LOG_HZ * np.exp(_LOGSTEP * (m - _MIN_LOG_MEL)), _F_SP * m)


@functools.lru_cache(maxsize=None)
def slaney_mel_basis(sr: int, n_fft: int, n_mels: int, fmin: float = 0.0, fmax: float | None = None) -> np.ndarray:
    """Slaney-scale, Slaney-normalised triangular mel filters [n_mels, n_fft//2+1] (= librosa.filters.mel)."""
    fmax = sr / 2.0 if fmax is None else float(fmax)
    fft_freqs = np.linspace(0.0, sr / 2.0, n_fft // 2 + 1)
    mel_edges = np.linspace(_hz_to_mel_slaney(fmin), _hz_to_mel_slaney(fmax), n_mels + 2)
    hz_edges = _mel_to_hz_slaney(mel_edges)
    widths = np.diff(hz_edges)
    offsets = hz_edges[:, None] - fft_freqs[None, :]
    rising = -offsets[:-2] / widths[:-1, None]
    falling = offsets[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(rising, falling))
    weights *= (2.0 / (hz_edges[2:] - hz_edges[:-2]))[:, None]
    weights.setflags(write=False)
    return weights.astype(np.float32)


def _as_1d_tensor(wav, what: str, min_samples: int) -> torch.Tensor:
    x = torch.as_tensor(np.asarray(wav, dtype=np.float32) if not isinstance(wav, torch.Tensor) else wav)
    x = x.to(torch.float32).reshape(-1)
    if x.numel() < min_samples:
        raise InputError(f"{what}: audio too short ({x.numel()} samples, need at least {min_samples})")
    return x


# ------------------------------------------------------------------------------------------------- features

def prompt_mel(wav24k) -> torch.Tensor:
    """24 kHz mono samples [N] -> log-mel [N // 480, 80] (the flow's prompt features)."""
    pad = (PROMPT_N_FFT - PROMPT_HOP) // 2
    x = _as_1d_tensor(wav24k, "prompt_mel", pad + 1)
    x = F.pad(x[None, None], (pad, pad), mode="reflect")[0]
    window = torch.hann_window(PROMPT_WIN, dtype=torch.float32)
    spec = torch.stft(x, PROMPT_N_FFT, hop_length=PROMPT_HOP, win_length=PROMPT_WIN, window=window,
                      center=False, normalized=False, onesided=True, return_complex=True)
    magnitude = torch.sqrt(spec.real.square() + spec.imag.square() + 1e-9)  # [1, 961, T]
    basis = torch.from_numpy(slaney_mel_basis(PROMPT_SR, PROMPT_N_FFT, PROMPT_N_MELS, PROMPT_FMIN, PROMPT_FMAX))
    mel = basis @ magnitude
    return torch.log(torch.clamp(mel, min=1e-5))[0].transpose(0, 1).contiguous()


def whisper_log_mel(wav16k, n_mels: int = 128) -> torch.Tensor:
    """16 kHz mono samples [N] -> Whisper log-mel [n_mels, N // 160] (100 frames per second)."""
    x = _as_1d_tensor(wav16k, "whisper_log_mel", WHISPER_N_FFT // 2 + 1)
    window = torch.hann_window(WHISPER_N_FFT, dtype=torch.float32)
    spec = torch.stft(x, WHISPER_N_FFT, hop_length=WHISPER_HOP, window=window, center=True, pad_mode="reflect",
                      return_complex=True)
    power = spec[..., :-1].abs() ** 2  # [201, T]; the last frame is dropped as Whisper does
    basis = torch.from_numpy(slaney_mel_basis(WHISPER_SR, WHISPER_N_FFT, n_mels))
    log_spec = torch.clamp(basis @ power, min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return (log_spec + 4.0) / 4.0


def kaldi_fbank(wav16k) -> torch.Tensor:
    """16 kHz mono samples [N] -> 80-bin Kaldi log fbank [T, 80], mean-subtracted over time.

    25 ms frames, 10 ms shift, snip edges, no dither, DC removal, pre-emphasis 0.97, Povey window, power spectrum,
    low 20 Hz / high Nyquist: the defaults of torchaudio.compliance.kaldi.fbank that upstream calls. Samples are
    used as given (floats in [-1, 1], not rescaled to int16 range), as upstream does.
    """
    import kaldi_native_fbank as knf
    x = _as_1d_tensor(wav16k, "kaldi_fbank", 400).numpy()
    opts = knf.FbankOptions()
    opts.frame_opts.samp_freq = FBANK_SR
    opts.frame_opts.frame_length_ms = 25.0
    opts.frame_opts.frame_shift_ms = 10.0
    opts.frame_opts.dither = 0.0
    opts.frame_opts.preemph_coeff = 0.97
    opts.frame_opts.remove_dc_offset = True
    opts.frame_opts.window_type = "povey"
    opts.frame_opts.round_to_power_of_two = True
    opts.frame_opts.snip_edges = True
    opts.mel_opts.num_bins = FBANK_BINS
    opts.mel_opts.low_freq = 20.0
    opts.mel_opts.high_freq = 0.0
    opts.use_energy = False
    opts.use_log_fbank = True
    opts.use_power = True
    fbank = knf.OnlineFbank(opts)
    fbank.accept_waveform(FBANK_SR, x)
    fbank.input_finished()
    feats = np.stack([np.asarray(fbank.get_frame(i), dtype=np.float32) for i in range(fbank.num_frames_ready)])
    feats = torch.from_numpy(feats)
    return feats - feats.mean(dim=0, keepdim=True)
