"""Issue #20 on the GPU: what the batch-invariant LM costs and whether it holds on CUDA (one run, full-size
architecture, seeded random weights, bf16).

1. `step_ms`: AR decode step ms per batch size (KV rung 1024, 300 positions filled), CUDA graph of the eager step and
   of the torch.compile'd step, `SchedulerConfig.batch_invariant` off vs on (the LM attribute), and the on/off ratio;
   prefill ms (eager) for 2 x 150 and 8 x 150.
2. `logits`: max |logit difference| of one row alone vs beside 15 other rows vs padded into batch 64 vs at KV rungs
   256 / 2048, for eager, CUDA graph and compiled + CUDA graph, off and on (on should be 0.0 everywhere), and the
   same for prefill (alone vs beside 7 rows vs padded to 512 positions, eager and compiled).
3. `tokens`: 16 requests of different texts and seeds through TTS.submit with the compiled + CUDA-graph scheduler
   (SchedulerConfig(compile=True, cuda_graphs=True)), each alone and then all 16 concurrently: how many give the same
   tokens (on: should be 16 of 16), and the max |audio difference| of those.
Writes OUT/batch_invariance.json (the results, a `summary` of them, `status` complete / partial, per-part seconds and
errors; rewritten after every part, so a run stopped by a time limit still leaves what it measured) and
OUT/batch_invariance.md (a short table).

On the GPU machine, one command from the repository root (OUT defaults to $OUT; installs the carried frontend wheels
of .whl/ when there are any, which only the `tokens` part needs; stops itself before the device call's limit):
    bash benchmarks/batch_invariance_run.sh --parts step,logits          # about 3-4 minutes
    bash benchmarks/batch_invariance_run.sh                               # all parts: about 6-8 minutes
or directly: python3 benchmarks/batch_invariance_gpu.py [OUT] [--parts ...] [--budget-s S].
Options: --parts step,logits,tokens (default all); --off-tokens also runs the token check with the switch off;
--stream / --graphs PROFILE / --sched k=v,...: the token check with streaming requests, the DiT / HiFT in a profile's
CUDA graphs (cached hops: the flow prefix cache) and SchedulerConfig overrides (e.g. the exactness of step-level DiT
and hift_own_stream on the GPU: `--parts tokens --stream --graphs h200-graphs --sched hift_own_stream=1`);
--budget-s: parts that would start after this many seconds are skipped (recorded as such); --smoke: CPU, tiny
model, eager only (checks the script's wiring: tests/test_bench_scripts.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _import_this_checkout() -> None:
    """Import this checkout as `cosytrt` (not an installed wheel): a temporary package folder of links laid out as
    pyproject's package-dir (cosytrt/__init__.py + extras.py, and the top-level folders)."""
    pkg = os.path.join(tempfile.mkdtemp(), "cosytrt")
    os.mkdir(pkg)
    for name in os.listdir(os.path.join(REPO, "cosytrt")):
        if name.endswith(".py"):
            os.symlink(os.path.join(REPO, "cosytrt", name), os.path.join(pkg, name))
    for name in ("build", "engines", "profiles", "runtime", "tools"):
        os.symlink(os.path.join(REPO, name), os.path.join(pkg, name))
    sys.path.insert(0, os.path.dirname(pkg))


_import_this_checkout()

import numpy as np  # noqa: E402
import torch  # noqa: E402

from cosytrt.runtime.models import batch_invariant as bi  # noqa: E402

T0 = time.perf_counter()
DEV = "cuda"      # --smoke: "cpu" (tiny model, eager only: checks this script's wiring, not the GPU)


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def graph_ms(fn, args, reps: int = 20):
    """(ms per replay of fn(*args) in a CUDA graph, its output)."""
    from cosytrt.engines.cuda_graphs import GraphCache
    from cosytrt.tools.bench.timing import time_cuda

    g = GraphCache(fn, torch.device("cuda"))
    g.capture(0, args)
    out = g.run(0, *args).clone()
    return time_cuda(lambda: g.run(0, *args), reps=reps), out


