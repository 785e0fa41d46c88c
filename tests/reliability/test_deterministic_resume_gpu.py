"""train.deterministic on a GPU: 2N steps straight and N steps + SIGKILL + resume give the same losses
bit for bit (our attention's ordered backward, torch's deterministic algorithms, cuBLAS workspace,
inductor without on-device autotuning). Without CUDA it skips."""
import json
import subprocess
import sys

import pytest
import torch

import fault_trials as ft  # bench/fault_trials.py (conftest puts bench/ on the path)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# head dim 64 and bf16 so attention runs on our kernels; 8 steps of 2 micro-batches, checkpoint every 4
GPU = ["train.device=cuda", "model.attention=flash", "model.n_layer=2", "model.d_model=256", "model.n_head=4",
       "model.seq_len=256", "train.global_batch_size=8", "train.micro_batch_size=4", "train.max_steps=8",
       "train.ckpt_interval=4", "train.eval_interval=0", "logging.progress=false", "logging.wandb=disabled",
       "train.deterministic=true"]


def launch(out_dir, cache_dir, *overrides, fault=None):
    cmd = [sys.executable, ft.TRAIN, "--config", "tiny_cpu.yaml", f"train.out_dir={out_dir}",
           f"data.cache_dir={cache_dir}", *GPU, *overrides]
    env = {**ft.environment(), **({"FLASHGPT_FAULT": fault} if fault else {})}
    return subprocess.run(cmd, cwd=ft.REPO, env=env, capture_output=True, text=True, timeout=900)


def losses(out_dir):
    lines = (out_dir / "tiny_cpu" / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


@pytest.mark.parametrize("compile", ["false", "true"])
def test_kill_and_resume_is_bit_identical_on_gpu(tmp_path, cache_dir, compile):
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    proc = launch(straight, cache_dir, f"train.compile={compile}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "attention flash" in proc.stderr and "deterministic" in proc.stderr, proc.stderr[-3000:]
    killed = launch(broken, cache_dir, f"train.compile={compile}", fault="step:6")
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = launch(broken, cache_dir, f"train.compile={compile}")
    assert resumed.returncode == 0 and "at step 4" in resumed.stderr, resumed.stderr[-4000:]
    a, b = losses(straight), losses(broken)
    assert sorted(a) == list(range(1, 9)) and a == b, (a, b)
