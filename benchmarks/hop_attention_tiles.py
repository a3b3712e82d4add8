"""The paged prefix attention alone on a GPU, per tile, against the gathered form (~1 minute, no compile).

Run 66 (H100, compiled cached-hop step at 8 requests x 200 new frames over 1500 cached): the kernel took 3.8 ms of an
8.5 ms Euler step (22 calls, 64 x 64 tiles, 4 warps) where cuDNN's flash SDPA over the gathered prefix took 3.15 ms
plus 1.84 ms of gather (run 65). This times `hop_attention.triton_attention` for several tiles (new frames per
program x keys per step x warps) and the gathered form (the store rows gathered, then SDPA under the DiT's mask), one
layer's call with the full-size DiT's 16 heads of 64 on the page store's row layout (pages of 50 frames, each
request's pages scattered), and checks each tile's values against the gathered form.

  usage (GPU machine): python3 benchmarks/hop_attention_tiles.py [OUT.md] [--tiles 64x64x4,64x128x4,...]
Prints a markdown table: µs per call per case and tile, and the max abs difference from the gathered form.
"""
from __future__ import annotations

import argparse
import sys

import torch

from cosytrt.runtime.models import hop_attention as ha
from cosytrt.tools.bench.timing import time_cuda
from cosytrt.tools.table import emit

HEADS, HD, CHUNK, STEPS = 16, 64, 50, 10
CASES = [(1, 100, 200), (8, 100, 200), (8, 200, 1500), (16, 200, 800), (4, 100, 1950)]  # requests, new, prefix
TILES = "64x64x4,64x128x4,64x128x8,128x64x8,128x128x8,32x64x4,64x32x4"


def case(requests: int, new: int, prefix: int, dtype=torch.bfloat16, device="cuda", seed=0):
    """Queries / new K / V for 2 x requests CFG rows, a store of pages and each row's row table (frame p of CFG row
    c at Euler step s of a page g: ((g x steps + s) x 2 + c) x 50 + p % 50, as PageStore lays them out)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    B, D = 2 * requests, HEADS * HD
    pages_per = -(-prefix // CHUNK)
    pages = requests * pages_per + 2
    q, kn, vn = (torch.randn(B, new, D, generator=g).to(device, dtype) for _ in range(3))
    store_rows = pages * STEPS * 2 * CHUNK
    sk, sv = (torch.randn(store_rows, D, generator=g).to(device, dtype) for _ in range(2))
    perm = torch.randperm(pages - 2, generator=g) + 2
    rows = torch.empty(B, prefix, dtype=torch.long)
    p = torch.arange(prefix)
    step = 3
    for b in range(B):
        req, cfg = b // 2, b % 2
        own = perm[req * pages_per:(req + 1) * pages_per]
        rows[b] = ((own[p // CHUNK] * STEPS + step) * 2 + cfg) * CHUNK + p % CHUNK
    plen = torch.full((B,), prefix, dtype=torch.long)
    nvalid = torch.full((B,), new, dtype=torch.long)
    return [t.to(device) for t in (q, kn, vn, sk, sv, rows, plen, nvalid)]


def time_us(fn) -> float:
    return time_cuda(fn, reps=50, warmup=3) * 1000  # median µs per call


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default=None)
    ap.add_argument("--tiles", default=TILES)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no GPU: nothing to time")
        return 0
    tiles = [ha._tiles(t) for t in args.tiles.split(",")]
    head = ["requests x new, prefix", "gathered SDPA µs"] + [f"{bm}x{bn}x{w} µs" for bm, bn, w in tiles] + \
        ["best / gathered", "max abs vs gathered (worst tile)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for requests, new, prefix in CASES:
        q, kn, vn, sk, sv, rows, plen, nvalid = case(requests, new, prefix)
        ref = ha.reference(q, kn, vn, sk, sv, rows, plen, nvalid, HEADS, CHUNK)
        gathered = time_us(lambda: ha.reference(q, kn, vn, sk, sv, rows, plen, nvalid, HEADS, CHUNK))
        cells, worst = [], 0.0
        for bm, bn, w in tiles:
            try:
                out = ha.triton_attention(q, kn, vn, sk, sv, rows, plen, nvalid, HEADS, CHUNK, bm, bn, w)
                worst = max(worst, (out.float() - ref.float()).abs().max().item())
                cells.append(time_us(lambda: ha.triton_attention(q, kn, vn, sk, sv, rows, plen, nvalid, HEADS,
                                                                 CHUNK, bm, bn, w)))
            except Exception as e:  # noqa: BLE001 - a tile the compiler refuses (shared memory): shown, not fatal
                print(f"tile {bm}x{bn}x{w} at {requests}x{new},{prefix}: {type(e).__name__}: {e}"[:300],
                      file=sys.stderr)
                cells.append(float("nan"))
        best = min((c for c in cells if c == c), default=float("nan"))
        row = [f"{requests} x {new}, {prefix}", f"{gathered:.1f}"] + [f"{c:.1f}" for c in cells] + \
            [f"{best / gathered:.2f}", f"{worst:.3g}"]
        lines.append("| " + " | ".join(row) + " |")
        print(lines[-1], flush=True)
    emit("\n".join(lines), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
