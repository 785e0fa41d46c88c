"""The transformer MLP (d -> mlp_ratio·d -> d, tanh GELU) and the one place that chooses how it runs.

Implementations (chosen once per model, logged):
  fused  - the GELU and its bias in cuBLASLt's GEMM epilogues, forward and backward
           (`kernels.gelu_mlp`): CUDA, bf16/fp16, d_model and hidden multiples of 8
  torch  - two nn.Linear and F.gelu (torch.compile fuses what it can around them)
  auto   - fused on CUDA in bf16/fp16 where our extension loads, else torch
Both compute the same function with the same parameters (checkpoints do not depend on the choice).
"""
from __future__ import annotations

from typing import Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.config import GPTConfig
from model.linear import Linear


def resolve_mlp(requested: str, device: torch.device, dtype: torch.dtype = torch.bfloat16,
                d_model: int = 2048, hidden: int = 8192) -> Tuple[str, str]:
    """Return (implementation, reason). `requested` is the config's model.mlp; `dtype` what the MLP
    computes in (the autocast dtype; float32 without autocast)."""
    if requested == "torch":
        return "torch", "asked for in model.mlp"
    why_not = ""
    if device.type != "cuda":
        why_not = f"the fused MLP is CUDA-only, this model runs on {device.type}"
    elif dtype not in (torch.bfloat16, torch.float16):
        why_not = f"the fused MLP computes in bf16/fp16, this model in {dtype}"
    elif d_model % 8 or hidden % 8:
        why_not = f"d_model ({d_model}) and the MLP hidden size ({hidden}) must be multiples of 8"
    else:
        from model.attention import _our_kernel_status  # the same extension builds both

        ok, status = _our_kernel_status()
        if not ok:
            why_not = f"our CUDA extension is unavailable ({status})"
    if not why_not:
        return "fused", "GELU in cuBLASLt's GEMM epilogues (kernels/gelu_mlp.py)"
    if requested == "fused":
        raise RuntimeError(f"model.mlp=fused but {why_not}; use model.mlp=auto or torch")
    return "torch", f"auto: {why_not}"


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig, impl: str = "torch", recompute_gelu: bool = False):
        super().__init__()
        hidden = cfg.mlp_ratio * cfg.d_model
        self.fc = Linear(cfg.d_model, hidden, bias=cfg.bias)
        self.proj = Linear(hidden, cfg.d_model, bias=cfg.bias)
        self.proj.is_residual_out = True
        self.dropout = nn.Dropout(cfg.dropout)
        self.impl = impl
        self.recompute_gelu = recompute_gelu  # fused only: keep the GELU's input, not its output

    def forward(self, x):  # (B, T, d) -> (B, T, d)
        if self.impl == "fused":
            from kernels.gelu_mlp import gelu_mlp  # falls back to the torch MLP off CUDA (e.g. a CPU eval)

            return self.dropout(gelu_mlp(x, self.fc.weight, self.fc.bias, self.proj.weight, self.proj.bias,
                                         self.fc.main_grad, self.proj.main_grad, self.recompute_gelu))
        return self.dropout(self.proj(F.gelu(self.fc(x), approximate="tanh")))
