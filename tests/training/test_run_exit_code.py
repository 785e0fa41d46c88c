"""The run logger is told how the training loop ended: 0 when it finished or stopped on a signal, 1 when
an error stopped it, so the W&B run of a crashed run is marked failed rather than finished."""
import pytest
import torch

from training.config import load_config
from training.distributed import DistInfo
from training.resilience import faults
from training.telemetry.logging import RunLogger
from training.trainer import Trainer

from train_runner import FAST


def _fit(tmp_path, monkeypatch, fault=None):
    closed = []
    real_close = RunLogger.close
    monkeypatch.setattr(RunLogger, "close", lambda self, exit_code=0: (closed.append(exit_code),
                                                                      real_close(self, exit_code))[1])
    if fault:
        monkeypatch.setenv(faults.FAULT_ENV, fault)
    else:
        monkeypatch.delenv(faults.FAULT_ENV, raising=False)
    cfg = load_config("tiny_cpu.yaml", [f"train.out_dir={tmp_path}", f"data.cache_dir={tmp_path / 'cache'}", *FAST,
                                        "train.max_steps=2", "train.eval_interval=0", "train.ckpt_interval=0",
                                        "logging.wandb=disabled", "train.run_name=r"])
    trainer = Trainer.build(cfg, DistInfo())
    return trainer, closed


def test_a_finished_run_closes_with_0(tmp_path, monkeypatch):
    trainer, closed = _fit(tmp_path, monkeypatch)
    trainer.fit()
    assert closed == [0]


def test_an_error_closes_with_1(tmp_path, monkeypatch):
    trainer, closed = _fit(tmp_path, monkeypatch, fault="oom:2")
    with pytest.raises((torch.OutOfMemoryError, RuntimeError)):
        trainer.fit()
    assert closed == [1]
