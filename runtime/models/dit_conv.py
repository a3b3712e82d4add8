"""Ways to run the DiT's grouped convolutions (the conv position embedding: kernel 31, 16 groups, 1024 channels), and
the attention backends its SDPA calls may use — the two suspects of a streaming DiT call at T = 200 frames taking 7x
longer than at T = 450 on the H200 (BENCHMARKS run 23). `python -m cosytrt.tools.bench.dit_shapes` times them per
length; the environment picks one for a whole process (read at import, for A/B runs on the GPU machine):

  COSYTRT_DIT_CONV = cudnn (default: F.conv1d) | nhwc (conv2d on a channels-last [B, C, 1, T] tensor) |
                     unfold (im2col over time + one grouped batched matmul: no cuDNN) |
                     benchmark (F.conv1d with torch.backends.cudnn.benchmark on for the whole process: cuDNN times
                     its algorithms per new shape, during the warm-ups before each CUDA-graph capture)
  COSYTRT_DIT_SDPA = "" (default: torch's choice) | efficient (memory-efficient kernel, then math) | no_cudnn (any
                     but cuDNN attention)

All compute the same convolution / attention (tests/test_bench_scripts.py checks the convolutions against F.conv1d);
the defaults are the model's behaviour until a GPU run says otherwise.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend


def conv2d_nhwc(conv, x: torch.Tensor) -> torch.Tensor:
    """conv(x) (no padding, stride 1) as conv2d on a channels-last [B, C, 1, T] tensor."""
    x4 = x.unsqueeze(2).contiguous(memory_format=torch.channels_last)
    return F.conv2d(x4, conv.weight.unsqueeze(2), conv.bias, groups=conv.groups).squeeze(2)


def unfold_matmul(conv, x: torch.Tensor) -> torch.Tensor:
    """conv(x) (no padding, stride 1) as im2col: windows over time, one batched matmul per group."""
    b, _, length = x.shape
    g = conv.groups
    cout, cin_g, k = conv.weight.shape
    t = length - k + 1
    cols = x.unfold(2, k, 1).reshape(b, g, cin_g, t, k).permute(0, 1, 3, 2, 4).reshape(b, g, t, cin_g * k)
    y = torch.matmul(cols, conv.weight.reshape(g, cout // g, cin_g * k).transpose(1, 2))   # [B, G, T, Cout/g]
    y = y.permute(0, 1, 3, 2).reshape(b, cout, t)
    return y if conv.bias is None else y + conv.bias[None, :, None]


CONV_IMPLS = {"cudnn": None, "benchmark": None, "nhwc": conv2d_nhwc, "unfold": unfold_matmul}
SDPA_BACKENDS = {"": None,
                 "efficient": [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
                 "no_cudnn": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]}


def _from_env(name: str, table: dict):
    value = os.environ.get(name, "")
    if value not in table:
        raise ValueError(f"{name}={value!r}: choose one of {sorted(k for k in table if k)} (or leave it unset)")
    return value


CONV = _from_env("COSYTRT_DIT_CONV", {**CONV_IMPLS, "": None}) or "cudnn"
SDPA = _from_env("COSYTRT_DIT_SDPA", SDPA_BACKENDS)
if CONV == "benchmark":
    torch.backends.cudnn.benchmark = True
