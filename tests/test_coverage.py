"""`trtbuild coverage`: a workload replayed through the runtime on a tiny ONNX Runtime set; fallbacks, suggested
buckets, report.json and heatmap.png."""
import json
import os

import pytest
import torch

from cosytrt.build.engine_set import build_engine_set
from cosytrt.engines.buckets import Bucket, BucketTable, parse_key
from cosytrt.tools.bench.workload import generate, parse_open_loop
from cosytrt.tools.coverage_run import (CallRecorder, WorkloadRequest, build_report, default_matrix, load_workload,
                                      open_loop_workload, suggest_buckets, text_of_tokens)
from cosytrt.engines.errors import InputError
from cosytrt.runtime.models.loading import load_models
from cosytrt.runtime.stages.profile import load_profile, profile_from_dict
from cosytrt.runtime.models.text import ByteTokenizer
from cosytrt.tools.trtbuild import main

# the same set as tests/test_parity.py builds (same cache folder: a session builds it once)
ORT_PROFILE = {
    "model": "tiny", "dtype": "float32", "max_padding_waste": 1.5,
    "stages": {"dit": {"stream": {"batch": [2], "frames": [128, 288]},
                       "offline": {"batch": [2], "frames": [192, 288]}},
               "hift": {"offline": {"batch": [1, 2], "frames": [64, 128]}}},
}
STAGE_FIELDS = {"calls", "hits", "fallbacks", "work", "padded_work", "seconds", "fallback_seconds",
                "fallback_time_share", "fallback_work_share", "waste", "buckets", "fallback_shapes", "has_engine"}

# The tiny model's built-in voice has a 3 s prompt: 75 speech tokens = 150 mel frames. A request of N speech tokens
# makes offline DiT calls of 2 (75 + N) frames (CFG: 2 rows) and an offline HiFT call of 2 N frames.
WORKLOAD = [
    {"text": "Hello there.", "speech_tokens": 30},                      # DiT 210 -> b2xt288, HiFT 60 -> b1xt64
    {"text_tokens": 20, "speech_tokens": 120},                          # DiT 390, HiFT 240: outside every bucket
    {"text": "Streaming now.", "speech_tokens": 30, "stream": True,      # prompt 25 tokens: hop DiT 100 -> b2xt128;
     "prompt_seconds": 1.0},                                            # final DiT 110: b2xt192 wastes 1.75
]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ort_set():
    out = os.path.join(os.environ["COSYTRT_CACHE"], "test_engine_sets", "ort")
    build_engine_set(load_models("tiny"), profile_from_dict(ORT_PROFILE, "ort"), "onnxruntime", "cpu", out,
                     progress=False)
    return out


@pytest.fixture(scope="module")
def coverage_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("coverage")
    wl = d / "workload.jsonl"
    wl.write_text("# a comment line\n" + "\n".join(json.dumps(x) for x in WORKLOAD) + "\n")
    return str(wl), str(d / "report")


def test_workload_parsing(tmp_path):
    p = tmp_path / "w.jsonl"
    p.write_text('{"text": "hi", "concurrency": 3, "group": "g", "seed": 5, "stream": true}\n\n'
                 '{"text_tokens": 40, "prompt_seconds": 2.5}\n')
    reqs = load_workload(str(p))
    assert [r.seed for r in reqs[:3]] == [5, 6, 7] and {r.group for r in reqs[:3]} == {"g"}
    assert reqs[0].stream and reqs[3] == WorkloadRequest(None, 40, None, 2.5, False, "line3", 0)
    for line, what in (('{"text": "a", "txet": 1}', "unknown field(s) ['txet']"),
                       ('{"text": "a", "text_tokens": 3}', "exactly one of 'text' and 'text_tokens'"),
                       ('{"text": "a", "stream": "yes"}', "field 'stream'"),
                       ('{"text": "a", "concurrency": 0}', "field 'concurrency'"),
                       ('{"text": "a", "prompt_seconds": -1}', "field 'prompt_seconds'"),
                       ("[1, 2]", "must be a JSON object"), ("{nope", "not valid JSON")):
        p.write_text(line + "\n")
        with pytest.raises(InputError, match=":1: ") as e:
            load_workload(str(p))
        assert what in str(e.value)
    with pytest.raises(InputError, match="not found"):
        load_workload(str(tmp_path / "missing.jsonl"))


def test_default_matrix():
    full = default_matrix()
    assert len(full) == 3 * 2 * 2 * (1 + 8 + 32)
    assert len({r.group for r in full}) == 36
    c32 = [r for r in full if r.group == "long/stream/ref/c32"]
    assert len(c32) == 32 and all(r.stream and r.prompt_seconds == 3.0 and r.speech_tokens == 450 for r in c32)
    quick = default_matrix(quick=True)
    assert len(quick) == 3 * 2 * 2 * (1 + 2 + 4) and max(r.speech_tokens for r in quick) == 100
    half = default_matrix(0.5)
    assert len([r for r in half if r.group == "short/offline/noref/c8"]) == 4
    with pytest.raises(InputError, match="scale"):
        default_matrix(0)
    tok = ByteTokenizer()
    assert len(tok.encode(text_of_tokens(tok, 40))) >= 40 > len(tok.encode(text_of_tokens(tok, 40))) - 12


