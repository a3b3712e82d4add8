"""The one dtype table: engine / profile / config dtype names <-> torch dtypes."""
from __future__ import annotations

import torch

from .errors import EngineSetError

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}
DTYPES = tuple(TORCH_DTYPES)  # the names profiles and configs accept


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a name ("float32", "float16", "bfloat16"); EngineSetError for anything else."""
    if name not in TORCH_DTYPES:
        raise EngineSetError(f"unknown dtype {name!r} (expected one of {sorted(TORCH_DTYPES)})")
    return TORCH_DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """The name of a torch dtype of the table; EngineSetError for any other."""
    if dtype not in DTYPE_NAMES:
        raise EngineSetError(f"unsupported dtype {dtype} (expected one of {sorted(TORCH_DTYPES)})")
    return DTYPE_NAMES[dtype]
