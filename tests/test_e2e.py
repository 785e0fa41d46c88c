"""End to end on CPU: the tiny config trains (loss falls), and stopping + resuming continues the
loss curve bit for bit, in one process and under 2-process torchrun."""
import json
import subprocess
import sys

import pytest
from train_runner import REPO, TRAIN, losses, run



@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("data_cache"))


def test_tiny_run_loss_falls(tmp_path, cache_dir):
    run(tmp_path, cache_dir, "train.max_steps=40", "train.run_name=falls", "train.ckpt_interval=0",
        "train.eval_interval=20")
    curve = losses(tmp_path / "falls")
    assert sorted(curve) == list(range(1, 41))
    first, last = curve[1], sum(curve[s] for s in range(36, 41)) / 5
    assert last < first - 1.0, (first, last)
    assert (tmp_path / "falls" / "config.yaml").is_file()
    assert (tmp_path / "falls" / "checkpoints" / "latest").read_text().strip() == "step_00000040"
    records = [json.loads(line) for line in (tmp_path / "falls" / "metrics.jsonl").read_text().splitlines()]
    rec = [r for r in records if "loss" in r][-1]
    assert rec["step"] == 40 and any("eval/loss" in r for r in records)
    for key in ("lr", "grad_norm", "tokens_per_s", "tflops_paper", "tflops_causal", "step_time_s"):
        assert rec.get(key) is not None, key


@pytest.mark.parametrize("nproc", [1, 2])
def test_resume_is_bit_identical(tmp_path, cache_dir, nproc):
    """2N steps straight == N steps, stop, resume for N more (N=3: a checkpoint every 3 steps)."""
    run(tmp_path, cache_dir, "train.max_steps=6", "train.run_name=straight", nproc=nproc)
    run(tmp_path, cache_dir, "train.max_steps=6", "train.run_name=stopped", "train.stop_after=3", nproc=nproc)
    assert sorted(losses(tmp_path / "stopped")) == [1, 2, 3]
    resumed = run(tmp_path, cache_dir, "train.max_steps=6", "train.run_name=stopped", nproc=nproc)
    assert "resumed from" in resumed.stderr + resumed.stdout
    a, b = losses(tmp_path / "straight"), losses(tmp_path / "stopped")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
    assert a == b  # exact float equality, every step


def test_bad_override_fails_fast_with_one_message(tmp_path, cache_dir):
    cmd = [sys.executable, TRAIN, "--config", "tiny_cpu.yaml", "model.n_head=5"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "not divisible" in proc.stderr and "Traceback" not in proc.stderr
