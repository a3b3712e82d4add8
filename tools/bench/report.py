"""Turn a `trtbuild bench` results.json into markdown tables and PNG plots.

    python -m cosytrt.tools.bench.report RESULTS.json --out DIR   # writes DIR/bench_tables.md, DIR/*.png
"""
from __future__ import annotations

import argparse
import json
import os

from ..table import format_table


def _md(headers, rows) -> str:
    def cell(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return "—" if v is None else str(v)

    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def _ms(r: dict, key: str):
    return r.get(key)


def tables(res: dict) -> str:
    parts = []
    ar = res.get("ar")
    if isinstance(ar, list):
        dec = [r for r in ar if r.get("stage") == "ar_decode"]
        rows = [[r["batch"], r["eager_ms"], r.get("graph_ms"), r.get("compiled_sdpa_graph_ms"),
                 r.get("compiled_graph_ms"), r.get("bound_ms"), r.get("best_fraction_of_bound"),
                 r.get("compiled_max_abs_err")] for r in dec]
        parts.append(f"**AR decode (Qwen2 0.5B, bf16)**, ms per step, slot-indexed KV cache, KV rung "
                     f"{dec[0].get('kv_len', 1024) if dec else ''}\n\n" + _md(
                         ["batch", "eager", "CUDA graph", "compiled + graph, SDPA attention",
                          "compiled + graph", "HBM bound", "bound / best", "compiled max abs err (logits)"], rows))
        for r in dec:
            k = r.get("kernels")
            if isinstance(k, dict) and k.get("top"):
                parts.append(f"**AR decode kernels, batch {r['batch']}** (compiled, no graph; per step: "
                             f"{k['launches']:.0f} launches, {k['kernel_us']:.0f} us of kernel time)\n\n" + _md(
                                 ["kernel", "calls", "us"], [[t["name"][:90], t["calls"], t["us"]] for t in k["top"]]))
        pre = [r for r in ar if r.get("stage") == "ar_prefill"]
        if pre:
            rows = [[r["batch"], r["tokens"], r["eager_ms"], r.get("graph_ms"), r.get("compiled_ms"),
                     r.get("compiled_graph_ms"), r.get("bound_ms"), r.get("compiled_max_abs_err")] for r in pre]
            parts.append("**AR prefill**, ms per call\n\n" + _md(
                ["batch", "tokens", "eager", "CUDA graph", "compiled", "compiled + graph", "bound",
                 "compiled max abs err (logits)"], rows))
    dit = res.get("dit")
    if isinstance(dit, list):
        rows = [["stream" if r["streaming"] else "offline", r["rows"], r["frames"], r["eager_ms"], r.get("graph_ms"),
                 r.get("compiled_graph_ms"), r.get("aoti_graph_ms"), r["bound_ms"], r.get("best_fraction_of_bound"),
                 r.get("compiled_graph_max_abs_err")] for r in dit if r.get("stage") == "dit"]
        parts.append("**DiT estimator (bf16), one forward = one Euler step**, ms\n\n" + _md(
            ["mask", "CFG rows", "frames", "eager", "CUDA graph", "compiled + graph", "AOTI + graph", "roofline",
             "bound / best", "compiled max abs err"], rows))
    if isinstance(res.get("hift"), list):
        rows = [[r["batch"], r["frames"], r["eager_ms"], r.get("graph_ms"), r.get("compiled_graph_ms"),
                 r["ms_per_audio_s"], r.get("compiled_max_abs_err")] for r in res["hift"]]
        parts.append("**HiFT (fp32, f0 predictor fp64), finalize**\n\n" + _md(
            ["batch", "mel frames", "eager ms", "CUDA graph ms", "compiled + graph ms", "ms per audio second (best)",
             "compiled max abs err"], rows))
    if isinstance(res.get("e2e"), list):
        rows = [["stream" if r["stream"] else "offline", r["audio_target_s"], r["ttfa"], r["total"], r["rtf"],
                 r["T_AR"], r["T_DiT"], r["T_vocoder"]] for r in res["e2e"]]
        parts.append("**Single request end to end (eager pipeline, c1)**\n\n" + _md(
            ["mode", "audio s", "TTFA s", "total s", "RTF", "T_AR", "T_DiT", "T_vocoder"], rows))
    srv = res.get("serving")
    if isinstance(srv, dict) and srv.get("cells"):
        parts.append("**Serving matrix (scheduler; full-size architecture, random weights, forced token counts)**"
                     "\n\n" + _cell_table(srv["cells"], "variant"))
    feat = res.get("features")
    if isinstance(feat, dict) and feat.get("cells"):
        parts.append(f"**Scheduler features off vs on ({feat.get('variant')} variant)**\n\n"
                     + _cell_table(feat["cells"], "setting"))
    return "\n\n".join(parts)


def _cell_table(cells: list, first: str) -> str:
    rows = []
    for r in cells:
        label = [r.get("variant"), r.get("text"), r.get("concurrency"), "stream" if r.get("stream") else "offline",
                 "yes" if r.get("reference_audio") else "no", r.get("arrival_s") or 0]
        if "error" in r:
            rows.append(label + ["error: " + r["error"][:60]])
            continue
        rows.append(label + [r["ttfa"]["p50"], r["ttfa"]["p95"], r["ttfa"]["p99"], r["inter_chunk"]["p50"],
                             r["inter_chunk"]["p95"], r["rtf"]["p50"], r["rtf"]["p95"], r["total"]["p50"],
                             r["total"]["p99"], r["throughput_audio_s_per_s"], r["T_tokenizer"], r["T_AR"], r["T_DiT"],
                             r["T_vocoder"], r["T_queue"], r["peak_gpu_gb"]]
                    + [(r.get("occupancy") or {}).get(s) for s in ("ar", "dit", "hift")])
    return _md([first, "text", "conc.", "mode", "ref audio", "arrival s", "TTFA p50", "TTFA p95", "TTFA p99",
                "inter-chunk p50", "inter-chunk p95", "RTF p50", "RTF p95", "e2e p50", "e2e p99", "audio s/s",
                "T_tok", "T_AR", "T_DiT", "T_voc", "T_queue", "peak GB", "AR busy", "DiT busy", "HiFT busy"], rows)


def ratios(res: dict) -> str:
    """Variant and feature ratios measured in the same run (same cells, same process)."""
    srv = res.get("serving") or {}
    by = {(c["variant"], c["text"], c["concurrency"], c["stream"], c["reference_audio"]): c
          for c in srv.get("cells", []) if "error" not in c}
    rows = []
    variants = sorted({k[0] for k in by})
    for base in ("eager", "graphs"):
        for v in variants:
            if v == base:
                continue
            for (var, text, conc, stream, ref), c in sorted(by.items(), key=lambda kv: str(kv[0])):
                b = by.get((base, text, conc, stream, ref))
                if var != v or b is None:
                    continue
                rows.append([f"{v} / {base}", text, conc, "stream" if stream else "offline",
                             b["ttfa"]["p50"] / c["ttfa"]["p50"],
                             c["throughput_audio_s_per_s"] / b["throughput_audio_s_per_s"]])
    parts = []
    if rows:
        parts.append("**Variant ratios (same run)**: TTFA p50 speed-up and throughput gain\n\n" + _md(
            ["variant / base", "text", "conc.", "mode", "TTFA p50 base / variant", "throughput variant / base"], rows))
    feat = res.get("features") or {}
    cells = [c for c in feat.get("cells", []) if "error" not in c]
    on: dict = {}  # cell -> the "all on" runs (first and repeat): the base is their mean
    for c in cells:
        if c["variant"].startswith("all on"):
            on.setdefault((c["text"], c["concurrency"], c["stream"]), []).append(c)

    def row(label, key, c, base_runs):
        """`c` against the mean of `base_runs`: TTFA p95 c / base, throughput base / c, e2e p50 c / base."""
        n = len(base_runs)
        ttfa = sum(r["ttfa"]["p95"] for r in base_runs) / n
        thr = sum(r["throughput_audio_s_per_s"] for r in base_runs) / n
        e2e = sum(r["total"]["p50"] for r in base_runs) / n
        return [label, key[0], key[1], "stream" if key[2] else "offline", c["ttfa"]["p95"] / ttfa,
                thr / c["throughput_audio_s_per_s"], c["total"]["p50"] / e2e]

    rows = [row("all on, repeat vs first (noise)", key, runs[1], runs[:1])
            for key, runs in on.items() if len(runs) == 2]
    for c in cells:
        key = (c["text"], c["concurrency"], c["stream"])
        if not c["variant"].startswith("all on") and key in on:
            rows.append(row(c["variant"], key, c, on[key]))
    if rows:
        parts.append("**What each feature buys (same run)**: ratio of the feature switched off to all on (the mean of "
                     "the first and the repeated all-on run; their own ratio is the first row per cell)\n\n" + _md(
            ["setting", "text", "conc.", "mode", "TTFA p95 off / on", "throughput on / off", "e2e p50 off / on"],
            rows))
    return "\n\n".join(parts)


def provenance(res: dict) -> str:
    """What a plot was measured on: engines (variants, graph profile), cosytrt commit, GPU, model."""
    meta = res.get("meta") or {}
    variants = sorted({c.get("variant") for sec in ("serving", "features", "open_loop")
                       for c in ((res.get(sec) or {}).get("cells") or []) if isinstance(c, dict) and c.get("variant")}
                      | ({(res.get(sec) or {}).get("variant") for sec in ("open_loop", "agent")} - {None}))
    engines = ", ".join(v for v in variants if v) or "micro-benchmarks"
    if meta.get("graph_profile") and set(variants) - {"eager", "engines", None}:  # only graph variants use it
        engines += f" (graph profile {meta['graph_profile']})"
    return (f"engines: {engines}; cosytrt {meta.get('commit') or '?'}; {meta.get('gpu') or 'no GPU (CPU)'}; "
            f"{meta.get('model', '?')} model")


def _legend_below(fig, axes) -> None:
    """One legend for the figure, under the panels, so it covers no data."""
    handles, labels = [], []
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    if handles:
        fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=min(4, len(labels)),
                   fontsize=7, frameon=False)


