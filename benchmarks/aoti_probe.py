"""Why does loading an AOTInductor package segfault on the lent H200 (runs 8, 13 and 14)? Run 14 showed it is not
our model: a two-layer Linear package built on CUDA segfaults in `AOTIModelPackageLoader` too. This probe builds the
same Linear with several AOTInductor settings (and on the CPU, and through the deprecated `aot_compile` / `aot_load`
path), each in its own process (builds in parallel, then each load in its own process: a crash costs only that
probe), and prints every probe's exit code and log tail. On the GPU machine, outside the repo (so the installed
wheel is imported):  cd /tmp && python3 REPO/benchmarks/aoti_probe.py OUT_DIR
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

OUT = sys.argv[1] if len(sys.argv) > 1 else "/tmp/aoti_probe"
os.makedirs(OUT, exist_ok=True)

BUILD = """
import torch
dev = DEVICE
m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).to(dev).eval()
x = torch.randn(4, 64, device=dev)
B = torch.export.Dim('b', min=1, max=64)
with torch.no_grad():
    ep = torch.export.export(m, (x,), dynamic_shapes=({0: B},))
    if DEPRECATED:
        so = torch._export.aot_compile(m, (x,), dynamic_shapes=({0: B},), options={'aot_inductor.output_path': PATH})
        print('so', so)
    else:
        torch._inductor.aoti_compile_and_package(ep, package_path=PATH, inductor_configs=CONFIGS)
    torch.save({'x': x.cpu(), 'ref': m(x).cpu()}, PATH + '.ref')
print('built', flush=True)
"""

LOAD = """
import torch
dev = DEVICE
t = torch.load(PATH + '.ref')
if DEPRECATED:
    m = torch._export.aot_load(PATH, dev)
else:
    m = torch._inductor.aoti_load_package(PATH)
print('loaded', flush=True)
with torch.inference_mode():
    out = m(t['x'].to(dev))
out = out[0] if isinstance(out, (list, tuple)) else out
print('ran; max abs err', (out.float().cpu() - t['ref'].float()).abs().max().item(), flush=True)
"""

PROBES = {  # name: (device, deprecated path, inductor configs)
    "cpu default": ("cpu", False, {}),
    "cuda constants outside the .so": ("cuda", False, {"aot_inductor.package_constants_in_so": False}),
    "cuda embed_kernel_binary": ("cuda", False, {"aot_inductor.embed_kernel_binary": True}),
    "cuda force_mmap_weights": ("cuda", False, {"aot_inductor.force_mmap_weights": True}),
    "cuda deprecated aot_compile + aot_load": ("cuda", True, {}),
}


def _code(template: str, name: str, device: str, deprecated: bool, configs: dict) -> tuple[str, str]:
    path = os.path.join(OUT, name.replace(" ", "_").replace("+", "").replace("/", "") + (".so" if deprecated else ".pt2"))
    head = f"PATH={path!r}\nDEVICE={device!r}\nDEPRECATED={deprecated!r}\nCONFIGS={configs!r}\n"
    return path, head + template


def _tail(log: str, n: int = 10) -> str:
    with open(log) as f:
        lines = [ln for ln in f.read().splitlines() if "Warning" not in ln and "warn(" not in ln
                 and "Extension modules" not in ln]
    return "\n".join(lines[-n:])


def main() -> None:
    import torch

    print("torch", torch.__version__, "cuda", torch.version.cuda, "gcc", shutil.which("gcc"), flush=True)
    t0 = time.perf_counter()
    builds = {}
    for name, (device, deprecated, configs) in PROBES.items():  # all builds at once (16 cores)
        _path, code = _code(BUILD, name, device, deprecated, configs)
        log = os.path.join(OUT, name.replace(" ", "_") + ".build.log")
        with open(log, "w") as f:
            builds[name] = (subprocess.Popen([sys.executable, "-X", "faulthandler", "-c", code], stdout=f,
                                             stderr=subprocess.STDOUT), log)
    for name, (proc, log) in builds.items():
        try:
            rc = proc.wait(timeout=max(1, 300 - (time.perf_counter() - t0)))
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "timeout"
        print(f"== build {name}: rc {rc} at {time.perf_counter() - t0:.0f}s\n{_tail(log, 4)}", flush=True)
        if rc != 0:
            continue
        device, deprecated, configs = PROBES[name]
        _path, code = _code(LOAD, name, device, deprecated, configs)
        log = log.replace(".build.log", ".load.log")
        with open(log, "w") as f:
            try:
                rc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], stdout=f,
                                    stderr=subprocess.STDOUT, timeout=120).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        print(f"== load {name}: rc {rc}\n{_tail(log)}", flush=True)
    for f in os.listdir(OUT):  # packages stay on the machine: only logs come back
        if not f.endswith(".log"):
            p = os.path.join(OUT, f)
            shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)


if __name__ == "__main__":
    main()
