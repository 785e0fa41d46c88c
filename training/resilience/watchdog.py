"""Hang watchdog (train.hang_timeout_s): a job whose training stops making progress ends with every
live rank's Python stack, one line naming the stuck rank(s), and exit code 4, instead of waiting in a
collective until the process group's 30-minute timeout (or forever, for a stopped process).

Each rank of a multi-rank run runs one daemon thread. The training loop calls `mark(step, doing)` at
every progress event: a finished optimizer step, and the start and end of an evaluation or a
checkpoint save (those may be long: each gets the full timeout of its own). The thread writes this
rank's heartbeat to the rendezvous store (`hb/<rank>`: last finished step, what the main thread is
doing, the time, host and pid) after progress (at most once a second) and at least every `period`
seconds; it runs while the main thread waits, so a stale heartbeat means the whole process is
stopped, frozen or gone. Every `period` it also looks for the `hang` key.

When this rank's own allowance passes without progress (hang_timeout_s; FIRST_STEP_FACTOR times that
for the first step of a session, which includes torch.compile, autotuning and the communicators' set-up)
its thread sets `hang` (the first rank to do so prints the line), dumps all its threads' stacks to
stderr, reads the other ranks' heartbeats to name the stuck one(s), waits `period` x 2 for the others to
see `hang` and dump theirs, and leaves with os._exit(4): the main thread is blocked in C++ and cannot
be unwound. torchrun then stops the remaining workers (SIGTERM, and SIGKILL 30 s later for a stopped
one). Store operations have a short timeout of their own, so a store that stopped with its host rank
(launchers where rank 0 hosts it) cannot stall the watchdog.
"""
from __future__ import annotations

import faulthandler
import json
import os
import socket
import sys
import tempfile
import threading
import time
from typing import Callable

EXIT_CODE = 4  # launch/train.py's table: 2 bad input, 3 non-finite values, 4 hang
FIRST_STEP_FACTOR = 4  # the first step of a session gets this many timeouts (20 min at the default 300 s)


def write_block(header: str, tail: str) -> None:
    """Write `header`, every thread's Python stack and `tail` to stderr in one write(): ranks launched
    together share one stderr, and a stack dump written piecewise by two ranks at once comes out
    interleaved character by character. The stacks go through a temporary file (faulthandler writes
    only to a file descriptor); without one they go to stderr directly."""
    sys.stderr.flush()
    try:
        with tempfile.TemporaryFile() as tmp:
            faulthandler.dump_traceback(file=tmp, all_threads=True)
            tmp.seek(0)
            block = header.encode() + tmp.read() + tail.encode()
    except OSError:
        sys.stderr.write(header)
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.write(tail)
        sys.stderr.flush()
        return
    view = memoryview(block)
    while view:
        view = view[os.write(2, view):]


def period_for(timeout_s: float) -> float:
    """Seconds between heartbeats: a tenth of the timeout, within [1, 10]."""
    return min(10.0, max(1.0, timeout_s / 10))


