"""`trtbuild bench`: GPU benchmarks on the full-size CosyVoice3 architecture (seeded random weights, fixed lengths).

Suites (each writes into --out as it finishes, so a run cut short keeps what it measured):
- `micro`: AR prefill / decode ms per step per batch (eager vs CUDA graph), DiT ms per call per (rows, frames)
  (eager vs CUDA graph), HiFT ms per call per (batch, frames) (eager vs CUDA graph), each beside its H200 roofline
  bound (bytes / 4.8 TB/s, FLOPs / 790 TFLOP/s bf16) and the achieved fraction.
- `e2e`: single requests end to end (c1) through the eager pipeline: stream / offline, TTFA, RTF, stage breakdown.
- `serving`: the request matrix through the scheduler (text short/medium/long x concurrency x stream/offline x
  reference audio yes/no), p50/p95/p99 TTFA, inter-chunk, RTF, throughput (needs the runtime scheduler).
Everything runs with what the GPU machine has (torch, numpy); other imports are guarded.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import time

import torch

from ..engines.dtypes import TORCH_DTYPES

H200_HBM_BPS = 4.8e12
H200_BF16_FLOPS = 790e12


def add_arguments(p) -> None:
    p.add_argument("--suite", default="micro,parity,e2e,serving,features",
                   help="comma list of micro (= ar, dit, hift), parity, e2e, serving, features")
    p.add_argument("--out", required=True, help="folder for results.json (and plots)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="full", help="'full' (random full-size weights) or 'tiny'")
    p.add_argument("--dtype", default="bfloat16", help="LM and DiT dtype (HiFT stays float32)")
    p.add_argument("--quick", action="store_true", help="fewer shapes and repetitions (serving: the quick cells)")
    p.add_argument("--cells", default=None, choices=["full", "quick", "smoke"],
                   help="serving cell set (default: full, or quick with --quick; smoke: a CPU check of the harness)")
    p.add_argument("--budget-s", type=float, default=480.0, help="stop starting new sections after this many seconds")
    p.add_argument("--graph-profile", default="h200-graphs", help="bucket profile of the CUDA graphs (serving)")
    p.add_argument("--variants", default="compiled,graphs,eager",
                   help="serving variants (the first runs the whole matrix, the others the comparison cells)")
    p.add_argument("--no-compile", action="store_true", help="micro: skip the torch.compile variants")
    p.add_argument("--aoti", action="store_true", help="micro: also build and time an AOTInductor DiT on CUDA")
    p.add_argument("--compile-cache", default=None,
                   help="file of torch.compile artifacts: loaded first if it exists, (re)written at the end")


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


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


def full_models(device: str, dtype: torch.dtype, which: str = "full"):
    """Full-size (or tiny) architecture with seeded random weights, built directly on the device."""
    from ..runtime.models.config import full_config, tiny_config
    from ..runtime.models.loading import build_modules

    cfg = full_config() if which == "full" else tiny_config()
    torch.manual_seed(0)
    llm, flow, hift = build_modules(cfg, device=device)
    with torch.no_grad():
        hift.f0_predictor.classifier.bias.fill_(180.0)
    hift.fold_weight_norm()
    llm.to(dtype)
    flow.to(dtype)
    return cfg, llm.eval(), flow.eval(), hift.eval()


class Bench:
    def __init__(self, args):
        self.args = args
        self.t0 = time.perf_counter()
        self.results: dict = {"meta": self._meta(args)}
        os.makedirs(args.out, exist_ok=True)

    def _meta(self, args) -> dict:
        meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__, "model": args.model,
                "dtype": args.dtype}
        if torch.cuda.is_available():
            meta["gpu"] = torch.cuda.get_device_name(0)
        meta["commit"] = os.environ.get("COSYTRT_COMMIT", "")  # set by the caller where the tree has no .git
        if not meta["commit"]:
            try:
                meta["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                text=True).stdout.strip()
            except OSError:
                pass
        return meta

    def over_budget(self) -> bool:
        return time.perf_counter() - self.t0 > self.args.budget_s

    def save(self) -> None:
        with open(os.path.join(self.args.out, "results.json"), "w") as f:
            json.dump(self.results, f, indent=1)

    def section(self, name: str, fn) -> None:
        if self.over_budget():
            _log(f"skip {name}: time budget spent")
            self.results.setdefault("skipped", []).append(name)
            return
        _log(f"start {name}")
        t = time.perf_counter()
        try:
            self.results[name] = fn()
        except Exception as e:  # noqa: BLE001 - a failing section must not lose the others
            import traceback

            traceback.print_exc()
            self.results[name] = {"error": repr(e)}
        _log(f"done {name} in {time.perf_counter() - t:.1f}s")
        self.save()
        if self.args.compile_cache:  # after every section: a run cut short still leaves its compiles behind
            from ..runtime.stages.compiled import save_compile_cache

            _log(f"saved compile cache {self.args.compile_cache}: "
                 f"{save_compile_cache(self.args.compile_cache) / 1e6:.1f} MB")


# ------------------------------------------------------------------ micro-benchmarks

def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
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
    from ..engines.cuda_graphs import GraphCache

    t0 = time.perf_counter()
    g = GraphCache(fn, device)
    g.capture(0, args)
    capture_s = time.perf_counter() - t0
    out = g.run(0, *args)
    err = _max_err(out[0] if isinstance(out, (list, tuple)) else out, ref)
    return time_cuda(lambda: g.run(0, *args), reps=reps), err, capture_s


def _sdpa_decode_graph(fn, device, args: tuple, kv_len: int, ref) -> tuple[float, float]:
    """`fn` (a torch.compile of the LM's decode, separate from the scheduler's) traced with SDPA decode attention
    at every batch (`llm.REDUCE_ATTENTION_MAX_ROWS = 0`) in a CUDA graph: ms per step and max abs error vs eager;
    the same-run baseline of the reduce form that small batches use."""
    from ..runtime.models import llm as llm_module

    default = llm_module.REDUCE_ATTENTION_MAX_ROWS
    llm_module.REDUCE_ATTENTION_MAX_ROWS = 0
    try:
        ms, err, _ = graph_timing(lambda t, s, p: fn(t, s, p, kv_len=kv_len), device, args, ref)
        return ms, err
    finally:
        llm_module.REDUCE_ATTENTION_MAX_ROWS = default


def bench_ar(llm, device, quick: bool, compile: bool = True) -> list[dict]:
    """Decode ms per step per batch through the scheduler's path (slot-indexed KV cache, 300 positions filled, KV
    rung 1024): eager, CUDA graph of the eager step, CUDA graph of the torch.compile'd step. Prefill eager vs
    compiled. `compiled_max_abs_err`: compiled vs eager logits."""
    from ..runtime.stages.compiled import compile_fn
    from ..runtime.models.llm import REDUCE_ATTENTION_MAX_ROWS

    q = llm.config.qwen
    params = sum(p.numel() for p in llm.parameters()) - llm.speech_embedding.weight.numel()
    # decode reads the backbone + llm_decoder once per step (embed_tokens rows are gathered, not read)
    step_bytes = (params - q.vocab_size * q.hidden_size) * 2
    rows = []
    kv_len, filled = 1024, 300
    # batch 2 is one request in the compiled scheduler (a padding row: dynamo specializes batch 1, see compiled.py)
    batches = [2, 8, 32] if quick else [2, 8, 32, 64]
    # the serving scheduler's cache (same shapes, so this section's compiles are the ones serving reuses, also
    # through the compile cache in a later run)
    from ..runtime.stages.kv_slots import KVSlots
    from .bench_serving import scheduler_config

    serving = scheduler_config("compiled")
    KVSlots(llm, serving.ar_max_batch, serving.ar_max_len, scratch=True)
    decode_c = compile_fn(llm.decode) if compile else None
    decode_sdpa = torch.compile(llm.decode, dynamic=True, fullgraph=True) if compile else None
    for B in batches:
        tokens = torch.randint(0, 6561, (B,), device=device)
        slots = torch.arange(B, device=device)
        pos = torch.full((B,), filled, device=device, dtype=torch.long)
        row = {"stage": "ar_decode", "batch": B, "kv_len": kv_len}
        with torch.inference_mode():
            ref = llm.decode(tokens, slots, pos, kv_len=kv_len).clone()
            row["eager_ms"] = time_cuda(lambda: llm.decode(tokens, slots, pos, kv_len=kv_len), reps=10)
            row["graph_ms"], _, _ = graph_timing(lambda t, s, p: llm.decode(t, s, p, kv_len=kv_len), device,
                                                 (tokens, slots, pos), ref)
            if decode_c is not None:
                t0 = time.perf_counter()
                out = decode_c(tokens, slots, pos, kv_len=kv_len)
                row["compile_s"] = time.perf_counter() - t0
                row["compiled_max_abs_err"] = _max_err(out, ref)
                row["compiled_graph_ms"], row["compiled_graph_max_abs_err"], _ = graph_timing(
                    lambda t, s, p: decode_c(t, s, p, kv_len=kv_len), device, (tokens, slots, pos), ref)
                if B in (2, max(batches)):  # where the GPU time of a step goes (kernels, no graph)
                    try:
                        row["kernels"] = kernel_table(lambda: decode_c(tokens, slots, pos, kv_len=kv_len))
                    except Exception as e:  # noqa: BLE001 - a profiler problem must not cost the timings
                        row["kernels"] = {"error": repr(e), "kernel_us": float("nan"), "launches": 0, "top": []}
                    _log(f"AR decode B={B} compiled, kernels per step: {row['kernels']['kernel_us']:.0f} us in "
                         f"{row['kernels']['launches']} launches; top: " + "; ".join(
                             f"{k['name'][:60]} x{k['calls']} {k['us']:.0f}us" for k in row["kernels"]["top"][:6]))
                if B <= REDUCE_ATTENTION_MAX_ROWS:  # larger batches use SDPA already
                    row["compiled_sdpa_graph_ms"], row["compiled_sdpa_max_abs_err"] = _sdpa_decode_graph(
                        decode_sdpa, device, (tokens, slots, pos), kv_len, ref)
        kv_bytes = 2 * q.num_hidden_layers * B * q.num_key_value_heads * filled * q.head_dim * 2
        row["bound_ms"] = (step_bytes + kv_bytes) / H200_HBM_BPS * 1e3
        best = min(v for k, v in row.items() if k.endswith("graph_ms"))
        row["best_fraction_of_bound"] = row["bound_ms"] / best
        rows.append(row)
        _log(f"AR decode B={B}: eager {row['eager_ms']:.2f} ms, graph {row['graph_ms']:.2f} ms, compiled+graph "
             f"{row.get('compiled_graph_ms', float('nan')):.3f} ms (err {row.get('compiled_max_abs_err', 0):.2e}; "
             f"with SDPA decode attention {row.get('compiled_sdpa_graph_ms', float('nan')):.3f} ms), "
             f"bound {row['bound_ms']:.3f} ms")
    prefill_c = compile_fn(llm.prefill) if compile else None
    for B, T in ((2, 150), (8, 150)):  # 2 rows: what one request runs as in the compiled scheduler (+1 padding row)
        emb = torch.randn(B, T, q.hidden_size, device=device, dtype=next(llm.parameters()).dtype)
        lengths = torch.full((B,), T, device=device)
        slots = torch.arange(B, device=device)
        row = {"stage": "ar_prefill", "batch": B, "tokens": T}
        with torch.inference_mode():
            ref = llm.prefill(emb, lengths, slots).clone()
            row["eager_ms"] = time_cuda(lambda: llm.prefill(emb, lengths, slots), reps=5)
            if prefill_c is not None:
                t0 = time.perf_counter()
                out = prefill_c(emb, lengths, slots)
                row["compile_s"] = time.perf_counter() - t0
                row["compiled_max_abs_err"] = _max_err(out, ref)
                row["compiled_ms"] = time_cuda(lambda: prefill_c(emb, lengths, slots), reps=5)
            for name, fn in (("graph", llm.prefill), ("compiled_graph", prefill_c)):  # the scheduler's PrefillGraphs
                if fn is not None:
                    row[f"{name}_ms"], row[f"{name}_max_abs_err"], _ = graph_timing(fn, device, (emb, lengths, slots),
                                                                                    ref, reps=10)
        flops = 2 * params * B * T
        row["bound_ms"] = max(flops / H200_BF16_FLOPS, step_bytes / H200_HBM_BPS) * 1e3
        rows.append(row)
        _log(f"AR prefill {B}x{T}: " + ", ".join(f"{k[:-3]} {v:.2f} ms" for k, v in row.items() if k.endswith("_ms")))
    return rows


class AotiBuild:
    """The offline DiT as an AOTInductor package (dynamic batch and frames), built, loaded and timed in a child process.

    Started when the run starts, so its compile overlaps the sections before the DiT one; the child then waits until
    `measure(shapes)` tells it to go (the parent is idle while it times, so no two measurements share the GPU), loads
    the package, captures it in a CUDA graph per shape (CUDA) and times it against its own eager DiT. The child
    rebuilds the same seeded models (same weights as this process). Everything that can crash (run 4 of 2026-12-02
    segfaulted building the package, run 8 loading it) happens in the child: a crash costs this variant, not the run,
    and the child's log (with its faulthandler stack) lands in the error."""

    def __init__(self, model: str, dtype: torch.dtype, device: str, out_dir: str):
        import subprocess
        import sys

        self.path = os.path.join(out_dir, "dit_offline.pt2")
        self.results = os.path.join(out_dir, "results.json")
        self.log = os.path.join(out_dir, "child.log")
        self.t0 = time.perf_counter()
        code = (f"import torch; from cosytrt.tools.bench import aoti_child; aoti_child({model!r}, "
                f"torch.{str(dtype).split('.')[-1]}, {device!r}, {self.path!r}, {self.results!r})")
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-X", "faulthandler", "-c", code], stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.PIPE, text=True)

    def measure(self, shapes: list[tuple[int, int]]) -> dict:
        """Tell the child to time `shapes` [(rows, frames)]; returns {"build_s", "rows": [{rows, frames,
        aoti_graph_ms, aoti_graph_max_abs_err}]}. Raises RuntimeError with the child's log tail if it failed."""
        import json

        try:
            self.proc.stdin.write(json.dumps(shapes) + "\n")
            self.proc.stdin.close()
        except BrokenPipeError:  # the child is gone already: its exit code and log say why
            pass
        rc = self.proc.wait()
        if rc != 0:
            with open(self.log) as f:
                tail = f.read()[-3000:]
            raise RuntimeError(f"AOTInductor DiT child exited with {rc} after {time.perf_counter() - self.t0:.0f}s:"
                               f"\n{tail}")
        with open(self.results) as f:
            return json.load(f)


