"""`trtbuild build`: build an engine set (ONNX Runtime / AOTInductor / TensorRT) from a bucket profile."""
from __future__ import annotations

from .table import format_table


def add_arguments(p) -> None:
    p.add_argument("--model", default="tiny", help="'tiny' or a CosyVoice3 model directory")
    p.add_argument("--profile", default=None, help="profile YAML path or shipped name (default: tiny for the tiny "
                   "model, default otherwise)")
    p.add_argument("--backend", default="auto", help="auto | tensorrt | onnxruntime | aoti | compiled (torch.compile's "
                   "cache for the compiled serving variant: `serve --engines` then starts without compiling)")
    p.add_argument("--device", default="cpu", help="cpu | cuda")
    p.add_argument("--out", required=True, help="engine-set folder to write")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args) -> int:
    from ..build.engine_set import build_engine_set, resolve_backend
    from ..runtime.model import load_models
    from ..runtime.profile import load_profile

    if resolve_backend(args.backend, args.device) == "tensorrt":
        from ..engines.tensorrt import import_tensorrt

        import_tensorrt()  # names the missing package before any work
    profile = load_profile(args.profile or ("tiny" if args.model == "tiny" else "default"))
    models = load_models(args.model, device=args.device)
    manifest, results = build_engine_set(models, profile, args.backend, args.device, args.out,
                                         progress=not args.quiet)
    rows = [[r.spec.stage, r.spec.mode, r.spec.file, len(r.spec.buckets), r.spec.dtype,
             "built" if r.rebuilt else "up to date", r.seconds] for r in results]
    print(format_table(["stage", "mode", "file", "buckets", "dtype", "status", "seconds"], rows,
                       title=f"engine set {args.out} ({manifest.backend}, {manifest.device})"))
    cc = manifest.compile_cache
    if cc:
        print(f"compile cache {cc['file']}: {cc['bytes'] / 1e6:.1f} MB, {cc.get('graphs')} graphs compiled in "
              f"{cc.get('compile_seconds')} s (torch {cc['torch']}, {cc['device_name']}); AR runner: "
              f"{manifest.ar_runner}")
    for note in (manifest.commands.get("trtllm_note"),):
        if note:
            print(f"AR (TensorRT-LLM): not built here: {note}; commands recorded in the manifest")
    return 0