def _save(fig, out_dir: str, name: str, res: dict | None = None, axes=(), title: str = "") -> str:
    """The figure under `title` and the run's provenance (when `res` is given), its legend below the panels, written
    to out_dir/name."""
    import matplotlib.pyplot as plt

    if res is not None:
        fig.suptitle(f"{title} - {provenance(res)}" if title else provenance(res), fontsize=9)
        fig.tight_layout(rect=(0, 0, 1, 0.95))
    else:
        fig.tight_layout()
    _legend_below(fig, axes)
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def plots(res: dict, out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    srv = res.get("serving")
    cells = [c for c in (srv or {}).get("cells", []) if "error" not in c]
    if cells:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        concs = sorted({c["concurrency"] for c in cells})  # categories: evenly spaced, labelled
        for (variant, text, stream), style in zip(sorted({(c["variant"], c["text"], c["stream"]) for c in cells}),
                                                  ["o-", "s-", "^-", "v-", "d-", "x-", "*-", "+-"]):
            pts = sorted((c["concurrency"], c) for c in cells if (c["variant"], c["text"], c["stream"]) ==
                         (variant, text, stream) and not c["reference_audio"])
            if not pts:
                continue
            label = f"{variant} {text} {'stream' if stream else 'offline'}"
            xs = [concs.index(p[0]) for p in pts]
            axes[0].plot(xs, [p[1]["rtf"]["p50"] for p in pts], style, label=label)
            axes[1].plot(xs, [p[1]["throughput_audio_s_per_s"] for p in pts], style, label=label)
        for ax in axes:
            ax.set_xticks(range(len(concs)), [str(c) for c in concs])
            ax.set_xlim(-0.5, len(concs) - 0.5)
        axes[0].set(xlabel="concurrency", ylabel="RTF p50", title="RTF vs concurrency")
        axes[1].set(xlabel="concurrency", ylabel="audio seconds per second", title="throughput")
        written.append(_save(fig, out_dir, "bench_serving.png", res, axes))
    micro = [(name, [r for r in res.get(name) or [] if r.get("stage") == stage])
             for name, stage in (("ar", "ar_decode"), ("dit", "dit"))]
    micro = [(name, rows) for name, rows in micro if rows]
    if micro:
        fig, axes = plt.subplots(1, len(micro), figsize=(6 * len(micro), 4), squeeze=False)
        for ax, (name, rows) in zip(axes[0], micro):
            if name == "dit":
                rows = [r for r in rows if not r["streaming"]]
                labels = [f"{r['rows']}x{r['frames']}" for r in rows]
            else:
                labels = [f"B={r['batch']}" for r in rows]
            series = [(k, lab) for k, lab in (("eager_ms", "eager"), ("graph_ms", "CUDA graph"),
                                              ("compiled_graph_ms", "compiled + graph"),
                                              ("aoti_graph_ms", "AOTI + graph")) if any(r.get(k) for r in rows)]
            w = 0.8 / len(series)
            for j, (k, lab) in enumerate(series):
                ax.bar([i + (j - (len(series) - 1) / 2) * w for i in range(len(rows))],
                       [r.get(k) or 0 for r in rows], w, label=lab)
            ax.plot(range(len(rows)), [r["bound_ms"] for r in rows], "k_", markersize=20, label="roofline")
            ax.set_xticks(list(range(len(rows))), labels)
            ax.set_yscale("log")
            ax.set_xlim(-0.5, len(rows) - 0.5)
            ax.set(ylabel="ms per call (log)", title="AR decode step, bf16" if name == "ar" else
                   "DiT forward (offline mask), bf16")
        written.append(_save(fig, out_dir, "bench_micro.png", res, axes[0]))
    samples = [c for c in cells if c.get("ttfa_samples") and c["concurrency"] >= 8]
    if samples:
        fig, ax = plt.subplots(figsize=(6, 4))
        for c in samples:
            xs = c["ttfa_samples"]
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], drawstyle="steps-post",
                    label=f"{c['variant']} {c['text']} c{c['concurrency']} {'stream' if c['stream'] else 'offline'}")
        ax.set(xlabel="time to first audio, s", ylabel="fraction of requests", title="TTFA distribution")
        written.append(_save(fig, out_dir, "bench_ttfa.png", res, [ax]))
    return written


