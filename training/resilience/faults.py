"""Test-only fault injection, driven by one environment variable that real runs leave unset.

    FLASHGPT_FAULT=<point>:<step>[:<rank>][,<point>:<step>[:<rank>]...]      (rank defaults to 0)

The code calls one hook where a fault can happen, `reach(place, step, rank)`, and the model carries
one forward hook (`install`) for the numerical faults. Each point below belongs to one place; when the
place is reached at <step> on <rank>, the point's action runs.

Place `update`: the trainer's step <step>, after backward and before the optimizer update:
    step         SIGKILL the whole job (the torchrun agent, every worker, this process; a node loss)
Place `first_micro_batch`: the trainer's step <step>, after its first micro-batch:
    oom          raise torch.OutOfMemoryError (tests of the out-of-memory message)
    stop         this rank SIGSTOPs itself (the hang watchdog must end the job; the test SIGKILLs the rest)
    hang         this rank's main thread sleeps for ever, the process stays alive (as I/O that never returns)
Places `ckpt_write` / `ckpt_commit`: Checkpointer.save(<step>), SIGKILL the whole job
    ckpt_write   after the engine's files are written, before client.pt, the manifest and the rename
    ckpt_commit  after the rename into place, before `latest` is rewritten
Model forward (`install`), training only; the trainer must catch these before the optimizer step:
    nan_loss     the loss of step <step> is NaN (and so is every gradient)
    nan_grad     the loss of step <step> is finite but every gradient is NaN
    lost_grad    step <step>'s attention outputs reach the output projection detached: the q/k/v weights
                 get no gradient (a backward that never ran; training/gradient_check.py must stop the run)

The variable is parsed once per value: unset, `reach` costs one environment lookup.
"""
from __future__ import annotations

import os
import signal
import time
from typing import Callable, Dict, FrozenSet, Tuple

import torch

FAULT_ENV = "FLASHGPT_FAULT"

Plan = Dict[Tuple[str, int, int], FrozenSet[str]]  # (place, step, rank) -> the points asked there


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


def raise_oom() -> None:
    """The error a full GPU raises."""
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (FLASHGPT_FAULT=oom). "
                                 "Including non-PyTorch memory, this process has ...")


def stop_process() -> None:
    """Freeze every thread of this process, as a stopped process is."""
    os.kill(os.getpid(), signal.SIGSTOP)


def hang_forever() -> None:
    """Block this thread only, as I/O that never returns would; the process stays alive."""
    while True:
        time.sleep(60)


# point -> (place, action); actions at one place run in this order. The nan_* points have no action
# here: the forward hook of `install` applies them.
POINTS: Dict[str, Tuple[str, Callable[[], None] | None]] = {
    "step": ("update", kill_job),
    "oom": ("first_micro_batch", raise_oom),
    "stop": ("first_micro_batch", stop_process),
    "hang": ("first_micro_batch", hang_forever),
    "ckpt_write": ("ckpt_write", kill_job),
    "ckpt_commit": ("ckpt_commit", kill_job),
    "nan_loss": ("loss", None),
    "nan_grad": ("loss", None),
    "lost_grad": ("loss", None),
}


def parse(spec: str) -> Plan:
    """FLASHGPT_FAULT's value -> (place, step, rank) -> points. Raises ValueError naming a malformed
    item or an unknown point (a test that misspells its fault must not pass without one)."""
    plan: Dict[Tuple[str, int, int], set] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        parts = item.split(":")
        if len(parts) not in (2, 3) or parts[0] not in POINTS or not all(p.isdigit() for p in parts[1:]):
            raise ValueError(f"{FAULT_ENV}: cannot read {item!r}: expected <point>:<step>[:<rank>] with "
                             f"<point> one of {', '.join(POINTS)}")
        point, step, rank = parts[0], int(parts[1]), int(parts[2]) if len(parts) == 3 else 0
        plan.setdefault((POINTS[point][0], step, rank), set()).add(point)
    return {key: frozenset(points) for key, points in plan.items()}


_parsed: Tuple[str, Plan] = ("", {})  # (the value last parsed, its plan)


def plan() -> Plan:
    """The faults FLASHGPT_FAULT asks for ({} when unset), parsed once per value."""
    global _parsed
    spec = os.environ.get(FAULT_ENV, "")
    if spec != _parsed[0]:
        _parsed = (spec, parse(spec))
    return _parsed[1]


def asked(point: str, step: int, rank: int) -> bool:
    """Whether FLASHGPT_FAULT asks for `point` at `step` on `rank`."""
    return point in plan().get((POINTS[point][0], step, rank), ())


def reach(place: str, step: int, rank: int) -> None:
    """The code reached `place` in step `step` on `rank`: run what FLASHGPT_FAULT asks for there."""
    if not os.environ.get(FAULT_ENV):
        return
    points = plan().get((place, step, rank))
    if points:
        for point, (_, action) in POINTS.items():
            if point in points and action is not None:
                action()


def install(model: torch.nn.Module, current_step: Callable[[], int], rank: int) -> None:
    """When FLASHGPT_FAULT names nan_loss / nan_grad, hook the model's forward (which returns the
    loss) so that the training loss of that step (1-based: `current_step()` = steps done + 1) is NaN,
    or its gradients are. Nothing is installed otherwise."""
    if not any(place == "loss" for place, _, _ in plan()):
        return

    def hook(module, args, loss):
        if not module.training:  # leave evaluation alone
            return loss
        step = current_step()
        if asked("nan_loss", step, rank):
            return loss * float("nan")
        if asked("nan_grad", step, rank) and loss.requires_grad:
            loss.register_hook(lambda g: g * float("nan"))
        return loss

    model.register_forward_hook(hook)

    def cut(module, args):  # before the attention's output projection
        if module.training and asked("lost_grad", current_step(), rank):
            return (args[0].detach(),)
        return None

    from model.attention import CausalSelfAttention

    for m in model.modules():
        if isinstance(m, CausalSelfAttention):
            m.proj.register_forward_pre_hook(cut)
