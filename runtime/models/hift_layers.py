"""The building blocks of the causal HiFT vocoder (`hift.py`): causal / up- / down-sampling convolutions, Snake,
residual blocks, the f0 predictor, the sine source's linear mix, and STFT / iSTFT as convolutions."""
from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.parametrizations import weight_norm



def _causal_padding(kernel_size: int, dilation: int) -> int:
    """Upstream CausalConv1d padding formula (= (k - 1) * d for every kernel the model uses)."""
    return int((kernel_size * dilation - dilation) / 2) * 2 + (kernel_size + 1) % 2


def repeat_frames(x: torch.Tensor, rate: int, dim: int) -> torch.Tensor:
    """Nearest-neighbour upsampling by an integer rate along `dim` (x[..., i, ...] repeated `rate` times)."""
    x = x.unsqueeze(dim + 1)
    shape = list(x.shape)
    shape[dim + 1] = rate
    return x.expand(shape).flatten(dim, dim + 1)


# ----------------------------------------------------------------------------------------------------------- layers

class CausalConv1d(nn.Conv1d):
    """Stride-1 conv with one-sided zero padding: 'left' is causal, 'right' looks ahead.

    `context` replaces the zero padding with real frames (the right context of a non-final chunk)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int = 1,
                 causal_type: str = "left"):
        super().__init__(in_channels, out_channels, kernel_size, dilation=dilation)
        self.causal_padding = _causal_padding(kernel_size, dilation)
        self.causal_type = causal_type

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        if context is None:
            pad = (self.causal_padding, 0) if self.causal_type == "left" else (0, self.causal_padding)
            x = F.pad(x, pad)
        elif self.causal_type == "left":
            x = torch.cat([context, x], dim=2)
        else:
            x = torch.cat([x, context], dim=2)
        return super().forward(x)


class CausalUpsampleConv(nn.Conv1d):
    """Nearest upsampling by `rate`, then a left-padded conv (upstream CausalConv1dUpsample)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, rate: int):
        super().__init__(in_channels, out_channels, kernel_size)
        self.rate = rate
        self.causal_padding = kernel_size - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.pad(repeat_frames(x, self.rate, 2), (self.causal_padding, 0)))


class CausalDownsampleConv(nn.Conv1d):
    """Strided conv left-padded with stride - 1 zeros (upstream CausalConv1dDownSample)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int):
        super().__init__(in_channels, out_channels, kernel_size, stride=stride)
        self.causal_padding = stride - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.pad(x, (self.causal_padding, 0)))


class Snake(nn.Module):
    """x + 1/(alpha + 1e-9) * sin(alpha x)^2, one alpha per channel (linear scale)."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.alpha.unsqueeze(0).unsqueeze(-1)
        return x + (1.0 / (alpha + 1e-9)) * torch.sin(x * alpha).pow(2)


