"""configs/tiny_cpu_local.yaml (GPT-3's alternating dense and local layers) as a training run on CPU: it
trains (finite losses, the banner names the band), and a backend without a mask ends launch/train.py
with one config-error line."""
import math
import subprocess
import sys

from training.config import load_config
from training.distributed import DistInfo
from training.trainer import Trainer

from train_runner import FAST, REPO, TRAIN, env, losses


def test_tiny_cpu_local_trains(tmp_path, capsys):
    fast = [a for a in FAST if not a.startswith(("logging.wandb", "train.eval_interval", "train.ckpt_interval"))]
    cfg = load_config("tiny_cpu_local.yaml", [f"train.out_dir={tmp_path}", f"data.cache_dir={tmp_path / 'cache'}",
                                              *fast, "train.max_steps=3", "train.eval_interval=0",
                                              "train.ckpt_interval=0", "logging.wandb=disabled", "train.run_name=r"])
    trainer = Trainer.build(cfg, DistInfo())
    assert [b.attn.window for b in trainer.engine.model.blocks] == [0, 32]  # FAST: 2 layers, 64 tokens
    trainer.fit()
    got = losses(tmp_path / "r")
    assert sorted(got) == [1, 2, 3] and all(math.isfinite(v) for v in got.values()), got
    printed = capsys.readouterr()
    assert "| attention sdpa, local band of 32 tokens in odd layers | MLP" in printed.out + printed.err


def test_sdpa_flash_with_a_window_is_one_config_error_line(tmp_path):
    cmd = [sys.executable, TRAIN, "--config", "tiny_cpu_local.yaml", f"train.out_dir={tmp_path}",
           f"data.cache_dir={tmp_path / 'cache'}", *FAST, "logging.wandb=disabled", "model.attention=sdpa_flash"]
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "config error: model.attention=sdpa_flash cannot run a local window (model.attention_window=32: that SDPA "
        "backend takes no mask); use model.attention=flash or sdpa (or auto, math), or model.attention_window=0"), \
        proc.stderr[-3000:]
