"""ONNX Runtime runner: provider selection (TensorRT / CUDA / CPU), free-dimension fixing of static bucket sessions,
and the I/O-binding paths, exercised with the CPU provider (ORT's IOBinding binds CPU pointers the same way)."""
import pytest
import torch

from cosytrt.engines.base import EngineSpec
from cosytrt.engines.onnxruntime import (OnnxRuntimeRunner, OrtOptions, free_dim_values, provider_plan,
                                         tensorrt_library)
from cosytrt.engines.buckets import Bucket
from cosytrt.engines.errors import BackendUnavailableError, EngineSetError
from cosytrt.runtime.models.loading import load_models

ALL = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
DIT_TPL = {"x": ["B", 80, "T"], "mask": ["B", 1, "T"], "mu": ["B", 80, "T"], "t": ["B"], "spks": ["B", 80],
           "cond": ["B", 80, "T"]}


def _names(plan):
    return [p if isinstance(p, str) else p[0] for p in plan]


def test_provider_plan_cpu_and_cuda():
    plan, notes = provider_plan("cpu", ALL, True)
    assert plan == ["CPUExecutionProvider"]
    plan, notes = provider_plan("cuda:1", ALL, True)
    assert _names(plan) == ALL and plan[0][1]["device_id"] == 1 and plan[1][1]["device_id"] == 1
    assert "enable_cuda_graph" not in plan[1][1]
    plan, notes = provider_plan("cuda", ALL, False, "libnvinfer.so.10: cannot open")
    assert _names(plan) == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert any("TensorRT EP skipped" in n and "libnvinfer" in n for n in notes)
    plan, notes = provider_plan("cuda", ALL[1:], True)
    assert _names(plan) == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert any("no TensorrtExecutionProvider" in n for n in notes)
    plan, _ = provider_plan("cuda", ALL, True, cuda_graph=True, options=OrtOptions(tensorrt=False))
    assert _names(plan) == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert plan[0][1]["enable_cuda_graph"] == "1"
    assert plan[0][1]["use_tf32"] == "0"  # fp32 parity (run 23: TF32 on was 3e-3 off the fp32 model)
    plan, _ = provider_plan("cuda", ALL, False, options=OrtOptions.from_dict({"tf32": True}))
    assert plan[0][1]["use_tf32"] == "1"
    with pytest.raises(BackendUnavailableError, match="onnxruntime-gpu"):
        provider_plan("cuda", ["CPUExecutionProvider"], False)
    with pytest.raises(BackendUnavailableError):
        provider_plan("cuda", ALL, False, "absent", options=OrtOptions(tensorrt=True))


def test_tensorrt_library_absent_here_with_reason():
    ok, why = tensorrt_library(("libnvinfer.so.10",))
    if ok:
        pytest.skip("a TensorRT library is installed here")
    assert "libnvinfer.so.10" in why
    ok, why = tensorrt_library(("libcertainly-not-there.so.1",))
    assert not ok and "libcertainly-not-there" in why


def test_free_dim_values():
    graph = [("x", ["batch", 80, "seq_len"]), ("mask", ["batch", 1, "seq_len"]), ("mu", ["batch", 80, "seq_len"]),
             ("t", ["batch"]), ("spks", ["batch", 80]), ("cond", ["batch", 80, "seq_len"])]
    assert free_dim_values(graph, DIT_TPL, Bucket("dit", "offline", 4, 128)) == {"batch": 4, "seq_len": 128}
    hift = [("mel", ["batch", 80, "frames"]), ("sine_noise", [1, "noise_samples", 9])]
    tpl = {"mel": ["B", 80, "T"], "sine_noise": [1, "T*480", 9]}
    assert free_dim_values(hift, tpl, Bucket("hift", "offline", 2, 64)) == {"batch": 2, "frames": 64,
                                                                            "noise_samples": 64 * 480}
    with pytest.raises(EngineSetError, match="both"):
        free_dim_values([("a", ["n"]), ("b", ["n"])], {"a": ["B"], "b": ["T"]}, Bucket("dit", "offline", 2, 64))
    with pytest.raises(EngineSetError, match="no shape template"):
        free_dim_values(graph, {}, Bucket("dit", "offline", 2, 64))


