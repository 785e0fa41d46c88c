"""The tied token-embedding / output-head weight's gradient added straight into an fp32 buffer.

GPT ties the output head to the token embedding: one fp32 (V, d) weight used twice. Through autograd,
per micro-batch the fused loss returns the head's (V, d) fp32 gradient, the embedding's backward makes
a dense (V, d) fp32 gradient (zero-filled, then its rows added), autograd sums the two and
AccumulateGrad adds the sum into .grad: about four passes over 0.5 GB at 2.7B (V 50304 x d 2560),
~1.4 ms per micro-batch on an H100 (bench/RESULTS.md). With `main_grad` -- the fp32
weight's .grad, handed in by the weight cache like the projections' buffers (training/engines/weight_cache.py)
-- the head's backward adds grad_weight * grad_loss into it in one pass and the embedding's backward
adds its rows with index_add: no dense gradient, no sum, no AccumulateGrad. The weight itself then
gets no gradient from autograd (its .grad is the buffer).

    x = embedding(idx, weight, main_grad)          # F.embedding(idx, weight); rows' grads -> main_grad
    add_head_grad(main_grad, grad_weight, scale)   # main_grad += grad_weight * scale (model/loss.py)

Ops (torch.library.custom_op, in place, so a compiled backward keeps the additions as they are):
    flashgpt::index_add_rows_(main_grad (V, d) fp32, index (n,) int64, rows (n, d)) -> None
    flashgpt::add_scaled_(main_grad (V, d) fp32, t (V, d), scale ()) -> None
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor


@torch.library.custom_op("flashgpt::index_add_rows_", mutates_args=("main_grad",))
def index_add_rows_(main_grad: Tensor, index: Tensor, rows: Tensor) -> None:
    """main_grad[index[i]] += rows[i] for each i (repeated indices add up)."""
    main_grad.index_add_(0, index, rows.to(main_grad.dtype))


@index_add_rows_.register_fake
def _(main_grad, index, rows):
    return None


@torch.library.custom_op("flashgpt::add_scaled_", mutates_args=("main_grad",))
def add_scaled_(main_grad: Tensor, t: Tensor, scale: Tensor) -> None:
    """main_grad += t * scale (scale a 0-d tensor: the loss's incoming gradient; one pass)."""
    main_grad.addcmul_(t, scale)


@add_scaled_.register_fake
def _(main_grad, t, scale):
    return None


def add_head_grad(main_grad: Tensor, grad_weight: Tensor, scale: Tensor) -> None:
    """main_grad (V, d) fp32 += grad_weight (V, d) * scale (0-d): the head's share of the gradient."""
    add_scaled_(main_grad, grad_weight, scale)


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, idx, weight, main_grad):
        ctx.save_for_backward(idx)
        # main_grad rides on ctx, not in save_for_backward: the head's backward adds into the same
        # buffer before this one runs, and saved tensors must not change in between.
        ctx.main_grad = main_grad
        return F.embedding(idx, weight)

    @staticmethod
    def backward(ctx, grad):  # grad (..., d)
        (idx,) = ctx.saved_tensors
        index_add_rows_(ctx.main_grad, idx.reshape(-1), grad.reshape(-1, grad.shape[-1]))
        return None, None, None


def embedding(idx: Tensor, weight: Tensor, main_grad: Optional[Tensor]) -> Tensor:
    """F.embedding(idx, weight); with main_grad (weight's shape, fp32) the rows' gradients are added
    into it and weight gets none from autograd."""
    if main_grad is None:
        return F.embedding(idx, weight)
    return _Embedding.apply(idx, weight, main_grad)


class TiedEmbedding(nn.Embedding):
    """nn.Embedding with an optional fp32 gradient buffer (non-persistent, None by default: then it
    is nn.Embedding); the trainer sets it from outside through torch.func.functional_call."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__(num_embeddings, embedding_dim)
        self.register_buffer("main_grad", None, persistent=False)  # (V, d) fp32 when set

    def forward(self, idx):  # (B, T) -> (B, T, d)
        return embedding(idx, self.weight, self.main_grad)