# ------------------------------------------------------------------ open loop

def _open_cells(res: dict) -> list[dict]:
    ol = res.get("open_loop")
    return [c for c in (ol or {}).get("cells", []) if isinstance(c, dict) and "error" not in c] \
        if isinstance(ol, dict) else []


def open_loop_tables(res: dict) -> str:
    """The open-loop cells: latency and playback per (setting, rate), then where the time went."""
    ol = res.get("open_loop")
    if not isinstance(ol, dict) or not ol.get("cells"):
        return ""
    sp = ol.get("spec") or {}
    mix = " + ".join(f"{w:g} x log-normal(median {m:g} s, sigma {s:g})" for m, s, w in sp.get("lengths", []))
    head = (f"**Open loop ({ol.get('variant')} variant)**: Poisson arrivals for {sp.get('duration_s'):g} s per rate "
            f"(seed {sp.get('seed')}), lengths {mix} clipped to {sp.get('min_s'):g}-{sp.get('max_s'):g} s, "
            f"{100 * sp.get('stream_fraction', 1):.0f}% streaming, saved-speaker voice. TTFA and underruns: streams; "
            "achieved: audio delivered during the arrival window / window.")
    rows, res_rows = [], []
    cells = ol["cells"]
    head += _short_drain(cells, sp.get("max_s"))
    sms = sorted({sm for c in cells for sm in (c.get("buckets") or {})})
    for c in cells:
        label = [c.get("setting"), c.get("rate")]
        if "error" in c:
            rows.append(label + ["error: " + c["error"][:80]])
            continue
        t, lat = c.get("ttfa") or {}, c.get("offline_latency") or {}
        rows.append(label + [c["offered_audio_s_per_s"], c["achieved_audio_s_per_s"], c.get("delivered_audio_s_per_s"),
                             f"{c['streams']}/{c['offline']}", t.get("p50"), t.get("p95"), t.get("p99"),
                             c.get("inter_chunk_p95"), f"{c['underrun_requests']} of {c['streams']}",
                             c.get("underrun_fraction"), c.get("stall_s"), lat.get("p95"),
                             _unfinished(c), _failed(c), c.get("saturated") or ""])
        busy, frames = c.get("busy") or {}, c.get("dit_frames") or {}
        res_rows.append(label + [busy.get(s) for s in ("ar", "dit", "hift")]
                        + [((c.get("buckets") or {}).get(sm) or {}).get("hit_rate") for sm in sms]
                        + [c.get("fallbacks"), frames.get("frames_computed"), frames.get("frames_reused"),
                           c.get("compiles"), c.get("peak_gpu_gb"), _p50_p95(c.get("gil_wait_ms")),
                           _util(c.get("gpu_util_pct")), _ar_steps(c.get("ar_steps")), _alloc(c.get("cuda_alloc")),
                           _pool(c.get("prefix_pool"))])
    parts = [head + "\n\n" + _md(
        ["setting", "req/s", "offered audio s/s", "achieved", "delivered (with drain)", "streams/offline", "TTFA p50 s",
         "TTFA p95 s", "TTFA p99 s", "inter-chunk p95 s", "streams with underrun", "underrun fraction", "stall s",
         "offline latency p95 s", "unfinished", "failed (shed)", "saturated"], rows)]
    if res_rows:
        parts.append("**Open loop: stage busy fraction, bucket hit rate per stage/mode, eager fallbacks, DiT frames**"
                     "\n\n" + _md(["setting", "req/s", "AR busy", "DiT busy", "HiFT busy"]
                                   + [f"hits {sm}" for sm in sms]
                                   + ["eager fallbacks", "DiT frames computed", "DiT frames reused", "compiles",
                                      "peak GB", "GIL wait p50 / p95 ms", "GPU util mean / p50 %",
                                      "AR rows/step, sampled in graph (held / paced s)",
                                      "alloc retries / cudaFree",
                                      "prefix pool: hops fallen back / planned, peak / budget GB"], res_rows))
    parts += _open_loop_table(
        cells, "host", lambda c: _host_row(c["host"]) + [_anatomy_cell(c.get("ar_steps"))],
        "**Open loop: the worker threads' host time inside their batches** (`StageClock.host_s`: wall and CPU seconds "
        "of each thread inside its spans as shares of the cell; blocked = (wall - CPU) / wall: waiting for the "
        "interpreter lock or descheduled — a CUDA wait spins, so it counts as CPU; the AR per decode step; every "
        "8th single step's anatomy: the runner call's host ms, the GPU span around it — its kernels and their waits "
        "for SMs —, the host ms after it: sampling, the wait for the ids, bookkeeping)",
        ["AR wall / CPU share", "AR blocked", "AR wall / CPU ms per step", "DiT wall / CPU share", "DiT blocked",
         "HiFT wall / CPU share", "HiFT blocked", "AR step, every 8th: runner call / its GPU span / after, ms"])
    parts += _open_loop_table(
        cells, "waits", lambda c: _waits_row(c.get("host") or {}, c["waits"]),
        "**Open loop: where the DiT and HiFT threads' time goes** (shares of the cell's wall time: inside their spans "
        "(`StageClock.host_s`, launching and bookkeeping); the DiT fence = waiting for its launched steps to complete "
        "on the GPU (`dit_steps_ahead`; a spin), the HiFT fence the same for its calls (`hift_calls_ahead`); idle = "
        "waiting for work; the rest of the thread's time is picking work and handing it on outside both)",
        ["DiT in spans", "DiT fence", "DiT idle", "HiFT in spans", "HiFT fence", "HiFT idle"])
    from .playback import TTFA_PARTS

    ttfa_rows = [[c.get("setting"), c.get("rate")]
                 + [_p50_p95((c.get("ttfa_parts") or {}).get(name)) for name, _, _ in TTFA_PARTS]
                 for c in cells if "error" not in c and c.get("ttfa_parts")]
    if ttfa_rows:
        parts.append("**Open loop: where time to first audio goes** (streams; p50 / p95 s, share of the summed TTFA): "
                     "text frontend, prompt features + LM input, admission (KV slot, AR loop), AR up to the first hop, "
                     "DiT queue wait, the first DiT job, vocoder + copy\n\n" + _md(["setting", "req/s"] + [name for name, _, _ in TTFA_PARTS], ttfa_rows))
    kinds = sorted({k for c in cells for k in (c.get("dit_calls") or {})})
    if kinds:
        parts.append("**Open loop: DiT calls per kind** (calls / rows per call; '/step': one Euler step per call)\n\n"
                     + _md(["setting", "req/s"] + kinds,
                           [[c.get("setting"), c.get("rate")]
                            + [_calls(((c.get("dit_calls") or {}).get(k))) for k in kinds]
                            for c in cells if "error" not in c]))
    hop_rows = [[c.get("setting"), c.get("rate")] + _hop_row(c["cached_hops"])
                for c in cells if "error" not in c and c.get("cached_hops")]
    if hop_rows:
        parts.append("**Open loop: cached-hop graphs** (estimator calls of prefix-cached hops: in a bucket / eager; "
                     "the buckets replayed; the call shapes requests x new frames x prefix frames; the shapes feed "
                     "`tools/coverage_profile.derive_cached_grid`)\n\n"
                     + _md(["setting", "req/s", "calls", "hit rate", "eager", "capture failed", "buckets replayed",
                            "distinct shapes", "most frequent shapes"], hop_rows))
    fb_rows = [[c.get("setting"), c.get("rate"), sum(c["fallback_shapes"].values()), len(c["fallback_shapes"]),
                _top(c["fallback_shapes"], 6)]
               for c in cells if "error" not in c and c.get("fallback_shapes")]
    if fb_rows:
        parts.append("**Open loop: eager fallbacks by call shape** (stage/mode rows,length: calls that no bucket "
                     "covered within the padding-waste limit — the shapes a profile for this traffic should add)\n\n"
                     + _md(["setting", "req/s", "eager calls", "distinct shapes", "most frequent"], fb_rows))
    kp_rows = [[c.get("setting"), c.get("rate")] + _kernel_row(c["kernel_profile"])
               for c in cells if "error" not in c and (c.get("kernel_profile") or {}).get("kernels")]
    if kp_rows:
        parts.append("**Open loop: GPU kernels in a profiled window** (torch.profiler / CUPTI, from the middle of the "
                     "arrivals: the share of the window with any kernel running, summed kernel time over that, each "
                     "launching thread's kernel-busy share and its heaviest kernels, the heaviest kernels overall)"
                     "\n\n" + _md(["setting", "req/s", "window s", "kernels", "device busy", "concurrency",
                                    "per thread: busy", "top kernels (ms)"], kp_rows))
    st_rows = [[c.get("setting"), c.get("rate"), thread, d.get("samples"), _shares(d.get("cosytrt")),
                _shares(d.get("leaf"))]
               for c in cells if "error" not in c for thread, d in sorted((c.get("stacks") or {}).items())]
    if st_rows:
        parts.append("**Open loop: where the worker threads' time goes** (`--sample-stacks`: every 5 ms each "
                     "cosytrt-* thread's innermost cosytrt frame and innermost frame, as shares of its samples; a "
                     "thread waiting for the interpreter lock shows at the line it runs next)\n\n"
                     + _md(["setting", "req/s", "thread", "samples", "top cosytrt frames", "top innermost frames"],
                           st_rows))
    setups = [s for s in ol.get("settings") or [] if s.get("scheduler_setup_s") is not None]
    if setups:
        names = sorted({k for s in setups for k in (s.get("scheduler_setup_parts_s") or {})})
        parts.append(f"**Open loop: set-up per setting** (pipeline: DiT / HiFT graphs "
                     f"{_num(ol.get('pipeline_setup_s'))} s; then per setting the scheduler, its parts, the rest being "
                     "the warm-up requests; GPU memory after it)\n\n"
                     + _md(["setting", "scheduler s"] + [f"{k} s" for k in names] + ["reserved GB", "allocated GB"],
                           [[s.get("label"), s["scheduler_setup_s"]]
                            + [(s.get("scheduler_setup_parts_s") or {}).get(k) for k in names]
                            + [s.get("gpu_reserved_gb"), s.get("gpu_allocated_gb")] for s in setups]))
    skipped = ol.get("ab_skipped") or []
    if skipped:
        parts.append("A/B: " + "; ".join(skipped))
    return "\n\n".join(parts)


