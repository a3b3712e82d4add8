"""AOTInductor packages (`.pt2`): torch.export with dynamic batch/length ranges, then aoti_compile_and_package."""
from __future__ import annotations

import os
import time

import torch

from ..engines.errors import EngineSetError


def export_program(module: torch.nn.Module, example_inputs: tuple, dynamic_shapes: dict | tuple):
    """torch.export of `module` over the dynamic ranges (no compilation: seconds); EngineSetError with the first
    lines of torch's message when a range cannot be exported (e.g. a constraint violation)."""
    with torch.no_grad():
        try:
            return torch.export.export(module, example_inputs, dynamic_shapes=dynamic_shapes, strict=False)
        except Exception as e:  # noqa: BLE001
            lines = [ln for ln in str(e).splitlines() if ln.strip()][:6]
            raise EngineSetError(f"torch.export failed for {type(module).__name__}: " + "\n".join(lines)) from None


def compile_aoti(module: torch.nn.Module, example_inputs: tuple, dynamic_shapes: dict | tuple, package_path: str,
                 inductor_configs: dict | None = None, program=None) -> dict:
    """Export `module(*example_inputs)` with `dynamic_shapes` and compile it to `package_path` (CPU or CUDA, from
    the inputs' device). Example sizes must be >= 2 on dynamic dims (torch.export specializes 0/1)."""
    if not package_path.endswith(".pt2"):
        raise EngineSetError(f"AOTInductor package path must end with .pt2: {package_path}")
    t0 = time.perf_counter()
    with torch.no_grad():
        ep = program if program is not None else export_program(module, example_inputs, dynamic_shapes)
        tmp = package_path[:-4] + ".tmp.pt2"
        if os.path.exists(tmp):
            os.remove(tmp)
        configs = {"max_autotune": False}
        if example_inputs[0].device.type == "cpu":
            configs["freezing"] = True
        configs.update(inductor_configs or {})
        torch._inductor.aoti_compile_and_package(ep, package_path=tmp, inductor_configs=configs)
        os.replace(tmp, package_path)
    return {"seconds": time.perf_counter() - t0}
