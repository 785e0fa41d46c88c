"""The plain PyTorch engine (`TorchEngine`): one process, or replicas across the torchrun ranks, and the
choices it makes from the config (gradient sync, weight cache, fp32 weight gradients). The interface is
in training/engines/base.py; training/engines/factory.py picks the engine a config asks for.
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Dict

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from training.compile.options import prepare_compile
from training.config import Config, grad_accum_steps
from training.distributed import DistInfo
from training.engines.base import Engine, autocast_dtype
from training.engines.grad_allreduce import all_reduce_grads, broadcast_from_rank0, grad_sync_choice
from training.engines.weight_cache import setup as setup_weight_cache
from training.optim import WarmupCosine, build_optimizer, clip_scale, clips_in_step
from training.resilience.checkpoint import load_data

log = logging.getLogger(__name__)




class TorchEngine(Engine):
    """Plain PyTorch: one process, or replicas across the torchrun ranks (gloo on CPU, nccl on GPU) whose
    gradients DDP reduces during the backward or `all_reduce_grads` after it (engine.grad_sync)."""

    _clips_in_step = None  # whether clipping rides in the fused optimizer step (set on the first step)
    weight_cache = None  # WeightCache when in use (autocast; one process or after/during_backward): weight_cache.py
    grad_sync = None  # with several ranks: "ddp", "after_backward" or "during_backward" (grad_sync_choice)
    _told_early = False

    def __init__(self, model: torch.nn.Module, cfg: Config, dist: DistInfo):
        self.cfg, self.dist, self.device = cfg, dist, dist.device
        self.model = model.to(self.device)
        self.accum = grad_accum_steps(cfg, dist.world_size)
        self.amp_dtype = autocast_dtype(cfg, self.device)
        self.optimizer = build_optimizer(self.model, cfg.optim, self.device)
        self.scheduler = WarmupCosine(self.optimizer, cfg.optim, cfg.train.max_steps)
        wrapped = self.model
        options = (prepare_compile(cfg.train) or None) if cfg.train.compile else None
        if cfg.train.compile:
            wrapped = torch.compile(wrapped, options=options)
            self.compiled = True
        self.grad_sync = grad_sync_choice(cfg, dist, self.amp_dtype)[0] if dist.enabled else None
        if self.grad_sync == "ddp":
            ids = [self.device.index] if self.device.type == "cuda" else None
            wrapped = DDP(wrapped, device_ids=ids, bucket_cap_mb=cfg.engine.bucket_mb)
        elif self.grad_sync is not None:
            broadcast_from_rank0(self.model)  # the replicas start equal, as DDP makes them
        self.wrapped = wrapped
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # low-precision weight cache, fp32 weight-gradient GEMMs, early reduction (training/engines/weight_cache.py)
        self.weight_cache, self.cached_forward, self.reducer = setup_weight_cache(
            self.model, cfg, dist, self.amp_dtype, self.grad_sync, options)

    def forward_backward(self, batch, sync: bool) -> torch.Tensor:
        """One micro-batch. `sync=False` skips DDP's gradient all-reduce (all but the last
        micro-batch of an accumulation)."""
        no_sync = self.grad_sync == "ddp" and not sync
        summed = self.grad_sync in ("after_backward", "during_backward")
        # the ranks' gradients are summed: each rank's share of the mean is 1 / world_size
        scale = self.accum * (self.dist.world_size if summed else 1)
        early = self.reducer is not None and sync
        with (self.wrapped.no_sync() if no_sync else contextlib.nullcontext()):
            with self.autocast():
                if self.weight_cache is not None:
                    loss = self.cached_forward(self.weight_cache.tensors(), *self._inputs(batch))
                else:
                    loss = self.wrapped(*self._inputs(batch))
            with (self.reducer.armed() if early else contextlib.nullcontext()):
                (loss / scale).backward()
        if early:
            n = self.reducer.finish(self.params)
            if not self._told_early:  # once: how much of the reduction overlapped the backward
                self._told_early = True
                log.info(f"engine.grad_sync=during_backward: {n} of {len(self.params)} gradients (the "
                         f"weight-gradient GEMMs' fp32 ones) all-reduced during the backward, the rest after")
        elif sync and summed:
            all_reduce_grads(self.params)
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
        if self._clips_in_step is None:
            self._clips_in_step = clips_in_step(self.optimizer, self.params)
        if clip > 0 and self._clips_in_step:
            self.optimizer.grad_scale = clip_scale(norm, clip)  # fused AdamW divides as it reads
        elif clip > 0:
            torch.nn.utils.clip_grads_with_norm_(self.params, clip, norm)
        self._norm = None
        lr = self.scheduler.lr
        try:
            self.optimizer.step()
        finally:
            self.optimizer.grad_scale = None  # a later step without the fold must not divide
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if self.weight_cache is not None:
            self.weight_cache.invalidate()
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
        if self.weight_cache is not None:
            self.weight_cache.invalidate()

    def save(self, directory: Path) -> None:
        """DDP keeps identical replicas: rank 0 writes one copy."""
        if self.dist.is_main:
            torch.save(self.state_dict(), Path(directory) / "engine.pt")

    def load(self, directory: Path) -> None:
        state = load_data(Path(directory) / "engine.pt", map_location=self.device)
        self.load_state_dict(state)

