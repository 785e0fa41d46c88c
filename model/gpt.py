"""GPT (GPT-2/3 style), single device: embeddings -> N x Block(LN -> Attention -> LN -> MLP) -> LN -> head.

Knows nothing of parallelism, compile or DeepSpeed: those are applied from outside (training/).
"""
from __future__ import annotations

import logging
import math
from functools import partial
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from model.attention import CausalSelfAttention, resolve_backend
from model.config import GPTConfig
from model.layernorm import LayerNorm
from model.loss import fused_linear_cross_entropy
from model.mlp import MLP, resolve_mlp
from model.rope import rope_cache
from model.tied_grad import TiedEmbedding

log = logging.getLogger(__name__)


class LMHead(nn.Linear):
    """Output projection to the vocabulary; with targets, returns the loss (fused in row chunks).

    The loss runs inside this module's forward so that wrappers which gather parameters around a
    module's forward (ZeRO-3, FSDP) see the (tied) weight in use."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, out_features, bias=bias)
        # Set from outside (training/engines/weight_cache.py, through functional_call), None by default:
        # the (tied) weight's fp32 gradient buffer and its copy in the compute dtype.
        self.register_buffer("main_grad", None, persistent=False)
        self.register_buffer("weight_lp", None, persistent=False)

    def forward(self, x, targets=None, fused: bool = True):  # x (B, T, d)
        if targets is None:
            return super().forward(x)  # logits (B, T, vocab)
        if fused:
            return fused_linear_cross_entropy(x, self.weight, targets, main_grad=self.main_grad,
                                              weight_lp=self.weight_lp)
        logits = super().forward(x)
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, backend: str, mlp_impl: str = "torch", layer: int = 0):
        super().__init__()
        self.ln1 = LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias, saves_output=cfg.norm_saves_output)
        self.attn = CausalSelfAttention(cfg, backend, window=cfg.window_of(layer))  # window 0: dense
        self.ln2 = LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias, saves_output=cfg.norm_saves_output)
        self.mlp = MLP(cfg, mlp_impl, recompute_gelu=cfg.recomputes_gelu(layer))
        self.fused_add_norm = cfg.fused_add_norm  # GPT checks norm_saves_output is on too

    def forward(self, x, rope=None, cu_seqlens=None, max_seqlen=None, pending=None):
        """x + attn(ln1(x)), then + mlp(ln2(.)). With model.fused_add_norm the block returns (h, m)
        instead of h + m: the caller hands m to the next block as `pending`, whose ln1 adds it in the
        same op as it normalises (LayerNorm.add_forward), as ln2 does with the attention's output."""
        if not self.fused_add_norm:
            x = x + self.attn(self.ln1(x), rope, cu_seqlens, max_seqlen)
            return x + self.mlp(self.ln2(x))
        x, y = self.ln1.add_forward(x, pending) if pending is not None else (x, self.ln1(x))
        x, y = self.ln2.add_forward(x, self.attn(y, rope, cu_seqlens, max_seqlen))
        return x, self.mlp(y)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, device: Optional[torch.device] = None,
                 attention_dtype: torch.dtype = torch.bfloat16):
        """`device` and `attention_dtype` (what attention and the MLP compute in: the autocast
        dtype, or float32) only decide the attention backend and the MLP's implementation (auto:
        our kernels on CUDA in bf16/fp16); build on meta or CPU and move as usual."""
        super().__init__()
        self.cfg = cfg
        if cfg.fused_add_norm and not cfg.norm_saves_output:
            raise ValueError("model.fused_add_norm=true needs model.norm_saves_output=true (the fused op is the "
                             "output-keeping LayerNorm's); set both, or fused_add_norm=false")
        backend_device = torch.device(device) if device is not None else torch.device("cpu")
        self.attention_backend, reason = resolve_backend(cfg.attention, backend_device, cfg.head_dim,
                                                         attention_dtype, cfg.attention_window)
        log.info("attention backend: %s (%s)", self.attention_backend, reason)
        if cfg.attention_window > 0:
            local = [i for i in range(cfg.n_layer) if cfg.window_of(i)]
            log.info("local attention: window of %d tokens in layers %s (%s), the others dense",
                     cfg.attention_window, local, cfg.attention_window_layers)
        self.mlp_impl, reason = resolve_mlp(cfg.mlp, backend_device, attention_dtype, cfg.d_model,
                                            cfg.mlp_ratio * cfg.d_model)
        log.info("MLP: %s (%s)", self.mlp_impl, reason)
        self.wte = TiedEmbedding(cfg.vocab_size, cfg.d_model)  # nn.Embedding + an optional grad buffer
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model) if cfg.pos_emb == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, self.attention_backend, self.mlp_impl, layer)
                                    for layer in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)
        self.lm_head = LMHead(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied input/output embedding
        if cfg.pos_emb == "rope":
            cos, sin = rope_cache(cfg.seq_len, cfg.head_dim, cfg.rope_theta)
            self.register_buffer("rope_cos", cos, persistent=False)  # (T, D/2)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        """GPT-2/3 init: N(0, init_std); residual output projections scaled by 1/sqrt(2 * n_layer)."""
        std = self.cfg.init_std
        if isinstance(module, nn.Linear):
            if getattr(module, "is_residual_out", False):
                std = std / math.sqrt(2 * self.cfg.n_layer)
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # tied weights are counted once

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None,
                cu_seqlens: Optional[torch.Tensor] = None, max_seqlen: Optional[int] = None,
                position_offset: int = 0):
        """idx: (B, T) token ids. Returns the mean cross-entropy if `targets` (B, T) is given, else
        logits (B, T, vocab). `cu_seqlens` (int32, documents' start offsets in the flattened batch)
        keeps attention inside documents. `position_offset`: the position of idx's first token (a
        context-parallel rank holds tokens offset .. offset + T - 1 of each window); positions, learned
        or RoPE, start there."""
        B, T = idx.shape
        if position_offset + T > self.cfg.seq_len:
            raise ValueError(f"sequence of {T} tokens at position {position_offset} exceeds "
                             f"model.seq_len={self.cfg.seq_len}")
        x = self.wte(idx)  # (B, T, d)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(position_offset, position_offset + T, device=idx.device))
        x = self.drop(x)
        if self.cfg.residual == "autocast" and torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))  # the blocks' outputs then add in bf16
        rope = None
        if self.cfg.pos_emb == "rope":  # (T, D/2) tables of positions offset .. offset + T - 1
            rope = (self.rope_cos[position_offset:position_offset + T],
                    self.rope_sin[position_offset:position_offset + T])
        pending = None  # with fused_add_norm: the last block's MLP output, not yet added
        recompute = self.cfg.recompute_blocks and torch.is_grad_enabled()
        for block in self.blocks:
            # model.recompute_blocks: the block keeps its inputs only (the RNG state too, for dropout)
            run = partial(checkpoint, block, use_reentrant=False) if recompute else block
            if block.fused_add_norm:
                x, pending = run(x, rope, cu_seqlens, max_seqlen, pending)
            else:
                x = run(x, rope, cu_seqlens, max_seqlen)
        if pending is not None:
            x = x + pending
        return self.lm_head(self.ln_f(x), targets, self.cfg.fused_loss)  # logits (B, T, V) or loss
