"""Cross-entropy of the output head without materialising full fp32 logits.

A GPT step at 8k context and a 50k vocabulary makes (T, V) = 8192 × 50304 logits: 0.8 GB in bf16,
1.6 GB more in fp32 for the softmax, and as much again for their gradient. `fused_linear_cross_entropy`
walks the T rows in chunks: per chunk it computes the logits (the head matmul), the log-softmax in
fp32, the loss, and at once the gradient of the loss with respect to the chunk's hidden states and
the head weight (the loss is the end of the graph, so d loss / d logits is known in the forward
pass). Only (T, d) + (V, d) gradients are kept for backward; no extra matmul FLOPs are spent (the
three head matmuls of a normal step — logits, d hidden, d weight — run once each).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from model.tied_grad import add_head_grad


def _compute_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return dtype


def _grad_logits(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, inv_n: float,
                 dtype: torch.dtype) -> torch.Tensor:
    """(softmax(logits) - onehot(targets)) * inv_n in `dtype`: d(mean loss)/d logits of one chunk.
    logits (c, V), targets (c,), lse (c,) fp32."""
    if torch.compiler.is_compiling():
        # One expression, so inductor fuses it with the logsumexp into one kernel that reads the
        # 16-bit logits and writes the 16-bit gradient (an in-place scatter made it write the fp32
        # gradient, then a second kernel read it back to scale and cast: ~2.5x the bytes).
        hit = torch.arange(logits.shape[1], device=logits.device)[None, :] == targets[:, None]
        return ((torch.exp(logits.float() - lse[:, None]) - hit.float()) * inv_n).to(dtype)
    g = torch.exp(logits.float() - lse[:, None])  # eager: in place, no (c, V) one-hot materialised
    g.scatter_add_(1, targets[:, None], torch.full_like(targets[:, None], -1, dtype=g.dtype))
    return g.mul_(inv_n).to(dtype)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_rows: int, main_grad=None, weight_lp=None):
        """hidden (N, d), weight (V, d), targets (N,) int64 -> mean loss over N (fp32 scalar).
        main_grad / weight_lp: see fused_linear_cross_entropy."""
        dtype = _compute_dtype(hidden.device, hidden.dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            n = hidden.shape[0]
            w = _matmul_weight(weight, weight_lp, dtype)
            grad_hidden = torch.empty_like(hidden)
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
            for start in range(0, n, chunk_rows):
                h = hidden[start:start + chunk_rows].to(dtype)  # (c, d)
                t = targets[start:start + chunk_rows]  # (c,)
                logits = h @ w.t()  # (c, V) in dtype; fp32 only inside the reductions below
                lse = torch.logsumexp(logits.float(), dim=-1)  # (c,)
                loss += (lse - logits.gather(1, t[:, None]).squeeze(1).float()).sum()
                g = _grad_logits(logits, t, lse, 1.0 / n, dtype)  # (c, V)
                grad_hidden[start:start + chunk_rows] = (g @ w).to(hidden.dtype)  # (c, d)
                grad_weight += (g.t() @ h).float()  # (V, d)
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        ctx.main_grad = main_grad  # on ctx: the embedding's backward adds into it too (model/tied_grad.py)
        return loss / n

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        if ctx.main_grad is not None:  # the weight's gradient goes into its fp32 buffer, not to autograd
            add_head_grad(ctx.main_grad, grad_weight, grad_loss)
            return grad_hidden * grad_loss, None, None, None, None, None
        return grad_hidden * grad_loss, grad_weight * grad_loss, None, None, None, None


def _matmul_weight(weight: torch.Tensor, weight_lp, dtype: torch.dtype) -> torch.Tensor:
    """The head weight in the compute dtype: the weight cache's copy when it has one (cast once per
    optimizer step, training/engines/weight_cache.py), else a cast of the fp32 weight."""
    if weight_lp is not None and weight_lp.dtype == dtype:
        return weight_lp
    return weight.to(dtype)


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                               chunk_rows: int = 4096, main_grad: Optional[torch.Tensor] = None,
                               weight_lp: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Mean cross-entropy of softmax(hidden @ weightᵀ) against targets.

    hidden (..., d), weight (V, d), targets (...) int64. Equal to
    F.cross_entropy((hidden @ weight.T).float(), targets) up to rounding, in far less memory.
    main_grad (V, d) fp32: weight's gradient is added into it (times the loss's incoming gradient)
    instead of returned to autograd (model/tied_grad.py). weight_lp: weight already in the compute
    dtype (the weight cache's copy), used for the matmuls instead of casting weight.
    """
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)
    if not torch.is_grad_enabled() or not (h.requires_grad or weight.requires_grad):
        dtype = _compute_dtype(h.device, h.dtype)
        w = _matmul_weight(weight, weight_lp, dtype)
        return sum(F.cross_entropy((h[s:s + chunk_rows].to(dtype) @ w.t()).float(),
                                   t[s:s + chunk_rows], reduction="sum")
                   for s in range(0, h.shape[0], chunk_rows)) / h.shape[0]
    return _FusedLinearCrossEntropy.apply(h, weight, t, chunk_rows, main_grad, weight_lp)
