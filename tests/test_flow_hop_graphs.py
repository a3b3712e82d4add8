"""Cached-hop graphs (runtime/stages/flow_hop_calls.py): a prefix-cached stream whose hops run in padded buckets with
static buffers shared by every bucket (rows, new frames and prefix padded; stale values of earlier hops left in the
buffers) equals the eager cached stream and the whole-history stream; a call no bucket holds runs eagerly (counted);
the grid validates its lists. On CPU a bucket "replays" by calling forward_cached on its static views, which checks
all but the CUDA capture itself (the GPU run checks that: benchmarks/, BENCHMARKS.md)."""
import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from cosytrt.runtime.models.flow import FlowInput
from cosytrt.runtime.stages.flow_cache import FlowCachePool
from cosytrt.runtime.stages.flow_hop_calls import CachedGrid, CachedHopGraphs, frame_windows
from cosytrt.runtime.stages.flow_hops import flow_rows
from cosytrt.runtime.stages.token2wav import LOOKAHEAD

from test_flow_cache import BATCH_TOL, BIG, CACHE_TOL, flow, hop_ends, make_prompt, make_tokens, max_err  # noqa: F401


def graphs_for(flow, batch=(1, 4), frames=(64, 128, 256, 512), prefix=(0, 96, 200, 400, 800)):
    return CachedHopGraphs(flow.estimator, CachedGrid(batch, frames, prefix), "cpu", graphs=False)


def test_frame_windows_equal_the_gather_it_replaces():
    """`frame_windows` (the conv tails at a hop's commit points: one index_select over flattened frames) gives the
    values of the per-element gather it replaced, for CFG-major rows, windows at both ends, and a non-contiguous
    input (a transposed view, as the DiT's second conv input is)."""
    g = torch.Generator().manual_seed(0)
    R, T, dim, k = 3, 40, 8, 30
    at = torch.tensor([0, 10, T - k])
    for z in (torch.randn(2 * R, T, dim, generator=g), torch.randn(2 * R, dim, T, generator=g).transpose(1, 2)):
        idx = (at.unsqueeze(1) + torch.arange(k))
        want = z.gather(1, torch.cat((idx, idx)).unsqueeze(-1).expand(2 * R, k, dim))
        assert torch.equal(frame_windows(z, at, k), want)


def test_grid_select_and_validation():
    g = CachedGrid((4, 1, 2), (100, 50), (0, 200))
    assert g.batch == (1, 2, 4) and g.frames == (50, 100)
    assert g.select(3, 50, 0) == (4, 50, 0)
    assert g.select(1, 51, 1) == (1, 100, 200)
    assert g.select(5, 50, 0) is None and g.select(1, 101, 0) is None and g.select(1, 50, 201) is None
    assert len(g.keys()) == 3 * 2 * 2
    for bad in ((), (0,), (1.5,), (True,)):
        with pytest.raises(ValueError):
            CachedGrid(bad, (50,), (0,))
    with pytest.raises(ValueError):
        CachedGrid((1,), (50,), (-1,))


def test_graph_buckets_equal_eager_and_whole_history(flow):
    """Three streams in lock-step, batched (3 requests in the 4-request bucket), every hop padded in rows, frames and
    prefix, buffers reused across hops and buckets; then one stream alone (the 1-request bucket after the 4-request
    one left its values in the shared buffers)."""
    specs = [(20, 8, 300), (33, 9, 300), (60, 10, 300)]
    prompts = [make_prompt(flow, P, s) for P, s, _ in specs]
    tokens = [make_tokens(flow, n, s + 100) for _, s, n in specs]
    ends = [hop_ends(P, n) for P, _, n in specs]
    graphs = graphs_for(flow)
    pool_g, pool_e = FlowCachePool(BIG), FlowCachePool(BIG)
    sg = [pool_g.new_state() for _ in specs]
    se = [pool_e.new_state() for _ in specs]
    rounds = min(len(e) for e in ends)
    assert rounds >= 3
    for rnd in range(rounds):
        rows_g = [FlowInput(tokens[i][:ends[i][rnd] + LOOKAHEAD], *prompts[i], False, sg[i]) for i in range(3)]
        rows_e = [FlowInput(tokens[i][:ends[i][rnd] + LOOKAHEAD], *prompts[i], False, se[i]) for i in range(3)]
        got = flow_rows(flow, rows_g, True, hops=graphs)
        eager = flow_rows(flow, rows_e, True)
        for i in range(3):
            whole = flow_rows(flow, [FlowInput(tokens[i][:ends[i][rnd] + LOOKAHEAD], *prompts[i], False)], True)[0]
            assert max_err(got[i], eager[i]) <= BATCH_TOL, (rnd, i)
            assert max_err(got[i], whole) <= BATCH_TOL, (rnd, i)
            assert sg[i].frames == se[i].frames
    assert graphs.counts["hits"] == rounds * flow.cfg.n_timesteps and graphs.counts["misses"] == 0  # per step
    assert {k[0] for k in graphs.entries} == {4}
    # one more stream alone through the 1-request buckets
    P, seed = 25, 40
    prompt, toks = make_prompt(flow, P, seed), make_tokens(flow, 280, seed)
    st = FlowCachePool(BIG).new_state()
    for upto in hop_ends(P, 280):
        got = flow_rows(flow, [FlowInput(toks[:upto + LOOKAHEAD], *prompt, False, st)], True, hops=graphs)[0]
        whole = flow_rows(flow, [FlowInput(toks[:upto + LOOKAHEAD], *prompt, False)], True)[0]
        assert max_err(got, whole) <= BATCH_TOL, upto
    assert any(k[0] == 1 and k[2] > 0 for k in graphs.entries)