def part_step(llm, res):
    from cosytrt.runtime.stages.compiled import compile_fn
    from cosytrt.tools.bench.timing import time_cuda

    dev = "cuda"
    kv_len, filled = 1024, 300
    decode_c = compile_fn(llm.decode)
    rows = []
    for B in (2, 8, 32, 64):  # batch 2 = one request in the compiled scheduler (one padding row)
        tokens = torch.randint(0, 6561, (B,), device=dev)
        slots = torch.arange(B, device=dev)
        pos = torch.full((B,), filled, device=dev, dtype=torch.long)
        row = {"batch": B}
        for tag, on, impl, norm, dec in MODES:
            llm.batch_invariant = on
            bi.ATTENTION_IMPL, bi.NORM_IMPL, bi.DECODE_ATTENTION = impl, norm, dec
            with torch.inference_mode():
                row[f"graph_ms_{tag}"], _ = graph_ms(lambda t, s, p: llm.decode(t, s, p, kv_len=kv_len),
                                                     (tokens, slots, pos))
                if tag in ("on torch-attention", "on bi-decode"):
                    continue  # the compiled step runs the same opaque op: the eager graph shows the difference
                row[f"compiled_graph_ms_{tag}"], _ = graph_ms(lambda t, s, p: decode_c(t, s, p, kv_len=kv_len),
                                                              (tokens, slots, pos))
        bi.ATTENTION_IMPL, bi.NORM_IMPL, bi.DECODE_ATTENTION = "auto", "torch", "auto"
        for k in ("graph_ms", "compiled_graph_ms"):
            row[f"{k}_ratio"] = row[f"{k}_on"] / row[f"{k}_off"]
        log(f"decode B={B}: graph {row['graph_ms_off']:.3f} -> {row['graph_ms_on']:.3f} ms "
            f"(x{row['graph_ms_ratio']:.2f}), compiled+graph {row['compiled_graph_ms_off']:.3f} -> "
            f"{row['compiled_graph_ms_on']:.3f} ms (x{row['compiled_graph_ms_ratio']:.2f})")
        rows.append(row)
    for B, T in ((2, 150), (8, 150)):
        emb = torch.randn(B, T, llm.config.qwen.hidden_size, device=dev, dtype=llm.dtype)
        lengths, slots = torch.full((B,), T, device=dev), torch.arange(B, device=dev)
        row = {"prefill": f"{B}x{T}"}
        for on in (False, True):
            llm.batch_invariant = on
            with torch.inference_mode():
                row["eager_ms_" + ("on" if on else "off")] = time_cuda(lambda: llm.prefill(emb, lengths, slots), 5)
        row["eager_ms_ratio"] = row["eager_ms_on"] / row["eager_ms_off"]
        log(f"prefill {B}x{T}: eager {row['eager_ms_off']:.2f} -> {row['eager_ms_on']:.2f} ms")
        rows.append(row)
    res["step_ms"] = rows


# (label, SchedulerConfig.batch_invariant, batch_invariant.ATTENTION_IMPL): "on" is what the scheduler runs (the
# Triton attention on CUDA); "on torch-attention" is the torch form of the op that run 20 measured (7.8e-3 at 64 rows)
# "on triton-norm": also rms_norm and the SiLU gate as one Triton kernel each (bi_norm_triton.py, NORM_IMPL; off by
# default until this run shows it invariant and cheaper)
# (tag, switch, bi.ATTENTION_IMPL, bi.NORM_IMPL, bi.DECODE_ATTENTION): "on" runs the decode steps' attention through
# the split-KV kernels on CUDA (the default since the twenty-second session), "on bi-decode" through the bi op
MODES = (("off", False, "auto", "torch", "auto"), ("on", True, "auto", "torch", "auto"),
         ("on bi-decode", True, "auto", "torch", "bi"), ("on torch-attention", True, "torch", "torch", "bi"),
         ("on triton-norm", True, "auto", "auto", "auto"))
EAGER_ONLY = False  # --eager-only: the logits part without its compiled forms (no compile: a short GPU call)


