"""Plain PyTorch attention, used as the reference by the tests and the benchmark.

attention_ref: q (b, sq, h, d), k/v (b, sk, hk, d) with h % hk == 0 (GQA), causal mask aligned
bottom-right (query i sees key j iff j <= i + sk - sq, as FlashAttention >= 2.1). Computes in fp32
when upcast=True (the reference), or in the inputs' own dtype when upcast=False (to measure
PyTorch's own rounding error, the yardstick for the kernels' tolerance).
Rows that see no key give output 0 and lse = -inf.
attention_grads_flash: dq, dk, dv by the FlashAttention backward's equations (D = rowsum(dO o O) from the
given output) in the inputs' dtype -- PyTorch's own error for the rounding that autograd through
attention_ref does not make.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor


def attention_ref(q: Tensor, k: Tensor, v: Tensor, causal: bool = False,
                  softmax_scale: Optional[float] = None, upcast: bool = True) -> tuple[Tensor, Tensor]:
    """Returns (out (b, sq, h, d) in q's dtype unless upcast, lse (b, h, sq) fp32)."""
    dtype = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    if hk != h:  # GQA / MQA: query head i uses kv head i // (h // hk)
        k = k.repeat_interleave(h // hk, dim=2)
        v = v.repeat_interleave(h // hk, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q * scale, k)  # (b, h, sq, sk)
    if causal:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        scores = scores.masked_fill(j > i + (sk - sq), float("-inf"))
    lse = torch.logsumexp(scores.float(), dim=-1)  # (b, h, sq); -inf for empty rows
    p = torch.softmax(scores, dim=-1)
    p = torch.nan_to_num(p, nan=0.0)  # fully masked rows: softmax of all -inf -> 0
    out = torch.einsum("bhqk,bkhd->bqhd", p, v)
    return (out if upcast else out.to(dtype)), lse


def attention_varlen_ref(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                         cu_seqlens_k: Tensor, causal: bool = False,
                         softmax_scale: Optional[float] = None,
                         upcast: bool = True) -> tuple[Tensor, Tensor]:
    """Packed (total, h, d) inputs; each sequence attends only within itself.
    Returns (out (total_q, h, d), lse (h, total_q))."""
    cq = cu_seqlens_q.tolist()
    ck = cu_seqlens_k.tolist()
    outs, lses = [], []
    for i in range(len(cq) - 1):
        qs, ks_ = q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]]
        vs = v[ck[i]:ck[i + 1]]
        o, l = attention_ref(qs[None], ks_[None], vs[None], causal, softmax_scale, upcast)
        outs.append(o[0])
        lses.append(l[0])
    return torch.cat(outs, 0), torch.cat(lses, 1)


def attention_grads_flash(q: Tensor, k: Tensor, v: Tensor, out: Tensor, dout: Tensor, causal: bool = False,
                          softmax_scale: Optional[float] = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) as a FlashAttention backward computes them, here in the inputs' dtype: P recomputed,
    dP = dO V^T, D = rowsum(dO o O) from `out` (the forward's rounded output), dS = P o (dP - D),
    dQ = scale dS K, dK = scale dS^T Q, dV = P^T dO; summed over a key/value head's group (GQA).
    Autograd through attention_ref(upcast=False) takes D from its own P instead, and so misses the error
    of the rounded O: e.g. a row with one key has dS = 0 exactly there, while D - dP is one rounding of
    terms of the size of dP. Shapes as attention_ref."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    kr = k.repeat_interleave(h // hk, dim=2) if hk != h else k
    vr = v.repeat_interleave(h // hk, dim=2) if hk != h else v
    scores = torch.einsum("bqhd,bkhd->bhqk", q * scale, kr)
    if causal:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        scores = scores.masked_fill(j > i + (sk - sq), float("-inf"))
    p = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)  # (b, h, sq, sk)
    dv = torch.einsum("bhqk,bqhd->bkhd", p, dout)
    dp = torch.einsum("bqhd,bkhd->bhqk", dout, vr)
    dsum = (dout * out).sum(-1).transpose(1, 2)  # (b, h, sq)
    ds = p * (dp - dsum[..., None])
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kr) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q) * scale
    if hk != h:
        dk = dk.view(b, sk, hk, h // hk, d).sum(3)
        dv = dv.view(b, sk, hk, h // hk, d).sum(3)
    return dq, dk, dv


def attention_grads_flash_varlen(q: Tensor, k: Tensor, v: Tensor, out: Tensor, dout: Tensor,
                                 cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, causal: bool = False,
                                 softmax_scale: Optional[float] = None) -> tuple[Tensor, Tensor, Tensor]:
    """attention_grads_flash over packed (total, h, d) sequences; gradients packed like their inputs."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    grads = [[], [], []]
    for i in range(len(cq) - 1):
        sq_, sk_ = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        g = attention_grads_flash(q[sq_][None], k[sk_][None], v[sk_][None], out[sq_][None], dout[sq_][None],
                                  causal, softmax_scale)
        for acc, x in zip(grads, g):
            acc.append(x[0])
    return tuple(torch.cat(acc, 0) for acc in grads)
