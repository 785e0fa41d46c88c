"""The transformer MLP, y = gelu_tanh(x w1^T + b1) w2^T + b2, with the GELU in cuBLASLt's GEMM epilogue.

What it saves against the plain (even compiled) MLP: element-wise memory passes around the GELU
(at 1.3B-8k micro-batch 3 the plain MLP's are 0.83 of its 7.7 ms forward +
backward per layer on an H100):
  forward   one GEMM writes both the GELU input `pre` (kept for the backward) and its output `g`
            (cuBLASLt's GELU_AUX_BIAS epilogue), instead of a bias GEMM and a GELU kernel;
  backward  one kernel (csrc/mlp/gelu_backward.cu) writes dpre = dg * gelu'(pre) and sums b1's
            gradient on the way, instead of a GELU-backward kernel and a reduction reading dpre again.
            (cuBLASLt's GELU-backward / bias-gradient epilogues would fold these into the GEMMs, but
            on an H100 its picks run them as separate kernels, slower than these: docs/kernels.md.)
What the backward keeps is the same as the compiled plain MLP's: x, pre and g (g for w2's gradient).
With recompute_gelu=True it keeps x and pre only (4 d-units per token less, d-units as in
dev/saved_activations.py), and the backward's GELU pass, which reads pre anyway, writes g again for
w2's gradient (one more (M, h) write; model.recompute_gelu, for a micro-batch that fits only so). The
rebuilt g is gelu_tanh(pre) of the rounded pre, where the forward's epilogue rounded gelu_tanh of the
fp32 product: they differ by about one rounding of g, as a plain MLP recomputing its GELU would.
Given fp32 gradient buffers (main_grad1 / main_grad2, the fp32 weights' .grad: training/engines/weight_cache.py),
the backward adds the weight gradients into them inside their GEMMs (kernels/wgrad.py) and returns none
for w1 / w2.

Ops (torch.library.custom_op, fake kernels for torch.compile, autograd registered):
    flashgpt::gelu_mlp(x (M, d), w1 (h, d), b1 (h)?, w2 (d, h), b2 (d)?, main_grad1 (h, d)?,
                       main_grad2 (d, h)?, save_gelu) -> (y (M, d), pre, g (M, h))
    flashgpt::gelu_backward_bias(dg (M, h), pre (M, h)) -> (dpre (M, h), partial (R, h) fp32)
    flashgpt::gelu_backward_bias_gelu(dg, pre) -> (dpre, partial, g = gelu_tanh(pre) (M, h))
The backward's products (dg, dx, dw1, dw2) and b2's gradient are ordinary torch ops, which
torch.compile traces as it does for the plain MLP.

Supported: CUDA, bf16 or fp16 (under autocast the inputs are cast to its dtype, as F.linear's are),
d and h multiples of 8, contiguous weights. `gelu_mlp` falls back to the plain torch MLP elsewhere;
`gelu_mlp_supported` says why not.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .wgrad import accumulate as wgrad_accumulate, accumulate_op as wgrad_accumulate_op, compute_dtype
from .wgrad import linear as wgrad_linear

_DTYPES = (torch.float16, torch.bfloat16)


def _ext():
    from .build import load_extension  # lazily: importing never builds

    return load_extension()


def reference_mlp(x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor]) -> Tensor:
    """The plain MLP (model/mlp.py's torch implementation): what gelu_mlp computes, in torch ops."""
    return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)


def _forward(x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor]):
    """(y, pre, g) through the binding: one GELU-epilogue GEMM, then the second projection."""
    if not x.is_cuda:
        raise ValueError(f"flashgpt.gelu_mlp: x is on {x.device}; the fused MLP runs on CUDA only")
    g, pre = _ext().linear_gelu(x, w1, b1)
    y = torch.addmm(b2, g, w2.t()) if b2 is not None else torch.mm(g, w2.t())
    return y, pre, g


