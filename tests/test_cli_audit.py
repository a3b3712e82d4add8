"""CLI audit: careless input gives a one-line error and exit 2 (never a traceback, never a destroyed folder, never a
misleading PASS / FAIL). Every test here fails before any model loads or any engine is built."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from cosytrt.engines.errors import EngineSetError
from cosytrt.tools.trtbuild import main

HIFT_PROFILE = """model: tiny
dtype: float32
stages:
  hift:
    offline: {batch: [1], frames: [64]}
"""


@pytest.fixture
def no_model_load(monkeypatch):
    """Any model or TTS load fails the test: the command must refuse its input first."""
    from cosytrt.runtime.tts import TTS
    from cosytrt.tools import build_cmd

    def refuse(*a, **k):
        raise AssertionError("the model loaded before the input was checked")

    monkeypatch.setattr(TTS, "load", refuse)
    monkeypatch.setattr("cosytrt.runtime.models.loading.load_models", refuse)
    monkeypatch.setattr(build_cmd, "random_full_models", refuse)


def _profile(tmp_path) -> str:
    p = tmp_path / "p.yaml"
    p.write_text(HIFT_PROFILE)
    return str(p)


# ------------------------------------------------------------------ build --out: never replace what is not a set
def test_build_refuses_a_folder_of_something_else(tmp_path, capsys, no_model_load):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "thesis.txt").write_text("precious")
    rc = main(["build", "--backend", "onnxruntime", "--profile", _profile(tmp_path), "--out", str(docs)])
    assert rc == 2
    assert "not an engine set" in capsys.readouterr().err
    assert (docs / "thesis.txt").read_text() == "precious"


@pytest.mark.parametrize("out", ["", ".", ".."])
def test_build_refuses_the_current_folder(tmp_path, capsys, monkeypatch, no_model_load, out):
    work = tmp_path / "work"
    work.mkdir()
    (work / "manifest.json").write_text("{}")  # even one that looks like a set: it is where the user stands
    (work / "notes.txt").write_text("keep")
    prof = _profile(tmp_path)
    monkeypatch.chdir(work)
    assert main(["build", "--backend", "onnxruntime", "--profile", prof, "--out", out]) == 2
    assert "trtbuild build: error: --out" in capsys.readouterr().err
    assert (work / "notes.txt").read_text() == "keep"


def test_build_out_under_a_file_is_an_error(tmp_path, capsys, no_model_load):
    (tmp_path / "f").write_text("x")
    rc = main(["build", "--backend", "onnxruntime", "--profile", _profile(tmp_path), "--out", str(tmp_path / "f" / "es")])
    assert rc == 2
    assert "is a file, not a folder" in capsys.readouterr().err


def test_check_out_dir_allows_new_empty_and_engine_set_folders(tmp_path):
    from cosytrt.build.engine_set import check_out_dir

    assert check_out_dir(str(tmp_path / "new")) == str(tmp_path / "new")
    (tmp_path / "empty").mkdir()
    check_out_dir(str(tmp_path / "empty"))
    (tmp_path / "set").mkdir()
    (tmp_path / "set" / "manifest.json").write_text(json.dumps({"format": 2, "backend": "onnxruntime",
                                                                "profile": {}, "files": {}}))
    (tmp_path / "set" / "dit_offline.onnx").write_bytes(b"x")
    check_out_dir(str(tmp_path / "set"))  # a previous set is rebuilt incrementally
    # a stray manifest.json of something else does not make a folder an engine set (it would be replaced whole)
    for stray in ("{}", "[1, 2]", "not json", json.dumps({"name": "my-npm-package", "version": "1.0.0"})):
        (tmp_path / "stray").mkdir(exist_ok=True)
        (tmp_path / "stray" / "manifest.json").write_text(stray)
        (tmp_path / "stray" / "thesis.txt").write_text("keep")
        with pytest.raises(EngineSetError, match="not an engine set"):
            check_out_dir(str(tmp_path / "stray"))
    with pytest.raises(EngineSetError, match="not empty"):
        (tmp_path / "other").mkdir()
        (tmp_path / "other" / "a.txt").write_text("a")
        check_out_dir(str(tmp_path / "other"))


# ------------------------------------------------------------------ build --profile that is not text
@pytest.mark.parametrize("content", [b"\x00\x01\xff\xfe\x80", b"model: tiny\n\xff\xfe\n"])
def test_build_binary_profile_is_a_profile_error(tmp_path, capsys, no_model_load, content):
    prof = tmp_path / "bin.yaml"
    prof.write_bytes(content)
    rc = main(["build", "--backend", "onnxruntime", "--profile", str(prof), "--out", str(tmp_path / "es")])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("trtbuild build: error: profile ") and "not UTF-8 text" in err and "Traceback" not in err
    assert not (tmp_path / "es").exists()


def test_coverage_simulate_binary_profile_is_a_profile_error(tmp_path, capsys):
    prof = tmp_path / "bin.yaml"
    prof.write_bytes(b"\xff\xfe\x00")
    wl = tmp_path / "w.jsonl"
    wl.write_text('{"text_tokens": 10, "speech_tokens": 20}\n')
    assert main(["coverage", "--simulate", "--workload", str(wl), "--profile", str(prof), "--quiet"]) == 2
    assert "not UTF-8 text" in capsys.readouterr().err


# ------------------------------------------------------------------ synth outputs checked before synthesis
def test_synth_out_that_is_a_folder_fails_before_synthesis(tmp_path, capsys, no_model_load):
    (tmp_path / "x.wav").mkdir()
    assert main(["synth", "--text", "Hi.", "--out", str(tmp_path / "x.wav")]) == 2
    assert "is a folder, not a file" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["missing/x.spk", "dir.spk"])
def test_synth_save_speaker_target_checked_before_synthesis(tmp_path, capsys, no_model_load, where):
    (tmp_path / "dir.spk").mkdir()
    (tmp_path / "p.wav").write_bytes(b"")
    rc = main(["synth", "--text", "Hi.", "--out", str(tmp_path / "o.wav"), "--prompt-wav", str(tmp_path / "p.wav"),
               "--save-speaker", str(tmp_path / where)])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("trtbuild synth: error: --save-speaker") and "Traceback" not in err


def test_synth_save_speaker_without_prompt_fails_before_synthesis(tmp_path, capsys, no_model_load):
    rc = main(["synth", "--text", "Hi.", "--out", str(tmp_path / "o.wav"), "--save-speaker", str(tmp_path / "a.spk")])
    assert rc == 2
    assert "--save-speaker needs --prompt-wav" in capsys.readouterr().err


# ------------------------------------------------------------------ an edited manifest
@pytest.mark.parametrize("waste", ["x", None, True, [1.5]])
def test_edited_manifest_padding_waste_is_an_engine_set_error(tmp_path, capsys, waste):
    from cosytrt.engines.base import EngineSpec
    from cosytrt.engines.manifest import Manifest

    m = Manifest(model={"source": "tiny", "kind": "tiny", "weights_hash": "0" * 16, "config": {}},
                 backend="onnxruntime", device="cpu", dtype="float32", versions={"torch": "x"},
                 profile={"max_padding_waste": 1.5}, profile_hash="0",
                 engines=[EngineSpec("hift", "offline", "onnxruntime", "h.onnx", ["mel"], ["wav"],
                                     ["hift/offline/b1xt64"])], files={"h.onnx": "0" * 64})
    folder = str(tmp_path / "es")
    m.save(folder)
    path = os.path.join(folder, "manifest.json")
    with open(path) as f:
        d = json.load(f)
    d["profile"]["max_padding_waste"] = waste
    with open(path, "w") as f:
        json.dump(d, f)
    with pytest.raises(EngineSetError, match="max_padding_waste"):
        Manifest.load(folder)
    assert main(["inspect", folder]) == 2
    assert "max_padding_waste must be a number >= 1" in capsys.readouterr().err


# ------------------------------------------------------------------ golden with damaged vectors
def _golden_copy(golden_dir, tmp_path):
    d = tmp_path / "golden"
    shutil.copytree(golden_dir, d)
    return d


def test_golden_missing_vector_is_named(golden_dir, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    d = _golden_copy(golden_dir, tmp_path)
    v = load_file(str(d / "vectors.safetensors"))
    del v["flow.token"]
    save_file(v, str(d / "vectors.safetensors"))
    assert main(["golden", str(d)]) == 2
    assert "lacks golden vector(s) flow.token" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["vectors.safetensors", "stream_vectors.safetensors"])
def test_golden_truncated_vectors_are_an_error(golden_dir, tmp_path, capsys, name):
    d = _golden_copy(golden_dir, tmp_path)
    data = (d / name).read_bytes()
    (d / name).write_bytes(data[:100])
    assert main(["golden", str(d)]) == 2
    err = capsys.readouterr().err
    assert "not a readable safetensors file" in err and name in err


def test_golden_wrong_shaped_vector_is_an_error(golden_dir, tmp_path, capsys):
    import torch
    from safetensors.torch import load_file, save_file

    d = _golden_copy(golden_dir, tmp_path)
    v = load_file(str(d / "vectors.safetensors"))
    v["llm.lm_input"] = torch.zeros(3, 3)
    save_file(v, str(d / "vectors.safetensors"))
    assert main(["golden", str(d)]) == 2
    assert "its vectors do not fit its models" in capsys.readouterr().err


# ------------------------------------------------------------------ parity options are usage errors
@pytest.mark.parametrize("argv,needle", [
    (["--stream-tokens", "0"], "--stream-tokens must be >= 1"),
    (["--prompt-seconds", "-1"], "--prompt-seconds must be in (0, 30]"),
    (["--prompt-seconds", "nan"], "--prompt-seconds must be in (0, 30]"),
    (["--prompt-seconds", "1e9"], "--prompt-seconds must be in (0, 30]"),
])
def test_parity_bad_request_options_exit_2_before_checking(tmp_path, capsys, argv, needle):
    assert main(["parity", "--engines", str(tmp_path / "none"), *argv]) == 2
    assert needle in capsys.readouterr().err


# ------------------------------------------------------------------ coverage workloads that would exhaust memory
@pytest.mark.parametrize("line,needle", [
    ('{"text_tokens": 10, "concurrency": 100000000}', "'concurrency' must be an integer in 1..4096"),
    ('{"text_tokens": 1000000000000}', "'text_tokens' must be an integer in 1..32768"),
    ('{"text_tokens": 10, "speech_tokens": 1000000000000}', "'speech_tokens' must be an integer in 1..32768"),
])
def test_coverage_workload_bounds(tmp_path, capsys, line, needle):
    wl = tmp_path / "w.jsonl"
    wl.write_text(line + "\n")
    assert main(["coverage", "--simulate", "--workload", str(wl), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_coverage_workload_total_requests_bounded(tmp_path, capsys):
    wl = tmp_path / "w.jsonl"
    wl.write_text('{"text_tokens": 10, "concurrency": 4096}\n' * 30)
    assert main(["coverage", "--simulate", "--workload", str(wl), "--quiet"]) == 2
    assert "more than 100000 requests" in capsys.readouterr().err


@pytest.mark.parametrize("argv,needle", [
    (["--open-loop", "rate=1e9,duration=1e9"], "open-loop rate x duration is 1e+18 requests; at most 100000"),
    (["--open-loop", "rate=1,duration=5", "--rates", "1,x"], "--rates '1,x': give numbers"),
])
def test_coverage_open_loop_bounds(capsys, argv, needle):
    assert main(["coverage", "--simulate", "--quiet", *argv]) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("flag,where,needle", [
    ("--derive-profile", "missing/d.yaml", "does not exist"),
    ("--derive-profile", "", "is a folder, not a file"),
    ("--out", "file.txt", "exists and is not a folder"),
])
def test_coverage_outputs_checked_before_the_run(tmp_path, capsys, monkeypatch, flag, where, needle):
    from cosytrt.tools import coverage

    monkeypatch.setattr(coverage, "_simulate", lambda *a, **k: pytest.fail("the run started before the check"))
    (tmp_path / "file.txt").write_text("x")
    assert main(["coverage", "--simulate", "--matrix", "default", "--quick", "--quiet", flag,
                 str(tmp_path / where)]) == 2
    assert needle in capsys.readouterr().err


def test_synth_batch_out_dir_that_is_a_file(tmp_path, capsys, no_model_load):
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text('{"text": "Hi.", "force_tokens": 5}\n')
    (tmp_path / "f").write_text("x")
    for out_dir in (tmp_path / "f", tmp_path / "f" / "sub"):
        assert main(["synth", "--batch", str(jobs), "--out-dir", str(out_dir)]) == 2
        assert "--out-dir" in capsys.readouterr().err


# ------------------------------------------------------------------ serve --port
@pytest.mark.parametrize("port", ["70000", "0", "-1", "http"])
def test_serve_port_out_of_range_is_a_usage_error(capsys, port):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--port", port])
    assert e.value.code == 2
    assert "invalid port" in capsys.readouterr().err
