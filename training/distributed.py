"""Process-group set-up from the torchrun / deepspeed launcher environment (RANK, WORLD_SIZE, ...),
and the host-side coordination beside it: a client of the rendezvous store with short timeouts of its
own (heartbeats, rank 0's data preparation) and a gloo group for the per-micro-batch stop flag."""
from __future__ import annotations

import datetime
import os
import socket
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

import torch
import torch.distributed as dist


# Collectives' timeout. Kept at torch's 30 minutes, not shortened: a collective cannot tell a stopped
# rank from a legitimately long wait (rank 0 writing a checkpoint alone, a first torch.compile, a
# big corpus being tokenized) and its timeout aborts without naming the rank or showing stacks. The
# hang watchdog (training/resilience/watchdog.py, train.hang_timeout_s=300 s, 4x that for a session's first step)
# ends a hung job first and says which rank stopped; this timeout is the backstop when it is off.
PG_TIMEOUT = datetime.timedelta(minutes=30)


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


class Rank0Failed(RuntimeError):
    """Rank 0 failed in work the other ranks wait for (`rank0_first`). `reported`: rank 0 printed its
    own error, so the other ranks leave without repeating it (launch/train.py)."""

    def __init__(self, msg: str, reported: bool):
        super().__init__(msg)
        self.reported = reported


T = TypeVar("T")


def control_store(op_timeout_s: float = 10.0):
    """A new client of the launcher's rendezvous store (MASTER_ADDR:MASTER_PORT: torchrun's agent, or
    rank 0 under other launchers) whose get/set/check give up after `op_timeout_s`, under a prefix of
    this job and attempt (torchrun restarts reuse the agent's store). The process group's own store
    client keeps its long timeout; this one never blocks a caller for long on a stopped store host."""
    timeout = datetime.timedelta(seconds=op_timeout_s)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timeout, wait_for_workers=False)
    prefix = (f"flashgpt/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/"
              f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
    return dist.PrefixStore(prefix, store)


READ_WAIT_S = 15.0  # how long a failed rank 0 waits for the others to read its error (they poll each second)


def rank0_first(info: DistInfo, what: str, fn: Callable[[], T]) -> T:
    """Run `fn` on rank 0, then on every other rank (which then finds rank 0's results, e.g. in a cache).
    The others wait on a store key, not in a collective, so no process-group timeout applies: a first
    run's data preparation may take hours. An exception on rank 0 reaches them as Rank0Failed."""
    if not info.enabled:
        return fn()
    store = control_store()
    key = f"done/{what}"
    if info.is_main:
        try:
            out = fn()
        except BaseException as e:
            try:
                store.set(key, f"{type(e).__name__}: {e}")
                # where rank 0 hosts the store (launchers other than torchrun), it goes when rank 0 exits:
                # wait (bounded) until every other rank has read the failure
                deadline = time.monotonic() + READ_WAIT_S
                while store.add(f"{key}/read", 0) < info.world_size - 1 and time.monotonic() < deadline:
                    time.sleep(0.05)
            except Exception:  # the store is gone too: the others find that out themselves
                pass
            raise
        store.set(key, "ok")
        return out
    try:
        while not store.check([key]):
            time.sleep(1.0)
        status = store.get(key).decode()
        store.add(f"{key}/read", 1)
    except (RuntimeError, OSError) as e:  # DistStoreError is a RuntimeError
        raise Rank0Failed(f"lost the rendezvous store while rank 0 was {what} ({str(e).splitlines()[0]}); "
                          f"rank 0 (which may host it) is likely gone: see its output", reported=False) from None
    if status != "ok":
        raise Rank0Failed(f"rank 0 failed while {what}: {status}", reported=True)
    return fn()


def all_reached(what: str, world_size: int, wait_s: float = 30.0) -> bool:
    """Before the process group exists (a config error): count this rank in under `what` and wait up to
    `wait_s` for all `world_size` ranks, so that none exits before the others got there (torchrun
    stops the remaining workers as soon as one exits) and rank 0's line, printed before, is out. False
    where no store is up yet (other launchers start theirs with the process group), it does not answer
    or not every rank came."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return False
    try:
        store = control_store(op_timeout_s=wait_s)
        deadline = time.monotonic() + wait_s
        count = store.add(f"reached/{what}", 1)
        while count < world_size and time.monotonic() < deadline:
            time.sleep(0.05)
            count = store.add(f"reached/{what}", 0)
        return count >= world_size
    except Exception:
        return False


def stop_group(info: DistInfo):
    """A gloo group of all ranks for the stop flag all-reduced at every micro-batch boundary: a CPU
    tensor, so no device sync (training/resilience/signals.py). None in a single process. Collective: every rank
    calls it at the same point."""
    if not info.enabled:
        return None
    return dist.new_group(backend="gloo", timeout=PG_TIMEOUT)


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
        dist.init_process_group(backend=backend, timeout=PG_TIMEOUT, **kwargs)
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
