"""Graceful stop on SIGTERM / SIGINT (what schedulers send before pre-emption, and Ctrl-C).

The handler only sets a flag. The trainer asks `agreed()` at every micro-batch boundary: the flag is
MAX all-reduced over a gloo group of all ranks (one int32 on the host: no device sync; measured cost
in README "SIGTERM"), so every rank abandons the same micro-batch; FSDP runs collectives in every
micro-batch, and ranks leaving at different ones would wait for each other forever. The partial step
is dropped and the checkpoint of the last finished step is saved (Trainer.train_step), so from the
signal to a committed checkpoint takes at most one micro-batch plus the save. torchrun forwards
SIGTERM/SIGINT to its workers and SIGKILLs them 30 s later (Slurm's KillWait is also 30 s).

A second signal while a stop is under way: in a single process a second SIGINT raises
KeyboardInterrupt (the impatient Ctrl-C Ctrl-C; the last checkpoint stays intact). With several ranks
it is ignored, with a note on stderr: a rank that left alone mid-save would leave the others waiting
in a collective; SIGKILL still ends a rank at once.
"""
from __future__ import annotations

import os
import signal
import threading
from typing import Optional

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignal:
    """Context manager: installs the handlers on enter (main thread only), restores them on exit.
    `group`: the gloo group of all ranks for `agreed()` (training/distributed.py stop_group), None in
    a single process."""

    def __init__(self, group=None):
        self.received: Optional[str] = None  # name of the first signal, e.g. "SIGTERM"
        self.group = group
        self._flag = torch.zeros(1, dtype=torch.int32)
        self._old = {}

    @property
    def requested(self) -> bool:
        return self.received is not None

    def agreed(self) -> bool:
        """Whether any rank received a signal (collective over `group`: every rank calls it at the same
        point). One 4-byte gloo all-reduce on the host."""
        if self.group is None:
            return self.requested
        self._flag.fill_(int(self.requested))
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(self._flag.item())

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is None:
            self.received = name
            return
        if self.group is None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        # not logging: the handler may run inside a logging call of the main thread
        os.write(2, f"{name} again: the stop after {self.received} is under way (at most a micro-batch "
                    f"and the checkpoint save); a second signal does not abort a multi-rank run part-way, "
                    f"as the other ranks would wait for this one. SIGKILL ends it at once.\n".encode())

    def __enter__(self) -> "StopSignal":
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()
