"""Plain PyTorch attention, used as the reference by the tests and the benchmark.

attention_ref: q (b, sq, h, d), k/v (b, sk, hk, d) with h % hk == 0 (GQA), causal mask aligned
bottom-right (query i sees key j iff j <= i + sk - sq, as FlashAttention >= 2.1). Computes in fp32
when upcast=True (the reference), or in the inputs' own dtype when upcast=False (to measure
PyTorch's own rounding error, the yardstick for the kernels' tolerance).
Rows that see no key give output 0 and lse = -inf.
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