def aoti_child(model: str, dtype: torch.dtype, device: str, path: str, results: str) -> None:
    """The child process of `AotiBuild`: build the package, wait for the shapes on stdin, load it, time it per shape
    (a CUDA graph of the package on CUDA, plain calls on the CPU) against the eager offline DiT, write `results`."""
    import json
    import sys

    from ..build.export_dit import example_inputs
    from ..build.stage_exports import dit_export
    from ..runtime.models.dit import FixedModeDiT

    _cfg, llm, flow, hift = full_models(device, dtype, model)
    del llm, hift
    dit = flow.estimator
    t0 = time.perf_counter()
    dit_export(dit, False, dtype, device).to_aoti(path, 64, 16, 2048)
    build_s = time.perf_counter() - t0
    print(f"built {path} in {build_s:.0f}s", flush=True)
    shapes = json.loads(sys.stdin.readline())
    cuda = device.startswith("cuda")
    loaded = torch._inductor.aoti_load_package(path, run_single_threaded=cuda)
    print("loaded", flush=True)
    eager = FixedModeDiT(dit, False)
    rows = []
    for B, T in shapes:
        args = example_inputs(dit, B, T, dtype=dtype, device=device)
        with torch.inference_mode():
            ref = eager(*args).clone()
            if cuda:
                ms, err, _ = graph_timing(loaded, device, args, ref, reps=10)
            else:  # the CPU test of this child: one timed call, no graph
                loaded(*args)
                t = time.perf_counter()
                out = loaded(*args)
                ms = (time.perf_counter() - t) * 1e3
                err = _max_err(out[0] if isinstance(out, (list, tuple)) else out, ref)
        rows.append({"rows": B, "frames": T, "aoti_graph_ms": ms, "aoti_graph_max_abs_err": err})
        print(f"AOTI DiT {B}x{T}: {ms:.2f} ms", flush=True)
    with open(results, "w") as f:
        json.dump({"build_s": build_s, "rows": rows}, f)


