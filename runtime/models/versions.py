"""Content stamps of tensors, for memos that must notice new values without reading them."""
from __future__ import annotations

import torch


def tensor_version(t: torch.Tensor) -> tuple:
    """(storage, in-place version) of a tensor: changes when it is replaced or written in place (inference tensors
    keep no version counter: their storage stands for it)."""
    try:
        return t.data_ptr(), t._version
    except RuntimeError:
        return t.data_ptr(), None
