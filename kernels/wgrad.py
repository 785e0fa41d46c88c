"""Weight gradients added straight into an fp32 gradient buffer by the GEMM (beta = 1). The kernel layer
only: when the trainer uses it, and the wiring, are owned by training/engines/weight_cache.py.

With low-precision copies of the weights (training/engines/weight_cache.py) a Linear layer's weight gradient
comes out of its GEMM in bf16 (2 bytes per parameter written), and a second kernel adds it into the
fp32 parameter's .grad (2 + 4 read, 4 written): per micro-batch ~12 bytes of memory traffic per
parameter. Here the weight-gradient GEMM itself reads the fp32 buffer in its epilogue and writes the
sum (8 bytes per parameter, hidden inside a compute-bound GEMM), and the product is added without
being rounded to bf16 first (Megatron-LM's "gradient accumulation fusion" does the same). On an H100
a 2.7B block's four weight gradients cost 2.16 ms with the fold, 1.89
with this (the GEMMs alone 1.82); the trainer uses it for every projection of a block (model/linear.py):
2.7B-8k 634 -> 643 model TFLOP/s with the MLP's alone (bench/RESULTS.md).

    y = linear(x, w, b, main_grad)   # y = x w^T + b; the backward adds dy^T x into main_grad (fp32)

`w` gets no gradient of its own (its .grad stays None); x and b get theirs as usual. `main_grad` is
the fp32 parameter's .grad, shape (out, in); the caller zeroes it at the start of an accumulation.

Ops (torch.library.custom_op, traced by torch.compile's backward; the mutation is in place):
    flashgpt::wgrad_accumulate_(dy (M, N), x (M, K), main_grad (N, K) fp32) -> None
On CUDA with our extension it is one cuBLASLt GEMM (csrc/mlp/wgrad_api.cpp); elsewhere (CPU, or no
extension) torch's fp32 addmm, so the same path runs (slowly) everywhere.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

_DTYPES = (torch.float16, torch.bfloat16)


def _binding():
    """The extension if dy can take the cuBLASLt path (CUDA, extension loads), else None."""
    from . import is_available
    from .build import load_extension

    return load_extension() if is_available() else None


def reference_accumulate(dy: Tensor, x: Tensor, main_grad: Tensor) -> None:
    """main_grad += dy^T x in fp32 torch ops: the fallback and the tests' reference."""
    main_grad.addmm_(dy.t().to(main_grad.dtype), x.to(main_grad.dtype))


_written_hook: Optional[Callable[[Tensor], None]] = None  # see set_written_hook


def set_written_hook(hook: Optional[Callable[[Tensor], None]]) -> None:
    """Call hook(main_grad) after each accumulation has been queued (None: no call). The trainer's
    engine.grad_sync=during_backward uses it to start a gradient's all-reduce while the rest of the
    backward runs (training/engines/weight_cache.py `ReduceAsWritten`); it is called at run time also inside
    compiled graphs, which call this op as an opaque kernel."""
    global _written_hook
    _written_hook = hook


def accumulate(dy: Tensor, x: Tensor, main_grad: Tensor) -> None:
    """main_grad (N, K) fp32 += dy (M, N)^T x (M, K), in place; the binding on CUDA (16-bit inputs,
    row lengths multiples of 8), torch's fp32 addmm otherwise."""
    _accumulate(dy, x, main_grad)
    if _written_hook is not None:
        _written_hook(main_grad)


def _accumulate(dy: Tensor, x: Tensor, main_grad: Tensor) -> None:
    # Every check is made here, before the binding, with torch's names for the problem; the
    # binding's own C++ checks are a last line (they raise, not crash: csrc/check_text.h).
    if main_grad.dtype != torch.float32:
        raise ValueError(f"flashgpt.wgrad: main_grad must be float32 (the fp32 parameter's .grad), got "
                         f"{main_grad.dtype}")
    if dy.dim() != 2 or x.dim() != 2 or main_grad.shape != (dy.shape[1], x.shape[1]) or dy.shape[0] != x.shape[0]:
        raise ValueError(f"flashgpt.wgrad: dy {tuple(dy.shape)} and x {tuple(x.shape)} do not give a weight "
                         f"gradient of main_grad's shape {tuple(main_grad.shape)}")
    if not main_grad.is_contiguous():
        raise ValueError("flashgpt.wgrad: main_grad must be contiguous (it is written in place)")
    if not (dy.device == x.device == main_grad.device):
        raise ValueError(f"flashgpt.wgrad: dy, x and main_grad must be on one device, got {dy.device}, "
                         f"{x.device}, {main_grad.device}")
    if (dy.is_cuda and dy.dtype in _DTYPES and x.dtype == dy.dtype and dy.shape[1] % 8 == 0
            and x.shape[1] % 8 == 0):
        ext = _binding()
        if ext is not None:
            ext.wgrad_accumulate(dy.contiguous(), x.contiguous(), main_grad)
            return
    reference_accumulate(dy, x, main_grad)


@torch.library.custom_op("flashgpt::wgrad_accumulate_", mutates_args=("main_grad",))
def accumulate_op(dy: Tensor, x: Tensor, main_grad: Tensor) -> None:
    """`accumulate` as an op: what traced backwards call (a custom op's registered backward is traced
    by AOTAutograd outside dynamo, so it cannot tell eager from tracing: it always uses this)."""
    accumulate(dy, x, main_grad)


@accumulate_op.register_fake
def _(dy, x, main_grad):
    return None


class _Linear(torch.autograd.Function):
    """y = x w^T + b on 2-D x; the backward accumulates w's gradient into main_grad. torch.compile
    traces both directions (the forward's matmul stays an ordinary one for inductor)."""

    @staticmethod
    def forward(ctx, x, w, b, main_grad):
        ctx.save_for_backward(x, w, main_grad)
        ctx.has_bias = b is not None
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx, dy):
        x, w, main_grad = ctx.saved_tensors
        dy = dy.contiguous()
        if torch.compiler.is_compiling():  # dynamo traces this backward: it must see the op
            accumulate_op(dy, x, main_grad)
        else:  # eager: the call, without the op dispatcher's tens of microseconds
            accumulate(dy, x, main_grad)
        dx = dy @ w  # (M, N) (N, K) -> (M, K)
        db = dy.sum(0) if ctx.has_bias else None
        return dx, None, db, None


def compute_dtype(x: Tensor) -> torch.dtype:
    """What a Linear on x computes in: the autocast dtype of x's device when autocast is on."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def linear(x: Tensor, w: Tensor, b: Optional[Tensor], main_grad: Tensor) -> Tensor:
    """F.linear(x, w, b) for x (..., in), w (out, in), under autocast as F.linear is (inputs cast to
    its dtype); w's gradient is added into main_grad (fp32, (out, in)) instead of returned."""
    dtype = compute_dtype(x)
    lead = x.shape[:-1]
    x2, w, b = (t.to(dtype) if t is not None else None for t in (x.reshape(-1, x.shape[-1]), w, b))
    y = _Linear.apply(x2, w, b, main_grad)  # autocast leaves these (already its dtype) as they are
    return y.view(*lead, y.shape[-1])


