"""The DeepSpeed config, generated from ours: one source of truth, saved with the run.

Batch arithmetic (DeepSpeed checks it): train_batch_size = micro_batch × accumulation × ranks
(= global_batch_size × engine.context_parallel_size).
"""
from __future__ import annotations

from training.config import Config, grad_accum_steps
from training.engines.base import autocast_dtype


def deepspeed_config(cfg: Config, world_size: int, device) -> dict:
    e, t, o = cfg.engine, cfg.train, cfg.optim
    bucket = int(e.bucket_mb * 1e6)  # elements per reduction bucket (DeepSpeed counts elements)
    ds = {
        # DeepSpeed's data-parallel group is every rank: with context parallelism (C ranks sharing each
        # sequence) its arithmetic counts each sequence C times; its all-reduce mean over all ranks is
        # then the mean over the sequences (the slices are of equal size), as under DDP
        "train_batch_size": t.global_batch_size * e.context_parallel_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": grad_accum_steps(cfg, world_size),
        "gradient_clipping": o.grad_clip,
        "bf16": {"enabled": autocast_dtype(cfg, device) is not None},
        "zero_optimization": {
            "stage": e.zero_stage,
            "overlap_comm": e.overlap_comm,
            "contiguous_gradients": True,
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
        },
        "zero_allow_untested_optimizer": True,  # our torch AdamW under ZeRO
        "steps_per_print": 10**9,  # our logger reports; keep DeepSpeed quiet
        "wall_clock_breakdown": False,
    }
    if e.zero_stage == 3:
        ds["zero_optimization"].update({"stage3_prefetch_bucket_size": bucket,
                                        "stage3_param_persistence_threshold": 10**5})
    if e.ds_optimizer == "deepspeed":
        ds["optimizer"] = {"type": "AdamW", "params": {
            "lr": o.lr, "betas": [o.beta1, o.beta2], "eps": o.eps, "weight_decay": o.weight_decay,
            # FusedAdam needs a CUDA build of its op; on CPU use torch's implementation.
            "torch_adam": getattr(device, "type", str(device)) != "cuda"}}
    return ds
