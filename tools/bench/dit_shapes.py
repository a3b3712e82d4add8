"""DiT call time across lengths and convolution implementations (one GPU call; issue #18's first-hop latency).

Why: on the H200 one streaming DiT call at T = 200 frames took 92–107 ms (eager and compiled CUDA graphs, fp32, batch
2 and 8) against 13–46 ms at T = 450 (BENCHMARKS run 23), and run 18's whole-history hop at 200 frames took longer
than at 300. A stream's first hop is about that long (prompt + first chunk), so a slow shape there is TTFA. The
suspect is the conv position embedding's grouped convolutions (kernel 31, 16 groups, 1024 channels): cuDNN picks
its algorithm from the shape. This tool times the streaming (and offline) DiT call per length T, for each way of
running those convolutions, each captured in a CUDA graph, and profiles the slowest and a fast length so the kernel
that takes the time is named:

  cudnn              F.conv1d (the model's choice before session 9; now its choice on the CPU)
  cudnn_benchmark    the same with torch.backends.cudnn.benchmark (cuDNN times its algorithms per shape)
  conv2d_nhwc        the convolution as conv2d on a channels-last [B, C, 1, T] tensor (other cuDNN kernels;
                     the model's choice on CUDA since session 9)
  unfold_matmul      im2col: x.unfold over time and one grouped batched matmul (no cuDNN)
  sdpa_efficient     convolutions as today, the attention limited to the memory-efficient SDPA kernel (then math)
  sdpa_cudnn         convolutions as today, the attention limited to cuDNN's SDPA (the other suspect: torch may
                     pick cuDNN attention for some lengths, as the LM prefill once did, `llm.PREFILL_SDPA_BACKENDS`)

    python -m cosytrt.tools.bench.dit_shapes --out OUT [--lengths 100,150,...] [--batch 2] [--dtype bf16]
    python -m cosytrt.tools.bench.dit_shapes --out OUT --smoke     # CPU, tiny model, eager (checks the wiring)

`--modes cached` also times prefix-cached hops (DiT.forward_cached, one request = 2 CFG rows, NEW:PREFIX frames from
`--cached-shapes`): run 18 found their solve at ~4–5 ms per Euler step whatever the new frames, the same question.

Writes OUT/dit_shapes.json and OUT/dit_shapes.md (ms per call per T and variant, max |diff| to the eager model as it runs today, the top
kernels of the profiled lengths). Exactness of a variant is reported, not assumed: a variant that would be adopted
still has to pass the golden and cached-hop tests.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

import torch

VARIANTS = ("cudnn", "cudnn_benchmark", "conv2d_nhwc", "unfold_matmul", "sdpa_efficient", "sdpa_cudnn")
CUDA_ONLY = ("sdpa_cudnn",)  # skipped by --smoke


@contextlib.contextmanager
def conv_variant(name: str):
    """Run the DiT's `_conv1d` as `name` inside the block (module attribute swap: the model looks it up per call)."""
    from ...runtime.models import dit as dit_mod

    original, bench = dit_mod._conv1d, torch.backends.cudnn.benchmark
    from ...runtime.models import dit_conv

    impl = {"conv2d_nhwc": dit_conv.conv2d_nhwc, "unfold_matmul": dit_conv.unfold_matmul}.get(name, dit_conv.conv1d)
    if name not in VARIANTS:
        raise ValueError(f"unknown conv variant {name!r}: {VARIANTS}")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"sdpa_efficient": dit_conv.SDPA_BACKENDS["efficient"],
                "sdpa_cudnn": [SDPBackend.CUDNN_ATTENTION]}.get(name)
    try:
        dit_mod._conv1d = lambda conv, x: impl(x, conv.weight, conv.bias, conv.groups)
        torch.backends.cudnn.benchmark = name == "cudnn_benchmark"
        with sdpa_kernel(backends) if backends else contextlib.nullcontext():
            yield
    finally:
        dit_mod._conv1d, torch.backends.cudnn.benchmark = original, bench


def _cached_inputs(dit, n: int, p: int, device, dtype):
    """A prefix-cached hop of one request (2 CFG rows): n new frames after p cached frames (DiT.forward_cached's
    inputs, shaped by the cached-hop graphs' `hop_shapes`)."""
    from ...runtime.stages.flow_hop_calls import _INPUTS, hop_shapes, input_dtype

    g = torch.Generator().manual_seed(n * 10007 + p)
    shapes = hop_shapes(dit, 1, n, p)
    args = []
    for name in _INPUTS:
        if name not in shapes:
            args.append(None)
        elif name == "offsets":
            args.append(torch.full(shapes[name], p, dtype=torch.long))
        elif name in ("mask", "prefix_valid"):
            args.append(torch.ones(shapes[name], dtype=input_dtype(name, dtype)))
        else:  # k_all / v_all: the prefix's K/V (the call overwrites the new frames' rows)
            args.append(torch.rand(shapes[name], generator=g) if name == "t" else
                        torch.randn(shapes[name], generator=g) * (0.1 if name in ("k_all", "v_all") else 1.0))
    return tuple(None if a is None else a.to(device, a.dtype if a.dtype in (torch.long, torch.bool) else dtype)
                 for a in args)


