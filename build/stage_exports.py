"""One export description per stage: I/O names, shape templates, and how to write it as ONNX or AOTInductor."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch

from .aoti_build import compile_aoti, export_program


@dataclass
class StageExport:
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    input_shapes: dict[str, list]  # shape templates in B (batch) and T (length); see engines/shapes.py
    to_onnx: Callable[[str], str]
    module: torch.nn.Module  # the fixed-mode module that takes the inputs positionally
    example: Callable[[int, int], tuple]  # (batch, length) -> example inputs on the build device
    dynamic_shapes: Callable[[int, int, int], dict]  # (max_batch, min_len, max_len) -> torch.export dynamic shapes

    def _example(self, min_len: int, max_len: int) -> tuple:
        t = max(2, min(max_len, max(min_len, 64)))
        return self.example(2, t)

    def to_aoti(self, path: str, max_batch: int, min_len: int, max_len: int, program=None) -> dict:
        """Compile to an AOTInductor package (`program`: this export's ExportedProgram from `check_export`)."""
        return compile_aoti(self.module, self._example(min_len, max_len),
                            self.dynamic_shapes(max_batch, min_len, max_len), path, program=program)

    def check_export(self, max_batch: int, min_len: int, max_len: int):
        """torch.export over the ranges only (what `to_aoti` compiles; no compilation): the ExportedProgram, or
        EngineSetError on a constraint violation."""
        return export_program(self.module, self._example(min_len, max_len),
                              self.dynamic_shapes(max_batch, min_len, max_len))


def dit_export(dit, streaming: bool, dtype: torch.dtype, device: str) -> StageExport:
    from ..runtime.models.dit import FixedModeDiT
    from .export_dit import INPUT_NAMES, OUTPUT_NAME, example_inputs, export_dit_onnx

    dev = torch.device(device)
    base = dit if next(dit.parameters()).dtype == dtype else copy.deepcopy(dit).to(dtype)
    module = FixedModeDiT(base.to(dev), streaming).eval()
    c = dit.cfg
    shapes = {"x": ["B", c.mel_dim, "T"], "mask": ["B", 1, "T"], "mu": ["B", c.mu_dim, "T"], "t": ["B"],
              "spks": ["B", c.spk_dim], "cond": ["B", c.mel_dim, "T"]}

    def dyn(max_batch, min_len, max_len):
        B = torch.export.Dim("batch", min=1, max=max(2, max_batch))
        lo = max(1, min_len)
        T = torch.export.Dim("seq_len", min=lo, max=max(lo + 1, max_len))  # a Dim needs min < max
        bt = {0: B, 2: T}
        return {"x": bt, "mask": bt, "mu": bt, "t": {0: B}, "spks": {0: B}, "cond": bt}

    return StageExport(
        input_names=INPUT_NAMES, output_names=(OUTPUT_NAME,), input_shapes=shapes,
        to_onnx=lambda path: export_dit_onnx(base, path, streaming, dtype=dtype),
        module=module, example=lambda b, t: example_inputs(base, b, t, dtype=dtype, device=dev),
        dynamic_shapes=dyn)


def hift_export(hift, mode: str, device: str, reduce_phase: bool = False, stft_matmul: bool = False) -> StageExport:
    """HiFT as one graph: mel [B, 80, T] + the fixed sine-noise slice [1, T*480, 9] -> wav [B, T*480] (offline,
    finalize) or the chunk variant (stream: look-ahead held back). float32 (f0 predictor float64 inside).
    reduce_phase, stft_matmul: see `HiFTOnnxGraph` (the profile's hift `options: {reduce_phase: true, ...}`)."""
    from .export_hift import INPUT_NAMES, OUTPUT_NAME, HiFTOnnxGraph, export_hift_onnx

    dev = torch.device(device)
    finalize = mode == "offline"
    graph = HiFTOnnxGraph(hift, finalize, reduce_phase, stft_matmul).to(dev).eval()
    spf = hift.samples_per_frame
    shapes = {"mel": ["B", hift.cfg.in_channels, "T"], "sine_noise": [1, f"T*{spf}", hift.cfg.nb_harmonics + 1]}

    def example(b, t):
        t = max(t, hift.held_back_frames + 2)
        mel = torch.randn(b, hift.cfg.in_channels, t, device=dev) - 4.0
        return mel, hift.sine_waves[:, :t * spf].to(dev).clone()

    def dyn(max_batch, min_len, max_len):
        lo = max(min_len, hift.held_back_frames + 1)
        B = torch.export.Dim("batch", min=1, max=max(2, max_batch))
        T = torch.export.Dim("frames", min=lo, max=max(lo + 1, max_len))
        # the sine-noise slice is T * samples_per_frame long: a derived dim (torch < 2.9 refuses an independent one
        # the graph relates to T: "noise_samples = 480*frames")
        return {"mel": {0: B, 2: T}, "sine_noise": {1: T * spf}}

    return StageExport(input_names=INPUT_NAMES, output_names=(OUTPUT_NAME,), input_shapes=shapes,
                       to_onnx=lambda path: export_hift_onnx(hift, path, finalize, reduce_phase=reduce_phase,
                                                             stft_matmul=stft_matmul),
                       module=graph, example=example, dynamic_shapes=dyn)