def _num(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def _kernel_row(kp: dict) -> list:
    threads = "; ".join(f"{who} {100 * r['busy']:.0f} % ({r['top'][0][:40] if r['top'] else '-'})"
                        for who, r in kp["threads"].items())
    top = ", ".join(f"{k['name'][:40]} ({k['ms']:.0f})" for k in kp["top_kernels"][:4])
    return [kp["window_s"], kp["kernels"], f"{100 * kp['device_busy']:.0f} %", kp["concurrency"], threads, top]


def _top(counts: dict, k: int) -> str:
    """The k most frequent keys of `counts` as 'key (n)', most frequent first."""
    return ", ".join(f"{key} ({n})" for key, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:k])


def _failed(c: dict):
    """Failed requests of a cell, and those refused by load shedding (`shed_lag_s`) when there were any."""
    return f"{c.get('failed')} ({c['shed']} shed)" if c.get("shed") else c.get("failed")


def _host_row(host: dict) -> list:
    out = []
    for stage in ("ar", "dit", "hift"):
        h = host.get(stage)
        if not h:
            out += ["—", "—"] + (["—"] if stage == "ar" else [])
            continue
        out += [f"{h['wall_share']:.2f} / {h['cpu_share']:.2f}", f"{100 * h['blocked']:.0f} %"]
        if stage == "ar":
            out.append(f"{h['wall_ms_per_step']:.2f} / {h['cpu_ms_per_step']:.2f}" if "wall_ms_per_step" in h
                       else "—")
    return out


