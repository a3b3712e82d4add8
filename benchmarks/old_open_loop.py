"""An open-loop cell for an OLD cosytrt wheel that predates `trtbuild bench --suite open_loop` (issue #18's baseline:
the 40 s stream target is "≥ 2.5x the saturation throughput of c5f2d40"). The old wheel builds the pipeline the way
its own serving bench did (`tools/bench.full_models`: the full-size architecture with seeded random weights, bf16;
`tools/bench_serving.make_pipeline` + `scheduler_config` + `_start`: the compiled variant over a graph profile, the
built-in saved voice); this script then submits the arrivals that HEAD's workload generator made for the same cell
(a JSON list: index, t, tokens, stream, seed) at their times from a timer thread, as HEAD's `open_loop.drive` does,
and summarises the cell with HEAD's own `tools/bench/playback.py` (TTFA p50 / p95 / p99, underruns, stall seconds,
achieved audio s/s, `saturated`), loaded from this checkout by path (it imports only the standard library).

    PYTHONPATH=/tmp/site_old python3 benchmarks/old_open_loop.py ARRIVALS.json OUT.json \
        [--duration-s 24] [--drain-s 42] [--variant compiled] [--graph-profile h200-graphs]

ARRIVALS.json: {"rate": r, "arrivals": [...]} or a list of such cells (run one after the other on one pipeline).
Used by benchmarks/old_new_long.sh. A measuring tool: no test checks its numbers (tests/test_old_open_loop.py checks
its driving and summary on a fake TTS)."""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PLAYBACK = os.path.join(HERE, "..", "tools", "bench", "playback.py")
TEXT = "a" * 40  # what the old serving bench sent: the forced token count sets the audio length


def load_playback():
    """HEAD's playback summary (standard library only), whatever `cosytrt` the interpreter imports."""
    spec = importlib.util.spec_from_file_location("cosytrt_head_playback", PLAYBACK)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look the module up while building the classes
    spec.loader.exec_module(mod)
    return mod


def drive(tts, arrivals: list[dict], duration_s: float, drain_s: float, make_request, pb) -> tuple[list, float]:
    """Submit each arrival at its time; wait for all until duration_s + drain_s, cancel what is left; returns
    (HEAD RequestRecords, the cell's end in seconds after its start)."""
    handles: list = [None] * len(arrivals)
    errors: list = [None] * len(arrivals)
    stop = threading.Event()
    t0 = time.perf_counter() + 0.02

    def timer():
        for i, a in enumerate(arrivals):
            if stop.wait(max(0.0, t0 + a["t"] - time.perf_counter())):
                return
            try:
                handles[i] = tts.submit(make_request(a))
            except Exception as e:  # noqa: BLE001 - a refused request is a failed request of the cell
                errors[i] = f"{type(e).__name__}: {e}"

    th = threading.Thread(target=timer, name="old-bench-arrivals", daemon=True)
    th.start()
    deadline = t0 + duration_s + drain_s
    th.join(max(0.0, deadline - time.perf_counter()))
    stop.set()
    cut = pb.wait_or_cancel(handles, deadline)
    th.join()
    end = time.perf_counter() - t0
    records = []
    for i, a in enumerate(arrivals):
        rec = pb.RequestRecord(a["t"], a["tokens"] / 25.0, bool(a["stream"]))
        h = handles[i]
        if h is None:
            rec.status, rec.error = (pb.FAILED, errors[i]) if errors[i] else (pb.NOT_SUBMITTED, None)
            records.append(rec)
            continue
        sizes = []
        try:
            for c in h.chunks(timeout=1.0):
                sizes.append(c.size)
        except Exception as e:  # noqa: BLE001 - failed or cancelled: keep what it delivered
            rec.error = f"{type(e).__name__}: {e}"
        m = h.metrics
        times = list(m.chunk_times)
        n = min(len(times), len(sizes))
        rec.chunk_t = [m.t_submit + x - t0 for x in times[:n]]
        rec.chunk_s = [s / tts.sample_rate for s in sizes[:n]]
        rec.ttfa_s = m.ttfa
        failed = getattr(h, "error", None) is not None or rec.error is not None
        rec.status = (pb.UNFINISHED if i in cut else pb.FAILED) if failed else pb.OK
        records.append(rec)
    return records, end


def old_tts(variant: str, graph_profile: str):
    """The old wheel's serving-bench pipeline and TTS (compiled variant: torch.compile + CUDA graphs at start)."""
    import torch
    from cosytrt.runtime.model import CosyVoice3Models
    from cosytrt.tools.bench import full_models
    from cosytrt.tools.bench_serving import _start, make_pipeline, scheduler_config

    cfg, llm, flow, hift = full_models("cuda" if torch.cuda.is_available() else "cpu", torch.bfloat16)
    models = CosyVoice3Models(cfg, llm, flow, hift, "random-full", "", "random")
    pipe = make_pipeline(models, variant, graph_profile)
    return _start(pipe, scheduler_config(variant))


def old_request(a: dict):
    from cosytrt.runtime.request import Request
    from cosytrt.runtime.sampling import SamplingParams

    return Request(text=TEXT, stream=bool(a["stream"]), sampling=SamplingParams(seed=a["seed"], force_tokens=a["tokens"]))


def run_cells(tts, cells: list[dict], duration_s: float, drain_s: float, make_request, pb, log=print) -> list[dict]:
    out = []
    for cell in cells:
        t = time.perf_counter()
        records, end = drive(tts, cell["arrivals"], duration_s, drain_s, make_request, pb)
        s = pb.summarize(records, duration_s, end)
        s.update(rate=cell["rate"], duration_s=duration_s, cell_s=time.perf_counter() - t)
        s["saturated"] = pb.saturated(s)
        s["records"] = [dataclasses.asdict(r) for r in records]
        out.append(s)
        log(f"rate {cell['rate']}: " + json.dumps({k: v for k, v in s.items() if k != "records"}, default=str)[:1500])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("arrivals")
    p.add_argument("out")
    p.add_argument("--duration-s", type=float, default=24.0)
    p.add_argument("--drain-s", type=float, default=42.0)
    p.add_argument("--variant", default="compiled")
    p.add_argument("--graph-profile", default="h200-graphs")
    a = p.parse_args(argv)
    with open(a.arrivals) as f:
        cells = json.load(f)
    cells = cells if isinstance(cells, list) else [cells]
    pb = load_playback()
    t = time.perf_counter()
    tts = old_tts(a.variant, a.graph_profile)
    setup_s = time.perf_counter() - t
    print(f"old pipeline + TTS set up in {setup_s:.1f} s", flush=True)
    results = {"setup_s": setup_s, "variant": a.variant, "graph_profile": a.graph_profile,
               "cells": run_cells(tts, cells, a.duration_s, a.drain_s, old_request, pb,
                                  log=lambda m: print(m, flush=True))}
    with open(a.out, "w") as f:
        json.dump(results, f, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