def bench_dit(flow, device, dtype, quick: bool, compile: bool = True, aoti: AotiBuild | None = None) -> list[dict]:
    """ms per DiT forward (one Euler step) per (CFG rows, frames) and mask: eager, CUDA graph of eager, CUDA graph
    of torch.compile, and (offline mask, `aoti`) CUDA graph of an AOTInductor package, timed in its child process
    first, while this process waits."""
    from ..build.export_dit import example_inputs
    from ..runtime.stages.compiled import CompiledDiT
    from ..runtime.models.dit import FixedModeDiT

    dit = flow.estimator
    params = sum(p.numel() for p in dit.parameters())
    shapes = [(2, 200), (16, 200), (2, 1000), (32, 500)] if quick else [(2, 200), (8, 200), (16, 200), (2, 1000),
                                                                        (16, 1000), (32, 500), (64, 300)]
    compiled = CompiledDiT.of(dit) if compile else None
    aoti_rows, aoti_build_s = {}, None
    if aoti is not None:
        try:
            got = aoti.measure(shapes)
            aoti_build_s = got["build_s"]
            aoti_rows = {(r["rows"], r["frames"]): r for r in got["rows"]}
            _log(f"AOTInductor DiT (offline): built in {aoti_build_s:.0f}s, timed in its child process")
        except Exception as e:  # noqa: BLE001 - the other variants still run
            _log(f"AOTInductor DiT failed: {e!r}")
    rows = []
    for streaming in (False, True):
        variants = {"graph": FixedModeDiT(dit, streaming)}
        if compiled is not None:
            variants["compiled_graph"] = compiled.fixed(streaming)
        for B, T in shapes:
            args = example_inputs(dit, B, T, dtype=dtype, device=device)
            row = {"stage": "dit", "streaming": streaming, "rows": B, "frames": T}
            if not streaming and (B, T) in aoti_rows:
                row.update({k: v for k, v in aoti_rows[(B, T)].items() if k.startswith("aoti_")})
            with torch.inference_mode():
                ref = variants["graph"](*args).clone()
                row["eager_ms"] = time_cuda(lambda: variants["graph"](*args), reps=5)
                for name, fn in variants.items():
                    row[f"{name}_ms"], err, setup_s = graph_timing(fn, device, args, ref, reps=10)
                    if name != "graph":
                        row[f"{name}_setup_s"], row[f"{name}_max_abs_err"] = setup_s, err
            flops = 2 * params * B * T + 4 * B * T * T * dit.cfg.dim * dit.cfg.depth
            row["bound_ms"] = max(flops / H200_BF16_FLOPS, params * 2 / H200_HBM_BPS) * 1e3
            best = min(v for k, v in row.items() if k.endswith("graph_ms"))
            row["best_fraction_of_bound"] = row["bound_ms"] / best
            rows.append(row)
            _log(f"DiT {'stream' if streaming else 'offline'} {B}x{T}: " + ", ".join(
                f"{k[:-3]} {v:.2f} ms" for k, v in row.items() if k.endswith("_ms")))
        torch.cuda.empty_cache()
    if aoti_build_s is not None:
        rows.append({"stage": "dit_aoti_build", "seconds": aoti_build_s})
    return rows


