"""The trtbuild CLI: golden check (table, JSON, exit codes) and synth (valid WAV of the right length)."""
import json
import os
import shutil

import numpy as np
import pytest
import soundfile as sf
import torch

from cosytrt.tools.trtbuild import main


def test_golden_json_passes(golden_dir, capsys):
    assert main(["golden", golden_dir, "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["pass"] is True and res["stream.lengths_match"] is True
    for k in ("llm.hidden", "llm.logits", "flow.offline.mel", "flow.stream.mel", "flow.stream_final.mel",
              "hift.final.wav", "hift.final.source", "hift.chunk.wav", "hift.chunk.source"):
        assert res[k] < 1e-4, k
    assert res["stream.wav.snr_db"] > 60 and all(res[f"stream.chunk{i}.snr_db"] > 60 for i in range(3))


def test_golden_fails_on_changed_weights(golden_dir, tmp_path, capsys):
    for f in os.listdir(golden_dir):
        shutil.copy(os.path.join(golden_dir, f), tmp_path / f)
    os.remove(tmp_path / "stream_vectors.safetensors")
    sd = torch.load(tmp_path / "flow.pt", weights_only=True)
    sd["decoder.estimator.proj_out.bias"] += 0.01
    torch.save(sd, tmp_path / "flow.pt")
    assert main(["golden", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "flow.offline.mel" in out


def test_golden_missing_dir_is_an_error(tmp_path, capsys):
    assert main(["golden", str(tmp_path / "nope")]) == 2
    assert "not found" in capsys.readouterr().err


@pytest.mark.parametrize("stream", [False, True])
def test_synth_writes_wav_of_token_duration(tmp_path, capsys, stream):
    out = tmp_path / "out.wav"
    args = ["synth", "--model", "tiny", "--text", "Hello world.", "--seed", "1", "--force-tokens", "60",
            "--out", str(out)] + (["--stream"] if stream else [])
    assert main(args) == 0
    wav, sr = sf.read(out, dtype="float32")
    info = sf.info(out)
    assert sr == 24000 and info.subtype == "PCM_16" and info.channels == 1
    assert len(wav) == 60 * 24000 // 25  # tokens / 25 Hz
    text = capsys.readouterr().out
    for k in ("T_tokenizer", "T_AR", "T_DiT", "T_vocoder", "time to first audio", "RTF"):
        assert k in text


def test_synth_is_deterministic_for_a_seed(tmp_path):
    paths = []
    for i in range(2):
        p = tmp_path / f"{i}.wav"
        assert main(["synth", "--text", "Same seed.", "--seed", "5", "--max-tokens", "40", "--out", str(p)]) == 0
        paths.append(p)
    a, _ = sf.read(paths[0])
    b, _ = sf.read(paths[1])
    assert np.array_equal(a, b)


def test_synth_empty_text_is_an_error(tmp_path, capsys):
    assert main(["synth", "--text", "  ", "--out", str(tmp_path / "x.wav")]) == 2
    assert "empty" in capsys.readouterr().err


def test_synth_compiled_matches_eager_and_writes_the_cache(tmp_path):
    """--compile (torch.compile'd LM and DiT) gives the eager audio within the batched-call tolerance (2e-3) and
    --compile-cache writes the compiled artifacts."""
    paths, cache = [tmp_path / "eager.wav", tmp_path / "compiled.wav"], tmp_path / "cc.bin"
    base = ["synth", "--text", "Compiled.", "--seed", "2", "--force-tokens", "40"]
    assert main(base + ["--out", str(paths[0])]) == 0
    assert main(base + ["--compile", "--compile-cache", str(cache), "--out", str(paths[1])]) == 0
    (a, _), (b, _) = sf.read(paths[0], dtype="float32"), sf.read(paths[1], dtype="float32")
    assert a.shape == b.shape and np.abs(a - b).max() <= 2e-3 + 1 / 32768
    assert cache.stat().st_size > 0


def test_synth_compile_cache_without_compile_is_an_error(tmp_path, capsys):
    assert main(["synth", "--text", "x", "--compile-cache", str(tmp_path / "c.bin"), "--out", str(tmp_path / "x.wav")]) == 2
    assert "compile_cache needs compile=True" in capsys.readouterr().err


def _jobs(tmp_path, *lines):
    p = tmp_path / "jobs.jsonl"
    p.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return str(p)


def test_synth_batch_writes_each_line_as_synthesised_alone(tmp_path, capsys):
    """--batch: every line's file, atomically, with results.jsonl; at concurrency 1 each file is exactly the
    single-utterance synth of the same line; --resume skips what exists."""
    jobs = _jobs(tmp_path, {"text": "First line.", "out": "a.wav", "seed": 1, "force_tokens": 20}, "# a comment", "",
                 {"text": "Second line.", "seed": 2, "max_tokens": 30}, {"text": "Third.", "out": "sub/c.flac",
                                                                        "seed": 3, "force_tokens": 15})
    out = tmp_path / "out"
    assert main(["synth", "--batch", jobs, "--out-dir", str(out), "--concurrency", "1", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["ok"] == 3 and summary["failed"] == 0 and summary["audio_seconds"] > 0
    results = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["line"], r["out"], r["status"]) for r in results] == [(1, "a.wav", "ok"), (4, "00004.wav", "ok"),
                                                                    (5, "sub/c.flac", "ok")]
    assert not list(out.rglob("*.part*"))
    single = tmp_path / "single.wav"
    assert main(["synth", "--text", "First line.", "--seed", "1", "--force-tokens", "20", "--out", str(single)]) == 0
    assert np.array_equal(sf.read(out / "a.wav")[0], sf.read(single)[0])
    assert sf.info(out / "sub/c.flac").frames == 15 * 24000 // 25
    capsys.readouterr()
    (out / "a.wav").unlink()
    assert main(["synth", "--batch", jobs, "--out-dir", str(out), "--resume", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["ok"] == 1 and summary["skipped"] == 2 and (out / "a.wav").exists()


def test_synth_batch_concurrency_is_capped_at_the_runtime_slots(tmp_path, capsys):
    from cosytrt.runtime.scheduling.config import SchedulerConfig

    jobs = _jobs(tmp_path, {"text": "One.", "force_tokens": 5}, {"text": "Two.", "force_tokens": 5})
    slots = SchedulerConfig().max_in_flight
    assert main(["synth", "--batch", jobs, "--out-dir", str(tmp_path / "o"), "--concurrency", str(slots + 100),
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["concurrency"] == slots


def test_synth_batch_line_failure_is_isolated(tmp_path, capsys):
    (tmp_path / "not_audio.wav").write_bytes(b"this is not audio")
    jobs = _jobs(tmp_path, {"text": "Fine.", "out": "ok.wav", "force_tokens": 10},
                 {"text": "Bad prompt.", "out": "bad.wav", "prompt_wav": "not_audio.wav", "prompt_text": "x"},
                 {"text": "Also fine.", "out": "ok2.wav", "force_tokens": 10})
    out = tmp_path / "out"
    assert main(["synth", "--batch", jobs, "--out-dir", str(out), "--json"]) == 1
    summary = json.loads(capsys.readouterr().out)
    assert summary["ok"] == 2 and summary["failed"] == 1
    results = {r["out"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert results["bad.wav"]["status"] == "error" and results["bad.wav"]["error"]
    assert (out / "ok.wav").exists() and (out / "ok2.wav").exists() and not (out / "bad.wav").exists()


@pytest.mark.parametrize("line,needle", [
    ({"text": "x", "colour": "red"}, "unknown key(s) colour"),
    ({"out": "a.wav"}, "'text' must be a non-empty string"),
    ({"text": "x", "out": "../escape.wav"}, "relative path inside the output folder"),
    ({"text": "x", "out": "/abs.wav"}, "relative path inside the output folder"),
    ({"text": "x", "out": "a.txt"}, "needs an audio extension"),
    ({"text": "x", "speaker": "missing.spk"}, "does not exist"),
    ({"text": "x", "top_p": 2.0}, "top_p"),
    ("[1, 2]", "must be a JSON object"),
    ("{broken", "not valid JSON"),
])
def test_synth_batch_bad_lines_fail_before_loading(tmp_path, capsys, line, needle, monkeypatch):
    import cosytrt.runtime.tts as tts_mod

    monkeypatch.setattr(tts_mod.TTS, "load", classmethod(lambda *a, **k: pytest.fail("loaded the model")))
    jobs = _jobs(tmp_path, {"text": "Good line."}, line)
    assert main(["synth", "--batch", jobs, "--out-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "jobs.jsonl:2" in err and needle in err


def test_synth_batch_argument_errors(tmp_path, capsys):
    jobs = _jobs(tmp_path, {"text": "x"}, {"text": "y", "out": "00001.wav"})
    assert main(["synth", "--batch", jobs, "--out-dir", str(tmp_path / "o")]) == 2
    assert "also line 1's" in capsys.readouterr().err
    jobs = _jobs(tmp_path, {"text": "x"})
    for argv, needle in ((["--out-dir", "o"], "give --text"),
                         (["--batch", jobs, "--text", "t", "--out-dir", "o"], "not both"),
                         (["--batch", jobs, "--out", "x.wav", "--out-dir", "o"], "not --out"),
                         (["--batch", jobs], "needs --out-dir"),
                         (["--text", "t"], "needs --out")):
        assert main(["synth", *argv]) == 2, argv
        assert needle in capsys.readouterr().err, argv
