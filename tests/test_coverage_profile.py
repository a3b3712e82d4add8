"""Shape-only coverage and derived profiles: the simulated calls follow the hop schedule and HiFTStream's windows, a
derived grid covers the shapes within the waste limit and the bucket cap, and `trtbuild coverage --simulate
--derive-profile` writes a profile the runtime loads, with the hit rates of the old and the derived profile."""
import json
import os
from collections import Counter

import pytest
import torch

from cosytrt.engines.buckets import BucketTable, Bucket
from cosytrt.runtime.models.config import tiny_config
from cosytrt.runtime.models.hift import HiFT
from cosytrt.runtime.models.hift_stream import HiFTStream
from cosytrt.runtime.stages.hop_schedule import streaming_schedule
from cosytrt.runtime.stages.profile import load_profile
from cosytrt.tools.coverage_profile import derive_grid
from cosytrt.tools.coverage_sim import FINAL, CachedHops, HiFTGeometry, HiFTWindows, hit_rates, rate_calls, simulate
from cosytrt.tools.coverage_workload import WorkloadRequest
from cosytrt.tools.trtbuild import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_hift_windows_match_hift_stream():
    """The simulated window lengths are the ones HiFTStream decodes (a tiny random vocoder, real pushes)."""
    torch.manual_seed(0)
    hift = HiFT(tiny_config().hift).eval()
    g = HiFTGeometry.of(hift)
    assert g == HiFTGeometry()  # the defaults the full-size simulation uses
    for chunks in ([50, 100, 200, 200, 37], [30, 9, 1, 60], [12], [50, 100, 61]):
        real, sim = HiFTStream(hift), HiFTWindows(g)
        for i, n in enumerate(chunks):
            fin = i == len(chunks) - 1
            real.push(torch.randn(1, 80, n), finalize=fin)
            w = sim.push(n, fin)
            assert (w or 0) == real.last_decode_window_frames, (chunks, i)


def test_simulated_calls_follow_the_hop_schedule():
    P, N = 75, 200
    calls = simulate([WorkloadRequest(None, 8, N, None, True, "s", 0, 0.0)], prompt_tokens=P)
    sched = streaming_schedule(P, N)
    dit_stream = [n for s, m, b, n, *_ in calls if (s, m) == ("dit", "stream")]
    dit_final = [n for s, m, b, n, *_ in calls if (s, m) == ("dit", "offline")]
    assert dit_stream == [c.dit_frames for c in sched if not c.final for _ in range(10)]
    assert dit_final == [sched[-1].dit_frames] * 10
    assert all(b == 2 for s, m, b, *_ in calls if s == "dit")
    hift = [c for c in calls if c[:2] == ("hift", "stream")]
    assert len(hift) == len(sched) and hift[-1][6] == FINAL and not any(c[6] for c in hift[:-1])
    off = simulate([WorkloadRequest(None, 8, N, None, False, "o", 0, 0.0)] * 3, prompt_tokens=P)
    shapes = Counter(c[:4] for c in off)
    assert shapes[("dit", "offline", 6, 2 * (P + N))] == 10  # three requests at t = 0: one batched call
    assert shapes[("hift", "offline", 3, 2 * N)] == 1


def test_derived_grid_covers_within_waste_and_cap():
    shapes = {(2, 200): 50, (2, 300): 40, (4, 500): 10, (6, 700): 5, (2, 1400): 3, (16, 300): 2, (10, 900): 1}
    g = derive_grid("dit", shapes, 1.5, max_buckets=16)
    assert len(g["batch"]) * len(g["frames"]) <= 16 and all(b % 2 == 0 for b in g["batch"])
    table = BucketTable([Bucket("dit", "stream", b, n) for b in g["batch"] for n in g["frames"]], 1.5)
    covered = sum(w for (b, n), w in shapes.items() if table.select(b, n) is not None)
    assert covered == g["covered_calls"] == sum(shapes.values())
    tight = derive_grid("dit", shapes, 1.5, max_buckets=2)  # over the cap: the most calls first
    assert len(tight["batch"]) * len(tight["frames"]) <= 2 and tight["covered_calls"] >= 90


