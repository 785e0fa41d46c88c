"""torch.library custom ops around our FlashAttention-2 kernels, and the public functions.

Ops (schema via torch.library.custom_op; fake kernels for torch.compile; autograd registered):
    flashgpt::fwd(q, k, v, cu_seqlens_q?, cu_seqlens_k?, max_seqlen_q, max_seqlen_k,
                  softmax_scale, causal, deterministic, window_left=-1, window_right=-1) -> (out, lse)
    flashgpt::bwd(dout, q, k, v, out, lse, cu_seqlens_q?, cu_seqlens_k?, max_seqlen_q,
                  max_seqlen_k, softmax_scale, causal, deterministic, window_left=-1,
                  window_right=-1) -> (dq, dk, dv)
    flashgpt::fwd_qkvpacked(qkv, n_kv_heads, softmax_scale, causal, deterministic, window_left=-1,
                            window_right=-1) -> (out, lse)
    flashgpt::bwd_qkvpacked(dout, qkv, out, lse, n_kv_heads, softmax_scale, causal,
                            deterministic, window_left=-1, window_right=-1) -> dqkv
      qkv (batch, seqlen, heads + 2 kv_heads, d): q, k, v heads side by side per token (a fused
      q/k/v projection's output viewed per head). The backward writes dq, dk, dv into one dqkv, so
      the projection's gradient needs no concatenation (0.9% of a 1.3B-8k training step).

Shapes: dense q (batch, seqlen_q, heads, d), k/v (batch, seqlen_k, heads_k, d), heads % heads_k == 0.
Varlen: q (total_q, heads, d), k/v (total_k, heads_k, d), cu_seqlens int32 (batch + 1).
lse: (batch, heads, seqlen_q) dense, (heads, total_q) varlen; fp32, natural log; +inf for rows
that see no key (causal with seqlen_q > seqlen_k, or a window that misses every key), whose output is 0.

Local (sliding-window) attention: window_size=(left, right), each >= -1 (-1 = unbounded on that
side; (-1, -1) = none), aligned bottom-right like the causal mask: query i sees key j iff
i + sk - sq - left <= j <= i + sk - sq + right (and, if causal, j <= i + sk - sq); per sequence
when packed. The kernels visit only the key tiles the band reaches (time scales with the window).

Head dims: the kernels are compiled for 64, 96 and 128; any other d <= 128 is zero-padded
up to the next of these here (e.g. 80 -> 96; zero columns change no dot product and give zero
output columns, which are sliced off). softmax_scale defaults to 1/sqrt(d) of the ORIGINAL d.

Eager calls run the same forward/backward through a torch.autograd.Function that calls the
binding directly (no custom-op dispatch cost); torch.compile traces the ops.

Building happens on the first call (see kernels/build.py); importing this module never builds.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .reference import check_window  # the one definition of a valid window_size, shared with the model

_SUPPORTED_HDIMS = (64, 96, 128)
_DTYPES = (torch.float16, torch.bfloat16)


def _ext():
    from .build import load_extension  # imported lazily: `python -m kernels.build` stays clean

    return load_extension()


# ---------------------------------------------------------------------------------------------
# Ops
# ---------------------------------------------------------------------------------------------
@torch.library.custom_op("flashgpt::fwd", mutates_args=())
def _fwd_op(
    q: Tensor, k: Tensor, v: Tensor,
    cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
    max_seqlen_q: int, max_seqlen_k: int,
    softmax_scale: float, causal: bool, deterministic: bool,
    window_left: int = -1, window_right: int = -1,
) -> tuple[Tensor, Tensor]:
    if not q.is_cuda:
        raise ValueError(_device_message(q.device))
    out, lse = _ext().fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          softmax_scale, causal, window_left, window_right)
    return out, lse


@_fwd_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
      deterministic, window_left=-1, window_right=-1):
    out = q.new_empty(q.shape)
    if cu_seqlens_q is not None:
        lse = q.new_empty((q.shape[-2], q.shape[0]), dtype=torch.float32)
    else:
        lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    return out, lse


@torch.library.custom_op("flashgpt::bwd", mutates_args=())
def _bwd_op(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
    max_seqlen_q: int, max_seqlen_k: int,
    softmax_scale: float, causal: bool, deterministic: bool,
    window_left: int = -1, window_right: int = -1,
) -> tuple[Tensor, Tensor, Tensor]:
    if not q.is_cuda:
        raise ValueError(_device_message(q.device))
    dq, dk, dv = _ext().bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                            max_seqlen_k, softmax_scale, causal, window_left, window_right, deterministic)
    return dq, dk, dv


@_bwd_op.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      softmax_scale, causal, deterministic, window_left=-1, window_right=-1):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, deterministic, *window = inputs
    window_left, window_right = window if window else (-1, -1)
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.args = (max_q, max_k, scale, causal, deterministic, window_left, window_right)
    ctx.n_inputs = len(inputs)
    ctx.mark_non_differentiable(lse)
    # No zero gradient is made for the LSE (a fill kernel per call); a missing dout arrives as None.
    ctx.set_materialize_grads(False)


def _ext_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, deterministic,
             window_left, window_right):
    # The binding takes the window before `deterministic` (flash_api.cpp).
    return _ext().bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, window_left,
                      window_right, deterministic)


def _backward_with(bwd, ctx, dout):
    """Gradients of the forward inputs (10, or 12 with the window), computing dq, dk, dv with `bwd`
    (the op, or _ext_bwd on the binding)."""
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = bwd(dout.contiguous() if dout.stride(-1) != 1 else dout, q, k, v, out, lse,
                     cu_q, cu_k, *ctx.args)
    return (dq, dk, dv) + (None,) * (ctx.n_inputs - 3)


def _backward(ctx, dout, dlse):
    # dlse is ignored: the LSE output is not differentiable (documented in flash_attn_func).
    return _backward_with(_bwd_op, ctx, dout)


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerFlash(torch.autograd.Function):
    """The same forward and backward as the ops, calling the binding directly: what eager mode
    runs. A torch.library custom op costs tens of microseconds of Python dispatch per call, which
    at short sequences is GPU idle time of the same order as the kernels (kernels/NOTES.md);
    torch.compile traces the ops instead (see _attention)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, deterministic, window_left=-1,
                window_right=-1):
        if not q.is_cuda:
            raise ValueError(_device_message(q.device))
        out, lse = _ext().fwd(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window_left, window_right)
        _setup_context(ctx, (q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, deterministic, window_left,
                             window_right), (out, lse))
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        return _backward_with(_ext_bwd, ctx, dout)


