"""The engine-set manifest: model identity, backend and versions, device, dtype, every engine with its buckets."""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
from dataclasses import dataclass, field

from .base import EngineSpec
from .buckets import DEFAULT_MAX_PADDING_WASTE, check_waste
from .errors import BucketError, EngineSetError

MANIFEST = "manifest.json"
FORMAT = 2  # 2: `files` (sha256 of every file of the set) and the model directory's file hashes
# files of a set folder that are not hashed: the manifest itself, TensorRT's timing cache (rewritten by later builds)
UNHASHED = (MANIFEST, "timing.cache")


def safe_relpath(rel, where: str = MANIFEST) -> str:
    """A manifest file entry as a path inside the set: relative, no `..`, no drive / absolute path (EngineSetError)."""
    if not isinstance(rel, str) or not rel:
        raise EngineSetError(f"{where}: file entry {rel!r} is not a file name")
    norm = rel.replace("\\", "/")
    parts = norm.split("/")
    if norm.startswith("/") or os.path.isabs(rel) or (len(norm) > 1 and norm[1] == ":") or ".." in parts \
            or "\0" in rel:
        raise EngineSetError(f"{where}: file entry {rel!r} points outside the engine set (entries must be paths "
                             f"inside the set folder)")
    return norm


def set_path(folder: str, rel: str, where: str = MANIFEST) -> str:
    """The absolute path of a set's file entry, refused when it (or a symlink on the way) leaves the folder."""
    path = os.path.join(folder, safe_relpath(rel, where))
    root = os.path.realpath(folder)
    real = os.path.realpath(path)
    if os.path.commonpath([root, real]) != root:
        raise EngineSetError(f"{where}: file entry {rel!r} resolves outside the engine set ({real})")
    return path


_HASH_CACHE: dict[tuple, str] = {}


def sha256_file(path: str) -> str:
    """Full sha256 (hex) of a file, cached per (path, size, mtime) for this process."""
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    if key not in _HASH_CACHE:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        _HASH_CACHE[key] = h.hexdigest()
    return _HASH_CACHE[key]