def test_simulate_and_derive_a_profile(tmp_path, capsys):
    out, prof = tmp_path / "cov", tmp_path / "derived.yaml"
    rc = main(["coverage", "--simulate", "--open-loop", "rate=3,duration=4,seed=1,stream=0.7", "--rates", "3,6",
               "--profile", "h200-graphs", "--derive-profile", str(prof), "--max-buckets", "12", "--out", str(out),
               "--quiet"])
    text = capsys.readouterr().out
    assert rc == 0 and "bucket hit rate, same calls" in text
    p = load_profile(str(prof))
    assert p.model == "full" and p.buckets("dit", "stream") and p.buckets("hift", "stream")
    assert all(len(p.buckets(s, m)) <= 12 for s in ("dit", "hift") for m in ("stream", "offline"))
    head = prof.read_text().splitlines()[0]
    assert head.startswith("# Derived by `trtbuild coverage --derive-profile`")
    r = json.loads((out / "report.json").read_text())
    comp = r["profile_comparison"]["comparison"]
    assert set(comp) == {"h200-graphs (final HiFT windows eager)", "h200-graphs", "derived.yaml"}
    for sm, d in comp["derived.yaml"].items():
        assert d["hit_rate"] >= comp["h200-graphs"][sm]["hit_rate"] - 1e-9, sm
    assert comp["h200-graphs (final HiFT windows eager)"]["hift/stream"]["hit_rate"] < 1.0
    assert r["workload"]["requests"] > 0 and r["totals"]["calls"] == comp["h200-graphs"]["total"]["calls"]
    if (out / "hit_rates.png").exists():
        assert (out / "hit_rates.png").read_bytes()[:4] == b"\x89PNG"
        assert (out / "heatmap_derived.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("name,cached", [("h200-open-loop", False), ("h200-cached-open-loop", True),
                                         ("h200-mixed", True)])
def test_shipped_open_loop_profile_loads_and_covers_its_simulation(name, cached):
    from cosytrt.tools.coverage_sim import rate_cached

    p = load_profile(os.path.join(os.path.dirname(__file__), "..", "profiles", f"{name}.yaml"))
    assert p.model == "full" and p.max_padding_waste == 1.5
    assert all(len(p.buckets(s, m)) <= 32 for s in ("dit", "hift") for m in ("stream", "offline"))
    reqs = [WorkloadRequest(None, 8, n, None, s, "g", 0, t)
            for t, n, s in ((0.0, 150, True), (0.1, 400, False), (0.15, 90, True), (0.2, 1000, True))]
    ch = CachedHops(cap=max(p.stage("dit").cached.batch)) if cached else None
    calls = simulate(reqs, cached=ch)
    tables = {(s, m): p.table(s, m) for s in ("dit", "hift") for m in ("stream", "offline")}
    assert hit_rates(rate_calls(calls, tables))["total"]["hit_rate"] == 1.0
    if cached:  # a 40 s stream's last hops too; fewer graphs than h200-graphs' 160
        grid = p.stage("dit").cached
        assert rate_cached(ch.calls, grid)["hit_rate"] == 1.0 and len(grid.keys()) <= 64


def test_b16_profile_is_the_cached_open_loop_one_with_wider_dit_batches():
    """h200-cached-open-loop-b16 (the A/B profile for `dit_max_requests=16`): the same buckets as
    h200-cached-open-loop but for the DiT's batch axes — cached hops up to 16 requests, offline / final calls up to
    32 CFG rows — so the same simulated traffic still runs in its buckets."""
    base, wide = load_profile("h200-cached-open-loop"), load_profile("h200-cached-open-loop-b16")
    for s, m in (("dit", "stream"), ("hift", "stream"), ("hift", "offline")):
        assert wide.buckets(s, m) == base.buckets(s, m)
    bc, wc = base.stage("dit").cached, wide.stage("dit").cached
    assert (wc.frames, wc.prefix) == (bc.frames, bc.prefix) and max(wc.batch) == 16 and len(wc.keys()) == 96
    assert {b.length for b in wide.buckets("dit", "offline")} == {b.length for b in base.buckets("dit", "offline")}
    assert max(b.batch for b in wide.buckets("dit", "offline")) == 32
    reqs = [WorkloadRequest(None, 8, n, None, s, "g", 0, t)
            for t, n, s in ((0.0, 150, True), (0.1, 400, False), (0.15, 90, True), (0.2, 1000, True))]
    calls = simulate(reqs, cached=CachedHops(cap=16))
    tables = {(s, m): wide.table(s, m) for s in ("dit", "hift") for m in ("stream", "offline")}
    assert hit_rates(rate_calls(calls, tables))["total"]["hit_rate"] == 1.0


def test_mixed_profile_covers_the_matrix_waves_too():
    """h200-mixed (derived from open-loop traffic plus the matrix's waves, `--plus-matrix`) runs every simulated
    call of the default matrix in a bucket, where the open-loop-only profile falls back for most HiFT windows
    (BENCHMARKS.md, runs 36-39: 142 of 888 calls)."""
    from cosytrt.tools.coverage_workload import default_matrix

    cells: dict = {}
    for r in default_matrix():  # each matrix cell is its own run (a wave submitted at t = 0)
        cells.setdefault(r.group, []).append(r)
    for name, covered in (("h200-mixed", True), ("h200-cached-open-loop", False)):
        p = load_profile(name)
        calls = []
        for cell in cells.values():
            calls += simulate(cell, 75, cached=CachedHops(cap=max(p.stage("dit").cached.batch)))
        tables = {(s, m): p.table(s, m) for s in ("dit", "hift") for m in ("stream", "offline")}
        assert (hit_rates(rate_calls(calls, tables))["total"]["hit_rate"] == 1.0) == covered, name


