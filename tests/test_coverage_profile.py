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
from cosytrt.tools.coverage_sim import FINAL, HiFTGeometry, HiFTWindows, hit_rates, rate_calls, simulate
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


def test_shipped_open_loop_profile_loads_and_covers_its_simulation():
    p = load_profile(os.path.join(os.path.dirname(__file__), "..", "profiles", "h200-open-loop.yaml"))
    assert p.model == "full" and p.max_padding_waste == 1.5
    assert all(len(p.buckets(s, m)) <= 32 for s in ("dit", "hift") for m in ("stream", "offline"))
    reqs = [WorkloadRequest(None, 8, n, None, s, "g", 0, t)
            for t, n, s in ((0.0, 150, True), (0.1, 400, False), (0.15, 90, True))]
    calls = simulate(reqs)
    tables = {(s, m): p.table(s, m) for s in ("dit", "hift") for m in ("stream", "offline")}
    assert hit_rates(rate_calls(calls, tables))["total"]["hit_rate"] == 1.0