def part_logits(llm, res):
    from cosytrt.runtime.stages.compiled import compile_fn

    dev, H = DEV, llm.config.qwen.hidden_size
    cuda = dev == "cuda"
    compiled = cuda and not EAGER_ONLY
    decode_c, prefill_c = (compile_fn(llm.decode), compile_fn(llm.prefill)) if compiled else (None, None)
    g = torch.Generator(device=dev).manual_seed(0)
    lengths = [40 + 7 * i for i in range(16)]
    embeds = [torch.randn(n, H, device=dev, dtype=llm.dtype, generator=g) for n in lengths]
    scratch = 64

    def prefill(fn, rows, width=None):
        width = width or max(lengths[r] for r in rows)
        x = torch.zeros(len(rows), width, H, device=dev, dtype=llm.dtype)
        for i, r in enumerate(rows):
            x[i, :lengths[r]] = embeds[r]
        return fn(x, torch.tensor([lengths[r] for r in rows], device=dev), torch.tensor(rows, device=dev)).clone()

    def decode_args(rows, pad_to=None):
        t = [(37 * r) % 6561 for r in rows]
        s, p = list(rows), [lengths[r] for r in rows]
        if pad_to:
            n = pad_to - len(rows)
            t, s, p = t + [0] * n, s + [scratch] * n, p + [0] * n
        return tuple(torch.tensor(c, device=dev) for c in (t, s, p))

    out = {}
    for tag, on, impl, norm, dec in MODES if cuda else MODES[:2]:
        llm.batch_invariant = on
        bi.ATTENTION_IMPL, bi.NORM_IMPL, bi.DECODE_ATTENTION = impl, norm, dec
        with torch.inference_mode():
            for name, fn in (("eager", llm.prefill), ("compiled", prefill_c))[:2 if compiled else 1]:
                alone = prefill(fn, [5, 6])[0]  # compiled calls get >= 2 rows in the scheduler
                out[f"prefill {name} beside 7 rows, {tag}"] = (prefill(fn, list(range(8)))[5] - alone).abs().max().item()
                out[f"prefill {name} padded to 512, {tag}"] = (prefill(fn, [5, 6], 512)[0] - alone).abs().max().item()
            prefill(llm.prefill, list(range(16)))  # every slot holds its prompt
            for name, fn in (("eager", llm.decode), ("compiled", decode_c))[:2 if compiled else 1]:
                for graph in (False, True)[:2 if cuda else 1]:
                    def call(rows, kv, pad_to=None, fn=fn, graph=graph):
                        args = decode_args(rows, pad_to)
                        if graph:
                            return graph_ms(lambda t, s, p: fn(t, s, p, kv_len=kv), args, reps=1)[1]
                        return fn(*args, kv_len=kv).clone()

                    label = name + (" + CUDA graph" if graph else "")
                    alone = call([5], 256, pad_to=2)[0]
                    out[f"decode {label} beside 15 rows, {tag}"] = (call(list(range(16)), 256)[5] - alone).abs().max().item()
                    out[f"decode {label} padded to 64 rows, {tag}"] = (call([5], 256, 64)[0] - alone).abs().max().item()
                    out[f"decode {label} KV rung 2048, {tag}"] = (call([5], 2048, 2)[0] - alone).abs().max().item()
        log(f"logits ({tag}): " + ", ".join(f"{k}: {v:.2e}" for k, v in out.items() if k.endswith(tag)))
    if cuda:  # how far the Triton attention's logits are from the torch form's (accuracy, not invariance)
        llm.batch_invariant = True
        with torch.inference_mode():
            got = {}
            for impl, dec in (("triton", "bi"), ("torch", "bi"), ("triton", "auto")):
                bi.ATTENTION_IMPL, bi.DECODE_ATTENTION = impl, dec
                got[impl, dec] = llm.decode(*decode_args([5], 2), kv_len=256).float()[0]
            res["triton_vs_torch_attention_logits"] = (got["triton", "bi"] - got["torch", "bi"]).abs().max().item()
            res["split_kv_vs_bi_decode_logits"] = (got["triton", "auto"] - got["triton", "bi"]).abs().max().item()
        log(f"decode logits, Triton vs torch attention: {res['triton_vs_torch_attention_logits']:.2e}; split-KV vs "
            f"the bi op in decode: {res['split_kv_vs_bi_decode_logits']:.2e}")
    bi.ATTENTION_IMPL, bi.NORM_IMPL, bi.DECODE_ATTENTION = "auto", "torch", "auto"
    res["logits_max_abs_diff"] = out