def test_static_buffers_allocated_with_the_first_bucket(flow):
    from cosytrt.runtime.stages.flow_hops import step_consts

    graphs = graphs_for(flow)
    assert graphs.static_bytes == 0  # a set whose cache stays off holds no buffers
    store = FlowCachePool(BIG).storage(flow)
    graphs.capture_all(store, step_consts(flow, "cpu", torch.float32))
    assert graphs.static_bytes > 0 and graphs.counts["captured"] == len(graphs.grid.keys())
    assert graphs.stats()["capture_failed"] == 0
    # the fixed arena holds GRAPH_ARENA_SLOTS rows mid-solve before rows go eager (run 63: 64 were too few at load)
    from cosytrt.runtime.stages.flow_hop_calls import GRAPH_ARENA_SLOTS

    arena = graphs.arena
    assert arena.slots == GRAPH_ARENA_SLOTS >= 256 and not arena.growable
    taken = [graphs.take(max(graphs.grid.frames), "cpu", torch.float32) for _ in range(GRAPH_ARENA_SLOTS)]
    assert all(a is arena for a, _ in taken)
    assert graphs.take(1, "cpu", torch.float32)[0] is not arena  # full: the next row's state goes to the eager arena


def test_no_bucket_runs_eagerly_and_is_counted(flow):
    P = 20
    prompt, toks = make_prompt(flow, P, 5), make_tokens(flow, 300, 6)
    graphs = graphs_for(flow, batch=(1,), frames=(64,), prefix=(0, 96))  # hops of 100+ new frames: no bucket
    st_g, st_e = FlowCachePool(BIG).new_state(), FlowCachePool(BIG).new_state()
    for upto in hop_ends(P, 300)[:3]:
        got = flow_rows(flow, [FlowInput(toks[:upto + LOOKAHEAD], *prompt, False, st_g)], True, hops=graphs)[0]
        ref = flow_rows(flow, [FlowInput(toks[:upto + LOOKAHEAD], *prompt, False, st_e)], True)[0]
        assert max_err(got, ref) <= CACHE_TOL
    assert graphs.counts["misses"] >= 1
    s = graphs.stats()
    assert s["grid"] == {"batch": [1], "frames": [64], "prefix": [0, 96]} and s["graphs"] is False
    assert s["hits"] + s["misses"] == 3 * flow.cfg.n_timesteps  # one estimator call per hop and Euler step
    assert sum(s["shapes"].values()) == s["hits"] + s["misses"] and sum(s["replays"].values()) == s["hits"]
    n = flow.cfg.n_timesteps  # (requests, new frames, prefix frames) per call: hops of 100, 100 and 200 frames
    assert s["shapes"] == {"1,100,0": n, "1,100,100": n, "1,200,200": n} and s["replays"] == {}


