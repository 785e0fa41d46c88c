"""LayerNorm that keeps its output for the backward instead of its input (model.norm_saves_output).

A block's LayerNorm output y feeds a projection, whose backward keeps y (its input) anyway; the
LayerNorm's own backward normally keeps the input x as well. This one keeps only y, the per-row
1/std (fp32, one value per token) and its parameters, and recovers the normalised input from y:

    x_hat = (y - bias) / weight         (elementwise; y is what the forward returned, rounded)

so one d-unit per token per LayerNorm less is kept (Apex's "memory-efficient" LayerNorm does the
same). The gradients are then the usual ones, with g = dy * weight:

    dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat)),  dweight = sum(dy * x_hat),  dbias = sum(dy)

(means over the normalised dimension, sums over all others). x_hat carries y's rounding divided by
|weight|: fine for gains of order one (they start at 1 and take no weight decay here), wrong where a
gain is at or near zero, where y holds nothing about x -- the reason it is opt-in.

The output has autocast's dtype when autocast is on (the projections after it would cast to that
anyway; keeping the cast once is what saves the memory), else x's. Written in torch ops, which
torch.compile fuses into its own kernels -- not inductor's LayerNorm lowering: at 1.3B-8k micro-batch 4
the step ran ~0.6% slower with it (bench/RESULTS.md session 23), the price of the memory.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in dtype, cast only where it differs (see forward)."""
    return t if t.dtype == dtype else t.to(dtype)


class _OutputSavingLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
                out_dtype: torch.dtype):
        xf = x.float()  # (..., d)
        var, mean = torch.var_mean(xf, dim=-1, keepdim=True, correction=0)  # (..., 1) each
        rstd = torch.rsqrt(var + eps)
        y = (xf - mean) * rstd * weight.float()
        if bias is not None:
            y = y + bias.float()
        if y.dtype != out_dtype:  # (a no-op .to() here made torch 2.11's compiled backward return zeros)
            y = y.to(out_dtype)
        ctx.save_for_backward(y, weight, bias, rstd)
        ctx.x_dtype = x.dtype
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        y, weight, bias, rstd = ctx.saved_tensors
        w = weight.float()
        x_hat = (y.float() - bias.float()) / w if bias is not None else y.float() / w
        dyf = dy.float()
        g = dyf * w
        dx = rstd * (g - g.mean(-1, keepdim=True) - x_hat * (g * x_hat).mean(-1, keepdim=True))
        lead = tuple(range(dy.dim() - 1))
        dweight = _as((dyf * x_hat).sum(lead), weight.dtype)
        dbias = _as(dyf.sum(lead), bias.dtype) if bias is not None else None
        return _as(dx, ctx.x_dtype), dweight, dbias, None, None


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm (same parameters and state dict); with saves_output=True its training backward
    keeps the output instead of the input (module docstring)."""

    def __init__(self, d: int, eps: float = 1e-5, bias: bool = True, saves_output: bool = False):
        super().__init__(d, eps=eps, bias=bias)
        self.saves_output = saves_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.saves_output and torch.is_grad_enabled():
            from kernels.wgrad import compute_dtype  # torch-only: autocast's dtype, else x's

            return _OutputSavingLayerNorm.apply(x, self.weight, self.bias, self.eps, compute_dtype(x))
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
