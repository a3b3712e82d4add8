"""runtime/audio.py against independent numpy computations of the same formulas, and against librosa where it is
installed (the `test-full` extra; the default test install checks the mel bases against a numpy transcription of
librosa's Slaney formula instead)."""
import numpy as np
import pytest
import soundfile as sf
import torch

from cosytrt.runtime.models import audio
from cosytrt.engines.errors import InputError

try:
    import librosa
except ImportError:  # the lean test install: the numpy Slaney filterbank below stands in
    librosa = None


def numpy_slaney_mel(sr: int, n_fft: int, n_mels: int, fmin: float = 0.0, fmax: float | None = None) -> np.ndarray:
    """librosa.filters.mel(htk=False, norm="slaney") written out in numpy (float64)."""
    fmax = sr / 2 if fmax is None else fmax
    f_sp, min_log_hz, logstep = 200.0 / 3, 1000.0, np.log(6.4) / 27.0
    min_log_mel = min_log_hz / f_sp

    def hz_to_mel(f):
        f = np.asarray(f, dtype=np.float64)
        return np.where(f >= min_log_hz, min_log_mel + np.log(np.maximum(f, 1e-10) / min_log_hz) / logstep, f / f_sp)

    def mel_to_hz(m):
        return np.where(m >= min_log_mel, min_log_hz * np.exp(logstep * (m - min_log_mel)), f_sp * m)

    mel_f = mel_to_hz(np.linspace(hz_to_mel(fmin), hz_to_mel(fmax), n_mels + 2))
    fft_f = np.linspace(0, sr / 2, 1 + n_fft // 2)
    fdiff = np.diff(mel_f)
    ramps = mel_f[:, None] - fft_f[None, :]
    lower = -ramps[:-2] / fdiff[:-1, None]
    upper = ramps[2:] / fdiff[1:, None]
    weights = np.maximum(0, np.minimum(lower, upper))
    return weights * (2.0 / (mel_f[2:n_mels + 2] - mel_f[:n_mels]))[:, None]


def mel_filters(sr: int, n_fft: int, n_mels: int, fmin: float = 0.0, fmax: float | None = None) -> np.ndarray:
    if librosa is not None:
        return librosa.filters.mel(sr=sr, n_fft=n_fft, n_mels=n_mels, fmin=fmin, fmax=fmax, htk=False, norm="slaney")
    return numpy_slaney_mel(sr, n_fft, n_mels, fmin, fmax)


def speechlike(n: int, sr: int, seed: int = 0) -> np.ndarray:
    """Harmonics with a moving pitch, an envelope and a little noise (float32, peak ~0.5)."""
    rng = np.random.default_rng(seed)
    t = np.arange(n) / sr
    f0 = 140 + 30 * np.sin(2 * np.pi * 1.3 * t)
    phase = 2 * np.pi * np.cumsum(f0) / sr
    x = sum(np.sin(k * phase) / k for k in range(1, 12))
    x *= 0.5 + 0.5 * np.sin(2 * np.pi * 2.1 * t) ** 2
    x = 0.25 * x + 0.01 * rng.standard_normal(n)
    return x.astype(np.float32)


def periodic_hann(n: int) -> np.ndarray:
    return 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n) / n)


# ---------------------------------------------------------------------------------------------- mel bases

@pytest.mark.parametrize("sr,n_fft,n_mels,fmax", [(24000, 1920, 80, 12000.0), (16000, 400, 128, None),
                                                  (22050, 1024, 80, 8000.0)])