@pytest.mark.parametrize("scope", ["whole", "regional"])
def test_compiled_forward_cached_buckets_equal_eager(flow, scope):
    """The compiled variant's cached hops (`GraphedEagerSet(compile=True)` hands CachedHopGraphs the compiled
    forward_cached of `CompiledDiT`, whole-graph or regional): the same hops through the compiled function, bucket
    after bucket of different (rows, frames, prefix) sizes, equal the eager cached hops; dynamic shapes, so new
    buckets do not recompile each time."""
    import torch._dynamo

    from cosytrt.runtime.stages.compiled import CompiledDiT

    specs = [(20, 8, 250), (33, 9, 250)]
    prompts = [make_prompt(flow, P, s) for P, s, _ in specs]
    tokens = [make_tokens(flow, n, s + 100) for _, s, n in specs]
    ends = [hop_ends(P, n) for P, _, n in specs]
    grid = CachedGrid((1, 2), (64, 128, 256, 512), (0, 96, 200, 400, 800))
    fn = CompiledDiT.of(flow.estimator, scope).forward_cached
    compiled = CachedHopGraphs(flow.estimator, grid, "cpu", fn=fn, graphs=False)
    pool_c, pool_e = FlowCachePool(BIG), FlowCachePool(BIG)
    sc = [pool_c.new_state() for _ in specs]
    se = [pool_e.new_state() for _ in specs]
    torch._dynamo.utils.counters.clear()
    rounds = min(len(e) for e in ends)
    sources = []
    for rnd in range(rounds):
        rows = [0, 1] if rnd % 2 == 0 else [1]  # 2-row and 1-row buckets, prefix growing
        inputs = [FlowInput(tokens[i][:ends[i][rnd] + LOOKAHEAD], *prompts[i], False, sc[i]) for i in rows]
        got, src = run_and_get_code(lambda: flow_rows(flow, inputs, True, hops=compiled))
        sources += src
        eager = flow_rows(flow, [FlowInput(tokens[i][:ends[i][rnd] + LOOKAHEAD], *prompts[i], False, se[i])
                                 for i in rows], True)
        for a, b in zip(got, eager):
            assert max_err(a, b) <= BATCH_TOL, rnd
    assert compiled.counts["misses"] == 0 and compiled.counts["hits"] >= 2, compiled.counts
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert 1 <= frames <= 3, f"{frames} graphs compiled for {rounds} hops of different buckets"
    # each layer writes its new frames' K / V into its own input in place: no buffer of every layer's K / V
    # ([depth, rows, prefix + new, D]) in the generated code (run 63: a slice write into one [depth, ...] input was
    # functionalised as a copy of the whole input per layer, most of the DiT's GPU time in the 40 s cell)
    assert sources
    whole_kv = re.findall(r"empty_strided_\w+\(\(([^,()]+, ){2}[^,()]+ \+ [^,()]+, \d+\)", "\n".join(sources))
    assert not whole_kv, f"{len(whole_kv)} [depth, rows, prefix + new, D] buffers in the compiled cached hop"


@pytest.mark.parametrize("form, conv", [("paged", ""), ("layers", "triton")])
def test_compiled_paged_prefix_hops_equal_eager(flow, monkeypatch, form, conv):
    """The paged prefix form (`SchedulerConfig.dit_paged_prefix`: the attention reads the prefix from the store through
    an opaque op) through the compiled forward_cached: the hops equal the eager gathered ones across buckets, and
    the store's pages reach the op as inputs (no recompile per bucket). And the Triton conv (`dit_conv=triton`)
    compiled: an opaque op too (run 66: Dynamo failed inside its launch), the same hops."""
    import torch._dynamo

    from cosytrt.runtime.models import dit_conv
    from cosytrt.runtime.stages.compiled import CompiledDiT

    if conv:
        from cosytrt.runtime.models import dit_conv_triton

        if not dit_conv_triton.available():
            pytest.skip("Triton is not installed (the Triton conv falls back to F.conv1d without it)")
        monkeypatch.setattr(dit_conv, "CONV", conv)

    P, n = 20, 250
    prompt, toks = make_prompt(flow, P, 8), make_tokens(flow, n, 108)
    grid = CachedGrid((1, 2), (64, 128, 256, 512), (0, 96, 200, 400, 800))
    compiled = CachedHopGraphs(flow.estimator, grid, "cpu", fn=CompiledDiT.of(flow.estimator, "whole").forward_cached,
                               graphs=False)
    compiled.use_kv_form(form)
    pool_c, pool_e = FlowCachePool(BIG), FlowCachePool(BIG)
    sc, se = pool_c.new_state(), pool_e.new_state()
    torch._dynamo.utils.counters.clear()
    for upto in hop_ends(P, n)[:4]:
        got = flow_rows(flow, [FlowInput(toks[:upto + LOOKAHEAD], *prompt, False, sc)], True, hops=compiled)
        eager = flow_rows(flow, [FlowInput(toks[:upto + LOOKAHEAD], *prompt, False, se)], True)
        assert max_err(got[0], eager[0]) <= BATCH_TOL, upto
    assert compiled.counts["misses"] == 0 and compiled.counts["hits"] >= 2, compiled.counts
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert 1 <= frames <= 3, f"{frames} graphs compiled for 4 hops"


