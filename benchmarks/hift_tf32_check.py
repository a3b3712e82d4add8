"""The HiFT's fp32 convolutions with and without cuDNN's TF32 (`COSYTRT_HIFT_TF32`, runtime/stages/pipeline.py), on a
GPU: the full-size vocoder (the bench's seeded random weights), offline calls of 100 / 400 / 2000 mel frames and a
streaming window of 200: the wav's max abs difference TF32 vs fp32 against the golden wav tolerance (2e-3), and the
ms per call of each (CUDA events, after warm-up). Why: in run 63's 12 req/s kernel profiles the vocoder's fp32
convolutions ran on CUDA cores (ffma implicit-GEMM kernels) for 10-16 % of the device's wall time.
  usage (device, repo root, after device_setup.sh --install): python3 benchmarks/hift_tf32_check.py > $OUT/hift_tf32.md"""
import sys

import torch

from cosytrt.tools.build_cmd import random_full_models

WAV_TOL = 2e-3  # tools/golden.py: hift.final.wav / hift.chunk.wav


def timed_ms(fn, iters: int = 10) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters


def main() -> int:
    hift = random_full_models("cuda").hift.eval()
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"# HiFT fp32 convolutions, TF32 off / on, {torch.cuda.get_device_name()} (torch {torch.__version__})\n")
    print("| call | mel frames | max abs wav diff (TF32 - fp32) | within 2e-3 | fp32 ms | TF32 ms | TF32 / fp32 |")
    print("|---|---|---|---|---|---|---|")
    ok = True
    for finalize, frames in ((True, 100), (True, 400), (True, 2000), (False, 200)):
        mel = torch.randn(1, 80, frames, generator=g, device="cuda") * 2 - 5
        out, ms = {}, {}
        for tf32 in (False, True):
            torch.backends.cudnn.allow_tf32 = tf32
            with torch.inference_mode():
                out[tf32] = hift.inference(mel, finalize=finalize)[0].float()
                ms[tf32] = timed_ms(lambda: hift.inference(mel, finalize=finalize))
        diff = (out[True] - out[False]).abs().max().item()
        ok &= diff <= WAV_TOL
        kind = "offline" if finalize else "stream window"
        print(f"| {kind} | {frames} | {diff:.2e} | {diff <= WAV_TOL} | {ms[False]:.2f} | {ms[True]:.2f} "
              f"| {ms[True] / ms[False]:.2f} |")
    torch.backends.cudnn.allow_tf32 = False
    print(f"\nTF32 within the golden wav tolerance everywhere: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
