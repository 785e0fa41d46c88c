"""DeepSpeed engine (ZeRO 0-3, bf16, accumulation, clipping, overlapped reduction) behind our Engine
interface. Started by torchrun or by the `deepspeed` launcher; the model code never imports deepspeed.

DeepSpeed counts micro-steps itself: `engine.step()` must be called after every backward, and only
the call at an accumulation boundary updates the weights. We call it for the non-final micro-batches
inside `forward_backward` and for the final one in `step`.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Dict

import torch

from training.compile.options import prepare_compile
from training.config import Config
from training.distributed import DistInfo, ensure_process_group
from training.engines.base import Engine, autocast_dtype
from training.engines.deepspeed_config import deepspeed_config
from training.optim import WarmupCosine, build_optimizer, param_groups
from training.resilience.checkpoint import load_data

TAG = "deepspeed"  # sub-folder of our checkpoint folder holding DeepSpeed's own files
UNIVERSAL_TAG = "deepspeed_universal"  # its conversion to a universal checkpoint (made on demand)


def saved_shard_count(ds_dir: Path) -> int:
    """Data-parallel ranks a DeepSpeed checkpoint was sharded over (0: no optimizer shards)."""
    return len(list(ds_dir.glob("*zero_pp_rank_*_optim_states.pt")))


def convert_to_universal(ds_dir: Path, out_dir: Path) -> None:
    """DeepSpeed's ds_to_universal, in-process; written to a temporary folder renamed at the end so
    a crash never leaves a half-converted checkpoint that looks complete."""
    import argparse
    import shutil

    from deepspeed.checkpoint import ds_to_universal

    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    args = argparse.Namespace(input_folder=str(ds_dir), output_folder=str(tmp), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True,
                              inject_missing_state=True)
    ds_to_universal.main(args)
    tmp.rename(out_dir)


def repair_universal_load(optimizer: torch.optim.Optimizer, hyper: list) -> None:
    """Undo three side effects of deepspeed 0.19's universal-checkpoint load (harmless where they do
    not occur):
    - it copies param group 0's hyperparameters onto every group (the no-decay group got weight
      decay): `hyper` holds each group's own, taken before the load (lr follows our schedule);
    - it gives every group's state one shared `step` tensor, which torch's Adam then increments once
      per group per step (the second group's bias correction ran a step ahead; ZeRO-3's resumed
      curve drifted by 5e-4 in three steps): one tensor each;
    - that tensor is on the CPU, where the fused and capturable Adam kernels refuse it ("state_steps
      is on cpu", seen resuming ZeRO-2 and -3 from 2 GPUs onto 1): it goes where torch's own Adam
      keeps it -- beside the parameter for fused / capturable groups, else on the CPU -- as float32."""
    for group, h in zip(optimizer.param_groups, hyper):
        group.update(h)
    # Every state, not only those of the groups' current params: ZeRO-3 swaps its sub-group partitions
    # in and out of param_groups, so the lists hold one tensor per group while the state has them all.
    on_param_device = any(g.get("fused") or g.get("capturable") for g in optimizer.param_groups)
    for p, state in optimizer.state.items():
        step = state.get("step")
        if torch.is_tensor(step):
            device = p.device if on_param_device else torch.device("cpu")
            state["step"] = torch.full((), float(step), dtype=torch.float32, device=device)


def restore_fp32_master(module: torch.nn.Module, optimizer, init: Dict[str, torch.Tensor]) -> int:
    """Give DeepSpeed's fp32 master copy the model's fp32 initialisation; returns how many parameters
    it set (all of them with ZeRO 0-3 in bf16).

    DeepSpeed's bf16 mode casts the model to bf16 first and builds its fp32 master from those bf16
    weights, so every master value starts exactly on the bf16 grid: the warm-up steps' updates (lr
    ~1e-6 against a bf16 step of ~1e-4 at |w| ~ 0.02) then leave every bf16 weight unchanged until
    they add up to half a step, and the loss curve lags DDP's and FSDP2's, whose fp32 weights start
    off the grid (measured: 1.3B-8k step 2 11.195 vs 11.018 on GPUs; 125M on CPU in bf16 too).
    `init`: name -> fp32 value, taken before deepspeed.initialize."""
    from deepspeed.utils import safe_set_full_fp32_param

    named = list(module.named_parameters())
    done = set()
    for name, p in named:  # ZeRO-3 partitions, ZeRO-1/2 and BF16_Optimizer fragments
        if hasattr(p, "ds_id") or hasattr(p, "_hp_mapping"):
            safe_set_full_fp32_param(p, init[name].to(p.device))
            done.add(name)
    # ZeRO-0 in bf16 (FP16_UnfusedOptimizer): fp32 copies in fp32_groups, parallel to fp16_groups
    by_id = {id(p): name for name, p in named}
    for low, high in zip(getattr(optimizer, "fp16_groups", []), getattr(optimizer, "fp32_groups", [])):
        for lo, hi in zip(low, high):
            name = by_id.get(id(lo))
            if name is not None and name not in done:
                hi.data.copy_(init[name].to(hi.device))
                done.add(name)
    return len(done)


class DeepSpeedEngine(Engine):
    def __init__(self, model: torch.nn.Module, cfg: Config, dist: DistInfo):
        import deepspeed

        self.cfg, self.dist, self.device = cfg, dist, dist.device
        # ZeRO 1-3 save optimizer (and, at 3, parameter) shards per data-parallel rank; on another
        # rank count, load() converts the checkpoint once to DeepSpeed's universal checkpoint and
        # loads that, then repairs three side effects of that load (repair_universal_load). The CPU
        # tests check the curve continues as the uninterrupted run's for ZeRO-1, -2 and -3.
        ensure_process_group(dist, cfg.engine.backend)
        self.ds_config = deepspeed_config(cfg, dist.world_size, self.device)
        self.amp_dtype = None  # DeepSpeed's bf16 mode holds bf16 weights itself; no autocast on top
        self._bf16 = autocast_dtype(cfg, self.device) is not None
        model = model.to(self.device)
        # the fp32 initialisation, for DeepSpeed's master copy (restore_fp32_master); host memory,
        # released once handed over
        init = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()} if self._bf16 else None
        if cfg.engine.ds_optimizer == "ours":
            kwargs = {"optimizer": build_optimizer(model, cfg.optim, self.device)}
        else:
            kwargs = {"model_parameters": param_groups(model, cfg.optim.weight_decay)}
        self.ds, self.optimizer, _, _ = deepspeed.initialize(model=model, config=self.ds_config, **kwargs)
        self.model = self.ds.module
        if init is not None:
            if restore_fp32_master(self.model, self.optimizer, init) < len(init):
                logging.getLogger(__name__).warning(
                    "DeepSpeed's fp32 master copy starts from the bf16-rounded weights for some parameters "
                    "(optimizer %s): early warm-up updates may not move them", type(self.optimizer).__name__)
            del init
        if cfg.train.compile:  # DeepSpeed's own entry: compiles the module inside its ZeRO hooks
            options = prepare_compile(cfg.train)
            self.ds.compile(compile_kwargs={"options": options} if options else {})
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

    def _to_universal(self, directory: Path, saved: int) -> str:
        """Rank 0 converts <directory>/deepspeed (sharded over `saved` ranks) into
        <directory>/deepspeed_universal; every rank then loads that. Returns the tag to load. The
        conversion is rebuilt at each such resume from the shards the manifest just verified (the
        manifest does not cover it: training/resilience/manifest.py DERIVED), so no file added later is loaded."""
        import shutil

        import torch.distributed as tdist

        out = directory / UNIVERSAL_TAG
        if self.dist.is_main:
            logging.getLogger(__name__).warning(
                "ZeRO checkpoint %s was sharded over %d ranks, this run has %d: converting it to a "
                "DeepSpeed universal checkpoint (%s)", directory, saved, self.dist.world_size, out)
            shutil.rmtree(out, ignore_errors=True)
            convert_to_universal(directory / TAG, out)
        if tdist.is_available() and tdist.is_initialized():
            tdist.barrier()
        return UNIVERSAL_TAG

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
        saved = saved_shard_count(Path(directory) / TAG)
        if saved and saved != self.dist.world_size:
            tag = self._to_universal(Path(directory), saved)
            inner = getattr(self.ds.optimizer, "optimizer", self.ds.optimizer)  # the torch optimizer
            ours = [{k: v for k, v in g.items() if k not in ("params", "lr")} for g in inner.param_groups]
            self.ds._config.load_universal_checkpoint = True  # read by load_checkpoint only
            try:
                path, _ = self.ds.load_checkpoint(str(directory), tag=tag, load_lr_scheduler_states=False)
            finally:
                self.ds._config.load_universal_checkpoint = False
            repair_universal_load(inner, ours)
        else:
            path, _ = self.ds.load_checkpoint(str(directory), tag=TAG, load_lr_scheduler_states=False)
        if path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint under {directory}/{TAG}")
        state = load_data(Path(directory) / "schedule.pt")
        self.scheduler.load_state_dict(state["scheduler"])
