"""A resume that can be trusted, through launch/train.py as a user runs it: a fresh run never prunes an
old run away, one run per run folder, a tampered checkpoint runs no code, leftovers are cleaned, a
finished run says how to continue, and W&B holds every step metrics.jsonl holds after a SIGKILL."""
import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import torch

from training.resilience.manifest import write_manifest
from training.resilience.run_folder import RunLock
from training.telemetry.wandb_history import logged_steps

import fault_trials as ft  # bench/fault_trials.py (conftest puts bench/ on the path)

FAST = [a for a in ft.FAST if "ckpt_interval" not in a]


def launch(out_dir, cache_dir, *overrides, env=None, timeout=300):
    cmd = [sys.executable, ft.TRAIN, "--config", "tiny_cpu.yaml", f"train.out_dir={out_dir}",
           f"data.cache_dir={cache_dir}", *FAST, "train.ckpt_interval=2", "train.keep_last=2", *overrides]
    return subprocess.run(cmd, cwd=ft.REPO, env={**ft.environment(), **(env or {})}, capture_output=True,
                          text=True, timeout=timeout)


def ok(proc):
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def one_line(proc, code, *words):
    assert proc.returncode == code, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    line = proc.stderr.strip().splitlines()[-1]
    for w in words:
        assert w in line, line
    return line


def steps_of(run_dir: Path) -> list:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))


def test_fresh_run_into_an_old_run_folder_stops_or_moves_it_aside(tmp_path, cache_dir):
    """The audit's case: an old run left step_6 and step_8 (keep_last=2); `train.resume=none` must not
    prune the new run's step_2 and step_3 at once, nor the next auto-resume continue the old step_8."""
    run = tmp_path / "tiny_cpu"
    ok(launch(tmp_path, cache_dir, "train.max_steps=8"))
    assert steps_of(run) == ["step_00000006", "step_00000008"]
    line = one_line(launch(tmp_path, cache_dir, "train.max_steps=3", "train.resume=none"), 2,
                    "checkpoint error:", "already holds checkpoints", "train.run_name", "train.overwrite=true")
    assert "step_00000008" in line and steps_of(run) == ["step_00000006", "step_00000008"]
    ok(launch(tmp_path, cache_dir, "train.max_steps=3", "train.resume=none", "train.overwrite=true"))
    assert steps_of(run) == ["step_00000002", "step_00000003"]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000003"
    aside = list(run.glob("replaced-*"))
    assert len(aside) == 1 and steps_of(aside[0]) == ["step_00000006", "step_00000008"]
    assert (aside[0] / "metrics.jsonl").is_file()
    resumed = ok(launch(tmp_path, cache_dir, "train.max_steps=5"))
    assert "resumed from" in resumed.stderr and "step_00000003 at step 3" in resumed.stderr


def test_second_run_in_a_busy_folder_stops_naming_the_holder(tmp_path, cache_dir):
    run = tmp_path / "tiny_cpu"
    with RunLock(run):  # this test process plays the first run
        line = one_line(launch(tmp_path, cache_dir, "train.max_steps=2"), 2, "checkpoint error:",
                        f"in use by pid {os.getpid()}", "train.run_name")
    assert not (run / "checkpoints").exists() and not (run / "metrics.jsonl").exists(), line
    ok(launch(tmp_path, cache_dir, "train.max_steps=2"))


def test_tampered_checkpoint_runs_no_code_and_resume_falls_back(tmp_path, cache_dir):
    run = tmp_path / "tiny_cpu"
    ok(launch(tmp_path, cache_dir, "train.max_steps=4"))
    newest = run / "checkpoints" / "step_00000004"
    marker = tmp_path / "marker"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    client = torch.load(newest / "client.pt", weights_only=True)
    with open(newest / "client.pt", "wb") as f:
        pickle.dump({**client, "x": Payload()}, f)
    facts = {k: v for k, v in json.loads((newest / "manifest.json").read_text()).items()
             if k not in ("version", "algorithm", "files")}
    write_manifest(newest, facts)  # the manifest recomputed over the payload
    proc = ok(launch(tmp_path, cache_dir, "train.max_steps=6"))
    assert not marker.exists()
    assert re.search(r"step_00000004 is damaged \(loading it failed: UnpicklingError: it holds objects other "
                     r"than tensors.*\); resuming from .*step_00000002", proc.stderr), proc.stderr[-3000:]
    assert (run / "checkpoints" / "corrupt-step_00000004").is_dir()


def test_leftovers_are_removed_at_start_and_a_finished_run_says_how_to_go_on(tmp_path, cache_dir):
    run = tmp_path / "tiny_cpu"
    ok(launch(tmp_path, cache_dir, "train.max_steps=2"))
    for name in (".tmp-step_00000003", ".trash-step_00000001-5"):
        (run / "checkpoints" / name).mkdir()
        (run / "checkpoints" / name / "engine.pt").write_bytes(b"half")
    proc = ok(launch(tmp_path, cache_dir, "train.max_steps=2"))
    assert not list((run / "checkpoints").glob(".*-step_*"))
    assert "removed leftovers" in proc.stderr
    assert "nothing to train" in proc.stderr and "train.max_steps=4" in proc.stderr


def test_wandb_holds_every_step_of_metrics_after_a_sigkill(tmp_path, cache_dir):
    """W&B's service buffers history: a SIGKILL loses it. The resumed run logs those steps again."""
    run = tmp_path / "tiny_cpu"
    killed = launch(tmp_path, cache_dir, "train.max_steps=6", "logging.wandb=offline",
                    env={"FLASHGPT_FAULT": "step:5"})
    assert killed.returncode == -9, killed.stderr[-3000:]
    ok(launch(tmp_path, cache_dir, "train.max_steps=6", "logging.wandb=offline"))
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    want = {r["step"] for r in records}
    assert want == set(range(1, 7))
    # README's command: wandb sync runs/<run_name>/wandb/offline-run-*
    readme = (ft.REPO / "README.md").read_text()
    pattern = re.search(r"wandb sync runs/<run_name>/(\S+?)`", readme).group(1)
    folders = sorted(run.glob(pattern))
    assert folders and all(f.name.startswith("offline-run-") for f in folders)
    run_id = folders[0].name.rsplit("-", 1)[1]
    assert logged_steps(run / "wandb", run_id) == want


def test_two_ranks_fall_back_together_when_one_rank_cannot_load(tmp_path, cache_dir):
    """Rank 1's file of the newest checkpoint is garbage behind a recomputed manifest: rank 0 loads its
    own files fine, so only the ranks' agreement makes both fall back to the same older checkpoint."""
    run = tmp_path / "tiny_cpu"
    cmd = ft.command(tmp_path, cache_dir, "tiny_cpu", 4, nproc=2, extra=["train.ckpt_interval=2"])
    proc = subprocess.run(cmd, cwd=ft.REPO, env=ft.environment(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    newest = run / "checkpoints" / "step_00000004"
    (newest / "rank00001.pt").write_bytes(b"not a torch file")
    facts = {k: v for k, v in json.loads((newest / "manifest.json").read_text()).items()
             if k not in ("version", "algorithm", "files")}
    write_manifest(newest, facts)
    cmd = ft.command(tmp_path, cache_dir, "tiny_cpu", 6, nproc=2, extra=["train.ckpt_interval=2"])
    proc = subprocess.run(cmd, cwd=ft.REPO, env=ft.environment(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "rank 1: loading it failed" in proc.stderr and "resuming from" in proc.stderr, proc.stderr[-4000:]
    assert proc.stderr.count("at step 2") >= 1, proc.stderr[-4000:]
