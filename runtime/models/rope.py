"""Rotary position embedding of the LM (HF Qwen2 layout), shared by the plain kernels (`llm.py`) and the
batch-invariant ones (`batch_invariant.py`)."""
from __future__ import annotations

import torch


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """HF-style rotary tables for integer `positions` [..., T] -> cos, sin [..., T, head_dim] (computed in fp32)."""
    exponent = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponent)
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin
