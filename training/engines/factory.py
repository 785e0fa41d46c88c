"""The engine a config asks for: the one module that imports every engine (the trainer calls it).
engine.type=torch: replicas (DDP or our own gradient sync, or one process) / FSDP2 (engine.parallel=fsdp);
engine.type=deepspeed: ZeRO stages 0-3. FSDP2's and DeepSpeed's modules are imported only when asked for
(they pull in torch.distributed.checkpoint and deepspeed)."""
from __future__ import annotations

import torch

from training.config import Config
from training.distributed import DistInfo
from training.engines.base import Engine
from training.engines.replicas import TorchEngine


def build_engine(model: torch.nn.Module, cfg: Config, dist: DistInfo) -> Engine:
    if cfg.engine.type == "deepspeed":
        from training.engines.deepspeed import DeepSpeedEngine

        return DeepSpeedEngine(model, cfg, dist)
    if cfg.engine.parallel == "fsdp":
        from training.engines.fsdp import FSDPEngine

        return FSDPEngine(model, cfg, dist)
    return TorchEngine(model, cfg, dist)