def _anatomy_cell(ar: dict | None) -> str:
    """A timed AR step's parts (`stage_clock.StepTimer`), ms: the runner call on the host, the GPU span from just
    before to just after it, the host after it."""
    a = (ar or {}).get("anatomy_ms")
    return f"{a['launch']:.2f} / {a['gpu']:.2f} / {a['rest']:.2f}" if a else "—"


def _open_loop_table(cells: list, key: str, row, title: str, columns: list) -> list[str]:
    """[one markdown part]: `title` over a table of the cells that have `key` (setting, req/s, then `row(cell)`
    under `columns`), or [] when none has it."""
    rows = [[c.get("setting"), c.get("rate")] + row(c) for c in cells if "error" not in c and c.get(key)]
    return [title + "\n\n" + _md(["setting", "req/s"] + columns, rows)] if rows else []


def _waits_row(host: dict, waits: dict) -> list:
    def share(d, key):
        v = (d.get(key) or {}).get("wall_share")
        return "—" if v is None else f"{v:.2f}"

    return [share(host, "dit"), share(waits, "dit_fence"), share(waits, "dit_idle"), share(host, "hift"),
            share(waits, "hift_fence"), share(waits, "hift_idle")]


def _hop_row(h: dict) -> list:
    calls = h.get("hits", 0) + h.get("misses", 0)
    shapes = h.get("shapes") or {}
    return [calls, h.get("hits", 0) / calls if calls else None, h.get("misses"), h.get("capture_failed"),
            len(h.get("replays") or {}), len(shapes), _top(shapes, 4)]


