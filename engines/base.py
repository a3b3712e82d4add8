"""One small interface over every backend (Polygraphy-style runners).

An engine file serves one (stage, mode) — e.g. the streaming DiT estimator — for a set of buckets. The runtime pads a
batch to a bucket's shape and calls `run(inputs, bucket)`; the adapter returns the outputs at that padded shape.
"""
from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from .buckets import Bucket
from .dtypes import torch_dtype  # noqa: F401 - re-exported (the table lives in dtypes.py)


@dataclass
class EngineSpec:
    """What the manifest records for one engine file."""

    stage: str  # "dit" | "hift" | "ar"
    mode: str  # "stream" | "offline" | "decode" | "prefill"
    backend: str  # an engines.ADAPTERS key: "onnxruntime" | "aoti" | "tensorrt" ("cudagraph": in-process wrappers)
    file: str  # relative to the engine-set folder
    input_names: list[str]
    output_names: list[str]
    buckets: list[str]  # bucket keys, in optimization-profile order
    dtype: str = "float32"
    device: str = "cpu"
    build_seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(d: dict) -> "EngineSpec":
        names = {f.name for f in dataclasses.fields(EngineSpec)}
        return EngineSpec(**{k: v for k, v in d.items() if k in names})


class EngineRunner(abc.ABC):
    """Runs one engine file. Subclasses: one per backend."""

    backend: ClassVar[str] = ""

    def __init__(self, path: str, spec: EngineSpec, device: str = "cpu"):
        self.path = path
        self.spec = spec
        self.device = torch.device(device)

    @abc.abstractmethod
    def run(self, inputs: dict[str, torch.Tensor], bucket: Bucket) -> dict[str, torch.Tensor]:
        """Run at the bucket's padded shape. Inputs and outputs are torch tensors on `self.device`."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources."""

    @property
    def input_names(self) -> list[str]:
        return self.spec.input_names

    @property
    def output_names(self) -> list[str]:
        return self.spec.output_names