@pytest.mark.parametrize("through", ["graphs", "eager"])
def test_stepped_solves_at_different_steps_equal_alone(flow, through):
    """Step-level DiT: three streams' cached hops advance one Euler step per estimator call, each at its own step
    (the second joins after the first took 3 steps, the third after 6; the first finishes and leaves while the
    others go on), through padded buckets with shared buffers (or eagerly). Each row's mel equals its hop solved
    alone and its whole-history hop, and what it commits serves the next hop as well."""
    from cosytrt.runtime.stages.flow_hop_calls import EagerHops
    from cosytrt.runtime.stages.flow_hops import finish_cached, plan_hops, solve_cached, start_cached, step_cached

    specs = [(20, 8, 300), (33, 9, 300), (60, 10, 300)]
    prompts = [make_prompt(flow, P, s) for P, s, _ in specs]
    tokens = [make_tokens(flow, n, s + 100) for _, s, n in specs]
    ends = [hop_ends(P, n) for P, _, n in specs]
    hops = graphs_for(flow) if through == "graphs" else EagerHops(flow.estimator, flow.estimator.forward_cached)
    pool_s, pool_a = FlowCachePool(BIG), FlowCachePool(BIG)
    ss = [pool_s.new_state() for _ in specs]
    sa = [pool_a.new_state() for _ in specs]
    S = flow.cfg.n_timesteps

    def inputs(i, upto, st):
        return FlowInput(tokens[i][:upto + LOOKAHEAD], *prompts[i], False, st)

    for i in range(3):  # one hop each, alone, in both pools: every stream has a cached prefix now
        for st in (ss[i], sa[i]):
            flow_rows(flow, [inputs(i, ends[i][0], st)], True)
    for rnd in (1, 2):
        with torch.inference_mode():
            solves = []
            for i in range(3):
                inp = inputs(i, ends[i][rnd], ss[i])
                plans, whole = plan_hops(flow, [inp], [flow.prepare_row(inp.token, *prompts[i], False)])
                assert not whole
                solves.append(start_cached(flow, plans[0]))
            mels = [None] * 3
            active = []
            for tick in range(3 * S):
                if tick in (0, 3, 6):
                    active.append(tick // 3)
                step_cached(flow, [solves[i] for i in active], hops)
                for i in [i for i in active if solves[i].done]:
                    mels[i] = finish_cached(flow, [solves[i]])[0]
                    active.remove(i)
                if not active:
                    break
            assert all(sv.done for sv in solves) and [sv.step for sv in solves] == [S] * 3
        for i in range(3):
            inp = inputs(i, ends[i][rnd], sa[i])
            plans, _ = plan_hops(flow, [inp], [flow.prepare_row(inp.token, *prompts[i], False)])
            alone = solve_cached(flow, plans, EagerHops(flow.estimator, flow.estimator.forward_cached))[0]
            row = flow.prepare_row(inp.token, *prompts[i], False)
            whole = flow_rows(flow, [FlowInput(tokens[i][:ends[i][rnd] + LOOKAHEAD], *prompts[i], False)], True)[0]
            got = mels[i][:, :, row.prompt_frames:row.frames]
            assert max_err(got, alone[:, :, row.prompt_frames:row.frames]) <= BATCH_TOL, (rnd, i)
            assert max_err(got, whole) <= BATCH_TOL, (rnd, i)
            assert ss[i].frames == sa[i].frames


def stream_solves(flow, hops, pool, B: int, k: int, with_inputs: bool = False):
    """B streams with their first k hops committed (k segments each); their (k+1)-th hops' solves in `hops` (and
    each hop's inputs without the cache, for its whole-history reference)."""
    from cosytrt.runtime.stages.flow_hops import plan_hops, start_cached

    solves, plain = [], []
    for i in range(B):
        P = 20
        prompt, tokens = make_prompt(flow, P, 70 + i), make_tokens(flow, 25 + 100 * (k + 2), 170 + i)
        ends = hop_ends(P, tokens.numel())
        st = pool.new_state()
        for j in range(k):
            flow_rows(flow, [FlowInput(tokens[:ends[j] + LOOKAHEAD], *prompt, False, st)], True)
        inp = FlowInput(tokens[:ends[k] + LOOKAHEAD], *prompt, False, st)
        with torch.inference_mode():
            plans, whole = plan_hops(flow, [inp], [flow.prepare_row(inp.token, *prompt, False)])
            assert not whole
            solves.append(start_cached(flow, plans[0], hops))
        plain.append(FlowInput(tokens[:ends[k] + LOOKAHEAD], *prompt, False))
    return (solves, plain) if with_inputs else solves


def test_host_work_per_step_does_not_grow_with_rows_or_prefix(flow):
    """What a step-level cached DiT call costs the host besides the graph replay: a fixed handful of ops (the step's
    table and its upload), the same for 1 or 3 streams with 1 or 3 committed hops each. Before the paged prefix
    store each step copied every prefix segment of every row and updated each row on the host (rows x segments x ~3
    ops: the DiT thread's host time limited step-level scheduling near saturation, BENCHMARKS.md run 31)."""
    from cosytrt.runtime.stages.flow_hops import step_cached
    from cosytrt.tools.bench.op_count import OpCounter

    counts = {}
    for B, k in ((1, 1), (3, 1), (1, 3), (3, 3)):
        graphs = graphs_for(flow, batch=(1, 4), frames=(64, 128, 256), prefix=(0, 200, 400, 800))
        solves = stream_solves(flow, graphs, FlowCachePool(BIG), B, k)
        assert max(len(sv.plan.prefix.segments) for sv in solves) == k
        counter = OpCounter()
        entry = graphs.entry

        def paused_entry(key, entry=entry, counter=counter):  # the replay (the whole hop_step) is not host work
            meta, replay = entry(key)

            def run():
                counter.active = False
                try:
                    replay()
                finally:
                    counter.active = True
            return meta, run

        graphs.entry = paused_entry
        with torch.inference_mode():
            step_cached(flow, solves, graphs)  # the first call binds and fills the bucket's table
            counter.ops.clear()
            with counter:
                step_cached(flow, solves, graphs)
        assert graphs.counts["misses"] == 0
        counts[(B, k)] = counter.total
        for sv in solves:
            sv.release()
    assert len(set(counts.values())) == 1 and max(counts.values()) <= 8, counts


def test_failed_hop_leaves_the_prefix_and_gives_back_its_reservations(flow):
    """A hop whose estimator fails mid-solve (after some steps wrote its reserved pages and tail slot) commits
    nothing: the pool gets its pages and slots back, the committed prefix is untouched (its tail slot is never
    written by a later hop: each hop writes a fresh one), and the next hop still equals the whole-history hop."""
    from cosytrt.runtime.stages.flow_hop_calls import EagerHops
    from cosytrt.runtime.stages.flow_hops import plan_hops, solve_cached

    P = 20
    prompt, toks = make_prompt(flow, P, 9), make_tokens(flow, 300, 10)
    ends = hop_ends(P, 300)
    pool = FlowCachePool(BIG, prompt_cache=False)
    st = pool.new_state()
    flow_rows(flow, [FlowInput(toks[:ends[0] + LOOKAHEAD], *prompt, False, st)], True)
    used, frames, tail = pool.stats()["bytes_used"], st.frames, st.prefix.tail
    saved = pool.store.tails.clone()
    calls = [0]

    def flaky(*a):
        calls[0] += 1
        if calls[0] == 4:
            raise RuntimeError("estimator failed")
        return flow.estimator.forward_cached(*a)

    inp = FlowInput(toks[:ends[1] + LOOKAHEAD], *prompt, False, st)
    with torch.inference_mode():
        plans, _ = plan_hops(flow, [inp], [flow.prepare_row(inp.token, *prompt, False)])
        assert pool.stats()["bytes_used"] > used  # the hop's pages and tail slot are reserved
        with pytest.raises(RuntimeError, match="estimator failed"):
            solve_cached(flow, plans, EagerHops(flow.estimator, flaky))
    assert pool.stats()["bytes_used"] == used and st.frames == frames and st.prefix.tail == tail
    rows = slice(tail * flow.cfg.n_timesteps * 4, (tail + 1) * flow.cfg.n_timesteps * 4)
    assert torch.equal(pool.store.tails[rows], saved[rows])
    for upto in ends[1:3]:
        got = flow_rows(flow, [FlowInput(toks[:upto + LOOKAHEAD], *prompt, False, st)], True)[0]
        whole = flow_rows(flow, [FlowInput(toks[:upto + LOOKAHEAD], *prompt, False)], True)[0]
        assert max_err(got, whole) <= CACHE_TOL


def test_capture_out_of_memory_runs_that_bucket_eagerly(flow):
    """A bucket whose graph capture runs out of device memory (the compiled variant's cached-hop graphs did on an
    80 GB H100) is marked failed and its calls run eagerly, exactly; the other buckets keep their graphs."""
    from cosytrt.runtime.stages.flow_hops import finish_cached, step_consts, step_cached

    class OOMOnBig:
        graphs: dict = {}

        def capture(self, key, inputs, static=False, collect=True, fn=None):
            if key[0] > 1:
                raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
            self.graphs[key] = fn

        def run(self, key):
            return self.graphs[key]()

    graphs = graphs_for(flow, batch=(1, 4), frames=(64, 128), prefix=(0, 200))
    graphs.cache = OOMOnBig()
    pool = FlowCachePool(BIG)
    graphs.capture_all(pool.storage(flow), step_consts(flow, "cpu", torch.float32))
    assert graphs.counts["capture_failed"] == 4 and graphs.counts["captured"] == 4
    solves, plain = stream_solves(flow, graphs, pool, 2, 1, with_inputs=True)
    with torch.inference_mode():
        for _ in range(flow.cfg.n_timesteps):
            step_cached(flow, solves, graphs)
        mels = finish_cached(flow, solves)
    assert graphs.counts["misses"] == flow.cfg.n_timesteps and graphs.counts["hits"] == 0
    for sv, mel, inp in zip(solves, mels, plain):
        row = sv.plan.row
        whole = flow_rows(flow, [inp], True)[0]
        assert max_err(mel[:, :, row.prompt_frames:row.frames], whole) <= BATCH_TOL


def test_graph_buckets_share_one_set_of_kv_buffers(flow):
    """Every bucket of a graph set gathers its prefix K/V into, and has the call write this step's K/V into, the
    same flat buffers (sized for the largest bucket), so the memory of those tensors does not grow with the number
    of captured graphs (gathered per graph they would add up to ~96 GB over the full-size h200-graphs grid)."""
    from cosytrt.runtime.stages.flow_hops import finish_cached, step_cached

    seen = []

    def recording(*a):
        k_all, v_all = a[7], a[8]  # one tensor per layer: views of the shared buffers, the first at their start
        assert len(k_all) == len(v_all) == flow.estimator.cfg.depth
        seen.append((k_all[0].data_ptr(), v_all[0].data_ptr()))
        return flow.estimator.forward_cached(*a)

    graphs = CachedHopGraphs(flow.estimator, CachedGrid((1, 4), (64, 128, 256), (0, 200, 400, 800)), "cpu",
                             fn=recording, graphs=False)
    pool = FlowCachePool(BIG)
    for B, k in ((1, 1), (3, 2)):  # two different buckets
        solves = stream_solves(flow, graphs, pool, B, k)
        with torch.inference_mode():
            for _ in range(flow.cfg.n_timesteps):
                step_cached(flow, solves, graphs)
            finish_cached(flow, solves)
    bufs = graphs._bufs
    assert {k for k, _ in seen} == {bufs["k_all"].data_ptr()} and {v for _, v in seen} == {bufs["v_all"].data_ptr()}
    assert len({k for k in graphs.entries}) >= 2


def test_eager_hop_runner_is_one_per_thread(flow):
    """Callers without graphs share the flow's eager cached-hop runner within a thread, never across threads (its
    growable arena is not thread-safe)."""
    import threading

    from cosytrt.runtime.stages.flow_hops import hop_runner
    mine = hop_runner(flow)
    assert hop_runner(flow) is mine
    other = []
    t = threading.Thread(target=lambda: other.append(hop_runner(flow)))
    t.start()
    t.join()
    assert other[0] is not mine and other[0].fn == mine.fn
    fn = lambda *a, **k: flow.estimator.forward_cached(*a, **k)  # noqa: E731
    assert hop_runner(flow, fn=fn) is not mine and hop_runner(flow, fn=fn).fn is fn


def test_kv_forms_give_the_same_hops(flow):
    """hop_step's K / V forms (`SchedulerConfig.dit_kv_layer_inputs` and `dit_paged_prefix`): the stacked [depth, ...]
    form and the per-layer form give bit-identical hops (eager: the same arithmetic), the paged prefix (the
    attention reads the prefix in place from the store) the same up to the attention's fp32 reduction order (the
    same bits where its op runs the gathered torch form: no Triton); switching drops the captured buckets (they bake
    the form in)."""
    P = 20
    prompt, toks = make_prompt(flow, P, 7), make_tokens(flow, 300, 8)
    mels = {}
    for kv in ("layers", "stacked", "paged"):
        graphs = graphs_for(flow)
        graphs.use_kv_form(kv)
        assert graphs.kv == kv and graphs.eager.kv == kv
        st = FlowCachePool(BIG).new_state()
        mels[kv] = [flow_rows(flow, [FlowInput(toks[:upto + LOOKAHEAD], *prompt, False, st)], True, hops=graphs)[0]
                    for upto in hop_ends(P, 300)[:3]]
        assert graphs.counts["hits"] > 0
        c = flow.estimator.cfg  # the shared K / V buffers: the grid's largest prefix + new frames, or new only (paged)
        held = (0 if kv == "paged" else 800) + 512
        assert graphs._bufs["k_all"].numel() == c.depth * 2 * 4 * held * c.heads * c.dim_head
        if kv == "layers":
            assert graphs.entries
            graphs.use_kv_form("stacked")
            assert not graphs.entries
    with pytest.raises(ValueError, match="one of"):
        graphs.use_kv_form("gathered")
    assert all(torch.equal(a, b) for a, b in zip(mels["layers"], mels["stacked"]))
    for a, b in zip(mels["layers"], mels["paged"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_wide_views_gather_the_same_bits():
    """`wide`: bf16 / fp32 rows gathered and copied as 8-byte words give the same bits as element by element; tensors
    whose last dim is not whole 8-byte words (or not unit-stride, or already 8-byte) are left as they are."""
    from cosytrt.runtime.stages.flow_hop_calls import wide

    g = torch.Generator().manual_seed(3)
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        store = torch.randn(3, 40, 128, generator=g).to(dtype)
        idx = torch.tensor([5, 0, 39, 5, 17])
        out = torch.empty(3, 5, 128, dtype=dtype)
        torch.index_select(wide(store), 1, idx, out=wide(out))
        assert torch.equal(out, store.index_select(1, idx)) and wide(out).dtype == torch.int64
        dst, ref = store.clone(), store.clone()
        src = torch.randn(3, 5, 128, generator=g).to(dtype)
        wide(dst).index_copy_(1, idx[:3], wide(src[:, :3].contiguous()))
        ref.index_copy_(1, idx[:3], src[:, :3])
        assert torch.equal(dst, ref)
    odd = torch.zeros(2, 3, dtype=torch.bfloat16)  # 6 bytes a row
    assert wide(odd) is odd and wide(torch.zeros(4, 8).t()).dtype == torch.float32
    assert wide(torch.zeros(4, 8, dtype=torch.int64)).dtype == torch.int64


def test_capture_stream_switch_drops_graphs_captured_elsewhere(flow):
    """`use_capture_stream` (the scheduler's SM partition, dit_green_reserve_sms): the graphs are captured on the
    given stream from then on (only graphs captured on a green context's stream run confined to its SMs, run 67),
    graphs captured on another stream are dropped, and the same stream again keeps them."""
    hops = CachedHopGraphs(flow.estimator, CachedGrid((1,), (64,), (0,)), "cpu", graphs=True)  # no capture on CPU
    green = object()  # stands in for a green context's stream
    hops.entries["k"] = "captured on the cache's own stream"
    hops.use_capture_stream(green)
    assert hops.entries == {} and hops.cache._stream is green
    hops.entries["k"] = "captured on the green stream"
    hops.use_capture_stream(green)
    assert hops.entries == {"k": "captured on the green stream"} and hops.cache._stream is green
    hops.use_capture_stream(None)
    assert hops.entries == {} and hops.cache._stream is None
