"""The AR decode step alone on the GPU: how far it is from its memory-bandwidth floor, and which kernels fill it.

    python -m cosytrt.tools.bench.ar_gpu_step [--model full|tiny] [--device cuda] [--batches 1,4,16,64]
        [--positions 200,1000] [--compile] [--kernels] [--steps 50] [--json OUT.json]

Under open-loop traffic the first audio waits on ~28 AR steps (49 ms at 1 req/s, BENCHMARKS.md run 43) and the AR
worker is busy 84-94 % from 4 req/s on, yet one step of the 0.5B LM reads ~0.7 GB of weights: ~0.2 ms on an H100
(runs 8 / 11 measured 1.18-1.25 ms and 314 kernels per step at batch 1-2: kernel-bound).
For each batch and KV position this measures, with `TorchARRunner` as the scheduler builds it (decode graphs on
CUDA; `--compile`: the compiled step, as the graphs_ar / compiled variants):

  * `replay_us`: GPU time per decode call, calls queued back to back (CUDA events; no host sync between them), the
    step's floor with nothing else on the GPU;
  * `worker_us`: wall time of a whole AR worker step (inputs, decode, sampling with its host sync, bookkeeping);
  * `floor_us`: the LM's weight bytes a step reads (embedding tables excluded) over the card's nominal HBM bandwidth
    (H100 SXM 3.35 TB/s, H200 4.8 TB/s; none for other cards) — what a step must read at least;
  * with `--kernels`: kernels per decode call and the heaviest ones (torch.profiler over 10 calls,
    `kernel_profile.summarize_trace`).

On the CPU (tests, `--model tiny`) the same loop runs without graphs or events (`replay_us` = wall time per call).
A measuring tool: no test checks its numbers."""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}  # nominal HBM bytes/s of the SXM cards


def bandwidth(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((bw for key, bw in BANDWIDTH.items() if key in name), None)


def param_bytes(module: torch.nn.Module) -> int:
    """Bytes of weights a decode step reads: every parameter except embedding tables (a lookup reads one row; the
    text embedding, ~270 MB at full size, is not read at all while decoding speech tokens)."""
    skip = {id(p) for m in module.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    return sum(p.numel() * p.element_size() for p in module.parameters() if id(p) not in skip)


def build_runner(model: str, device: str, max_batch: int, max_len: int, compile: bool, dtype: torch.dtype):
    from ...runtime.stages.ar_runner import TorchARRunner
    from .common import full_models

    cfg, llm, _, _ = full_models(device, dtype, model)
    runner = TorchARRunner(llm, max_batch, max_len, device, cuda_graphs=device.startswith("cuda"), compile=compile)
    return llm, runner


def time_replays(runner, b: int, pos: int, steps: int, slots: list[int]) -> float:
    """Median µs per decode call of b rows at KV position `pos` (3 blocks of `steps` calls)."""
    dev = runner.device
    tokens, positions = [1] * b, [pos] * b
    cuda = dev.type == "cuda"
    out = []
    with torch.inference_mode():
        for _ in range(3):
            runner.decode(tokens, slots[:b], positions)
        for _ in range(3):
            if cuda:
                torch.cuda.synchronize(dev)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            for _ in range(steps):
                runner.decode(tokens, slots[:b], positions)
            if cuda:
                end.record()
                end.synchronize()
                out.append(start.elapsed_time(end) * 1e3 / steps)
            else:
                out.append((time.perf_counter() - t0) * 1e6 / steps)
    return statistics.median(out)


def time_worker(runner, b: int, pos: int, steps: int) -> float:
    """Median µs of a whole AR worker decode step with b running rows from position `pos`."""
    from .ar_step import time_steps, worker_for

    w = worker_for(runner, b, start_pos=pos, device=str(runner.device))
    try:
        return time_steps(w, steps, 3)[0]
    finally:
        for r in w.running:
            runner.release(r.slot)


def kernels_per_call(runner, b: int, pos: int, slots: list[int], calls: int = 10) -> dict | None:
    if runner.device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    from .kernel_profile import exported_trace, summarize_trace

    with torch.inference_mode():
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                runner.decode([1] * b, slots[:b], [pos] * b)
            torch.cuda.synchronize(runner.device)
    s = summarize_trace(exported_trace(prof))
    return {"kernels_per_call": s.get("kernels", 0) / calls,
            "top": [{"name": k["name"][:70], "us_per_call": round(k["ms"] * 1e3 / calls, 1),
                     "per_call": k["count"] / calls} for k in s.get("top_kernels", [])[:6]]}


def measure(model: str = "full", device: str = "cuda", batches=(1, 4, 16, 64), positions=(200, 1000),
            steps: int = 50, compile: bool = False, kernels: bool = False, dtype: torch.dtype = torch.bfloat16,
            log=print) -> dict:
    max_batch = max(batches)
    max_len = max(2048, max(positions) + steps * 20 + 64)
    t0 = time.perf_counter()
    llm, runner = build_runner(model, device, max_batch, max_len, compile, dtype)
    setup_s = time.perf_counter() - t0
    dev = runner.device
    nbytes = param_bytes(llm)
    bw = bandwidth(dev)
    log(f"AR decode step: {model} LM, {nbytes / 1e9:.2f} GB of weights read per step, {dev}"
        + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else "")
        + f", runner set up in {setup_s:.1f} s")
    slots = [runner.allocate() for _ in range(max_batch)]
    rows = []
    try:
        for pos in positions:
            for b in batches:
                row = {"batch": b, "position": pos, "replay_us": round(time_replays(runner, b, pos, steps, slots), 1),
                       "floor_us": round(nbytes / bw * 1e6, 1) if bw else None}
                if kernels:
                    row["kernels"] = kernels_per_call(runner, b, pos, slots)
                rows.append(row)
                log(f"  batch {b:3d} position {pos:5d}: decode {row['replay_us']:8.1f} us"
                    + (f" (floor {row['floor_us']} us)" if row["floor_us"] else ""))
    finally:
        for s in slots:
            runner.release(s)
    for row in rows:  # the worker needs free slots: measured after the replays
        row["worker_us"] = round(time_worker(runner, row["batch"], row["position"], max(5, steps // 2)), 1)
    runner.close()
    return {"model": model, "device": str(dev), "param_bytes": nbytes, "bandwidth": bw, "compile": compile,
            "setup_s": round(setup_s, 1), "rows": rows}


def table(res: dict) -> str:
    lines = ["| batch | KV position | GPU µs per decode call | bandwidth floor µs | whole worker step µs "
             "| kernels per call | heaviest kernels (µs per call) |", "|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        k = r.get("kernels") or {}
        top = ", ".join(f"{t['name'][:40]} ({t['us_per_call']})" for t in k.get("top", [])[:3]) or "-"
        lines.append(f"| {r['batch']} | {r['position']} | {r['replay_us']} | {r['floor_us'] or '-'} "
                     f"| {r['worker_us']} | {k.get('kernels_per_call', '-')} | {top} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="full", choices=["full", "tiny"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--positions", default="200,1000")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--compile", action="store_true", help="the compiled decode step (as the graphs_ar / compiled "
                                                          "variants; minutes cold)")
    p.add_argument("--kernels", action="store_true", help="CUDA: profile 10 calls per cell for the kernels")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--json", default=None, help="also write the results here")
    a = p.parse_args(argv)
    res = measure(a.model, a.device, tuple(int(x) for x in a.batches.split(",")),
                  tuple(int(x) for x in a.positions.split(",")), a.steps, a.compile, a.kernels,
                  getattr(torch, a.dtype))
    print(table(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
