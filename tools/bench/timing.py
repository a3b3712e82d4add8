"""GPU timing helpers of the benchmarks: CUDA-event medians, CUDA-graph replay timing, max abs error, per-kernel
profile. Used by the micro-benchmarks (`micro.py`), the AOTInductor child (`aoti.py`) and the scripts in
benchmarks/."""
from __future__ import annotations

import statistics
import time

import torch


def time_cuda(fn, reps: int = 10, warmup: int = 2) -> float:
    """Median milliseconds of fn() measured with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def kernel_table(fn, steps: int = 5, top: int = 12) -> dict:
    """GPU kernels of `steps` calls of `fn` (torch.profiler, no CUDA graph): launches and kernel time per call,
    and the `top` kernels by time."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                fn()
            torch.cuda.synchronize()
    per: dict[str, list] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = per.setdefault(e.name, [0, 0.0])
            k[0] += 1
            k[1] += e.device_time
    rows = sorted(({"name": n, "calls": c / steps, "us": t / steps} for n, (c, t) in per.items()),
                  key=lambda r: -r["us"])
    return {"kernel_us": sum(r["us"] for r in rows), "launches": sum(r["calls"] for r in rows), "top": rows[:top]}


def graph_timing(fn, device, args: tuple, ref, reps: int = 20) -> tuple[float, float, float]:
    """`fn(*args)` captured in a CUDA graph: (median ms per replay, max abs error of its output vs `ref`, seconds the
    capture took, warm-up included)."""
    from ...engines.cuda_graphs import GraphCache

    t0 = time.perf_counter()
    g = GraphCache(fn, device)
    g.capture(0, args)
    capture_s = time.perf_counter() - t0
    out = g.run(0, *args)
    err = max_err(out[0] if isinstance(out, (list, tuple)) else out, ref)
    return time_cuda(lambda: g.run(0, *args), reps=reps), err, capture_s