def test_mel_basis_equals_librosa(sr, n_fft, n_mels, fmax):
    if librosa is None:
        pytest.skip("librosa not installed (pip install -e '.[test-full]'); test_mel_basis_equals_numpy_slaney runs")
    ref = librosa.filters.mel(sr=sr, n_fft=n_fft, n_mels=n_mels, fmin=0.0, fmax=fmax, htk=False, norm="slaney")
    ours = audio.slaney_mel_basis(sr, n_fft, n_mels, 0.0, fmax)
    assert ours.shape == ref.shape == (n_mels, n_fft // 2 + 1)
    assert ours.dtype == np.float32
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(numpy_slaney_mel(sr, n_fft, n_mels, 0.0, fmax), ref, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("sr,n_fft,n_mels,fmax", [(24000, 1920, 80, 12000.0), (16000, 400, 128, None),
                                                  (22050, 1024, 80, 8000.0)])
def test_mel_basis_equals_numpy_slaney(sr, n_fft, n_mels, fmax):
    ref = numpy_slaney_mel(sr, n_fft, n_mels, 0.0, fmax)
    ours = audio.slaney_mel_basis(sr, n_fft, n_mels, 0.0, fmax)
    assert ours.shape == ref.shape == (n_mels, n_fft // 2 + 1)
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-8)


# ---------------------------------------------------------------------------------------------- prompt mel

def numpy_prompt_mel(x: np.ndarray) -> np.ndarray:
    x = np.pad(x.astype(np.float64), (720, 720), mode="reflect")
    n_frames = 1 + (len(x) - 1920) // 480
    frames = np.stack([x[i * 480: i * 480 + 1920] for i in range(n_frames)])
    spec = np.fft.rfft(frames * periodic_hann(1920), axis=-1)
    mag = np.sqrt(spec.real ** 2 + spec.imag ** 2 + 1e-9)
    basis = mel_filters(24000, 1920, 80, 0, 12000)
    return np.log(np.maximum(mag @ basis.T.astype(np.float64), 1e-5))


def test_prompt_mel_matches_numpy():
    x = speechlike(24000 * 2 + 480 * 3, 24000)
    ours = audio.prompt_mel(x)
    ref = numpy_prompt_mel(x)
    assert ours.dtype == torch.float32
    assert tuple(ours.shape) == ref.shape == (x.size // 480, 80)
    assert np.abs(ours.numpy() - ref).max() <= 1e-4


def test_prompt_mel_clamps_silence():
    mel = audio.prompt_mel(np.zeros(24000, dtype=np.float32))
    # sqrt(1e-9) magnitude floor goes through the mel basis, then the 1e-5 clamp
    assert tuple(mel.shape) == (50, 80)
    assert torch.all(mel <= np.log(1e-4)) and torch.all(mel >= np.log(1e-5) - 1e-6)


@pytest.mark.parametrize("n", [960, 24000, 24000 * 3 + 480 * 7, 12345])
def test_prompt_mel_frame_count(n):
    assert audio.prompt_mel(np.zeros(n, np.float32) + 0.01).shape[0] == n // 480


# ---------------------------------------------------------------------------------------------- whisper log-mel

def numpy_whisper_log_mel(x: np.ndarray, n_mels: int = 128) -> np.ndarray:
    x = np.pad(x.astype(np.float64), (200, 200), mode="reflect")
    n_frames = 1 + (len(x) - 400) // 160
    frames = np.stack([x[i * 160: i * 160 + 400] for i in range(n_frames)])
    power = np.abs(np.fft.rfft(frames * periodic_hann(400), axis=-1)) ** 2
    power = power[:-1]  # whisper drops the last frame
    basis = mel_filters(16000, 400, n_mels).astype(np.float64)
    log_spec = np.log10(np.maximum(basis @ power.T, 1e-10))
    log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
    return (log_spec + 4.0) / 4.0


def test_whisper_log_mel_matches_numpy():
    x = speechlike(16000 * 3 + 77, 16000, seed=1)
    ours = audio.whisper_log_mel(x)
    ref = numpy_whisper_log_mel(x)
    assert tuple(ours.shape) == ref.shape == (128, x.size // 160)
    assert np.abs(ours.numpy() - ref).max() <= 1e-4


def test_whisper_log_mel_dynamic_range_floor():
    x = speechlike(16000, 16000, seed=2)
    x[4000:8000] = 0.0  # digital silence is floored at max - 8 (log10 units), i.e. (max - 8 + 4) / 4
    mel = audio.whisper_log_mel(x)
    assert torch.isclose(mel.min(), mel.max() - 2.0, atol=1e-6)


def test_whisper_log_mel_matches_s3tokenizer():
    s3 = pytest.importorskip(
        "s3tokenizer", reason="s3tokenizer not installed: its wheel requires torchaudio (and pre-commit), which would "
                              "replace the pinned torch, so it is not a clean install here")
    x = speechlike(16000 * 2, 16000, seed=3)
    ref = s3.log_mel_spectrogram(torch.from_numpy(x), n_mels=128)
    assert np.abs(audio.whisper_log_mel(x).numpy() - ref.numpy()).max() <= 1e-5


# ---------------------------------------------------------------------------------------------- kaldi fbank

def numpy_kaldi_fbank(x: np.ndarray) -> np.ndarray:
    """Kaldi compute-fbank-feats defaults (torchaudio.compliance.kaldi.fbank), dither 0, 80 bins, 16 kHz."""
    x = x.astype(np.float64)
    n_frames = 1 + (len(x) - 400) // 160
    frames = np.stack([x[i * 160: i * 160 + 400] for i in range(n_frames)])
    frames = frames - frames.mean(axis=1, keepdims=True)
    frames = np.concatenate([frames[:, :1] * (1 - 0.97), frames[:, 1:] - 0.97 * frames[:, :-1]], axis=1)
    povey = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(400) / 399)) ** 0.85
    power = np.abs(np.fft.rfft(frames * povey, n=512, axis=-1)) ** 2

    def mel(f):
        return 1127.0 * np.log(1.0 + f / 700.0)
    lo, hi = mel(20.0), mel(8000.0)
    delta = (hi - lo) / 81
    bin_mel = mel(np.arange(256) * 16000 / 512)
    banks = np.zeros((80, 257))
    for b in range(80):
        left, centre, right = lo + b * delta, lo + (b + 1) * delta, lo + (b + 2) * delta
        up = (bin_mel - left) / (centre - left)
        down = (right - bin_mel) / (right - centre)
        w = np.where(bin_mel <= centre, up, down)
        banks[b, :256] = np.where((bin_mel > left) & (bin_mel < right), w, 0.0)
    feats = np.log(np.maximum(power @ banks.T, np.finfo(np.float32).eps))
    return feats - feats.mean(axis=0, keepdims=True)


def test_kaldi_fbank_matches_numpy():
    x = speechlike(16000 * 2 + 123, 16000, seed=4)
    ours = audio.kaldi_fbank(x)
    ref = numpy_kaldi_fbank(x)
    assert tuple(ours.shape) == ref.shape == (1 + (x.size - 400) // 160, 80)
    assert ours.dtype == torch.float32
    assert np.abs(ours.numpy() - ref).max() <= 5e-4
    assert torch.abs(ours.mean(dim=0)).max() <= 1e-4  # mean-subtracted over time


def test_kaldi_fbank_is_deterministic_no_dither():
    x = speechlike(16000, 16000, seed=5)
    assert torch.equal(audio.kaldi_fbank(x), audio.kaldi_fbank(x))


# ---------------------------------------------------------------------------------------------- loading

def test_resample_48k_file_lengths_and_content(tmp_path):
    n = 48000 * 2
    t = np.arange(n) / 48000
    x = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    path = tmp_path / "tone48k.wav"
    sf.write(path, x, 48000, subtype="FLOAT")
    for sr in (24000, 16000):
        y = audio.load_wav(str(path), sr)
        assert y.dtype == np.float32 and y.ndim == 1
        assert y.shape[0] == n * sr // 48000
        ty = np.arange(y.shape[0]) / sr
        expected = 0.5 * np.sin(2 * np.pi * 440 * ty)
        mid = slice(sr // 10, -sr // 10)  # away from the filter's edge transients
        assert np.abs(y[mid] - expected[mid]).max() < 1e-3


def test_load_wav_array_with_rate():
    x = speechlike(44100, 44100)
    y = audio.load_wav(x, 16000, sr=44100)
    assert y.shape == (16000,)
    assert np.array_equal(audio.load_wav(x, 44100), x)  # no rate given: already at target


def test_stereo_mixdown_file_and_arrays(tmp_path):
    left = speechlike(16000, 16000, seed=6)
    right = speechlike(16000, 16000, seed=7)
    path = tmp_path / "stereo.wav"
    sf.write(path, np.stack([left, right], axis=1), 16000, subtype="FLOAT")
    expected = (left + right) / 2
    np.testing.assert_allclose(audio.load_wav(str(path), 16000), expected, atol=1e-7)
    np.testing.assert_allclose(audio.load_wav(np.stack([left, right], axis=1), 16000), expected, atol=1e-7)
    np.testing.assert_allclose(audio.load_wav(torch.from_numpy(np.stack([left, right])), 16000), expected, atol=1e-7)


def test_int16_pcm_file_and_array(tmp_path):
    x = speechlike(8000, 16000)
    path = tmp_path / "pcm16.wav"
    sf.write(path, x, 16000, subtype="PCM_16")
    y = audio.load_wav(str(path), 16000)
    assert np.abs(y - x).max() <= 1.0 / 32768 + 1e-7
    pcm = np.round(x * 32767).astype(np.int16)
    assert np.abs(audio.load_wav(pcm, 16000) - x).max() <= 2.0 / 32768


def test_empty_file_error_names_file(tmp_path):
    path = tmp_path / "empty.wav"
    sf.write(path, np.zeros(0, np.float32), 16000)
    with pytest.raises(InputError, match="empty.wav"):
        audio.load_wav(str(path), 16000)


def test_unreadable_file_error_names_file(tmp_path):
    path = tmp_path / "garbage.wav"
    path.write_bytes(b"this is not audio at all" * 10)
    with pytest.raises(InputError, match="garbage.wav"):
        audio.load_wav(str(path), 16000)
    with pytest.raises(InputError, match="missing.wav"):
        audio.load_wav(str(tmp_path / "missing.wav"), 16000)


def test_bad_arrays():
    with pytest.raises(InputError, match="empty"):
        audio.load_wav(np.zeros(0, np.float32), 16000)
    with pytest.raises(InputError, match="NaN"):
        audio.load_wav(np.array([0.0, np.nan], np.float32), 16000)
    with pytest.raises(InputError, match="too short"):
        audio.prompt_mel(np.zeros(100, np.float32))
    with pytest.raises(InputError, match="too short"):
        audio.whisper_log_mel(np.zeros(100, np.float32))
    with pytest.raises(InputError, match="too short"):
        audio.kaldi_fbank(np.zeros(399, np.float32))
