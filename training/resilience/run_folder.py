"""The run folder's two guards: one run at a time in it (RunLock), and a fresh run never mixing with,
or pruning away, an old run's files (move_aside, for train.overwrite=true).

Rank 0 holds an exclusive lock on <run_dir>/.lock for the run's life.

The lock is an advisory `flock` on the file, which the kernel drops when the holder exits in any way
(SIGKILL and node loss included, on the machine that held it), so a lock "left by a dead process" is
simply free. The file holds one JSON line while locked: host, pid, start time (UTC) and the command,
for the message a second run prints; a clean exit empties it, so text found in an unlocked file names
a run that died, and the next run takes the lock over with a warning naming it. Network file systems: NFSv4 and Lustre (mounted with -o flock) honour flock across nodes.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Optional

from training.resilience.checkpoint import CheckpointError

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"


class RunFolderBusy(CheckpointError):
    """Another live process holds the run folder's lock (reported as a checkpoint error: exit 2)."""


def _describe(holder: dict) -> str:
    if not holder:
        return "an unknown process"
    return (f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} (since {holder.get('since', '?')}: "
            f"{holder.get('command', '?')})")


def _read(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 1 << 16).decode("utf-8", "replace").strip()
    try:
        holder = json.loads(text) if text else {}
        return holder if isinstance(holder, dict) else {}
    except ValueError:
        return {}


class RunLock:
    """Context manager; `acquire()` raises RunFolderBusy naming the holder when another process has it."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_NAME
        self._fd: Optional[int] = None
        self.previous: dict = {}  # the holder named in the file when we took it over (a dead run)

    def acquire(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read(fd)
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RunFolderBusy(
                    f"run folder {self.path.parent} is in use by {_describe(holder)}: two runs in one folder "
                    f"would overwrite each other's checkpoints and metrics. Stop that run, or choose another "
                    f"train.run_name") from None
            raise
        self.previous = _read(fd)
        if self.previous and self.previous.get("pid") != os.getpid():
            log.warning(f"took over the lock of run folder {self.path.parent} left by {_describe(self.previous)}, "
                        f"which is no longer running")
        me = {"host": socket.gethostname(), "pid": os.getpid(),
              "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "command": " ".join(sys.argv)[:500]}
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, (json.dumps(me) + "\n").encode())
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        """Clear the holder's text, then unlock (text left in an unlocked file means its holder died)."""
        if self._fd is not None:
            try:
                os.ftruncate(self._fd, 0)
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            finally:
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def move_aside(run_dir: Path) -> Path:
    """Move everything of an old run in run_dir (checkpoints, metrics.jsonl, config.yaml, wandb/, ...)
    into run_dir/replaced-<UTC time>/, so a fresh run starts empty and nothing is lost. The lock file
    and earlier replaced-* folders stay. Call with the lock held."""
    run_dir = Path(run_dir)
    aside = run_dir / time.strftime("replaced-%Y%m%dT%H%M%SZ", time.gmtime())
    n = 1
    while aside.exists():
        n += 1
        aside = aside.with_name(f"{aside.name.split('.')[0]}.{n}")
    aside.mkdir()
    for p in sorted(run_dir.iterdir()):
        if p.name != LOCK_NAME and not p.name.startswith("replaced-"):
            shutil.move(str(p), str(aside / p.name))
    return aside
