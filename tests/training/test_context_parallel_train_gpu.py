"""Context parallelism from the trainer on 2 GPUs (NCCL): launch/train.py at engine.context_parallel_size=2,
compiled, bf16, our kernel as the local attention, RoPE, trains the curve of one GPU at C=1 (within bf16
rounding) and passes the first step's gradient check (training/gradient_check.py: the attention's backward
ran on both ranks). Skipped without 2 CUDA GPUs."""
import json
import subprocess
import sys

import pytest
import torch
from train_runner import REPO, TRAIN, env

pytestmark = pytest.mark.gpu
if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA GPUs (one rank each)", allow_module_level=True)

# head dim 64, bf16: our kernels; 6 steps of 2 micro-batches of 4 windows of 512 tokens
GPU = ["train.device=cuda", "model.attention=flash", "model.pos_emb=rope", "model.n_layer=2", "model.d_model=256",
       "model.n_head=4", "model.seq_len=512", "train.global_batch_size=8", "train.micro_batch_size=4",
       "train.max_steps=6", "train.eval_interval=0", "train.ckpt_interval=0", "train.save_final=false",
       "train.compile=true", "logging.progress=false", "logging.wandb=disabled", "train.run_name=cp"]


def _train(out_dir, cache_dir, nproc, *overrides):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", TRAIN,
           "--config", "tiny_cpu.yaml", f"train.out_dir={out_dir}", f"data.cache_dir={cache_dir}", *GPU, *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env={**env(), "NCCL_NVLS_ENABLE": "0"}, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = (out_dir / "cp" / "metrics.jsonl").read_text().splitlines()
    return proc.stderr, {r["step"]: r for r in map(json.loads, lines) if "loss" in r}


def test_two_context_ranks_train_the_one_gpu_curve(tmp_path):
    cache = tmp_path / "cache"
    _, one = _train(tmp_path / "c1", cache, 1)
    log, two = _train(tmp_path / "c2", cache, 2, "engine.context_parallel_size=2")
    assert "(context 2 x data 1)" in log and "attention flash" in log, log[-3000:]
    assert sorted(one) == sorted(two) == list(range(1, 7))
    for step in one:
        assert two[step]["loss"] == pytest.approx(one[step]["loss"], rel=2e-2), (step, one, two)
        assert two[step]["grad_norm"] == pytest.approx(one[step]["grad_norm"], rel=5e-2), (step, one, two)