def test_open_loop_workload_and_timed_lines(tmp_path):
    spec = parse_open_loop("rate=4,duration=10,seed=0,stream=0.5")
    reqs = open_loop_workload(spec)
    arrivals = generate(spec)
    assert len(reqs) == len(arrivals) and {r.group for r in reqs} == {"open-loop"}
    for r, a in zip(reqs, arrivals):
        assert (r.arrival_s, r.speech_tokens, r.stream, r.seed) == (a.t, a.tokens, a.stream, a.seed)
        assert r.text is None and r.text_tokens == max(4, a.tokens // 4) and r.prompt_seconds is None
        assert 50 <= r.speech_tokens <= 1000
    p = tmp_path / "timed.jsonl"
    p.write_text('{"text": "a", "arrival_s": 0.5, "concurrency": 2}\n{"text": "b", "arrival_s": 0}\n')
    assert [r.arrival_s for r in load_workload(str(p))] == [0.5, 0.5, 0.0]
    for text, what in (('{"text": "a", "arrival_s": 1}\n{"text": "b"}\n', "arrival_s on every line or on none"),
                       ('{"text": "a", "arrival_s": -1}\n', "field 'arrival_s'")):
        p.write_text(text)
        with pytest.raises(InputError, match=what):
            load_workload(str(p))


def test_coverage_of_open_loop_traffic(ort_set, tmp_path, capsys):
    """`--open-loop`: generated Poisson traffic of mixed lengths replayed at its arrival times (tiny lengths here)."""
    spec = "rate=3,duration=1.5,seed=4,stream=0.5,lengths=1.2:0.2,min=0.8,max=1.6"
    rc = main(["coverage", "--engines", ort_set, "--open-loop", spec, "--out", str(tmp_path), "--quiet"])
    text = capsys.readouterr().out
    assert rc == 0
    r = json.loads((tmp_path / "report.json").read_text())
    n = len(generate(parse_open_loop(spec)))
    assert r["workload"]["requests"] == n and r["workload"]["groups"] == 1 and r["workload"]["failed"] == []
    assert r["workload"]["source"] == f"open loop {spec}" and r["workload"]["wall_seconds"] > 1.37
    assert r["totals"]["calls"] > 0 and "bucket hit rate" in text


def test_suggest_buckets_fewest_within_waste():
    shapes = {(2, 300): 10, (2, 310): 10, (4, 300): 20, (6, 90): 5}
    s = suggest_buckets("dit", "offline", shapes, [Bucket("dit", "offline", 2, 128)], 1.5)
    chosen = [parse_key(x["key"]) for x in s["fallback_buckets"]]
    assert len(chosen) == 3 and s["uncovered"] == []
    for (b, n), _ in shapes.items():  # every fallback shape now has a bucket within the waste limit
        assert BucketTable(chosen, 1.5).select(b, n) is not None
    assert s["fallback_buckets"][0]["covers_calls"] == 20  # greedy: the most calls first
    assert all(bk.batch % 2 == 0 for bk in chosen)


def test_build_report_numbers():
    table = BucketTable([Bucket("dit", "offline", 2, 100)], 1.5)
    calls = [("dit", "offline", 2, 80, "dit/offline/b2xt100", 1.0, None)] * 3 + \
            [("dit", "offline", 2, 150, None, 2.0, "no_cover")]
    r = build_report(calls, {("dit", "offline"): table}, {"engines": "x"}, {"dit": 3000})
    st = r["stages"]["dit/offline"]
    assert set(st) == STAGE_FIELDS
    assert (st["calls"], st["hits"], st["fallbacks"], st["work"], st["padded_work"]) == (4, 3, 1, 780, 900)
    assert st["fallback_time_share"] == pytest.approx(0.4) and st["fallback_work_share"] == pytest.approx(300 / 780)
    assert st["waste"] == {"mean": 1.25, "p95": 1.25, "max": 1.25}
    (b,) = st["buckets"]
    assert b["calls"] == 3 and b["share_of_work"] == pytest.approx(480 / 780) and b["share_of_calls"] == 0.75
    (fb,) = st["fallback_shapes"]
    assert fb == {"b": 2, "n": 150, "count": 1, "reason": "no_cover", "seconds": 2.0,
                  "suggested_bucket": "dit/offline/b2xt160"}
    assert r["suggestions"]["dit/offline"]["fallback_buckets"][0]["covers_shapes"] == [[2, 150]]
    assert r["totals"] == {"calls": 4, "hits": 3, "fallbacks": 1, "hit_rate": 0.75, "seconds": 5.0,
                           "fallback_seconds": 2.0}


def test_call_recorder_wraps_and_restores():
    from cosytrt.engines.buckets import ShapeStats

    st = ShapeStats()
    rec = CallRecorder(st)
    st.record("dit", "stream", 2, 100, Bucket("dit", "stream", 2, 128), 0.5)
    st.record("hift", "offline", 1, 300, None, 0.25, reason="no_cover")
    rec.detach()
    st.record("dit", "stream", 2, 100, None, 0.1, reason="waste")
    assert rec.calls == [("dit", "stream", 2, 100, "dit/stream/b2xt128", 0.5, None),
                         ("hift", "offline", 1, 300, None, 0.25, "no_cover")]
    assert st.summary()["calls"] == 3


def test_coverage_of_workload(coverage_run, ort_set, capsys):
    wl, out = coverage_run
    rc = main(["coverage", "--engines", ort_set, "--workload", wl, "--out", out, "--quiet"])
    text = capsys.readouterr().out
    assert rc == 0
    with open(os.path.join(out, "report.json")) as f:
        r = json.load(f)
    with open(os.path.join(out, "heatmap.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert r["heatmap"] == "heatmap.png" and r["backend"] == "onnxruntime"
    assert {"engines", "backend", "device", "model", "max_padding_waste", "workload", "totals", "stages",
            "suggestions", "shapes", "stages_without_engines", "heatmap"} <= set(r)
    assert r["workload"]["requests"] == 3 and r["workload"]["groups"] == 3 and r["workload"]["failed"] == []
    assert set(r["stages"]) == {"dit/stream", "dit/offline", "hift/offline"}
    for st in r["stages"].values():
        assert set(st) == STAGE_FIELDS

    def fallback(sm, b, n):
        (e,) = [e for e in r["stages"][sm]["fallback_shapes"] if (e["b"], e["n"]) == (b, n)]
        return e

    # the long request: outside every bucket, for each of its 10 DiT steps and its one HiFT call
    e = fallback("dit/offline", 2, 390)
    assert e["count"] == 10 and e["reason"] == "no_cover" and e["seconds"] > 0
    sug = parse_key(e["suggested_bucket"])
    assert sug.batch >= 2 and sug.length >= 390 and sug.waste(2, 390) <= 1.5
    e = fallback("hift/offline", 1, 240)
    assert e["count"] == 1 and e["reason"] == "no_cover"
    assert parse_key(e["suggested_bucket"]).waste(1, 240) <= 1.5
    # the streaming final call: covered by b2xt192 but at waste 1.75 > 1.5
    e = fallback("dit/offline", 2, 110)
    assert e["count"] == 10 and e["reason"] == "waste" and parse_key(e["suggested_bucket"]).waste(2, 110) <= 1.5
    dit_off = {b["key"]: b for b in r["stages"]["dit/offline"]["buckets"]}
    assert dit_off["dit/offline/b2xt288"]["calls"] == 10 and dit_off["dit/offline/b2xt192"]["calls"] == 0
    assert dit_off["dit/offline/b2xt288"]["waste"]["max"] == pytest.approx(288 / 210)
    assert {b["key"]: b["calls"] for b in r["stages"]["dit/stream"]["buckets"]}["dit/stream/b2xt128"] == 10
    off = r["stages"]["dit/offline"]
    assert off["calls"] == 30 and off["fallbacks"] == 20 and 0 < off["fallback_time_share"] < 1
    assert off["work"] == 10 * (2 * 210 + 2 * 390 + 2 * 110)
    assert {(s["stage_mode"], s["b"], s["n"], s["bucket"]) for s in r["shapes"]} >= {
        ("dit/offline", 2, 390, None), ("dit/offline", 2, 210, "dit/offline/b2xt288"),
        ("hift/offline", 1, 60, "hift/offline/b1xt64")}
    assert r["totals"]["calls"] == sum(s["calls"] for s in r["stages"].values())
    # the terminal report
    assert "eager fallbacks" in text and "no_cover" in text and "waste" in text
    assert r["stages"]["dit/offline"]["fallback_shapes"][0]["suggested_bucket"] in text
    assert "suggested buckets:" in text and "heatmap: heatmap.png" in text


def test_coverage_derives_a_profile_from_recorded_calls(ort_set, tmp_path, capsys):
    """`--derive-profile` on a real replay (tiny set, open-loop traffic): a profile covering every recorded shape,
    hit rates of the set's profile and the derived one on the same calls."""
    spec = "rate=3,duration=1.5,seed=4,stream=0.5,lengths=1.2:0.2,min=0.8,max=1.6"
    derived = tmp_path / "derived.yaml"
    rc = main(["coverage", "--engines", ort_set, "--open-loop", spec, "--derive-profile", str(derived),
               "--out", str(tmp_path), "--quiet"])
    text = capsys.readouterr().out
    assert rc == 0 and "bucket hit rate, same calls" in text
    r = json.loads((tmp_path / "report.json").read_text())
    comp = r["profile_comparison"]["comparison"]
    assert set(comp) == {"engine set ort", "derived.yaml"}
    assert comp["derived.yaml"]["total"]["hit_rate"] == 1.0
    assert comp["derived.yaml"]["total"]["calls"] == r["totals"]["calls"]
    assert comp["engine set ort"]["total"]["hits"] == r["totals"]["hits"]  # re-rating reproduces the replay
    assert load_profile(str(derived)).model == profile_from_dict(ORT_PROFILE).model == "tiny"
    assert main(["coverage", "--open-loop", spec]) != 0  # neither --engines nor --simulate