def _time(fn, args, ref, cuda: bool, reps: int) -> tuple[float, float]:
    """(ms per call: a CUDA-graph replay on CUDA, an eager call on CPU; max |output - ref|)."""
    from .timing import graph_timing, max_err

    if cuda:
        ms, err, _ = graph_timing(fn, torch.device("cuda"), args, ref, reps=reps)
        return ms, err
    t = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    return (time.perf_counter() - t) * 1e3 / reps, max_err(out, ref)


def run(out_dir: str, lengths, batch: int, dtype: torch.dtype, modes, reps: int, profile_lengths, smoke: bool,
        cached_shapes=((50, 150), (50, 400), (100, 1000))) -> dict:
    from ...build.export_dit import example_inputs
    from ...runtime.models.dit import FixedModeDiT
    from .common import full_models
    from .timing import kernel_table

    device = "cpu" if smoke else "cuda"
    _, _, flow, _ = full_models(device, dtype, "tiny" if smoke else "full")
    dit = flow.estimator
    res = {"meta": {"device": torch.cuda.get_device_name(0) if not smoke else "cpu (smoke)", "torch": torch.__version__,
                    "batch": batch, "dtype": str(dtype), "commit": os.environ.get("COSYTRT_COMMIT", "unknown"),
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, "rows": [], "profiles": []}
    cases = []
    for mode in modes:
        if mode == "cached":  # a stream's prefix-cached hops: "T" = new frames + cached prefix frames
            cases += [(mode, f"{n}+{p}", lambda *a: dit.forward_cached(*a)[0], _cached_inputs(dit, n, p, device, dtype))
                      for n, p in cached_shapes]
        else:
            fn = FixedModeDiT(dit, mode == "stream")
            cases += [(mode, length, fn, example_inputs(dit, batch, length, dtype, torch.device(device), seed=length))
                      for length in lengths]
    for mode, length, fn, args in cases:
        row = {"mode": mode, "T": length}
        with torch.inference_mode():
            ref = fn(*args).float()  # eager, the model as it runs today: what each variant's output is compared to
        for name in VARIANTS:
            if smoke and name in CUDA_ONLY:
                row[name] = None
                row[f"{name}_error"] = "CUDA only"
                continue
            try:
                with conv_variant(name), torch.inference_mode():
                    ms, row[f"{name}_err"] = _time(fn, args, ref, not smoke, reps)
                row[name] = round(ms, 3)
            except Exception as e:  # noqa: BLE001 - one variant failing must not lose the others
                row[name] = None
                row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:200]
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
        if not smoke and (length in profile_lengths or mode == "cached"):
            for name in ("cudnn", "unfold_matmul"):
                with conv_variant(name):
                    top = kernel_table(lambda: fn(*args), steps=1, top=8)["top"]
                res["profiles"].append({"mode": mode, "T": length, "variant": name, "top": top})
        _save(out_dir, res)
    return res


def _save(out_dir: str, res: dict) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "dit_shapes.json"), "w") as f:
        json.dump(res, f, indent=1)
    lines = [f"## DiT call ms per length and convolution implementation ({res['meta']})", "",
             "| mode | T | " + " | ".join(VARIANTS) + " | max err vs the eager model, per variant |",
             "|---|---|" + "---|" * (len(VARIANTS) + 1)]
    for r in res["rows"]:
        errs = ", ".join(f"{r[k]:.1e}" for k in (f"{v}_err" for v in VARIANTS) if r.get(k) is not None)
        lines.append(f"| {r['mode']} | {r['T']} | " + " | ".join("fail" if r.get(v) is None else f"{r[v]:.2f}"
                                                                 for v in VARIANTS) + f" | {errs} |")
    for p in res["profiles"]:
        lines += ["", f"{p['mode']} T={p['T']} {p['variant']}: " + "; ".join(f"{k['name'][:90]} x{k['calls']:g} {k['us'] / 1e3:.3f} ms"
                                                                            for k in p["top"])]
    with open(os.path.join(out_dir, "dit_shapes.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cosytrt.tools.bench.dit_shapes", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--lengths", default="100,150,200,230,250,300,350,400,450,500")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--modes", default="stream,offline,cached", help="stream, offline (whole calls of T frames), "
                    "cached (prefix-cached hops of --cached-shapes)")
    ap.add_argument("--cached-shapes", default="50:150,50:400,100:1000,200:1000",
                    help="NEW:PREFIX frames of the cached hops timed (one request = 2 CFG rows)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--profile-lengths", default="200,450")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, eager: checks the wiring only")
    a = ap.parse_args(argv)
    lengths = [int(x) for x in a.lengths.split(",") if x]
    dtype = torch.bfloat16 if a.dtype == "bf16" and not a.smoke else torch.float32
    cached = [tuple(int(v) for v in x.split(":")) for x in a.cached_shapes.split(",") if x]
    run(a.out, lengths, a.batch, dtype, [m for m in a.modes.split(",") if m], a.reps,
        {int(x) for x in a.profile_lengths.split(",") if x}, a.smoke, cached)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