def sched_overrides(text: str) -> dict:
    """`--sched a=1,b=0.5`: SchedulerConfig overrides (bools as 0 / 1, else int or float)."""
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, _, value = item.partition("=")
        out[name] = value in ("1", "true", "True") if value in ("0", "1", "true", "false", "True", "False") else (
            int(value) if value.lstrip("-").isdigit() else float(value))
    return out


def part_tokens(models, res, on: bool, stream: bool = False, graphs: str | None = None, overrides=None):
    """16 requests alone, then concurrently: same tokens? (batch_invariant on: should be 16 of 16) and the audio of
    those. `stream`: streaming requests (hops, the flow prefix cache where the backends have cached-hop graphs);
    `graphs`: a profile whose CUDA graphs (cached hops included) the pipeline runs; `overrides`: SchedulerConfig
    fields (e.g. dit_step_level, hift_own_stream) — so the check covers the DiT / HiFT scheduling paths too."""
    from cosytrt.runtime.scheduling.config import SchedulerConfig
    from cosytrt.runtime.tts import TTS
    from cosytrt.tools.bench.common import pipeline_with_random_frontend as _pipeline_with_random_frontend

    pipe = _pipeline_with_random_frontend(models)
    cuda = DEV == "cuda"
    if graphs and cuda:
        from cosytrt.runtime.stages.engine_set import attach_cuda_graphs
        from cosytrt.runtime.stages.profile import load_profile

        attach_cuda_graphs(pipe, load_profile(graphs))
    cfg = SchedulerConfig(**{**dict(max_in_flight=64, ar_max_batch=64, ar_max_len=1024, cuda_graphs=cuda,
                                    compile=cuda, batch_invariant=on), **(overrides or {})})
    t = time.perf_counter()
    tts = TTS(pipe, scheduler=cfg)
    tts.scheduler  # start: compiles and captures now
    log(f"tokens ({'on' if on else 'off'}): scheduler ready in {time.perf_counter() - t:.1f}s")
    texts = [f"Sentence number {i} for the concurrency test, a little longer." for i in range(16)]

    def run(i):
        h = tts.submit(texts[i], seed=100 + i, max_tokens=(60 + 5 * i) if cuda else 20 + i, stream=stream)
        wav = np.concatenate(list(h.chunks(timeout=600)))
        return h.tokens, wav

    try:
        alone = [run(i) for i in range(16)]
        together = [None] * 16

        def go(i):
            together[i] = run(i)

        threads = [threading.Thread(target=go, args=(i,)) for i in range(16)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        st = tts.scheduler.stats()
    finally:
        tts.close()
    same = [a[0] == b[0] for a, b in zip(alone, together)]
    audio = [float(np.abs(a[1] - b[1]).max()) for a, b, s in zip(alone, together, same) if s and a[1].shape == b[1].shape]
    path = ("compiled AR + CUDA graphs" if cuda else "eager (CPU smoke)") + (f", DiT/HiFT graphs of {graphs}" if graphs
                                                                             else "")
    path += (", streaming" if stream else ", offline") + "".join(f", {k}={v}" for k, v in (overrides or {}).items())
    row = {"batch_invariant": on, "path": path, "stats_dit_kinds": st["dit"].get("kinds"),
           "frames_reused": st["dit"].get("frames_reused"),
           "same_tokens": sum(same), "of": 16, "tokens_alone": [len(a[0]) for a in alone],
           "tokens_together": [len(b[0]) for b in together], "max_decode_batch": st["ar"]["max_decode_batch"],
           "audio_max_abs_diff_same_tokens": max(audio) if audio else None}
    log(f"tokens ({'on' if on else 'off'}): {row['same_tokens']}/16 the same; max decode batch "
        f"{row['max_decode_batch']}; audio max |diff| {row['audio_max_abs_diff_same_tokens']}")
    res.setdefault("tokens", []).append(row)


def table(res) -> str:
    lines = ["## Batch invariance on the GPU (issue #20)", "", f"{res.get('meta')}", "",
             "| decode batch | graph off ms | graph on ms | ratio | on, torch attention ms | on, Triton norm ms "
             "| compiled+graph off ms | on ms | ratio | on, Triton norm ms |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res.get("step_ms", []):
        if "batch" in r:
            def ms(key):
                return "" if r.get(key) is None else f"{r[key]:.3f}"

            lines.append(f"| {r['batch']} | {r['graph_ms_off']:.3f} | {r['graph_ms_on']:.3f} | {r['graph_ms_ratio']:.2f} "
                         f"| {ms('graph_ms_on torch-attention')} | {ms('graph_ms_on triton-norm')} "
                         f"| {r['compiled_graph_ms_off']:.3f} | {r['compiled_graph_ms_on']:.3f} | "
                         f"{r['compiled_graph_ms_ratio']:.2f} | {ms('compiled_graph_ms_on triton-norm')} |")
        else:
            lines.append(f"| prefill {r['prefill']} (eager) | {r['eager_ms_off']:.2f} | {r['eager_ms_on']:.2f} | "
                         f"{r['eager_ms_ratio']:.2f} | | | | | | |")
    if "triton_vs_torch_attention_logits" in res:
        lines.append(f"\nDecode logits, Triton vs torch form of the attention: max |diff| "
                     f"{res['triton_vs_torch_attention_logits']:.3e}")
    if "logits_max_abs_diff" in res:
        lines += ["", "| logits, one row vs | max abs diff |", "|---|---|"]
        lines += [f"| {k} | {v:.3e} |" for k, v in res["logits_max_abs_diff"].items()]
    for r in res.get("tokens", []):
        lines.append(f"\n16 concurrent requests, {r.get('path')}, batch_invariant={r['batch_invariant']}: "
                     f"{r['same_tokens']}/16 give the tokens they give alone (max decode batch {r['max_decode_batch']});"
                     f" audio max |diff| of those {r['audio_max_abs_diff_same_tokens']}")
    for k, v in res.get("errors", {}).items():
        lines.append(f"\nERROR in {k}: {v.splitlines()[-1]}")
    for k in res.get("skipped", []):
        lines.append(f"\nSKIPPED {k} (time budget)")
    return "\n".join(lines) + "\n"


def commit() -> str:
    """The commit measured: $COSYTRT_COMMIT, benchmarks/COMMIT (written by the coordinator's carry), or git."""
    if os.environ.get("COSYTRT_COMMIT"):
        return os.environ["COSYTRT_COMMIT"]
    try:
        with open(os.path.join(REPO, "benchmarks", "COMMIT")) as f:
            return f.read().strip()
    except OSError:
        pass
    import subprocess

    try:
        return subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def summary(res) -> dict:
    """The few numbers the README / BENCHMARKS.md quote, from what ran."""
    out = {}
    lg = res.get("logits_max_abs_diff")
    if lg:
        on = [v for k, v in lg.items() if k.endswith(", on")]
        off = [v for k, v in lg.items() if k.endswith(", off")]
        out["logits_on_max_abs_diff"] = max(on) if on else None      # 0.0: invariant on every path measured
        out["logits_on_invariant"] = bool(on) and max(on) == 0.0
        out["logits_off_max_abs_diff"] = max(off) if off else None
        tn = [v for k, v in lg.items() if k.endswith(", on triton-norm")]
        if tn:
            out["logits_on_triton_norm_invariant"] = max(tn) == 0.0
    steps = [r for r in res.get("step_ms", []) if "batch" in r]
    if steps:
        out["decode_ratio_on_off"] = {str(r["batch"]): {"graph": round(r["graph_ms_ratio"], 3),
                                                        "compiled_graph": round(r["compiled_graph_ms_ratio"], 3)}
                                      for r in steps}
    for r in res.get("tokens", []):
        out[f"tokens_same_{'on' if r['batch_invariant'] else 'off'}"] = f"{r['same_tokens']}/{r['of']}"
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?", default=os.environ.get("OUT"), help="output folder (default: $OUT)")
    ap.add_argument("--parts", default="step,logits,tokens")
    ap.add_argument("--off-tokens", action="store_true", help="also run the token check with the switch off")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="skip the parts that would start after this many seconds (default: no limit)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, eager only: checks the script itself")
    ap.add_argument("--eager-only", action="store_true", help="logits part: eager and CUDA-graph forms only")
    ap.add_argument("--stream", action="store_true", help="tokens part: streaming requests")
    ap.add_argument("--graphs", default=None, help="tokens part: run DiT / HiFT in the CUDA graphs of this profile "
                                                   "(e.g. h200-graphs: cached-hop graphs, the flow prefix cache on)")
    ap.add_argument("--sched", default="", help="tokens part: SchedulerConfig overrides, e.g. "
                                                "dit_step_level=1,hift_own_stream=1")
    args = ap.parse_args()
    if not args.out:
        ap.error("give the output folder (or set $OUT)")
    os.makedirs(args.out, exist_ok=True)
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - {"step", "logits", "tokens"}
    if unknown:
        ap.error(f"unknown part(s) {sorted(unknown)}: choose from step, logits, tokens")
    from cosytrt.tools.bench.common import full_models

    global DEV, EAGER_ONLY
    EAGER_ONLY = args.eager_only
    if args.smoke:
        DEV = "cpu"
        parts = [p for p in parts if p != "step"]  # CUDA graphs and events only
        cfg, llm, flow, hift = full_models("cpu", torch.float32, "tiny")
    else:
        if not torch.cuda.is_available():
            ap.error("no CUDA device (use --smoke to check the script on the CPU)")
        cfg, llm, flow, hift = full_models("cuda", torch.bfloat16)
    res = {"meta": {"gpu": torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu (smoke)",
                    "torch": torch.__version__, "commit": commit(), "argv": sys.argv[1:],
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
           "status": "running", "parts_s": {}, "skipped": [], "errors": {}}
    from cosytrt.runtime.stages.kv_slots import KVSlots

    KVSlots(llm, 64, 2048, scratch=True)

    def save():
        res["summary"] = summary(res)
        with open(os.path.join(args.out, "batch_invariance.json"), "w") as f:
            json.dump(res, f, indent=1)
        with open(os.path.join(args.out, "batch_invariance.md"), "w") as f:
            f.write(table(res))

    jobs = [("step", lambda: part_step(llm, res)), ("logits", lambda: part_logits(llm, res))]
    if "tokens" in parts:
        from cosytrt.runtime.models.loading import CosyVoice3Models

        models = CosyVoice3Models(cfg, llm, flow, hift, "random-full", "", "random")
        kw = dict(stream=args.stream, graphs=args.graphs, overrides=sched_overrides(args.sched))
        jobs.append(("tokens", lambda: part_tokens(models, res, True, **kw)))
        if args.off_tokens:
            jobs.append(("tokens off", lambda: part_tokens(models, res, False, **kw)))
    save()
    for name, fn in jobs:
        if name.split()[0] not in parts:
            continue
        if args.budget_s is not None and time.perf_counter() - T0 > args.budget_s:
            res["skipped"].append(name)
            log(f"skip {name}: past the {args.budget_s:.0f}s budget")
            continue
        log(f"start {name}")
        t = time.perf_counter()
        try:
            fn()
        except Exception:  # noqa: BLE001 - one failing part must not lose the others
            res["errors"][name] = traceback.format_exc()
            log(f"{name} failed:\n{res['errors'][name]}")
        res["parts_s"][name] = round(time.perf_counter() - t, 1)
        llm.batch_invariant = False
        save()
    res["status"] = "partial" if res["errors"] or res["skipped"] else "complete"
    save()
    print(table(res), flush=True)
    print(json.dumps(res["summary"]), flush=True)
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