def bench_hift(hift, device, quick: bool, compile: bool = True) -> list[dict]:
    """HiFT (finalize) ms per call per (batch, frames): eager, its CUDA graph and, for batch >= 2, the torch.compile'd
    vocoder (f0 predictor, sine source and decode: one dynamic-shape graph on the CPU, tests/test_bench_harness.py)
    in a CUDA graph, with its max abs error vs eager (the compiled serving variant's HiFT, `CompiledHiFT`)."""
    params = sum(p.numel() for p in hift.parameters())
    shapes = [(1, 100), (2, 500), (8, 500)] if quick else [(1, 100), (1, 500), (8, 100), (8, 500), (16, 1000)]
    rows = []
    eager = lambda m: hift.inference(m, finalize=True)[0]  # noqa: E731
    compiled = None
    if compile:
        from ..runtime.stages.compiled import CompiledHiFT

        compiled = CompiledHiFT.of(hift).offline  # what the compiled serving variant captures
    for B, T in shapes:
        mel = torch.randn(B, 80, T, device=device) * 0.5 - 4.0
        row = {"stage": "hift", "batch": B, "frames": T}
        with torch.inference_mode():
            ref = eager(mel).clone()
            row["eager_ms"] = time_cuda(lambda: eager(mel), reps=5)
            try:
                row["graph_ms"], _, _ = graph_timing(eager, device, (mel,), ref, reps=10)
            except Exception as e:  # noqa: BLE001
                _log(f"HiFT graph capture failed: {e!r}")
            if compiled is not None and B >= 2:  # batch 1 runs the eager vocoder (CompiledHiFT)
                try:
                    t0 = time.perf_counter()
                    row["compiled_max_abs_err"] = _max_err(compiled(mel), ref)
                    row["compile_s"] = time.perf_counter() - t0
                    row["compiled_graph_ms"], _, _ = graph_timing(compiled, device, (mel,), ref, reps=10)
                except Exception as e:  # noqa: BLE001 - costs this column only
                    row["compiled_error"] = repr(e)
                    _log(f"HiFT compiled {B}x{T}: {e!r}")
        audio_s = B * T * 480 / 24000
        best = min(v for k, v in row.items() if k.endswith("_ms"))
        row["ms_per_audio_s"] = best / audio_s
        # ~2 FLOPs per weight per output sample at each stage's rate; a coarse bound (fp32 convs ~ 60 TFLOP/s)
        row["bound_ms"] = 2 * params * B * T * 60 / 60e12 * 1e3
        rows.append(row)
        _log(f"HiFT {B}x{T}: " + ", ".join(f"{k[:-3]} {v:.2f} ms" for k, v in row.items() if k.endswith("_ms"))
             + f" ({row['ms_per_audio_s']:.2f} ms per audio s; compiled err {row.get('compiled_max_abs_err')})")
    return rows


