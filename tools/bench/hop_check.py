"""One long stream's hops three ways on the bench pipeline: whole-history (the streaming DiT's CUDA graphs, eager
past the largest bucket), prefix-cached through the cached-hop graphs and prefix-cached eagerly: per hop the DiT
time of each and the mel difference to the whole-history hop (the GPU side of tests/test_flow_hop_graphs.py)."""
from __future__ import annotations

import time

import torch


def _timed(device, fn):
    torch.cuda.synchronize(device)
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize(device)
    return out, time.perf_counter() - t


def cached_hop_check(pipe, n_tokens: int = 400, prompt_tokens: int = 75, seed: int = 0) -> dict:
    from ...runtime.models.flow import FlowInput
    from ...runtime.stages.flow_cache import FlowCachePool
    from ...runtime.stages.flow_hops import flow_rows, plan_hops, solve_cached, step_consts
    from ...runtime.stages.hop_schedule import LOOKAHEAD, HopSchedule
    from .timing import max_err

    flow, backends, device = pipe.models.flow, pipe.backends, pipe.device
    graphs = backends.dit_cached
    if graphs is None:
        return {"skipped": "the pipeline's backends have no cached-hop graphs (profile without dit.cached)"}
    # two pools (graphs / eager hops) of 4 GiB each: a 400-token stream commits ~1000 frames (1.8 GB in bf16)
    pool_g, pool_e = FlowCachePool(4 << 30), FlowCachePool(4 << 30)
    consts = step_consts(flow, flow.rand_noise.device, flow.rand_noise.dtype)
    _, capture_s = _timed(device, lambda: graphs.capture_all(pool_g.storage(flow), consts))
    g = torch.Generator().manual_seed(seed)
    vocab = flow.cfg.vocab_size
    pt = torch.randint(0, vocab, (prompt_tokens,), generator=g).to(device)
    pf = torch.randn(2 * prompt_tokens, 80, generator=g).to(device)
    emb = torch.randn(192, generator=g).to(device)
    tokens = torch.randint(0, vocab, (n_tokens,), generator=g).to(device)
    est = backends.estimator(True)
    st_g, st_e = pool_g.new_state(), pool_e.new_state()
    sched, hops = HopSchedule(prompt_tokens), []
    while sched.ready(n_tokens):
        _, upto = sched.advance()
        toks = tokens[:upto + LOOKAHEAD]
        prefix = st_g.frames
        with torch.inference_mode():
            whole, t_whole = _timed(device, lambda: flow_rows(flow, [FlowInput(toks, pt, pf, emb, False)], True, est))
            inp = FlowInput(toks, pt, pf, emb, False, st_g)  # flow_rows' steps for one cached row, timed apart
            row, t_prep = _timed(device, lambda: flow.prepare_row(toks, pt, pf, emb, False))
            (plans, _), t_plan = _timed(device, lambda: plan_hops(flow, [inp], [row]))
            prof = None
            if len(hops) == 3:  # one mid-stream hop under the profiler: where its time goes
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof_:
                    mels, t_solve = _timed(device, lambda: solve_cached(flow, plans, graphs))
                prof = prof_.key_averages().table(sort_by="cpu_time_total", row_limit=25)
            else:
                mels, t_solve = _timed(device, lambda: solve_cached(flow, plans, graphs))
            graph = mels[0][:, :, row.prompt_frames:row.frames]
            t_graph = t_prep + t_plan + t_solve
            eager, t_eager = _timed(device, lambda: flow_rows(flow, [FlowInput(toks, pt, pf, emb, False, st_e)], True,
                                                              est))
        hops.append({"tokens": upto, "frames": 2 * (prompt_tokens + upto), "prefix": prefix,
                     "whole_ms": round(1e3 * t_whole, 2), "cached_graph_ms": round(1e3 * t_graph, 2),
                     "cached_eager_ms": round(1e3 * t_eager, 2), "graph_prepare_ms": round(1e3 * t_prep, 2),
                     "graph_plan_ms": round(1e3 * t_plan, 2), "graph_solve_ms": round(1e3 * t_solve, 2),
                     "graph_vs_whole_max_abs": max_err(graph[0], whole[0]),
                     "graph_vs_eager_cached_max_abs": max_err(graph[0], eager[0])})
        if prof is not None:
            hops[-1]["profile"] = prof
    st_g.close()
    st_e.close()
    stats = graphs.stats()
    graphs.close()  # its graphs read pool_g's pages, which go now
    pool_g.close()
    pool_e.close()
    return {"capture_s": round(capture_s, 2), "graph_stats": stats, "hops": hops}
