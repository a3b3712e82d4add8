"""Turn a `trtbuild bench` results.json into markdown tables and PNG plots.

    python -m cosytrt.tools.bench_report RESULTS.json --out DIR   # writes DIR/bench_tables.md, DIR/*.png
"""
from __future__ import annotations

import argparse
import json
import os

from .table import format_table


def _md(headers, rows) -> str:
    def cell(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return "—" if v is None else str(v)

    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def tables(res: dict) -> str:
    parts = []
    if isinstance(res.get("ar"), list):
        rows = [[r["batch"], r.get("tokens", ""), r["eager_ms"], r.get("graph_ms"), r.get("bound_ms"),
                 r.get("graph_fraction_of_bound")] for r in res["ar"]]
        parts.append("**AR (Qwen2 0.5B, bf16)** — decode ms per step (KV length 1024, 300 positions filled) and "
                     "prefill\n\n" + _md(["batch", "prefill tokens", "eager ms", "CUDA graph ms", "HBM bound ms",
                                          "bound / graph"], rows))
    if isinstance(res.get("dit"), list):
        rows = [["stream" if r["streaming"] else "offline", r["rows"], r["frames"], r["eager_ms"], r["graph_ms"],
                 r["eager_ms"] / r["graph_ms"], r["bound_ms"], r["graph_fraction_of_bound"]] for r in res["dit"]]
        parts.append("**DiT estimator (bf16), one forward = one Euler step**\n\n" + _md(
            ["mask", "CFG rows", "frames", "eager ms", "CUDA graph ms", "eager / graph", "roofline ms",
             "bound / graph"], rows))
    if isinstance(res.get("hift"), list):
        rows = [[r["batch"], r["frames"], r["eager_ms"], r.get("graph_ms"), r["ms_per_audio_s"]] for r in res["hift"]]
        parts.append("**HiFT (fp32, f0 predictor fp64), finalize**\n\n" + _md(
            ["batch", "mel frames", "eager ms", "CUDA graph ms", "ms per audio second"], rows))
    if isinstance(res.get("e2e"), list):
        rows = [["stream" if r["stream"] else "offline", r["audio_target_s"], r["ttfa"], r["total"], r["rtf"],
                 r["T_AR"], r["T_DiT"], r["T_vocoder"]] for r in res["e2e"]]
        parts.append("**Single request end to end (eager pipeline, c1)**\n\n" + _md(
            ["mode", "audio s", "TTFA s", "total s", "RTF", "T_AR", "T_DiT", "T_vocoder"], rows))
    srv = res.get("serving")
    if isinstance(srv, dict) and srv.get("cells"):
        rows = []
        for r in srv["cells"]:
            if "error" in r:
                rows.append([r.get("variant"), *r.get("cell", []), "error: " + r["error"][:60]])
                continue
            rows.append([r["variant"], r["text"], r["concurrency"], "stream" if r["stream"] else "offline",
                         "yes" if r["reference_audio"] else "no", r["ttfa"]["p50"], r["ttfa"]["p95"], r["ttfa"]["p99"],
                         r["inter_chunk"]["p50"], r["rtf"]["p50"], r["rtf"]["p95"], r["throughput_audio_s_per_s"],
                         r["T_AR"], r["T_DiT"], r["T_vocoder"], r["T_queue"], r["peak_gpu_gb"]])
        parts.append("**Serving matrix (scheduler; full-size architecture, random weights, forced token counts)**\n\n"
                     + _md(["variant", "text", "conc.", "mode", "ref audio", "TTFA p50", "TTFA p95", "TTFA p99",
                            "inter-chunk p50", "RTF p50", "RTF p95", "audio s/s", "T_AR", "T_DiT", "T_vocoder",
                            "T_queue", "peak GB"], rows))
    return "\n\n".join(parts)


def plots(res: dict, out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    srv = res.get("serving")
    cells = [c for c in (srv or {}).get("cells", []) if "error" not in c]
    if cells:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for (variant, text, stream), style in zip(sorted({(c["variant"], c["text"], c["stream"]) for c in cells}),
                                                  ["o-", "s-", "^-", "v-", "d-", "x-", "*-", "+-"]):
            pts = sorted((c["concurrency"], c) for c in cells if (c["variant"], c["text"], c["stream"]) ==
                         (variant, text, stream) and not c["reference_audio"])
            if not pts:
                continue
            label = f"{variant} {text} {'stream' if stream else 'offline'}"
            axes[0].plot([p[0] for p in pts], [p[1]["rtf"]["p50"] for p in pts], style, label=label)
            axes[1].plot([p[0] for p in pts], [p[1]["throughput_audio_s_per_s"] for p in pts], style, label=label)
        axes[0].set(xscale="log", xlabel="concurrency", ylabel="RTF p50", title="RTF vs concurrency")
        axes[1].set(xscale="log", xlabel="concurrency", ylabel="audio seconds per second", title="throughput")
        axes[1].legend(fontsize=7)
        fig.tight_layout()
        p = os.path.join(out_dir, "bench_serving.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)
    if isinstance(res.get("dit"), list):
        fig, ax = plt.subplots(figsize=(6, 4))
        rows = [r for r in res["dit"] if not r["streaming"]]
        labels = [f"{r['rows']}x{r['frames']}" for r in rows]
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r["eager_ms"] for r in rows], 0.4, label="eager")
        ax.bar([i + 0.2 for i in x], [r["graph_ms"] for r in rows], 0.4, label="CUDA graph")
        ax.plot(list(x), [r["bound_ms"] for r in rows], "k_", markersize=20, label="roofline")
        ax.set_xticks(list(x), labels)
        ax.set(ylabel="ms per DiT forward", title="DiT (offline mask), H200 bf16")
        ax.legend()
        fig.tight_layout()
        p = os.path.join(out_dir, "bench_dit.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)
    return written


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("results")
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    with open(a.results) as f:
        res = json.load(f)
    os.makedirs(a.out, exist_ok=True)
    md = tables(res)
    with open(os.path.join(a.out, "bench_tables.md"), "w") as f:
        f.write(md + "\n")
    for p in plots(res, a.out):
        print("wrote", p)
    print(format_table(["section"], [[k] for k in res]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
