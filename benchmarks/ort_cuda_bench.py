"""ONNX Runtime on CUDA vs the compiled torch variant, and the compiled engine set's set-up time, on the GPU machine.
Driven by benchmarks/ort_cuda_run.sh (which installs onnxruntime-gpu first); every step appends to OUT/ort_cuda.json
and writes its table to OUT/ort_cuda_<step>.md. Run from outside the repo (so `cosytrt` resolves to the source
tree put on PYTHONPATH by the script):

    python3 REPO/benchmarks/ort_cuda_bench.py env|model|build|time|setup ... --out OUT

Steps:
  env                      torch / CUDA / GPU, onnxruntime version and providers, the TensorRT library check
  model DIR                a full-size golden-layout model directory with seeded random weights (config.json + llm.pt,
                           flow.pt, hift.pt), what `trtbuild build/parity --model DIR` load
  time --sets A,B          per bucket of each ORT engine set: ms per call through the ORT runner (I/O binding, CUDA
                           graph where ORT made one) vs the compiled torch function captured in a CUDA graph (what the
                           compiled serving variant runs) vs the eager module's CUDA graph; max abs error vs eager
  setup --mode M           seconds to a ready TTS in a fresh process: `cold` (compile=True, empty Inductor caches),
                           `set` (TTS.load(engines=<compiled set>), empty Inductor caches: a new machine with the set)
  serve --engines SET      offline requests at concurrency 1 and 8 through TTS.load with the ORT set, eager + graphs
                           (and `--variants ...,compiled`): a quick serving comparison
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time


def _imp(*names):
    """The first importable module of `names` (new layout first, then the old flat layout)."""
    err = None
    for n in names:
        try:
            return importlib.import_module(n)
        except ImportError as e:
            err = e
    raise err


def log(msg: str) -> None:
    print(f"[ort_cuda {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def save(out: str, step: str, data, table: str | None = None) -> None:
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "ort_cuda.json")
    allr = json.load(open(path)) if os.path.isfile(path) else {}
    allr[step] = data
    with open(path, "w") as f:
        json.dump(allr, f, indent=1, default=str)
    if table:
        with open(os.path.join(out, f"ort_cuda_{step}.md"), "w") as f:
            f.write(table + "\n")
        print(table, flush=True)


# ------------------------------------------------------------------ env
def step_env(args) -> None:
    import torch

    d = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
         "commit": os.environ.get("COSYTRT_COMMIT", "")}
    if torch.cuda.is_available():
        d["gpu"] = torch.cuda.get_device_name(0)
    try:
        import onnxruntime as ort

        d["onnxruntime"] = ort.__version__
        d["onnxruntime_file"] = ort.__file__
        d["providers"] = ort.get_available_providers()
        d["build_info"] = getattr(ort, "get_build_info", lambda: "")()
    except Exception as e:  # noqa: BLE001
        d["onnxruntime_error"] = repr(e)
    eng = _imp("cosytrt.engines.onnxruntime")
    d["tensorrt_library"] = eng.tensorrt_library()
    save(args.out, "env", d)
    log(json.dumps(d, default=str))


# ------------------------------------------------------------------ model
def step_model(args) -> None:
    """config.json in the golden layout with the full-size sizes, and the released checkpoint layout, seeded."""
    import dataclasses

    import torch

    cfgm = _imp("cosytrt.runtime.models.config", "cosytrt.runtime.config")
    loading = _imp("cosytrt.runtime.models.loading", "cosytrt.runtime.model")
    full = cfgm.full_config()
    q = full.llm.qwen
    sizes = {"qwen": {f.name: getattr(q, f.name) for f in dataclasses.fields(q)},
             "speech_token_size": full.llm.speech_token_size,
             "dit": {f.name: getattr(full.flow.dit, f.name) for f in dataclasses.fields(full.flow.dit)},
             "pre_channels": full.flow.pre_channels, "hift_base": full.hift.base_channels,
             "f0_cond": full.hift.f0_cond_channels}
    sizes = json.loads(json.dumps(sizes))
    os.makedirs(args.dir, exist_ok=True)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    for name, sd in loading.random_checkpoints(full, seed=0).items():
        torch.save(sd, os.path.join(args.dir, name))
    with open(os.path.join(args.dir, "config.json"), "w") as f:
        json.dump({"seed": 0, "config": sizes, "cosytrt": "full-random"}, f, indent=1)
    back = cfgm.config_from_golden_json(os.path.join(args.dir, "config.json"))
    # a golden directory caps the mel buffers at 3000 frames (120 s); everything else is the full architecture
    strip = lambda d: json.dumps({k: ({kk: vv for kk, vv in v.items() if kk != "max_mel_frames"}  # noqa: E731
                                      if isinstance(v, dict) else v) for k, v in d.items() if k != "name"},
                                 sort_keys=True, default=str)
    same = strip(back.to_dict()) == strip(full.to_dict())
    save(args.out, "model", {"dir": args.dir, "seconds": time.perf_counter() - t0, "same_as_full_config": same})
    log(f"model directory {args.dir} written in {time.perf_counter() - t0:.0f}s; config round trip equal: {same}")


# ------------------------------------------------------------------ timing
def _time_ms(fn, reps: int = 20, warmup: int = 3) -> float:
    from cosytrt.tools.bench.timing import time_cuda

    return time_cuda(fn, reps=reps, warmup=warmup)


def _graph(fn, args):
    """fn captured in a CUDA graph (cosytrt's GraphCache): a replay callable."""
    gc = _imp("cosytrt.engines.cuda_graphs", "cosytrt.runtime.cuda_graphs")
    g = gc.GraphCache(fn, "cuda")
    g.capture(0, args)
    return lambda: g.run(0, *args)


def _err(a, b) -> float:
    a = a[0] if isinstance(a, (list, tuple)) else a
    return float((a.float() - b.float()).abs().max())


def step_time(args) -> None:
    import torch

    manifest_m = _imp("cosytrt.engines.manifest", "cosytrt.build.manifest")
    buckets_m = _imp("cosytrt.engines.buckets", "cosytrt.runtime.buckets")
    loading = _imp("cosytrt.runtime.models.loading", "cosytrt.runtime.model")
    compiled_m = _imp("cosytrt.runtime.stages.compiled", "cosytrt.runtime.compiled")
    dit_m = _imp("cosytrt.runtime.models.dit", "cosytrt.runtime.dit")
    from cosytrt.engines import open_runner

    if args.compile_cache and os.path.isfile(args.compile_cache):
        log(f"compile cache {args.compile_cache} loaded: {compiled_m.load_compile_cache(args.compile_cache)}")
    rows, notes = [], {}
    models_by_dtype = {}
    for folder in args.sets.split(","):
        m = manifest_m.Manifest.load(folder)
        for spec in m.engines:
            if spec.stage not in ("dit", "hift"):
                continue
            dt = getattr(torch, spec.dtype)
            key = spec.dtype if spec.stage == "dit" else "float32"
            if key not in models_by_dtype:
                log(f"loading {m.model['source']} on cuda ({key} DiT)")
                mods = loading.load_models(m.model["source"], device="cuda")
                mods.flow.to(dt if spec.stage == "dit" else torch.float32)
                models_by_dtype[key] = mods
            mods = models_by_dtype[key]
            t0 = time.perf_counter()
            try:
                runner = open_runner(spec, folder, "cuda")
            except Exception as e:  # noqa: BLE001 - the other engines still run
                log(f"{folder} {spec.stage}/{spec.mode}: runner failed: {e!r}")
                rows.append({"set": folder, "stage": spec.stage, "mode": spec.mode, "error": repr(e)})
                continue
            load_s = time.perf_counter() - t0
            notes[f"{folder}:{spec.stage}/{spec.mode}"] = {"load_s": load_s, "notes": getattr(runner, "notes", []),
                                                           "providers": getattr(runner, "providers", None)}
            log(f"{spec.stage}/{spec.mode} {spec.dtype}: runner ready in {load_s:.1f}s; {getattr(runner, 'notes', '')}")
            for key_b in spec.buckets:
                b = buckets_m.parse_key(key_b)
                row = {"set": os.path.basename(folder.rstrip("/")), "stage": spec.stage, "mode": spec.mode,
                       "dtype": spec.dtype, "bucket": key_b, "graph": key_b in getattr(runner, "static", {}) and
                       runner.static[key_b].graph}
                try:
                    with torch.inference_mode():
                        _time_bucket(row, runner, spec, b, mods, compiled_m, dit_m, args)
                except Exception as e:  # noqa: BLE001
                    row["error"] = repr(e)[:300]
                rows.append(row)
                log(json.dumps(row))
            runner.close()
            del runner
            torch.cuda.empty_cache()
    table = _table(rows)
    save(args.out, "time", {"rows": rows, "runners": notes}, table)


def _time_bucket(row, runner, spec, b, mods, compiled_m, dit_m, args) -> None:
    import torch

    dev = "cuda"
    if spec.stage == "dit":
        dit = mods.flow.estimator
        dt = next(dit.parameters()).dtype
        example = _imp("cosytrt.build.export_dit").example_inputs(dit, b.batch, b.length, dt, torch.device(dev))
        ins = dict(zip(("x", "mask", "mu", "t", "spks", "cond"), example))
        streaming = spec.mode == "stream"
        eager = dit_m.FixedModeDiT(dit, streaming)
        args_t = tuple(ins[n] for n in spec.input_names)
        ref = eager(*args_t).clone()
        out = runner.run(ins, b)[spec.output_names[0]]
        row["ort_max_abs_err"] = _err(out, ref)
        row["ort_ms"] = _time_ms(lambda: runner.run(ins, b), reps=args.reps)
        row["eager_graph_ms"] = _time_ms(_graph(eager, args_t), reps=args.reps)
        if not args.no_compile:
            fn = compiled_m.CompiledDiT.of(dit).fixed(streaming)
            t0 = time.perf_counter()
            rep = _graph(fn, args_t)
            row["compiled_setup_s"] = time.perf_counter() - t0
            row["compiled_max_abs_err"] = _err(fn(*args_t), ref)
            row["compiled_graph_ms"] = _time_ms(rep, reps=args.reps)
    else:
        hift = mods.hift
        T, B = b.length, b.batch
        mel = (torch.randn(B, 80, T, generator=torch.Generator().manual_seed(0)) * 0.5 - 4.0).to(dev)
        ins = {"mel": mel, "sine_noise": hift.noise_slice(0, T).to(dev)}
        out = runner.run(ins, b)[spec.output_names[0]]
        row["ort_ms"] = _time_ms(lambda: runner.run(ins, b), reps=args.reps)
        if spec.mode == "offline":
            eager = lambda m: hift.inference(m, finalize=True)[0]  # noqa: E731
            ref = eager(mel).clone()
            n = min(out.shape[-1], ref.shape[-1])
            row["ort_max_abs_err"] = _err(out[..., :n], ref[..., :n])
            row["eager_graph_ms"] = _time_ms(_graph(eager, (mel,)), reps=args.reps)
            if not args.no_compile and B >= 2:
                fn = compiled_m.CompiledHiFT.of(hift).offline
                row["compiled_max_abs_err"] = _err(fn(mel), ref)
                row["compiled_graph_ms"] = _time_ms(_graph(fn, (mel,)), reps=args.reps)


def _table(rows) -> str:
    head = ["set", "stage/mode", "dtype", "bucket", "ORT graph", "ORT ms", "compiled graph ms", "eager graph ms",
            "ORT / compiled", "ORT err", "compiled err"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    f = lambda v, p=".3f": "-" if v is None else (format(v, p) if isinstance(v, float) else str(v))  # noqa: E731
    for r in rows:
        ratio = (r["ort_ms"] / r["compiled_graph_ms"]) if r.get("ort_ms") and r.get("compiled_graph_ms") else None
        lines.append("| " + " | ".join([
            str(r.get("set")), f"{r.get('stage')}/{r.get('mode')}", str(r.get("dtype", "-")),
            str(r.get("bucket", "-")).split("/")[-1], str(r.get("graph", "-")), f(r.get("ort_ms")),
            f(r.get("compiled_graph_ms")), f(r.get("eager_graph_ms")), f(ratio, ".2f"),
            f(r.get("ort_max_abs_err"), ".2e"), f(r.get("compiled_max_abs_err"), ".2e")])
            + (f" error: {r['error'][:120]}" if r.get("error") else ""))
    return "\n".join(lines)


# ------------------------------------------------------------------ set-up
def step_setup(args) -> None:
    """Seconds from nothing to a TTS that serves, in this (fresh) process; Inductor / Triton caches are whatever
    the caller's environment points at (the script gives each measurement empty ones)."""
    t0 = time.perf_counter()
    import torch

    tts_m = _imp("cosytrt.runtime.tts")
    t_import = time.perf_counter() - t0
    kw = {"model": args.model, "device": "cuda"}
    if args.mode == "cold":
        kw.update(compile=True, dtype=torch.bfloat16, cuda_graphs=args.profile)
    elif args.mode == "set":
        kw.update(engines=args.engines)
    elif args.mode == "graphs":
        kw.update(dtype=torch.bfloat16, cuda_graphs=args.profile)
    else:
        raise SystemExit(f"unknown setup mode {args.mode}")
    t1 = time.perf_counter()
    tts = tts_m.TTS.load(**kw)
    if args.mode == "graphs":  # not compiled: one request starts the scheduler (its graphs)
        tts.synthesize("Warm up.", seed=0, force_tokens=8)
    t_load = time.perf_counter() - t1
    t2 = time.perf_counter()
    tts.synthesize("Hello there, this is a test.", seed=0, force_tokens=50)
    t_first = time.perf_counter() - t2
    d = {"mode": args.mode, "import_s": t_import, "load_s": t_load, "first_request_s": t_first,
         "total_s": time.perf_counter() - t0, "inductor_cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
         "compile_set_load_s": getattr(getattr(tts.pipeline, "compiled_set", None), "load_seconds", None)}
    try:
        cm = _imp("cosytrt.runtime.stages.compiled", "cosytrt.runtime.compiled")
        d["graphs_compiled_in_process"] = cm.compiled_graph_count()
    except Exception:  # noqa: BLE001
        pass
    tts.close()
    save(args.out, f"setup_{args.mode}", d, f"| set-up {args.mode} | load {t_load:.1f} s | first request "
                                             f"{t_first:.2f} s | total {d['total_s']:.1f} s |")


# ------------------------------------------------------------------ serving (a quick matrix)
def step_serve(args) -> None:
    """Offline requests at concurrency 1 and 8 (forced token counts, seeded) through TTS.load with: the ORT set
    (`--engines`), eager + CUDA graphs, and the compiled variant; wall seconds and audio seconds per second."""
    import torch

    tts_m = _imp("cosytrt.runtime.tts")
    variants = {"ort": {"engines": args.engines, "dtype": torch.bfloat16},
                "graphs": {"dtype": torch.bfloat16, "cuda_graphs": args.profile},
                "compiled": {"dtype": torch.bfloat16, "cuda_graphs": args.profile, "compile": True}}
    rows = []
    for name in args.variants.split(","):
        kw = dict(variants[name], model=args.model, device="cuda")
        if name == "compiled" and args.compile_cache and os.path.isfile(args.compile_cache):
            kw["compile_cache"] = args.compile_cache
        t0 = time.perf_counter()
        try:
            tts = tts_m.TTS.load(**kw)
            tts.synthesize("Warm up.", seed=0, force_tokens=16)
        except Exception as e:  # noqa: BLE001
            rows.append({"variant": name, "error": repr(e)[:300]})
            log(f"{name}: {e!r}")
            continue
        setup = time.perf_counter() - t0
        for conc in (1, 8):
            t1 = time.perf_counter()
            hs = [tts.submit("The quick brown fox jumps over the lazy dog.", seed=i, force_tokens=args.tokens)
                  for i in range(conc)]
            audio = sum(len(h.result()) for h in hs) / tts.sample_rate
            wall = time.perf_counter() - t1
            rows.append({"variant": name, "concurrency": conc, "setup_s": setup, "wall_s": wall,
                         "audio_s": audio, "audio_s_per_s": audio / wall})
            log(json.dumps(rows[-1]))
        tts.close()
        del tts
        torch.cuda.empty_cache()
    lines = ["| variant | concurrency | wall s | audio s | audio s / s | set-up s |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | error: {r['error'][:100]} | | | | |")
        else:
            lines.append(f"| {r['variant']} | {r['concurrency']} | {r['wall_s']:.2f} | {r['audio_s']:.1f} | "
                         f"{r['audio_s_per_s']:.1f} | {r['setup_s']:.0f} |")
    save(args.out, "serve", rows, "\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("step", choices=["env", "model", "time", "setup", "serve"])
    p.add_argument("dir", nargs="?", default="/tmp/full_model")
    p.add_argument("--out", required=True)
    p.add_argument("--sets", default="")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--compile-cache", default=None)
    p.add_argument("--mode", default="cold")
    p.add_argument("--model", default="/tmp/full_model")
    p.add_argument("--engines", default=None)
    p.add_argument("--profile", default="h200-graphs")
    p.add_argument("--variants", default="ort,graphs")
    p.add_argument("--tokens", type=int, default=150)
    args = p.parse_args()
    {"env": step_env, "model": step_model, "time": step_time, "setup": step_setup, "serve": step_serve}[args.step](args)


if __name__ == "__main__":
    main()
