"""Host work per step-level DiT call (issue 18): aten ops that `step_cached` dispatches OUTSIDE the estimator call
for B streams with k earlier hops committed each: with `--through graphs` what a CUDA-graph replay would not cover
(the step's table and its upload; before the paged prefix store also the per-segment prefix copies, the K/V write-out,
the conv tails and the Euler update, run 31's limit), with `--through eager` everything outside the estimator. On the GPU every such op is one kernel launch from the DiT thread's Python (~5-20 us
each, under the GIL it shares with the AR thread); run 31 measured the DiT thread's host time as what limits
step-level scheduling near saturation. CPU, tiny model (tests/data/golden), no timing claim: op counts, plus host
microseconds per step on this machine's CPU as a rough guide.

    python benchmarks/dit_step_host_ops.py [--batch 1,4,8] [--hops 1,4,8] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from cosytrt.tools.bench.op_count import OpCounter

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.join(HERE, "..", "tests", "data", "golden")


class PausedRun:
    """Wraps a cached-hop graph set so what a CUDA graph replay would run (the whole `hop_step`: gathers, the
    estimator, K/V / tail writes, the Euler update) is not counted: what remains is the host's work per step."""

    def __init__(self, hops, counter: OpCounter):
        self.hops, self.counter = hops, counter
        if not hasattr(hops, "entry"):  # eager: pause around the estimator only
            fn = hops.fn

            def paused_fn(*a):
                counter.active = False
                try:
                    return fn(*a)
                finally:
                    counter.active = True

            hops.fn = paused_fn
            return
        entry = hops.entry

        def paused_entry(key):
            got = entry(key)
            if got is None:
                return None
            meta, replay = got

            def paused():
                counter.active = False
                try:
                    return replay()
                finally:
                    counter.active = True

            return meta, paused

        hops.entry = paused_entry


def setup(flow, hops, B: int, k: int):
    """B streams, each with its first k hops committed; their (k+1)-th hop's solves (the tests' helper)."""
    from cosytrt.runtime.stages.flow_cache import FlowCachePool
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    from test_flow_hop_graphs import stream_solves

    return stream_solves(flow, hops, FlowCachePool(1 << 31, prompt_cache=False), B, k)


def measure(flow, hops, B: int, k: int, steps: int = 4) -> dict:
    from cosytrt.runtime.stages.flow_hops import step_cached

    solves = setup(flow, hops, B, k)
    segs = [len(sv.plan.prefix.segments) if sv.plan.prefix is not None else 0 for sv in solves]
    counter = OpCounter()
    PausedRun(hops, counter)
    per_step, fresh_ops, host_us = [], None, []
    with torch.inference_mode():
        for s in range(steps):
            counter.ops.clear()
            t0 = time.perf_counter()
            with counter:
                step_cached(flow, solves, hops)
            host_us.append((time.perf_counter() - t0) * 1e6)
            n = sum(counter.ops.values())
            if s == 0:
                fresh_ops = n
            else:
                per_step.append(dict(counter.ops))
    steady = sum(per_step[-1].values())
    return dict(batch=B, prior_hops=k, segments_per_row=max(segs), ops_first_step=fresh_ops, ops_per_step=steady,
                ops_by_name=dict(sorted(per_step[-1].items(), key=lambda kv: -kv[1])),
                host_us_per_step_with_dit=round(sorted(host_us[1:])[len(host_us[1:]) // 2]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,4,8")
    ap.add_argument("--hops", default="1,4,8")
    ap.add_argument("--through", default="graphs", choices=["graphs", "eager"])
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    from cosytrt.runtime.models.checkpoint import read_state_dict
    from cosytrt.runtime.models.config import config_from_golden_json
    from cosytrt.runtime.models.flow import Flow
    from cosytrt.runtime.stages.flow_hop_calls import CachedGrid, CachedHopGraphs, EagerHops

    cfg = config_from_golden_json(os.path.join(GOLDEN, "config.json")).flow
    flow = Flow(cfg).eval().load_checkpoint(read_state_dict(os.path.join(GOLDEN, "flow.pt")))
    rows = []
    for B in map(int, a.batch.split(",")):
        for k in map(int, a.hops.split(",")):
            if a.through == "graphs":
                hops = CachedHopGraphs(flow.estimator, CachedGrid((1, 4, 8), (64, 128, 256, 512),
                                                                  (0, 200, 400, 800, 1600, 3200)), "cpu")
            else:
                hops = EagerHops(flow.estimator, flow.estimator.forward_cached)
            r = measure(flow, hops, B, k)
            rows.append(r)
            top = ", ".join(f"{n} {c}" for n, c in list(r["ops_by_name"].items())[:5])
            print(f"B={B:2d} prior hops={k:2d} segments/row={r['segments_per_row']:2d}  ops/step {r['ops_per_step']:4d} "
                  f"(first {r['ops_first_step']:4d})  {r['host_us_per_step_with_dit']:7d} us/step  [{top}]", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(commit=os.environ.get("COSYTRT_COMMIT", ""), through=a.through, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
