"""`trtbuild build`: tiny engine sets with ONNX Runtime and AOTInductor; every bucket matches eager; manifests."""
import json
import os
import shutil

import pytest
import torch

from cosytrt.build.engine_set import build_engine_set, resolve_backend
from cosytrt.engines.manifest import Manifest
from cosytrt.build.tensorrt_build import network_flags
from cosytrt.engines import open_runner
from cosytrt.engines.shapes import profile_index, profile_shapes, resolve_dim, resolve_shape
from cosytrt.engines.buckets import Bucket, parse_key
from cosytrt.runtime.models.dit import FixedModeDiT
from cosytrt.runtime.stages.engine_set import LoadedEngineSet
from cosytrt.engines.errors import EngineSetError
from cosytrt.runtime.models.loading import load_models
from cosytrt.runtime.stages.profile import profile_from_dict
from cosytrt.tools.trtbuild import main

TOL = {"dit": 1e-3, "hift": 2e-3}

ORT_PROFILE = {
    "model": "tiny", "dtype": "float32", "max_padding_waste": 1.5,
    "stages": {"dit": {"stream": {"batch": [2, 4], "frames": [64, 128]},
                       "offline": {"batch": [2], "frames": [128, 288]}},
               "hift": {"offline": {"batch": [1, 2], "frames": [64, 128]}},
               "ar": {"max_seq_len": 512, "decode_batch": [1, 2]}},
}
AOTI_PROFILE = {
    "model": "tiny", "dtype": "float32", "max_padding_waste": 1.5,
    "stages": {"dit": {"offline": {"batch": [2], "frames": [64, 128]}},
               "hift": {"offline": {"batch": [1], "frames": [64]}}},
}


@pytest.fixture(scope="module")
def models():
    return load_models("tiny")


@pytest.fixture(scope="module")
def ort_set(models, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("es") / "tiny-ort")
    build_engine_set(models, profile_from_dict(ORT_PROFILE, "test"), "onnxruntime", "cpu", out, progress=False)
    return out


@pytest.fixture(scope="module")
def aoti_set(models, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("es") / "tiny-aoti")
    build_engine_set(models, profile_from_dict(AOTI_PROFILE, "test"), "aoti", "cpu", out, progress=False)
    return out