def test_options_refuse_unknown_keys():
    assert OrtOptions.from_dict({"cuda_graph": False}).cuda_graph is False
    with pytest.raises(EngineSetError, match="unknown onnxruntime runner option"):
        OrtOptions.from_dict({"cuda_graphs": True})


@pytest.fixture(scope="module")
def dit_onnx(tmp_path_factory):
    from cosytrt.build.stage_exports import dit_export

    models = load_models("tiny")
    exp = dit_export(models.flow.estimator, False, torch.float32, "cpu")
    path = str(tmp_path_factory.mktemp("ort") / "dit_offline.onnx")
    exp.to_onnx(path)
    buckets = [Bucket("dit", "offline", 2, 64), Bucket("dit", "offline", 2, 128, min_length=65)]
    spec = EngineSpec("dit", "offline", "onnxruntime", "dit_offline.onnx", list(exp.input_names),
                      list(exp.output_names), [b.key for b in buckets], extra={"input_shapes": exp.input_shapes})
    return path, spec, buckets


def _inputs(B, T, seed):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, 1, T)
    mask[1, :, T // 2:] = 0
    return {"x": torch.randn(B, 80, T, generator=g), "mask": mask, "mu": torch.randn(B, 80, T, generator=g),
            "t": torch.rand(B, generator=g), "spks": torch.randn(B, 80, generator=g),
            "cond": torch.randn(B, 80, T, generator=g)}


def test_io_binding_matches_host_path_on_cpu(dit_onnx):
    path, spec, (static, dynamic) = dit_onnx
    host = OnnxRuntimeRunner(path, spec, "cpu", {"io_binding": False})
    bound = OnnxRuntimeRunner(path, spec, "cpu")  # CPU default: I/O binding, no static sessions
    assert bound.static == {} and bound.providers == ["CPUExecutionProvider"]
    for bucket, T in ((static, 64), (dynamic, 100), (dynamic, 100)):  # the repeat: pre-allocated outputs
        inp = _inputs(bucket.batch, T, T)
        ref = host.run(inp, bucket)["estimator_out"]
        out = bound.run(inp, bucket)["estimator_out"]
        assert out.shape == ref.shape and out.dtype == torch.float32
        assert torch.allclose(out, ref, atol=1e-5)
    assert len(bound._out_shapes) == 2  # learnt once per input shape


def test_static_bucket_sessions_on_cpu(dit_onnx):
    path, spec, (static, dynamic) = dit_onnx
    host = OnnxRuntimeRunner(path, spec, "cpu", {"io_binding": False})
    r = OnnxRuntimeRunner(path, spec, "cpu", {"static_buckets": True})
    assert list(r.static) == [static.key]  # the dynamic-range bucket runs on the dynamic session
    sb = r.static[static.key]
    assert not sb.graph  # CUDA graphs only on CUDA
    assert tuple(sb.outputs["estimator_out"].shape) == (2, 80, 64)
    assert any("1 static bucket sessions, 0 with a CUDA graph" in n for n in r.notes)
    for seed in (0, 1):
        inp = _inputs(2, 64, seed)
        out = r.run(inp, static)["estimator_out"]
        assert out.data_ptr() != sb.outputs["estimator_out"].data_ptr()  # a copy, not the static buffer
        assert torch.allclose(out, host.run(inp, static)["estimator_out"], atol=1e-5)
    with pytest.raises(EngineSetError, match="does not fit bucket"):
        r.run(_inputs(2, 32, 0), static)
    with pytest.raises(EngineSetError, match="missing input"):
        r.run({"x": torch.zeros(2, 80, 64)}, static)
    capped = OnnxRuntimeRunner(path, spec, "cpu", {"static_buckets": True, "max_static_sessions": 0})
    assert capped.static == {} and any("max_static_sessions=0" in n for n in capped.notes)
