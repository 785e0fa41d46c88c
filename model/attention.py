"""Causal self-attention and the one place that chooses how attention is computed.

Backends (chosen once per model, logged):
  flash      - our FlashAttention-2 CUDA kernel (`kernels.flash_attn_func`), CUDA + bf16/fp16 only
  sdpa       - PyTorch's scaled_dot_product_attention (picks flash/cuDNN/math itself)
  sdpa_flash - SDPA held to its FlashAttention-2 backend (no fallback: it runs or the run is refused)
  sdpa_cudnn - SDPA held to its cuDNN backend (CUDA only)
  math       - standard attention materialising the s x s scores in the input dtype, softmax in fp32
               (model/materialized_attention.py): the FlashAttention-2 paper's "without FlashAttention"
  reference  - plain matmul + softmax in fp32; slow, for checking
  auto       - ours on CUDA in bf16/fp16 (else, or where it cannot load, SDPA)
model.recompute_attention recomputes the attention's forward in the backward (any backend).
model.attention_window > 0 makes some layers local (a causal band of that many tokens): flash passes
window_size to our kernels, sdpa / math / reference take a boolean mask; sdpa_flash and sdpa_cudnn take
no mask and are refused.
Context parallelism comes from outside: the module's `context_parallel` slot (None on one device) takes
a wrapper (training/context_parallel) that exchanges sequence slices around the module's own attention.
"""
from __future__ import annotations

import logging
import math
import warnings
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from kernels.reference import window_mask
from model.config import GPTConfig
from model.linear import Linear
from model.materialized_attention import materialized_attention
from model.rope import apply_rotary

log = logging.getLogger(__name__)

BACKENDS = ("flash", "sdpa", "sdpa_flash", "sdpa_cudnn", "math", "reference")
# SDPA held to one backend: model.attention -> torch's SDPBackend member name
SDPA_ONLY = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION"}


class AttentionUnavailable(RuntimeError):
    """model.attention names a backend that cannot run on this device / dtype / head dim; the message
    names the choice and what to use instead (the trainer reports it as a config error)."""


def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend

    return getattr(SDPBackend, SDPA_ONLY[name])


def _sdpa_only_status(requested: str, device: torch.device, head_dim: int,
                      dtype: torch.dtype) -> Tuple[bool, str]:
    """Whether SDPA's one backend runs forward and backward here: a tiny causal call at the model's
    head dim and dtype (torch's own checks, which differ by device, GPU and version, decide)."""
    from torch.nn.attention import sdpa_kernel

    if device.type == "cuda" and not torch.cuda.is_available():
        return False, "no CUDA GPU is visible"
    with warnings.catch_warnings(record=True) as caught, torch.enable_grad():
        warnings.simplefilter("always")  # torch says why a backend cannot run in warnings
        try:
            # fixed values, not random ones: the probe must not move the RNG that initialises the weights
            q = torch.linspace(-1, 1, 8 * head_dim, device=device).view(1, 1, 8, head_dim).to(dtype)
            q.requires_grad_()
            with sdpa_kernel(_sdpa_backend(requested)):
                F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
        except RuntimeError as e:
            said = [str(w.message) for w in caught] or [str(e)]
            said = [m.splitlines()[0].split(". ")[0].rstrip(".") for m in said if m]  # first sentences
            return False, "; ".join(dict.fromkeys(said))
    return True, f"PyTorch SDPA, its {SDPA_ONLY[requested]} backend only"


def _our_kernel_status() -> Tuple[bool, str]:
    try:
        import kernels
    except Exception as e:  # a broken install must not stop the CPU path
        return False, f"kernels package failed to import: {e}"
    if kernels.is_available():
        return True, "our FlashAttention-2 kernel"
    return False, kernels.unavailable_reason()


def window_refusal(backend: str, window: int) -> Optional[str]:
    """The one-line reason `backend` cannot run a local layer of `window` tokens, or None where it can."""
    if window <= 0:
        return None
    if backend not in SDPA_ONLY:
        return None
    return (f"model.attention={backend} cannot run a local window (model.attention_window={window}: that SDPA "
            f"backend takes no mask); use model.attention=flash or sdpa (or auto, math), or model.attention_window=0")


