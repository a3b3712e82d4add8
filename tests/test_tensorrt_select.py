"""TensorRT-family library selection (tensorrt / TensorRT for RTX / neither), the manifest field naming it, and the
refusal of a TensorRT-RTX plan on a GPU it does not support — all with fake modules (no TensorRT needed)."""
import enum
import importlib
import types

import pytest
import torch

from cosytrt.engines import manifest as manifest_mod
from cosytrt.engines.manifest import Manifest
from cosytrt.build.tensorrt_build import compute_capability_targets, network_flags
from cosytrt.engines import tensorrt as trt_mod
from cosytrt.engines.errors import BackendUnavailableError, EngineSetError

REAL_IMPORT = importlib.import_module
H200_ERROR = ("IRuntime::deserializeCudaEngine: Error Code 6: API Usage Error (The engine cannot run on this GPU, "
              "which has compute capability 9.0. Supported compute capabilities: None. TensorRT-RTX does not support "
              "this compute capability ...)")


class Severity(enum.IntEnum):
    INTERNAL_ERROR = 0
    ERROR = 1
    WARNING = 2
    INFO = 3
    VERBOSE = 4


class Validity(enum.IntEnum):
    VALID = 0
    SUBOPTIMAL = 1
    INVALID = 2


class Diag(enum.IntEnum):
    VERSION_MISMATCH = 1
    UNSUPPORTED_CC = 2


class CC(enum.IntEnum):
    NONE = 0
    CURRENT = 1
    SM75 = 2
    SM80 = 3
    SM86 = 4
    SM89 = 5
    SM120 = 6
    SM121 = 7


def fake_trt(name: str, version: str, refuse: bool = False) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__version__ = version

    class ILogger:
        def __init__(self):
            pass

    ILogger.Severity = Severity
    m.ILogger = ILogger
    m.NetworkDefinitionCreationFlag = types.SimpleNamespace(STRONGLY_TYPED=0)
    if "rtx" in name:
        m.ComputeCapability = CC
        m.EngineInvalidityDiagnostics = Diag

    class Runtime:
        def __init__(self, logger):
            self.logger = logger

        def get_engine_validity(self, plan):
            return (Validity.INVALID, Diag.UNSUPPORTED_CC) if refuse else (Validity.VALID, 0)

        def deserialize_cuda_engine(self, plan):
            if refuse:
                self.logger.log(Severity.ERROR, H200_ERROR)
                return None
            return types.SimpleNamespace(num_optimization_profiles=1)

    m.Runtime = Runtime
    return m


def only(monkeypatch, **present):
    """Make importlib.import_module in engines/tensorrt.py see only the given fake modules."""
    def fake_import(name, *a, **k):
        if name in present:
            return present[name]
        if name in ("tensorrt", "tensorrt_rtx_bindings", "tensorrt_rtx"):
            raise ImportError(f"No module named {name!r}")
        return REAL_IMPORT(name, *a, **k)

    monkeypatch.setattr(trt_mod.importlib, "import_module", fake_import)


def test_tensorrt_is_preferred(monkeypatch):
    only(monkeypatch, tensorrt=fake_trt("tensorrt", "10.13.3.9"),
         tensorrt_rtx_bindings=fake_trt("tensorrt_rtx_bindings", "1.7.1.116"))
    trt, lib = trt_mod.select_tensorrt()
    assert trt.__name__ == "tensorrt" and lib.library == "tensorrt" and not lib.rtx and lib.version == "10.13.3.9"
    assert trt_mod.tensorrt_version() == "10.13.3.9"


def test_tensorrt_rtx_bindings_when_tensorrt_is_absent(monkeypatch):
    only(monkeypatch, tensorrt_rtx_bindings=fake_trt("tensorrt_rtx_bindings", "1.7.1.116"))
    trt, lib = trt_mod.select_tensorrt()
    assert lib.library == "tensorrt_rtx" and lib.module == "tensorrt_rtx_bindings" and lib.rtx
    assert str(lib) == "TensorRT-RTX 1.7.1.116 (tensorrt_rtx_bindings)"
    assert trt_mod.import_tensorrt() is trt
    v = manifest_mod.backend_versions("tensorrt")
    assert v["tensorrt"] == "1.7.1.116" and v["tensorrt_library"] == "tensorrt_rtx"


