"""What a multi-rank launch prints: a config error once (rank 0), every rank exiting 2; the start
banner naming the engine."""
import subprocess
from types import SimpleNamespace

import fault_trials as ft  # bench/fault_trials.py (conftest puts bench/ on the path)
from training.config import load_config
from training.trainer import Trainer


def test_config_error_under_torchrun_is_one_line_from_rank_0(tmp_path):
    cmd = ft.command(tmp_path, tmp_path / "cache", "bad", 2, extra=["model.n_layrs=3"])
    proc = subprocess.run(cmd, cwd=ft.REPO, env=ft.environment(), capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    lines = [x for x in out.splitlines() if "config error" in x]
    assert len(lines) == 1 and lines[0].startswith("config error: override 'model.n_layrs=3': bad key"), out
    assert proc.returncode != 0 and out.count("exitcode  : 2") == 2, out  # both ranks


def engine_banner(*overrides, grad_sync=None, cache=None) -> str:
    cfg = load_config("tiny_cpu.yaml", list(overrides))
    fake = SimpleNamespace(cfg=cfg, engine=SimpleNamespace(grad_sync=grad_sync, weight_cache=cache))
    return Trainer._engine_banner(fake)


def test_banner_names_the_engine():
    assert engine_banner() == " | single process"
    assert engine_banner(grad_sync="ddp") == " | DDP"
    assert engine_banner(grad_sync="after_backward") == " | DDP (gradients summed after the backward)"
    assert engine_banner("engine.parallel=fsdp") == " | FSDP2"
    assert engine_banner("engine.type=deepspeed", "engine.zero_stage=2") == " | DeepSpeed ZeRO-2"
    assert engine_banner("engine.type=deepspeed", "engine.zero_stage=0") == " | DeepSpeed ZeRO-0"
    cache = SimpleNamespace(accumulated=[1])
    assert engine_banner(grad_sync="during_backward", cache=cache) == \
        " | DDP (gradients summed as the last backward writes them) | weight cache + fp32 weight gradients"
