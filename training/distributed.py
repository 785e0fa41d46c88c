"""Process-group set-up from the torchrun / deepspeed launcher environment (RANK, WORLD_SIZE, ...)."""
from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def all_reduce_mean(self, t: torch.Tensor) -> torch.Tensor:
        """Mean over ranks, on the device (no host sync)."""
        if self.enabled:
            t = t.clone()
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
            t /= self.world_size
        return t

    def shutdown(self) -> None:
        # DeepSpeed and gloo runs have been seen to abort at exit without this (ENVIRONMENT.md).
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but no CUDA GPU is visible here; use train.device=cpu "
                           "(or auto) on this machine")
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(device_request: str = "auto", backend: str = "auto") -> DistInfo:
    """Read the launcher's environment; start the process group when WORLD_SIZE > 1.

    torchrun and the deepspeed launcher both set RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT.
    Backend auto: nccl for CUDA, gloo for CPU.
    """
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    device = pick_device(device_request, local_rank)
    if world_size > 1 and not dist.is_initialized():
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=30), **kwargs)
    return DistInfo(rank=rank, local_rank=local_rank, world_size=world_size, device=device)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_process_group(info: DistInfo, backend: str = "auto") -> None:
    """A 1-rank process group for engines that need one even in a plain `python launch/train.py`
    (FSDP2, DeepSpeed); a no-op under torchrun, where init_distributed already made it."""
    if dist.is_initialized():
        return
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if backend == "auto":
        backend = "nccl" if info.device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, world_size=1, rank=0)
