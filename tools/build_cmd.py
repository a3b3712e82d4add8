"""`trtbuild build`: build an engine set (ONNX Runtime / AOTInductor / TensorRT) from a bucket profile."""
from __future__ import annotations

import json
import sys

from ._cli import BACKEND_CHOICES, add_device, captured_stdout, quiet_exporters
from .table import format_table


def add_arguments(p) -> None:
    p.add_argument("--model", default="tiny", help="'tiny', 'random-full' (the full-size architecture with seeded "
                   "random weights: build checks and benchmarks) or a CosyVoice3 model directory")
    p.add_argument("--profile", default=None, help="profile YAML path or shipped name (default: tiny for the tiny "
                   "model, default otherwise)")
    p.add_argument("--backend", default="auto", choices=BACKEND_CHOICES,
                   help="auto (TensorRT where installed on CUDA, else AOTInductor on CUDA, else ONNX Runtime)")
    add_device(p)
    p.add_argument("--out", required=True, help="engine-set folder to write (replaced only when the build succeeds)")
    p.add_argument("--stages", default=None, help="comma-separated stages of the profile to build (default: all), "
                   "e.g. dit,hift")
    p.add_argument("--onnx-dir", default=None, help="tensorrt: reuse ONNX exports from this folder (named "
                   "<stage>_<mode>_<dtype>.onnx; missing ones are exported there), e.g. shared by several profiles")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--verbose", action="store_true", help="show the exporters' (torch.export / ONNX) warnings")
    p.add_argument("--json", action="store_true", help="print one JSON object (the engines built) instead of tables")


def run(args) -> int:
    from ..build.engine_set import build_engine_set, check_out_dir, resolve_backend
    from ..runtime.models.loading import load_models

    check_out_dir(args.out)  # before any work: never replace the current folder or a folder of something else
    if resolve_backend(args.backend, args.device) == "tensorrt":
        from ..engines.tensorrt import import_tensorrt

        import_tensorrt()  # names the missing package before any work
    from ..runtime.stages.profile import load_profile
    profile = load_profile(args.profile or ("tiny" if args.model == "tiny" else "default"))
    if args.stages:
        profile = select_stages(profile, args.stages.split(","))
    with captured_stdout(args.json), quiet_exporters(args.verbose):
        models = random_full_models(args.device) if args.model == "random-full" else load_models(args.model,
                                                                                                  device=args.device)
        manifest, results = build_engine_set(models, profile, args.backend, args.device, args.out,
                                             progress=not (args.quiet or args.json), onnx_dir=args.onnx_dir)
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
    lib = f", {manifest.tensorrt_library}" if manifest.tensorrt_library else ""
    print(format_table(["stage", "mode", "file", "buckets", "dtype", "status", "seconds"], rows,
                       title=f"engine set {args.out} ({manifest.backend}{lib}, {manifest.device})"))
    for r in results:
        if r.spec.extra.get("runnable_here") is False:
            print(f"{r.spec.stage}/{r.spec.mode}: built, but cannot run on this machine: "
                  f"{r.spec.extra.get('not_runnable_reason')}")
    cc = manifest.compile_cache
    if cc:
        print(f"compile cache {cc['file']}: {cc['bytes'] / 1e6:.1f} MB, {cc.get('graphs')} graphs compiled in "
              f"{cc.get('compile_seconds')} s (torch {cc['torch']}, {cc['device_name']}); AR runner: "
              f"{manifest.ar_runner}")
    print(f"{len(manifest.files)} files hashed (sha256) in the manifest; `trtbuild inspect --verify {args.out}` "
          f"re-checks them")
    for note in (manifest.commands.get("trtllm_note"),):
        if note:
            print(f"AR (TensorRT-LLM): not built here: {note}; commands recorded in the manifest", file=sys.stderr)
    return 0


def select_stages(profile, stages: list[str]):
    """The profile with only `stages` (an unknown or absent stage is an error naming the profile's)."""
    import dataclasses

    from ..engines.errors import ProfileError

    missing = [s for s in stages if s not in profile.stages]
    if missing:
        raise ProfileError(f"--stages {','.join(stages)}: {', '.join(missing)} not in the profile (has "
                           f"{', '.join(profile.stages)})")
    return dataclasses.replace(profile, stages={k: v for k, v in profile.stages.items() if k in stages})


def random_full_models(device: str):
    """The full-size CosyVoice3 architecture with the bench's seeded random weights (folded HiFT): one recipe and one
    label ("random-full-seed0") with `trtbuild bench`, so a set built from them opens against the bench's models."""
    import torch

    from ..runtime.models.loading import check_device
    from .bench.common import full_models, random_models

    check_device(device)
    return random_models(*full_models(device, torch.float32, "full"))