def resolve_backend(requested: str, device: torch.device, head_dim: int = 128,
                    dtype: torch.dtype = torch.bfloat16, window: int = 0) -> Tuple[str, str]:
    """Return (backend, reason). `requested` is the config's model.attention; `dtype` is what
    attention computes in (the autocast dtype; float32 without autocast); `window` the model's
    attention_window (> 0: some layers local, which sdpa_flash and sdpa_cudnn cannot run).

    `auto` is our kernel on CUDA (it builds on first use) for bf16/fp16 and head dims up to 128,
    and SDPA otherwise, or where our kernel cannot build or load (the reason is logged). Ours is at
    or above PyTorch's own FlashAttention-2 (SDPA flash) and SDPA's cuDNN backend over the kernel
    sweep on an H100 (bench/RESULTS.md); `model.attention=sdpa` selects SDPA.
    """
    refusal = window_refusal(requested, window)
    if refusal:
        raise AttentionUnavailable(refusal)
    if requested in ("sdpa", "reference"):
        return requested, "asked for in model.attention"
    if requested == "math":
        return requested, "asked for in model.attention: scores materialised, softmax in fp32"
    if requested == "sdpa_cudnn" and device.type != "cuda":
        raise AttentionUnavailable(f"model.attention=sdpa_cudnn needs a CUDA GPU (cuDNN); on {device.type} use "
                                   f"model.attention=sdpa_flash, sdpa or math")
    if requested in SDPA_ONLY:
        ok, why = _sdpa_only_status(requested, device, head_dim, dtype)
        if not ok:
            raise AttentionUnavailable(
                f"model.attention={requested} cannot run on {device.type} in {str(dtype).replace('torch.', '')} "
                f"at head dim {head_dim} (PyTorch: {why}); use model.attention=sdpa (PyTorch picks a backend) "
                f"or math" + ("" if device.type == "cuda" else ", or run on a CUDA GPU"))
        return requested, why
    if device.type != "cuda":
        if requested == "flash":
            raise AttentionUnavailable("model.attention=flash needs a CUDA device; on this machine use "
                                       "model.attention=sdpa (or auto)")
        return "sdpa", f"auto on {device.type}: our kernel is CUDA-only"
    if requested == "auto" and (head_dim > 128 or dtype not in (torch.bfloat16, torch.float16)):
        return "sdpa", (f"auto: our kernel takes bf16/fp16 and head dim <= 128, this model computes "
                        f"attention in {dtype} at head dim {head_dim}")
    ok, why = _our_kernel_status()
    if requested == "auto":
        if ok:
            return "flash", f"auto on CUDA: {why}"
        return "sdpa", f"auto: our kernel is unavailable ({why}); using SDPA"
    if not ok:
        raise AttentionUnavailable(f"model.attention=flash but our kernel is unavailable: {why}")
    return "flash", why