def _p50_p95(d) -> str:
    if not d or d.get("p50") is None:
        return "-"
    share = d.get("share")
    return f"{d['p50']:.3f} / {d['p95']:.3f}" + ("" if share is None else f" ({100 * share:.0f}%)")


def _shares(frames, top: int = 4) -> str:
    """[[where, share], ...] -> 'where 41 %; ...' for the first `top`."""
    return "; ".join(f"{w} {100 * x:.0f} %" for w, x in (frames or [])[:top]) or "-"


def _unfinished(c: dict):
    """Unfinished requests of a cell, with how many of them were still ahead of their listener when it ended
    (paced streams, or finals deferred by the slack-first DiT: not a backlog) and their audio not yet due then."""
    n, ahead = c.get("unfinished"), c.get("unfinished_ahead")
    if not (n and ahead):
        return n
    due = c.get("undelivered_ahead_s")
    return f"{n} ({ahead} ahead, {due:.0f} s to come)" if due else f"{n} ({ahead} ahead)"


def _short_drain(cells: list, max_s) -> str:
    """A caveat when a streaming cell's drain was shorter than its longest request: streams still producing at the
    cut (the slack-first DiT defers a stream's final until its listener nears it) are cut ahead of their listeners,
    so the window's achieved audio s/s trails offered by audio not yet due — read underruns and `saturated`."""
    short = sorted({c["drain_s"] for c in cells if c.get("streams") and c.get("drain_s") is not None
                    and max_s and c["drain_s"] < max_s})
    if not short:
        return ""
    return (f" The drain ({', '.join(f'{d:g}' for d in short)} s) is shorter than the longest request ({max_s:g} s): "
            "streams still producing at the cut end unfinished though ahead of their listeners, so achieved trails "
            "offered by the audio still to come; whether they would have kept ahead is not observed — read underruns, "
            "stalls and saturated.")


