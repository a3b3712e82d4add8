"""`trtbuild parity`: tiny ONNX Runtime and AOTInductor sets pass; an engine exported from changed weights fails."""
import json
import math
import os
import shutil

import pytest
import torch

from cosytrt.build.engine_set import build_engine_set
from cosytrt.build.parity_cases import bucket_cases, comparator_metrics
from cosytrt.build.parity_metrics import THRESHOLDS, Rule, compare, engine_rule
from cosytrt.engines.buckets import Bucket
from cosytrt.runtime.models.loading import load_models
from cosytrt.runtime.stages.profile import profile_from_dict
from cosytrt.tools.trtbuild import main

# Shared with tests/test_coverage.py (same folder, so a session builds it once). The streaming parity request
# (prompt 1 s = 25 tokens, 80 speech tokens) makes DiT calls of 100 and 200 frames (stream) and 210 (final,
# offline): every one hits a bucket here at padding waste <= 1.5.
ORT_PROFILE = {
    "model": "tiny", "dtype": "float32", "max_padding_waste": 1.5,
    "stages": {"dit": {"stream": {"batch": [2], "frames": [128, 288]},
                       "offline": {"batch": [2], "frames": [192, 288]}},
               "hift": {"offline": {"batch": [1, 2], "frames": [64, 128]}}},
}
# one AOTInductor compile: the offline DiT, one dynamic bucket (calls run at their own length)
AOTI_PROFILE = {
    "model": "tiny", "dtype": "float32", "max_padding_waste": 1.5,
    "stages": {"dit": {"offline": {"buckets": [{"batch": 2, "frames": 256, "min_frames": 64}]}}},
}
CORRUPT_PROFILE = {
    "model": "tiny", "dtype": "float32", "max_padding_waste": 1.5,
    "stages": {"dit": {"offline": {"batch": [2], "frames": [192]}}},
}
CHECK_FIELDS = {"name", "kind", "stage", "mode", "bucket", "case", "dtype", "batch", "lengths", "max_abs_err",
                "max_rel_err", "cosine", "snr_db", "rule", "passed", "note", "details"}


def tiny_set(name: str, profile: dict, backend: str, models=None) -> str:
    """Build (or reuse: the builder is incremental) a tiny engine set in the session's cosytrt cache."""
    out = os.path.join(os.environ["COSYTRT_CACHE"], "test_engine_sets", name)
    build_engine_set(models or load_models("tiny"), profile_from_dict(profile, name), backend, "cpu", out,
                     progress=False)
    return out


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ort_set():
    return tiny_set("ort", ORT_PROFILE, "onnxruntime")


@pytest.fixture(scope="module")
def aoti_set():
    return tiny_set("aoti", AOTI_PROFILE, "aoti")


@pytest.fixture(scope="module")
def corrupt_set(tmp_path_factory):
    """The DiT exported from weights whose proj_out bias was shifted by 0.01; the manifest still names the tiny
    model's weights hash (the files on disk are unchanged), so parity loads it against the real tiny model."""
    models = load_models("tiny")
    with torch.no_grad():
        models.flow.estimator.proj_out.bias += 0.01
    out = str(tmp_path_factory.mktemp("parity") / "corrupt")
    build_engine_set(models, profile_from_dict(CORRUPT_PROFILE, "corrupt"), "onnxruntime", "cpu", out, progress=False)
    return out