class HangWatchdog:
    def __init__(self, timeout_s: float, rank: int, world_size: int, store, step: int,
                 rerun_hint: Callable[[], str]):
        self.timeout, self.rank, self.world = float(timeout_s), rank, world_size
        self.store, self.rerun_hint = store, rerun_hint
        self.period = period_for(self.timeout)
        self.host, self.pid = socket.gethostname(), os.getpid()
        self._step, self._doing = step, f"step {step + 1} (the first of this session)"
        self._since = time.monotonic()
        self._micro = 0  # micro-batches of the step in progress this rank has finished (`at`)
        self._version = 0  # bumped on every mark / at: the thread publishes what changed
        self._allowance = self.timeout * FIRST_STEP_FACTOR
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hang-watchdog", daemon=True)

    # --- main thread --------------------------------------------------------------------------------
    def start(self) -> "HangWatchdog":
        self._publish()
        self._thread.start()
        return self

    def mark(self, step: int, doing: str) -> None:
        """Progress: `step` optimizer steps are done and the main thread now does `doing`. Restarts
        this rank's clock with the normal allowance. Plain assignments: no lock, no I/O."""
        self._step, self._doing, self._micro = step, doing, 0
        self._allowance = self.timeout
        self._since = time.monotonic()
        self._version += 1

    def at(self, micro: int) -> None:
        """`micro` micro-batches of the step in progress are done (not progress: the clock runs on).
        Tells a rank stuck inside a step from the ranks waiting for it in a collective."""
        self._micro = micro
        self._version += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.period + 5)

    # --- the thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        """Every second: publish the heartbeat if the main thread made progress (at most once a
        second, so a fast loop does not flood the store), else every `period`; look for `hang` every
        `period`; check this rank's own deadline."""
        tick = min(1.0, self.period)
        published = checked = time.monotonic()
        shown = self._version
        while not self._stop.wait(tick):
            now = time.monotonic()
            if self._version != shown or now - published >= self.period:
                shown, published = self._version, now
                self._publish()
            if now - checked >= self.period:
                checked = now
                if self._seen_hang():
                    self._leave(leader=False)
            if now - self._since > self._allowance:
                self._leave(leader=True)

    def _publish(self) -> None:
        value = {"step": self._step, "micro": self._micro, "doing": self._doing, "time": time.time(),
                 "host": self.host, "pid": self.pid}
        try:
            self.store.set(f"hb/{self.rank}", json.dumps(value))
        except Exception:  # a slow or gone store: the deadline check below still runs
            pass

    def _seen_hang(self) -> bool:
        try:
            return self.store.check(["hang"])
        except Exception:
            return False

    def _leave(self, leader: bool) -> None:
        waited = time.monotonic() - self._since
        first = False
        if leader:
            try:
                first = self.store.add("hang_count", 1) == 1
                self.store.set("hang", str(self.rank))
            except Exception:
                first = True  # no store: nobody else can print it
        who = (f"rank {self.rank} found no progress for {waited:.0f} s" if leader
               else f"rank {self.rank}: another rank found the job hung")
        header = (f"\n--- hang watchdog: {who}; Python stacks of rank {self.rank} (pid {self.pid} on "
                  f"{self.host}), main thread doing {self._doing}:\n")
        tail = self.message(waited, self._heartbeats()) + "\n" if first else ""
        write_block(header, tail)
        time.sleep(2 * self.period)  # the other ranks see `hang` at their next heartbeat and dump
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(EXIT_CODE)

    def _heartbeats(self) -> dict:
        """rank -> heartbeat dict, None when it never wrote one, or the error text when it cannot be read
        (after the first failure the rest are not tried: each would wait for the store's timeout again)."""
        out, failed = {}, None
        for r in range(self.world):
            if failed is not None:
                out[r] = failed
                continue
            try:
                key = f"hb/{r}"
                out[r] = json.loads(self.store.get(key)) if self.store.check([key]) else None
            except Exception as e:
                out[r] = failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return out

    def message(self, waited: float, beats: dict) -> str:
        """One line: this rank's state, the stuck rank(s) and why, what to do."""
        now = time.time()
        stale_after = 3 * self.period  # a live process writes every `period` s
        unreadable = {r: b for r, b in beats.items() if isinstance(b, str)}
        never = [r for r, b in beats.items() if b is None]
        alive = {r: b for r, b in beats.items() if isinstance(b, dict)}
        silent = {r: b for r, b in alive.items() if now - b["time"] > stale_after}
        where = {r: (b["step"], b.get("micro", 0)) for r, b in alive.items()}  # (steps, micro-batches) done
        parts = [f"rank {r} never wrote a heartbeat: it has not reached the training loop" for r in never]
        for r, b in sorted(silent.items()):
            parts.append(f"rank {r} (pid {b['pid']} on {b['host']}) has not answered for {now - b['time']:.0f} s "
                         f"(its last heartbeat: finished step {b['step']}, doing {b['doing']}): it is stopped, "
                         f"frozen or its host is down")
        if not parts and where and min(where.values()) < max(where.values()):
            low, high = min(where.values()), max(where.values())
            for r in sorted(r for r, w in where.items() if w == low):
                parts.append(f"rank {r} (pid {alive[r]['pid']} on {alive[r]['host']}) is behind: it finished "
                             f"step {low[0]} and {low[1]} micro-batch(es) of the next, others step {high[0]} and "
                             f"{high[1]}; it is doing {alive[r]['doing']}")
        if not parts and unreadable:
            parts.append("the heartbeats of " + ", ".join(f"rank {r}" for r in unreadable) + " could not "
                         "be read (" + "; ".join(sorted(set(unreadable.values()))) + "): the rank hosting the "
                         "rendezvous store may be the stuck one")
        if not parts:
            parts.append("every rank is alive and none finished its work (" + "; ".join(
                f"rank {r}: {b['doing']}" for r, b in sorted(alive.items())) + "): a collective that "
                "not every rank entered, or I/O that does not return; the stacks show where")
        return (f"hang: no progress for {waited:.0f} s on rank {self.rank} (train.hang_timeout_s="
                f"{self.timeout:g}; it last finished step {self._step} and is doing {self._doing}); "
                + "; ".join(parts) + ". Every live rank printed its Python stacks under a '--- hang watchdog' "
                "header. " + self.rerun_hint())
