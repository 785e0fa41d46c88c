"""FSDP2 engine: parameters, gradients and optimizer state sharded across ranks with `fully_shard`,
checkpoints through torch.distributed.checkpoint (DCP), which reshards on load, so a run saved on
4 ranks resumes on 2.

Parallelism is applied from outside the model, in a fixed order (as torchtitan does): compile each
block (optional), shard each block, then the root (embeddings, final norm, tied head).
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from training.compile.options import prepare_compile
from training.config import Config, grad_accum_steps
from training.distributed import DistInfo, ensure_process_group
from training.engines.base import autocast_dtype
from training.engines.replicas import TorchEngine
from training.optim import WarmupCosine, build_optimizer
from training.resilience.checkpoint import load_data


class FSDPEngine(TorchEngine):
    def __init__(self, model: torch.nn.Module, cfg: Config, dist: DistInfo):
        self.cfg, self.dist, self.device = cfg, dist, dist.device
        ensure_process_group(dist, cfg.engine.backend)  # fully_shard needs a group, even of one
        self.accum = grad_accum_steps(cfg, dist.world_size)
        self.amp_dtype = autocast_dtype(cfg, self.device)
        model = model.to(self.device)
        # bf16 all-gathers and compute, fp32 gradient reduction (the usual FSDP2 recipe). The blocks' inputs
        # pass uncast, as under DDP (autocast casts each op's inputs): the RoPE tables stay fp32, and a block
        # recomputed in the backward (model.recompute_blocks) sees the dtypes its forward saw; torch 2.11's
        # FSDP2 casts a forward's inputs but not a recomputation's.
        mp = MixedPrecisionPolicy(param_dtype=self.amp_dtype, reduce_dtype=torch.float32,
                                  cast_forward_inputs=False) if self.amp_dtype is not None else MixedPrecisionPolicy()
        options = (prepare_compile(cfg.train) or None) if cfg.train.compile else None
        for block in model.blocks:
            if cfg.train.compile:
                block.compile(options=options)
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        self.compiled = bool(cfg.train.compile)  # per block: FSDP2 all-gathers stay between graphs
        self.model = self.wrapped = model
        self.optimizer = build_optimizer(model, cfg.optim, self.device)
        self.scheduler = WarmupCosine(self.optimizer, cfg.optim, cfg.train.max_steps)
        self.params = [p for p in model.parameters() if p.requires_grad]

    def _no_sync(self, sync: bool):
        # FSDP2: skip the reduce-scatter for all but the last micro-batch of an accumulation
        self.model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()

    def forward_backward(self, batch, sync: bool) -> torch.Tensor:
        self._no_sync(sync)
        with self.autocast():
            loss = self.model(*self._inputs(batch))
        (loss / self.accum).backward()
        return loss.detach()

    def save(self, directory: Path) -> None:
        """Collective: every rank writes its shards into <directory>/dcp/."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(Path(directory) / "dcp"))
        if self.dist.is_main:
            torch.save({"scheduler": self.scheduler.state_dict()}, Path(directory) / "schedule.pt")

    def load(self, directory: Path) -> None:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optimizer": optim_sd}
        dcp.load(state, checkpoint_id=str(Path(directory) / "dcp"))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        sched = load_data(Path(directory) / "schedule.pt")
        self.scheduler.load_state_dict(sched["scheduler"])
