"""The DiT's grouped convolutions (conv position embedding: 1024 channels, 16 groups, kernel 31, bf16) per
implementation of `runtime/models/dit_conv.py`, at the rows x frames the cached hops and finals run: µs per call
(CUDA graph replay), kernels launched per call, and the max abs difference from F.conv1d. Why: run 63's c1 profile
showed cuDNN running each conv as 16 launches of `cutlass_tensorop_bf16_s16816fprop_analytic` (one per group, ~36
µs each) plus layout conversions — ~1.2 ms of a ~3.1 ms cached-hop Euler step at one request. The input is laid out
as the DiT passes it (`--layout time_major`, the default: [B, C, T] views of [B, T, C] tensors; run 64's first
table used contiguous [B, C, T] inputs, which cuDNN ran in other kernels), and `triton` (dit_conv_triton.py, session
24) is timed beside cuDNN's forms.

    python benchmarks/dit_conv_check.py [--device cpu]      (CPU: a smoke run of the same code)
"""
from __future__ import annotations

import argparse
import sys

import torch


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", default="2:130,2:230,16:130,16:230,32:430,12:2180")
    ap.add_argument("--layout", default="time_major", choices=("time_major", "contiguous"))
    a = ap.parse_args(argv)
    from cosytrt.runtime.models import dit_conv
    from cosytrt.tools.bench.timing import kernel_table, time_cuda

    cuda = a.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    dev = torch.device(a.device)
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(1024, 64, 31, generator=g) * 0.02).to(dev, dtype)
    bias = (torch.randn(1024, generator=g) * 0.02).to(dev, dtype)
    from cosytrt.runtime.models import dit_conv_triton as tk

    impls = {"conv1d": dit_conv.conv1d, "nhwc (default)": dit_conv.conv2d_nhwc, "unfold": dit_conv.unfold_matmul,
             "triton": dit_conv.triton_conv}
    if tk.runs_on(torch.empty(0, device=dev)):  # the kernel's other tile: 128 frames per program, 8 warps
        impls["triton 128"] = lambda x, w, b, g: tk.grouped_conv1d(x, w, b, g, block_t=128, num_warps=8)
    print("| rows x input frames | " + " | ".join(f"{n} µs" for n in impls) + " | launches per call | max abs vs conv1d |")
    print("|---|" + "---|" * (len(impls) + 2))
    for shape in a.shapes.split(","):
        rows, frames = map(int, shape.split(":"))
        if a.layout == "contiguous":
            x = torch.randn(rows, 1024, frames, generator=g).to(dev, dtype)
        else:
            x = torch.randn(rows, frames, 1024, generator=g).to(dev, dtype).transpose(1, 2)
        ref = dit_conv.conv1d(x, w, bias, 16).float()
        us, launches, errs = [], [], []
        for name, fn in impls.items():
            with torch.inference_mode():
                out = fn(x, w, bias, 16)
                errs.append(f"{(out.float() - ref).abs().max().item():.2g}")
                if cuda:
                    graph = torch.cuda.CUDAGraph()
                    fn(x, w, bias, 16)
                    torch.cuda.synchronize()
                    with torch.cuda.graph(graph):
                        fn(x, w, bias, 16)
                    us.append(f"{1e3 * time_cuda(graph.replay, reps=50):.1f}")
                    launches.append(f"{kernel_table(lambda: fn(x, w, bias, 16), steps=2)['launches']:.0f}")
                else:
                    us.append("-")
                    launches.append("-")
        print(f"| {rows} x {frames} | " + " | ".join(us) + f" | {' / '.join(launches)} | {' / '.join(errs)} |",
              flush=True)


if __name__ == "__main__":
    sys.exit(main())
