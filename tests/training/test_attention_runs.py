"""Training runs that differ only in model.attention (the FlashAttention-2 paper's Table 1 columns), on the
tiny CPU config: `math` (scores materialised) trains the sdpa run's first loss, also with the attention
recomputed; a backend this machine cannot run ends launch/train.py with one config-error line."""
import math
import subprocess
import sys

import pytest
import torch

from training.config import load_config
from training.distributed import DistInfo
from training.trainer import Trainer

from train_runner import FAST, REPO, TRAIN, env, losses

STEPS = 2


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("data_cache")


def _run(out_dir, cache_dir, *overrides) -> dict:
    """{step: loss} of an in-process run of STEPS steps of tiny_cpu.yaml (tests/train_runner.py's FAST shape)."""
    fast = [a for a in FAST if not a.startswith(("logging.wandb", "train.eval_interval", "train.ckpt_interval"))]
    cfg = load_config("tiny_cpu.yaml", [f"train.out_dir={out_dir}", f"data.cache_dir={cache_dir}", *fast,
                                        f"train.max_steps={STEPS}", "train.eval_interval=0", "train.ckpt_interval=0",
                                        "logging.wandb=disabled", "train.run_name=r", *overrides])
    trainer = Trainer.build(cfg, DistInfo())
    assert trainer.engine.model.attention_backend == cfg.model.attention
    trainer.fit()
    return losses(out_dir / "r")


def test_math_trains_the_loss_of_sdpa(tmp_path, cache_dir, capsys):
    sdpa = _run(tmp_path / "sdpa", cache_dir, "model.attention=sdpa")
    for extra in ([], ["model.recompute_attention=true"]):
        ours = _run(tmp_path / f"math{len(extra)}", cache_dir, "model.attention=math", *extra)
        assert sorted(ours) == list(range(1, STEPS + 1)) and all(math.isfinite(v) for v in ours.values())
        assert abs(ours[1] - sdpa[1]) < 1e-4 * sdpa[1], (ours, sdpa)  # same weights, same batch, fp32
        assert abs(ours[2] - sdpa[2]) < 1e-3 * sdpa[2], (ours, sdpa)
    printed = capsys.readouterr()
    assert "| attention math (recomputed in backward) | MLP" in printed.out + printed.err  # the run's banner


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
@pytest.mark.parametrize("choice,line", [
    ("sdpa_cudnn", "model.attention=sdpa_cudnn needs a CUDA GPU (cuDNN); on cpu use model.attention=sdpa_flash, "
                   "sdpa or math"),
    ("flash", "model.attention=flash needs a CUDA device; on this machine use model.attention=sdpa (or auto)"),
])
def test_a_gpu_only_attention_on_a_cpu_is_one_config_error_line(tmp_path, cache_dir, choice, line):
    cmd = [sys.executable, TRAIN, "--config", "tiny_cpu.yaml", f"train.out_dir={tmp_path}",
           f"data.cache_dir={cache_dir}", *FAST, "logging.wandb=disabled", f"model.attention={choice}"]
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == f"config error: {line}", proc.stderr[-3000:]
