"""CUDA-graph adapter: any stage callable (the eager module, an AOTInductor package) captured once per static bucket.

Same interface as the other runners; `backend` is "cudagraph". Only static buckets (min = max length) are captured —
a dynamic-range bucket has no single shape to freeze — and those calls go to the wrapped callable directly.
"""
from __future__ import annotations

from typing import Callable

import torch

from .buckets import Bucket
from .cuda_graphs import GraphCache
from .base import EngineRunner, EngineSpec
from .shapes import resolve_shape


class CudaGraphRunner(EngineRunner):
    backend = "cudagraph"

    def __init__(self, fn: Callable, spec: EngineSpec, device: str, buckets: list[Bucket],
                 example: Callable[[Bucket], tuple], progress: bool = False):
        super().__init__("<cuda graphs>", spec, device)
        self.fn = fn
        self.cache = GraphCache(fn, device, group=spec.stage)  # "dit" / "hift": `capture_group_on` can move them
        static = sorted((b for b in buckets if not b.dynamic), key=lambda b: -b.cost)
        it = static
        if progress:
            from tqdm import tqdm

            it = tqdm(static, desc=f"capturing {spec.stage}/{spec.mode} CUDA graphs", unit="graph")
        for b in it:
            self.cache.capture(b.key, example(b))

    def run(self, inputs: dict[str, torch.Tensor], bucket: Bucket) -> dict[str, torch.Tensor]:
        args = [inputs[n] for n in self.spec.input_names]
        if bucket.key in self.cache:
            out = self.cache.run(bucket.key, *args)
        else:
            with torch.inference_mode():
                out = self.fn(*args)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        # the static outputs are overwritten by the next replay: hand out copies
        return {n: o.clone() for n, o in zip(self.spec.output_names, outs)}


def example_from_templates(templates: dict[str, list], names: list[str], dtypes: dict[str, torch.dtype],
                           device: str) -> Callable[[Bucket], tuple]:
    """Capture inputs for a bucket: ones for masks, small random values elsewhere (values do not matter)."""

    def make(bucket: Bucket) -> tuple:
        out = []
        for n in names:
            shape = resolve_shape(templates[n], bucket.batch, bucket.length)
            dt = dtypes.get(n, torch.float32)
            out.append(torch.ones(shape, dtype=dt, device=device) if n == "mask" else
                       torch.rand(shape, device=device).to(dt))
        return tuple(out)

    return make