def _stream_runtime_calls(flow, P: int, n_tokens: list[int]) -> list[tuple]:
    """(requests, new frames, prefix frames) of every cached-hop estimator call the runtime makes for streams of one
    saved voice run one after another (flow_rows through CachedHopGraphs, each non-final hop of upstream's
    schedule)."""
    from cosytrt.runtime.models.flow import FlowInput
    from cosytrt.runtime.stages.flow_cache import FlowCachePool
    from cosytrt.runtime.stages.flow_hop_calls import CachedGrid, CachedHopGraphs
    from cosytrt.runtime.stages.flow_hops import flow_rows
    from cosytrt.runtime.stages.token2wav import LOOKAHEAD

    from test_flow_cache import hop_ends, make_prompt, make_tokens

    hops = CachedHopGraphs(flow.estimator, CachedGrid((1,), (400,), (0, 2000)), "cpu", graphs=False)
    seen = []
    real_run = hops.run

    def run(store, arena, rows, N, P_, consts):
        seen.append((len(rows), N, P_))
        return real_run(store, arena, rows, N, P_, consts)

    hops.run = run
    prompt = make_prompt(flow, P, 7)
    pool = FlowCachePool(1 << 30)
    for i, n in enumerate(n_tokens):
        st, tokens = pool.new_state(), make_tokens(flow, n, 10 + i)
        for upto in hop_ends(P, n):
            flow_rows(flow, [FlowInput(tokens[:upto + LOOKAHEAD], *prompt, False, st)], True, hops=hops)
        st.close()
    return seen


def test_simulated_cached_hops_are_the_runtimes():
    """With CachedHops, a stream's simulated cached-hop calls (requests, new frames, prefix frames: 10 per hop) are
    exactly the ones the runtime's prefix-cached hops make (the real flow_rows through CachedHopGraphs, golden
    full-geometry flow): the first stream of a voice computes its prompt, later ones start after the cached prompt
    chunks; finals stay full-attention DiT calls."""
    from cosytrt.runtime.models.checkpoint import read_state_dict
    from cosytrt.runtime.models.config import config_from_golden_json
    from cosytrt.runtime.models.flow import Flow
    from cosytrt.runtime.stages.flow_cache import prompt_cacheable_frames

    golden = os.path.join(os.path.dirname(__file__), "data", "golden")
    flow = Flow(config_from_golden_json(os.path.join(golden, "config.json")).flow).eval().load_checkpoint(
        read_state_dict(os.path.join(golden, "flow.pt")))
    P, lengths = 60, [260, 140]
    ch = CachedHops()
    assert ch.prompt_split(P) == prompt_cacheable_frames(flow, P) == 100
    reqs = [WorkloadRequest(None, 8, n, None, True, "s", 0, 100.0 * i) for i, n in enumerate(lengths)]
    calls = simulate(reqs, prompt_tokens=P, cached=ch)
    assert ch.calls == _stream_runtime_calls(flow, P, lengths)
    assert ch.calls[0] == (1, 2 * (P + 40), 0)  # the voice's first hop: prompt + 40 tokens, no prefix
    assert (1, 2 * (P + 40) - 100, 100) in ch.calls  # the next stream's: after the 2 cached prompt chunks
    assert not [c for c in calls if c[:2] == ("dit", "stream")]  # no whole-history hop left
    assert Counter(c[1] for c in calls if c[0] == "dit") == {"offline": 20}  # two finals, 10 steps each


def test_step_level_cached_hops_share_calls_and_derive_a_grid():
    """Overlapping streams: step-level calls hold rows at different steps and prefixes (the call's new frames and
    prefix are the largest of its rows); the derived cached grid holds every call, within the graph budget."""
    from cosytrt.runtime.stages.flow_hop_calls import CachedGrid
    from cosytrt.tools.coverage_profile import derive_cached_grid
    from cosytrt.tools.coverage_sim import rate_cached

    reqs = [WorkloadRequest(None, 8, n, None, True, "s", 0, t)
            for t, n in ((0.0, 600), (0.05, 300), (0.3, 900), (0.35, 450), (0.4, 200), (0.9, 700))]
    ch = CachedHops(cap=4)
    simulate(reqs, prompt_tokens=75, cached=ch)
    assert 2 <= max(b for b, _, _ in ch.calls) <= 4
    for max_graphs in (64, 16):
        g = derive_cached_grid(ch.calls, max_graphs)
        grid = CachedGrid(g["batch"], g["frames"], g["prefix"])
        r = rate_cached(ch.calls, grid)
        assert r["hit_rate"] == 1.0 and r["graphs"] == g["graphs"] <= max_graphs
        assert g["batch"] == [1, 2, 4][:len(g["batch"])] and 0 in g["prefix"]
        assert all(any(p <= q <= p * g["prefix_ratio"] + 1e-9 for q in g["prefix"]) for _, _, p in ch.calls if p)
    top = max(p for _, _, p in ch.calls)
    assert derive_cached_grid(ch.calls, 64, ceiling=10 * top)["prefix"][-1] == 10 * top  # the old grid's reach kept
    assert rate_cached(ch.calls, None)["hit_rate"] == 0.0


