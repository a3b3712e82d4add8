"""ONNX export of the CosyVoice3 causal HiFT vocoder (runtime/hift.py).

Graph: inputs `mel` [B, 80, T] float32 and `sine_noise` [1, >= F * 480, 9] float32 (the fixed noise slice from sample 0,
F = T frames when finalize, T - 3 when not; longer slices are cut inside), output `wav` [B, S] (S = T * 480, or
(T - 8) * 480 when not finalize). B and T are dynamic (with `per_row_noise=True`, `sine_noise` is [B, S, 9]).

Inside: the f0 predictor in float64 (its convs as im2col MatMuls: ONNX Runtime's CPU Conv has no float64 kernel;
MatMul / Elu / CumSum do), the SineGen2 source (phase sum in float64, then float32 as eager), STFT as a Conv1d over a
windowed DFT basis and iSTFT as a ConvTranspose1d over the inverse basis divided by the overlap-added squared window
(ONNX has no iSTFT), weight norm folded. TensorRT has no float64: TensorRT-RTX 1.7's parser accepts this graph and
computes the f0 predictor in float32 (no layer of the parsed network is DOUBLE; seen on the tiny export, numerics
unchecked since its plans cannot run here); see tests/test_export_hift.py for the float32-f0 error.

`rand_ini` is not an input: upstream adds it to a sample its frame-rate resampling never reads (see runtime/hift.py),
so it does not change the output.
"""
from __future__ import annotations

import copy
import os

import torch
import torch.nn as nn

from ..engines.errors import InputError
from ..runtime.models.hift import CausalConv1d, F0Predictor, HiFT
from ..engines.signatures import HIFT_INPUTS, HIFT_OUTPUT


INPUT_NAMES, OUTPUT_NAME = HIFT_INPUTS, HIFT_OUTPUT


class MatmulCausalConv1d(nn.Module):
    """A folded CausalConv1d computed as pad + im2col + MatMul (exports to ops ORT supports in float64)."""

    def __init__(self, conv: CausalConv1d):
        super().__init__()
        w = conv.weight.detach()
        self.kernel_size = w.shape[2]
        self.dilation = conv.dilation[0]
        self.causal_padding = conv.causal_padding
        self.causal_type = conv.causal_type
        self.register_buffer("weight", w.flatten(1).clone())             # [out, in * k], index c * k + i
        self.register_buffer("bias", conv.bias.detach().clone().unsqueeze(-1))

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        p = self.causal_padding
        if context is None:
            x = torch.nn.functional.pad(x, (p, 0) if self.causal_type == "left" else (0, p))
        elif self.causal_type == "left":
            x = torch.cat([context, x], dim=2)
        else:
            x = torch.cat([x, context], dim=2)
        span = (self.kernel_size - 1) * self.dilation
        n = x.shape[2] - span
        cols = torch.stack([x[:, :, i * self.dilation:i * self.dilation + n] for i in range(self.kernel_size)], dim=2)
        return torch.matmul(self.weight, cols.flatten(1, 2)) + self.bias


def matmul_f0_predictor(f0: F0Predictor) -> F0Predictor:
    """A copy of a folded F0Predictor whose convs are MatmulCausalConv1d (float64 kept)."""
    f0 = copy.deepcopy(f0)
    for i, m in enumerate(f0.condnet):
        if isinstance(m, CausalConv1d):
            f0.condnet[i] = MatmulCausalConv1d(m)
    return f0


def _shifted_blocks(x: torch.Tensor, n: int) -> torch.Tensor:
    """x [B, N, hop] -> [B, N - n + 1, n * hop]: row f is x[f], x[f + 1], ..., x[f + n - 1] concatenated."""
    frames = x.shape[1] - n + 1
    return torch.cat([x[:, i:i + frames] for i in range(n)], dim=2)


def _fft_sizes(mod, owner: str) -> tuple[int, int]:
    """(n_fft, hop) of a ConvSTFT / ConvISTFT, checked: the MatMul forms frame in whole hop-size blocks."""
    if mod.n_fft % mod.hop:
        raise InputError(f"{owner}: n_fft {mod.n_fft} must be a multiple of hop {mod.hop}")
    return mod.n_fft, mod.hop


