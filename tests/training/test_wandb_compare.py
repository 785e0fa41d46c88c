"""Runs compared side by side in W&B: group and tags (kept on resume), tokens_seen as every metric's
x-axis, the steady-state medians in the W&B summary and in <run_dir>/summary.json. W&B runs offline
with HOME and its folders in tmp_path; what it wrote is read back from its .wandb files."""
import json
import math
import time
from pathlib import Path

import pytest

from training.config import Config
from training.telemetry.logging import RunLogger
from training.telemetry.summary import steady_summary
from training.telemetry.wandb_history import records

WANDB_VARS = ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_MODE", "WANDB_API_KEY")


@pytest.fixture(autouse=True)
def isolated_env(monkeypatch, tmp_path):
    for var in WANDB_VARS:
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "home").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


def make_cfg(wandb="offline", group="paper-table", tags=("1.3b", "8k", "flash"), jsonl=True):
    cfg = Config()
    cfg.logging.wandb, cfg.logging.progress, cfg.logging.jsonl = wandb, False, jsonl
    cfg.logging.group, cfg.logging.tags = group, list(tags)
    cfg.train.run_name = "cell"
    return cfg


def _read(run_dir: Path):
    from wandb.proto import wandb_internal_pb2 as pb
    out, paths = [], sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb"))
    for path in paths:
        for body in records(path):
            rec = pb.Record()
            rec.ParseFromString(body)
            out.append((path.parent.name, rec))
    return out, len(paths)


def wandb_records(run_dir: Path, timeout_s: float = 60.0):
    """(offline folder name, parsed Record) of every record of every offline run under run_dir/wandb,
    once each run's file ends with its exit record (W&B's service may still be writing after
    run.finish() returns)."""
    deadline = time.monotonic() + timeout_s
    while True:
        out, n = _read(run_dir)
        if len(of_type(out, "exit")) == n or time.monotonic() > deadline:
            return out
        time.sleep(0.2)


def of_type(recs, kind):
    return [(folder, r) for folder, r in recs if r.WhichOneof("record_type") == kind]


def wandb_summary(recs) -> dict:
    """The run's summary as W&B holds it after the last summary record (top-level keys only)."""
    out = {}
    for _, r in of_type(recs, "summary"):
        for item in r.summary.update:
            key = item.key or "/".join(item.nested_key)
            out[key] = json.loads(item.value_json)
    return out


def train_record(step, mfu, **extra):
    return {"loss": 1.0 / step, "tokens_seen": 1000 * step, "mfu_paper": mfu, "mfu_causal": mfu / 2,
            "tflops_paper": 300 * mfu, "tflops_causal": 150 * mfu, "tokens_per_s_per_gpu": 1e4 * mfu,
            "gpu_sm_clock_mhz": 1980.0, "gpu_power_w": 600.0 + step, "mem_max_alloc_gb": 10.0 + step % 3,
            **extra}


def test_group_and_tags_reach_wandb_and_survive_resume(tmp_path):
    run = tmp_path / "run"
    with RunLogger(make_cfg(), run, rank=0, total_steps=4) as log:
        log.log(1, train_record(1, 0.1))
        wid = log.wandb_id
    time.sleep(1.1)  # W&B names offline folders by the second
    with RunLogger(make_cfg(), run, rank=0, total_steps=4, start_step=1, wandb_id=wid) as log:
        log.log(2, train_record(2, 0.2))
    runs = of_type(wandb_records(run), "run")
    assert len({folder for folder, _ in runs}) == 2  # the first session and the resumed one
    for _, r in runs:
        assert r.run.run_id == wid and r.run.run_group == "paper-table"
        assert list(r.run.tags) == ["1.3b", "8k", "flash"]


def test_no_group_no_tags_by_default(tmp_path):
    with RunLogger(make_cfg(group="", tags=()), tmp_path / "run", rank=0, total_steps=1) as log:
        log.log(1, train_record(1, 0.1))
    (_, r), = of_type(wandb_records(tmp_path / "run"), "run")
    assert r.run.run_group == "" and list(r.run.tags) == []


def test_tokens_seen_is_every_metrics_x_axis(tmp_path):
    run = tmp_path / "run"
    with RunLogger(make_cfg(), run, rank=0, total_steps=2) as log:
        log.log(1, train_record(1, 0.1, time_share_attention=0.3))
        log.log_eval(2, {"loss": 2.5, "tokens_seen": 2000})
    metrics = {r.metric.name: r.metric for _, r in of_type(wandb_records(run), "metric")}
    assert "tokens_seen" in metrics and metrics["tokens_seen"].step_metric == ""
    for name in ("loss", "eval/loss", "mfu_paper", "mfu_causal", "tflops_paper", "tokens_per_s_per_gpu",
                 "gpu_sm_clock_mhz", "gpu_power_w", "mem_max_alloc_gb", "time_share_attention"):
        assert metrics[name].step_metric == "tokens_seen", name
    assert metrics["mfu_paper"].summary.mean  # the summaries of WANDB_SUMMARIES stay
    eval_rec = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert eval_rec["eval/loss"] == 2.5 and eval_rec["tokens_seen"] == 2000  # not eval/tokens_seen
    history = [r.history for _, r in of_type(wandb_records(run), "history")]
    assert [h.step.num for h in history] == [1, 2]  # the W&B step is still the optimizer step


