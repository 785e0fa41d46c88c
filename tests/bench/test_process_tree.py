"""bench/process_tree.py: a launch whose worker runs in a session of its own (as torchrun starts its
workers) leaves no process behind when it times out, or when the tool that started it gets SIGTERM."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import process_tree  # bench/ (tests/bench/conftest.py puts it on the path)

BENCH = Path(process_tree.__file__).resolve().parent
# an "agent" that starts a "worker" in a new session, writes the worker's pid, and waits for it
AGENT = ("import subprocess, sys, time; w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], "
         "start_new_session=True); open(sys.argv[1], 'w').write(str(w.pid)); w.wait()")


def _pid(path: Path, timeout=60.0) -> int:
    end = time.monotonic() + timeout
    while not (path.exists() and path.read_text()):
        assert time.monotonic() < end, "the agent never started its worker"
        time.sleep(0.05)
    return int(path.read_text())


def _gone(pid: int, timeout=30.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_a_launch_past_its_deadline_kills_the_worker_of_another_session(tmp_path):
    pid_file = tmp_path / "worker.pid"
    launch = process_tree.Launch([sys.executable, "-c", AGENT, str(pid_file)], tmp_path / "log")
    worker = _pid(pid_file)
    assert os.getsid(worker) != os.getsid(launch.proc.pid)  # out of reach of a signal to the agent's group
    with pytest.raises(TimeoutError):
        launch.finish(time.monotonic() + 0.5)
    assert _gone(worker) and _gone(launch.proc.pid)


def test_sigterm_to_the_tool_kills_its_launch_and_worker(tmp_path):
    pid_file = tmp_path / "worker.pid"
    tool = ("import sys, time; sys.path.insert(0, sys.argv[1]); import process_tree as p; p.terminate_raises(); "
            "launch = p.Launch([sys.executable, '-c', sys.argv[2], sys.argv[3]], p.Path(sys.argv[4])); "
            "launch.finish(time.monotonic() + 600)")
    proc = subprocess.Popen([sys.executable, "-c", tool, str(BENCH), AGENT, str(pid_file), str(tmp_path / "log")])
    worker = _pid(pid_file)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert _gone(worker)


def test_a_finished_launch_returns_its_exit_code(tmp_path):
    launch = process_tree.Launch([sys.executable, "-c", "print('hi'); raise SystemExit(3)"], tmp_path / "log",
                                 cwd=tmp_path, append=False)
    assert launch.finish(time.monotonic() + 60) == 3 and launch.tail() == "hi\n"
