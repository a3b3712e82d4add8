"""Does confining the DiT-sized work to a CUDA green context (an SM partition) keep the AR's decode step fast beside it?
(~1 minute on a GPU, no model: a probe before any scheduler change.)

Why: in run 66 (H100, 12 req/s of mixed streams, compiled) the AR thread was 97 % busy at 5.8 ms per decode step of
~15 rows, while the same step alone takes ~1.2-1.9 ms (runs 11, 43): its small kernels wait for SMs that the DiT's and
the vocoder's large kernels hold, even on a highest-priority stream (priority orders the blocks waiting to start, it
does not take SMs back). A green context gives a stream a set of SMs that other green contexts cannot use; with the
DiT / HiFT streams in one of (all SMs - N), N SMs stay free for the AR.

What it runs: an "AR step" — 24 layers of [rows, 896] x [896, 4864] and [rows, 4864] x [4864, 896] bf16 matmuls (the
0.5B LM's MLP weight bytes, ~0.6 GB a step) captured in one CUDA graph on a high-priority stream — timed by CUDA events
(a) alone, (b) beside a "DiT load" (a queue of [8192, 4096] x [4096, 4096] bf16 matmuls on another stream) and (c)
with that load on a green-context stream of (SMs - N) SMs for several N; and the load's TFLOP/s in each, so the cost
to the DiT shows too. torch's green-context API changed between releases (2.10: `create(num_sms, device_id)` with
`set_context` / `pop_context`, a stream of the context current in between; later: `.Stream()`, a stream of the
context from `cuGreenCtxStreamCreate`): `.Stream()` first, and the table says which ran or why none did. Whether the
confinement holds shows in the numbers (a stream outside the context would leave the AR as slow as beside the
plain-stream load).

  usage (GPU machine): python3 benchmarks/green_ctx_probe.py [OUT.md] [--rows 16] [--reserve 8,16,32]
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from cosytrt.tools.table import emit

HIDDEN, FFN, LAYERS = 896, 4864, 24


def green_stream(sms: int):
    """(a stream whose kernels run on `sms` SMs of a new green context, how it was made) or (None, why not)."""
    try:
        from torch.cuda.green_contexts import GreenContext
    except Exception as e:  # noqa: BLE001 - an older torch, a build without it
        return None, f"no torch.cuda.green_contexts: {type(e).__name__}: {e}"
    errors = []
    try:  # 2.12+: keyword arguments, the context's own Stream()
        ctx = GreenContext.create(num_sms=sms, device_id=torch.cuda.current_device())
        if hasattr(ctx, "Stream"):
            return (ctx, ctx.Stream()), "GreenContext.create(num_sms=...).Stream()"
    except Exception as e:  # noqa: BLE001
        errors.append(f"keyword create: {type(e).__name__}: {e}")
    try:  # older: no Stream(); set_context makes a stream of the context current (torch.cuda.Stream() would come
        # from torch's stream pool, made in the primary context: not confined), so take that one
        ctx = GreenContext.create(sms, torch.cuda.current_device())
        ctx.set_context()
        try:
            stream = torch.cuda.current_stream()
        finally:
            ctx.pop_context()
        return (ctx, stream), "GreenContext.create(num_sms, device) + set_context / current_stream / pop_context"
    except Exception as e:  # noqa: BLE001
        errors.append(f"positional create: {type(e).__name__}: {e}")
    return None, "; ".join(errors)[:600]


def ar_graph(rows: int):
    """The AR-like step in a CUDA graph on a highest-priority stream: (replay fn, its stream)."""
    w1 = [torch.randn(HIDDEN, FFN, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
    w2 = [torch.randn(FFN, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
    x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream(priority=-100)

    def step():
        h = x
        for a, b in zip(w1, w2):
            h = h + (h @ a).relu() @ b
        return h

    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
        stream.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            step()
    g.inputs = (w1, w2, x)  # the graph reads them: kept alive with it (the replay method holds g)
    return g.replay, stream


LOAD_GRAPH_OPS = 50  # matmuls per load graph (`load_graph`)


def load_graph(capture_stream):
    """The load as the scheduler's DiT runs: matmuls in a CUDA graph captured on `capture_stream` (a plain stream,
    as the scheduler captures its graphs today, or the green one); returns the graph (replay it)."""
    a = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    with torch.cuda.stream(capture_stream):
        torch.mm(a, b)
        capture_stream.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=capture_stream):
            for _ in range(LOAD_GRAPH_OPS):
                torch.mm(a, b)
    torch.cuda.synchronize()
    g.inputs = (a, b)  # the graph reads them: kept alive with it
    return g


def ar_steps(replay, stream, until=None, steps: int = 200) -> float:
    """ms per AR step, each replayed and waited for (as the AR worker waits for its sampled ids): `steps` of them, or
    with `until` (the load's end event) as many as run before the load ends — so every step counted ran beside it."""
    n, t0 = 0, time.perf_counter()
    with torch.cuda.stream(stream):
        while (n < steps) if until is None else (not until.query() and n < 20000):
            replay()
            stream.synchronize()
            n += 1
    return (time.perf_counter() - t0) * 1e3 / max(1, n)


def run_case(replay, ar_stream, load_stream, load_ops: int = 2000, graph=None) -> tuple[float, float | None]:
    """(AR ms per step while the load runs, load TFLOP/s or None): the load queued on `load_stream` first (None: no
    load); `graph`: the load as replays of that CUDA graph (`load_graph`) instead of eager matmuls."""
    if load_stream is None:
        return ar_steps(replay, ar_stream), None
    a = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    with torch.cuda.stream(load_stream):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(load_stream)
        if graph is not None:
            for _ in range(load_ops // LOAD_GRAPH_OPS):
                graph.replay()
        else:
            for _ in range(load_ops):
                torch.mm(a, b)
        end.record(load_stream)
    time.sleep(0.02)  # the load's first kernels are running
    ms = ar_steps(replay, ar_stream, until=end)
    end.synchronize()
    tflops = load_ops * 2 * 8192 * 4096 * 4096 / (start.elapsed_time(end) / 1e3) / 1e12
    return ms, tflops


def graphs_on(stream) -> list[str]:
    """Can the DiT's CUDA graphs move into the green context: a graph captured as the scheduler captures them (on the
    primary context) replayed on the green stream, and one captured on the green stream itself, each checked
    against eager."""
    x = torch.randn(64, 256, device="cuda")
    w = torch.randn(256, 256, device="cuda")
    want = (x @ w).relu()
    out = []
    for name in ("captured on a plain stream, replayed on the green one", "captured and replayed on the green one"):
        try:
            cap = torch.cuda.Stream() if name.startswith("captured on a plain") else stream
            with torch.cuda.stream(cap):
                (x @ w).relu()
                cap.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, stream=cap):
                    y = (x @ w).relu()
            with torch.cuda.stream(stream):
                y.zero_()
                g.replay()
            stream.synchronize()
            out.append(f"{name}: {'ok' if torch.allclose(y, want, atol=1e-3) else 'WRONG VALUES'}")
        except Exception as e:  # noqa: BLE001 - what the driver says is the answer
            out.append(f"{name}: {type(e).__name__}: {e}"[:300])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default=None)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--reserve", default="8,16,32", help="SMs kept out of the load's green context")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no GPU: nothing to probe")
        return 0
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    replay, ar_stream = ar_graph(args.rows)
    lines = [f"{torch.cuda.get_device_name(0)}, {sms} SMs, torch {torch.__version__}, AR-like step of {args.rows} rows",
             "", "| setting | AR ms per step (beside the load: only steps that ran while it ran) | load TFLOP/s |",
             "|---|---|---|"]

    def row(name, ms, tf):
        lines.append(f"| {name} | {ms:.3f} | {'—' if tf is None else f'{tf:.0f}'} |")
        print(lines[-1], flush=True)

    row("AR alone", *run_case(replay, ar_stream, None))
    row("AR beside the load (a plain stream)", *run_case(replay, ar_stream, torch.cuda.Stream()))
    plain = torch.cuda.Stream()
    row("AR beside the load as a CUDA graph (a plain stream)", *run_case(replay, ar_stream, plain, graph=load_graph(plain)))
    for n in (int(v) for v in args.reserve.split(",")):
        made, how = green_stream(sms - n)
        if made is None:
            lines.append(f"| load in a green context of {sms - n} SMs | not run: {how} | |")
            print(lines[-1], flush=True)
            break
        _ctx, stream = made
        if n == int(args.reserve.split(",")[0]):
            for line in graphs_on(stream):
                lines.append(f"| CUDA graph {line} | | |")
                print(lines[-1], flush=True)
        cases = [("", lambda: None)]
        if n == int(args.reserve.split(",")[0]):  # the DiT's form: its CUDA graphs, captured off or on the context
            cases += [(", as a CUDA graph captured on a plain stream", lambda: load_graph(torch.cuda.Stream())),
                      (", as a CUDA graph captured on the green stream", lambda: load_graph(stream))]
        for what, graph in cases:
            try:
                row(f"load in a green context of {sms - n} SMs ({n} kept for the AR; {how}){what}",
                    *run_case(replay, ar_stream, stream, graph=graph()))
            except Exception as e:  # noqa: BLE001 - shown, the probe goes on
                lines.append(f"| load in a green context of {sms - n} SMs{what} | failed: {type(e).__name__}: {e} |"[:400])
                print(lines[-1], flush=True)
    emit("\n".join(lines), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