def test_steady_medians_skip_warmup_and_eval():
    recs = [{"step": s, **train_record(s, mfu)} for s, mfu in
            [(1, 0.01), (2, 0.02), (3, 0.03), (4, 0.40), (5, 0.50), (6, 0.60), (7, 0.70)]]
    recs.insert(3, {"step": 3, "eval/loss": 9.0, "tokens_seen": 3000})
    recs[4]["mfu_paper"] = None  # a step without MFU counts for the others, not for this median
    s = steady_summary(recs, warmup_steps=3)
    assert s["steady/steps"] == 4 and s["steady/warmup_steps"] == 3
    assert s["steady/mfu_paper"] == pytest.approx(0.6)  # median of 0.5, 0.6, 0.7
    assert s["steady/mfu_causal"] == pytest.approx(0.275)  # median of 0.2, 0.25, 0.3, 0.35
    assert s["steady/gpu_power_w"] == pytest.approx(605.5)
    assert s["peak_mem_gb"] == 12.0  # over all train steps, warm-up included
    empty = steady_summary([{"step": 1, "loss": 1.0, "mfu_paper": math.nan}], warmup_steps=0)
    assert empty["steady/steps"] == 1 and empty["steady/mfu_paper"] is None and empty["peak_mem_gb"] is None


def test_summary_in_json_and_wandb_over_the_whole_resumed_run(tmp_path):
    run = tmp_path / "run"
    with RunLogger(make_cfg(), run, rank=0, total_steps=8) as log:
        for step in range(1, 6):
            log.log(step, train_record(step, 0.1 * step))
        log.log(6, train_record(6, 0.9))  # after the checkpoint at 5: dropped on resume
        wid = log.wandb_id
    assert json.loads((run / "summary.json").read_text())["steady/steps"] == 3
    time.sleep(1.1)
    with RunLogger(make_cfg(), run, rank=0, total_steps=8, start_step=5, wandb_id=wid) as log:
        for step in (6, 7, 8):
            log.log(step, train_record(step, 0.1 * step))
    # steps 4..8 of the whole run (5 of them from the first session); median of 0.4 ... 0.8
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steady/steps"] == 5 and summary["steady/mfu_paper"] == pytest.approx(0.6)
    assert summary["steady/tflops_paper"] == pytest.approx(180.0) and summary["peak_mem_gb"] == 12.0
    assert set(summary) >= {f"steady/{k}" for k in ("tokens_per_s_per_gpu", "tflops_paper", "tflops_causal",
                                                     "mfu_paper", "mfu_causal", "gpu_sm_clock_mhz", "gpu_power_w")}
    assert not list(run.glob("*.tmp"))
    recs = wandb_records(run)
    resumed = sorted({folder for folder, _ in recs})[-1]
    in_wandb = wandb_summary([(f, r) for f, r in recs if f == resumed])
    for key, value in summary.items():
        assert in_wandb[key] == pytest.approx(value), key


def test_summary_written_on_an_exception_and_without_jsonl(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(RuntimeError):
        with RunLogger(make_cfg(wandb="disabled", jsonl=False), run, rank=0, total_steps=9) as log:
            for step in range(1, 6):
                log.log(step, train_record(step, 0.1 * step))
            raise RuntimeError("out of memory")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steady/steps"] == 2 and summary["steady/mfu_paper"] == pytest.approx(0.45)
    assert not (run / "metrics.jsonl").exists()


def test_other_ranks_write_no_summary(tmp_path):
    with RunLogger(make_cfg(wandb="disabled"), tmp_path / "r1", rank=1, total_steps=1) as log:
        log.log(1, train_record(1, 0.1))
    assert not (tmp_path / "r1").exists()


def test_a_training_run_as_paper_table_starts_it(tmp_path):
    """launch/train.py with the overrides bench/paper_table.py passes: the W&B run is in the group with
    the tags, eval records carry tokens_seen, and summary.json holds the steps after the warm-up."""
    from train_runner import run as train
    train(tmp_path, tmp_path / "cache", "train.max_steps=6", "train.run_name=cell_flash", "train.ckpt_interval=0",
          "logging.group=paper-table", "logging.tags=[tiny,64,flash]", "logging.summary_warmup_steps=2")
    run = tmp_path / "cell_flash"
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    tokens = {r["step"]: r["tokens_seen"] for r in recs if "loss" in r}
    evals = [r for r in recs if "eval/loss" in r]
    assert [r["step"] for r in evals] == [3, 6]
    assert all(r["tokens_seen"] == tokens[r["step"]] == 8 * 64 * r["step"] for r in evals)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steady/steps"] == 4 and summary["steady/tflops_paper"] > 0
    (_, r), = of_type(wandb_records(run), "run")
    assert r.run.display_name == "cell_flash" and r.run.run_group == "paper-table"
    assert list(r.run.tags) == ["tiny", "64", "flash"]
    assert wandb_summary(wandb_records(run))["steady/steps"] == 4
