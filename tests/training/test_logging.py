"""RunLogger: rank-0 only, metrics.jsonl with resume truncation, W&B offline/disabled/fallbacks."""
import json
import time
import sys

import pytest

from training.config import Config
from training.telemetry import logging as runlog
from training.telemetry.logging import RunLogger, truncate_jsonl

WANDB_VARS = ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_MODE")


@pytest.fixture(autouse=True)
def isolated_env(monkeypatch, tmp_path):
    """Restore WANDB_* after each test and point HOME at an empty folder we can inspect."""
    for var in WANDB_VARS + ("WANDB_API_KEY",):
        monkeypatch.delenv(var, raising=False)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    return home


def make_cfg(wandb="disabled", progress=False, jsonl=True, log_interval=1):
    cfg = Config()
    cfg.logging.wandb, cfg.logging.progress = wandb, progress
    cfg.logging.jsonl, cfg.logging.log_interval = jsonl, log_interval
    cfg.train.run_name = "test-run"
    return cfg


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_and_resume_truncation(tmp_path, capsys):
    run = tmp_path / "run"
    with RunLogger(make_cfg(log_interval=2), run, rank=0, total_steps=5) as log:
        for step in range(1, 6):
            log.log(step, {"loss": 5.0 - step, "mfu_paper": None, "tflops_paper": 0.1})
        log.log_eval(4, {"loss": 1.5})
    recs = read(run / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 4]
    assert recs[0]["loss"] == 4.0 and recs[0]["mfu_paper"] is None and "time" in recs[0]
    assert recs[-1]["eval/loss"] == 1.5
    err = capsys.readouterr().err  # plain lines every log_interval (and the last step), MFU n/a
    assert "step 2/5" in err and "step 3/5" not in err and "step 5/5" in err and "mfu=n/a" in err

    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "lo')  # torn line of a crash
    with RunLogger(make_cfg(), run, rank=0, total_steps=5, start_step=3) as log:
        assert [r["step"] for r in read(run / "metrics.jsonl")] == [1, 2, 3]
        log.log(4, {"loss": 0.5})
    assert [r["step"] for r in read(run / "metrics.jsonl")] == [1, 2, 3, 4]
    assert not list(run.glob("*.tmp"))


def test_truncate_fresh_start_clears(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1}\n')
    truncate_jsonl(path, 0)
    assert path.read_text() == ""


def test_other_ranks_and_disabled_write_nothing(tmp_path, isolated_env):
    with RunLogger(make_cfg(wandb="offline"), tmp_path / "r1", rank=1, total_steps=3) as log:
        log.log(1, {"loss": 1.0})
        log.info("hidden")
    assert not (tmp_path / "r1").exists()
    with RunLogger(make_cfg(wandb="disabled", progress=True), tmp_path / "r0", rank=0, total_steps=3) as log:
        log.info("a message")
        log.log(1, {"loss": 1.0, "tokens_per_s": 2e3, "mfu_paper": 0.5})
        assert log.wandb_id is None
    assert sorted(p.name for p in (tmp_path / "r0").iterdir()) == ["metrics.jsonl", "summary.json"]
    assert not any(isolated_env.iterdir())


def test_wandb_offline_resume_same_id(tmp_path, isolated_env):
    run = tmp_path / "run"
    with RunLogger(make_cfg(wandb="offline"), run, rank=0, total_steps=4) as log:
        log.log(1, {"loss": 3.0, "mfu_paper": 0.4})
        log.log(2, {"loss": 2.0, "mfu_paper": 0.5})
        wid = log.wandb_id
    assert wid and len(list((run / "wandb").rglob(f"offline-run-*-{wid}"))) == 1
    time.sleep(1.1)  # W&B names offline folders by the second: a resume within 1 s would reuse it
    with RunLogger(make_cfg(wandb="offline"), run, rank=0, total_steps=4, start_step=2, wandb_id=wid) as log:
        assert log.wandb_id == wid
        log.log(3, {"loss": 1.0})
    assert len(list((run / "wandb").rglob(f"offline-run-*-{wid}"))) == 2
    assert not any(isolated_env.iterdir())  # nothing in the user's home


class FakeRun:
    def __init__(self, mode, fail_log=False):
        self.settings = type("S", (), {"mode": mode})()
        self.fail_log, self.logged, self.finished = fail_log, [], False

    def define_metric(self, *a, **k):
        pass

    def log(self, data, step):
        if self.fail_log:
            raise OSError("disk full")
        self.logged.append((step, data))

    def finish(self, exit_code=0):
        self.finished = True


def test_online_failure_falls_back_to_offline(tmp_path, monkeypatch, capsys):
    import wandb
    modes = []

    def fake_init(mode, **kwargs):
        modes.append(mode)
        if mode == "online":
            raise wandb.errors.UsageError("api_key not configured (no-tty)")
        return FakeRun(mode)

    monkeypatch.setattr(wandb, "init", fake_init)
    with RunLogger(make_cfg(wandb="online"), tmp_path, rank=0, total_steps=2) as log:
        log.log(1, {"loss": 1.0})
        assert modes == ["online", "offline"] and log._wandb.logged == [(1, {"loss": 1.0})]
    assert "falling back to offline" in capsys.readouterr().err


def test_backend_failure_never_raises(tmp_path, monkeypatch, capsys):
    import wandb
    monkeypatch.setattr(wandb, "init", lambda mode, **kw: FakeRun(mode, fail_log=True))
    with RunLogger(make_cfg(wandb="offline"), tmp_path, rank=0, total_steps=3) as log:
        for step in (1, 2, 3):
            log.log(step, {"loss": 1.0})
    assert capsys.readouterr().err.count("wandb logging failed") == 1
    assert len(read(tmp_path / "metrics.jsonl")) == 3  # the other backends went on


def test_wandb_missing_warns_and_continues(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with RunLogger(make_cfg(wandb="offline"), tmp_path, rank=0, total_steps=1) as log:
        log.log(1, {"loss": 1.0})
    assert "wandb logging failed" in capsys.readouterr().err
    assert runlog.RunLogger is RunLogger