class ResBlock(nn.Module):
    """Causal Snake residual block: per dilation, x += conv2(snake(conv1_d(snake(x))))."""

    def __init__(self, channels: int, kernel_size: int, dilations: Iterable[int]):
        super().__init__()
        dilations = tuple(dilations)
        self.convs1 = nn.ModuleList(weight_norm(CausalConv1d(channels, channels, kernel_size, d)) for d in dilations)
        self.convs2 = nn.ModuleList(weight_norm(CausalConv1d(channels, channels, kernel_size, 1)) for _ in dilations)
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    @property
    def left_context(self) -> int:
        return sum(c.causal_padding for c in self.convs1) + sum(c.causal_padding for c in self.convs2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for act1, conv1, act2, conv2 in zip(self.activations1, self.convs1, self.activations2, self.convs2):
            x = conv2(act2(conv1(act1(x)))) + x
        return x


class F0Predictor(nn.Module):
    """CausalConvRNNF0Predictor: look-ahead conv + 4 causal convs (ELU each) -> linear -> |f0| in Hz.

    Its parameters stay float64 (upstream runs it in float64: the sine phase integrates f0): `.to(dtype)` on a parent
    moves them between devices but keeps them float64."""

    dtype = torch.float64

    def __init__(self, in_channels: int, cond_channels: int, look_right: int, num_causal: int = 4):
        super().__init__()
        layers: list[nn.Module] = [weight_norm(CausalConv1d(in_channels, cond_channels, look_right + 1,
                                                            causal_type="right")), nn.ELU()]
        for _ in range(num_causal):
            layers += [weight_norm(CausalConv1d(cond_channels, cond_channels, 3)), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cond_channels, 1)
        self.double()

    def _apply(self, fn, recurse=True):
        def keep_float64(t):
            out = fn(t)
            if out.is_floating_point() and out.dtype != self.dtype:
                out = t.to(device=out.device, dtype=self.dtype)
            return out
        return super()._apply(keep_float64, recurse)

    @property
    def look_right(self) -> int:
        return self.condnet[0].causal_padding

    @property
    def left_context(self) -> int:
        return sum(m.causal_padding for m in self.condnet[2::2])

    def forward(self, mel: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """mel [B, 80, T] -> f0 [B, T] (finalize) or [B, T - look_right] (not), float64."""
        x = mel.to(self.dtype)
        first = self.condnet[0]
        if finalize:
            x = first(x)
        else:
            r = first.causal_padding
            x = first(x[:, :, :-r], context=x[:, :, -r:])
        for layer in self.condnet[1:]:
            x = layer(x)
        return self.classifier(x.transpose(1, 2)).squeeze(-1).abs()


class SourceModule(nn.Module):
    """Holds `l_linear` (harmonics -> 1), the merge of SourceModuleHnNSF; the sine math lives in HiFT."""

    def __init__(self, harmonics: int):
        super().__init__()
        self.l_linear = nn.Linear(harmonics, 1)


# ----------------------------------------------------------------------------------------------------- STFT as convs

def _hann(n_fft: int) -> torch.Tensor:
    """Periodic Hann (scipy get_window('hann', n, fftbins=True)), float64."""
    return torch.hann_window(n_fft, periodic=True, dtype=torch.float64)


def _dft_angles(n_fft: int) -> torch.Tensor:
    """2 pi k n / n_fft for the onesided bins k and samples n: [n_fft // 2 + 1, n_fft], float64."""
    n = torch.arange(n_fft, dtype=torch.float64)
    k = torch.arange(n_fft // 2 + 1, dtype=torch.float64)
    return 2 * math.pi * k[:, None] * n[None, :] / n_fft


class ConvSTFT(nn.Module):
    """torch.stft(center=True, reflect, Hann, onesided) as a strided Conv1d over a windowed DFT basis.

    x [B, S] -> [B, 2 * (n_fft // 2 + 1), S // hop + 1]: real parts, then imaginary parts."""

    def __init__(self, n_fft: int, hop: int):
        super().__init__()
        self.n_fft, self.hop = n_fft, hop
        angle = _dft_angles(n_fft)
        w = _hann(n_fft)
        basis = torch.cat([torch.cos(angle) * w, -torch.sin(angle) * w], dim=0)
        self.register_buffer("basis", basis.unsqueeze(1).float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pad = self.n_fft // 2
        x = F.pad(x.unsqueeze(1), (pad, pad), mode="reflect")
        return F.conv1d(x, self.basis.to(x.dtype), stride=self.hop)


class ConvISTFT(nn.Module):
    """torch.istft(center=True, Hann) as a ConvTranspose1d over the inverse onesided DFT basis (times the window),
    divided by the overlap-added squared window. real/imag [B, n_fft // 2 + 1, F] -> [B, (F - 1) * hop]."""

    def __init__(self, n_fft: int, hop: int):
        super().__init__()
        self.n_fft, self.hop = n_fft, hop
        angle = _dft_angles(n_fft)
        scale = torch.full((n_fft // 2 + 1, 1), 2.0 / n_fft, dtype=torch.float64)
        scale[0] = 1.0 / n_fft
        if n_fft % 2 == 0:
            scale[-1] = 1.0 / n_fft
        w = _hann(n_fft)
        basis = torch.cat([scale * torch.cos(angle) * w, -scale * torch.sin(angle) * w], dim=0)
        self.register_buffer("basis", basis.unsqueeze(1).float(), persistent=False)
        self.register_buffer("window_sq", (w * w).view(1, 1, n_fft).float(), persistent=False)

    def forward(self, real: torch.Tensor, imag: torch.Tensor) -> torch.Tensor:
        spec = torch.cat([real, imag], dim=1)
        frames = F.conv_transpose1d(spec, self.basis.to(spec.dtype), stride=self.hop)
        ones = torch.ones_like(spec[:1, :1, :])
        envelope = F.conv_transpose1d(ones, self.window_sq.to(spec.dtype), stride=self.hop)
        pad = self.n_fft // 2
        end = frames.shape[2] - pad
        return (frames[:, 0, pad:end] / envelope[:, 0, pad:end])


# ---------------------------------------------------------------------------------------------------------- the model