def _parity_json(capsys, *argv):
    rc = main(["parity", *argv, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_metrics_and_rules():
    ref = torch.ones(1000)
    m = compare(ref, ref * 1.1)
    assert m["max_abs_err"] == pytest.approx(0.1)
    assert m["max_rel_err"] == pytest.approx(0.1)
    assert m["cosine"] == pytest.approx(1.0)
    assert m["snr_db"] == pytest.approx(20.0)  # error power 1% of the signal
    assert compare(ref, torch.ones(999))["shape_match"] is False
    bad = compare(ref, torch.full((1000,), float("nan")))
    assert not engine_rule("dit", "float32").passed(bad)
    assert engine_rule("dit", "float32") == Rule(max_abs=1e-3)
    assert engine_rule("hift", "float32") == Rule(max_abs=2e-3)
    fp16 = engine_rule("dit", "float16")
    assert fp16 == Rule(min_snr_db=30.0, min_cosine=0.999)
    assert not fp16.passed(m)  # 20 dB < 30 dB
    assert fp16.passed(compare(ref, ref * 1.001))  # 60 dB
    assert "SNR 20.0 dB < 30 dB" in fp16.why(m)
    assert THRESHOLDS["float32"]["pipeline_min_snr_db"] == 40.0


def test_bucket_cases():
    cases = dict(bucket_cases(Bucket("dit", "offline", 4, 288), 1.5))
    assert cases["min_len"] == [192] * 4 and cases["max_len"] == [288] * 4
    assert cases["ragged"] == [288, 240, 192]  # one batch slot unused
    cases = dict(bucket_cases(Bucket("dit", "offline", 2, 256, 64), 1.5))  # dynamic: its own range
    assert cases["min_len"] == [64, 64] and cases["ragged"] == [256, 64]
    assert "ragged" not in dict(bucket_cases(Bucket("hift", "offline", 1, 64), 1.5, min_len=10))


def test_parity_passes_on_onnxruntime_set(ort_set, capsys):
    rc, rep = _parity_json(capsys, "--engines", ort_set)
    assert rc == 0, rep["failed"]
    assert set(rep) == {"engines", "model", "backend", "device", "thresholds", "checks", "failed", "passed"}
    assert rep["passed"] is True and rep["failed"] == [] and rep["backend"] == "onnxruntime"
    assert rep["thresholds"]["float32"]["dit_max_abs"] == 1e-3
    for c in rep["checks"]:
        assert set(c) == CHECK_FIELDS
    engine = [c for c in rep["checks"] if c["kind"] == "engine"]
    keys = {c["bucket"] for c in engine}
    assert keys == {"dit/stream/b2xt128", "dit/stream/b2xt288", "dit/offline/b2xt192", "dit/offline/b2xt288",
                    "hift/offline/b1xt64", "hift/offline/b2xt64", "hift/offline/b1xt128", "hift/offline/b2xt128"}
    for c in engine:
        assert c["passed"] and c["max_abs_err"] <= (2e-3 if c["stage"] == "hift" else 1e-3)
        assert c["cosine"] > 0.99999 and c["snr_db"] > 60
    by = {(c["bucket"], c["case"]): c for c in engine}
    assert by[("dit/offline/b2xt288", "ragged")]["lengths"] == [288, 192]
    assert by[("dit/offline/b2xt288", "min_len")]["lengths"] == [192, 192]
    assert "tail rule" in by[("hift/offline/b2xt128", "ragged")]["note"]
    poly = [c for c in rep["checks"] if c["kind"] == "polygraphy"]
    assert len(poly) == 8 and all(c["passed"] and "onnxrt-runner" in c["note"] for c in poly)
    # the Polygraphy checks carry their numbers too (worst output of the ORT runner vs the eager runner)
    assert all(c["max_abs_err"] <= (2e-3 if c["stage"] == "hift" else 1e-3) and "max |err|" in c["note"] for c in poly)
    (pipe,) = [c for c in rep["checks"] if c["kind"] == "pipeline_stream"]
    d = pipe["details"]
    assert pipe["passed"] and pipe["snr_db"] >= 40
    assert d["engine_calls"] == 30 and d["fallback_calls"] == 0  # 3 DiT solves x 10 steps, all in buckets
    assert d["chunk_lengths_engine"] == d["chunk_lengths_eager"] and len(d["boundaries"]) == 2
    assert all(b["deviation"] <= d["boundary_limit"] for b in d["boundaries"])
    (hb,) = [c for c in rep["checks"] if c["kind"] == "hift_batch"]
    assert hb["passed"] and "wrapper" in hb["note"] and hb["max_abs_err"] <= 2e-3  # whole rows, tails recomputed


def test_parity_passes_on_aoti_set(aoti_set, capsys):
    rc, rep = _parity_json(capsys, "--engines", aoti_set)
    assert rc == 0, rep["failed"]
    engine = [c for c in rep["checks"] if c["kind"] == "engine"]
    assert {c["case"] for c in engine} == {"min_len", "max_len", "ragged"}
    assert all(c["bucket"] == "dit/offline/b2xt64-256" and c["max_abs_err"] <= 1e-3 for c in engine)
    assert not [c for c in rep["checks"] if c["kind"] == "polygraphy"]  # no Polygraphy runner for .pt2
    (pipe,) = [c for c in rep["checks"] if c["kind"] == "pipeline_stream"]
    assert pipe["passed"] and pipe["snr_db"] >= 40
    # the streaming hops have no engine (eager); the final, offline call runs in the dynamic bucket
    assert pipe["details"]["engine_calls"] == 10 and pipe["details"]["fallback_calls"] == 20
    assert pipe["details"]["fallback_reasons"]["dit/stream"] == {"no engine for this mode": 20}


def test_corrupted_engine_fails(corrupt_set, capsys):
    rc = main(["parity", "--engines", corrupt_set, "--no-pipeline"])
    out = capsys.readouterr().out
    assert rc == 1
    for case in ("min_len", "max_len", "ragged", "polygraphy"):
        assert f"FAIL  dit/offline/b2xt192 {case}" in out
    poly_line = next(x for x in out.splitlines() if x.startswith("FAIL  dit/offline/b2xt192 polygraphy"))
    assert "worst output: max |err|" in poly_line  # the error value, not only pass/fail (issue #22)
    assert "max |err|" in out and "> 0.001" in out and out.rstrip().endswith("FAIL (4 of 4 checks)")
    rc, rep = _parity_json(capsys, "--engines", corrupt_set, "--no-pipeline", "--no-polygraphy")
    assert rc == 1 and rep["passed"] is False
    assert rep["failed"] == [f"dit/offline/b2xt192 {c}" for c in ("min_len", "max_len", "ragged")]
    for c in rep["checks"]:
        # a 0.01 bias shift on every output: the error is ~0.01 everywhere
        assert 5e-3 < c["max_abs_err"] < 2e-2 and not c["passed"]


def test_weights_hash_mismatch(corrupt_set, tmp_path, capsys):
    other = str(tmp_path / "other")
    shutil.copytree(corrupt_set, other)
    with open(os.path.join(other, "manifest.json")) as f:
        m = json.load(f)
    m["model"]["weights_hash"] = "0123456789abcdef"
    with open(os.path.join(other, "manifest.json"), "w") as f:
        json.dump(m, f)
    assert main(["parity", "--engines", other, "--no-pipeline"]) == 2
    assert "weights 0123456789abcdef" in capsys.readouterr().err
    rc, rep = _parity_json(capsys, "--engines", other, "--no-pipeline", "--no-polygraphy", "--ignore-weights-hash")
    assert rc == 1 and len(rep["checks"]) == 3 and math.isfinite(rep["checks"][0]["max_abs_err"])


def test_comparator_metrics():
    """The numbers next to a Polygraphy check: the worst target output vs the first (eager) runner."""
    import numpy as np

    a = np.zeros((2, 5), np.float32)
    b, c = a.copy(), a.copy()
    b[0, 1], c[1, 2] = 1e-3, 5e-3
    m = comparator_metrics([("eager", [{"wav": a + 1}]), ("ort", [{"wav": a + 1 + b}]), ("trt", [{"wav": a + 1 + c}])])
    assert m["max_abs_err"] == pytest.approx(5e-3) and m["shape_match"]
    assert comparator_metrics([("eager", [{"wav": a}])]) == {}
