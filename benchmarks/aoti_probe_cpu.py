"""Narrowing run 25's finding (benchmarks/aoti_probe.py on the lent H200, torch 2.11.0+cu130): loading ANY AOTInductor
package segfaults there, a CPU package of a two-layer Linear included, inside `AOTIModelPackageLoader` (called from
torch/export/pt2_archive/_package.py `_load_aoti`). This probe builds that CPU package once (and the same model
through the deprecated `aot_compile` .so path, in parallel) and then loads it, each way in its own process:

  package            torch._inductor.aoti_load_package (the failing call, to reproduce it)
  runner_from_so     the package unzipped, its model .so loaded by torch._C._aoti.AOTIModelContainerRunnerCpu
                     (no package loader: tells the loader from the compiled model)
  deprecated_so      torch._export.aot_load on the aot_compile .so
  gdb                the failing call under `gdb -batch` for a native backtrace (when gdb is installed)

and prints `ldd` of the model .so (which libtorch / libgomp / libstdc++ it resolves to). CPU only: no GPU needed, so
the same script also runs here (a different torch) as a control.
    cd /tmp && python3 REPO/benchmarks/aoti_probe_cpu.py OUT_DIR
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import time
import zipfile

OUT = sys.argv[1] if len(sys.argv) > 1 else "/tmp/aoti_probe_cpu"
os.makedirs(OUT, exist_ok=True)
PKG = os.path.join(OUT, "m.pt2")
SO = os.path.join(OUT, "m_deprecated.so")

MODEL = """
import torch
torch.manual_seed(0)  # the same weights in both builds
m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).eval()
x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
B = torch.export.Dim('b', min=1, max=64)
"""

BUILD_PKG = MODEL + f"""
with torch.no_grad():
    ep = torch.export.export(m, (x,), dynamic_shapes=({{0: B}},))
    torch._inductor.aoti_compile_and_package(ep, package_path={PKG!r})
    torch.save({{'x': x, 'ref': m(x)}}, {PKG!r} + '.ref')
print('built package', flush=True)
"""

BUILD_SO = MODEL + f"""
with torch.no_grad():
    so = torch._export.aot_compile(m, (x,), dynamic_shapes=({{0: B}},), options={{'aot_inductor.output_path': {SO!r}}})
print('built', so, flush=True)
"""

RUN = """
t = torch.load(REF)
print('loaded', flush=True)
with torch.inference_mode():
    out = CALL(t['x'])
out = out[0] if isinstance(out, (list, tuple)) else out
print('ran; max abs err', (out - t['ref']).abs().max().item(), flush=True)
"""


def load_code(how: str, so_in_pkg: str | None) -> str:
    head = f"import torch\nREF = {PKG + '.ref'!r}\n"
    if how == "package":
        body = f"m = torch._inductor.aoti_load_package({PKG!r})\nCALL = m\n"
    elif how == "runner_from_so":
        body = (f"r = torch._C._aoti.AOTIModelContainerRunnerCpu({so_in_pkg!r}, 1)\n"
                "CALL = lambda x: r.run([x])\n")
    else:
        body = f"m = torch._export.aot_load({SO!r}, 'cpu')\nCALL = m\n"
    return head + body + RUN


DEADLINE = time.perf_counter() + float(os.environ.get("AOTI_PROBE_S", "1e9"))  # the whole probe's time (device call)


def run(name: str, argv: list[str], timeout: int = 90) -> None:
    t0 = time.perf_counter()
    timeout = max(1, min(timeout, int(DEADLINE - t0)))
    try:
        p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
        rc, out = p.returncode, p.stdout
    except subprocess.TimeoutExpired as e:
        rc, out = "timeout", (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    keep = [ln for ln in out.splitlines() if "Warning" not in ln and "warn(" not in ln]
    print(f"== {name}: rc {rc} ({time.perf_counter() - t0:.1f}s)\n" + "\n".join(keep[-25:]), flush=True)


def main() -> None:
    import torch

    print("torch", torch.__version__, "gcc", shutil.which("gcc"), "gdb", shutil.which("gdb"), flush=True)
    t0 = time.perf_counter()
    procs = {n: subprocess.Popen([sys.executable, "-X", "faulthandler", "-c", c], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
             for n, c in (("build package", BUILD_PKG), ("build deprecated .so", BUILD_SO))}
    for n, p in procs.items():
        try:
            out, _ = p.communicate(timeout=max(1, 150 - (time.perf_counter() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            out = "timeout"
        print(f"== {n}: rc {p.returncode} at {time.perf_counter() - t0:.0f}s\n" + "\n".join(out.splitlines()[-4:]),
              flush=True)
    so_in_pkg = None
    if os.path.isfile(PKG):
        xdir = os.path.join(OUT, "unzipped")
        with zipfile.ZipFile(PKG) as z:
            print("package members:", *[i.filename for i in z.infolist()][:20], sep="\n  ", flush=True)
            z.extractall(xdir)
        sos = glob.glob(os.path.join(xdir, "**", "*.so"), recursive=True)
        so_in_pkg = sos[0] if sos else None
        # the loads that tell the most first (run 28 ran out of time on the package loader's): the bare .so,
        # then the deprecated path, then the package loader that segfaulted in runs 25 / 28
        if so_in_pkg:
            print(subprocess.run(["ldd", so_in_pkg], capture_output=True, text=True).stdout, flush=True)
            run("runner_from_so", [sys.executable, "-X", "faulthandler", "-c", load_code("runner_from_so", so_in_pkg)],
                timeout=60)
    if os.path.isfile(SO):
        run("deprecated_so", [sys.executable, "-X", "faulthandler", "-c", load_code("deprecated_so", None)], timeout=60)
    if os.path.isfile(PKG):
        run("package", [sys.executable, "-X", "faulthandler", "-c", load_code("package", None)], timeout=60)
        if shutil.which("gdb"):
            run("gdb", ["gdb", "-batch", "-ex", "run", "-ex", "bt 25", "--args", sys.executable, "-c",
                        load_code("package", None)], timeout=120)


if __name__ == "__main__":
    main()