def test_neither_names_both_and_why(monkeypatch):
    only(monkeypatch)
    with pytest.raises(BackendUnavailableError) as e:
        trt_mod.select_tensorrt()
    msg = str(e.value)
    assert "'tensorrt'" in msg and "tensorrt-rtx-cu13-bindings" in msg
    assert "tensorrt: No module named 'tensorrt'" in msg
    assert "tensorrt_rtx_bindings: No module named 'tensorrt_rtx_bindings'" in msg
    assert trt_mod.tensorrt_library() is None and trt_mod.tensorrt_version() is None
    v = manifest_mod.backend_versions("tensorrt")
    assert v["tensorrt"] == "absent" and v["tensorrt_library"] == "absent"


def test_network_flags_rtx_is_strongly_typed_without_the_flag():
    # TensorRT-RTX is 1.x: a major-version rule alone would ask TensorRT 10's STRONGLY_TYPED flag
    assert network_flags(fake_trt("tensorrt_rtx_bindings", "1.7.1.116")) == 0
    assert network_flags(fake_trt("tensorrt", "10.13.3.9")) == 1 and network_flags(fake_trt("tensorrt", "11.4")) == 0


def test_compute_capability_targets():
    rtx = fake_trt("tensorrt_rtx_bindings", "1.7.1.116")
    assert compute_capability_targets(rtx, ["SM89", "sm120", "8.6", "current"]) == [CC.SM89, CC.SM120, CC.SM86,
                                                                                     CC.CURRENT]
    assert trt_mod.rtx_target_capabilities(rtx) == ["7.5", "8.0", "8.6", "8.9", "12.0", "12.1"]
    with pytest.raises(EngineSetError, match="unknown compute capability '9.0'"):
        compute_capability_targets(rtx, ["9.0"])
    with pytest.raises(EngineSetError, match="needs TensorRT-RTX"):
        compute_capability_targets(fake_trt("tensorrt", "10.13.3.9"), ["SM89"])
    assert compute_capability_targets(fake_trt("tensorrt", "10.13.3.9"), []) == []


def test_rtx_plan_refused_on_unsupported_gpu_with_the_library_error():
    rtx = fake_trt("tensorrt_rtx_bindings", "1.7.1.116", refuse=True)
    with pytest.raises(EngineSetError) as e:
        trt_mod.deserialize_plan(rtx, b"plan", "dit_stream.plan", device_capability=(9, 0))
    msg = str(e.value)
    assert "Error Code 6" in msg and "compute capability 9.0" in msg and "TensorRT-RTX 1.7.1.116" in msg
    assert "UNSUPPORTED_CC" in msg and "not Hopper" in msg
    ok = fake_trt("tensorrt_rtx_bindings", "1.7.1.116")
    assert trt_mod.deserialize_plan(ok, b"plan", "x.plan").num_optimization_profiles == 1


def test_shared_logger_is_one_per_module():
    rtx = fake_trt("tensorrt_rtx_bindings", "1.7.1.116")
    a = trt_mod.shared_logger(rtx)
    assert trt_mod.shared_logger(rtx) is a
    mark = len(a.errors)
    a.log(Severity.ERROR, "boom")
    a.log(Severity.INFO, "quiet")
    assert a.errors[mark:] == ["boom"]


def _manifest(**kw) -> Manifest:
    d = dict(model={"weights_hash": "w"}, backend="tensorrt", device="cuda", dtype="bfloat16",
             versions={"torch": torch.__version__, "tensorrt": "1.7.1.116", "tensorrt_library": "tensorrt_rtx"},
             profile={}, profile_hash="p", tensorrt_library="tensorrt_rtx")
    d.update(kw)
    return Manifest(**d)


