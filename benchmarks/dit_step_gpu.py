"""Step-level cached DiT calls on the GPU, old vs new runtime (issue 18): for B streams with k committed hops each
(full-size DiT, random weights, bf16, the h200-graphs cached grid), the host time of one `step_cached` call (until it
returns: what the DiT thread spends per step) and the GPU time per step (synchronized), then the mel of one finished
hop against its whole-history hop, then the memory the whole cached grid's graphs take. Runs against whichever
cosytrt is importable (both APIs: segment prefixes before the paged store, pages after).

    python benchmarks/dit_step_gpu.py OUT.json [--model tiny] [--device cpu]     (CPU / tiny: a smoke run)

--compile: the cached hops run the compiled forward_cached (CompiledDiT, scope "whole": what the compiled serving
variant replays in its graphs) instead of the eager modules; --forms stacked,layers,paged: each case once per K/V form
of `hop_step` (`SchedulerConfig.dit_kv_layer_inputs`: one [depth, ...] tensor as before session 24, or a tensor per
layer; `dit_paged_prefix`: no gather, the attention reads the prefix from the pages), with the mel of the same hop compared across forms; a form may name the DiT's conv implementation too
("layers+conv=triton": runtime/models/dit_conv.py's COSYTRT_DIT_CONV choices, set while that form's graphs are
captured) and the prefix gather's element width ("+narrow": 2-byte moves, as before session 24, instead of
`flow_hop_calls.wide`'s 8-byte ones); --whole-ref: per case also the whole-history streaming forward over the same
rows x (prefix + new) frames (compiled with --compile: one more compile), what an uncached hop's step costs — is a
short-prefix cached step still dearer than recomputing?; --profile: the top kernels of a few steps per case.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time

import torch


def build(model: str, device, dtype):
    from cosytrt.runtime.models.config import FlowConfig, config_from_golden_json
    from cosytrt.runtime.models.flow import Flow

    if model == "tiny":
        here = os.path.dirname(os.path.abspath(__file__))
        cfg = config_from_golden_json(os.path.join(here, "..", "tests", "data", "golden", "config.json")).flow
    else:
        cfg = FlowConfig()
    torch.manual_seed(0)
    flow = Flow(cfg).eval()
    with torch.no_grad():
        for p in flow.parameters():
            p.normal_(0, 0.02)
    return flow.to(device=device, dtype=dtype)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", default="full")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cases", default="1:1,8:1,8:8")
    ap.add_argument("--no-capture-all", action="store_true")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--forms", default="layers", help="comma-separated: stacked, layers, paged (each +narrow / +conv=X)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--whole-ref", action="store_true")
    a = ap.parse_args(argv)
    forms = a.forms.split(",")
    import cosytrt.runtime.stages.flow_hop_calls as fhc
    import cosytrt.runtime.stages.flow_hops as fh
    from cosytrt.runtime.models import dit_conv
    from cosytrt.runtime.models.flow import FlowInput
    from cosytrt.runtime.stages.flow_cache import FlowCachePool
    from cosytrt.runtime.stages.flow_hop_calls import CachedGrid, CachedHopGraphs
    from cosytrt.runtime.stages.hop_schedule import LOOKAHEAD, HopSchedule

    device = torch.device(a.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    flow = build(a.model, device, dtype)
    new_api = "hops" in inspect.signature(fh.start_cached).parameters
    grid = CachedGrid((1, 2, 4, 8), (50, 100, 200, 300), (0, 100, 200, 400, 600, 800, 1000, 1400, 1800, 2600))
    fn = None
    if a.compile:
        from cosytrt.runtime.stages.compiled import CompiledDiT

        fn = CompiledDiT.of(flow.estimator, "whole").forward_cached
    out = {"api": "pages" if new_api else "segments", "device": torch.cuda.get_device_name() if cuda else "cpu",
           "compiled": a.compile, "cases": []}

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def ends_for(P, n):  # the runtime's non-final hop schedule: generated tokens covered after each hop
        sched, res = HopSchedule(P), []
        while sched.ready(n):
            res.append(sched.advance()[1])
        return res

    P = 75
    vocab = flow.cfg.vocab_size
    mels_of: dict = {}
    default_conv = dit_conv.CONV
    for form, case in [(f, c) for c in a.cases.split(",") for f in forms]:
        B, k = map(int, case.split(":"))
        g = torch.Generator().manual_seed(B * 1000 + k)  # the same streams for every form of a case
        graphs = CachedHopGraphs(flow.estimator, grid, device, dtype, fn=fn)
        fhc.WIDE_MOVES = "+narrow" not in form
        kv_form, _, conv = form.replace("+narrow", "").partition("+conv=")
        if hasattr(graphs, "use_kv_form"):
            graphs.use_kv_form(kv_form)
        elif hasattr(graphs, "use_layer_inputs"):  # a wheel from before the paged form
            graphs.use_layer_inputs(kv_form == "layers")
        dit_conv.CONV = conv or default_conv
        pool = FlowCachePool(24 << 30 if cuda else 1 << 30, prompt_cache=False)
        if new_api:
            graphs.bind(pool.storage(flow), fh.step_consts(flow, device, dtype))
        t0 = time.perf_counter()
        solves, plain = [], []
        for i in range(B):
            pt = torch.randint(0, vocab, (P,), generator=g).to(device)
            pf = torch.randn(2 * P, 80, generator=g).to(device, dtype)
            emb = torch.randn(192, generator=g).to(device, dtype)
            toks = torch.randint(0, vocab, (900,), generator=g).to(device)
            ends = ends_for(P, 900)
            st = pool.new_state()
            with torch.inference_mode():
                for j in range(k):
                    fh.flow_rows(flow, [FlowInput(toks[:ends[j] + LOOKAHEAD], pt, pf, emb, False, st)], True,
                                 hops=graphs)
                inp = FlowInput(toks[:ends[k] + LOOKAHEAD], pt, pf, emb, False, st)
                plans, whole = fh.plan_hops(flow, [inp], [flow.prepare_row(inp.token, pt, pf, emb, False)])
                assert not whole
                solves.append(fh.start_cached(flow, plans[0], graphs) if new_api else fh.start_cached(flow, plans[0]))
            plain.append(FlowInput(toks[:ends[k] + LOOKAHEAD], pt, pf, emb, False))
        setup_s = time.perf_counter() - t0
        with torch.inference_mode():
            fh.step_cached(flow, solves, graphs)  # warm: the bucket, fresh inputs
            sync()
            host, steps = 0.0, solves[0].n_steps - 2 - (3 if a.profile and cuda else 0)
            t_all = time.perf_counter()
            for _ in range(steps):
                t = time.perf_counter()
                fh.step_cached(flow, solves, graphs)
                host += time.perf_counter() - t
            sync()
            wall = time.perf_counter() - t_all
            top = None
            if a.profile and cuda:
                from cosytrt.tools.bench.timing import kernel_table

                # the solves' next 3 steps (kernel_table: one call, then 2 profiled), so they still end at n_steps
                top = kernel_table(lambda: fh.step_cached(flow, solves, graphs), steps=2, top=8)
            fh.step_cached(flow, solves, graphs)
            mels = fh.finish_cached(flow, solves)
            row = solves[0].plan.row
            ref = fh.flow_rows(flow, [plain[0]], True)[0]
            err = (mels[0][:, :, row.prompt_frames:row.frames] - ref).abs().max().item()
        prefix = max(sv.plan.start for sv in solves)
        other = mels_of.get(case)
        mels_of.setdefault(case, mels[0])
        rec = dict(form=form, batch=B, prior_hops=k, prefix_frames=prefix, new_frames=max(sv.n for sv in solves),
                   host_ms_per_step=round(1e3 * host / steps, 3), wall_ms_per_step=round(1e3 * wall / steps, 3),
                   mel_vs_whole_max_abs=err, setup_s=round(setup_s, 1), graph_counts=dict(graphs.counts),
                   mel_vs_first_form_max_abs=None if other is None else (mels[0] - other).abs().max().item(),
                   top_kernels=top)
        if a.whole_ref and form == forms[0]:
            from cosytrt.build.export_dit import example_inputs
            from cosytrt.runtime.models.dit import FixedModeDiT
            from cosytrt.tools.bench.timing import graph_timing

            whole = (CompiledDiT.of(flow.estimator, "whole").fixed(True) if a.compile
                     else FixedModeDiT(flow.estimator, True))
            args = example_inputs(flow.estimator, 2 * B, prefix + rec["new_frames"], dtype, device, seed=B)
            with torch.inference_mode():
                if cuda:
                    ref = whole(*args)
                    rec["whole_history_ms_per_step"] = round(graph_timing(whole, device, args, ref, reps=20)[0], 3)
                else:
                    t = time.perf_counter()
                    whole(*args)
                    rec["whole_history_ms_per_step"] = round(1e3 * (time.perf_counter() - t), 3)
        out["cases"].append(rec)
        print(json.dumps({k: v for k, v in rec.items() if k != "top_kernels"}), flush=True)
        for kern in (top or {}).get("top", [])[:8]:
            print(f"    {kern['name'][:90]:90s} {kern['calls']:6.1f} calls {kern['us']:9.1f} µs per step", flush=True)
        for sv in solves:
            sv.plan.state.close()
        if form != forms[-1] or case != a.cases.split(",")[-1]:
            graphs.close()
            del pool
    if not a.no_capture_all and cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved()
        t = time.perf_counter()
        try:
            if new_api:
                graphs.capture_all(pool.store, fh.step_consts(flow, device, dtype))
            else:
                graphs.capture_all()
            status = "ok"
        except torch.OutOfMemoryError as e:
            status = f"OOM: {str(e)[:160]}"
        out["capture_all"] = dict(status=status, seconds=round(time.perf_counter() - t, 1),
                                  graphs=graphs.counts.get("captured"),
                                  reserved_gb=round((torch.cuda.memory_reserved() - before) / 2**30, 2),
                                  pool_gb=round(pool.stats().get("budget_bytes", 0) / 2**30, 1))
        print(json.dumps(out["capture_all"]), flush=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
