"""How the DiT runs its grouped convolutions (the conv position embedding: kernel 31, 16 groups, 1024 channels), and
which attention backends its SDPA calls may use.

Default (`auto`): on CUDA the convolution runs as conv2d on a channels-last [B, C, 1, T] tensor; elsewhere (CPU, and
while exporting ONNX / AOTInductor graphs) as the plain F.conv1d. Why: on the H200 (session 9, `python -m
cosytrt.tools.bench.dit_shapes`) F.conv1d in fp32 made cuDNN pick an FFT algorithm at some lengths — a streaming DiT
call at T = 200 took 107 ms against 10.2 ms as channels-last conv2d (16.5 vs 15.7 ms at T = 450); in bf16 (the
serving dtype) channels-last conv2d was 7-10 % faster at every length and bit-identical to F.conv1d. The environment
can force one for a whole process (read at import, for A/B runs on the GPU machine):

  COSYTRT_DIT_CONV = auto (default) | cudnn (F.conv1d everywhere) | nhwc (channels-last conv2d everywhere) |
                     unfold (im2col over time + one grouped batched matmul: no cuDNN) |
                     triton (one Triton kernel per call, dit_conv_triton.py: tensor-core dots per tap, the input
                     read through its strides; F.conv1d where the kernel does not run or take the shapes — opt-in
                     until measured on a GPU) |
                     benchmark (F.conv1d with torch.backends.cudnn.benchmark on for the whole process: cuDNN times
                     its algorithms per new shape, during the warm-ups before each CUDA-graph capture)
  COSYTRT_DIT_SDPA = "" (default: torch's choice) | efficient (memory-efficient kernel, then math) | no_cudnn (any
                     but cuDNN attention)

All compute the same convolution / attention (tests/test_flow.py checks each against F.conv1d and the golden flow).
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend


Conv = Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor], int], torch.Tensor]


def conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], groups: int) -> torch.Tensor:
    """The plain grouped convolution (no padding, stride 1)."""
    return F.conv1d(x, weight, bias, groups=groups)


def conv2d_nhwc(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], groups: int) -> torch.Tensor:
    """conv1d(x) as conv2d on a channels-last [B, C, 1, T] tensor."""
    x4 = x.unsqueeze(2).contiguous(memory_format=torch.channels_last)
    return F.conv2d(x4, weight.unsqueeze(2), bias, groups=groups).squeeze(2)


def unfold_matmul(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], groups: int) -> torch.Tensor:
    """conv1d(x) as im2col: windows over time, one batched matmul per group."""
    b, _, length = x.shape
    g = groups
    cout, cin_g, k = weight.shape
    t = length - k + 1
    cols = x.unfold(2, k, 1).reshape(b, g, cin_g, t, k).permute(0, 1, 3, 2, 4).reshape(b, g, t, cin_g * k)
    y = torch.matmul(cols, weight.reshape(g, cout // g, cin_g * k).transpose(1, 2))   # [B, G, T, Cout/g]
    y = y.permute(0, 1, 3, 2).reshape(b, cout, t)
    return y if bias is None else y + bias[None, :, None]


def triton_conv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], groups: int,
                time_major: bool = True) -> torch.Tensor:
    """conv1d(x) by the Triton kernel of dit_conv_triton.py where it runs and takes the shapes (output time-major,
    or contiguous with `time_major=False`), else conv1d (also while exporting: no Triton kernel in a graph)."""
    from . import dit_conv_triton as tk

    if not exporting() and tk.runs_on(x) and tk.supports(x, weight, groups):
        return tk.grouped_conv1d(x, weight, bias, groups, time_major=time_major)
    return conv1d(x, weight, bias, groups)


CONV_IMPLS: dict[str, Conv] = {"cudnn": conv1d, "benchmark": conv1d, "nhwc": conv2d_nhwc, "unfold": unfold_matmul,
                               "triton": triton_conv}
SDPA_BACKENDS = {"": None,
                 "efficient": [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
                 "no_cudnn": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]}


def _from_env(name: str, table: dict):
    value = os.environ.get(name, "")
    if value not in table:
        raise ValueError(f"{name}={value!r}: choose one of {sorted(k for k in table if k)} (or leave it unset)")
    return value


CONV = _from_env("COSYTRT_DIT_CONV", {**CONV_IMPLS, "auto": None, "": None}) or "auto"
SDPA = _from_env("COSYTRT_DIT_SDPA", SDPA_BACKENDS)
if CONV == "benchmark":
    torch.backends.cudnn.benchmark = True


# the implementations a scheduler may switch to (SchedulerConfig.dit_conv): "benchmark" is read at import only
CHOICES = ("auto",) + tuple(sorted(n for n in CONV_IMPLS if n != "benchmark"))


def use(name: str) -> Callable[[int], None]:
    """`SchedulerConfig.dit_conv`: the process's convolution becomes `name` (a COSYTRT_DIT_CONV choice other than
    "benchmark", which is read at import) until the returned callable is called (with any argument: the scheduler's
    process-switch convention), which restores the one before. Calls captured in CUDA graphs keep the implementation
    they were captured with (a scheduler's cached-hop graphs are captured after it switches; a process's
    whole-history DiT graphs before). One switching scheduler at a time (TTS.reconfigure closes the old one first):
    overlapping ones would each restore what they found."""
    if name not in CHOICES:
        raise ValueError(f"DiT conv {name!r}: choose one of {list(CHOICES)}")
    global CONV
    before, CONV = CONV, name

    def restore(_delta: int = -1) -> None:
        global CONV
        CONV = before

    return restore


def exporting() -> bool:
    """torch.export (and the ONNX dynamo exporter on it), ONNX or jit tracing in progress. Reads the flag torch.export
    sets rather than calling `torch.compiler.is_exporting()` inside a Dynamo trace, which some torch versions fold to
    True under plain torch.compile too (the device's torch 2.11 did: run 66)."""
    flag = getattr(torch.compiler, "_is_exporting_flag", None)
    if flag is None:
        flag = torch.compiler.is_exporting()
    return bool(flag) or torch.jit.is_tracing() or torch.onnx.is_in_onnx_export()


def opaque_under_compile() -> bool:
    """Inside a torch.compile trace: whether the DiT's convolution runs as the opaque op (dit.py `_conv1d`), i.e. the
    implementation `pick` names runs as it does eagerly. Never while exporting. Always for an explicit choice
    (COSYTRT_DIT_CONV / `SchedulerConfig.dit_conv` other than auto): the Triton conv's weight cache and launch are
    not traceable (run 66's compiled cached hops failed in Dynamo), and an A/B of implementations should compare
    them, not what Inductor makes of each. The default (auto): where Dynamo does not fold
    `torch.compiler.is_exporting()` to True — so on the device's torch 2.11 the default compiled DiT has traced
    `pick`'s export choice, F.conv1d, in every measured run (run 66's profile: cuDNN's `analytic` implicit-GEMM kernel,
    16 launches per conv, 1.1 of a 2.2 ms cached-hop step at one request), and keeps doing so until an A/B says
    otherwise (torch 2.13 on the CPU takes the opaque op)."""
    if exporting():
        return False
    return CONV != "auto" or not torch.compiler.is_exporting()


def opaque_conv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], groups: int) -> torch.Tensor:
    """The opaque op's body (run eagerly, also in CUDA-graph capture): `pick`'s convolution with a contiguous output,
    as the op's fake declares it (Inductor asserts the strides; the Triton kernel then writes [B, C, T] directly,
    the channels-last conv's time-major output is copied)."""
    if CONV == "triton":
        return triton_conv(x, weight, bias, groups, time_major=False)
    return pick(x)(x, weight, bias, groups).contiguous()


def pick(x: torch.Tensor) -> Conv:
    """The convolution to run on `x` under the process's COSYTRT_DIT_CONV (module attribute, read per call)."""
    if CONV != "auto":
        return CONV_IMPLS[CONV]
    exporting = torch.compiler.is_exporting() or torch.jit.is_tracing() or torch.onnx.is_in_onnx_export()
    return conv2d_nhwc if x.is_cuda and not exporting else conv1d
