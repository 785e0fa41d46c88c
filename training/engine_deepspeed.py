"""DeepSpeed engine (ZeRO 0-3, bf16, accumulation, clipping, overlapped reduction) behind our Engine
interface. Started by torchrun or by the `deepspeed` launcher; the model code never imports deepspeed.

DeepSpeed counts micro-steps itself: `engine.step()` must be called after every backward, and only
the call at an accumulation boundary updates the weights. We call it for the non-final micro-batches
inside `forward_backward` and for the final one in `step`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict

import torch

from training.config import Config
from training.deepspeed_config import deepspeed_config
from training.distributed import DistInfo, ensure_process_group
from training.engine import Engine, autocast_dtype
from training.optim import WarmupCosine, build_optimizer, param_groups

TAG = "deepspeed"  # sub-folder of our checkpoint folder holding DeepSpeed's own files


class DeepSpeedEngine(Engine):
    def __init__(self, model: torch.nn.Module, cfg: Config, dist: DistInfo):
        import deepspeed

        self.cfg, self.dist, self.device = cfg, dist, dist.device
        # ZeRO 1-3 save optimizer (and, at 3, parameter) shards per data-parallel rank.
        self.reshardable = cfg.engine.zero_stage == 0
        self.reshard_hint = (
            f"resume on the number of GPUs it was saved with; ZeRO stage {cfg.engine.zero_stage} keeps "
            "optimizer shards per rank, and DeepSpeed's universal-checkpoint conversion "
            "(deepspeed.checkpoint.ds_to_universal) is not wired into this trainer yet. DDP, FSDP2 and "
            "ZeRO-0 checkpoints reshard")
        ensure_process_group(dist, cfg.engine.backend)
        self.ds_config = deepspeed_config(cfg, dist.world_size, self.device)
        self.amp_dtype = None  # DeepSpeed's bf16 mode holds bf16 weights itself; no autocast on top
        self._bf16 = autocast_dtype(cfg, self.device) is not None
        model = model.to(self.device)
        if cfg.engine.ds_optimizer == "ours":
            kwargs = {"optimizer": build_optimizer(model, cfg.optim, self.device)}
        else:
            kwargs = {"model_parameters": param_groups(model, cfg.optim.weight_decay)}
        self.ds, self.optimizer, _, _ = deepspeed.initialize(model=model, config=self.ds_config, **kwargs)
        self.model = self.ds.module
        if cfg.train.compile:  # DeepSpeed's own entry: compiles the module inside its ZeRO hooks
            self.ds.compile()
            self.compiled = True
        self.scheduler = WarmupCosine(self.optimizer, cfg.optim, cfg.train.max_steps)
        if dist.is_main:
            run_dir = Path(cfg.train.out_dir) / cfg.train.run_name
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "deepspeed_config.json").write_text(json.dumps(self.ds_config, indent=2) + "\n")

    def forward_backward(self, batch, sync: bool) -> torch.Tensor:
        loss = self.ds(*self._inputs(batch))
        self.ds.backward(loss)  # scales by 1/accumulation itself
        if not sync:
            self.ds.step()  # not a boundary: bookkeeping only, no weight update
        return loss.detach()

    def step(self) -> Dict[str, torch.Tensor | float]:
        lr = self.scheduler.lr
        self.ds.step()  # boundary: reduce (ZeRO), clip, optimizer step, zero grads
        self.scheduler.step()
        norm = self.ds.get_global_grad_norm()
        if norm is None:
            norm = float("nan")
        return {"grad_norm": norm, "lr": lr}

    @property
    def lr(self) -> float:
        return self.scheduler.lr

    @torch.no_grad()
    def eval_loss(self, batch) -> torch.Tensor:
        return self.ds(*self._inputs(batch)).detach()

    def save(self, directory: Path) -> None:
        """Collective: every rank writes its ZeRO shard under <directory>/deepspeed/."""
        self.ds.save_checkpoint(str(directory), tag=TAG, save_latest=False)
        if self.dist.is_main:
            torch.save({"scheduler": self.scheduler.state_dict()}, Path(directory) / "schedule.pt")

    def load(self, directory: Path) -> None:
        path, _ = self.ds.load_checkpoint(str(directory), tag=TAG, load_lr_scheduler_states=False)
        if path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint under {directory}/{TAG}")
        state = torch.load(Path(directory) / "schedule.pt", map_location="cpu", weights_only=False)
        self.scheduler.load_state_dict(state["scheduler"])
