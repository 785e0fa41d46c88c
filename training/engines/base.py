"""Engines: the model + optimizer + schedule behind one small interface, so the trainer does not care
whether plain torch (single process / DDP), FSDP2 or DeepSpeed runs underneath.

    loss = engine.forward_backward(batch, sync)   # one micro-batch; returns the detached loss
    stats = engine.step()                          # clip, optimizer step, zero grads, schedule
    engine.save(dir) / engine.load(dir)           # the engine's own files inside a checkpoint folder

This module is the interface and what every engine shares; each engine imports it and no other engine
but the one it extends (replicas.py: TorchEngine; fsdp.py extends it; deepspeed.py). factory.py picks one
from the config.
"""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Dict

import torch

from training.config import Config


def autocast_dtype(cfg: Config, device: torch.device):
    """bf16 autocast on CUDA by default; fp32 on CPU unless asked (CPU bf16 is slow and lossy)."""
    if cfg.train.dtype == "bf16" or (cfg.train.dtype == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


class Engine(ABC):
    model: torch.nn.Module  # the bare model (no wrapper), for evaluation and counting
    compiled = False  # train.compile took effect (shown in the run banner)

    @abstractmethod
    def forward_backward(self, batch, sync: bool) -> torch.Tensor: ...

    @abstractmethod
    def step(self) -> Dict[str, torch.Tensor | float]: ...

    @abstractmethod
    def save(self, directory: Path) -> None: ...

    @abstractmethod
    def load(self, directory: Path) -> None: ...

    @property
    @abstractmethod
    def lr(self) -> float: ...

    def autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    @torch.no_grad()
    def eval_loss(self, batch) -> torch.Tensor:
        with self.autocast():
            return self.model(*self._inputs(batch)).detach()

    def _inputs(self, batch):
        """The model's positional arguments: (x, y[, cu_seqlens, max_seqlen[, position_offset]]); a
        context rank's slice (training/context_parallel/slicing.py) starts at position_offset."""
        x = batch.x.to(self.device, non_blocking=True)
        y = batch.y.to(self.device, non_blocking=True)
        cu = getattr(batch, "cu_seqlens", None)
        offset = getattr(batch, "position_offset", 0)
        if cu is not None:
            cu = cu.to(self.device, non_blocking=True)
        if offset:
            return x, y, cu, batch.max_seqlen, offset
        if cu is not None:
            return x, y, cu, batch.max_seqlen
        return x, y
