"""The cached-hop step's prefix gather (`torch.index_select(store.k, 1, idx, out=k_all)`, runtime/stages/
flow_hop_calls.py) with 2-byte elements (bf16, as before session 24) against 8-byte words (`flow_hop_calls.wide`:
an int64 view, the same bits): µs per gather at the page-store and prefix sizes of the cached hops, and whether the
results are bit-identical. Run 64's profile had the 2-byte gather at ~30 % of a long-prefix step's kernels.

    python benchmarks/gather_width_check.py [--device cpu]      (CPU: a smoke run at small sizes)
"""
from __future__ import annotations

import argparse
import sys

import torch


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args(argv)
    from cosytrt.runtime.stages.flow_hop_calls import wide
    from cosytrt.tools.bench.timing import time_cuda

    cuda = a.device == "cuda"
    dev = torch.device(a.device)
    depth, d, store_rows = (22, 1024, 60000) if cuda else (2, 128, 4000)
    store = torch.randn(depth, store_rows, d, device=dev, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    print(f"| rows gathered (CFG rows x frames) | 2-byte µs | 8-byte µs | 8-byte / 2-byte | bit-identical |")
    print("|---|---|---|---|---|")
    for rows, frames in ((2, 300), (16, 300), (16, 900), (16, 1700)) if cuda else ((2, 30),):
        n = rows * frames
        idx = torch.randint(0, store_rows, (n,), generator=g).to(dev)
        out_n = torch.empty(depth, n, d, device=dev, dtype=torch.bfloat16)
        out_w = torch.empty_like(out_n)
        narrow = lambda: torch.index_select(store, 1, idx, out=out_n)  # noqa: E731
        wide_ = lambda: torch.index_select(wide(store), 1, idx, out=wide(out_w))  # noqa: E731
        narrow()
        wide_()
        same = torch.equal(out_n, out_w)
        if cuda:
            us_n, us_w = 1e3 * time_cuda(narrow, reps=20), 1e3 * time_cuda(wide_, reps=20)
            print(f"| {rows} x {frames} | {us_n:.0f} | {us_w:.0f} | {us_w / us_n:.2f} | {same} |", flush=True)
        else:
            print(f"| {rows} x {frames} | - | - | - | {same} |")


if __name__ == "__main__":
    sys.exit(main())