def doc_mask(cu_seqlens: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Boolean (B, 1, T, T) mask: causal and within the same document.

    cu_seqlens: int32 (n_docs + 1,) start offsets into the flattened (B*T) batch, 0 ... B*T.
    """
    total = batch * seqlen
    starts = torch.zeros(total, dtype=torch.int32, device=cu_seqlens.device)
    starts[cu_seqlens[1:-1].long()] = 1
    doc_id = torch.cumsum(starts, 0).view(batch, seqlen)  # (B, T) document index per token
    same_doc = doc_id[:, :, None] == doc_id[:, None, :]  # (B, T, T)
    causal = torch.ones(seqlen, seqlen, dtype=torch.bool, device=cu_seqlens.device).tril()
    return (same_doc & causal)[:, None]


def reference_attention(q, k, v, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q: (B, H, T, D), k/v: (B, H, T, D) -> (B, H, T, D); fp32 math, causal unless mask given."""
    T = q.shape[-2]
    scores = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    if mask is None:
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(dim=-1) @ v.float()).to(q.dtype)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, backend: str, window: int = 0):
        """`window` > 0: a local layer, token t attends to tokens t - window + 1 .. t (cfg.window_of)."""
        super().__init__()
        assert backend in BACKENDS, backend
        refusal = window_refusal(backend, window)
        if refusal:
            raise AttentionUnavailable(refusal)
        self.window = max(int(window), 0)
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_dim
        kv_dim = self.n_kv_head * self.head_dim
        # model/linear.py's Linear: nn.Linear with a main_grad slot, so that with the weight cache the
        # weight-gradient GEMMs add into the fp32 .grad (kernels/wgrad.py). Compiled, this relies on
        # training/compile/inductor_barrier.py's work-around for inductor's LayerNorm-kernel race.
        self.qkv = Linear(cfg.d_model, cfg.d_model + 2 * kv_dim, bias=cfg.bias)
        self.proj = Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.proj.is_residual_out = True  # scaled init (GPT-2)
        self.dropout = nn.Dropout(cfg.dropout)
        self.backend = backend
        self.rotary = cfg.pos_emb == "rope"
        # our kernel's backward adds dQ in a fixed order (bit-repeatable, slower); set from outside
        # (training/resilience/determinism.py) for train.deterministic
        self.deterministic = False
        # model.recompute_attention: keep only q, k, v (not the backend's own saved tensors, the s x s
        # probabilities for `math`) and run the attention's forward again in the backward
        self.recompute = cfg.recompute_attention and not cfg.recompute_blocks  # a recomputed block redoes it
        # set from outside (training/context_parallel: attach/detach), None on one device: a callable
        # cp(q, k, v, local) -> y that exchanges this rank's sequence slice for the full sequence of a
        # share of the heads, runs `local` (this module's own attention) on it and exchanges back
        self.context_parallel = None

    def _attend(self, fn, *args):
        if self.recompute and torch.is_grad_enabled():
            # the attention itself draws no random numbers: no RNG state to replay
            return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)
        return fn(*args)

    def forward(self, x: torch.Tensor, rope_cache=None, cu_seqlens=None, max_seqlen=None):
        B, T, C = x.shape  # (batch, seq, d_model)
        kv_dim = self.n_kv_head * self.head_dim
        qkv = self.qkv(x)  # (B, T, C + 2 kv_dim): q heads, k heads, v heads
        if self.backend == "flash" and not self.rotary and cu_seqlens is None and self.context_parallel is None:
            # our kernel on the packed heads: its backward returns one d(qkv), no concatenation
            packed = qkv.view(B, T, self.n_head + 2 * self.n_kv_head, self.head_dim)
            y = self._attend(self._flash_packed, packed, T)  # (B, T, H, D)
            return self.dropout(self.proj(y.reshape(B, T, C)))
        q, k, v = qkv.split([C, kv_dim, kv_dim], dim=-1)
        q = q.view(B, T, self.n_head, self.head_dim)  # (B, T, H, D)
        k = k.view(B, T, self.n_kv_head, self.head_dim)  # (B, T, Hkv, D)
        v = v.view(B, T, self.n_kv_head, self.head_dim)
        if self.rotary:
            q, k = apply_rotary(q, rope_cache), apply_rotary(k, rope_cache)
        if self.context_parallel is not None:
            # q (B, T/C, H, D), k/v (B, T/C, Hkv, D): this rank's slice; cu_seqlens / max_seqlen
            # describe the full window, which `local` sees after the exchange
            y = self.context_parallel(q, k, v, lambda q, k, v: self._local(q, k, v, cu_seqlens, max_seqlen))
        else:
            y = self._local(q, k, v, cu_seqlens, max_seqlen)  # (B, T, H, D)
        return self.dropout(self.proj(y.reshape(B, T, C)))

    def _local(self, q, k, v, cu_seqlens, max_seqlen):
        """This module's attention over the tensors given: q (B, T, h, D), k/v (B, T, h_kv, D) -> (B, T, h, D),
        causal; h and h_kv are the module's head counts, or their share under context parallelism."""
        if self.backend == "flash":
            return self._attend(self._flash, q, k, v, cu_seqlens, max_seqlen)
        return self._attend(self._torch, q, k, v, cu_seqlens)

    def _local_window(self, T: int) -> bool:
        """Whether this layer masks a band at sequence length T (a window >= T is every causal key)."""
        return 0 < self.window < T

    def _flash_window(self, T: int) -> dict:
        """Our kernel's window argument, window_size=(w - 1, 0) with causal=True; none for a dense layer."""
        return {"window_size": (self.window - 1, 0)} if self._local_window(T) else {}

    def _flash_packed(self, packed, T):
        import kernels

        return kernels.flash_attn_qkvpacked_func(packed, n_kv_heads=self.n_kv_head, causal=True,
                                                 deterministic=self.deterministic,
                                                 **self._flash_window(T))  # (B, T, H, D)

    def _flash(self, q, k, v, cu_seqlens, max_seqlen):
        import kernels

        B, T = q.shape[:2]
        if cu_seqlens is None:
            return kernels.flash_attn_func(q, k, v, causal=True, deterministic=self.deterministic,
                                           **self._flash_window(T))
        # the kernel aligns the window per document (each document's own positions)
        y = kernels.flash_attn_varlen_func(
            q.reshape(B * T, *q.shape[2:]), k.reshape(B * T, *k.shape[2:]), v.reshape(B * T, *v.shape[2:]),
            cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=True, deterministic=self.deterministic,
            **self._flash_window(T))
        return y.view(B, T, *y.shape[1:])

    def _torch(self, q, k, v, cu_seqlens):
        B, T = q.shape[:2]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        if k.shape[1] != q.shape[1]:  # grouped-query: repeat K/V heads for the group
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if cu_seqlens is not None and self.backend in SDPA_ONLY:
            raise ValueError(f"model.attention={self.backend} does not take document boundaries (its backend "
                             f"has no mask); use data.doc_boundaries=false, or model.attention=sdpa or math")
        mask = doc_mask(cu_seqlens, B, T) if cu_seqlens is not None else None
        if self._local_window(T):
            if self.backend in SDPA_ONLY:  # refused at construction; a backend switched afterwards lands here
                raise AttentionUnavailable(window_refusal(self.backend, self.window))
            # (T, T) causal band; within a document too, as documents are contiguous runs of the row
            band = window_mask(T, T, True, (self.window - 1, 0), q.device)
            mask = band if mask is None else mask & band
        if self.backend == "reference":
            y = reference_attention(q, k, v, mask)
        elif self.backend == "math":
            y = materialized_attention(q, k, v, mask)
        elif self.backend in SDPA_ONLY:
            from torch.nn.attention import sdpa_kernel

            with sdpa_kernel(_sdpa_backend(self.backend)):  # that backend or an error, never another
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return y.transpose(1, 2)  # (B, T, H, D)
