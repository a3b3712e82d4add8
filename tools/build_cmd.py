"""`trtbuild build`: build an engine set (ONNX Runtime / AOTInductor / TensorRT) from a bucket profile."""
from __future__ import annotations

import json
import sys

from ._cli import BACKEND_CHOICES, add_device, captured_stdout, quiet_exporters
from .table import format_table


def add_arguments(p) -> None:
    p.add_argument("--model", default="tiny", help="'tiny' or a CosyVoice3 model directory")
    p.add_argument("--profile", default=None, help="profile YAML path or shipped name (default: tiny for the tiny "
                   "model, default otherwise)")
    p.add_argument("--backend", default="auto", choices=BACKEND_CHOICES,
                   help="auto (TensorRT where installed on CUDA, else AOTInductor on CUDA, else ONNX Runtime)")
    add_device(p)
    p.add_argument("--out", required=True, help="engine-set folder to write (replaced only when the build succeeds)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--verbose", action="store_true", help="show the exporters' (torch.export / ONNX) warnings")
    p.add_argument("--json", action="store_true", help="print one JSON object (the engines built) instead of tables")


def run(args) -> int:
    from ..build.engine_set import build_engine_set, resolve_backend
    from ..runtime.model import load_models
    from ..runtime.profile import load_profile

    if resolve_backend(args.backend, args.device) == "tensorrt":
        from ..engines.tensorrt import import_tensorrt

        import_tensorrt()  # names the missing package before any work
    profile = load_profile(args.profile or ("tiny" if args.model == "tiny" else "default"))
    with captured_stdout(args.json), quiet_exporters(args.verbose):
        models = load_models(args.model, device=args.device)
        manifest, results = build_engine_set(models, profile, args.backend, args.device, args.out,
                                             progress=not (args.quiet or args.json))
    if args.json:
        print(json.dumps({"out": args.out, "backend": manifest.backend, "device": manifest.device,
                          "dtype": manifest.dtype, "build_seconds": manifest.build_seconds,
                          "engines": [{"stage": r.spec.stage, "mode": r.spec.mode, "file": r.spec.file,
                                       "buckets": r.spec.buckets, "dtype": r.spec.dtype, "rebuilt": r.rebuilt,
                                       "seconds": r.seconds, "sha256": manifest.files.get(r.spec.file)}
                                      for r in results],
                          "model_files": manifest.model.get("files", {}),
                          "trtllm_note": manifest.commands.get("trtllm_note")}, indent=1))
        return 0
    rows = [[r.spec.stage, r.spec.mode, r.spec.file, len(r.spec.buckets), r.spec.dtype,
             "built" if r.rebuilt else "up to date", r.seconds] for r in results]
    print(format_table(["stage", "mode", "file", "buckets", "dtype", "status", "seconds"], rows,
                       title=f"engine set {args.out} ({manifest.backend}, {manifest.device})"))
    print(f"{len(manifest.files)} files hashed (sha256) in the manifest; `trtbuild inspect --verify {args.out}` "
          f"re-checks them")
    for note in (manifest.commands.get("trtllm_note"),):
        if note:
            print(f"AR (TensorRT-LLM): not built here: {note}; commands recorded in the manifest", file=sys.stderr)
    return 0
