"""A rank that stops (SIGSTOP, as a wedged driver or a frozen host would) ends the job within
train.hang_timeout_s: the live rank dumps its Python stacks, one line names the stopped rank, exit 4;
rerunning the same command resumes and the loss curve equals an uninterrupted run's bit for bit."""
import time

import psutil

import fault_trials as ft  # bench/fault_trials.py (conftest puts bench/ on the path)

TIMEOUT_S = 8  # train.hang_timeout_s here; heartbeats every second
TORCHRUN_GRACE_S = 30  # torchrun SIGKILLs a worker this long after its SIGTERM (a stopped one ignores it)


def test_stopped_rank_ends_the_job_naming_it_then_resumes_exactly(work, cache_dir, reference, steps):
    name = "hang"
    cmd = ft.command(work, cache_dir, name, steps, extra=[f"train.hang_timeout_s={TIMEOUT_S}"])
    launch = ft.start(cmd, ft.environment("stop:8:1"), work / f"{name}.log")  # rank 1 stops in step 8
    deadline = time.monotonic() + ft.TIMEOUT
    stopped_since = None
    while launch.poll() is None and stopped_since is None:
        assert time.monotonic() < deadline, launch.tail()
        for p in launch.tree[1:]:
            try:
                if p.status() == psutil.STATUS_STOPPED:
                    stopped_since, stopped = time.monotonic(), p
            except psutil.Error:
                pass
        time.sleep(0.05)
    assert stopped_since is not None, launch.tail()
    code = launch.finish(deadline)  # SIGKILLs anything of the job left behind
    took = time.monotonic() - stopped_since
    log = launch.tail(30000)
    print(f"rank 1 stopped -> job ended in {took:.1f} s (train.hang_timeout_s={TIMEOUT_S})")
    assert code != 0 and "exitcode  : 4" in log, log
    assert took < TIMEOUT_S + 5 + TORCHRUN_GRACE_S + 10, (took, log)
    assert "--- hang watchdog: rank 0 found no progress" in log and "in train_step" in log, log
    assert log.count("hang: no progress for ") == 1, log
    line = next(x for x in log.splitlines() if x.startswith("hang: no progress for "))
    assert f"rank 1 (pid {stopped.pid} " in line and "has not answered" in line, line
    assert f"Rerun the same command: it continues from {work / name / 'checkpoints' / 'step_00000006'}" in line
    assert not stopped.is_running() or stopped.status() == psutil.STATUS_ZOMBIE
    launch.log_path.unlink()
    final = ft.start(cmd, ft.environment(), work / f"{name}.final.log")
    assert final.finish(time.monotonic() + ft.TIMEOUT) == 0, final.tail()
    assert ft.losses(work / name) == reference


def test_rank_stuck_in_python_ends_the_job_with_both_stacks(work, cache_dir, steps):
    """Rank 1's main thread never returns (as from I/O that hangs) while its process lives: both ranks'
    watchdogs dump their stacks and leave with exit 4, without torchrun's 30 s grace; the line names
    rank 1 as behind by a micro-batch (rank 0 waits for it at the next micro-batch boundary)."""
    name = "hang_alive"
    cmd = ft.command(work, cache_dir, name, steps, extra=[f"train.hang_timeout_s={TIMEOUT_S}"])
    launch = ft.start(cmd, ft.environment("hang:5:1"), work / f"{name}.log")
    code = launch.finish(time.monotonic() + ft.TIMEOUT)
    log = launch.tail(60000)
    assert code != 0 and log.count("exitcode  : 4") == 2, log
    assert "Python stacks of rank 0" in log and "Python stacks of rank 1" in log and "in hang_forever" in log, log
    line = next(x for x in log.splitlines() if x.startswith("hang: no progress for "))
    assert log.count("hang: no progress for ") == 1, log
    assert "rank 1 (pid " in line and "is behind: it finished step 4 and 0 micro-batch(es) of the next, " \
           "others step 4 and 1" in line, line
    assert "Rerun the same command: it continues from " in line and line.endswith("step_00000003."), line


def test_message_names_the_silent_rank_else_the_one_behind():
    """The one line: a rank whose heartbeat is stale (its process is stopped) is named first; with every
    process alive, the rank behind in steps; with none behind, what each is doing."""
    from training.resilience.watchdog import HangWatchdog

    dog = HangWatchdog(60, 0, 3, store=None, step=7, rerun_hint=lambda: "Rerun the same command.")
    dog.mark(7, "step 8")
    now = time.time()

    def beat(step, doing, age):
        return {"step": step, "doing": doing, "time": now - age, "host": "h", "pid": 100 + step}

    silent = dog.message(61, {0: beat(7, "step 8", 1), 1: beat(6, "step 7", 59), 2: beat(7, "step 8", 2)})
    assert silent.startswith("hang: no progress for 61 s on rank 0 (train.hang_timeout_s=60; it last finished "
                             "step 7 and is doing step 8); rank 1 (pid 106 on h) has not answered for 59 s"), silent
    assert "rank 2" not in silent and silent.endswith("Rerun the same command.")
    behind = dog.message(61, {0: beat(7, "step 8", 1), 1: beat(6, "step 7", 1), 2: beat(7, "step 8", 2)})
    assert "rank 1 (pid 106 on h) is behind: it finished step 6 and 0 micro-batch(es) of the next, others " \
           "step 7 and 0; it is doing step 7" in behind, behind
    same = dog.message(61, {0: beat(7, "step 8", 1), 1: beat(7, "checkpoint save of step 7", 1),
                            2: beat(7, "step 8", 1)})
    assert "every rank is alive and none finished its work (rank 0: step 8; rank 1: checkpoint save of step 7" in same
    unread = dog.message(61, {0: beat(7, "step 8", 1), 1: "DistStoreError: timeout", 2: beat(7, "step 8", 1)})
    assert "the heartbeats of rank 1 could not be read (DistStoreError: timeout)" in unread, unread
    never = dog.message(61, {0: beat(7, "step 8", 1), 1: None, 2: beat(7, "step 8", 1)})
    assert "rank 1 never wrote a heartbeat: it has not reached the training loop." in never, never
