"""DeepSpeed-Ulysses context parallelism around the model's own attention (Jacobs et al. 2023,
arXiv:2309.14509), built on DeepSpeed's exchange operator `deepspeed::dim_zero_all_to_all`
(deepspeed.sequence.layer, the one DeepSpeed's own Ulysses for compiled models uses).

A context group of C ranks; group rank r holds tokens [r*T/C, (r+1)*T/C) of every sequence. Per
attention call, on each rank:
  q (B, T/C, H, D), k/v (B, T/C, Hkv, D)      this rank's slice, all heads (positions applied)
  -- all-to-all: scatter heads, gather sequence -->
  q (B, T, H/C, D), k/v (B, T, Hkv/C, D)      the full sequence, heads [r*H/C, (r+1)*H/C)
  local(q, k, v) -> (B, T, H/C, D)            the module's own attention (our kernel, SDPA, ...), causal
  -- all-to-all: scatter sequence, gather heads -->
  y (B, T/C, H, D)
Under grouped-query attention query head h uses kv head h // (H/Hkv); rank r's query heads
[r*H/C, (r+1)*H/C) use exactly its kv heads [r*Hkv/C, (r+1)*Hkv/C), so H and Hkv must both divide by C.
Communication volume per layer: 4 all-to-alls of B*T*d/C elements per rank forward (q, k, v, y; k and v
smaller under GQA) and 4 backward.

Each exchange is one call of DeepSpeed's operator on a (C, ...) tensor whose chunk i goes to group rank i;
its declared backward is the same exchange of the gradient. It is an operator, not an autograd function
around an all-to-all into a fresh buffer (DeepSpeed's `DistributedAttention`): torch.compile inlines such a
function's body, and with torch 2.11 the traced graph's output then does not depend on its input, so the
forward stays right while every gradient upstream of the attention (q/k/v projections, the LayerNorm
before them) is zero (tests/training/test_context_parallel_ulysses.py compiles the attention and compares
those gradients).
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

Local = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

HEAD_DIM = 2  # q/k/v/y are (B, T, H, D)


def _divisible_choices(n_head: int, n_kv_head: int) -> str:
    g = math.gcd(n_head, n_kv_head)
    return ", ".join(str(c) for c in range(1, g + 1) if g % c == 0)


def check_heads(n_head: int, n_kv_head: int, size: int) -> None:
    """ValueError unless both head counts divide by the context-parallel size (Ulysses gives each rank
    H/C query heads and the Hkv/C kv heads they use)."""
    if n_head % size or n_kv_head % size:
        raise ValueError(
            f"context parallelism over {size} ranks needs the attention heads divisible by {size}, but the "
            f"model has {n_head} query heads and {n_kv_head} kv heads; set engine.context_parallel_size to one "
            f"of {_divisible_choices(n_head, n_kv_head)} (or change model.n_head / model.n_kv_head)")


def _ensure_deepspeed_comm() -> None:
    """DeepSpeed's collectives run through deepspeed.comm, which wraps the torch process group once it
    knows of it (a no-op when a DeepSpeed engine already did this)."""
    import deepspeed.comm as dsc

    if not dsc.is_initialized():
        dsc.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False, verbose=False)


def _exchange(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """DeepSpeed's all-to-all over dim 0 (size C): chunk i goes to group rank i, chunk j of the result came
    from group rank j; differentiable (its backward is the same exchange)."""
    return torch.ops.deepspeed.dim_zero_all_to_all(x.contiguous(), group_name)


def heads_to_sequence(x: torch.Tensor, size: int, group_name: str) -> torch.Tensor:
    """(B, T/C, h, D) this rank's slice, all heads -> (B, T, h/C, D) the whole sequence, this rank's heads."""
    B, Tc, h, D = x.shape
    x = x.view(B, Tc, size, h // size, D).permute(2, 0, 1, 3, 4)  # (C, B, T/C, h/C, D): chunk i to rank i
    x = _exchange(x, group_name)  # chunk j: rank j's slice of the sequence, our heads
    return x.permute(1, 0, 2, 3, 4).reshape(B, size * Tc, h // size, D)


def sequence_to_heads(y: torch.Tensor, size: int, group_name: str) -> torch.Tensor:
    """(B, T, h/C, D) the whole sequence, this rank's heads -> (B, T/C, h, D) this rank's slice, all heads."""
    B, T, hc, D = y.shape
    y = y.view(B, size, T // size, hc, D).permute(1, 0, 2, 3, 4)  # (C, B, T/C, h/C, D): slice i to rank i
    y = _exchange(y, group_name)  # chunk j: our slice, rank j's heads
    return y.permute(1, 2, 0, 3, 4).reshape(B, T // size, size * hc, D)


class UlyssesAttention:
    """cp(q, k, v, local) -> y over the context group `group` (see the module docstring). Not an
    nn.Module: set on every attention module, it must add no parameters, buffers or submodules."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None):
        if not dist.is_initialized():
            raise ValueError("UlyssesAttention needs torch.distributed initialised (the context group's ranks)")
        _ensure_deepspeed_comm()
        from deepspeed.sequence.layer import register_all_to_all_group  # registers the operator too

        self.group = group if group is not None else dist.group.WORLD
        self.size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)  # this rank's slice of each window
        # the operator finds the group by name; registered here, outside any compiled region
        self.group_name = register_all_to_all_group(self.group)

    def __repr__(self) -> str:
        return f"UlyssesAttention(size={self.size}, rank={self.rank})"

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, local: Local) -> torch.Tensor:
        check_heads(q.shape[HEAD_DIM], k.shape[HEAD_DIM], self.size)
        if self.size == 1:
            return local(q, k, v)
        q, k, v = (heads_to_sequence(t, self.size, self.group_name) for t in (q, k, v))
        return sequence_to_heads(local(q, k, v), self.size, self.group_name)


def _attention_modules(model: nn.Module):
    from model.attention import CausalSelfAttention

    return [m for m in model.modules() if isinstance(m, CausalSelfAttention)]


def attach(model: nn.Module, group: Optional[dist.ProcessGroup] = None) -> UlyssesAttention:
    """Route every attention module of `model` (bare, or inside DDP / FSDP / DeepSpeed / compile wrappers)
    through one UlyssesAttention over `group`; returns it. Checks the head counts first (ValueError)."""
    mods = _attention_modules(model)
    if not mods:
        raise ValueError(f"context parallelism: no attention module (model.attention.CausalSelfAttention) "
                         f"found in {type(model).__name__}")
    size = dist.get_world_size(group if group is not None else dist.group.WORLD) if dist.is_initialized() else 1
    for m in mods:
        check_heads(m.n_head, m.n_kv_head, size)
    cp = UlyssesAttention(group)
    for m in mods:
        m.context_parallel = cp
    return cp


def detach(model: nn.Module) -> None:
    """Back to single-device attention on every attention module of `model`."""
    for m in _attention_modules(model):
        m.context_parallel = None
