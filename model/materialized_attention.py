"""Standard attention that materialises the (s x s) score matrix: the FlashAttention-2 paper's
"without FlashAttention" baseline (model.attention=math), computed as Megatron-LM's unfused attention.

Forward, in the input dtype (bf16 under autocast) except the softmax:
    S = Q K^T * scale        one GEMM with the scale as its alpha, (B, H, Tq, Tk)
    S[masked] = -inf         causal, or the given boolean mask (True = attend)
    P = softmax(S) in fp32, rounded to the input dtype; saved for the backward
    O = P V
Backward from the saved P:
    dV = P^T dO,  dP = dO V^T,  dS = P * (dP - rowsum(dP * P)) in fp32, rounded to the input dtype
    (the softmax's own backward; rowsum(dP * P) equals FlashAttention's rowsum(dO * O) in exact
    arithmetic, and unlike the latter it cancels where a row attends to one key only),
    dQ = dS K * scale,  dK = dS^T Q * scale
The softmax and its backward run as PyTorch's softmax kernels, which compute a 16-bit input in fp32 and
write the result once in the input dtype -- as Megatron-LM's fused (scaled, masked) softmax kernels do
for its default unfused attention -- so the (s x s) tensors held at once are S or dP, P and dS in the
input dtype (2 bytes an element in bf16), never an fp32 copy.

Why a torch.library custom op: TorchInductor's pattern passes rewrite a matmul-softmax-matmul chain
into scaled_dot_product_attention (torch/_inductor/fx_passes/fuse_attention.py), which would quietly
turn this baseline into FlashAttention under torch.compile. An op is opaque to them; its fake kernels
let torch.compile trace around it. CPU and CUDA, any float dtype.

    flashgpt::math_attn_fwd(q, k, v, mask?, scale, causal) -> (out, p)
    flashgpt::math_attn_bwd(dout, q, k, v, p, scale) -> (dq, dk, dv)
q, k, v: (B, H, T, D) with the same H (grouped-query callers repeat K/V heads first); mask: bool,
broadcastable to (B, H, Tq, Tk); p: (B, H, Tq, Tk) in the input dtype.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def _no_autocast(device: torch.device):
    """The ops compute in their inputs' dtype: an enclosing autocast region (still active while an op's
    implementation runs) would otherwise write CUDA's softmax in fp32 -- P twice the size, and an fp32 P
    meeting a bf16 dO in the backward, which autocast does not cover."""
    return torch.autocast(device.type, enabled=False)


def _bmm(a: Tensor, b: Tensor, alpha: float = 1.0) -> Tensor:
    """a (..., m, k) @ b (..., k, n) -> (..., m, n) as one batched GEMM, `alpha` applied inside it."""
    lead = a.shape[:-2]
    a3, b3 = a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:])
    if alpha == 1.0:
        out = torch.bmm(a3, b3)
    else:  # beta=0: the (uninitialised) input is ignored, NaNs in it included
        out = torch.baddbmm(a3.new_empty(a3.shape[0], a3.shape[1], b3.shape[2]), a3, b3, beta=0.0, alpha=alpha)
    return out.view(*lead, *out.shape[-2:])


@torch.library.custom_op("flashgpt::math_attn_fwd", mutates_args=(), device_types=("cpu", "cuda"))
def _fwd_op(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: float,
            causal: bool) -> tuple[Tensor, Tensor]:
    with _no_autocast(q.device):
        s = _bmm(q, k.transpose(-2, -1), scale)  # (B, H, Tq, Tk), input dtype
        if mask is None and causal:
            tq, tk = s.shape[-2:]
            mask = torch.ones(tq, tk, dtype=torch.bool, device=s.device).tril(tk - tq)
        if mask is not None:
            s.masked_fill_(~mask, float("-inf"))
        p = torch.softmax(s, dim=-1)  # fp32 inside for 16-bit s (max, sum, exp), written in q.dtype
        del s
        return _bmm(p, v), p


@_fwd_op.register_fake
def _(q, k, v, mask, scale, causal):
    B, H, tq, _ = q.shape
    return q.new_empty(B, H, tq, v.shape[-1]), q.new_empty(B, H, tq, k.shape[-2])


@torch.library.custom_op("flashgpt::math_attn_bwd", mutates_args=(), device_types=("cpu", "cuda"))
def _bwd_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, p: Tensor,
            scale: float) -> tuple[Tensor, Tensor, Tensor]:
    with _no_autocast(q.device):
        dv = _bmm(p.transpose(-2, -1), dout)  # (B, H, Tk, Dv)
        dp = _bmm(dout, v.transpose(-2, -1))  # (B, H, Tq, Tk)
        # p * (dp - rowsum(dp * p)), fp32 inside, written in q.dtype; masked entries have p = 0, so ds = 0
        ds = torch.ops.aten._softmax_backward_data(dp, p, -1, q.dtype)
        del dp
        dq = _bmm(ds, k, scale)
        dk = _bmm(ds.transpose(-2, -1), q, scale)
        return dq, dk, dv


@_bwd_op.register_fake
def _(dout, q, k, v, p, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous, as the GEMMs write


def _setup_context(ctx, inputs, output):
    q, k, v, _mask, scale, _causal = inputs
    ctx.save_for_backward(q, k, v, output[1])  # output: (out, p)
    ctx.scale = scale


def _backward(ctx, dout, dp):
    q, k, v, p = ctx.saved_tensors
    dq, dk, dv = _bwd_op(dout.contiguous(), q, k, v, p, ctx.scale)
    return dq, dk, dv, None, None, None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def materialized_attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None,
                           causal: bool = True, scale: Optional[float] = None) -> Tensor:
    """q, k, v: (B, H, T, D) -> (B, H, T, D). Causal unless a boolean `mask` (True = attend) is given.
    Under autocast, fp32 inputs are cast to the autocast dtype first (as SDPA does)."""
    if q.dtype == torch.float32 and torch.is_autocast_enabled(q.device.type):
        dt = torch.get_autocast_dtype(q.device.type)
        q, k, v = q.to(dt), k.to(dt), v.to(dt)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return _fwd_op(q, k, v, mask, float(scale), causal)[0]