def _bucket_inputs(models, spec, bucket: Bucket, length: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    B = bucket.batch
    if spec.stage == "dit":
        c = models.flow.estimator.cfg
        mask = torch.ones(B, 1, length)
        mask[0, :, length // 2:] = 0  # a ragged row
        inputs = {"x": torch.randn(B, c.mel_dim, length, generator=g), "mask": mask,
                  "mu": torch.randn(B, c.mu_dim, length, generator=g), "t": torch.rand(B, generator=g),
                  "spks": torch.randn(B, c.spk_dim, generator=g), "cond": torch.randn(B, c.mel_dim, length, generator=g)}
        ref = FixedModeDiT(models.flow.estimator, spec.mode == "stream")(*inputs.values())
        return inputs, ref, lambda o: o * inputs["mask"]
    h = models.hift
    mel = torch.randn(B, 80, length, generator=g) - 4.0
    inputs = {"mel": mel, "sine_noise": h.noise_slice(0, length)}
    ref = h.inference(mel, finalize=spec.mode == "offline")[0]
    return inputs, ref, lambda o: o


def _check_every_bucket(models, folder):
    m = Manifest.load(folder)
    checked = 0
    for spec in m.engines:
        runner = open_runner(spec, folder, "cpu")
        for key in spec.buckets:
            bucket = parse_key(key)
            for length in sorted({bucket.length_range[0], bucket.length}):
                length = max(length, 16)
                inputs, ref, masked = _bucket_inputs(models, spec, bucket, length, seed=checked)
                with torch.inference_mode():
                    out = runner.run(inputs, bucket)[spec.output_names[0]]
                err = float((masked(out) - masked(ref)).abs().max())
                assert err <= TOL[spec.stage], (key, length, err)
                checked += 1
    return checked


def test_ort_every_bucket_matches_eager(models, ort_set):
    assert _check_every_bucket(models, ort_set) >= 8


def test_aoti_every_bucket_matches_eager(models, aoti_set):
    m = Manifest.load(aoti_set)
    assert {(e.stage, e.mode) for e in m.engines} == {("dit", "offline"), ("hift", "offline")}
    assert all(e.file.endswith(".pt2") for e in m.engines)
    assert _check_every_bucket(models, aoti_set) >= 3


def test_engine_set_pipeline_hits_buckets_and_matches_eager(ort_set):
    from cosytrt.runtime.tts import TTS

    eager = TTS.load("tiny")
    tts = TTS.load("tiny", engines=ort_set)
    kw = dict(seed=3, force_tokens=50)  # prompt 75 tokens: DiT 250 frames -> b2xt288, HiFT 100 frames -> b1xt128
    a = eager.synthesize("Engines and eager agree.", **kw)
    b = tts.synthesize("Engines and eager agree.", **kw)
    assert a.shape == b.shape == (50 * 960,)
    assert float(abs(a - b).max()) < 2e-3
    s = tts.pipeline.backends.shape_stats.summary()
    assert s["buckets"]["dit/offline/b2xt288"]["hits"] == 10  # 10 Euler steps
    assert s["buckets"]["hift/offline/b1xt128"]["hits"] == 1
    eager.close()
    tts.close()


def test_incremental_rebuild(models, ort_set, tmp_path):
    folder = str(tmp_path / "copy")
    shutil.copytree(ort_set, folder)
    prof = json.loads(json.dumps(ORT_PROFILE))
    _, results = build_engine_set(models, profile_from_dict(prof, "test"), "onnxruntime", "cpu", folder, progress=False)
    assert not any(r.rebuilt for r in results)
    prof["stages"]["hift"]["offline"]["frames"] = [64, 96]
    _, results = build_engine_set(models, profile_from_dict(prof, "test"), "onnxruntime", "cpu", folder, progress=False)
    assert {(r.spec.stage, r.spec.mode): r.rebuilt for r in results} == {
        ("dit", "stream"): False, ("dit", "offline"): False, ("hift", "offline"): True}


def test_manifest_round_trip_and_refusals(models, ort_set, tmp_path):
    m = Manifest.load(ort_set)
    assert Manifest.from_dict(json.loads(json.dumps(m.to_dict()))).to_dict() == m.to_dict()
    assert m.model["weights_hash"] == models.weights_hash and m.backend == "onnxruntime"
    folder = str(tmp_path / "es")
    shutil.copytree(ort_set, folder)
    with pytest.raises(EngineSetError, match="weights"):
        LoadedEngineSet(folder, "0" * 16)
    d = m.to_dict()
    d["versions"]["onnxruntime"] = "0.0.1"
    with open(os.path.join(folder, "manifest.json"), "w") as f:
        json.dump(d, f)
    with pytest.raises(EngineSetError, match="onnxruntime 0.0.1"):
        LoadedEngineSet(folder, models.weights_hash)
    with open(os.path.join(folder, "manifest.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(EngineSetError, match="not valid JSON"):
        Manifest.load(folder)
    with pytest.raises(EngineSetError, match="no manifest.json"):
        Manifest.load(str(tmp_path))


def test_ar_trtllm_export_and_commands_recorded(ort_set):
    m = Manifest.load(ort_set)
    convert, build = m.commands["trtllm"]
    assert "from_hugging_face" in convert and build.startswith("trtllm-build --checkpoint_dir ")
    for flag in ("--max_batch_size 2", "--max_seq_len 512", "--gemm_plugin bfloat16"):
        assert flag in build
    assert m.commands["trtllm_built"] is False and "tensorrt_llm" in m.commands["trtllm_note"]
    hf = os.path.join(ort_set, m.commands["ar_hf_checkpoint"])
    with open(os.path.join(hf, "config.json")) as f:
        assert json.load(f)["vocab_size"] % 128 == 0
    assert os.path.isfile(os.path.join(hf, "model.safetensors"))


def test_inspect_prints_table(ort_set, capsys):
    assert main(["inspect", ort_set]) == 0
    out = capsys.readouterr().out
    assert "dit/stream/b2xt64" in out and "onnxruntime" in out


def test_tensorrt_backend_absent_exits_2(tmp_path, capsys):
    pytest.importorskip("torch")
    try:
        import tensorrt  # noqa: F401
        pytest.skip("tensorrt is installed here")
    except ImportError:
        pass
    rc = main(["build", "--model", "tiny", "--backend", "tensorrt", "--device", "cuda", "--out", str(tmp_path / "x"),
               "--quiet"])
    assert rc == 2
    assert "'tensorrt'" in capsys.readouterr().err


def test_auto_backend_on_cpu_is_onnxruntime():
    assert resolve_backend("auto", "cpu") == "onnxruntime"
    with pytest.raises(EngineSetError, match="unknown backend"):
        resolve_backend("onnx", "cpu")


# ------------------------------------------------------------------ TensorRT pure-Python parts (no tensorrt needed)

def test_shape_templates_and_profiles():
    assert resolve_dim("T*480", 2, 64) == 30720 and resolve_dim("B", 3, 9) == 3 and resolve_dim(80, 1, 1) == 80
    assert resolve_dim("T*480+480", 1, 10) == 5280
    with pytest.raises(EngineSetError):
        resolve_dim("T**2", 1, 1)
    tpl = {"x": ["B", 80, "T"], "t": ["B"], "sine_noise": [1, "T*480", 9]}
    static = profile_shapes(tpl, Bucket("dit", "offline", 4, 128))
    assert static["x"] == ((4, 80, 128),) * 3 and static["t"] == ((4,),) * 3
    dyn = profile_shapes(tpl, Bucket("dit", "offline", 2, 1024, min_length=256))
    assert dyn["x"] == ((2, 80, 256), (2, 80, 1024), (2, 80, 1024))
    assert dyn["sine_noise"][0] == (1, 256 * 480, 9)
    keys = ["dit/offline/b2xt64", "dit/offline/b4xt128"]
    assert profile_index(keys, parse_key("dit/offline/b4xt128")) == 1
    with pytest.raises(EngineSetError, match="not in this engine"):
        profile_index(keys, parse_key("dit/offline/b8xt128"))
    assert resolve_shape(["B", "T"], 2, 3) == (2, 3)


def test_network_flags_for_tensorrt_10_and_11():
    class Flag:
        STRONGLY_TYPED = 1

    class Trt10:
        __version__ = "10.13.3.9"
        NetworkDefinitionCreationFlag = Flag

    class Trt11(Trt10):
        __version__ = "11.4.0.106"

    assert network_flags(Trt10) == 2 and network_flags(Trt11) == 0
