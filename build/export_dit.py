"""Export the flow estimator (DiT) to ONNX: one graph per attention mode, dynamic batch and frames.

Inputs `x, mask, mu, t, spks, cond`, output `estimator_out` (the upstream estimator signature). Unlike upstream's
export (batch fixed at 2, always full attention), batch (dim 0 of every input) and T (dim 2 of x/mask/mu/cond) are
both dynamic, and the streaming graph has the block-causal chunk mask built in (from `mask`, with tensor ops).

Exporter: the dynamo exporter (`torch.onnx.export(..., dynamo=True)`); it keeps B and T symbolic and lowers SDPA with
a boolean mask correctly. The TorchScript exporter (dynamo=False) fails on this module.

Precision: `dtype=torch.float16/bfloat16` exports a copy of the module cast to that dtype, so every input and the
output take that dtype too (as upstream's TRT path forces I/O to HALF). RoPE frequencies stay float32 inside, and
so does Mish (the conv position embedding's): TensorRT's ONNX parser takes Mish in FLOAT32 or FLOAT16 only ("Only
FLOAT32 or FLOAT16 input is supported for the Mish operator", seen with TensorRT-RTX 1.7 on the bf16 export), so a
reduced-precision export computes it as Cast -> Mish(float32) -> Cast.
"""
from __future__ import annotations

import copy
import os
from typing import Optional

import torch

from cosytrt.runtime.models.dit import DiT, FixedModeDiT
from cosytrt.engines.errors import InputError
from ..engines.signatures import DIT_INPUTS, DIT_OUTPUT

INPUT_NAMES, OUTPUT_NAME = DIT_INPUTS, DIT_OUTPUT


class Float32Mish(torch.nn.Module):
    """Mish computed in float32 and cast back (TensorRT parses Mish only in float32/float16)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mish(x.float()).to(x.dtype)


def float32_mish(module: torch.nn.Module) -> torch.nn.Module:
    """Replace every nn.Mish of `module` (in place) by Float32Mish; returns `module`."""
    for name, child in list(module.named_children()):
        if isinstance(child, torch.nn.Mish):
            setattr(module, name, Float32Mish())
        else:
            float32_mish(child)
    return module


def example_inputs(dit: DiT, batch: int, frames: int, dtype: torch.dtype = torch.float32,
                   device: Optional[torch.device] = None, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random (x, mask, mu, t, spks, cond) of the estimator's shapes; the mask is all ones."""
    cfg = dit.cfg
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, cfg.mel_dim, frames, generator=g)
    mask = torch.ones(batch, 1, frames)
    mu = torch.randn(batch, cfg.mu_dim, frames, generator=g)
    t = torch.rand(batch, generator=g)
    spks = torch.randn(batch, cfg.spk_dim, generator=g)
    cond = torch.randn(batch, cfg.mel_dim, frames, generator=g)
    return tuple(a.to(device=device, dtype=dtype) for a in (x, mask, mu, t, spks, cond))


def export_dit_onnx(dit: DiT, path: str, streaming: bool, dtype: torch.dtype = torch.float32, opset: int = 18,
                    example_batch: int = 2, example_frames: int = 256, max_batch: int = 1024,
                    max_frames: int = 15000, external_data: Optional[bool] = None) -> str:
    """Export `dit` with the attention mode fixed (`streaming`) to `path`; returns `path`.

    `external_data`: store weights in `path + ".data"`; None = only when they exceed 1 GiB (protobuf limit is 2 GiB).
    """
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise InputError(f"unsupported export dtype {dtype}; use float32, float16 or bfloat16")
    if example_batch < 2 or example_frames < 2:
        raise InputError(f"example_batch and example_frames must be >= 2 (sizes 0/1 get specialised), got "
                         f"{example_batch}, {example_frames}")
    param = next(dit.parameters())
    module = dit if param.dtype == dtype else copy.deepcopy(dit).to(dtype)
    if dtype != torch.float32 and any(isinstance(m, torch.nn.Mish) for m in module.modules()):
        module = float32_mish(copy.deepcopy(module) if module is dit else module)
    module = FixedModeDiT(module, streaming).eval()
    args = example_inputs(dit, example_batch, example_frames, dtype=dtype, device=param.device)

    batch = torch.export.Dim("batch", min=1, max=max_batch)
    frames = torch.export.Dim("seq_len", min=1, max=max_frames)
    bt = {0: batch, 2: frames}
    dynamic_shapes = {"x": bt, "mask": bt, "mu": bt, "t": {0: batch}, "spks": {0: batch}, "cond": bt}
    if external_data is None:
        n_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
        external_data = n_bytes > (1 << 30)

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with torch.no_grad():
        torch.onnx.export(module, args, path, input_names=list(INPUT_NAMES), output_names=[OUTPUT_NAME],
                          dynamic_shapes=dynamic_shapes, opset_version=opset, dynamo=True, optimize=True,
                          external_data=external_data)
    return path
