"""`trtbuild bench --suite open_loop` on the CPU: the playback underrun math on hand-made chunk timelines, the seeded
Poisson / log-normal workload, the A/B settings and stats deltas, one tiny open-loop sweep end to end, and the report
(tables + PNG) from a small results JSON."""
from __future__ import annotations

import json
import math
import os

import pytest

from cosytrt.engines.errors import InputError
from cosytrt.tools.bench import report
from cosytrt.tools.bench.open_loop import ab_settings, stats_delta
from cosytrt.tools.bench.playback import OK, UNFINISHED, RequestRecord, percentile, saturated, summarize, underruns
from cosytrt.tools.bench.workload import (LogNormal, OpenLoopSpec, generate, offered_audio_s_per_s, parse_lengths,
                                          parse_open_loop)


# ------------------------------------------------------------------ playback underruns

@pytest.mark.parametrize("arrivals, durations, expected", [
    ([], [], (0, 0.0)),
    ([3.0], [1.0], (0, 0.0)),                               # one chunk: nothing to wait for
    ([0.0, 0.5, 1.0], [1.0, 1.0, 1.0], (0, 0.0)),           # each chunk arrives while the one before plays
    ([0.0, 1.0, 2.0], [1.0, 1.0, 1.0], (0, 0.0)),           # exactly when the audio before it ends: no gap
    ([0.0, 1.5, 2.0], [1.0, 1.0, 1.0], (1, 0.5)),           # 0.5 s of silence, then the buffer holds
    ([0.0, 0.1, 0.2, 2.5], [1.0, 1.0, 1.0, 1.0], (0, 0.0)),  # 3 s buffered absorb a late fourth chunk
    ([0.0, 2.0, 4.0], [1.0, 1.0, 1.0], (2, 2.0)),           # every chunk late: playback restarts at each arrival
    ([1.0, 1.2, 3.0, 3.1], [0.5, 0.5, 2.0, 0.1], (1, 1.0)),  # ends 1.5, 2.0; third at 3.0 stalls 1.0; fourth is fine
])
def test_underruns_of_hand_made_timelines(arrivals, durations, expected):
    n, stall = underruns(arrivals, durations)
    assert n == expected[0] and stall == pytest.approx(expected[1])


def test_underrun_tolerance_and_bad_input():
    assert underruns([0.0, 1.01], [1.0, 1.0]) == (1, pytest.approx(0.01))
    assert underruns([0.0, 1.01], [1.0, 1.0], tolerance_s=0.02) == (0, 0.0)
    with pytest.raises(ValueError):
        underruns([0.0, 1.0], [1.0])


def test_percentile_matches_numpy():
    import numpy as np

    vals = [0.3, 0.1, 2.0, 0.7, 0.2]
    for q in (50, 95, 99):
        assert percentile(vals, q) == pytest.approx(float(np.percentile(vals, q)))
    assert percentile([], 50) is None


def test_summarize_cell():
    recs = [
        RequestRecord(0.0, 3.0, True, [0.2, 1.0, 2.0], [1.0, 1.0, 1.0]),          # smooth
        RequestRecord(1.0, 2.0, True, [1.5, 3.0], [1.0, 1.0]),                    # stalls 0.5 s
        RequestRecord(2.0, 4.0, True, [2.4, 4.0, 6.5, 6.6], [1.0, 1.0, 1.0, 1.0]),  # stalls 0.6 and 1.5
        RequestRecord(3.0, 2.0, False, [3.8], [2.0]),                             # offline: latency 0.8
        RequestRecord(9.5, 8.0, True, [], [], UNFINISHED, "cut"),                # no audio by the end (12.0)
    ]
    s = summarize(recs, duration_s=10.0, end_t=12.0)
    assert (s["requests"], s["streams"], s["offline"], s["completed"], s["unfinished"]) == (5, 4, 1, 4, 1)
    ttfa = [0.2, 0.5, 0.4, 12.0 - 9.5]
    assert s["ttfa"]["n"] == 4 and s["ttfa"]["censored"] == 1
    assert s["ttfa"]["p50"] == pytest.approx(percentile(ttfa, 50)) and s["ttfa"]["max"] == pytest.approx(2.5)
    assert s["offline_latency"]["p50"] == pytest.approx(0.8)
    assert s["underrun_requests"] == 2 and s["underrun_fraction"] == pytest.approx(2 / 3)
    assert s["underrun_events"] == 3 and s["stall_s"] == pytest.approx(0.5 + 0.6 + 1.5)
    assert s["stall_max_s"] == pytest.approx(2.1)
    assert s["offered_audio_s_per_s"] == pytest.approx((3 + 2 + 4 + 2 + 8) / 10)
    assert s["achieved_audio_s_per_s"] == pytest.approx((3 + 2 + 4 + 2) / 10)  # every chunk arrived by t = 10
    assert s["delivered_audio_s_per_s"] == pytest.approx(11 / 12)
    gaps = [0.8, 1.0, 1.5, 1.6, 2.5, 0.1]
    assert s["inter_chunk_p95"] == pytest.approx(percentile(gaps, 95))
    assert s["ttfa_parts"] == {}  # no marks recorded


def test_ttfa_parts_split_time_to_first_audio():
    from cosytrt.tools.bench.playback import ttfa_parts

    marks = {"tokenized": 0.002, "frontend_done": 0.005, "prefill": 0.01, "dit_queued": 0.11, "dit_start": 0.13,
             "dit_end": 0.18}
    recs = [RequestRecord(0.0, 3.0, True, [0.2], [1.0], marks=marks, ttfa_s=0.2),
            RequestRecord(1.0, 3.0, True, [1.4], [1.0], marks={k: 2 * v for k, v in marks.items()}, ttfa_s=0.4),
            RequestRecord(2.0, 2.0, False, [2.5], [2.0], marks=marks, ttfa_s=0.5),    # offline: not counted
            RequestRecord(3.0, 2.0, True, [3.5], [2.0], marks={"prefill": 0.1}, ttfa_s=0.5)]  # marks missing
    p = ttfa_parts(recs)
    assert p["tokenizer"]["n"] == 2 and p["tokenizer"]["max"] == pytest.approx(0.004)
    assert p["frontend"]["p50"] == pytest.approx(0.0045) and p["admission"]["max"] == pytest.approx(0.01)
    assert p["ar"]["p50"] == pytest.approx(0.15) and p["dit_wait"]["max"] == pytest.approx(0.04)
    assert p["dit"]["p50"] == pytest.approx(0.075) and p["vocoder"]["max"] == pytest.approx(0.04)
    assert sum(v["share"] for v in p.values()) == pytest.approx(1.0)
    assert p["ar"]["share"] == pytest.approx(0.3 / 0.6)


