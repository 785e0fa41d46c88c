"""Known bad inputs end the run with one clear line on stderr and a non-zero exit code, never a
traceback (launch/train.py); W&B online without a network falls back to offline and training goes
on. The full catalogue, with the tests of each case, is README "Errors and what to do"."""
import json
import os
import subprocess
import sys

import pytest
import torch

from training.config import load_config
from training.distributed import DistInfo
from training.resilience.checkpoint import CheckpointError
from training.trainer import Trainer

import fault_trials as ft  # bench/fault_trials.py (conftest puts bench/ on the path)

FAST = [a for a in ft.FAST if "ckpt_interval" not in a]


def launch(tmp_path, cache_dir, *overrides, env=None, timeout=300):
    cmd = [sys.executable, ft.TRAIN, "--config", "tiny_cpu.yaml", f"train.out_dir={tmp_path}",
           f"data.cache_dir={cache_dir}", *FAST, *overrides]
    env = {**ft.environment(), **(env or {})}
    return subprocess.run(cmd, cwd=ft.REPO, env=env, capture_output=True, text=True, timeout=timeout)


def one_line_error(proc, code, *words):
    assert proc.returncode == code, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = [x for x in proc.stderr.splitlines() if "error:" in x or "stopped:" in x][-1]
    for w in words:
        assert w in line, line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_device_on_a_cpu_machine(tmp_path, cache_dir):
    proc = launch(tmp_path, cache_dir, "train.device=cuda")
    one_line_error(proc, 2, "device error:", "train.device=cuda", "no CUDA GPU")


def test_missing_data_path(tmp_path, cache_dir):
    proc = launch(tmp_path, cache_dir, f"data.source=[{tmp_path}/nope.jsonl]")
    one_line_error(proc, 2, "data error:", "nope.jsonl' not found")


def test_nonfinite_stop_exit_code(tmp_path, cache_dir):
    proc = launch(tmp_path, cache_dir, "train.max_steps=3", "train.nonfinite=stop",
                  env={"FLASHGPT_FAULT": "nan_loss:2"})
    one_line_error(proc, 3, "training stopped:", "non-finite", "step 2")


def test_checkpoint_of_another_model_shape(tmp_path, cache_dir):
    assert launch(tmp_path, cache_dir, "train.max_steps=2").returncode == 0
    proc = launch(tmp_path, cache_dir, "train.max_steps=4", "model.n_layer=3")
    one_line_error(proc, 2, "checkpoint error:", "another shape", "n_layer")


def _trainer(tmp_path, cache_dir, *overrides):
    cfg = load_config("tiny_cpu.yaml", [f"train.out_dir={tmp_path}", f"data.cache_dir={cache_dir}",
                                        "train.max_steps=2", "logging.wandb=disabled", *FAST, *overrides])
    return Trainer.build(cfg, DistInfo())


def test_checkpoint_of_another_tokenizer_or_newer_format(tmp_path, cache_dir):
    _trainer(tmp_path, cache_dir).fit()
    t = _trainer(tmp_path, cache_dir)
    t.data_meta = {**t.data_meta, "tokenizer_hash": "0123abcd"}
    with pytest.raises(CheckpointError, match="another tokenizer.*0123abcd.*data"):
        t.maybe_resume()
    path = tmp_path / "tiny_cpu" / "checkpoints" / "step_00000002"
    t = _trainer(tmp_path, cache_dir, f"train.resume={path}")
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps({**manifest, "format_version": 99,
                                                    "written_by": "flashgpt 7.0"}))
    with pytest.raises(CheckpointError, match="written by flashgpt 7.0 in checkpoint format 99.*upgrade"):
        t.maybe_resume()  # read from the manifest, before any other file


def test_wandb_online_without_network_falls_back_to_offline(tmp_path, cache_dir):
    """A key is set, so W&B really tries the network; init gives up after WANDB_INIT_TIMEOUT."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(OMP_NUM_THREADS="1", WANDB_API_KEY="0" * 40, WANDB_INIT_TIMEOUT="5",
               WANDB_BASE_URL="http://127.0.0.1:9")  # nothing listens there: as good as no network
    cmd = [sys.executable, ft.TRAIN, "--config", "tiny_cpu.yaml", f"train.out_dir={tmp_path}",
           f"data.cache_dir={cache_dir}", *FAST, "logging.wandb=online", "train.max_steps=2"]
    proc = subprocess.run(cmd, cwd=ft.REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "falling back to offline" in proc.stderr and "(offline)" in proc.stderr, proc.stderr[-3000:]
    assert list((tmp_path / "tiny_cpu" / "wandb").rglob("offline-run-*"))
    steps = [json.loads(x)["step"] for x in (tmp_path / "tiny_cpu" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
