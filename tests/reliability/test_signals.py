"""SIGTERM (what schedulers send before pre-emption) stops every rank at the same step boundary with
a checkpoint and a clean exit; rerunning the command continues the loss curve bit for bit."""
import signal
import time

import psutil

import fault_trials as ft  # bench/fault_trials.py (conftest puts bench/ on the path)


def stop_with_sigterm(work, cache_dir, name, steps, after_step, target):
    """Launch; once `after_step` is logged, SIGTERM `target` ('agent' or 'rank1'); wait for the end."""
    since = time.time()
    launch = ft.Launch(ft.command(work, cache_dir, name, steps), ft.environment(), work / f"{name}.log")
    deadline = time.monotonic() + ft.TIMEOUT
    while ft.newest_step(work / name, since) < after_step:
        assert launch.poll() is None and time.monotonic() < deadline, launch.tail()
        time.sleep(0.01)
    agent = psutil.Process(launch.proc.pid)
    workers = sorted(agent.children(), key=lambda p: p.environ().get("RANK"))
    (agent if target == "agent" else workers[1]).send_signal(signal.SIGTERM)
    code = launch.finish(deadline)
    log = launch.tail(20000)
    launch.log_path.unlink()  # each launch appends; keep the next one's tail clean
    return code, log


def stopped_at(run_dir) -> int:
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    return int(latest.split("_")[1])


def test_sigterm_stops_all_ranks_at_one_step_and_resumes_exactly(work, cache_dir, reference, steps):
    name = "sigterm"
    # 1) Only rank 1 gets SIGTERM: the per-step flag all-reduce makes rank 0 stop at the same step;
    #    both save, both exit 0, so torchrun exits 0 too.
    code, log = stop_with_sigterm(work, cache_dir, name, steps, after_step=2, target="rank1")
    first = stopped_at(work / name)
    assert code == 0, log
    assert 2 < first < steps and "Traceback" not in log
    assert f"stop signal (another rank) received: stopped at step {first}" in log
    assert sorted(ft.losses(work / name)) == list(range(1, first + 1))
    # 2) SIGTERM to the torchrun agent, which forwards it to both workers. They save and exit 0; the
    #    agent itself then exits 1 with its own SignalException (torchrun's behaviour, not ours).
    code, log = stop_with_sigterm(work, cache_dir, name, steps, after_step=first + 1, target="agent")
    second = stopped_at(work / name)
    assert first < second < steps, log
    assert f"SIGTERM received: stopped at step {second}" in log
    assert log.count("Traceback") == log.count("got signal: 15") == 1, log  # only the agent's
    # 3) The same command again finishes the run: the loss curve equals the uninterrupted one.
    launch = ft.Launch(ft.command(work, cache_dir, name, steps), ft.environment(), work / f"{name}.log")
    assert launch.finish(time.monotonic() + ft.TIMEOUT) == 0, launch.tail()
    assert ft.losses(work / name) == reference


def test_sigterm_single_process_exits_zero(tmp_path, cache_dir):
    """Without torchrun: SIGTERM -> checkpoint at the next step boundary, exit code 0."""
    cmd = ft.command(tmp_path, cache_dir, "single", 40, nproc=1)
    cmd = [cmd[0], *cmd[cmd.index(ft.TRAIN):]]  # python launch/train.py ... (no torchrun)
    since = time.time()
    launch = ft.Launch(cmd, ft.environment(), tmp_path / "single.log")
    while ft.newest_step(tmp_path / "single", since) < 2:
        assert launch.poll() is None, launch.tail()
        time.sleep(0.01)
    launch.proc.send_signal(signal.SIGTERM)
    assert launch.finish(time.monotonic() + ft.TIMEOUT) == 0, launch.tail()
    step = stopped_at(tmp_path / "single")
    assert 2 < step < 40 and f"SIGTERM received: stopped at step {step}" in launch.tail()
