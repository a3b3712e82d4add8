"""The offline DiT as an AOTInductor package, built, loaded and timed in a child process (`trtbuild bench --suite dit
--aoti`): a crash in AOTInductor costs this variant, not the run."""
from __future__ import annotations

import os
import time

import torch

from .common import full_models
from .timing import graph_timing, max_err


class AotiBuild:
    """The offline DiT as an AOTInductor package (dynamic batch and frames), built, loaded and timed in a child process.

    Started when the run starts, so its compile overlaps the sections before the DiT one; the child then waits until
    `measure(shapes)` tells it to go (the parent is idle while it times, so no two measurements share the GPU), loads
    the package, captures it in a CUDA graph per shape (CUDA) and times it against its own eager DiT. The child
    rebuilds the same seeded models (same weights as this process). Everything that can crash (run 4 of 2026-12-02
    segfaulted building the package, run 8 loading it) happens in the child: a crash costs this variant, not the run,
    and the child's log (with its faulthandler stack) lands in the error."""

    def __init__(self, model: str, dtype: torch.dtype, device: str, out_dir: str):
        import subprocess
        import sys

        self.path = os.path.join(out_dir, "dit_offline.pt2")
        self.results = os.path.join(out_dir, "results.json")
        self.log = os.path.join(out_dir, "child.log")
        self.t0 = time.perf_counter()
        code = (f"import torch; from cosytrt.tools.bench.aoti import aoti_child; aoti_child({model!r}, "
                f"torch.{str(dtype).split('.')[-1]}, {device!r}, {self.path!r}, {self.results!r})")
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-X", "faulthandler", "-c", code], stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.PIPE, text=True)

    def measure(self, shapes: list[tuple[int, int]]) -> dict:
        """Tell the child to time `shapes` [(rows, frames)]; returns {"build_s", "rows": [{rows, frames,
        aoti_graph_ms, aoti_graph_max_abs_err}]}. Raises RuntimeError with the child's log tail if it failed."""
        import json

        try:
            self.proc.stdin.write(json.dumps(shapes) + "\n")
            self.proc.stdin.close()
        except BrokenPipeError:  # the child is gone already: its exit code and log say why
            pass
        rc = self.proc.wait()
        if rc != 0:
            with open(self.log) as f:
                tail = f.read()[-3000:]
            raise RuntimeError(f"AOTInductor DiT child exited with {rc} after {time.perf_counter() - self.t0:.0f}s:"
                               f"\n{tail}")
        with open(self.results) as f:
            return json.load(f)


def aoti_child(model: str, dtype: torch.dtype, device: str, path: str, results: str) -> None:
    """The child process of `AotiBuild`: build the package, wait for the shapes on stdin, load it, time it per shape
    (a CUDA graph of the package on CUDA, plain calls on the CPU) against the eager offline DiT, write `results`."""
    import json
    import sys

    from ...build.export_dit import example_inputs
    from ...build.stage_exports import dit_export
    from ...runtime.models.dit import FixedModeDiT

    _cfg, llm, flow, hift = full_models(device, dtype, model)
    del llm, hift
    dit = flow.estimator
    t0 = time.perf_counter()
    dit_export(dit, False, dtype, device).to_aoti(path, 64, 16, 2048)
    build_s = time.perf_counter() - t0
    print(f"built {path} in {build_s:.0f}s", flush=True)
    shapes = json.loads(sys.stdin.readline())
    cuda = device.startswith("cuda")
    loaded = torch._inductor.aoti_load_package(path, run_single_threaded=cuda)
    print("loaded", flush=True)
    eager = FixedModeDiT(dit, False)
    rows = []
    for B, T in shapes:
        args = example_inputs(dit, B, T, dtype=dtype, device=device)
        with torch.inference_mode():
            ref = eager(*args).clone()
            if cuda:
                ms, err, _ = graph_timing(loaded, device, args, ref, reps=10)
            else:  # the CPU test of this child: one timed call, no graph
                loaded(*args)
                t = time.perf_counter()
                out = loaded(*args)
                ms = (time.perf_counter() - t) * 1e3
                err = max_err(out[0] if isinstance(out, (list, tuple)) else out, ref)
        rows.append({"rows": B, "frames": T, "aoti_graph_ms": ms, "aoti_graph_max_abs_err": err})
        print(f"AOTI DiT {B}x{T}: {ms:.2f} ms", flush=True)
    with open(results, "w") as f:
        json.dump({"build_s": build_s, "rows": rows}, f)
