"""The `compiled` engine set: `trtbuild build --backend compiled` writes torch.compile's cache with a manifest entry,
TTS.load(engines=...) checks it (torch version, device model, digest, model config, AR runner) and loads it before
anything compiles. The warm-up that compiles is replaced by a small compile here (the real one is the compiled
TTS's warm-up, tests/test_compiled.py); the cold / warm set-up times are measured on the GPU
(benchmarks/ort_cuda_run.sh)."""
import json
import os

import pytest
import torch

from cosytrt.build.engine_set import build_engine_set
from cosytrt.engines.manifest import Manifest
from cosytrt.runtime.stages import compiled as compiled_mod
from cosytrt.build import compile_cache as compile_cache_mod
from cosytrt.runtime.stages.engine_set import LoadedEngineSet, check_ar_runner, open_compiled_set
from cosytrt.engines.errors import BackendUnavailableError, EngineSetError
from cosytrt.runtime.models.loading import load_models
from cosytrt.runtime.stages.profile import profile_from_dict

PROFILE = {"model": "tiny", "dtype": "float32", "max_padding_waste": 1.5,
           "stages": {"dit": {"offline": {"batch": [2], "frames": [64]}}}}


class _Warmed:
    closed = False

    def close(self):
        _Warmed.closed = True


@pytest.fixture(autouse=True)
def _process_compile_scope():
    """Opening a compiled set sets the process's compile scope (the set's): back to unset after each test."""
    from cosytrt.runtime.stages.compiled import set_compile_scope

    yield
    set_compile_scope(None)


@pytest.fixture(scope="module")
def models():
    return load_models("tiny")


@pytest.fixture()
def cheap_warm(monkeypatch):
    calls = []

    def warm(source, device, profile_path, dtype):
        calls.append((source, device, os.path.basename(profile_path), dtype))
        fn = torch.compile(lambda x: torch.sin(x) * 2 + 1, dynamic=False)
        fn(torch.ones(5 + len(calls)))
        return _Warmed()

    monkeypatch.setattr(compile_cache_mod, "warm_compiled_tts", warm)
    return calls


def test_build_writes_cache_and_manifest_then_reuses_it(models, cheap_warm, tmp_path):
    out = str(tmp_path / "set")
    m, results = build_engine_set(models, profile_from_dict(PROFILE, "t"), "compiled", "cpu", out, progress=False)
    assert results == [] and m.engines == [] and m.backend == "compiled" and m.ar_runner == "torch"
    cc = m.compile_cache
    assert cc["file"] == "compile_cache.bin" and cc["bytes"] == os.path.getsize(os.path.join(out, cc["file"])) > 0
    assert cc["torch"] == torch.__version__ and cc["device_name"] == "cpu" and cc["graphs"] >= 1
    assert cheap_warm == [("tiny", "cpu", "profile.yaml", None)] and _Warmed.closed
    on_disk = json.load(open(os.path.join(out, "manifest.json")))
    assert on_disk["ar_runner"] == "torch" and on_disk["compile_cache"]["sha256"] == cc["sha256"]
    m2, _ = build_engine_set(models, profile_from_dict(PROFILE, "t"), "compiled", "cpu", out, progress=False)
    assert len(cheap_warm) == 1 and m2.compile_cache == cc  # unchanged inputs: not compiled again

    cs = open_compiled_set(out, "cpu")
    assert cs.profile_path.endswith("profile.yaml") and cs.dtype is None and cs.load_seconds >= 0
    cs.check_model(models)
    assert cc["scope"] == "whole"
    with pytest.raises(EngineSetError, match="compiled engine set"):
        LoadedEngineSet(out, models.weights_hash)


def test_compiled_set_records_and_restores_its_compile_scope(models, cheap_warm, tmp_path, monkeypatch):
    """A set built with COSYTRT_COMPILE_SCOPE=regional records the scope (another scope is another stamp: rebuilt),
    and opening it sets the process's scope to it, so the runtime's compiles hit the cache."""
    from cosytrt.runtime.stages.compiled import compile_scope

    out = str(tmp_path / "set")
    monkeypatch.setenv("COSYTRT_COMPILE_SCOPE", "regional")
    m, _ = build_engine_set(models, profile_from_dict(PROFILE, "t"), "compiled", "cpu", out, progress=False)
    assert m.compile_cache["scope"] == m.compile_cache["stamp"]["scope"] == "regional"
    monkeypatch.setenv("COSYTRT_COMPILE_SCOPE", "whole")
    m2, _ = build_engine_set(models, profile_from_dict(PROFILE, "t"), "compiled", "cpu", out, progress=False)
    assert len(cheap_warm) == 2 and m2.compile_cache["scope"] == "whole"  # a new scope: compiled again
    build_engine_set(models, profile_from_dict(PROFILE, "t"), "compiled", "cpu", out, progress=False)
    assert len(cheap_warm) == 2
    _edit(out, scope="regional")
    open_compiled_set(out, "cpu")
    assert compile_scope() == "regional"  # the set's, over $COSYTRT_COMPILE_SCOPE


