"""The residual add and the output-keeping LayerNorm after it, as one op each way (csrc/norm).

A pre-LN block computes h = x + delta (the residual stream plus a sublayer's output) and then
y = LayerNorm(h) for the next sublayer. With model.norm_saves_output the LayerNorm keeps y and 1/std,
not h (model/layernorm.py), and its backward adds its input gradient to h's other gradient (the next
residual add's). torch.compile fuses the same adds, but at 2.7B-8k its LayerNorm backward reads at ~2.1
TB/s on an H100 and sums its weight gradients through a (1024 x d) fp32 workspace and an eager sum
(bench/RESULTS.md). Here:

    h, y = add_layer_norm(x, delta, weight, bias, eps)   # h = x + delta (16-bit), y = LN(h) (16-bit)

forward   one pass: reads x and delta, writes h, y and rstd (fp32 per row)
backward  one pass: reads dh_in (h's gradient from its other use), dy and y, writes dh = dh_in + the
          LayerNorm's input gradient (x's and delta's gradient both), and per-block partial sums of
          dy * x_hat and dy; a small kernel sums those into weight's and bias's gradients (fp32).
x_hat = (y - bias) / weight, as model/layernorm.py's: gains must stay away from zero.

Ops (torch.library.custom_op, fake kernels for torch.compile, autograd registered):
    flashgpt::add_layer_norm(x (M, d), delta (M, d), weight (d), bias (d)?, eps) -> (h, y, rstd (M) fp32)
    flashgpt::add_layer_norm_backward(dh_in, dy, y, weight, bias?, rstd) -> (dh, dweight, dbias)
On CUDA with 16-bit x and delta of one dtype, fp32 weight / bias and d % 8 == 0 (d <= 8192) the
kernels run; elsewhere the same math in torch ops (`reference_forward` / `reference_backward`).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

_DTYPES = (torch.float16, torch.bfloat16)


_loaded = None  # the extension once loaded: the ops run 128 times per micro-batch, host time counts


def _ext(t: Tensor):
    """The extension if t's problem can take the kernels, else None."""
    global _loaded
    if not (t.is_cuda and t.dtype in _DTYPES and t.shape[-1] % 8 == 0 and t.shape[-1] <= 8192):
        return None
    if _loaded is None:
        from . import is_available
        from .build import load_extension

        if not is_available():
            return None
        _loaded = load_extension()
    return _loaded


def reference_forward(x: Tensor, delta: Tensor, weight: Tensor, bias: Optional[Tensor], eps: float):
    """(h, y, rstd) in torch ops: h rounded to x's dtype, the statistics of what h holds in fp32."""
    h = (x.float() + delta.float()).to(x.dtype)
    hf = h.float()
    mean = hf.mean(-1, keepdim=True)
    centered = hf - mean
    rstd = torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + eps)
    y = centered * rstd * weight.float()
    if bias is not None:
        y = y + bias.float()
    return h, y.to(x.dtype), rstd.squeeze(-1)


def reference_backward(dh_in: Tensor, dy: Tensor, y: Tensor, weight: Tensor, bias: Optional[Tensor], rstd: Tensor):
    """(dh, dweight, dbias) in torch ops, x_hat rebuilt from y."""
    w = weight.float()
    x_hat = ((y.float() - bias.float()) if bias is not None else y.float()) / w
    g = dy.float() * w
    dx = rstd[..., None] * (g - g.mean(-1, keepdim=True) - x_hat * (g * x_hat).mean(-1, keepdim=True))
    dh = (dh_in.float() + dx).to(dh_in.dtype)
    dyf = dy.float().reshape(-1, dy.shape[-1])
    dweight = (dyf * x_hat.reshape(dyf.shape)).sum(0)
    return dh, dweight, (dyf.sum(0) if bias is not None else None)


@torch.library.custom_op("flashgpt::add_layer_norm", mutates_args=())
def _forward_op(x: Tensor, delta: Tensor, weight: Tensor, bias: Optional[Tensor],
                eps: float) -> tuple[Tensor, Tensor, Tensor]:
    ext = _ext(x)
    if ext is not None and delta.dtype == x.dtype and weight.dtype == torch.float32:
        d = x.shape[-1]
        h, y, rstd = ext.add_layer_norm_fwd(x.reshape(-1, d).contiguous(), delta.reshape(-1, d).contiguous(),
                                            weight.contiguous(), bias.contiguous() if bias is not None else None, eps)
        return h.view(x.shape), y.view(x.shape), rstd.view(x.shape[:-1])
    return reference_forward(x, delta, weight, bias, eps)


@_forward_op.register_fake
def _(x, delta, weight, bias, eps):
    return torch.empty_like(x), torch.empty_like(x), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("flashgpt::add_layer_norm_backward", mutates_args=())
def _backward_op(dh_in: Tensor, dy: Tensor, y: Tensor, weight: Tensor, bias: Optional[Tensor],
                 rstd: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(dh, dweight, dbias); dbias is zeros when there is no bias (an op returns no optional tensors)."""
    ext = _ext(y)
    if ext is not None and dh_in.dtype == dy.dtype == y.dtype and weight.dtype == torch.float32:
        d = y.shape[-1]
        flat = [t.reshape(-1, d).contiguous() for t in (dh_in, dy, y)]
        out = ext.add_layer_norm_bwd(*flat, weight.contiguous(), bias.contiguous() if bias is not None else None,
                                     rstd.reshape(-1).contiguous())
        return out[0].view(y.shape), out[1], (out[2] if bias is not None else torch.zeros_like(weight))
    dh, dweight, dbias = reference_backward(dh_in, dy, y, weight, bias, rstd)
    return dh, dweight.to(weight.dtype), (dbias.to(bias.dtype) if bias is not None else torch.zeros_like(weight))


@_backward_op.register_fake
def _(dh_in, dy, y, weight, bias, rstd):
    return torch.empty_like(y), torch.empty_like(weight), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    _, _, weight, bias, _ = inputs
    _, y, rstd = output
    ctx.save_for_backward(y, weight, bias, rstd)
    ctx.has_bias = bias is not None
    ctx.mark_non_differentiable(rstd)


def _backward(ctx, dh, dy, _drstd):
    y, weight, bias, rstd = ctx.saved_tensors
    dh = torch.zeros_like(y) if dh is None else dh  # h unused downstream (not in a GPT)
    dy = torch.zeros_like(y) if dy is None else dy
    dh_out, dweight, dbias = _backward_op(dh, dy, y, weight, bias if ctx.has_bias else None, rstd)
    return dh_out, dh_out, dweight, (dbias if ctx.has_bias else None), None


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def add_layer_norm(x: Tensor, delta: Tensor, weight: Tensor, bias: Optional[Tensor], eps: float):
    """(h, y): h = x + delta, y = LayerNorm(h) with weight / bias (fp32), in x's dtype; the backward
    keeps y and rstd (module docstring)."""
    h, y, _ = _forward_op(x, delta, weight, bias, eps)
    return h, y
