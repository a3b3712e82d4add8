"""GPU micro-benchmarks (`trtbuild bench --suite micro,parity,e2e`) on the full-size CosyVoice3 architecture (seeded
random weights, fixed shapes).

- `ar`, `dit`, `hift` (= `micro`): AR prefill / decode ms per step per batch (eager vs CUDA graph vs compiled), DiT
  ms per call per (rows, frames), HiFT ms per call per (batch, frames), each beside its H200 roofline bound
  (bytes / 4.8 TB/s, FLOPs / 790 TFLOP/s bf16) and the achieved fraction.
- `parity`: every static DiT / HiFT bucket of a graph profile, CUDA-graph replay vs the eager module.
- `e2e`: single requests end to end (c1) through the eager pipeline: stream / offline, TTFA, RTF, stage breakdown.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .aoti import AotiBuild
from .common import (H200_BF16_FLOPS, H200_HBM_BPS, log as _log, pipeline_with_random_frontend, random_models,
                     scheduler_config)
from .timing import graph_timing, kernel_table, max_err, time_cuda


# ------------------------------------------------------------------ micro-benchmarks

def sdpa_decode(llm):
    """The LM's decode step with SDPA decode attention at every batch (`reduce_attention_max_rows=0`), for a
    torch.compile separate from the scheduler's: the same-run baseline of the reduce form that small batches use.
    The LM itself is not changed."""

    def decode(tokens, slots, positions, kv_len=None):
        return llm.decode(tokens, slots, positions, kv_len=kv_len, reduce_attention_max_rows=0)

    return decode


def bench_ar(llm, device, quick: bool, compile: bool = True) -> list[dict]:
    """Decode ms per step per batch through the scheduler's path (slot-indexed KV cache, 300 positions filled, KV
    rung 1024): eager, CUDA graph of the eager step, CUDA graph of the torch.compile'd step. Prefill eager vs
    compiled. `compiled_max_abs_err`: compiled vs eager logits."""
    from ...runtime.stages.compiled import compile_fn

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
    from ...runtime.stages.kv_slots import KVSlots
    
    serving = scheduler_config("compiled")
    KVSlots(llm, serving.ar_max_batch, serving.ar_max_len, scratch=True)
    decode_c = compile_fn(llm.decode) if compile else None
    decode_sdpa = torch.compile(sdpa_decode(llm), dynamic=True, fullgraph=True) if compile else None
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
                row["compiled_max_abs_err"] = max_err(out, ref)
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
                if B <= llm.reduce_attention_max_rows:  # larger batches use SDPA already
                    row["compiled_sdpa_graph_ms"], row["compiled_sdpa_max_abs_err"], _ = graph_timing(
                        lambda t, s, p: decode_sdpa(t, s, p, kv_len=kv_len), device, (tokens, slots, pos), ref)
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
                row["compiled_max_abs_err"] = max_err(out, ref)
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


def bench_dit(flow, device, dtype, quick: bool, compile: bool = True, aoti: AotiBuild | None = None) -> list[dict]:
    """ms per DiT forward (one Euler step) per (CFG rows, frames) and mask: eager, CUDA graph of eager, CUDA graph
    of torch.compile, and (offline mask, `aoti`) CUDA graph of an AOTInductor package, timed in its child process
    first, while this process waits."""
    from ...build.export_dit import example_inputs
    from ...runtime.stages.compiled import CompiledDiT
    from ...runtime.models.dit import FixedModeDiT

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
        from ...runtime.stages.compiled import CompiledHiFT

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
                    row["compiled_max_abs_err"] = max_err(compiled(mel), ref)
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
    from ...engines.cudagraph import example_from_templates
    from ...engines.cuda_graphs import GraphCache
    from ...runtime.models.dit import FixedModeDiT
    from ...runtime.stages.profile import load_profile

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
    from ...runtime.models.sampling import SamplingParams
    from ...runtime.stages.request import Request

    models = random_models(cfg, llm, flow, hift)
    pipe = pipeline_with_random_frontend(models)
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