def _backward_with(ops, saved, has_b1: bool, has_b2: bool, dy: Tensor):
    """Gradients of (x, w1, b1, w2, b2, main_grad1, main_grad2); `ops` = (gelu_backward_bias,
    gelu_backward_bias_gelu, accumulate): the custom ops (traced by torch.compile) or the direct calls
    (eager). g saved as None: rebuilt here from pre. A weight with a main_grad gets None: its gradient
    went into the buffer."""
    gelu_backward_bias, gelu_backward_bias_gelu, accumulate = ops
    x, w1, w2, pre, g, main1, main2 = saved
    dy = dy.contiguous()
    dg = dy @ w2  # (M, d) (d, h) -> (M, h)
    if g is None:  # the same pass writes g = gelu(pre) for w2's gradient below
        dpre, partial, g = gelu_backward_bias_gelu(dg, pre)
    else:
        dpre, partial = gelu_backward_bias(dg, pre)  # partial (R, h) fp32
    db1 = partial.sum(0).to(dpre.dtype) if has_b1 else None
    dx = dpre @ w1                  # (M, h) (h, d) -> (M, d)
    dw1 = _weight_grad(accumulate, dpre, x, main1)  # (h, M) (M, d) -> (h, d)
    dw2 = _weight_grad(accumulate, dy, g, main2)    # (d, M) (M, h) -> (d, h)
    db2 = dy.sum(0) if has_b2 else None
    return dx, dw1, db1, dw2, db2, None, None


def _weight_grad(accumulate, dout: Tensor, inp: Tensor, main_grad: Optional[Tensor]) -> Optional[Tensor]:
    """dout^T inp, returned, or added into main_grad (fp32) by the GEMM and None returned."""
    if main_grad is None:
        return dout.t() @ inp
    accumulate(dout, inp, main_grad)
    return None


@torch.library.custom_op("flashgpt::gelu_mlp", mutates_args=())
def _gelu_mlp_op(x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor],
                 main_grad1: Optional[Tensor], main_grad2: Optional[Tensor],
                 save_gelu: bool) -> tuple[Tensor, Tensor, Tensor]:
    return _forward(x, w1, b1, w2, b2)  # the main_grads and save_gelu are for the backward


@_gelu_mlp_op.register_fake
def _(x, w1, b1, w2, b2, main_grad1, main_grad2, save_gelu):
    m, h = x.shape[0], w1.shape[0]
    return x.new_empty(m, w2.shape[0]), x.new_empty(m, h), x.new_empty(m, h)


@torch.library.custom_op("flashgpt::gelu_backward_bias", mutates_args=())
def _gelu_backward_bias_op(dg: Tensor, pre: Tensor) -> tuple[Tensor, Tensor]:
    dpre, partial = _ext().gelu_backward_bias(dg, pre)
    return dpre, partial


