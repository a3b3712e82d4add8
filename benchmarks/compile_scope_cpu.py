"""Compile time of the full-size DiT, whole-graph vs regional compilation (`stages.compiled.set_compile_scope`), on
whatever device runs it (CPU: Inductor's C++ backend; CUDA: Triton). Each scope in a fresh subprocess (no shared
in-process caches; Inductor's on-disk cache is pointed at a fresh temporary folder per run), random weights, B = 2
CFG rows, streaming mode: the first call at T = 100 frames (compile), then T = 150 (a recompile or not), then one
timed call at each length. Prints one JSON line per scope and a table.

    python benchmarks/compile_scope_cpu.py [--device cpu] [--dtype float32] [--lm] [--out FILE.json]

`--lm`: also the full-size LM (24 decoder layers): the first prefill call (2 rows x 64 positions) and the first
decode step (each a compile), a second decode step at new positions (timed: a recompile shows here).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def child(scope: str, device: str, dtype: str, lm: bool = False) -> dict:
    import torch
    import torch._dynamo.utils

    from cosytrt.runtime.models.config import FlowConfig
    from cosytrt.runtime.models.flow import Flow
    from cosytrt.runtime.stages.compiled import CompiledDiT

    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    dit = Flow(FlowConfig()).eval().estimator.to(device=device, dtype=dt)
    comp = CompiledDiT.of(dit, scope)
    out = {"scope": scope, "device": device, "dtype": dtype, "depth": dit.cfg.depth, "torch": torch.__version__}

    def inputs(T):
        g = torch.Generator().manual_seed(T)
        r = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dt)  # noqa: E731
        return r(2, 80, T), torch.ones(2, 1, T, device=device, dtype=dt), r(2, 80, T), torch.rand(2).to(device, dt), \
            r(2, 80), r(2, 80, T)

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    with torch.inference_mode():
        for T, key in ((100, "first_call_s"), (150, "second_length_s")):
            args = inputs(T)
            t0 = time.perf_counter()
            y = comp.fixed(True)(*args)
            sync()
            out[key] = round(time.perf_counter() - t0, 2)
            out[f"max_err_T{T}"] = float((y.float() - dit(*args, streaming=True).float()).abs().max())
        for T in (100, 150):
            args = inputs(T)
            comp.fixed(True)(*args)
            sync()
            t0 = time.perf_counter()
            comp.fixed(True)(*args)
            sync()
            out[f"call_ms_T{T}"] = round(1e3 * (time.perf_counter() - t0), 1)
    out["graphs_compiled"] = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    if lm:
        from cosytrt.runtime.models.config import LLMConfig
        from cosytrt.runtime.models.llm import CosyVoice3LM
        from cosytrt.runtime.stages.compiled import compiled_lm

        model = CosyVoice3LM(LLMConfig()).eval().to(device=device, dtype=dt)
        model.setup_cache(4, 256, device=device, dtype=dt)
        decode, prefill = compiled_lm(model, scope)
        g = torch.Generator().manual_seed(0)
        embeds = torch.randn(2, 64, model.config.qwen.hidden_size, generator=g).to(device, dt)
        lengths, slots = torch.tensor([64, 50], device=device), torch.arange(2, device=device)
        with torch.inference_mode():
            t0 = time.perf_counter()
            prefill(embeds, lengths, slots)
            sync()
            out["lm_prefill_first_call_s"] = round(time.perf_counter() - t0, 2)
            tokens = torch.tensor([5, 7], device=device)
            t0 = time.perf_counter()
            y = decode(tokens, slots, lengths, kv_len=128)
            sync()
            out["lm_decode_first_call_s"] = round(time.perf_counter() - t0, 2)
            out["lm_decode_max_err"] = float((y.float() - model.decode(tokens, slots, lengths, kv_len=128).float())
                                             .abs().max())
            t0 = time.perf_counter()
            decode(tokens, slots, lengths + 1, kv_len=128)
            sync()
            out["lm_decode_second_call_ms"] = round(1e3 * (time.perf_counter() - t0), 1)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", default=None)
    p.add_argument("--lm", action="store_true", help="also the full-size LM's prefill and decode step")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child, a.device, a.dtype, a.lm)))
        return 0
    rows = []
    for scope in ("whole", "regional"):
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
            r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", scope, "--device", a.device,
                                "--dtype", a.dtype] + (["--lm"] if a.lm else []), capture_output=True, text=True,
                               env=env)
        if r.returncode:
            print(r.stderr[-3000:], file=sys.stderr)
            return 1
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    keys = ["scope", "first_call_s", "second_length_s", "graphs_compiled", "call_ms_T100", "call_ms_T150",
            "max_err_T100", "max_err_T150"] + (["lm_prefill_first_call_s", "lm_decode_first_call_s",
                                                "lm_decode_second_call_ms", "lm_decode_max_err"] if a.lm else [])
    print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(str(r[k]) for k in keys) + " |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
