"""`trtbuild` conventions: --version, choices validated, --json on synth / build, inspect --json | head without a
traceback, audio written by extension after checking the folder, wrapped tables, parity count summary, the coverage
note on a mostly-fallback run, plot provenance."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import soundfile as sf

from cosytrt.engines.manifest import Manifest
from cosytrt.engines.base import EngineSpec
from cosytrt.tools.trtbuild import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HIFT_PROFILE = """model: tiny
dtype: float32
stages:
  hift:
    offline: {batch: [1], frames: [64]}
"""


def _subprocess_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)
    return env


@pytest.fixture
def big_manifest_set(tmp_path):
    """A manifest-only set whose JSON is far larger than a pipe buffer (no engine files: inspect only reads it)."""
    keys = [f"dit/offline/b{b}xt{t}" for b in range(2, 66, 2) for t in range(64, 4096, 64)]
    engines = [EngineSpec("dit", "offline", "onnxruntime", "dit_offline.onnx", ["x"], ["y"], keys)]
    m = Manifest(model={"source": "tiny", "kind": "tiny", "weights_hash": "0" * 16, "config": {}},
                 backend="onnxruntime", device="cpu", dtype="float32", versions={"torch": "x"}, profile={},
                 profile_hash="0", engines=engines, files={"dit_offline.onnx": "0" * 64})
    folder = str(tmp_path / "es")
    m.save(folder)
    return folder


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("cosytrt 0.") and "torch" in out


@pytest.mark.parametrize("argv,needle", [
    (["synth", "--text", "x", "--out", "x.wav", "--device", "gpu"], "invalid device 'gpu'"),
    (["build", "--out", "x", "--device", "cuda0"], "invalid device 'cuda0'"),
    (["build", "--out", "x", "--backend", "trt"], "invalid choice: 'trt'"),
    (["serve", "--device", "tpu"], "invalid device 'tpu'"),
])
def test_bad_choices_are_usage_errors(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_inspect_json_into_head_has_no_broken_pipe(big_manifest_set, tmp_path):
    code = "import sys; from cosytrt.tools.trtbuild import main; sys.exit(main(sys.argv[1:]))"
    p = subprocess.Popen([sys.executable, "-c", code, "inspect", "--json", big_manifest_set], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=_subprocess_env(), cwd=tmp_path)
    first = p.stdout.readline()
    p.stdout.close()  # what `| head -1` does
    err = p.stderr.read().decode()
    rc = p.wait(timeout=120)
    assert first.strip() == b"{", err
    assert "BrokenPipeError" not in err and "Traceback" not in err, err
    assert rc == 0


def test_wide_tables_wrap(big_manifest_set, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    assert main(["inspect", big_manifest_set]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(len(x) for x in lines) <= 100
    assert sum("dit/offline/b64xt4032" in x for x in lines) == 1  # a bucket key is never cut


def test_synth_checks_the_output_before_synthesis(tmp_path, capsys, monkeypatch):
    from cosytrt.runtime.tts import TTS

    def no_load(*a, **k):
        raise AssertionError("synthesis started before the output was checked")

    monkeypatch.setattr(TTS, "load", no_load)
    assert main(["synth", "--text", "Hi.", "--out", str(tmp_path / "missing" / "x.wav")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["synth", "--text", "Hi.", "--out", str(tmp_path / "x.aiff2")]) == 2
    assert "unknown audio extension" in capsys.readouterr().err


@pytest.mark.parametrize("ext,fmt", [(".flac", "FLAC"), (".mp3", "MP3"), (".opus", "OGG")])
def test_synth_writes_by_extension(tmp_path, ext, fmt):
    if fmt == "MP3" and "MP3" not in sf.available_formats():
        pytest.skip("this libsndfile has no MP3")
    out = str(tmp_path / f"x{ext}")
    assert main(["synth", "--text", "Hello.", "--force-tokens", "25", "--out", out]) == 0
    info = sf.info(out)
    assert info.format == fmt and info.samplerate == 24000 and info.channels == 1
    assert 0.9 < info.duration < 1.2  # 25 tokens = 1 s (mp3 adds encoder padding)


def test_synth_json(tmp_path, capsys):
    out = str(tmp_path / "x.wav")
    assert main(["synth", "--text", "Hello.", "--force-tokens", "25", "--out", out, "--json"]) == 0
    cap = capsys.readouterr()
    rep = json.loads(cap.out)
    assert rep["tokens"] == 25 and rep["sample_rate"] == 24000 and rep["out"] == out
    assert set(rep["model_files"]) >= {"llm.pt", "flow.pt", "hift.pt"}
    assert all(len(v) == 64 for v in rep["model_files"].values())


def test_synth_start_up_shows_model_hashes(tmp_path, capsys):
    assert main(["synth", "--text", "Hello.", "--force-tokens", "5", "--out", str(tmp_path / "x.wav")]) == 0
    err = capsys.readouterr().err
    assert "sha256 llm.pt" in err and "hift.pt" in err and "campplus.onnx" in err


def test_build_json_and_quiet_exporters(tmp_path, capsys):
    prof = tmp_path / "p.yaml"
    prof.write_text(HIFT_PROFILE)
    out = str(tmp_path / "es")
    assert main(["build", "--backend", "onnxruntime", "--profile", str(prof), "--out", out, "--json"]) == 0
    cap = capsys.readouterr()
    rep = json.loads(cap.out)  # nothing but the JSON on stdout
    assert [(e["stage"], e["mode"], e["rebuilt"]) for e in rep["engines"]] == [("hift", "offline", True)]
    assert len(rep["engines"][0]["sha256"]) == 64 and rep["model_files"]
    assert "Warning" not in cap.err  # exporter warnings stay out (shown with --verbose)


def test_parity_report_ends_with_counts():
    from cosytrt.build.parity_metrics import Check, ParityReport
    from cosytrt.tools.parity import format_report

    checks = [Check("a", "engine", True, "r"), Check("b", "engine", False, "r", note="too far"),
              Check("c", "polygraphy", True, "r", note="skipped: no polygraphy")]
    text = format_report(ParityReport("es", "tiny", "onnxruntime", "cpu", checks))
    lines = text.splitlines()
    assert lines[-2] == ("summary: 3 checks: 2 passed (1 skipped), 1 failed; passed by kind: engine 1/2, "
                         "polygraphy 1/1")
    assert lines[-1] == "FAIL (1 of 3 checks)"
    ok = format_report(ParityReport("es", "tiny", "onnxruntime", "cpu", checks[:1]))
    assert ok.splitlines()[-1] == "PASS (1 of 1 checks)"


def _coverage_report(source: str) -> dict:
    st = {"calls": 100, "fallbacks": 90, "has_engine": True, "buckets": [], "fallback_time_share": 0.9,
          "fallback_work_share": 0.9, "fallback_seconds": 1.0, "waste": {"mean": 1.0, "p95": 1.0, "max": 1.0},
          "fallback_shapes": [{"b": 8, "n": 900, "count": 90, "reason": "no_cover", "seconds": 1.0,
                               "suggested_bucket": "dit/offline/b8xt972"}]}
    return {"engines": "es", "backend": "onnxruntime", "device": "cpu", "max_padding_waste": 1.5,
            "workload": {"source": source, "requests": 10, "groups": 2, "wall_seconds": 1.0, "failed": []},
            "totals": {"calls": 100, "fallbacks": 90}, "stages": {"dit/offline": st}, "suggestions": {}}


def test_coverage_explains_a_mostly_fallback_run_and_suggests_quick():
    from cosytrt.tools.coverage import format_report

    text = format_report(_coverage_report("matrix default"))
    assert "most calls ran eagerly (90 of 100, 90%); why: dit/offline: no_cover (90 calls)" in text
    assert "trtbuild coverage --quick" in text
    assert "--quick" not in format_report(_coverage_report("matrix default (quick)"))


def test_heatmap_title_names_set_commit_and_device(tmp_path):
    pytest.importorskip("matplotlib")
    from cosytrt.tools.coverage_run import plot_provenance, write_heatmap

    r = _coverage_report("matrix default")
    r["shapes"] = [{"stage_mode": "dit/offline", "b": 8, "n": 900, "calls": 90, "bucket": None}]
    title = plot_provenance(r)
    assert title.startswith("engine set es (onnxruntime), cosytrt ") and title.endswith(", cpu")
    path = write_heatmap(r, {}, str(tmp_path / "h.png"))
    with open(path, "rb") as f:
        assert f.read(4) == b"\x89PNG"


def test_serve_start_up_line_shows_model_hashes(capsys):
    from cosytrt.tools.serve import _print_model_hashes

    _print_model_hashes("tiny")
    err = capsys.readouterr().err
    assert err.startswith("trtbuild serve: model ") and "sha256 llm.pt " in err and "speech_tokenizer_v3.onnx" in err
