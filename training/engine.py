"""Engines: the model + optimizer + schedule behind one small interface, so the trainer does not care
whether plain torch (single process / DDP) or DeepSpeed runs underneath.

    loss = engine.forward_backward(batch, sync)   # one micro-batch; returns the detached loss
    stats = engine.step()                          # clip, optimizer step, zero grads, schedule
    engine.save(dir) / engine.load(dir)           # the engine's own files inside a checkpoint folder
"""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Dict

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from training.config import Config, grad_accum_steps
from training.distributed import DistInfo
from training.optim import WarmupCosine, build_optimizer


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
        x = batch.x.to(self.device, non_blocking=True)
        y = batch.y.to(self.device, non_blocking=True)
        cu = getattr(batch, "cu_seqlens", None)
        if cu is not None:
            return x, y, cu.to(self.device, non_blocking=True), batch.max_seqlen
        return x, y


class TorchEngine(Engine):
    """Plain PyTorch: one process, or DDP across the torchrun ranks (gloo on CPU, nccl on GPU)."""

    def __init__(self, model: torch.nn.Module, cfg: Config, dist: DistInfo):
        self.cfg, self.dist, self.device = cfg, dist, dist.device
        self.model = model.to(self.device)
        self.accum = grad_accum_steps(cfg, dist.world_size)
        self.amp_dtype = autocast_dtype(cfg, self.device)
        self.optimizer = build_optimizer(self.model, cfg.optim, self.device)
        self.scheduler = WarmupCosine(self.optimizer, cfg.optim, cfg.train.max_steps)
        wrapped = self.model
        if cfg.train.compile:
            wrapped = torch.compile(wrapped)
            self.compiled = True
        if dist.enabled:
            ids = [self.device.index] if self.device.type == "cuda" else None
            wrapped = DDP(wrapped, device_ids=ids, bucket_cap_mb=cfg.engine.bucket_mb)
        self.wrapped = wrapped
        self.params = [p for p in self.model.parameters() if p.requires_grad]

    def forward_backward(self, batch, sync: bool) -> torch.Tensor:
        """One micro-batch. `sync=False` skips DDP's gradient all-reduce (all but the last
        micro-batch of an accumulation)."""
        no_sync = self.dist.enabled and not sync
        with (self.wrapped.no_sync() if no_sync else contextlib.nullcontext()):
            with self.autocast():
                loss = self.wrapped(*self._inputs(batch))
            (loss / self.accum).backward()
        return loss.detach()

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the gradients, on the device (no sync). The trainer checks it for
        non-finite values; `step` then clips with it rather than computing it a second time."""
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=self.device)
        if hasattr(norm, "full_tensor"):  # FSDP2: DTensor grads give a partial norm; reduce it
            norm = norm.full_tensor()
        self._norm = norm
        return norm

    def step(self) -> Dict[str, torch.Tensor | float]:
        clip = self.cfg.optim.grad_clip
        norm = getattr(self, "_norm", None)
        if norm is None:
            norm = self.grad_norm()
        if clip > 0:
            torch.nn.utils.clip_grads_with_norm_(self.params, clip, norm)
        self._norm = None
        lr = self.scheduler.lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return {"grad_norm": norm, "lr": lr}

    @property
    def lr(self) -> float:
        return self.scheduler.lr

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    def save(self, directory: Path) -> None:
        """DDP keeps identical replicas: rank 0 writes one copy."""
        if self.dist.is_main:
            torch.save(self.state_dict(), Path(directory) / "engine.pt")

    def load(self, directory: Path) -> None:
        state = torch.load(Path(directory) / "engine.pt", map_location=self.device, weights_only=False)
        self.load_state_dict(state)


def build_engine(model: torch.nn.Module, cfg: Config, dist: DistInfo) -> Engine:
    """engine.type=torch: DDP (or one process) / FSDP2 (engine.parallel=fsdp); deepspeed: ZeRO 0-3."""
    if cfg.engine.type == "deepspeed":
        from training.engine_deepspeed import DeepSpeedEngine

        return DeepSpeedEngine(model, cfg, dist)
    if cfg.engine.parallel == "fsdp":
        from training.engine_fsdp import FSDPEngine

        return FSDPEngine(model, cfg, dist)
    return TorchEngine(model, cfg, dist)
