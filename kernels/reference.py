"""Plain PyTorch attention, used as the reference by the tests and the benchmark.

attention_ref: q (b, sq, h, d), k/v (b, sk, hk, d) with h % hk == 0 (GQA), causal mask aligned
bottom-right (query i sees key j iff j <= i + sk - sq, as FlashAttention >= 2.1). Computes in fp32
when upcast=True (the reference), or in the inputs' own dtype when upcast=False (to measure
PyTorch's own rounding error, the yardstick for the kernels' tolerance).
Rows that see no key give output 0 and lse = -inf.
window_size=(left, right) (local attention, FlashAttention's convention; -1 = unbounded on that side):
query i sees key j iff j >= i + sk - sq - left and j <= i + sk - sq + right, as well as the causal
condition; window_mask builds that (sq, sk) mask. (-1, -1) is no window.
attention_grads_flash: dq, dk, dv by the FlashAttention backward's equations (D = rowsum(dO o O) from the
given output) in the inputs' dtype -- PyTorch's own error for the rounding that autograd through
attention_ref does not make.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor


def check_window(window_size) -> tuple[int, int]:
    """window_size as a (left, right) tuple of ints >= -1, else a ValueError of one line."""
    ok = (isinstance(window_size, (tuple, list)) and len(window_size) == 2
          and all(isinstance(x, int) and not isinstance(x, bool) and x >= -1 for x in window_size))
    if not ok:
        raise ValueError(f"window_size={window_size!r} is not two ints >= -1; give (left, right) keys each side "
                         f"of the diagonal, -1 for unbounded, e.g. (255, 0) for a causal window of 256")
    return int(window_size[0]), int(window_size[1])


def window_mask(sq: int, sk: int, causal: bool = False, window_size=(-1, -1),
                device: Optional[torch.device] = None) -> Tensor:
    """Boolean (sq, sk), True = query i may attend key j. With offset = sk - sq (bottom-right alignment):
    j >= i + offset - left unless left == -1, j <= i + offset + right unless right == -1, and if causal
    j <= i + offset."""
    left, right = check_window(window_size)
    i = torch.arange(sq, device=device)[:, None] + (sk - sq)  # the key column on query i's diagonal
    j = torch.arange(sk, device=device)[None, :]
    mask = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if left >= 0:
        mask &= j >= i - left
    if right >= 0:
        mask &= j <= i + right
    if causal:
        mask &= j <= i
    return mask


def _mask_scores(scores: Tensor, causal: bool, window_size) -> Tensor:
    """scores (..., sq, sk) with the positions no query may see set to -inf."""
    if not causal and tuple(window_size) == (-1, -1):
        return scores
    sq, sk = scores.shape[-2:]
    return scores.masked_fill(~window_mask(sq, sk, causal, window_size, scores.device), float("-inf"))


def attention_ref(q: Tensor, k: Tensor, v: Tensor, causal: bool = False,
                  softmax_scale: Optional[float] = None, upcast: bool = True,
                  window_size=(-1, -1)) -> tuple[Tensor, Tensor]:
    """Returns (out (b, sq, h, d) in q's dtype unless upcast, lse (b, h, sq) fp32)."""
    check_window(window_size)
    dtype = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    h, d, hk = q.shape[2], q.shape[3], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    if hk != h:  # GQA / MQA: query head i uses kv head i // (h // hk)
        k = k.repeat_interleave(h // hk, dim=2)
        v = v.repeat_interleave(h // hk, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q * scale, k)  # (b, h, sq, sk)
    scores = _mask_scores(scores, causal, window_size)
    lse = torch.logsumexp(scores.float(), dim=-1)  # (b, h, sq); -inf for empty rows
    p = torch.softmax(scores, dim=-1)
    p = torch.nan_to_num(p, nan=0.0)  # fully masked rows: softmax of all -inf -> 0
    out = torch.einsum("bhqk,bkhd->bqhd", p, v)
    return (out if upcast else out.to(dtype)), lse


def attention_varlen_ref(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                         cu_seqlens_k: Tensor, causal: bool = False,
                         softmax_scale: Optional[float] = None,
                         upcast: bool = True, window_size=(-1, -1)) -> tuple[Tensor, Tensor]:
    """Packed (total, h, d) inputs; each sequence attends only within itself (the window too, aligned
    per sequence). Returns (out (total_q, h, d), lse (h, total_q))."""
    check_window(window_size)
    cq = cu_seqlens_q.tolist()
    ck = cu_seqlens_k.tolist()
    outs, lses = [], []
    for i in range(len(cq) - 1):
        qs, ks_ = q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]]
        vs = v[ck[i]:ck[i + 1]]
        o, l = attention_ref(qs[None], ks_[None], vs[None], causal, softmax_scale, upcast, window_size)
        outs.append(o[0])
        lses.append(l[0])
    return torch.cat(outs, 0), torch.cat(lses, 1)


def attention_grads_flash(q: Tensor, k: Tensor, v: Tensor, out: Tensor, dout: Tensor, causal: bool = False,
                          softmax_scale: Optional[float] = None,
                          window_size=(-1, -1)) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) as a FlashAttention backward computes them, here in the inputs' dtype: P recomputed,
    dP = dO V^T, D = rowsum(dO o O) from `out` (the forward's rounded output), dS = P o (dP - D),
    dQ = scale dS K, dK = scale dS^T Q, dV = P^T dO; summed over a key/value head's group (GQA).
    Autograd through attention_ref(upcast=False) takes D from its own P instead, and so misses the error
    of the rounded O: e.g. a row with one key has dS = 0 exactly there, while D - dP is one rounding of
    terms of the size of dP. Shapes and window_size as attention_ref."""
    check_window(window_size)
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    kr = k.repeat_interleave(h // hk, dim=2) if hk != h else k
    vr = v.repeat_interleave(h // hk, dim=2) if hk != h else v
    scores = torch.einsum("bqhd,bkhd->bhqk", q * scale, kr)
    scores = _mask_scores(scores, causal, window_size)
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
                                 softmax_scale: Optional[float] = None,
                                 window_size=(-1, -1)) -> tuple[Tensor, Tensor, Tensor]:
    """attention_grads_flash over packed (total, h, d) sequences; gradients packed like their inputs."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    grads = [[], [], []]
    for i in range(len(cq) - 1):
        sq_, sk_ = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        g = attention_grads_flash(q[sq_][None], k[sk_][None], v[sk_][None], out[sq_][None], dout[sq_][None],
                                  causal, softmax_scale, window_size)
        for acc, x in zip(grads, g):
            acc.append(x[0])
    return tuple(torch.cat(acc, 0) for acc in grads)
