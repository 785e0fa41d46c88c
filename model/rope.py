"""Rotary position embedding (RoFormer, Su et al. 2021), the "rotate halves" form."""
from __future__ import annotations

from typing import Tuple

import torch


def rope_cache(seq_len: int, head_dim: int, theta: float, device=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables shaped (T, D/2) in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)  # (T, D/2)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cache: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x: (B, T, H, D); rotates pairs (x[..., i], x[..., i + D/2]) by the position's angle."""
    cos, sin = cache
    T, half = x.shape[1], x.shape[-1] // 2
    cos, sin = cos[:T, None, :], sin[:T, None, :]  # (T, 1, D/2), broadcast over heads
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.to(x.dtype)