def test_saturation_rule():
    ok = {"offered_audio_s_per_s": 40.0, "achieved_audio_s_per_s": 30.0, "duration_s": 10.0, "wall_s": 14.0,
          "delivered_audio_s_per_s": 400.0 / 14.0, "ttfa": {"p95": 0.3}, "unfinished": 0, "requests": 50}
    assert saturated(ok) is None  # the window trails offered by the lag to audio: not saturated
    assert "delivered" in saturated({**ok, "delivered_audio_s_per_s": 300.0 / 14.0})
    assert "unfinished" in saturated({**ok, "unfinished": 3})
    assert "TTFA p95" in saturated({**ok, "ttfa": {"p95": 6.0}})
    assert "TTFA p95" in saturated({**ok, "ttfa": {"p95": None}, "offline_latency": {"p95": 7.0}})
    # paced streams cut while still ahead of their listeners: neither unfinished nor offered-but-undelivered
    paced = {**ok, "unfinished": 3, "unfinished_ahead": 3, "undelivered_ahead_s": 120.0,
             "delivered_audio_s_per_s": 300.0 / 14.0}
    assert saturated(paced) is None
    assert "unfinished" in saturated({**paced, "unfinished_ahead": 2})
    assert "delivered" in saturated({**paced, "undelivered_ahead_s": 50.0})


def test_cut_streams_ahead_of_their_listener():
    """`summarize`: a stream cut at the end of the cell counts as `unfinished_ahead` when its listener still had
    audio to play then (the audio it did not deliver in `undelivered_ahead_s`), not when its playback had run dry."""
    recs = [RequestRecord(0.0, 20.0, True, [0.2, 1.0, 5.0], [1.0, 2.0, 4.0], status="unfinished"),  # plays to 7.2
            RequestRecord(1.0, 20.0, True, [1.2, 2.0], [1.0, 1.0], status="unfinished"),            # ran dry at 3.2
            RequestRecord(2.0, 3.0, True, [2.2], [3.0])]
    s = summarize(recs, duration_s=5.0, end_t=6.0)
    assert s["unfinished"] == 2 and s["unfinished_ahead"] == 1
    assert s["undelivered_ahead_s"] == pytest.approx(20.0 - 7.0)
    from cosytrt.tools.bench.report import _unfinished

    assert _unfinished(s) == "2 (1 ahead, 13 s to come)" and _unfinished({"unfinished": 0, "unfinished_ahead": 0}) == 0
    assert _unfinished({"unfinished": 3, "unfinished_ahead": 3}) == "3 (3 ahead)"


# ------------------------------------------------------------------ workload

def test_generator_is_seeded_poisson_within_bounds():
    spec = OpenLoopSpec(rate=8, duration_s=200, seed=3, stream_fraction=0.75)
    a = generate(spec)
    assert a == generate(spec) and a != generate(OpenLoopSpec(rate=8, duration_s=200, seed=4))
    assert [x.index for x in a] == list(range(len(a))) and [x.seed for x in a] == list(range(len(a)))
    ts = [x.t for x in a]
    assert ts == sorted(ts) and 0 <= ts[0] and ts[-1] < 200
    assert abs(len(a) - 1600) < 4 * math.sqrt(1600)                      # Poisson count: mean 1600, sd 40
    gaps = [b - c for b, c in zip(ts[1:], ts)]
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 8, rel=0.1)
    assert all(50 <= x.tokens <= 1000 for x in a)                          # 2-40 s at 25 tokens per second
    assert all(x.audio_s == x.tokens / 25 for x in a)
    med = sorted(x.audio_s for x in a)[len(a) // 2]
    assert 7.0 < med < 9.0                                                 # log-normal around 8 s
    assert 0.7 < sum(x.stream for x in a) / len(a) < 0.8
    # another rate, same seed: the same lengths and modes, in a different time pattern
    b = generate(spec.at_rate(16))
    n = min(len(a), len(b))
    assert [(x.tokens, x.stream) for x in a[:n]] == [(x.tokens, x.stream) for x in b[:n]]
    assert offered_audio_s_per_s(a, 200) == pytest.approx(sum(x.audio_s for x in a) / 200)


def test_length_mix_and_clipping():
    spec = OpenLoopSpec(rate=50, duration_s=40, seed=0, lengths=(LogNormal(3, 0.2, 0.5), LogNormal(30, 0.2, 0.5)),
                        min_s=2.0, max_s=32.0)
    a = generate(spec)
    short = sum(1 for x in a if x.audio_s < 10)
    assert 0.4 < short / len(a) < 0.6 and all(x.audio_s <= 32 for x in a) and all(x.audio_s >= 2 for x in a)
    assert any(x.audio_s == 32 for x in a)  # the upper tail is clipped


def test_spec_parsing():
    s = parse_open_loop("rate=8,duration=30,seed=0")
    assert (s.rate, s.duration_s, s.seed, s.stream_fraction, s.lengths) == (8, 30, 0, 1.0, (LogNormal(8.0, 0.6),))
    s = parse_open_loop("rate=2, duration=5, stream=0.5, lengths=6:0.5:0.8+20:0.4:0.2, min=1, max=30")
    assert s.lengths == (LogNormal(6, 0.5, 0.8), LogNormal(20, 0.4, 0.2)) and (s.min_s, s.max_s) == (1, 30)
    assert parse_lengths("8:0.6") == (LogNormal(8, 0.6),)
    for bad in ("rate=8", "duration=3", "rate=8,duration=30,speed=2", "rate=x,duration=3", "rate=0,duration=3",
                "rate=1,duration=3,stream=1.5", "rate=1,duration=3,min=5,max=2", "rate=1,duration=3,lengths=8"):
        with pytest.raises(InputError):
            parse_open_loop(bad)


# ------------------------------------------------------------------ A/B settings and stats

def test_ab_settings_accept_boolean_fields_and_skip_the_rest():
    from cosytrt.runtime.scheduling.scheduler import SchedulerConfig

    base = SchedulerConfig()
    settings, skipped = ab_settings(base, ["async_d2h", "no_such_flag", "max_in_flight"])
    assert settings == [("async_d2h off", {"async_d2h": False}), ("async_d2h on", {"async_d2h": True})]
    assert len(skipped) == 2 and "no_such_flag" in skipped[0] and "max_in_flight" in skipped[1]
    assert ab_settings(base, []) == ([("default", {})], [])
    assert ab_settings(base, ["flow_prefix_cache_not_here"])[0] == [("default", {})]
    # several fields switched together
    both, _ = ab_settings(base, ["async_d2h+continuous_batching"])
    assert both == [("async_d2h+continuous_batching off", {"async_d2h": False, "continuous_batching": False}),
                    ("async_d2h+continuous_batching on", {"async_d2h": True, "continuous_batching": True})]
    # explicit settings
    one, skipped = ab_settings(base, ["async_d2h=0+continuous_batching=1", "async_d2h=2"])
    assert one == [("async_d2h=0+continuous_batching=1", {"async_d2h": False, "continuous_batching": True})]
    assert len(skipped) == 1 and "async_d2h='2' is not a valid bool" in skipped[0]
    # numeric fields in explicit settings (config_overrides, as `serve --scheduler`): typed, range-checked
    num, skipped = ab_settings(base, ["dit_max_requests=16+hift_max_wait_ms=0", "dit_max_requests=0",
                                      "dit_max_requests=many", "ar_graph_batches=1"])
    assert num == [("dit_max_requests=16+hift_max_wait_ms=0", {"dit_max_requests": 16, "hift_max_wait_ms": 0.0})]
    assert len(skipped) == 3 and "dit_max_requests" in skipped[0] and "not a valid int" in skipped[1]
    assert "not a boolean, numeric or string SchedulerConfig field" in skipped[2]
    # the admission limits too (start_tts gives them to the TTS's admission control): load shedding as an A/B
    adm, skipped = ab_settings(base, ["max_in_flight=24+on_full=reject", "on_full=maybe"])
    assert adm == [("max_in_flight=24+on_full=reject", {"max_in_flight": 24, "on_full": "reject"})]
    assert len(skipped) == 1 and "on_full" in skipped[0]


def test_start_tts_gives_a_reconfigured_tts_the_settings_admission_limits():
    from types import SimpleNamespace

    from cosytrt.runtime.scheduling.admission import AdmissionControl
    from cosytrt.runtime.scheduling.config import SchedulerConfig
    from cosytrt.tools.bench.common import start_tts

    calls = []
    tts = SimpleNamespace(scheduler_config=SchedulerConfig(), admission=AdmissionControl(64),
                          reconfigure=lambda cfg: calls.append(cfg), synthesize=lambda *a, **k: None,
                          stream=lambda *a, **k: iter(()))
    cfg = SchedulerConfig(max_in_flight=24, on_full="reject", submit_timeout_s=2.0)
    assert start_tts(None, cfg, tts) is tts and calls == [cfg]
    assert tts.admission.limits == {"max_in_flight": 24, "max_waiting": None, "timeout_s": 2.0, "on_full": "reject"}


def test_stats_delta_reads_what_is_there():
    before = {"busy_s": {"ar": 1.0, "dit": 2.0}, "dit": {"frames_computed": 100, "frames_reused": 10},
              "shapes": {"stages": {"dit/stream": {"calls": 10, "hits": 8, "fallback_reasons": {"no_cover": 2}}}}}
    after = {"busy_s": {"ar": 2.0, "dit": 4.0, "hift": 1.0}, "dit": {"frames_computed": 300, "frames_reused": 110},
             "shapes": {"stages": {"dit/stream": {"calls": 30, "hits": 24, "fallback_reasons": {"no_cover": 6}},
                                   "hift/offline": {"calls": 4, "hits": 4}}}}
    d = stats_delta(before, after, 4.0)
    assert d["busy"] == {"ar": 0.25, "dit": 0.5, "hift": 0.25}
    assert d["buckets"]["dit/stream"] == {"calls": 20, "hits": 16, "fallbacks": 4, "hit_rate": 0.8}
    assert d["buckets"]["hift/offline"]["hit_rate"] == 1.0 and d["fallbacks"] == 4
    assert d["fallback_reasons"] == {"dit/stream: no_cover": 4}
    assert d["fallback_shapes"] == {}
    shaped = stats_delta(
        {"shapes": {"fallback_shapes": [{"stage_mode": "dit/offline", "b": 3, "n": 900, "count": 2}]}},
        {"shapes": {"fallback_shapes": [{"stage_mode": "dit/offline", "b": 3, "n": 900, "count": 5},
                                        {"stage_mode": "hift/stream", "b": 1, "n": 130, "count": 1},
                                        {"stage_mode": "dit/stream", "b": 1, "n": 50, "count": 0}]}}, 1.0)
    assert shaped["fallback_shapes"] == {"dit/offline 3,900": 3, "hift/stream 1,130": 1}
    assert d["dit_frames"] == {"frames_computed": 200, "frames_reused": 100, "cache_fallbacks": None}
    assert d["dit_calls"] == {}
    bare = stats_delta({}, {"busy_s": {"ar": 1.0}}, 2.0)  # no engine set, no DiT frame counters
    assert bare["buckets"] is None and bare["fallbacks"] is None
    assert bare["dit_frames"] == {"frames_computed": None, "frames_reused": None, "cache_fallbacks": None}
    kinds = stats_delta({"dit": {"kinds": {"cached/step": {"calls": 10, "rows": 15}}}},
                        {"dit": {"kinds": {"cached/step": {"calls": 30, "rows": 55}, "offline": {"calls": 2,
                                                                                                 "rows": 3}}}}, 1.0)
    assert kinds["dit_calls"] == {"cached/step": {"calls": 20, "rows": 40, "rows_per_call": 2.0},
                                  "offline": {"calls": 2, "rows": 3, "rows_per_call": 1.5}}
    assert bare["cached_hops"] is None
    hops = stats_delta({"flow_cache": {"hop_graphs": {"hits": 5, "misses": 1, "shapes": {"1,100,200": 5},
                                                      "replays": {"1,100,200": 5}}}},
                       {"flow_cache": {"hop_graphs": {"hits": 25, "misses": 1, "capture_failed": 0,
                                                      "shapes": {"1,100,200": 15, "2,200,400": 10},
                                                      "replays": {"1,100,200": 15, "2,200,400": 10}}}}, 1.0)
    assert hops["cached_hops"] == {"hits": 20, "misses": 0, "capture_failed": 0,
                                   "shapes": {"1,100,200": 10, "2,200,400": 10},
                                   "replays": {"1,100,200": 10, "2,200,400": 10}}
    ar = stats_delta({"ar": {"decode_steps": 10, "decode_rows": 15, "sampled_graph_replays": 0}},
                     {"ar": {"decode_steps": 30, "decode_rows": 75, "sampled_graph_replays": 15}}, 1.0)["ar_steps"]
    assert ar["decode_steps"] == 20 and ar["rows_per_step"] == 3.0 and ar["sampled_share"] == 0.75
    assert bare["ar_steps"]["decode_steps"] is None and "rows_per_step" not in bare["ar_steps"]
    assert bare["prefix_pool"] is None
    pool = stats_delta({"dit": {"flow_cache": {"cached_hops": 100, "fallback_hops": 10, "whole_hops": 1}}},
                       {"dit": {"flow_cache": {"cached_hops": 300, "fallback_hops": 90, "whole_hops": 3,
                                               "peak_bytes": 59.9e9, "budget_bytes": 60e9}}}, 1.0)["prefix_pool"]
    assert pool == {"cached_hops": 200, "fallback_hops": 80, "whole_hops": 2, "peak_bytes": 59.9e9,
                    "budget_bytes": 60e9}
    assert report._pool(pool) == "80 / 202, 59.9 / 60.0" and report._pool(None) == "-"


def test_allocator_events_and_their_report_cells(monkeypatch):
    """The cell's CUDA allocator counters are a difference of `torch.cuda.memory_stats()` (None without CUDA), and
    the report shows them and the AR steps' graph-sampled share, '-' where a cell has none (older results)."""
    from cosytrt.tools.bench import open_loop
    from cosytrt.tools.bench.report import _alloc, _ar_steps

    monkeypatch.setattr(open_loop.torch.cuda, "is_available", lambda: False)
    assert open_loop.allocator_events() is None
    stats = {"num_alloc_retries": 2, "num_device_free": 7, "num_device_alloc": 9}
    monkeypatch.setattr(open_loop.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(open_loop.torch.cuda, "memory_stats", lambda: dict(stats))
    before = open_loop.allocator_events()
    stats.update(num_alloc_retries=5, num_device_free=8)
    d = open_loop.allocator_events(before)
    assert d == {"num_alloc_retries": 3, "num_ooms": 0, "num_device_alloc": 0, "num_device_free": 1,
                 "num_sync_all_streams": 0}
    assert _alloc(d) == "3 / 1" and _alloc(None) == "-"
    assert _ar_steps({"decode_steps": 4, "rows_per_step": 1.5, "sampled_share": 0.25}) == "1.50, 25 %"
    assert _ar_steps({"decode_steps": 4, "rows_per_step": 1.5, "sampled_share": None}) == "1.50, -"
    assert _ar_steps({"decode_steps": 4, "rows_per_step": 1.5, "sampled_share": 0.0,
                      "first_audio_hold_s": 0.25}) == "1.50, 0 %, held 0.25 s"
    assert _ar_steps(None) == "-"
    from cosytrt.tools.bench.report import _top
    assert _top({"a": 1, "b": 3, "c": 3}, 2) == "b (3), c (3)"


# ------------------------------------------------------------------ end to end (tiny model, CPU) and report

@pytest.fixture(scope="module")
def tiny_open_loop(tmp_path_factory, one_torch_thread):
    from cosytrt.runtime.stages import compiled
    from cosytrt.tools.trtbuild import main

    from cosytrt.runtime.scheduling import scheduler

    out = tmp_path_factory.mktemp("open_loop")
    saves, runners = [], []
    real_runner = scheduler.make_ar_runner
    with pytest.MonkeyPatch.context() as mp:  # the compile cache is saved once the first scheduler is ready, and
        mp.setattr(compiled, "save_compile_cache", lambda path: saves.append(path) or 0)  # after the section
        mp.setattr(scheduler, "make_ar_runner", lambda *a, **k: runners.append(1) or real_runner(*a, **k))
        assert main(["bench", "--device", "cpu", "--model", "tiny", "--dtype", "float32", "--suite", "open_loop",
                     "--variants", "eager", "--rates", "2", "--duration-s", "2", "--drain-s", "60", "--lengths",
                     "1:0.3", "--min-s", "0.6", "--max-s", "1.6", "--stream-fraction", "0.5", "--seed", "3",
                     "--ab", "async_d2h,no_such_flag", "--compile-cache", str(out / "cc.bin"),
                     "--out", str(out)]) == 0
    assert saves == [str(out / "cc.bin")] * 2
    assert len(runners) == 1  # the A/B's two settings ran on one AR runner (TTS.reconfigure), built once
    return out, json.loads((out / "results.json").read_text())


def test_tiny_open_loop_sweep(tiny_open_loop):
    _, res = tiny_open_loop
    ol = res["open_loop"]
    arrivals = generate(OpenLoopSpec(2, 2, 3, 0.5, (LogNormal(1, 0.3),), 0.6, 1.6))
    assert len(arrivals) == 3 and 0 < sum(a.stream for a in arrivals) < 3  # streaming and offline
    assert [s["label"] for s in ol["settings"]] == ["async_d2h off", "async_d2h on"]
    first, second = ol["settings"]  # where a scheduler start's seconds went (the second reused the AR runner)
    assert set(first["scheduler_setup_parts_s"]) == set(second["scheduler_setup_parts_s"]) == {"ar_runner"}
    assert all(v >= 0 for s in (first, second) for v in s["scheduler_setup_parts_s"].values())
    assert first["stats"]["setup_s"] == first["scheduler_setup_parts_s"]
    assert len(ol["ab_skipped"]) == 1 and "no_such_flag" in ol["ab_skipped"][0]
    assert [c["setting"] for c in ol["cells"]] == ["async_d2h off", "async_d2h on"]
    for c in ol["cells"]:
        assert "error" not in c and c["rate"] == 2 and c["requests"] == len(arrivals)
        assert c["completed"] == c["requests"] and c["failed"] == c["unfinished"] == 0
        assert c["streams"] == sum(a.stream for a in arrivals) and c["ttfa"]["n"] == c["streams"]
        assert c["offered_audio_s_per_s"] == pytest.approx(sum(a.audio_s for a in arrivals) / 2)
        assert 0 < c["delivered_audio_s_per_s"] and c["wall_s"] > max(a.t for a in arrivals)
        # submitted at their arrival times: no chunk before its request was due
        for (t, audio, stream, first, last, chunks, status), a in zip(c["request_rows"], arrivals):
            assert t == pytest.approx(a.t, abs=1e-3) and status == OK and first >= t and last >= first
            assert chunks >= 1 and (stream or chunks == 1)
        assert set(c["busy"]) == {"ar", "dit", "hift"} and c["buckets"] is None  # eager: no engine set
        assert c["gil_wait_ms"]["n"] > 0 and c["gil_wait_ms"]["p50"] >= 0  # the lock probe ran through the cell
        assert c["dit_frames"].keys() == {"frames_computed", "frames_reused", "cache_fallbacks"}
        assert sum(v["calls"] for v in c["dit_calls"].values()) >= c["requests"]
        parts = c["ttfa_parts"]  # every stream has all marks: the parts add up to its time to first audio
        assert set(parts) == {"tokenizer", "frontend", "admission", "ar", "dit_wait", "dit", "vocoder"}
        assert all(p["n"] == c["streams"] and p["p50"] >= 0 for p in parts.values())
        assert sum(p["share"] for p in parts.values()) == pytest.approx(1.0)
        assert c["underrun_requests"] <= c["streams"]


def test_tiny_open_loop_report(tiny_open_loop, tmp_path):
    out, _ = tiny_open_loop
    assert report.main([str(out / "results.json"), "--out", str(tmp_path)]) == 0
    md = (tmp_path / "bench_tables.md").read_text()
    assert "**Open loop (eager variant)**" in md and "| async_d2h off | 2 |" in md.replace(".0 |", " |")
    assert "**Open loop: set-up per setting**" in md and "| setting | scheduler s | ar_runner s |" in md
    assert (tmp_path / "bench_open_loop.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _cell(setting, rate, offered, achieved, p50, under):
    return {"setting": setting, "rate": rate, "offered_audio_s_per_s": offered, "achieved_audio_s_per_s": achieved,
            "delivered_audio_s_per_s": achieved, "requests": 10, "streams": 10, "offline": 0,
            "ttfa": {"p50": p50, "p95": 2 * p50, "p99": 3 * p50}, "offline_latency": {"p95": None},
            "inter_chunk_p95": 0.4, "underrun_requests": round(10 * under), "underrun_fraction": under,
            "stall_s": 3.5, "unfinished": 0, "failed": 0, "saturated": None,
            "busy": {"ar": 0.5, "dit": 0.9, "hift": 0.4},
            "buckets": {"dit/stream": {"calls": 50, "hits": 40, "fallbacks": 10, "hit_rate": 0.8},
                        "hift/offline": {"calls": 5, "hits": 2, "fallbacks": 3, "hit_rate": 0.4}},
            "fallbacks": 13, "dit_frames": {"frames_computed": 5000, "frames_reused": None}, "compiles": 0,
            "peak_gpu_gb": 30.0,
            "ttfa_parts": {k: {"p50": 0.01, "p95": 0.02, "share": 0.2}
                           for k in ("tokenizer", "frontend", "admission", "ar", "dit_wait", "dit", "vocoder")},
            "dit_calls": {"cached/step": {"calls": 40, "rows": 100, "rows_per_call": 2.5}},
            "cached_hops": {"hits": 30, "misses": 10, "capture_failed": 0,
                            "shapes": {"1,100,200": 25, "2,200,400": 5, "9,100,0": 10},
                            "replays": {"1,100,200": 25, "2,200,400": 5}}}


def test_a_one_rate_ab_is_drawn_as_bars_a_sweep_as_lines(tmp_path, monkeypatch):
    """An A/B at one load (runs 59-60: one rate, four settings) would be one dot per setting on the offered-load axis:
    the plot draws grouped bars per setting instead; a rate sweep keeps its lines."""
    from cosytrt.tools.bench import report

    drawn = []
    for name in ("_open_loop_bars", "_open_loop_lines"):
        real = getattr(report, name)
        monkeypatch.setattr(report, name, lambda plt, c, s, _r=real, _n=name: drawn.append(_n) or _r(plt, c, s))
    one_rate = {"open_loop": {"variant": "compiled", "cells": [_cell("hift_own_stream=0", 12, 119.0, 74.0, 0.65, 0.75),
                                                              _cell("hift_own_stream=1", 12, 119.0, 82.0, 0.74, 0.65)]}}
    sweep = {"open_loop": {"variant": "compiled", "cells": [_cell("a", 4, 37.0, 36.0, 0.27, 0.0),
                                                           _cell("a", 8, 75.0, 61.0, 0.92, 0.2)]}}
    for res in (one_rate, sweep):
        path = report.open_loop_plot(res, str(tmp_path))
        assert open(path, "rb").read()[:8] == b"\x89PNG\r\n\x1a\n"
    assert drawn == ["_open_loop_bars", "_open_loop_lines"]


def test_report_of_a_small_open_loop_json(tmp_path):
    res = {"meta": {"commit": "abc1234", "gpu": "NVIDIA H200", "model": "full"},
           "open_loop": {"variant": "compiled", "rates": [4, 8],
                         "spec": {"rate": 4, "duration_s": 20, "seed": 0, "stream_fraction": 1.0, "min_s": 2,
                                  "max_s": 40, "lengths": [[8, 0.6, 1]]},
                         "ab_skipped": ["--ab nope: not a boolean field of SchedulerConfig in this build, skipped"],
                         "cells": [_cell("flow_prefix_cache off", 4, 37.0, 36.0, 0.27, 0.02),
                                   _cell("flow_prefix_cache off", 8, 75.0, 61.0, 0.92, 0.18),
                                   _cell("flow_prefix_cache on", 4, 37.0, 36.5, 0.09, 0.0),
                                   _cell("flow_prefix_cache on", 8, 75.0, 74.0, 0.12, 0.0),
                                   {"setting": "flow_prefix_cache on", "rate": 16, "error": "RuntimeError('x')"}]}}
    res["open_loop"]["cells"][3]["stacks"] = {"cosytrt-ar": {
        "samples": 200, "cosytrt": [["ar_worker.py:_decode:250", 0.62], ["sampling.py:ids_to_host:78", 0.2]],
        "leaf": [["threading.py:wait:355", 0.3]]}}
    md = report.open_loop_tables(res)
    assert "where the worker threads' time goes" in md
    assert "| flow_prefix_cache on | 8 | cosytrt-ar | 200 | ar_worker.py:_decode:250 62 %; sampling.py:ids_to_host:78 20 % " \
           "| threading.py:wait:355 30 % |" in md
    assert "Poisson arrivals for 20 s per rate" in md and "log-normal(median 8 s, sigma 0.6)" in md
    assert "drain" not in md.split("\n")[0]  # the cells carry no drain_s: no caveat
    short = {**res, "open_loop": {**res["open_loop"], "cells": [{**c, "drain_s": 8.0} for c in res["open_loop"]["cells"]]}}
    assert "The drain (8 s) is shorter than the longest request (40 s)" in report.open_loop_tables(short)
    long_drain = {**res, "open_loop": {**res["open_loop"],
                                       "cells": [{**c, "drain_s": 42.0} for c in res["open_loop"]["cells"]]}}
    assert "is shorter than the longest request" not in report.open_loop_tables(long_drain)
    assert "| flow_prefix_cache off | 8 | 75 | 61 |" in md and "| 10/0 | 0.92 | 1.84 | 2.76 |" in md
    assert "| hits dit/stream | hits hift/offline |" in md and "| 0.5 | 0.9 | 0.4 | 0.8 | 0.4 | 13 | 5000 | — |" in md
    assert "error: RuntimeError('x')" in md and "A/B: --ab nope" in md
    assert "where time to first audio goes" in md and "| 0.010 / 0.020 (20%) |" in md
    assert "| cached/step |" in md and "| 40 / 2.50 |" in md
    assert "cached-hop graphs" in md and "| 40 | 0.75 | 10 | 0 | 2 | 3 | 1,100,200 (25), 9,100,0 (10), 2,200,400 (5) |" in md
    path = report.open_loop_plot(res, str(tmp_path))
    assert path == str(tmp_path / "bench_open_loop.png") and (tmp_path / "bench_open_loop.png").stat().st_size > 0
    assert report.open_loop_tables({"serving": {}}) == "" and report.open_loop_plot({}, str(tmp_path)) is None


def test_open_loop_arguments_are_checked_before_any_model_work(tmp_path, capsys):
    from cosytrt.tools.trtbuild import main

    base = ["bench", "--device", "cpu", "--model", "tiny", "--suite", "open_loop", "--out", str(tmp_path)]
    for extra, what in ((["--rates", "4,x"], "--rates"), (["--rates", "0,4"], "positive rates"),
                        (["--lengths", "8"], "MEDIAN:SIGMA"), (["--stream-fraction", "2"], "stream fraction"),
                        (["--stream-fraction", "1,x"], "--stream-fraction"),
                        (["--stream-fraction", "1,-1"], "stream fraction"),
                        (["--drain-s", "-1"], "--drain-s")):
        assert main(base + extra) == 2
        assert what in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


def test_stack_sampler_counts_named_threads():
    import threading
    import time as _time

    from cosytrt.tools.bench.stacks import StackSampler, timed_sampler

    stop = threading.Event()

    def busy():
        while not stop.is_set():
            sum(range(1000))

    t = threading.Thread(target=busy, name="cosytrt-test", daemon=True)
    t.start()
    with StackSampler(0.001) as s:
        _time.sleep(0.1)
    stop.set()
    t.join()
    out = s.summary()
    assert out["cosytrt-test"]["samples"] > 0 and out["cosytrt-test"]["cosytrt"][0][0].startswith("test_bench")
    with timed_sampler(False) as none:
        assert none is None


def test_ab_switches_auto_fields():
    from cosytrt.runtime.scheduling.config import SchedulerConfig
    from cosytrt.tools.bench.open_loop import ab_settings

    base = SchedulerConfig()
    assert base.flow_prefix_cache is None  # auto
    settings, skipped = ab_settings(base, ["flow_prefix_cache", "max_in_flight"])
    assert [o for _, o in settings] == [{"flow_prefix_cache": False}, {"flow_prefix_cache": True}]
    assert len(skipped) == 1 and "max_in_flight" in skipped[0]


def test_flow_prefix_cache_setting_is_auto_or_bool():
    from cosytrt.engines.errors import InputError
    from cosytrt.runtime.scheduling.config import SchedulerConfig

    for ok in (None, True, False):
        assert SchedulerConfig(flow_prefix_cache=ok).flow_prefix_cache is ok
    for bad in ("on", 1, 0):
        with pytest.raises(InputError, match="flow_prefix_cache"):
            SchedulerConfig(flow_prefix_cache=bad)


def test_report_plots_name_engines_commit_gpu_and_keep_legends_off_the_data(tmp_path, monkeypatch):
    """#21 plots: every bench figure is titled with the engines (variants, graph profile), commit and GPU; legends
    sit under the panels, not on an axes; concurrency is a categorical axis (evenly spaced, labelled)."""
    pytest.importorskip("matplotlib")
    cells = [{"variant": v, "text": "short", "stream": True, "reference_audio": False, "concurrency": c,
              "rtf": {"p50": 0.1 * c}, "throughput_audio_s_per_s": 3.0 * c, "ttfa_samples": [0.1, 0.2]}
             for v in ("compiled", "graphs") for c in (1, 8, 32)]
    res = {"meta": {"commit": "abc1234", "gpu": "NVIDIA H200", "model": "full", "graph_profile": "h200-graphs"},
           "serving": {"cells": cells}}
    assert report.provenance(res) == ("engines: compiled, graphs (graph profile h200-graphs); cosytrt abc1234; "
                                      "NVIDIA H200; full model")
    seen = {}
    save = report._save

    def spy(fig, out_dir, name, res=None, axes=()):
        out = save(fig, out_dir, name, res, axes)
        seen[name] = (fig._suptitle.get_text() if fig._suptitle else "", [ax.get_legend() for ax in fig.axes],
                      [[t.get_text() for t in ax.get_xticklabels()] for ax in fig.axes],
                      [list(ax.get_xticks()) for ax in fig.axes], len(fig.legends))
        return out

    monkeypatch.setattr(report, "_save", spy)
    written = report.plots(res, str(tmp_path))
    assert {os.path.basename(p) for p in written} == {"bench_serving.png", "bench_ttfa.png"}
    for name, (title, legends, labels, ticks, fig_legends) in seen.items():
        assert "cosytrt abc1234" in title and "NVIDIA H200" in title and "compiled, graphs" in title, name
        assert all(lg is None for lg in legends) and fig_legends == 1, name
    _, _, labels, ticks, _ = seen["bench_serving.png"]
    assert labels[0] == ["1", "8", "32"] and ticks[0] == [0, 1, 2]


def test_graphs_ar_variant_compiles_only_the_ar():
    """`--variants graphs_ar`: eager DiT / HiFT in CUDA graphs, the AR compiled (SchedulerConfig.compile)."""
    from cosytrt.tools.bench.common import VARIANTS, scheduler_config

    assert "graphs_ar" in VARIANTS
    cfg = scheduler_config("graphs_ar")
    assert cfg.compile and cfg.cuda_graphs
    assert not scheduler_config("graphs").compile and scheduler_config("compiled").compile


def test_cached_hops_delta_reads_the_schedulers_stats(tiny_tts):
    """The cell's cached-hop numbers come from where Scheduler.stats() puts them (dit.flow_cache.hop_graphs): the
    runs of 2026-12-06 reported none because the bench looked for a top-level flow_cache."""
    from cosytrt.tools.bench.open_loop import cached_hops_delta

    assert "flow_cache" in tiny_tts.scheduler.stats()["dit"]

    def stats(hits, shapes):
        return {"dit": {"flow_cache": {"hop_graphs": {"hits": hits, "misses": 1, "capture_failed": 0,
                                                      "shapes": shapes, "replays": shapes}}}}

    d = cached_hops_delta(stats(3, {"1,100,200": 3}), stats(10, {"1,100,200": 5, "2,200,400": 2}))
    assert d == {"hits": 7, "misses": 0, "capture_failed": 0, "shapes": {"1,100,200": 2, "2,200,400": 2},
                 "replays": {"1,100,200": 2, "2,200,400": 2}}
    assert cached_hops_delta({}, {"dit": {"flow_cache": {}}}) is None  # no cached-hop graphs (eager, CPU)


def test_gil_probe_records_wakeups():
    import time

    from cosytrt.tools.bench.gil_probe import GilProbe

    with GilProbe(interval_s=0.002) as probe:
        time.sleep(0.05)
    d = probe.summary()
    assert d["n"] >= 5 and set(d) == {"p50", "p95", "p99", "max", "n"} and d["max"] >= d["p50"]


def test_open_loop_bench_imports_without_the_server_packages():
    """The open-loop bench runs where the serve extra is not installed (run 40 stopped on `import pydantic`: its lock
    probe came from the server package)."""
    import subprocess
    import sys

    code = ("import sys; import cosytrt.tools.bench.open_loop, cosytrt.tools.bench.gil_probe; "
            "bad = sorted(m for m in ('pydantic', 'fastapi', 'uvicorn', 'cosytrt.runtime.serving') "
            "if m in sys.modules); "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_stream_fraction_sweep_runs_each_share_in_one_process(tmp_path, one_torch_thread):
    """`--stream-fraction 1,0`: the same arrivals all streamed, then all offline, one set-up; labels name the share."""
    from cosytrt.tools.trtbuild import main

    assert main(["bench", "--device", "cpu", "--model", "tiny", "--dtype", "float32", "--suite", "open_loop",
                 "--variants", "eager", "--rates", "2", "--duration-s", "1.5", "--drain-s", "60", "--lengths",
                 "1:0.3", "--min-s", "0.6", "--max-s", "1.2", "--stream-fraction", "1,0", "--seed", "3",
                 "--out", str(tmp_path)]) == 0
    ol = json.loads((tmp_path / "results.json").read_text())["open_loop"]
    assert ol["stream_fractions"] == [1.0, 0.0] and len(ol["settings"]) == 1
    streamed, offline = ol["cells"]
    assert (streamed["setting"], offline["setting"]) == ("default / 100% streams", "default / 0% streams")
    assert streamed["requests"] == offline["requests"] == streamed["streams"] > 0 and offline["streams"] == 0
    assert streamed["completed"] == offline["completed"] == streamed["requests"]


def test_gpu_util_probe_reads_nvidia_smi_samples(tmp_path):
    """The per-cell GPU utilisation: nvidia-smi's CSV lines (a stand-in script here) become samples; lines that are
    not numbers are skipped; without CUDA / nvidia-smi nothing is sampled. The report shows mean / p50."""
    import stat
    import time

    from cosytrt.tools.bench.gpu_util import GpuUtilProbe

    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho \"$1 $2 $3 $4\" > \"$(dirname \"$0\")/args\"\n"
                    "printf '[N/A], [N/A]\\n90, 40\\n100, 50\\n80, 30\\n'\nexec sleep 30\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    with GpuUtilProbe(True, period_ms=50, device="1", exe=str(fake)) as probe:
        deadline = time.time() + 10
        while len(probe.gpu) < 3 and time.time() < deadline:
            time.sleep(0.02)
    assert probe.summary() == {"n": 3, "p50": 90.0, "p95": probe.summary()["p95"], "mean": 90.0, "mem_mean": 40.0}
    args = (tmp_path / "args").read_text().split()
    assert args[0] == "--id=1" and "--format=csv,noheader,nounits" in args and args[3] == "--loop-ms=50"
    assert GpuUtilProbe(False).__enter__().summary()["n"] == 0
    assert report._util({"n": 3, "mean": 90.0, "p50": 90.0}) == "90 / 90" and report._util({"n": 0}) == "-"


def test_graph_sampling_ab_shares_one_ar_runner(tmp_path, one_torch_thread):
    """`--ab ar_graph_sampling=0,ar_graph_sampling=1`: the second setting swaps the scheduler over the same AR runner
    (which takes the sampler on), no runner is built again (run 41 built one in 64.7 s)."""
    from cosytrt.runtime.scheduling import scheduler
    from cosytrt.tools.trtbuild import main

    runners = []
    real = scheduler.make_ar_runner
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(scheduler, "make_ar_runner", lambda *a, **k: runners.append(real(*a, **k)) or runners[-1])
        assert main(["bench", "--device", "cpu", "--model", "tiny", "--dtype", "float32", "--suite", "open_loop",
                     "--variants", "eager", "--rates", "2", "--duration-s", "1", "--drain-s", "60", "--lengths",
                     "1:0.3", "--min-s", "0.6", "--max-s", "1.2", "--seed", "3",
                     "--ab", "ar_graph_sampling=0,ar_graph_sampling=1", "--out", str(tmp_path)]) == 0
    ol = json.loads((tmp_path / "results.json").read_text())["open_loop"]
    assert [s["label"] for s in ol["settings"]] == ["ar_graph_sampling=0", "ar_graph_sampling=1"]
    assert len(runners) == 1 and runners[0].graph_sampler is not None
    assert all(c["completed"] == c["requests"] > 0 for c in ol["cells"])


def test_keep_alive_serves_queued_jobs_over_one_pipeline(tmp_path, one_torch_thread):
    """`--keep-alive DIR` (a bench process that stays up between device calls): after the pipeline's set-up it runs
    the jobs queued in DIR/queue, oldest first, each into DIR/done/ID/ with a DONE marker; a job whose flags do not
    parse finishes with its error and the next one still runs; the device / model / variant stay the process's; the
    process stops after its idle limit. Its own --rates / --ab are not run."""
    import os

    from cosytrt.runtime.scheduling import scheduler
    from cosytrt.tools.trtbuild import main

    d = tmp_path / "benchd"
    (d / "queue").mkdir(parents=True)
    jobs = {"a_bad": ["--rates", "2", "--no-such-flag"],
            "b_ok": ["--rates", "2", "--duration-s", "1.5", "--drain-s", "60", "--lengths", "1:0.3", "--min-s", "0.6",
                     "--max-s", "1.2", "--seed", "3", "--ab", "async_d2h", "--model", "full", "--device", "cuda"],
            "c_notalist": {"rates": 2}}
    for i, (name, flags) in enumerate(jobs.items()):
        p = d / "queue" / f"{name}.json"
        p.write_text(json.dumps(flags))
        os.utime(p, (1000 + i, 1000 + i))
    from cosytrt.runtime.stages import compiled

    runners, saves = [], []
    real_runner = scheduler.make_ar_runner
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(scheduler, "make_ar_runner", lambda *a, **k: runners.append(1) or real_runner(*a, **k))
        mp.setattr(compiled, "save_compile_cache", lambda path: saves.append(path) or 0)
        assert main(["bench", "--device", "cpu", "--model", "tiny", "--dtype", "float32", "--suite", "open_loop",
                     "--variants", "eager", "--rates", "99", "--keep-alive", str(d), "--keep-alive-idle-s", "1",
                     "--compile-cache", str(tmp_path / "cc.bin"), "--out", str(tmp_path / "boot")]) == 0
    assert saves == [str(tmp_path / "cc.bin")] * 2   # after the first job's first scheduler, and after the section
    assert not list((d / "queue").iterdir())
    assert (d / "done" / "a_bad" / "DONE").read_text().startswith("error:") and "no-such-flag" in \
        (d / "done" / "a_bad" / "DONE").read_text()
    assert (d / "done" / "c_notalist" / "DONE").read_text().startswith("error:")
    assert (d / "done" / "b_ok" / "DONE").read_text().strip() == "ok"
    res = json.loads((d / "done" / "b_ok" / "results.json").read_text())
    assert res["meta"]["model"] == "tiny"                       # the process's model, not the job's
    ol = res["open_loop"]
    assert ol["variant"] == "eager"                             # the process's variant (the report's header names it)
    assert ol["job"] == "b_ok" and len(ol["settings"]) == 2 and \
        sorted(s["overrides"]["async_d2h"] for s in ol["settings"]) == [False, True]
    assert ol["cells"] and all(c["rate"] == 2 for c in ol["cells"]) and ol["cells"][0]["completed"] > 0
    assert len(runners) == 1                                    # both settings over one AR runner
    boot = json.loads((tmp_path / "boot" / "results.json").read_text())["open_loop"]
    assert boot["cells"] == [] and boot["pipeline_setup_s"] > 0  # its own --rates 99 did not run


def test_bench_plans_parse_as_keep_alive_jobs(tmp_path):
    """Every job line of benchmarks/plans/*.txt (what benchmarks/bench_plan.sh queues on the GPU machine, split as a
    shell splits it) parses as the keep-alive process's job flags — a plan's typo would otherwise cost a device call."""
    import shlex
    from argparse import Namespace
    from pathlib import Path

    from cosytrt.tools.bench.cli import job_parser

    plans = sorted((Path(__file__).resolve().parents[1] / "benchmarks" / "plans").glob("*.txt"))
    if not plans:
        pytest.skip("no benchmarks/plans in this checkout")
    boot = Namespace(device="cpu", model="tiny", dtype="float32", graph_profile=None, engines=None,
                     variants="compiled", compile_cache=None)
    parse = job_parser(boot)
    for plan in plans:
        names = []
        for line in plan.read_text().splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            name, *flags = shlex.split(line)
            names.append(name)
            args, specs, rates, ab = parse(flags, str(tmp_path / name))
            assert rates and specs, line
        assert len(names) == len(set(names)), f"{plan.name}: a job name twice"