# ------------------------------------------------------------------ CUDA-graph replay vs eager, every bucket

def graph_parity(cfg, llm, flow, hift, device, profile_name: str) -> list[dict]:
    """For every static DiT/HiFT bucket of the graph profile: graph replay vs the eager module at that shape."""
    from ..engines.cudagraph import example_from_templates
    from ..engines.cuda_graphs import GraphCache
    from ..runtime.models.dit import FixedModeDiT
    from ..runtime.stages.profile import load_profile

    prof = load_profile(profile_name)
    dit = flow.estimator
    dtype = next(dit.parameters()).dtype
    c = dit.cfg
    names = ["x", "mask", "mu", "t", "spks", "cond"]
    tpl = {"x": ["B", c.mel_dim, "T"], "mask": ["B", 1, "T"], "mu": ["B", c.mu_dim, "T"], "t": ["B"],
           "spks": ["B", c.spk_dim], "cond": ["B", c.mel_dim, "T"]}
    rows = []
    for mode in ("stream", "offline"):
        fn = FixedModeDiT(dit, mode == "stream")
        g = GraphCache(fn, device)
        make = example_from_templates(tpl, names, {n: dtype for n in names}, device)
        for b in prof.buckets("dit", mode):
            args = make(b)
            with torch.inference_mode():
                ref = fn(*args).float()
                g.capture(b.key, args)
                out = g.run(b.key, *args).float()
            rows.append({"bucket": b.key, "max_abs_err": float((out - ref).abs().max()),
                         "ref_max": float(ref.abs().max())})
        del g
    hfn = lambda mel: hift.inference(mel, finalize=True)[0]  # noqa: E731
    g = GraphCache(hfn, device)
    for b in prof.buckets("hift", "offline"):
        mel = torch.randn(b.batch, 80, b.length, device=device) - 4.0
        with torch.inference_mode():
            ref = hfn(mel)
            g.capture(b.key, (mel,))
            out = g.run(b.key, mel)
        rows.append({"bucket": b.key, "max_abs_err": float((out - ref).abs().max()), "ref_max": float(ref.abs().max())})
    worst = max(r["max_abs_err"] for r in rows)
    _log(f"graph parity: {len(rows)} buckets, worst max |graph - eager| = {worst:.3e}")
    return rows