class MatmulSTFT(nn.Module):
    """`ConvSTFT` as reflect pad + framing (shifted hop-size blocks) + MatMul: no strided Conv in the graph."""

    def __init__(self, stft):
        super().__init__()
        self.n_fft, self.hop = _fft_sizes(stft, "MatmulSTFT")
        self.register_buffer("basis_t", stft.basis[:, 0, :].t().contiguous())  # [n_fft, 2 bins]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pad = self.n_fft // 2
        x = torch.nn.functional.pad(x.unsqueeze(1), (pad, pad), mode="reflect")[:, 0]
        x = x[:, :x.shape[1] // self.hop * self.hop].reshape(x.shape[0], -1, self.hop)
        frames = _shifted_blocks(x, self.n_fft // self.hop)                 # [B, F, n_fft]
        return torch.matmul(frames, self.basis_t.to(x.dtype)).transpose(1, 2)


class MatmulISTFT(nn.Module):
    """`ConvISTFT` as MatMul + overlap-add of shifted hop-size blocks: no ConvTranspose in the graph."""

    def __init__(self, istft):
        super().__init__()
        self.n_fft, self.hop = _fft_sizes(istft, "MatmulISTFT")
        self.register_buffer("basis", istft.basis[:, 0, :].contiguous())       # [2 bins, n_fft]
        self.register_buffer("window_sq", istft.window_sq[0].contiguous())    # [1, n_fft]

    def _overlap_add(self, frames: torch.Tensor) -> torch.Tensor:
        """frames [B, F, n_fft] -> [B, (F - 1) * hop + n_fft] (what conv_transpose1d with stride hop sums)."""
        n = self.n_fft // self.hop
        b, f = frames.shape[0], frames.shape[1]
        blocks = frames.reshape(b, f, n, self.hop)
        out = None
        for q in range(n):
            part = torch.nn.functional.pad(blocks[:, :, q], (0, 0, q, n - 1 - q))
            out = part if out is None else out + part
        return out.reshape(b, -1)

    def forward(self, real: torch.Tensor, imag: torch.Tensor) -> torch.Tensor:
        spec = torch.cat([real, imag], dim=1).transpose(1, 2)                  # [B, F, 2 bins]
        wav = self._overlap_add(torch.matmul(spec, self.basis.to(spec.dtype)))
        ones = torch.ones_like(spec[:1, :, :1])
        envelope = self._overlap_add(torch.matmul(ones, self.window_sq.to(spec.dtype)))
        pad = self.n_fft // 2
        end = wav.shape[1] - pad
        return wav[:, pad:end] / envelope[:, pad:end]


def _with_matmul_stft(hift: HiFT) -> HiFT:
    """A shallow copy of `hift` (same parameters) whose stft / istft are the MatMul versions."""
    h = copy.copy(hift)
    h._modules = dict(hift._modules)
    h._modules["stft"] = MatmulSTFT(hift.stft)
    h._modules["istft"] = MatmulISTFT(hift.istft)
    return h


class HiFTOnnxGraph(nn.Module):
    """mel [B, 80, T] + sine_noise [1, S, 9] -> wav, the computation of `HiFT.inference(mel, finalize)[0]`.

    reduce_phase: reduce the float32 sine argument (~1e5 rad at 512 frames) modulo 2 pi in float64 before the sine
    (`HiFT.source_from_phase(reduce_phase=True)`), so the engine's sine no longer depends on the backend's large-
    argument float32 sin; on ORT CPU it matches eager as closely as without (wav ~4e-7 at t512, full size).
    stft_matmul: the STFT (strided Conv) and iSTFT (ConvTranspose) as framing / overlap-add around MatMuls, so no
    cuDNN convolution computes them (ORT's CUDA EP may run a conv shape on TF32 tensor cores when cuDNN has no
    other plan for it, whatever use_tf32 says; cuBLAS MatMul follows use_tf32)."""

    def __init__(self, hift: HiFT, finalize: bool, reduce_phase: bool = False, stft_matmul: bool = False):
        super().__init__()
        if not hift.weights_folded:
            raise InputError("export_hift_onnx: fold weight norm first (HiFT.load_checkpoint or fold_weight_norm)")
        self.hift = _with_matmul_stft(hift) if stft_matmul else hift
        self.f0_predictor = matmul_f0_predictor(hift.f0_predictor)
        self.finalize = finalize
        self.reduce_phase = reduce_phase

    def forward(self, mel: torch.Tensor, sine_noise: torch.Tensor) -> torch.Tensor:
        h = self.hift
        f0 = self.f0_predictor(mel, finalize=self.finalize).float()
        frames = f0.shape[1]
        noise = sine_noise[:, :frames * h.samples_per_frame]
        source = h.source_from_phase(f0, h.cumulative_phase(f0), noise, reduce_phase=self.reduce_phase)
        if not self.finalize:
            mel = mel[:, :, :-h.f0_look_right]
        return h.decode(mel, source, self.finalize)


def example_inputs(hift: HiFT, frames: int, batch: int = 2, extra_frames: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(mel, sine_noise) for a [batch, 80, frames] request: the noise from sample 0, `extra_frames` longer than needed."""
    g = torch.Generator().manual_seed(0)
    mel = torch.randn(batch, hift.cfg.in_channels, frames, generator=g) - 4.0
    n = min(hift.noise_frames, frames + extra_frames)
    return mel, hift.sine_waves[:, :n * hift.samples_per_frame].clone()


def export_hift_onnx(hift: HiFT, path: str, finalize: bool, opset: int = 18, example_frames: int = 64,
                     per_row_noise: bool = False, dynamo: bool = False, reduce_phase: bool = False,
                     stft_matmul: bool = False) -> str:
    """Export HiFT (folded weights) to ONNX at `path` with dynamic batch and frames; returns `path`.

    per_row_noise: `sine_noise` is [B, S, 9] (one slice per row, e.g. per-row offsets into the buffer) instead of the
    shared [1, S, 9] of upstream. dynamo: False (default) uses the TorchScript exporter, True the dynamo exporter
    (torch.export); both give the same ORT results (~1e-6 from eager), the TorchScript one exports ~5x faster
    (~5 s vs ~25 s on 2 CPU cores), which keeps the test suite short. (The DiT needs dynamo; HiFT does not.)
    reduce_phase, stft_matmul: see `HiFTOnnxGraph`."""
    if example_frames < hift.held_back_frames + 2:
        raise InputError(f"export_hift_onnx: example_frames={example_frames} too short "
                         f"(need >= {hift.held_back_frames + 2})")
    graph = HiFTOnnxGraph(hift, finalize, reduce_phase, stft_matmul).eval()
    mel, noise = example_inputs(hift, example_frames)
    device = next(hift.parameters()).device  # example inputs on the module's device (a CUDA build exports there)
    mel, noise = mel.to(device), noise.to(device)
    if per_row_noise:
        noise = noise.expand(mel.shape[0], -1, -1).contiguous()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    names = dict(input_names=list(INPUT_NAMES), output_names=[OUTPUT_NAME])
    min_frames = hift.held_back_frames + 1
    with torch.no_grad():
        if dynamo:
            batch = torch.export.Dim("batch", min=1, max=1024)
            frames = torch.export.Dim("frames", min=min_frames, max=hift.noise_frames)
            min_noise = (min_frames - (0 if finalize else hift.f0_look_right)) * hift.samples_per_frame
            samples = torch.export.Dim("noise_samples", min=min_noise)
            noise_dims = {0: batch, 1: samples} if per_row_noise else {1: samples}
            program = torch.onnx.export(graph, (mel, noise), dynamo=True, opset_version=opset, optimize=True,
                                        dynamic_shapes={"mel": {0: batch, 2: frames}, "sine_noise": noise_dims},
                                        external_data=False, **names)
            program.save(path, external_data=False)
        else:
            noise_axes = {0: "batch", 1: "noise_samples"} if per_row_noise else {1: "noise_samples"}
            torch.onnx.export(graph, (mel, noise), path, dynamo=False, opset_version=opset,
                              dynamic_axes={"mel": {0: "batch", 2: "frames"}, "sine_noise": noise_axes,
                                            "wav": {0: "batch", 1: "samples"}}, **names)
    return path
