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
anyway; keeping the cast once is what saves the memory), else x's. Both directions call aten's
LayerNorm ops (the backward on x - mean rebuilt from y, with a zero mean), so torch.compile lowers them
as it lowers nn.LayerNorm (written out in torch ops they compiled into other kernels: 0.5 points more
GPU time at 1.3B-8k, 0.13 of them in the forward; bench/RESULTS.md).
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
    """Both directions are aten's own LayerNorm ops, so TorchInductor lowers them as it lowers
    nn.LayerNorm's: the backward's row kernel and column sums cost what nn.LayerNorm's do; the same
    math written out in torch ops costs 0.35 points more of a 1.3B-8k step's GPU time there
    (bench/RESULTS.md)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
                out_dtype: torch.dtype):
        d = x.shape[-1]
        # aten's CUDA kernel wants x in the parameters' dtype: a bf16 residual stream is read as fp32 (as
        # nn.LayerNorm under autocast does; compiled, the cast fuses into the row kernel)
        xin = x if x.dtype == weight.dtype else x.to(weight.dtype)
        with torch.autocast(x.device.type, enabled=False):
            y, _, rstd = torch.ops.aten.native_layer_norm(xin, [d], weight, bias, eps)  # rstd (..., 1) fp32
        if y.dtype != out_dtype:  # (a no-op .to() here made torch 2.11's compiled backward return zeros)
            y = y.to(out_dtype)
        ctx.save_for_backward(y, weight, bias, rstd)
        ctx.x_dtype = x.dtype
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        y, weight, bias, rstd = ctx.saved_tensors
        w = weight.float()
        # x - mean(x), from the output: (y - bias) / weight is x_hat = (x - mean) * rstd
        centered = ((y.float() - bias.float()) if bias is not None else y.float()) / (w * rstd)
        with torch.autocast(dy.device.type, enabled=False):  # fp32 throughout, as the forward's math
            dx, dweight, dbias = torch.ops.aten.native_layer_norm_backward(
                dy.float(), centered, [y.shape[-1]], torch.zeros_like(rstd), rstd, w,
                bias.float() if bias is not None else None, [True, True, bias is not None])
        return (_as(dx, ctx.x_dtype), _as(dweight, weight.dtype),
                _as(dbias, bias.dtype) if bias is not None else None, None, None)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm (same parameters and state dict); with saves_output=True its training backward
    keeps the output instead of the input (module docstring)."""

    def __init__(self, d: int, eps: float = 1e-5, bias: bool = True, saves_output: bool = False):
        super().__init__(d, eps=eps, bias=bias)
        self.saves_output = saves_output

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor):
        """(h, y) = (x + delta, self(x + delta)). With saves_output and a 16-bit residual stream in
        autocast's dtype (or autocast off) the add and the LayerNorm run as one op each way
        (kernels/add_layer_norm.py), keeping y and 1/std as forward() does."""
        if self.saves_output and torch.is_grad_enabled():
            from kernels.wgrad import compute_dtype

            if x.dtype == delta.dtype == compute_dtype(x) and x.dtype in (torch.float16, torch.bfloat16) \
                    and self.weight.dtype == torch.float32:
                from kernels.add_layer_norm import add_layer_norm

                return add_layer_norm(x, delta, self.weight, self.bias, self.eps)
        h = x + delta
        return h, self(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.saves_output and torch.is_grad_enabled():
            from kernels.wgrad import compute_dtype  # torch-only: autocast's dtype, else x's

            return _OutputSavingLayerNorm.apply(x, self.weight, self.bias, self.eps, compute_dtype(x))
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
