"""Reading released-layout checkpoints with strict, named validation."""
from __future__ import annotations

import os
from typing import Iterable, Mapping

import torch

from ...engines.errors import CheckpointError


def read_state_dict(path: str) -> dict[str, torch.Tensor]:
    """Load a `.pt` state dict (weights only) or a `.safetensors` file on CPU."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file not found: {path}")
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file
            sd = load_file(path)
        else:
            sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - re-raised with the file named
        raise CheckpointError(f"cannot read checkpoint {path}: {e}") from None
    if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise CheckpointError(f"{path}: not a state dict of tensors")
    return sd


def expected_shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Keys and shapes of a module's state dict (works on the meta device)."""
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}


def validate_state_dict(sd: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[int, ...]], what: str,
                        optional: Iterable[str] = ()) -> None:
    """Raise CheckpointError naming the first missing, unexpected or mis-shaped key.

    `optional` keys may be absent or present (e.g. a tied lm_head that is ignored)."""
    optional = set(optional)
    missing = [k for k in expected if k not in sd and k not in optional]
    unexpected = [k for k in sd if k not in expected and k not in optional]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{what}: missing key {missing[0]!r}{more}")
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise CheckpointError(f"{what}: unexpected key {unexpected[0]!r}{more}")
    for k, shape in expected.items():
        if k in sd and tuple(sd[k].shape) != tuple(shape):
            raise CheckpointError(f"{what}: key {k!r} has shape {tuple(sd[k].shape)}, expected {tuple(shape)}")


def load_strict(module: torch.nn.Module, sd: Mapping[str, torch.Tensor], what: str,
                optional: Iterable[str] = ()) -> None:
    """Validate then load `sd` into `module` (keys in the module's own layout)."""
    optional = set(optional)
    exp = expected_shapes(module)
    validate_state_dict(sd, exp, what, optional=optional)
    module.load_state_dict({k: v for k, v in sd.items() if k in exp}, strict=True)