# ------------------------------------------------------------------ end to end (c1)

def bench_e2e(cfg, llm, flow, hift, device, quick: bool) -> list[dict]:
    from ..runtime.models.loading import CosyVoice3Models
    from ..runtime.stages.pipeline import Pipeline
    from ..runtime.scheduling.request import Request
    from ..runtime.models.sampling import SamplingParams

    models = CosyVoice3Models(cfg, llm, flow, hift, "random-full", "", "random")
    pipe = _pipeline_with_random_frontend(models, Pipeline)
    rows = []
    for seconds in ((5,) if quick else (5, 15)):
        for stream in (True, False):
            req = Request(text="a" * 40, stream=stream, sampling=SamplingParams(seed=0, force_tokens=25 * seconds))
            pipe.synthesize(req)  # warm
            req = Request(text="a" * 40, stream=stream, sampling=SamplingParams(seed=0, force_tokens=25 * seconds))
            _, m = pipe.synthesize(req)
            d = m.to_dict()
            d.update({"audio_target_s": seconds, "stream": stream})
            rows.append(d)
            _log(f"e2e c1 {'stream' if stream else 'offline'} {seconds}s: TTFA {m.ttfa:.3f}s, total {m.total:.3f}s, "
                 f"RTF {m.rtf:.3f} (AR {m.t_ar:.3f}, DiT {m.t_dit:.3f}, voc {m.t_vocoder:.3f})")
    return rows


