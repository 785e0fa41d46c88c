"""The plain PyTorch engine (`TorchEngine`): one process, or replicas across the torchrun ranks, and the
choices it makes from the config (gradient sync, weight cache, fp32 weight gradients). The interface is
in training/engine_base.py; training/engine_factory.py picks the engine a config asks for.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import os
from pathlib import Path
from typing import Dict

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from training.checkpoint import load_data
from training.config import Config, grad_accum_steps
from training.distributed import DistInfo
from training.engine_base import Engine, autocast_dtype
from training.grad_allreduce import ReduceAsWritten, all_reduce_grads, broadcast_from_rank0
from training.compile_options import prepare_compile
from training.optim import WarmupCosine, build_optimizer, clip_scale, clips_in_step
from training.weight_cache import WeightCache

log = logging.getLogger(__name__)


def weight_cache_choice(cfg: Config, dist: DistInfo, amp_dtype) -> tuple:
    """(use the low-precision weight cache?, why) for the plain torch engine."""
    if cfg.engine.weight_cache == "disabled":
        return False, "engine.weight_cache=disabled"
    if amp_dtype is None:
        return False, "no autocast (fp32 run): nothing to cast"
    if dist.enabled and grad_sync_choice(cfg, dist, amp_dtype)[0] == "ddp":
        # DDP's hooks sit on the parameters' AccumulateGrad, which the cache's copies bypass
        return False, "engine.grad_sync=ddp: DDP reduces the gradients from the fp32 parameters' own hooks"
    return True, f"matmul weights cast to {str(amp_dtype).split('.')[-1]} once per optimizer step"


def grad_sync_choice(cfg: Config, dist: DistInfo, amp_dtype) -> tuple:
    """(how the replicated torch engine reduces gradients over ranks, why): "ddp" (torch DDP, overlapped
    with the backward) or "after_backward" (training/grad_allreduce.py: after the last micro-batch, which
    lets the weight cache and the fp32 weight-gradient GEMMs run), or "during_backward" (the same, each
    fp32 weight gradient's all-reduce started as its GEMM writes it in the last micro-batch). auto:
    during_backward when the cache applies and all ranks are on one node (2 H100s, 1.3B-8k: 672 vs 666
    TFLOP/s per GPU after the backward, bench/RESULTS.md); DDP across nodes, whose slower
    links need DDP's bucketed overlap."""
    choice = cfg.engine.grad_sync
    if choice != "auto":
        return choice, f"engine.grad_sync={choice}"
    if cfg.engine.weight_cache == "disabled" or amp_dtype is None:
        return "ddp", "auto: no weight cache to keep (fp32 run, or engine.weight_cache=disabled)"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", -1)))
    if local != dist.world_size:
        return "ddp", (f"auto: {dist.world_size} ranks over several nodes (or a launcher that does not say"
                       f" LOCAL_WORLD_SIZE): DDP overlaps the slower all-reduce with the backward")
    return "during_backward", (f"auto: one node of {dist.world_size} ranks: each fp32 weight gradient summed "
                               f"as the last micro-batch's backward writes it, so the weight cache and fp32 "
                               f"weight-gradient GEMMs stay on")


def wgrad_fp32_choice(cfg: Config, device: torch.device) -> tuple:
    """(weight-gradient GEMMs accumulate into the fp32 .grad?, why), given that the weight cache is on."""
    choice = cfg.engine.wgrad_fp32
    if choice != "auto":
        return choice == "enabled", f"engine.wgrad_fp32={choice}"
    if device.type != "cuda":
        return False, f"auto: on {device.type} the bf16 gradients fold as before"
    import kernels

    if not kernels.is_available():
        return False, f"auto: our CUDA extension is unavailable ({kernels.unavailable_reason()})"
    return True, "weight gradients accumulate in fp32 inside their GEMMs (kernels/wgrad.py)"


def functional_forward(model: torch.nn.Module):
    """model(*inputs) with some parameters replaced by the given tensors (the weight cache)."""
    def run(params, *inputs):
        return torch.func.functional_call(model, params, inputs)
    return run


class TorchEngine(Engine):
    """Plain PyTorch: one process, or replicas across the torchrun ranks (gloo on CPU, nccl on GPU) whose
    gradients DDP reduces during the backward or `all_reduce_grads` after it (engine.grad_sync)."""

    _clips_in_step = None  # whether clipping rides in the fused optimizer step (set on the first step)
    weight_cache = None  # WeightCache when in use (autocast; one process or after/during_backward): training/weight_cache.py
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
        use_cache, _ = weight_cache_choice(cfg, dist, self.amp_dtype)
        if use_cache:
            fp32_wgrad, _ = wgrad_fp32_choice(cfg, self.device)
            self.weight_cache = WeightCache(self.model, self.amp_dtype, fp32_wgrad)
            run = functional_forward(self.model)
            self.cached_forward = torch.compile(run, options=options) if cfg.train.compile else run
        self.reducer = None  # during_backward: the weights whose fp32 gradient a GEMM writes, once each
        if self.grad_sync == "during_backward":
            written = [m for _, m in self.weight_cache.accumulated] if self.weight_cache is not None else []
            times = collections.Counter(id(m) for m in written)  # the tied weight has two writers: not early
            self.reducer = ReduceAsWritten(m for m in written if times[id(m)] == 1)

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

