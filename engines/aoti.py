"""AOTInductor adapter: `.pt2` packages loaded with torch._inductor.aoti_load_package (CPU or CUDA)."""
from __future__ import annotations

import torch

from .buckets import Bucket
from .errors import EngineSetError
from .base import EngineRunner, EngineSpec


class AOTIRunner(EngineRunner):
    backend = "aoti"

    def __init__(self, path: str, spec: EngineSpec, device: str = "cpu"):
        super().__init__(path, spec, device)
        try:
            # run_single_threaded=True makes the package capturable in a CUDA graph (pytorch#148601).
            self.model = torch._inductor.aoti_load_package(path, run_single_threaded=True)
        except Exception as e:  # noqa: BLE001
            raise EngineSetError(f"cannot load AOTInductor package {path}: {e}") from None

    def run(self, inputs: dict[str, torch.Tensor], bucket: Bucket) -> dict[str, torch.Tensor]:
        try:
            args = [inputs[n] for n in self.spec.input_names]
        except KeyError as e:
            raise EngineSetError(f"{self.path}: missing input {e.args[0]!r}") from None
        out = self.model(*args)
        if isinstance(out, torch.Tensor):
            out = [out]
        return dict(zip(self.spec.output_names, out))
