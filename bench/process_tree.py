"""A torchrun launch that leaves no process behind: the agent runs in its own session with its output in
a log file, and its whole tree (torchrun starts each worker in a new session of its own, out of reach of
a signal to the agent's process group) is SIGKILLed when the launch is killed, times out, or the tool
that started it is interrupted or terminated. A worker that outlives its agent keeps its GPU memory,
and the next launch on that GPU then runs out of memory."""
from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import psutil


def kill_all(procs) -> None:
    """SIGKILL the torchrun agent first (so it cannot react), then its workers."""
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=30)


def terminate_raises() -> None:
    """SIGTERM raises SystemExit(143) in this process, so the `finally` of a running launch kills its tree
    (`timeout`, a job scheduler's stop) as Ctrl-C's KeyboardInterrupt does."""
    def raise_exit(signum, frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, raise_exit)


class Launch:
    """One launch of `cmd` (in its own session), stdout and stderr to `log_path`; tracks its process tree
    so no worker survives it."""

    def __init__(self, cmd, log_path: Path, env=None, cwd=None, append: bool = True):
        self.log_path = log_path
        self.log = open(log_path, "ab" if append else "wb")
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.tree = [psutil.Process(self.proc.pid)]

    def poll(self):
        try:  # refresh the snapshot of the tree while the agent lives
            self.tree = [self.tree[0], *self.tree[0].children(recursive=True)]
        except psutil.Error:
            pass
        return self.proc.poll()

    def kill(self) -> None:
        self.poll()
        kill_all(self.tree)
        self.proc.wait()
        self.log.close()

    def finish(self, deadline: float) -> int:
        """Wait for the exit code until `deadline` (time.monotonic()); past it, or on any exception while
        waiting (KeyboardInterrupt, SystemExit from terminate_raises), the tree is killed."""
        try:
            while self.poll() is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"launch timed out; log: {self.log_path}")
                time.sleep(0.05)
        except BaseException:
            self.kill()
            raise
        kill_all([p for p in self.tree[1:] if p.is_running()])  # stragglers of an agent that exited
        self.log.close()
        return self.proc.returncode

    def tail(self, n=3000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]