def _attention(*args):
    """flashgpt::fwd's (out, lse): the op while torch.compile traces, the binding in eager mode."""
    if torch.compiler.is_compiling():
        return _fwd_op(*args)
    return _EagerFlash.apply(*args)


def _split_qkv(qkv: Tensor, n_kv_heads: int):
    """(batch, seqlen, heads + 2 kv_heads, d) -> views q (.., heads, d), k and v (.., kv_heads, d)."""
    h = qkv.shape[-2] - 2 * n_kv_heads
    return qkv[..., :h, :], qkv[..., h:h + n_kv_heads, :], qkv[..., h + n_kv_heads:, :]


def _fwd_packed(qkv: Tensor, n_kv_heads: int, softmax_scale: float, causal: bool, window_left: int = -1,
                window_right: int = -1) -> tuple[Tensor, Tensor]:
    """(out, lse) of the binding's forward on qkv's head slices."""
    if not qkv.is_cuda:
        raise ValueError(_device_message(qkv.device))
    out, lse = _ext().fwd(*_split_qkv(qkv, n_kv_heads), None, None, qkv.shape[1], qkv.shape[1], softmax_scale,
                          causal, window_left, window_right)
    return out, lse


@torch.library.custom_op("flashgpt::fwd_qkvpacked", mutates_args=())
def _fwd_packed_op(qkv: Tensor, n_kv_heads: int, softmax_scale: float, causal: bool,
                   deterministic: bool, window_left: int = -1, window_right: int = -1) -> tuple[Tensor, Tensor]:
    return _fwd_packed(qkv, n_kv_heads, softmax_scale, causal, window_left, window_right)


@_fwd_packed_op.register_fake
def _(qkv, n_kv_heads, softmax_scale, causal, deterministic, window_left=-1, window_right=-1):
    b, s, n, d = qkv.shape
    h = n - 2 * n_kv_heads
    return qkv.new_empty((b, s, h, d)), qkv.new_empty((b, h, s), dtype=torch.float32)


