"""Test-only fault injection, driven by one environment variable (unset in real runs: every hook is
then a string lookup that returns at once).

    FLASHGPT_FAULT=<point>:<step>[:<rank>][,<point>:<step>[:<rank>]...]      (rank defaults to 0)

Kill points (SIGKILL the whole job: the torchrun agent, every worker, this process; as a node loss):
    step         optimizer step <step>, after backward and before the optimizer update
    ckpt_write   Checkpointer.save(<step>) after the engine's files are written, before client.pt,
                 the manifest and the rename
    ckpt_commit  Checkpointer.save(<step>) after the rename into place, before `latest` is rewritten
Out of memory (no kill): oom  torch.OutOfMemoryError in step <step>, after its first micro-batch
Hangs (no kill; the hang watchdog must end the job), in step <step> after its first micro-batch:
    stop         this rank SIGSTOPs itself (the test SIGKILLs what is left)
    hang         this rank's main thread sleeps for ever (the process stays alive)
Numerical faults (no kill; the trainer must catch them before the optimizer step):
    nan_loss     the loss of step <step> is NaN (and so is every gradient)
    nan_grad     the loss of step <step> is finite but every gradient is NaN
"""
from __future__ import annotations

import os
import signal
import time
from typing import Callable

import torch

FAULT_ENV = "FLASHGPT_FAULT"


def active(point: str, step: int, rank: int) -> bool:
    """Whether FLASHGPT_FAULT asks for `point` at `step` on `rank`."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return False
    for item in spec.split(","):
        parts = item.strip().split(":")
        if len(parts) in (2, 3) and parts[0] == point and int(parts[1]) == step \
                and int(parts[2] if len(parts) == 3 else 0) == rank:
            return True
    return False


def kill_job() -> None:
    """SIGKILL the torchrun agent (our parent when launched by it), the sibling workers, then us.
    torchrun starts each worker in its own session, so a process-group kill would miss them."""
    me = os.getpid()
    if "TORCHELASTIC_RUN_ID" in os.environ:  # set by torchrun for its workers
        import psutil  # a dependency of deepspeed; only needed here
        agent = psutil.Process(me).parent()
        siblings = [p for p in agent.children() if p.pid != me]
        for proc in [agent, *siblings]:
            try:
                proc.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass
    os.kill(me, signal.SIGKILL)


def maybe_kill(point: str, step: int, rank: int) -> None:
    if active(point, step, rank):
        kill_job()


def maybe_oom(step: int, rank: int) -> None:
    """Raise the error a full GPU raises (tests of the launcher's out-of-memory message)."""
    if active("oom", step, rank):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (FLASHGPT_FAULT=oom). "
                                     "Including non-PyTorch memory, this process has ...")


def maybe_hang(step: int, rank: int) -> None:
    """Freeze this process (every thread) as a stopped one would, or only its main thread, as I/O that
    never returns would."""
    if active("stop", step, rank):
        os.kill(os.getpid(), signal.SIGSTOP)
    if active("hang", step, rank):
        while True:
            time.sleep(60)


def install_nan_hook(model: torch.nn.Module, current_step: Callable[[], int], rank: int) -> None:
    """When FLASHGPT_FAULT names nan_loss/nan_grad, make the training loss of that step (1-based,
    `current_step()` = steps done so far + 1) NaN, or its gradients. The model returns the loss."""
    spec = os.environ.get(FAULT_ENV, "")
    if "nan_" not in spec:
        return

    def hook(module, args, loss):
        if not module.training:  # leave evaluation alone
            return loss
        step = current_step()
        if active("nan_loss", step, rank):
            return loss * float("nan")
        if active("nan_grad", step, rank) and loss.requires_grad:
            loss.register_hook(lambda g: g * float("nan"))
        return loss

    model.register_forward_hook(hook)