def _util(d) -> str:
    """GPU utilisation of a cell: mean / p50 %, '-' when not sampled."""
    if not d or not d.get("n"):
        return "-"
    return f"{d['mean']:.0f} / {d['p50']:.0f}"


def _ar_steps(d) -> str:
    """AR decode steps of a cell: rows per step, the share sampled inside the decode graphs ('-' before), the
    seconds of first-audio holds and pacing waits, the multi-step calls (`ar_decode_steps`)."""
    if not d or not d.get("decode_steps"):
        return "-"
    share, hold, pace = d.get("sampled_share"), d.get("first_audio_hold_s"), d.get("pace_wait_s")
    multi = d.get("multi_step_calls")
    return (f"{d['rows_per_step']:.2f}, " + ("-" if share is None else f"{100 * share:.0f} %")
            + (f", held {hold:.2f} s" if hold else "") + (f", paced {pace:.2f} s" if pace else "")
            + (f", {multi} multi-step calls" if multi else ""))


def _alloc(d) -> str:
    """The CUDA caching allocator's retries / cudaFree calls in a cell ('-' on CPU or before they were recorded)."""
    return "-" if not d else f"{d['num_alloc_retries']} / {d['num_device_free']}"


def _pool(d) -> str:
    """The flow prefix pool in a cell: hops that fell back (no room to commit) / hops planned against it, and its
    peak / budget GB so far ('-' without a pool or before it was recorded)."""
    if not d:
        return "-"
    planned = (d.get("cached_hops") or 0) + (d.get("whole_hops") or 0)
    gb = lambda b: "-" if b is None else f"{b / 1e9:.1f}"  # noqa: E731
    return f"{d.get('fallback_hops') or 0} / {planned}, {gb(d.get('peak_bytes'))} / {gb(d.get('budget_bytes'))}"


def _calls(d) -> str:
    return "-" if not d else f"{d['calls']} / {d['rows_per_call']:.2f}"


def open_loop_plot(res: dict, out_dir: str) -> str | None:
    """TTFA p50 / p95 / p99, the fraction of streams with an underrun and achieved throughput vs offered load, one
    line style per setting (e.g. a flag off: solid, on: dashed); legend below the panels, off the data."""
    cells = _open_cells(res)
    if not cells:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(dict.fromkeys(c.get("setting") for c in cells))
    if len({c.get("rate") for c in cells}) == 1 and len(settings) > 1:
        fig, axes = _open_loop_bars(plt, cells, settings)
    else:
        fig, axes = _open_loop_lines(plt, cells, settings)
    return _save(fig, out_dir, "bench_open_loop.png", res, axes, title="Open loop")