@torch.library.custom_op("flashgpt::bwd_qkvpacked", mutates_args=())
def _bwd_packed_op(dout: Tensor, qkv: Tensor, out: Tensor, lse: Tensor, n_kv_heads: int,
                   softmax_scale: float, causal: bool, deterministic: bool, window_left: int = -1,
                   window_right: int = -1) -> Tensor:
    return _bwd_packed(_ext().bwd_into, dout, qkv, out, lse, n_kv_heads, softmax_scale, causal, deterministic,
                       window_left, window_right)


@_bwd_packed_op.register_fake
def _(dout, qkv, out, lse, n_kv_heads, softmax_scale, causal, deterministic, window_left=-1, window_right=-1):
    return torch.empty_like(qkv)


def _bwd_packed(bwd_into, dout, qkv, out, lse, n_kv_heads, scale, causal, deterministic, window_left=-1,
                window_right=-1) -> Tensor:
    """dqkv (like qkv): the backward writing dq, dk, dv into their slices of one tensor."""
    dqkv = torch.empty_like(qkv)
    bwd_into(dout.contiguous() if dout.stride(-1) != 1 else dout, *_split_qkv(qkv, n_kv_heads), out, lse,
             None, None, qkv.shape[1], qkv.shape[1], scale, causal, window_left, window_right, deterministic,
             *_split_qkv(dqkv, n_kv_heads))
    return dqkv


def _setup_packed(ctx, inputs, output):
    qkv, n_kv_heads, scale, causal, deterministic, *window = inputs
    window_left, window_right = window if window else (-1, -1)
    out, lse = output
    ctx.save_for_backward(qkv, out, lse)
    ctx.args = (n_kv_heads, scale, causal, deterministic, window_left, window_right)
    ctx.n_inputs = len(inputs)
    ctx.mark_non_differentiable(lse)
    # No zero gradient is made for the LSE (a fill kernel per call); a missing dout arrives as None.
    ctx.set_materialize_grads(False)


def _backward_packed_with(bwd, ctx, dout):
    """Gradients of the forward inputs (5, or 7 with the window), dqkv from `bwd` (the op, or
    _bwd_packed on the binding)."""
    qkv, out, lse = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    return (bwd(dout, qkv, out, lse, *ctx.args),) + (None,) * (ctx.n_inputs - 1)


def _backward_packed(ctx, dout, dlse):
    return _backward_packed_with(_bwd_packed_op, ctx, dout)


_fwd_packed_op.register_autograd(_backward_packed, setup_context=_setup_packed)


class _EagerFlashPacked(torch.autograd.Function):
    """flashgpt::fwd_qkvpacked / bwd_qkvpacked calling the binding directly (eager mode; see _EagerFlash)."""

    @staticmethod
    def forward(ctx, qkv, n_kv_heads, scale, causal, deterministic, window_left=-1, window_right=-1):
        out, lse = _fwd_packed(qkv, n_kv_heads, scale, causal, window_left, window_right)
        _setup_packed(ctx, (qkv, n_kv_heads, scale, causal, deterministic, window_left, window_right), (out, lse))
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        return _backward_packed_with(lambda *a: _bwd_packed(_ext().bwd_into, *a), ctx, dout)


def _attention_packed(*args):
    if torch.compiler.is_compiling():
        return _fwd_packed_op(*args)
    return _EagerFlashPacked.apply(*args)


# ---------------------------------------------------------------------------------------------
# Validation (metadata only: traceable by torch.compile, no device sync)
# ---------------------------------------------------------------------------------------------
def _device_message(device) -> str:
    why = "" if torch.cuda.is_available() else " (and CUDA is not available in this process)"
    return (
        f"flashgpt flash attention needs CUDA tensors, got device '{device}'{why}. "
        "Fix: move q, k, v to a GPU with .cuda(), or on CPU use kernels.reference.attention_ref "
        "or torch.nn.functional.scaled_dot_product_attention."
    )


def _padded_hdim(d: int) -> int:
    for p in _SUPPORTED_HDIMS:
        if d <= p:
            return p
    raise ValueError(
        f"flashgpt flash attention: head dim {d} > 128 is not supported (kernels exist for "
        "64, 96 and 128; smaller dims are zero-padded). Fix: use head dim <= 128."
    )