def _edit(folder, **changes):
    path = os.path.join(folder, "manifest.json")
    d = json.load(open(path))
    for k, v in changes.items():
        if k in d:
            d[k] = v
        else:
            d["compile_cache"][k] = v
    json.dump(d, open(path, "w"))


def test_load_refusals(models, cheap_warm, tmp_path):
    out = str(tmp_path / "set")
    build_engine_set(models, profile_from_dict(PROFILE, "t"), "compiled", "cpu", out, progress=False)
    good = open(os.path.join(out, "manifest.json")).read()
    for change, msg in (({"torch": "1.0"}, "written by torch 1.0"), ({"device_name": "NVIDIA H200"}, "written on"),
                        ({"sha256": "0" * 16}, "digest"), ({"ar_runner": "vllm"}, "expects AR runner 'vllm'")):
        open(os.path.join(out, "manifest.json"), "w").write(good)
        _edit(out, **change)
        with pytest.raises(EngineSetError, match=msg):
            open_compiled_set(out, "cpu")
    open(os.path.join(out, "manifest.json"), "w").write(good)
    _edit(out, ar_runner="trtllm")
    if __import__("importlib").util.find_spec("tensorrt_llm") is None:
        with pytest.raises(BackendUnavailableError, match="tensorrt_llm"):
            open_compiled_set(out, "cpu")
    open(os.path.join(out, "manifest.json"), "w").write(good)
    os.remove(os.path.join(out, "compile_cache.bin"))
    with pytest.raises(EngineSetError, match="compile cache missing"):
        open_compiled_set(out, "cpu")
    from types import SimpleNamespace

    other = SimpleNamespace(config=SimpleNamespace(to_dict=lambda: {"flow": {"dit": {"depth": 99}}}))
    cs_manifest = Manifest.load(out)
    from cosytrt.runtime.stages.engine_set import CompiledSet

    with pytest.raises(EngineSetError, match="another model configuration"):
        CompiledSet(out, cs_manifest, "", None, 0.0).check_model(other)


def test_check_ar_runner_on_file_sets(models, tmp_path):
    m = Manifest(model={}, backend="onnxruntime", device="cpu", dtype="float32", versions={}, profile={},
                 profile_hash="")
    assert check_ar_runner(m, str(tmp_path)) == "torch"
    m.ar_runner = "eager"
    with pytest.raises(EngineSetError, match="torch, trtllm"):
        check_ar_runner(m, str(tmp_path))
    assert Manifest.from_dict({**m.to_dict(), "ar_runner": None} | {"ar_runner": "torch"}).ar_runner == "torch"
    d = m.to_dict()
    del d["ar_runner"], d["compile_cache"]  # a manifest written before these fields: torch, no cache
    old = Manifest.from_dict(d)
    assert old.ar_runner == "torch" and old.compile_cache == {}


def test_tts_load_takes_a_compiled_set(models, cheap_warm, tmp_path, monkeypatch):
    from cosytrt.runtime.stages.compiled import CompiledDiT
    from cosytrt.runtime.tts import TTS

    out = str(tmp_path / "set")
    build_engine_set(models, profile_from_dict(PROFILE, "t"), "compiled", "cpu", out, progress=False)
    loaded = []
    real = compiled_mod.load_compile_cache
    monkeypatch.setattr(compiled_mod, "load_compile_cache", lambda p: loaded.append(p) or real(p))
    # the warm-up requests compile the tiny LM and DiT on the CPU (tests/test_compiled.py does that): skipped here
    monkeypatch.setattr(TTS, "synthesize", lambda self, *a, **k: None)
    monkeypatch.setattr(TTS, "stream", lambda self, *a, **k: iter(()))
    tts = TTS.load("tiny", engines=out)
    assert loaded == [os.path.join(out, "compile_cache.bin")]
    assert tts.scheduler_config.compile and isinstance(tts.pipeline.backends.estimator(False), CompiledDiT)
    assert tts.pipeline.compiled_set.manifest.backend == "compiled" and tts.engines == out