@torch.library.custom_op("flashgpt::gelu_backward_bias_gelu", mutates_args=())
def _gelu_backward_bias_gelu_op(dg: Tensor, pre: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    dpre, partial, g = _ext().gelu_backward_bias(dg, pre, True)
    return dpre, partial, g


def _gelu_backward_bias_gelu_direct(dg: Tensor, pre: Tensor):
    return tuple(_ext().gelu_backward_bias(dg, pre, True))


def _row_groups(rows: int, cols: int) -> int:
    """Rows of gelu_backward_bias's partial sums (csrc/mlp/gelu_backward.cu's row groups)."""
    col_blocks = -(-cols // 1024)
    return max(1, min(rows, -(-1024 // col_blocks)))


@_gelu_backward_bias_op.register_fake
def _(dg, pre):
    return torch.empty_like(dg), dg.new_empty(_row_groups(dg.shape[0], dg.shape[1]), dg.shape[1],
                                              dtype=torch.float32)


@_gelu_backward_bias_gelu_op.register_fake
def _(dg, pre):
    return (torch.empty_like(dg), dg.new_empty(_row_groups(dg.shape[0], dg.shape[1]), dg.shape[1],
                                               dtype=torch.float32), torch.empty_like(pre))


def _setup_context(ctx, inputs, output):
    x, w1, b1, w2, b2, main1, main2, save_gelu = inputs
    _, pre, g = output
    ctx.save_for_backward(x, w1, w2, pre, g if save_gelu else None, main1, main2)
    ctx.has_b1, ctx.has_b2 = b1 is not None, b2 is not None
    ctx.mark_non_differentiable(pre, g)


def _backward(ctx, dy, dpre_out, dg_out):
    # dpre_out / dg_out are None: pre and g are saved intermediates, not differentiable outputs.
    grads = _backward_with((_gelu_backward_bias_op, _gelu_backward_bias_gelu_op, wgrad_accumulate_op),
                           ctx.saved_tensors, ctx.has_b1, ctx.has_b2, dy)
    return *grads, None  # save_gelu


_gelu_mlp_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerGeluMLP(torch.autograd.Function):
    """The same forward and backward calling the binding directly: what eager mode runs (a custom
    op's Python dispatch costs tens of microseconds per call; see kernels/flash_attn.py)."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, main1, main2, save_gelu):
        y, pre, g = _forward(x, w1, b1, w2, b2)
        ctx.save_for_backward(x, w1, w2, pre, g if save_gelu else None, main1, main2)
        ctx.has_b1, ctx.has_b2 = b1 is not None, b2 is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        ops = (_ext().gelu_backward_bias, _gelu_backward_bias_gelu_direct, wgrad_accumulate)
        return *_backward_with(ops, ctx.saved_tensors, ctx.has_b1, ctx.has_b2, dy), None


def _torch_mlp(x, w1, b1, w2, b2, main1, main2) -> Tensor:
    """reference_mlp, each projection's weight gradient into its main_grad where one is given."""
    def project(t, w, b, main):
        return F.linear(t, w, b) if main is None else wgrad_linear(t, w, b, main)

    return project(F.gelu(project(x, w1, b1, main1), approximate="tanh"), w2, b2, main2)


def gelu_mlp_supported(x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor]) -> str:
    """'' if gelu_mlp runs the fused op on these tensors (after autocast's cast), else why not."""
    tensors = [t for t in (x, w1, b1, w2, b2) if t is not None]
    if not all(t.is_cuda for t in tensors):
        return "the GELU-epilogue MLP needs CUDA tensors"
    dtype = compute_dtype(x)
    if dtype not in _DTYPES:
        return f"the GELU-epilogue MLP computes in bf16 or fp16, not {dtype}"
    d, h = x.shape[-1], w1.shape[0]
    if d % 8 or h % 8:
        return f"d_model ({d}) and the MLP hidden size ({h}) must be multiples of 8"
    if w1.shape != (h, d) or w2.shape != (d, h):
        return f"weights of shape {tuple(w1.shape)} and {tuple(w2.shape)} do not match x's {d} features"
    return ""


def gelu_mlp(x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor],
             main_grad1: Optional[Tensor] = None, main_grad2: Optional[Tensor] = None,
             recompute_gelu: bool = False) -> Tensor:
    """gelu_tanh(x w1^T + b1) w2^T + b2 for x (..., d), w1 (h, d), w2 (d, h): the fused op on CUDA in
    bf16 / fp16 (autocast's dtype when it is on), the plain torch MLP otherwise. With main_grad1 /
    main_grad2 (fp32, w1's / w2's shape) the weights' gradients are added into them (kernels/wgrad.py).
    recompute_gelu: keep only the GELU's input for the backward, which rebuilds its output (the fused
    op; the torch fallback keeps what autograd keeps)."""
    if gelu_mlp_supported(x, w1, b1, w2, b2):
        return _torch_mlp(x, w1, b1, w2, b2, main_grad1, main_grad2)
    dtype = compute_dtype(x)
    lead = x.shape[:-1]
    args = [t.to(dtype).contiguous() if t is not None else None
            for t in (x.reshape(-1, x.shape[-1]), w1, b1, w2, b2)] + [main_grad1, main_grad2, not recompute_gelu]
    if torch.compiler.is_compiling():
        y = _gelu_mlp_op(*args)[0]
    else:
        y = _EagerGeluMLP.apply(*args)
    return y.view(*lead, y.shape[-1])
