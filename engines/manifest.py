"""The engine-set manifest: model identity, backend and versions, device, dtype, every engine with its buckets."""
from __future__ import annotations

import datetime as _dt
import json
import os
from dataclasses import dataclass, field

from .base import EngineSpec
from .errors import EngineSetError

MANIFEST = "manifest.json"
FORMAT = 1


def backend_versions(backend: str) -> dict[str, str]:
    """Versions an engine file is tied to: torch always; the backend's own package too."""
    import torch

    v = {"torch": torch.__version__}
    if backend == "onnxruntime":
        import onnxruntime

        v["onnxruntime"] = onnxruntime.__version__
    elif backend == "tensorrt":
        from .tensorrt import tensorrt_library

        lib = tensorrt_library()
        v["tensorrt"] = lib.version if lib else "absent"
        v["tensorrt_library"] = lib.library if lib else "absent"  # "tensorrt" | "tensorrt_rtx"
    elif backend == "trtllm":
        try:
            import tensorrt_llm  # noqa: PLC0415

            v["tensorrt_llm"] = tensorrt_llm.__version__
        except ImportError:
            v["tensorrt_llm"] = "absent"
    return v


# the version that binds an engine file to its backend (AOTInductor packages are tied to the torch build)
BINDING_VERSION = {"onnxruntime": "onnxruntime", "aoti": "torch", "tensorrt": "tensorrt", "trtllm": "tensorrt_llm",
                   "compiled": "torch"}
_LIB_NAMES = {"tensorrt": "TensorRT", "tensorrt_rtx": "TensorRT-RTX", "absent": "no TensorRT"}
AR_RUNNER_NAMES = ("torch", "trtllm")  # engines.AR_RUNNERS


@dataclass
class Manifest:
    model: dict  # {"source", "kind", "weights_hash", "config"}
    backend: str
    device: str
    dtype: str
    versions: dict
    profile: dict
    profile_hash: str
    engines: list[EngineSpec] = field(default_factory=list)
    created: str = ""
    build_seconds: float = 0.0
    commands: dict = field(default_factory=dict)  # e.g. the exact trtllm-build command lines
    format: int = FORMAT
    # which TensorRT-family library built the plans: "tensorrt" | "tensorrt_rtx" ("" for other backends)
    tensorrt_library: str = ""
    ar_runner: str = "torch"  # the AR runner this set expects: "torch" | "trtllm" (engines.AR_RUNNERS)
    compile_cache: dict = field(default_factory=dict)  # backend "compiled": build/compile_cache.py

    def to_dict(self) -> dict:
        return {"format": self.format, "model": self.model, "backend": self.backend, "device": self.device,
                "dtype": self.dtype, "versions": self.versions, "profile": self.profile,
                "profile_hash": self.profile_hash, "engines": [e.to_dict() for e in self.engines],
                "created": self.created, "build_seconds": self.build_seconds, "commands": self.commands,
                "tensorrt_library": self.tensorrt_library,
                "ar_runner": self.ar_runner, "compile_cache": self.compile_cache}

    @staticmethod
    def from_dict(d: dict, where: str = MANIFEST) -> "Manifest":
        try:
            if d.get("format") != FORMAT:
                raise EngineSetError(f"{where}: manifest format {d.get('format')!r}, this cosytrt reads {FORMAT}")
            return Manifest(model=d["model"], backend=d["backend"], device=d["device"], dtype=d["dtype"],
                            versions=d["versions"], profile=d["profile"], profile_hash=d["profile_hash"],
                            engines=[EngineSpec.from_dict(e) for e in d["engines"]], created=d.get("created", ""),
                            build_seconds=d.get("build_seconds", 0.0), commands=d.get("commands", {}),
                            tensorrt_library=d.get("tensorrt_library") or (
                                "tensorrt" if d["backend"] == "tensorrt" else ""),
                            ar_runner=d.get("ar_runner", "torch"), compile_cache=d.get("compile_cache", {}))
        except KeyError as e:
            raise EngineSetError(f"{where}: manifest lacks field {e.args[0]!r}") from None

    def save(self, folder: str) -> str:
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, MANIFEST)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
        os.replace(tmp, path)
        return path

    @staticmethod
    def load(folder: str) -> "Manifest":
        path = os.path.join(folder, MANIFEST)
        if not os.path.isfile(path):
            raise EngineSetError(f"not an engine set: {folder!r} has no {MANIFEST}")
        try:
            with open(path) as f:
                d = json.load(f)
        except json.JSONDecodeError as e:
            raise EngineSetError(f"{path}: not valid JSON ({e})") from None
        return Manifest.from_dict(d, where=path)

    def engine(self, stage: str, mode: str) -> EngineSpec | None:
        for e in self.engines:
            if e.stage == stage and e.mode == mode:
                return e
        return None

    def check_compatible(self, weights_hash: str, backend_versions_now: dict | None = None) -> None:
        """Refuse an engine set built from other weights or by another backend version, saying which."""
        built = self.model.get("weights_hash")
        if built != weights_hash:
            raise EngineSetError(f"engine set was built for model weights {built} but the loaded model is "
                                 f"{weights_hash}: rebuild it with `trtbuild build`")
        now = backend_versions_now if backend_versions_now is not None else backend_versions(self.backend)
        if self.backend == "tensorrt":
            here = now.get("tensorrt_library", "tensorrt")
            if self.tensorrt_library and here != self.tensorrt_library:
                raise EngineSetError(f"engine set was built by {_LIB_NAMES.get(self.tensorrt_library, self.tensorrt_library)}"
                                     f" but this machine has {_LIB_NAMES.get(here, here)}: rebuild it with "
                                     f"`trtbuild build` (TensorRT and TensorRT-RTX plans are not interchangeable)")
        key = BINDING_VERSION.get(self.backend)
        if key and self.versions.get(key) != now.get(key):
            raise EngineSetError(f"engine set was built with {key} {self.versions.get(key)} but this machine has "
                                 f"{key} {now.get(key)}: rebuild it with `trtbuild build`")


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()
