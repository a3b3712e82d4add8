"""Coverage plots: the batch x length heatmap per stage/mode (calls, eager fallbacks, bucket outlines) and the
provenance title line every plot carries (engine set, backend, commit, device)."""
from __future__ import annotations

import math
import os
from collections import defaultdict

from ..engines.buckets import BucketTable


def plot_provenance(report: dict) -> str:
    """Title line of a plot: engine set, backend, cosytrt commit and the device (GPU name on CUDA)."""
    import subprocess

    commit = "unknown commit"
    try:
        here = os.path.dirname(os.path.realpath(__file__))
        commit = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                timeout=5).stdout.strip() or commit
    except (OSError, subprocess.SubprocessError):
        pass
    if report.get("simulated"):
        return f"{report.get('engines', '?')}, shape-only simulation (no GPU), cosytrt {commit}"
    device = str(report.get("device", "cpu"))
    if device.startswith("cuda"):
        try:
            import torch

            device = f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
        except Exception:  # noqa: BLE001 - a title never fails the report
            pass
    return (f"engine set {os.path.basename(os.path.normpath(str(report.get('engines', '?'))))} "
            f"({report.get('backend', '?')}), cosytrt {commit}, {device}")


def write_heatmap(report: dict, tables: dict[tuple[str, str], BucketTable], path: str, bins: int = 24) -> str:
    """batch x length grid per stage/mode, coloured by calls (log scale); cells with eager fallbacks marked with a
    red x; each bucket's coverage outlined."""
    from cosytrt.extras import require

    matplotlib = require("matplotlib", "plot", "the coverage heatmap (--out)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import LogNorm
    from matplotlib.patches import Rectangle

    by_sm: dict[str, list[dict]] = defaultdict(list)
    for s in report["shapes"]:
        by_sm[s["stage_mode"]].append(s)
    panels = [sm for sm in sorted(by_sm)] or ["(no calls)"]
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 2.2 + 1.6 * len(panels)), squeeze=False)
    for ax, sm in zip(axes[:, 0], panels):
        rows = by_sm.get(sm, [])
        if not rows:
            ax.set_title(f"{sm}: no calls")
            ax.axis("off")
            continue
        stage, mode = sm.split("/")
        table = tables.get((stage, mode))
        bucket_lengths = [bk.length for bk in table] if table is not None else []
        batches = sorted({r["b"] for r in rows} | ({bk.batch for bk in table} if table is not None else set()))
        top = max([r["n"] for r in rows] + bucket_lengths)
        width = max(1, math.ceil(top / bins))
        nb = math.ceil(top / width) + 1
        grid = np.zeros((len(batches), nb))
        fallback = np.zeros_like(grid, dtype=bool)
        for r in rows:
            i, j = batches.index(r["b"]), r["n"] // width
            grid[i, j] += r["calls"]
            if r["bucket"] is None:
                fallback[i, j] = True
        masked = np.ma.masked_where(grid == 0, grid)
        vmax = max(10.0, float(grid.max()))
        im = ax.imshow(masked, aspect="auto", origin="lower", cmap="viridis", norm=LogNorm(vmin=1, vmax=vmax),
                       extent=(0, nb * width, -0.5, len(batches) - 0.5), interpolation="nearest")
        ys, xs = np.nonzero(fallback)
        if len(xs):
            ax.scatter((xs + 0.5) * width, ys, marker="x", color="red", s=50, label="eager fallback")
        for bk in (table or []):  # what each bucket covers: batch <= B, length <= L (min_length.. if dynamic)
            top_row = max(i for i, b in enumerate(batches) if b <= bk.batch)
            lo = bk.min_length if bk.dynamic else 0
            ax.add_patch(Rectangle((lo, -0.5), bk.length - lo, top_row + 1, fill=False, edgecolor="gray",
                                   linewidth=0.8, linestyle="--"))
        ax.set_yticks(range(len(batches)))
        ax.set_yticklabels([str(b) for b in batches])
        ax.set_ylabel("batch (rows)")
        ax.set_xlabel("length (frames); dashed outlines: buckets (batch <= B, length <= L)")
        st = report["stages"].get(sm, {})
        ax.set_title(f"{sm}: {st.get('calls', 0)} calls, {st.get('fallbacks', 0)} eager fallbacks")
        fig.colorbar(im, ax=ax, label="calls")
    fig.suptitle(plot_provenance(report), fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    handles = [h for ax in axes[:, 0] for h in ax.get_legend_handles_labels()[0]][:1]
    if handles:  # one legend for the figure, under the panels: it covers no cell and no colour bar
        fig.legend(handles, ["eager fallback"], loc="upper center", bbox_to_anchor=(0.5, 0.0), fontsize=8,
                   frameon=False)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def write_hit_rate_plot(comparison: dict[str, dict], path: str, title: str) -> str:
    """Grouped bars: bucket hit rate per stage/mode (categories, evenly spaced) for each profile of `comparison`
    ({label: hit_rates dict}); the legend sits outside the axes."""
    from cosytrt.extras import require

    matplotlib = require("matplotlib", "plot", "the hit-rate plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(comparison)
    cats = sorted({k for hr in comparison.values() for k in hr})
    cats = [c for c in cats if c != "total"] + ["total"]
    width = 0.8 / max(1, len(labels))
    fig, ax = plt.subplots(figsize=(2.0 + 1.6 * len(cats), 4.2))
    for i, lab in enumerate(labels):
        hr = comparison[lab]
        xs = [j + (i - (len(labels) - 1) / 2) * width for j in range(len(cats))]
        ys = [100 * hr[c]["hit_rate"] if c in hr and hr[c]["calls"] else 0.0 for c in cats]
        bars = ax.bar(xs, ys, width, label=lab)
        ax.bar_label(bars, fmt="%.0f", fontsize=7, padding=1)
    ax.set_xticks(range(len(cats)))
    ax.set_xticklabels([f"{c}\n({comparison[labels[0]].get(c, {}).get('calls', 0)} calls)" for c in cats], fontsize=8)
    ax.set_ylim(0, 110)
    ax.set_ylabel("bucket hit rate (%)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0.0)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