def _validate(q: Tensor, k: Tensor, v: Tensor, ndim: int, name: str, check_device: bool = True) -> None:
    for t, n in ((q, "q"), (k, "k"), (v, "v")):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name}: {n} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name}: {n} has dtype {t.dtype}; supported: float16, bfloat16. "
                             "Fix: cast with .to(torch.bfloat16) (or run under autocast).")
        if t.dim() != ndim:
            layout = "(batch, seqlen, heads, headdim)" if ndim == 4 else "(total_tokens, heads, headdim)"
            raise ValueError(f"{name}: {n} must be {ndim}-D {layout}, got shape {tuple(t.shape)}")
        if t.numel() == 0:
            raise ValueError(f"{name}: {n} is empty (shape {tuple(t.shape)}); every dim must be > 0")
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: {n}'s last dim must be contiguous (stride 1), got stride "
                             f"{t.stride(-1)}. Fix: call .contiguous() first.")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{name}: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{name}: q, k, v are on different devices")
    if k.shape != v.shape:
        raise ValueError(f"{name}: k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"{name}: head dims differ: q {q.shape[-1]}, k {k.shape[-1]}")
    if ndim == 4 and q.shape[0] != k.shape[0]:
        raise ValueError(f"{name}: batch sizes differ: q {q.shape[0]}, k {k.shape[0]}")
    hq, hk = q.shape[-2], k.shape[-2]
    if hq % hk != 0:
        raise ValueError(f"{name}: q heads ({hq}) must be a multiple of k/v heads ({hk}) "
                         "(grouped-query attention)")
    _padded_hdim(q.shape[-1])
    if check_device:
        _check_device(q, k, v, name)


def _check_device(q: Tensor, k: Tensor, v: Tensor, name: str) -> None:
    # Checked last, so that every other check also runs (and is tested) on a CPU-only machine.
    for t, n in ((q, "q"), (k, "k"), (v, "v")):
        if t.device.type != "cuda":
            raise ValueError(f"{name}: {n} is on '{t.device}'. " + _device_message(t.device))


def _autocast(q: Tensor, k: Tensor, v: Tensor):
    """Under torch.autocast("cuda"), fp32 CUDA inputs are cast to the autocast dtype (as SDPA does)."""
    if q.is_cuda and q.dtype == torch.float32 and torch.is_autocast_enabled("cuda"):
        dt = torch.get_autocast_dtype("cuda")
        return q.to(dt), k.to(dt), v.to(dt)
    return q, k, v


def _scale(softmax_scale: Optional[float], d: int) -> float:
    if softmax_scale is None:
        return d ** -0.5
    if not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be > 0, got {softmax_scale}")
    return float(softmax_scale)


def _window(window_size, name: str) -> tuple[int, int]:
    """(left, right) as ints >= -1 (-1 = unbounded on that side), or one ValueError naming the function."""
    try:
        return check_window(window_size)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def _pad(t: Tensor, d_pad: int) -> Tensor:
    return t if t.shape[-1] == d_pad else F.pad(t, (0, d_pad - t.shape[-1]))


# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------
def flash_attn_func(q: Tensor, k: Tensor, v: Tensor, causal: bool = False,
                    softmax_scale: Optional[float] = None, deterministic: bool = False,
                    return_lse: bool = False, window_size: tuple[int, int] = (-1, -1)):
    """Scaled dot-product attention with our FlashAttention-2 kernels.

    q: (batch, seqlen_q, heads, d); k, v: (batch, seqlen_k, heads_k, d); bf16/fp16 CUDA.
    causal: bottom-right aligned mask (query i sees keys j <= i + seqlen_k - seqlen_q).
    deterministic: backward adds dQ contributions in a fixed order (bit-repeatable, slower).
    return_lse: also return the fp32 log-sum-exp (batch, heads, seqlen_q) (not differentiable).
    window_size: (left, right) local attention, -1 = unbounded on that side (module docstring).
    """
    left, right = _window(window_size, "flash_attn_func")
    q, k, v = _autocast(q, k, v)
    _validate(q, k, v, 4, "flash_attn_func")
    d = q.shape[-1]
    scale = _scale(softmax_scale, d)
    d_pad = _padded_hdim(d)
    out, lse = _attention(_pad(q, d_pad), _pad(k, d_pad), _pad(v, d_pad), None, None,
                          q.shape[1], k.shape[1], scale, bool(causal), bool(deterministic), left, right)
    if d_pad != d:
        out = out[..., :d]
    return (out, lse) if return_lse else out


def flash_attn_qkvpacked_func(qkv: Tensor, n_kv_heads: Optional[int] = None, causal: bool = False,
                              softmax_scale: Optional[float] = None, deterministic: bool = False,
                              return_lse: bool = False, window_size: tuple[int, int] = (-1, -1)):
    """Attention over a packed q/k/v tensor; the backward returns one gradient for it.

    qkv: (batch, seqlen, heads + 2 * n_kv_heads, d), bf16/fp16 CUDA: per token the q heads, then the
    k heads, then the v heads -- a fused q/k/v projection's output viewed per head. n_kv_heads
    defaults to a third of the heads (no grouping). Same results as flash_attn_func on the three
    slices; the backward writes dq, dk and dv into one tensor (no concatenation). A qkv that is not
    contiguous, or a head dim that needs padding, goes through flash_attn_func on the slices.
    """
    name = "flash_attn_qkvpacked_func"
    left, right = _window(window_size, name)
    if not isinstance(qkv, Tensor) or qkv.dim() != 4:
        raise ValueError(f"{name}: qkv must be a 4-D tensor (batch, seqlen, heads + 2 kv_heads, headdim), "
                         f"got {tuple(qkv.shape) if isinstance(qkv, Tensor) else type(qkv).__name__}")
    n = qkv.shape[2]
    if n_kv_heads is None:
        if n % 3:
            raise ValueError(f"{name}: {n} packed heads is not 3 x heads; pass n_kv_heads for grouped-query "
                             f"attention")
        n_kv_heads = n // 3
    if not (0 < n_kv_heads and 2 * n_kv_heads < n):
        raise ValueError(f"{name}: n_kv_heads={n_kv_heads} leaves no q heads among {n} packed heads")
    if qkv.dtype == torch.float32 and qkv.is_cuda and torch.is_autocast_enabled("cuda"):
        qkv = qkv.to(torch.get_autocast_dtype("cuda"))  # as _autocast does for the separate tensors
    q, k, v = _split_qkv(qkv, n_kv_heads)
    _validate(q, k, v, 4, name)
    d = qkv.shape[-1]
    if d not in _SUPPORTED_HDIMS or not qkv.is_contiguous():
        return flash_attn_func(q, k, v, causal=causal, softmax_scale=softmax_scale,
                               deterministic=deterministic, return_lse=return_lse, window_size=(left, right))
    out, lse = _attention_packed(qkv, n_kv_heads, _scale(softmax_scale, d), bool(causal), bool(deterministic),
                                 left, right)
    return (out, lse) if return_lse else out


def flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                           cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                           causal: bool = False, softmax_scale: Optional[float] = None,
                           deterministic: bool = False, return_lse: bool = False,
                           window_size: tuple[int, int] = (-1, -1)):
    """Attention over packed sequences: no token attends across a cu_seqlens boundary.

    q: (total_q, heads, d); k, v: (total_k, heads_k, d); cu_seqlens_*: int32 (batch + 1),
    starting at 0, non-decreasing, last = total tokens; max_seqlen_*: the longest sequence.
    lse (if returned): (heads, total_q) fp32. window_size: as flash_attn_func, inside each sequence.
    """
    name = "flash_attn_varlen_func"
    left, right = _window(window_size, name)
    q, k, v = _autocast(q, k, v)
    _validate(q, k, v, 3, name, check_device=False)
    for c, n in ((cu_seqlens_q, "cu_seqlens_q"), (cu_seqlens_k, "cu_seqlens_k")):
        if not isinstance(c, Tensor) or c.dim() != 1 or c.dtype != torch.int32:
            raise ValueError(f"{name}: {n} must be a 1-D int32 tensor")
        if c.device != q.device:
            raise ValueError(f"{name}: {n} is on {c.device}, q on {q.device}")
        if c.numel() < 2:
            raise ValueError(f"{name}: {n} needs at least 2 entries (batch + 1)")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"{name}: cu_seqlens_q has {cu_seqlens_q.numel()} entries but "
                         f"cu_seqlens_k has {cu_seqlens_k.numel()}: both must be batch + 1")
    if max_seqlen_q <= 0 or max_seqlen_k <= 0:
        raise ValueError(f"{name}: max_seqlen_q/k must be > 0")
    _check_device(q, k, v, name)
    d = q.shape[-1]
    scale = _scale(softmax_scale, d)
    d_pad = _padded_hdim(d)
    out, lse = _attention(_pad(q, d_pad), _pad(k, d_pad), _pad(v, d_pad),
                          cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(),
                          int(max_seqlen_q), int(max_seqlen_k), scale, bool(causal), bool(deterministic),
                          left, right)
    if d_pad != d:
        out = out[..., :d]
    return (out, lse) if return_lse else out