def _log_seconds_axis(ax) -> None:
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _open_loop_bars(plt, cells: list, settings: list):
    """One rate, several settings (an A/B at one load): grouped bars per setting, a line per rate would be a dot."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    by = {c.get("setting"): c for c in cells}
    xs = range(len(settings))
    for j, (q, color) in enumerate((("p50", "C0"), ("p95", "C1"), ("p99", "C3"))):
        axes[0].bar([x + (j - 1) * 0.27 for x in xs], [(by[s].get("ttfa") or {}).get(q) or 0 for s in settings],
                    0.27, color=color, label=f"TTFA {q}")
    axes[1].bar(xs, [by[s].get("underrun_fraction") or 0 for s in settings], 0.6, color="C4")
    axes[2].bar(xs, [by[s]["achieved_audio_s_per_s"] for s in settings], 0.6, color="C2", label="achieved")
    axes[2].axhline(cells[0]["offered_audio_s_per_s"], color="gray", linewidth=0.8, linestyle=":", label="offered")
    rate = cells[0].get("rate")
    axes[0].set(yscale="log", ylabel="time to first audio, s (log)", title=f"TTFA (streams), {rate:g} req/s")
    _log_seconds_axis(axes[0])
    axes[1].set(ylabel="fraction of streams", title="streams with a playback underrun", ylim=(0, 1.02))
    axes[2].set(ylabel="audio s/s", title="achieved vs offered")
    for ax in axes:
        ax.set_xticks(list(xs), [str(s).replace("+", "+\n") for s in settings], fontsize=7, rotation=20, ha="right")
    return fig, axes


def _open_loop_lines(plt, cells: list, settings: list):
    """A rate sweep: one line style per setting against offered load."""
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    top = 0.0
    for i, setting in enumerate(settings):
        pts = sorted((c for c in cells if c.get("setting") == setting), key=lambda c: c["offered_audio_s_per_s"])
        xs = [c["offered_audio_s_per_s"] for c in pts]
        top = max([top] + xs + [c["achieved_audio_s_per_s"] for c in pts])
        ls = styles[i % len(styles)]
        for q, color, marker in (("p50", "C0", "o"), ("p95", "C1", "s"), ("p99", "C3", "^")):
            ys = [(c.get("ttfa") or {}).get(q) for c in pts]
            axes[0].plot(xs, ys, ls, color=color, marker=marker, label=f"{setting}: TTFA {q}")
        axes[1].plot(xs, [c.get("underrun_fraction") for c in pts], ls, color=f"C{4 + i}", marker="o",
                     label=f"{setting}: streams with an underrun")
        axes[2].plot(xs, [c["achieved_audio_s_per_s"] for c in pts], ls, color=f"C{4 + i}", marker="o",
                     label=f"{setting}: achieved")
    axes[2].plot([0, top], [0, top], color="gray", linewidth=0.8, linestyle=":", label="achieved = offered")
    axes[0].set(yscale="log", xlabel="offered load, audio s/s", ylabel="time to first audio, s (log)",
                title="TTFA (streams)")
    _log_seconds_axis(axes[0])
    axes[1].set(xlabel="offered load, audio s/s", ylabel="fraction of streams", title="playback underruns",
                ylim=(-0.02, 1.02))
    axes[2].set(xlabel="offered load, audio s/s", ylabel="audio s/s", title="achieved vs offered")
    return fig, axes


def agent_tables(res: dict) -> str:
    """Voice-agent cells (agent.py): per server setting and session rate, sentence TTFA and avoidable stalls."""
    cells = (res.get("agent") or {}).get("cells") or []
    if not cells:
        return ""
    rows = [[c["setting"], c["rate"], f"{c['completed']} / {c['sessions']}", c["sentences"],
             _p50_p95(c.get("sentence_ttfa")), (c.get("sentence_ttfa") or {}).get("p99"),
             _p50_p95(c.get("first_sentence_ttfa")), f"{c['stalls']} in {c['stalled_sessions']}", c["stall_s"],
             c["text_bound_s"], c.get("audio_s_per_s"), c["failed"] + c["unfinished"],
             " / ".join(f"{(c.get('busy') or {}).get(k, 0):.2f}" for k in ("ar", "dit", "hift")) if c.get("busy")
             else "-", _p50_p95(c.get("gil_wait_ms"))] for c in cells]
    return ("### Voice-agent websocket sessions (sentence TTFA: first audio after the sentence's text was complete; "
            "avoidable stall: playback ran dry though the text of what came next was complete)\n\n" +
            _md(["setting", "sessions/s", "completed", "sentences", "sentence TTFA p50 / p95 s", "p99 s",
                 "first sentence TTFA p50 / p95 s", "avoidable stalls (sessions)", "stall s", "text-bound gap s",
                 "audio s/s", "failed + unfinished", "AR / DiT / HiFT busy", "GIL wait p50 / p95 ms"], rows))


def agent_plot(res: dict, out_dir: str) -> str | None:
    """Sentence TTFA p50 / p95 and avoidable stall seconds vs session rate, one line style per server setting."""
    cells = (res.get("agent") or {}).get("cells") or []
    if not cells:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, la in enumerate(dict.fromkeys(c["setting"] for c in cells)):
        pts = sorted((c for c in cells if c["setting"] == la), key=lambda c: c["rate"])
        xs = [c["rate"] for c in pts]
        ls = ["-", "--", ":", "-."][i % 4]
        for q, color in (("p50", "C0"), ("p95", "C1")):
            axes[0].plot(xs, [(c.get("sentence_ttfa") or {}).get(q) for c in pts], ls, color=color, marker="o",
                         label=f"{la}: sentence TTFA {q}")
        axes[1].plot(xs, [c["stall_s"] for c in pts], ls, color=f"C{3 + i}", marker="o",
                     label=f"{la}: avoidable stall s")
    axes[0].set(xlabel="sessions / s", ylabel="seconds", title="sentence time to first audio")
    axes[1].set(xlabel="sessions / s", ylabel="seconds (all sessions)", title="avoidable playback stalls")
    return _save(fig, out_dir, "bench_agent.png", res, axes, title="Voice-agent sessions")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cosytrt.tools.bench.report")
    ap.add_argument("results")
    ap.add_argument("--out", default=".")
    a = ap.parse_args(argv)
    with open(a.results) as f:
        res = json.load(f)
    os.makedirs(a.out, exist_ok=True)
    md = "\n\n".join(p for p in (tables(res), ratios(res), open_loop_tables(res), agent_tables(res)) if p)
    with open(os.path.join(a.out, "bench_tables.md"), "w") as f:
        f.write(md + "\n")
    written = plots(res, a.out)
    extra = [p for p in (open_loop_plot(res, a.out), agent_plot(res, a.out)) if p]
    for p in written + extra:
        print("wrote", p)
    print(format_table(["section"], [[k] for k in res]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