def test_manifest_names_the_library_and_refuses_the_other(tmp_path):
    m = _manifest()
    m.save(str(tmp_path))
    back = Manifest.load(str(tmp_path))
    assert back.tensorrt_library == "tensorrt_rtx" and back.to_dict()["tensorrt_library"] == "tensorrt_rtx"
    back.check_compatible("w", {"tensorrt": "1.7.1.116", "tensorrt_library": "tensorrt_rtx"})
    with pytest.raises(EngineSetError, match="built by TensorRT-RTX but this machine has TensorRT"):
        back.check_compatible("w", {"tensorrt": "1.7.1.116", "tensorrt_library": "tensorrt"})
    # a manifest written before the field existed: its plans came from TensorRT
    d = m.to_dict()
    del d["tensorrt_library"]
    assert Manifest.from_dict(d).tensorrt_library == "tensorrt"
    d["backend"] = "onnxruntime"
    assert Manifest.from_dict(d).tensorrt_library == ""


def test_float32_mish_keeps_the_source_module():
    from cosytrt.build.export_dit import Float32Mish, float32_mish

    seq = torch.nn.Sequential(torch.nn.Conv1d(4, 4, 3), torch.nn.Mish()).to(torch.bfloat16)
    copy = float32_mish(torch.nn.Sequential(*[m for m in seq]))
    assert isinstance(copy[1], Float32Mish) and isinstance(seq[1], torch.nn.Mish)
    x = torch.randn(2, 4, 8, dtype=torch.bfloat16)
    y = copy(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), torch.nn.functional.mish(seq[0](x).float()), atol=1e-2, rtol=1e-2)


def test_select_stages():
    from cosytrt.engines.errors import ProfileError
    from cosytrt.runtime.stages.profile import load_profile
    from cosytrt.tools.build_cmd import select_stages

    p = select_stages(load_profile("default"), ["dit", "hift"])
    assert set(p.stages) == {"dit", "hift"} and p.stage("ar") is None
    with pytest.raises(ProfileError, match="ar not in the profile"):
        select_stages(p, ["ar"])


def test_shared_onnx_is_reused_only_for_the_same_weights(tmp_path):
    from types import SimpleNamespace

    from cosytrt.build.engine_set import EngineSetBuilder

    calls = []

    def to_onnx(path):
        calls.append(path)
        with open(path, "w") as f:
            f.write("onnx")

    exp = SimpleNamespace(input_shapes={"x": ["B", 80, "T"]}, to_onnx=to_onnx)
    me = SimpleNamespace(onnx_dir=str(tmp_path / "onnx"), models=SimpleNamespace(weights_hash="w1"))
    path = EngineSetBuilder._shared_onnx(me, exp, "dit_stream_float32")
    assert path.endswith("dit_stream_float32.onnx")
    assert EngineSetBuilder._shared_onnx(me, exp, "dit_stream_float32") == path and len(calls) == 1
    me.models.weights_hash = "w2"
    EngineSetBuilder._shared_onnx(me, exp, "dit_stream_float32")
    assert len(calls) == 2


def test_workspace_hint_names_the_needed_size():
    from cosytrt.build.tensorrt_build import TensorRTOptions, workspace_hint

    err = "[localCheckMacros.cpp::getErrorStr::132] Error Code 2: OutOfMemory (Requested size was 9914508224 bytes.)"
    hint = workspace_hint(err, TensorRTOptions(workspace_gb=8))
    assert "9.2 GiB" in hint and "{workspace_gb: 11}" in hint
    assert workspace_hint(err, TensorRTOptions(workspace_gb=12)) == "" and workspace_hint("parse error", TensorRTOptions()) == ""


def test_tensorrt_build_device_cpu_only_with_rtx(monkeypatch):
    """TensorRT-RTX builds ahead of time without a GPU: `--device cpu` exports on the CPU and the set targets CUDA;
    TensorRT 10/11 (kernel timing on the build GPU) still needs --device cuda."""
    from cosytrt.build.engine_set import tensorrt_build_device

    assert tensorrt_build_device("cuda:1") == "cuda:1"
    only(monkeypatch, tensorrt_rtx_bindings=fake_trt("tensorrt_rtx_bindings", "1.7.1.116"))
    assert tensorrt_build_device("cpu") == "cuda"
    only(monkeypatch, tensorrt=fake_trt("tensorrt", "10.13.3.9"))
    with pytest.raises(EngineSetError, match="builds on --device cuda with TensorRT 10.13.3.9"):
        tensorrt_build_device("cpu")
