"""CosyVoice3 causal HiFT vocoder: 80-bin mel (50 Hz) -> 24 kHz waveform, 480 samples per mel frame.

Re-implements upstream `CausalHiFTGenerator` + `CausalConvRNNF0Predictor` (FunAudioLLM/CosyVoice) with the same
state-dict layout and order of operations:

  mel -f0 predictor (float64)-> f0 per frame -SineGen2 (fixed noise)-> source s -STFT-> 18 ch
  mel -conv_pre-> [leaky_relu, nearest-upsample conv, (+) source_resblock(source_down(s_stft)), mean of resblocks] x3
      -> leaky_relu -> conv_post -> exp(log-mag) / sin(phase) -> iSTFT -> clamp +-0.99

Everything is causal (left-padded convs) except two look-ahead convs: f0_predictor.condnet.0 (3 frames) and conv_pre
(4 frames). `finalize=False` (a streaming prefix) uses those look-ahead frames as real right context instead of zero
padding and cuts the last 480 samples, so 8 of the T input frames are held back: the output of a prefix is then a
prefix of the output of any longer input (the property `hift_stream.HiFTStream` is built on).

Sine source notes (upstream SineGen2, causal eval path):
  * per-frame phase increment rad = (f0 * k / sr) % 1, cumulative sum over frames (float64 accumulation, rounded to
    float32, which is what upstream's CPU float32 cumsum does), then * 2 * pi, * 480, then nearest upsampling: the
    phase is constant within a frame. Phase reaches ~1e4 rad, so this exact order of float32 roundings matters.
  * upstream adds `rand_ini` to sample 0 of the sample-rate increments and then resamples them to frame rate with
    linear interpolation at positions 480 i + 239.5; sample 0 is never read, so `rand_ini` has no effect on the output.
    It is kept as a settable buffer for layout parity only.
  * the additive noise is `noise_amp * sine_waves[:, :S]`: one fixed uniform buffer shared by every batch row.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from .checkpoint import expected_shapes, load_strict, read_state_dict
from .config import HiFTConfig
from ...engines.errors import CheckpointError, InputError, RequestTooLongError

DEFAULT_NOISE_SEED = 1986


from .hift_layers import (  # noqa: F401 - re-exported
    _causal_padding, repeat_frames, CausalConv1d, CausalUpsampleConv, CausalDownsampleConv, Snake, ResBlock, F0Predictor, SourceModule, _hann, _dft_angles, ConvSTFT, ConvISTFT)


class HiFT(nn.Module):
    """Causal HiFT generator with fixed, settable noise (non-persistent buffers `rand_ini`, `sine_waves`, `uv`)."""

    def __init__(self, cfg: HiFTConfig, noise_seed: int = DEFAULT_NOISE_SEED):
        super().__init__()
        self.cfg = cfg
        self.harmonics = cfg.nb_harmonics + 1
        self.samples_per_frame = cfg.samples_per_frame
        self.stft_rate = math.prod(cfg.upsample_rates)  # STFT frames per mel frame
        self.num_kernels = len(cfg.resblock_kernel_sizes)
        n_bins = cfg.n_fft // 2 + 1
        self.n_bins = n_bins

        # Same registration order as upstream, so state_dict() lists keys in the released order.
        self.m_source = SourceModule(self.harmonics)
        self.conv_pre = weight_norm(CausalConv1d(cfg.in_channels, cfg.base_channels, cfg.conv_pre_look_right + 1,
                                                 causal_type="right"))
        self.ups = nn.ModuleList(
            weight_norm(CausalUpsampleConv(cfg.base_channels // 2 ** i, cfg.base_channels // 2 ** (i + 1), k, u))
            for i, (u, k) in enumerate(zip(cfg.upsample_rates, cfg.upsample_kernel_sizes)))
        down_rates = [1] + list(cfg.upsample_rates[::-1][:-1])
        cum_rates = [math.prod(down_rates[:i + 1]) for i in range(len(down_rates))][::-1]
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        for i, (u, k, d) in enumerate(zip(cum_rates, cfg.source_resblock_kernel_sizes,
                                          cfg.source_resblock_dilation_sizes)):
            ch = cfg.base_channels // 2 ** (i + 1)
            self.source_downs.append(CausalConv1d(2 * n_bins, ch, 1) if u == 1 else
                                     CausalDownsampleConv(2 * n_bins, ch, 2 * u, u))
            self.source_resblocks.append(ResBlock(ch, k, d))
        self.resblocks = nn.ModuleList()
        for i in range(len(self.ups)):
            ch = cfg.base_channels // 2 ** (i + 1)
            for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes):
                self.resblocks.append(ResBlock(ch, k, d))
        self.conv_post = weight_norm(CausalConv1d(ch, 2 * n_bins, 7))
        self.f0_predictor = F0Predictor(cfg.in_channels, cfg.f0_cond_channels, cfg.f0_look_right)

        self.stft = ConvSTFT(cfg.n_fft, cfg.hop_len)
        self.istft = ConvISTFT(cfg.n_fft, cfg.hop_len)
        self.register_buffer("harmonic_numbers", torch.arange(1, self.harmonics + 1, dtype=torch.float32),
                             persistent=False)
        rand_ini, sine_waves, uv = default_noise(cfg, noise_seed)
        self.register_buffer("rand_ini", rand_ini, persistent=False)
        self.register_buffer("sine_waves", sine_waves, persistent=False)
        self.register_buffer("uv", uv, persistent=False)
        self.weights_folded = False

    # ------------------------------------------------------------------ checkpoint

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every key and shape of this config's released hift.pt (weight-norm layout, also once folded)."""
        return checkpoint_shapes(self.cfg) if self.weights_folded else expected_shapes(self)

    def load_checkpoint(self, sd: str | dict[str, torch.Tensor], what: str = "hift.pt") -> "HiFT":
        """Validate and load a released-layout state dict or a path to one (optional `generator.` key prefix), then
        fold weight norm."""
        if isinstance(sd, str):
            what, sd = sd, read_state_dict(sd)
        if self.weights_folded:
            raise CheckpointError(f"{what}: this HiFT already holds folded weights; build a new HiFT to load it")
        sd = {k[len("generator."):] if k.startswith("generator.") else k: v for k, v in sd.items()}
        load_strict(self, sd, what)
        self.fold_weight_norm()
        return self

    def fold_weight_norm(self) -> None:
        """Replace every weight-norm parametrization by its plain weight (computed once, in the module's dtype)."""
        for m in self.modules():
            if parametrize.is_parametrized(m, "weight"):
                parametrize.remove_parametrizations(m, "weight", leave_parametrized=True)
        self.weights_folded = True

    # ------------------------------------------------------------------ noise

    @property
    def noise_frames(self) -> int:
        """Mel frames the fixed sine noise buffer covers."""
        return self.sine_waves.shape[1] // self.samples_per_frame

    @property
    def max_frames(self) -> int:
        """Most mel frames one request may have (the noise buffer length); same as `noise_frames`."""
        return self.noise_frames

    def set_noise(self, rand_ini: torch.Tensor | None = None, sine_waves: torch.Tensor | None = None,
                  uv: torch.Tensor | None = None) -> None:
        """Replace the fixed noise (e.g. with upstream's buffers or a golden slice; shorter buffers are fine)."""
        h = self.harmonics
        if rand_ini is not None:
            if tuple(rand_ini.shape) != (1, h):
                raise InputError(f"set_noise: rand_ini must have shape (1, {h}), got {tuple(rand_ini.shape)}")
            self.rand_ini = rand_ini.detach().to(self.rand_ini.device, torch.float32).contiguous()
        if sine_waves is not None:
            if sine_waves.ndim != 3 or sine_waves.shape[0] != 1 or sine_waves.shape[2] != h:
                raise InputError(f"set_noise: sine_waves must have shape (1, S, {h}), got {tuple(sine_waves.shape)}")
            self.sine_waves = sine_waves.detach().to(self.sine_waves.device, torch.float32).contiguous()
        if uv is not None:
            if uv.ndim != 3 or uv.shape[0] != 1 or uv.shape[2] != 1:
                raise InputError(f"set_noise: uv must have shape (1, S, 1), got {tuple(uv.shape)}")
            self.uv = uv.detach().to(self.uv.device, torch.float32).contiguous()

    def check_noise(self, frames: int, start_frame: int = 0) -> None:
        """Raise RequestTooLongError if source frames [start_frame, start_frame + frames) exceed the noise buffer."""
        need = start_frame + frames
        if need > self.noise_frames:
            raise RequestTooLongError(
                f"HiFT: the request needs {need} mel frames of fixed sine noise, the buffer holds {self.noise_frames} "
                f"({self.sine_waves.shape[1]} samples); raise HiFTConfig.max_mel_frames or shorten the request")

    def noise_slice(self, start_frame: int, frames: int) -> torch.Tensor:
        """The fixed noise for source frames [start_frame, start_frame + frames): [1, frames * 480, H]."""
        self.check_noise(frames, start_frame)
        spf = self.samples_per_frame
        return self.sine_waves[:, start_frame * spf:(start_frame + frames) * spf]

    # ------------------------------------------------------------------ receptive fields (in mel frames)

    @property
    def f0_look_right(self) -> int:
        return self.f0_predictor.look_right

    @property
    def f0_left_context(self) -> int:
        return self.f0_predictor.left_context

    @property
    def conv_pre_look_right(self) -> int:
        return self.conv_pre.causal_padding

    @property
    def held_back_frames(self) -> int:
        """Frames of a non-final input that produce no output yet (3 + 4 + 1 = 8)."""
        return self.f0_look_right + self.conv_pre_look_right + 1

    def decode_left_context(self) -> int:
        """Mel frames of left context that make `decode` of a window exact from the window's (context+1)-th frame.

        A conservative walk back through the receptive field: iSTFT, conv_post, per stage resblocks / upsampling convs
        (x path) and source_resblocks / source_downs / STFT (source path)."""
        cfg = self.cfg
        rates = [math.prod(cfg.upsample_rates[:i + 1]) for i in range(len(cfg.upsample_rates))]
        nk = self.num_kernels
        back = (cfg.n_fft / cfg.hop_len + self.conv_post.causal_padding) / self.stft_rate
        worst = back
        for i in reversed(range(len(self.ups))):
            rate = rates[i]
            back += max(self.resblocks[i * nk + j].left_context for j in range(nk)) / rate
            if i == len(self.ups) - 1:
                back += 1 / rate
            down = self.source_downs[i]
            src = back + self.source_resblocks[i].left_context / rate
            src += (down.causal_padding + down.stride[0]) / self.stft_rate + cfg.n_fft / self.samples_per_frame
            worst = max(worst, src)
            back += self.ups[i].causal_padding / rate + cfg.upsample_rates[i] / rate
        worst = max(worst, back)
        return math.ceil(worst) + 1

    # ------------------------------------------------------------------ pieces

    def predict_f0(self, mel: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """mel [B, 80, T] -> f0 [B, T'] (T' = T, or T - 3 when not finalize), computed in float64, returned float32."""
        return self.f0_predictor(mel, finalize=finalize).float()

    def frame_phase_increments(self, f0: torch.Tensor) -> torch.Tensor:
        """f0 [B, F] -> per-frame phase increments (f0 * k / sr) % 1, [B, F, H] float32."""
        fn = f0.float().unsqueeze(-1) * self.harmonic_numbers
        return (fn / self.cfg.sampling_rate) % 1

    def cumulative_phase(self, f0: torch.Tensor, start: torch.Tensor | None = None) -> torch.Tensor:
        """Running sum of the increments over frames in float64, [B, F, H]; `start` [B, H] is the sum before frame 0."""
        rad = self.frame_phase_increments(f0).double()
        if start is None:
            return torch.cumsum(rad, dim=1)
        return torch.cumsum(torch.cat([start.double().unsqueeze(1), rad], dim=1), dim=1)[:, 1:]

    def source_from_phase(self, f0: torch.Tensor, cum_phase: torch.Tensor, noise: torch.Tensor,
                          reduce_phase: bool = False) -> torch.Tensor:
        """SineGen2 + SourceModuleHnNSF merge. f0 [B, F], cum_phase [B, F, H] float64, noise [1 or B, F * 480, H]
        -> source [B, 1, F * 480]. The sine math runs in float32 whatever the module dtype.

        reduce_phase (exports only; eager keeps False): the float32 sine argument (up to ~1e5 rad) is reduced modulo
        2 pi in float64 before the sine, so the result no longer depends on how a backend's float32 sin reduces large
        arguments; same value as the plain float32 sin of an accurate implementation (to ~1e-7)."""
        cfg = self.cfg
        spf = self.samples_per_frame
        f0 = f0.float()
        phase = cum_phase.float() * 2 * math.pi
        phase = phase * spf
        if reduce_phase:
            phase = torch.remainder(phase.double(), 2 * math.pi).float()
        sine = torch.sin(phase) * cfg.nsf_alpha                      # [B, F, H], constant within a frame
        uv = (f0 > cfg.nsf_voiced_threshold).float().unsqueeze(-1)   # [B, F, 1]
        noise_amp = uv * cfg.nsf_sigma + (1 - uv) * cfg.nsf_alpha / 3
        sine = repeat_frames(sine, spf, 1)
        uv = repeat_frames(uv, spf, 1)
        noise_amp = repeat_frames(noise_amp, spf, 1)
        s = sine * uv + noise_amp * noise.float()
        lin = self.m_source.l_linear
        s = torch.tanh(F.linear(s.to(lin.weight.dtype), lin.weight, lin.bias))
        return s.transpose(1, 2)

    def sine_source(self, f0: torch.Tensor, start_frame: int = 0) -> torch.Tensor:
        """Source for f0 [B, F] whose frame 0 is absolute frame 0 (phase from 0, noise from `start_frame`)."""
        return self.source_from_phase(f0, self.cumulative_phase(f0), self.noise_slice(start_frame, f0.shape[1]))

    def decode_output_samples(self, frames: int, finalize: bool) -> int:
        """Samples `decode` returns for a window of `frames` mel frames."""
        spf = self.samples_per_frame
        return frames * spf if finalize else (frames - self.conv_pre_look_right - 1) * spf

    def decode(self, mel: torch.Tensor, source: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """mel [B, 80, T] + source [B, 1, T * 480] -> wav [B, T * 480] (finalize) or [B, (T - 5) * 480] (not: the
        last 4 frames are conv_pre look-ahead only and the last 480 samples are cut)."""
        cfg = self.cfg
        spec = self.stft(source.squeeze(1).to(mel.dtype))
        if finalize:
            x = self.conv_pre(mel)
        else:
            r = self.conv_pre.causal_padding
            x = self.conv_pre(mel[:, :, :-r], context=mel[:, :, -r:])
            spec = spec[:, :, :-(self.stft_rate * r)]
        last = len(self.ups) - 1
        for i, up in enumerate(self.ups):
            x = up(F.leaky_relu(x, cfg.lrelu_slope))
            if i == last:
                x = torch.cat([x[:, :, 1:2], x], dim=2)  # ReflectionPad1d((1, 0))
            x = x + self.source_resblocks[i](self.source_downs[i](spec))
            xs = self.resblocks[i * self.num_kernels](x)
            for j in range(1, self.num_kernels):
                xs = xs + self.resblocks[i * self.num_kernels + j](x)
            x = xs / self.num_kernels
        x = self.conv_post(F.leaky_relu(x))
        magnitude = torch.clamp(torch.exp(x[:, :self.n_bins]), max=1e2)
        phase = torch.sin(x[:, self.n_bins:])
        wav = self.istft(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        if not finalize:
            wav = wav[:, :-self.samples_per_frame]
        return torch.clamp(wav, -cfg.audio_limit, cfg.audio_limit)

    # ------------------------------------------------------------------ inference

    def check_mel(self, mel: torch.Tensor, finalize: bool, what: str = "HiFT") -> None:
        if not isinstance(mel, torch.Tensor) or mel.ndim != 3 or mel.shape[1] != self.cfg.in_channels:
            shape = tuple(mel.shape) if isinstance(mel, torch.Tensor) else type(mel).__name__
            raise InputError(f"{what}: mel must have shape (B, {self.cfg.in_channels}, T), got {shape}")
        need = 1 if finalize else self.held_back_frames
        if mel.shape[2] < need:
            raise InputError(f"{what}: mel has {mel.shape[2]} frames, finalize={finalize} needs at least {need}")

    @torch.no_grad()
    def inference(self, mel: torch.Tensor, finalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """mel [B, 80, T] -> (wav [B, S], source [B, 1, S']) with upstream `CausalHiFTGenerator.inference` semantics.

        finalize: S = S' = T * 480. Not finalize: S' = (T - 3) * 480, S = (T - 8) * 480."""
        self.check_mel(mel, finalize)
        frames = mel.shape[2] if finalize else mel.shape[2] - self.f0_look_right
        self.check_noise(frames)
        f0 = self.predict_f0(mel, finalize)
        source = self.sine_source(f0)
        wav = self.decode(mel if finalize else mel[:, :, :frames], source, finalize)
        return wav, source

    @torch.no_grad()
    def inference_batch(self, mels: list[torch.Tensor], finalize: bool = True) -> list[torch.Tensor]:
        """Vocode several mels [80, T_i] (or [1, 80, T_i]) as one right-zero-padded batch; returns wavs [S_i], each
        equal to `inference` of that mel alone.

        Rule: zero padding only changes what a padded row's *last* frame sees (the STFT's reflect padding of the source
        and the iSTFT's last frames: at most its last 480 samples; f0 and phase are unchanged because the look-ahead
        convs pad with zeros anyway). Non-final rows lose that frame to the 480-sample cut, so they are exact as
        cropped. For finalize=True, the last 480 samples of every padded row are recomputed from a window of its own
        last `decode_left_context() + 1` frames and the batch's (exact) source; rows no longer than that window are
        run alone."""
        mels = [m[0] if m.ndim == 3 and m.shape[0] == 1 else m for m in mels]
        for i, m in enumerate(mels):
            self.check_mel(m.unsqueeze(0) if m.ndim == 2 else m, finalize, what=f"HiFT batch row {i}")
        if not mels:
            return []
        lengths = [m.shape[1] for m in mels]
        width = max(lengths)
        batch = torch.stack([F.pad(m, (0, width - m.shape[1])) for m in mels])
        wav, source = self.inference(batch, finalize)
        spf = self.samples_per_frame
        keep = [(t if finalize else t - self.held_back_frames) * spf for t in lengths]
        out = [wav[i, :keep[i]] for i in range(len(mels))]
        if not finalize:
            return out
        ctx = self.decode_left_context()
        tails = [i for i, t in enumerate(lengths) if t < width and t > ctx + 1]
        for i, t in enumerate(lengths):
            if t < width and t <= ctx + 1:
                out[i] = self.inference(mels[i].unsqueeze(0), True)[0][0]
        if tails:
            win = ctx + 1
            mel_w = torch.stack([mels[i][:, lengths[i] - win:] for i in tails])
            src_w = torch.stack([source[i, :, (lengths[i] - win) * spf:lengths[i] * spf] for i in tails])
            tail = self.decode(mel_w, src_w, finalize=True)[:, -spf:]
            for row, i in enumerate(tails):
                out[i] = torch.cat([out[i][:-spf], tail[row]])
        return out


# ---------------------------------------------------------------------------------------------------------- helpers

def default_noise(cfg: HiFTConfig, seed: int = DEFAULT_NOISE_SEED) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Deterministic uniform noise buffers (rand_ini [1, H] with column 0 = 0, sine_waves [1, N, H], uv [1, N, 1]) for
    N = max_mel_frames * 480 samples. Upstream draws the same shapes from the global RNG; use `HiFT.set_noise` to
    install upstream's exact buffers. On the meta device only the shapes are made."""
    h = cfg.nb_harmonics + 1
    n = cfg.max_mel_frames * cfg.samples_per_frame
    if torch.empty(0).device.type == "meta":
        return torch.empty(1, h), torch.empty(1, n, h), torch.empty(1, n, 1)
    g = torch.Generator(device="cpu").manual_seed(seed)
    rand_ini = torch.rand(1, h, generator=g, device="cpu")
    rand_ini[:, 0] = 0
    sine_waves = torch.rand(1, n, h, generator=g, device="cpu")
    uv = torch.rand(1, n, 1, generator=g, device="cpu")
    return rand_ini, sine_waves, uv


def checkpoint_shapes(cfg: HiFTConfig) -> dict[str, tuple[int, ...]]:
    """Keys and shapes a released hift.pt must have for `cfg` (built on the meta device)."""
    with torch.device("meta"):
        model = HiFT(cfg)
    return expected_shapes(model)


def load_hift(cfg: HiFTConfig, checkpoint: str | dict[str, torch.Tensor], device: str | torch.device = "cpu",
              noise_seed: int = DEFAULT_NOISE_SEED) -> HiFT:
    """Build a HiFT, load a hift.pt (path or state dict), fold weight norm, move to `device`, eval mode."""
    model = HiFT(cfg, noise_seed=noise_seed)
    model.load_checkpoint(checkpoint, what="hift state dict")
    return model.to(device).eval()