def hash_set_files(folder: str) -> dict[str, str]:
    """{relative path: sha256} of every regular file of a set folder except the manifest and the timing cache."""
    out = {}
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            rel = os.path.relpath(path, folder).replace(os.sep, "/")
            if rel in UNHASHED or name.endswith(".tmp") or os.path.islink(path):
                continue
            out[rel] = sha256_file(path)
    return out


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
    files: dict = field(default_factory=dict)  # {relative path: sha256} of every file of the set (engines included)
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
                "files": self.files, "tensorrt_library": self.tensorrt_library,
                "ar_runner": self.ar_runner, "compile_cache": self.compile_cache}

    @staticmethod
    def from_dict(d: dict, where: str = MANIFEST) -> "Manifest":
        """Validate and read a manifest dict; anything malformed is an EngineSetError naming the field."""
        if not isinstance(d, dict):
            raise EngineSetError(f"{where}: a manifest is a JSON object, not {type(d).__name__}")
        if d.get("format") == 1:
            raise EngineSetError(f"{where}: manifest format 1 (built before engine files were hashed): rebuild the "
                                 f"set with `trtbuild build`")
        if d.get("format") != FORMAT:
            raise EngineSetError(f"{where}: manifest format {d.get('format')!r}, this cosytrt reads {FORMAT}")
        missing = [k for k in ("model", "backend", "device", "dtype", "versions", "profile", "profile_hash",
                               "engines", "files") if k not in d]
        if missing:
            raise EngineSetError(f"{where}: manifest lacks field {missing[0]!r}")
        types = {"model": dict, "backend": str, "device": str, "dtype": str, "versions": dict, "profile": dict,
                 "profile_hash": str, "engines": list, "files": dict, "commands": dict, "created": str,
                 "build_seconds": (int, float), "tensorrt_library": str,
                 "ar_runner": str, "compile_cache": dict}
        for k, t in types.items():
            if k in d and not isinstance(d[k], t):
                raise EngineSetError(f"{where}: manifest field {k!r} has the wrong type ({type(d[k]).__name__})")
        try:  # the bucket tables' own check, here so an edited manifest fails on load, naming the file
            check_waste(d["profile"].get("max_padding_waste", DEFAULT_MAX_PADDING_WASTE))
        except BucketError as e:
            raise EngineSetError(f"{where}: profile.{e}") from None
        files = {}
        for rel, digest in d["files"].items():
            if not (isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)):
                raise EngineSetError(f"{where}: files[{rel!r}] is not a sha256 hex digest")
            files[safe_relpath(rel, where)] = digest
        engines = []
        for i, e in enumerate(d["engines"]):
            engines.append(_engine_spec(e, f"{where}: engines[{i}]"))
            if engines[-1].file and safe_relpath(engines[-1].file, where) not in files:
                raise EngineSetError(f"{where}: engine file {engines[-1].file!r} has no sha256 in 'files'")
        return Manifest(model=d["model"], backend=d["backend"], device=d["device"], dtype=d["dtype"],
                        versions=d["versions"], profile=d["profile"], profile_hash=d["profile_hash"],
                        engines=engines, created=d.get("created", ""),
                        build_seconds=float(d.get("build_seconds", 0.0)), commands=d.get("commands", {}),
                        files=files, ar_runner=d.get("ar_runner", "torch"), compile_cache=d.get("compile_cache", {}),
                        tensorrt_library=d.get("tensorrt_library") or ("tensorrt" if d["backend"] == "tensorrt" else ""))

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
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise EngineSetError(f"{path}: not valid JSON ({type(e).__name__}: {e})") from None
        except OSError as e:
            raise EngineSetError(f"{path}: cannot read the manifest ({e})") from None
        return Manifest.from_dict(d, where=path)

    def verify(self, folder: str, raise_on_error: bool = True) -> list[tuple[str, str]]:
        """Re-hash every file the manifest lists: [(file, "ok" | problem)], EngineSetError naming the first bad file
        when `raise_on_error`."""
        out = []
        for rel, digest in self.files.items():
            path = set_path(folder, rel)
            if not os.path.isfile(path):
                status = "missing"
            else:
                got = sha256_file(path)
                status = "ok" if got == digest else f"sha256 {got[:16]}.. differs from the manifest's {digest[:16]}.."
            if status != "ok" and raise_on_error:
                raise EngineSetError(f"engine set {folder!r}: file {rel} is {status}" if status == "missing" else
                                     f"engine set {folder!r}: file {rel} is corrupted or changed since the build "
                                     f"({status}); rebuild with `trtbuild build`")
            out.append((rel, status))
        return out

    def check_model_files(self, file_hashes: dict) -> None:
        """Refuse a model directory whose recorded files (checkpoints, ONNX frontends) differ, naming the file."""
        recorded = self.model.get("files") or {}
        for name, digest in recorded.items():
            now = file_hashes.get(name)
            if now is not None and now != digest:
                raise EngineSetError(f"model file {name} has sha256 {now[:16]}.. but the engine set was built from "
                                     f"{digest[:16]}..: the file changed or is corrupted")

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


def _engine_spec(e, where: str) -> EngineSpec:
    if not isinstance(e, dict):
        raise EngineSetError(f"{where} is not an object")
    for k in ("stage", "mode", "backend", "file", "input_names", "output_names", "buckets"):
        if k not in e:
            raise EngineSetError(f"{where} lacks field {k!r}")
    for k, t in (("stage", str), ("mode", str), ("backend", str), ("file", str), ("input_names", list),
                 ("output_names", list), ("buckets", list), ("dtype", str), ("device", str), ("extra", dict),
                 ("build_seconds", (int, float))):
        if k in e and not isinstance(e[k], t):
            raise EngineSetError(f"{where}.{k} has the wrong type ({type(e[k]).__name__})")
    for k in ("input_names", "output_names", "buckets"):
        if not all(isinstance(x, str) for x in e[k]):
            raise EngineSetError(f"{where}.{k} must be a list of strings")
    from .buckets import parse_key

    for key in e["buckets"]:
        try:
            parse_key(key)
        except Exception as exc:  # noqa: BLE001 - any parse failure is a malformed manifest
            raise EngineSetError(f"{where}: bad bucket key {key!r} ({exc})") from None
    safe_relpath(e["file"], where)
    return EngineSpec.from_dict(e)


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()