def test_coverage_cli_cached_hops(tmp_path, capsys):
    """`trtbuild coverage --simulate --cached-hops --derive-profile`: the cached-hop calls rated against the
    profile's dit.cached grid and derived into the written profile, which the runtime loads."""
    out = tmp_path / "derived.yaml"
    assert main(["coverage", "--simulate", "--open-loop", "rate=4,duration=6,seed=1,stream=0.8", "--cached-hops",
                 "--max-cached-graphs", "32", "--derive-profile", str(out)]) == 0
    text = capsys.readouterr().out
    assert "dit/cached (prefix-cached hops, one call per Euler step)" in text and "160 graphs" in text
    prof = load_profile(str(out))
    grid = prof.stage("dit").cached
    assert grid is not None and len(grid.keys()) <= 32
    assert "--cached-hops --max-cached-graphs 32" in out.read_text()
    assert main(["coverage", "--engines", str(tmp_path), "--cached-hops"]) == 2
    assert "--cached-hops goes with --simulate" in capsys.readouterr().err


def test_coverage_cached_from_a_bench_run(tmp_path, capsys):
    """`--cached-from results.json`: the cached-hop shapes a GPU open-loop run recorded (every cell) are rated and
    derived instead of the simulated ones; a file without them, or without --cached-hops, is a clear error."""
    res = {"open_loop": {"cells": [{"cached_hops": {"shapes": {"1,100,200": 30, "3,200,900": 10}}},
                                   {"error": "x"}, {"cached_hops": {"shapes": {"2,100,1500": 20}}}]}}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(res))
    out = tmp_path / "d.yaml"
    assert main(["coverage", "--simulate", "--open-loop", "rate=2,duration=3,seed=1", "--cached-hops",
                 "--cached-from", str(path), "--derive-profile", str(out)]) == 0
    text = capsys.readouterr().out
    assert "dit/cached (prefix-cached hops, one call per Euler step): 60 calls" in text
    grid = load_profile(str(out)).stage("dit").cached
    assert grid.batch == (1, 2, 3) and grid.frames == (100, 200)  # powers of two up to the largest, the frames seen
    assert all(grid.select(b, n, p) is not None for b, n, p in ((1, 100, 200), (3, 200, 900), (2, 100, 1500)))
    header = " ".join(line.lstrip("# ") for line in out.read_text().splitlines() if line.startswith("#"))
    assert "--cached-from" in header and "recorded in" in header
    path.write_text(json.dumps({"open_loop": {"cells": [{}]}}))
    assert main(["coverage", "--simulate", "--open-loop", "rate=2,duration=3,seed=1", "--cached-hops",
                 "--cached-from", str(path)]) == 2
    assert "holds no cached-hop call shapes" in capsys.readouterr().err
    assert main(["coverage", "--simulate", "--open-loop", "rate=2,duration=3,seed=1", "--cached-from", str(path)]) == 2
    assert "--cached-from goes with --simulate --cached-hops" in capsys.readouterr().err


def test_plus_matrix_adds_the_waves(tmp_path, capsys):
    """--plus-matrix: the matrix's cells join the open-loop traffic (each its own run) before a profile is derived;
    without --open-loop it is an error that names it."""
    from cosytrt.tools.coverage_workload import default_matrix

    prof = tmp_path / "mixed.yaml"
    assert main(["coverage", "--simulate", "--open-loop", "rate=2,duration=3,seed=1", "--plus-matrix", "--quick",
                 "--json", "--derive-profile", str(prof), "--quiet"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert "plus the default matrix" in r["workload"]["source"]
    assert r["workload"]["requests"] > len(default_matrix(quick=True))
    assert "--plus-matrix" in " ".join(line.lstrip("# ") for line in prof.read_text().splitlines()[:12])
    assert main(["coverage", "--simulate", "--matrix", "default", "--plus-matrix"]) == 2
    assert "--plus-matrix goes with --open-loop" in capsys.readouterr().err
