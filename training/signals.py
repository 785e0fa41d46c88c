"""Graceful stop on SIGTERM / SIGINT (what schedulers send before pre-emption, and Ctrl-C).

The handler only sets a flag; the trainer reads it once per step, all-reduces it across ranks
together with its non-finite check (one 2-element MAX all-reduce, see Trainer.train_step), so every
rank stops at the same step, saves a checkpoint and returns normally (exit code 0). A second SIGINT
while a stop is pending raises KeyboardInterrupt (the impatient Ctrl-C Ctrl-C).
torchrun forwards SIGTERM/SIGINT to its workers and SIGKILLs them 30 s later: the step in flight plus
the checkpoint save must fit in that window (Slurm's KillWait is also 30 s by default).
"""
from __future__ import annotations

import signal
import threading
from typing import Optional

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignal:
    """Context manager: installs the handlers on enter (main thread only), restores them on exit."""

    def __init__(self):
        self.received: Optional[str] = None  # name of the first signal, e.g. "SIGTERM"
        self._old = {}

    @property
    def requested(self) -> bool:
        return self.received is not None

    def _handle(self, signum, frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = self.received or signal.Signals(signum).name

    def __enter__(self) -> "StopSignal":
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()
