"""A once-per-run check that the attention's backward ran.

After the first step's backward, the q/k/v projection weight of every attention layer must hold a
gradient with a nonzero element: that gradient is dense (every token and head of the step contributes to
every element), so all zeros means the attention's backward did not run. That is what a gradient lost in
a compiled graph looks like (an all-to-all or a custom op whose derivative the tracer dropped,
training/context_parallel/ulysses.py): the forward and the loss stay right, the loss even falls, and those
weights never train. One device sync, once per process.
"""
from __future__ import annotations

from typing import List

import torch.nn as nn


class GradientLostError(RuntimeError):
    """The first step's backward left an attention layer's q/k/v weight without gradient."""


def _clean(name: str) -> str:
    """A module name without the wrappers' prefixes (DDP's module., torch.compile's _orig_mod.)."""
    return ".".join(p for p in name.split(".") if p not in ("module", "_orig_mod"))


def attention_weights_without_gradient(model: nn.Module) -> List[str]:
    """Names of the attention q/k/v weights of `model` (bare or wrapped) whose gradient is missing or all
    zeros on this rank; a sharded gradient counts its local shard, an empty shard passes."""
    from model.attention import CausalSelfAttention

    out = []
    for name, module in model.named_modules():
        if not isinstance(module, CausalSelfAttention):
            continue
        p = module.qkv.weight
        if not p.requires_grad:
            continue
        g = p.grad
        if g is not None and hasattr(g, "to_local"):  # FSDP2's DTensor: this rank's rows
            g = g.to_local()
        if g is not None and g.numel() == 0:
            continue
        if g is None or not bool(g.any()):
            out.append(_clean(f"{name}.qkv.weight"))
    return out


def lost_gradient_message(names: List[str]) -> str:
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (f"the first step's gradient of {shown} is zero in every element: the attention's backward did "
            f"not run, so these weights would never train (the loss still falls through the other layers). "
            f"Stopped before the optimizer step. Report it with the torch and deepspeed versions and the "
            f"config; train.compile=false runs the attention outside a compiled graph")