def _pipeline_with_random_frontend(models, Pipeline):
    """A pipeline over in-memory random models with the tiny ONNX frontends and a synthetic built-in voice."""
    import tempfile

    from ..runtime.models.frontend import Frontend, SavedSpeaker
    from ..runtime.scheduling.request import default_voice_wav
    from ..runtime.models.text import ByteTokenizer
    from ..runtime.models.tiny_frontends import write_tiny_frontends

    d = tempfile.mkdtemp()
    tok_path, spk_path = write_tiny_frontends(d)
    fe = Frontend(ByteTokenizer(models.config.llm.qwen.vocab_size), tok_path, spk_path)
    feats = fe.prompt_features(default_voice_wav(16000, 3.0), 16000)
    return Pipeline(models, fe, SavedSpeaker(features=feats, prompt_text="a prompt of three seconds"))


def run(args) -> int:
    from ..runtime.stages.compiled import load_compile_cache
    from ..engines.errors import InputError

    suites = set(args.suite.split(","))
    if "micro" in suites:
        suites |= {"ar", "dit", "hift"}
    unknown = suites - {"micro", "ar", "dit", "hift", "parity", "e2e", "serving", "features"}
    if unknown:
        raise InputError(f"unknown bench suite(s) {sorted(unknown)}: use micro (= ar, dit, hift), parity, e2e, "
                         "serving, features")
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise InputError("trtbuild bench --device cuda: no CUDA GPU here")
    if not cuda and suites & {"ar", "dit", "hift", "parity"}:
        raise InputError("the micro (ar, dit, hift) and parity suites time CUDA graphs: they need --device cuda")
    variants = args.variants.split(",")
    bad = set(variants) - {"compiled", "graphs", "eager"}
    if bad:
        raise InputError(f"unknown serving variant(s) {sorted(bad)}: use compiled, graphs, eager")
    cells = args.cells or ("quick" if args.quick else "full")
    dtype = TORCH_DTYPES[args.dtype]
    b = Bench(args)
    if args.compile_cache and os.path.isfile(args.compile_cache):
        _log(f"loading compile cache {args.compile_cache}: {load_compile_cache(args.compile_cache)}")
    _log(f"building {args.model} models on {args.device}")
    cfg, llm, flow, hift = full_models(args.device, dtype, args.model)
    compile = not args.no_compile
    aoti = None
    if "dit" in suites and args.aoti:  # started first: its compile overlaps the sections before the DiT one
        import tempfile

        # the package holds the weights (hundreds of MB): keep it out of --out
        aoti = AotiBuild(args.model, dtype, args.device, tempfile.mkdtemp(prefix="cosytrt-aoti-"))
        _log(f"building the AOTInductor DiT in a child process (log: {aoti.log})")
    if "ar" in suites:
        b.section("ar", lambda: bench_ar(llm, args.device, args.quick, compile))
    if "dit" in suites:
        b.section("dit", lambda: bench_dit(flow, args.device, dtype, args.quick, compile, aoti))
    if "hift" in suites:
        b.section("hift", lambda: bench_hift(hift, args.device, args.quick, compile))
    if "parity" in suites:
        b.section("graph_parity", lambda: graph_parity(cfg, llm, flow, hift, args.device, args.graph_profile))
    if "e2e" in suites:
        b.section("e2e", lambda: bench_e2e(cfg, llm, flow, hift, args.device, args.quick))
    if suites & {"serving", "features"}:
        from .bench_serving import bench_serving

        b.section("serving", lambda: bench_serving(cfg, llm, flow, hift, args.device, b, variants, cells,
                                                   matrix="serving" in suites, features="features" in suites))
    b.results["peak_gpu_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None
    b.save()
    _log(f"wrote {os.path.join(args.out, 'results.json')}")
    return 0


def main() -> int:  # python -m cosytrt.tools.bench
    import argparse

    p = argparse.ArgumentParser(prog="python -m cosytrt.tools.bench")
    add_arguments(p)
    return run(p.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
