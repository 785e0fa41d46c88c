"""bench/paper_table.py: the paper's Table 1 as runs of launch/train.py, one per (model, context,
attention) cell, appended to one results file; a cell already there is skipped; the markdown table and
the PNG chart from the file. The end-to-end test runs the tiny CPU config with two attention columns."""
import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import paper_table
from training.telemetry.summary import steady_summary, write_summary



def _rec(model, seq, attention, tflops=None, status="ok", recompute=False, nproc=1, gpu="NVIDIA H100 80GB HBM3"):
    rec = {"model": model, "seq": seq, "attention": attention, "nproc": nproc, "gpu": gpu, "status": status,
           "recompute": recompute}
    if status == "ok":
        rec.update(tflops_paper=tflops, tflops_causal=tflops * 0.8, mfu_paper=tflops / 989,
                   tokens_per_s_per_gpu=1000.0, peak_mem_gb=10.0)
    return rec


def test_sequence_lengths():
    assert paper_table.seq_tokens("2k") == 2048 and paper_table.seq_tokens("8K") == 8192
    assert paper_table.seq_tokens("128") == 128 and paper_table.seq_label(8192) == "8k"
    with pytest.raises(SystemExit, match="--seq 'eight'"):
        paper_table.seq_tokens("eight")


def test_table_beside_the_paper():
    """Per row: our columns (TFLOP/s per GPU and MFU), * where the attention was recomputed, OOM where
    even that did not fit, our speed-ups over 'without' and over PyTorch's FA2, the paper's A100 figures
    and its own ratios (8k: 3.06x / 1.29x at 1.3B)."""
    gpu = "NVIDIA H100 80GB HBM3"
    results = [_rec("1.3b", 8192, "math", 200.0, recompute=True), _rec("1.3b", 8192, "sdpa_flash", 400.0),
               _rec("1.3b", 8192, "sdpa_cudnn", 600.0), _rec("1.3b", 8192, "flash", 690.0),
               _rec("2.7b", 8192, "math", status="oom"), _rec("2.7b", 8192, "flash", 660.0),
               _rec("1.3b", 8192, "flash", 100.0, nproc=4)]  # another GPU count: not in this table
    text = paper_table.markdown(results, 1, gpu, paper_table.DEFAULT_COLUMNS)
    row13 = next(line for line in text.splitlines() if line.startswith("| GPT3-1.3B, 8k"))
    assert "| 200 (20%)* | 400 (40%) | 600 (61%) | 690 (70%) |" in row13
    assert "| 3.45x | 1.73x | 72 / 170 / 220 (71%) | 3.06x | 1.29x |" in row13
    row27 = next(line for line in text.splitlines() if line.startswith("| GPT3-2.7B, 8k"))
    assert "| OOM | - | - | 660 (67%) | - | - | 80 / 175 / 225 (72%) | 2.81x | 1.29x |" in row27
    assert "(no cells" in paper_table.markdown(results, 2, gpu, paper_table.DEFAULT_COLUMNS)


def test_chart_is_written(tmp_path):
    results = [_rec("1.3b", 2048, "math", 150.0), _rec("1.3b", 2048, "flash", 600.0),
               _rec("2.7b", 8192, "math", status="oom"), _rec("2.7b", 8192, "flash", 660.0)]
    png = paper_table.chart(results, 1, "NVIDIA H100 80GB HBM3", ["math", "flash"], tmp_path / "t.png")
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert paper_table.chart(results, 8, "NVIDIA H100 80GB HBM3", ["math"], tmp_path / "none.png") is None


def test_results_file_survives_a_torn_line(tmp_path):
    path = tmp_path / "cells.jsonl"
    paper_table.append_result(path, _rec("1.3b", 2048, "flash", 600.0))
    with open(path, "a") as f:
        f.write('{"model": "1.3b", "se')  # a run killed while appending
    assert [r["attention"] for r in paper_table.read_results(path)] == ["flash"]


def test_bad_arguments_are_one_line():
    with pytest.raises(SystemExit):
        paper_table.parse_args(["--steps", "3", "--warmup", "3"])
    with pytest.raises(SystemExit):
        paper_table.parse_args(["train.compile"])


@pytest.mark.slow
def test_two_columns_on_the_tiny_config(tmp_path, capsys):
    """Two attention columns of the tiny CPU model, two steps each: two launch/train.py runs under
    torchrun, each an offline W&B run of the group with its tags; the results file gets both cells; a
    second call runs nothing and prints the same table."""
    out = tmp_path / "pt"
    argv = ["--nproc", "1", "--models", "tiny", "--seq", "128", "--attention", "math", "sdpa", "--steps", "2",
            "--warmup", "1", "--out-dir", str(out), "--group", "tiny-table", "train.device=cpu"]
    assert paper_table.main(argv) == 0
    cells = paper_table.read_results(out / "cells.jsonl")
    assert [(c["attention"], c["status"], c["gpu"]) for c in cells] == [("math", "ok", "cpu"), ("sdpa", "ok", "cpu")]
    for c in cells:
        assert c["tflops_paper"] > 0 and c["micro_batch"] == 8 and c["global_batch"] == 16
        run_dir = Path(c["run_dir"])
        assert run_dir.name == f"tiny-128-{c['attention']}-1gpu"
        config = OmegaConf.load(run_dir / "config.yaml")
        assert config.model.attention == c["attention"] and config.logging.group == "tiny-table"
        assert c["attention"] in config.logging.tags and "1gpu" in config.logging.tags
        assert list((run_dir / "wandb").glob("offline-run-*")), "no offline W&B run"
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["steady/steps"] == 1
    first = capsys.readouterr().out
    assert "| tiny (CPU test), 128 |" in first and (out / "paper_table_1gpu.png").is_file()

    assert paper_table.main(argv) == 0  # both cells measured already: no run
    second = capsys.readouterr().out
    assert second.count("already") == 2 and len(paper_table.read_results(out / "cells.jsonl")) == 2
    assert first.split("\n\n", 1)[1].split("chart:")[0] == second.split("\n\n", 1)[1].split("chart:")[0]


class FakeTrain:
    """paper_table.run_training in place of torchrun: records each command; a run named in `oom` prints the
    out-of-memory line and exits 2, any other writes a metrics.jsonl of 4 steps and its summary.json and
    exits 0."""

    def __init__(self, oom=()):
        self.commands, self.oom = [], set(oom)

    def __call__(self, cmd, log, timeout_s):
        self.commands.append(cmd)
        args = dict(a.split("=", 1) for a in cmd if "=" in a and not a.startswith("--"))
        run_dir = Path(args["train.out_dir"]) / args["train.run_name"]
        if args["train.run_name"] in self.oom:
            log.write_text("out of memory: out of GPU memory in the backward (...)\n")
            return 2
        run_dir.mkdir(parents=True, exist_ok=True)
        records = [{"step": step, "loss": 5.0, "tokens_per_s_per_gpu": 1000.0 * step, "tflops_paper": 100.0 * step,
                    "tflops_causal": 80.0 * step, "mfu_paper": 0.1 * step, "mem_max_alloc_gb": 50.0}
                   for step in range(1, 5)]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        # what the run's logger writes when it ends (training/telemetry/logging.py)
        write_summary(run_dir / "summary.json",
                      steady_summary(records, int(args["logging.summary_warmup_steps"])))
        log.write_text("done\n")
        return 0


def _cell(tmp_path, monkeypatch, attention, seq, memory_gb, oom=(), model="1.3b", extra=()):
    fake = FakeTrain(oom)
    monkeypatch.setattr(paper_table, "run_training", fake)
    monkeypatch.setattr(paper_table, "gpu_memory_gb", lambda: memory_gb)
    args = paper_table.parse_args(["--out-dir", str(tmp_path), "--steps", "4", "--warmup", "2", *extra])
    rec = paper_table.Cell(args, model, seq, attention, "NVIDIA H100 80GB HBM3").run()
    return rec, [next(a for a in c if a.startswith("model.recompute_attention=")) for c in fake.commands]


def test_math_runs_out_of_memory_then_recomputes(tmp_path, monkeypatch):
    """'without FlashAttention' at 2k: the plain run runs out of memory, the recomputed one is the cell
    (marked); the medians are those of the steps after the warm-up."""
    rec, tries = _cell(tmp_path, monkeypatch, "math", 2048, 80.0, oom=["1.3b-2k-math-1gpu"])
    assert tries == ["model.recompute_attention=false", "model.recompute_attention=true"]
    assert rec["status"] == "ok" and rec["recompute"] and rec["tflops_paper"] == 350.0 and rec["micro_batch"] == 8


def test_math_whose_scores_exceed_the_gpu_recomputes_at_once(tmp_path, monkeypatch):
    """At 8k the probabilities alone (24 layers x 16 heads x 2 x 8192^2 x 2 bytes = 103 GB) exceed an
    80 GB GPU: no plain try. Both tries out of memory: the cell is OOM."""
    assert paper_table.score_matrices_gb(24, 16, 2, 8192) == pytest.approx(103.08, abs=0.01)
    rec, tries = _cell(tmp_path, monkeypatch, "math", 8192, 80.0)
    assert tries == ["model.recompute_attention=true"] and rec["recompute"] and rec["scores_gb"] == 103.1
    names = ["1.3b-2k-math-1gpu", "1.3b-2k-math-1gpu-recompute"] + [f"1.3b-2k-math-1gpu-recompute-mb{m}"
                                                                    for m in (4, 2, 1)]
    rec, tries = _cell(tmp_path, monkeypatch, "math", 2048, 80.0, oom=names)
    assert rec["status"] == "oom" and len(tries) == 5 and paper_table._cell_text(rec) == "OOM"


def test_math_recomputed_out_of_memory_halves_the_micro_batch(tmp_path, monkeypatch):
    """8k, micro-batch 2: recomputed still out of memory, then micro-batch 1 with the same 4 sequences per
    step (4 micro-batches accumulated): the cell, marked * and mb1."""
    fake = FakeTrain(oom=["1.3b-8k-math-1gpu-recompute"])
    monkeypatch.setattr(paper_table, "run_training", fake)
    monkeypatch.setattr(paper_table, "gpu_memory_gb", lambda: 80.0)
    args = paper_table.parse_args(["--out-dir", str(tmp_path), "--steps", "4", "--warmup", "2"])
    rec = paper_table.Cell(args, "1.3b", 8192, "math", "NVIDIA H100 80GB HBM3").run()
    micro = [next(a for a in c if a.startswith("train.micro_batch_size=")) for c in fake.commands]
    glob = {next(a for a in c if a.startswith("train.global_batch_size=")) for c in fake.commands}
    assert micro == ["train.micro_batch_size=2", "train.micro_batch_size=1"] and glob == {"train.global_batch_size=4"}
    assert rec["status"] == "ok" and rec["micro_batch"] == 1 and rec["config_micro_batch"] == 2
    assert paper_table._cell_text(rec).endswith("* mb1") and rec["run_dir"].endswith("-recompute-mb1")


def test_math_whose_scores_and_optimizer_state_exceed_the_gpu_recomputes_at_once(tmp_path, monkeypatch):
    """2.7B at 2k, micro-batch 8: probabilities 32 layers x 20 heads x 8 x 2048^2 x 2 bytes = 43 GB and fp32
    weights, gradients and AdamW moments 16 x 2.67B = 43 GB exceed 80 GB together (not alone): no plain try;
    on a 141 GB GPU the plain run comes first. Sharded (FSDP on 4 GPUs) the state is a quarter."""
    rec, tries = _cell(tmp_path, monkeypatch, "math", 2048, 80.0, model="2.7b")
    assert tries == ["model.recompute_attention=true"]
    assert rec["scores_gb"] == pytest.approx(42.9, abs=0.1) and rec["state_gb"] == pytest.approx(42.7, abs=0.1)
    _, tries = _cell(tmp_path, monkeypatch, "math", 2048, 141.0, model="2.7b")
    assert tries == ["model.recompute_attention=false"]
    args = paper_table.parse_args(["--nproc", "4", "engine.parallel=fsdp"])
    cell = paper_table.Cell(args, "2.7b", 2048, "math", "NVIDIA H100 80GB HBM3")
    assert cell.state_gb == pytest.approx(rec["state_gb"] / 4, abs=0.1)


def test_other_columns_run_once(tmp_path, monkeypatch):
    rec, tries = _cell(tmp_path, monkeypatch, "flash", 8192, 80.0)
    assert tries == ["model.recompute_attention=false"] and rec["status"] == "ok" and rec["micro_batch"] == 2


def test_a_relative_out_dir_is_the_callers_and_the_run_starts_in_the_repository(tmp_path, monkeypatch):
    """--out-dir relative to the folder paper_table is called from, though every run starts in the
    repository (its launch/train.py path is relative there): the run folder and the results file land in
    the caller's folder."""
    fake = FakeTrain()
    monkeypatch.setattr(paper_table, "run_training", fake)
    monkeypatch.setattr(paper_table, "gpu_memory_gb", lambda: 80.0)
    monkeypatch.chdir(tmp_path)
    args = paper_table.parse_args(["--out-dir", "pt", "--steps", "4", "--warmup", "2"])
    rec = paper_table.Cell(args, "1.3b", 2048, "flash", "NVIDIA H100 80GB HBM3").run()
    assert "launch/train.py" in fake.commands[0]
    assert (paper_table.ROOT / fake.commands[0][fake.commands[0].index("launch/train.py")]).is_file()
    assert Path(rec["run_dir"]) == tmp_path / "pt" / "1.3b-2k-flash-1gpu" and (tmp_path / "pt" / "1.3b-2k-flash-1gpu").is_dir()
    assert args.results == tmp_path / "pt" / "cells.jsonl"


def test_a_cell_held_out_of_memory_goes_on_at_its_next_try(tmp_path, monkeypatch, capsys):
    """A results file whose 8k "without" cell ran out of memory recomputed at micro-batch 2 (a ladder that
    then ended there): the next call runs micro-batch 1 only and appends the cell; a cell held as run, or
    out of memory at its ladder's last try, is skipped."""
    fake = FakeTrain()
    monkeypatch.setattr(paper_table, "run_training", fake)
    monkeypatch.setattr(paper_table, "gpu_memory_gb", lambda: 80.0)
    monkeypatch.setattr(paper_table, "gpu_name", lambda: "NVIDIA H100 80GB HBM3")
    results = tmp_path / "cells.jsonl"
    base = {"model": "1.3b", "seq": 8192, "nproc": 1, "gpu": "NVIDIA H100 80GB HBM3", "config_micro_batch": 2}
    paper_table.append_result(results, {**base, "attention": "math", "status": "oom", "recompute": True,
                                        "micro_batch": 2})
    paper_table.append_result(results, {**base, "attention": "flash", "status": "ok", "recompute": False,
                                        "micro_batch": 2, "tflops_paper": 600.0, "mfu_paper": 0.6})
    argv = ["--out-dir", str(tmp_path), "--results", str(results), "--steps", "4", "--warmup", "2",
            "--models", "1.3b", "--seq", "8k", "--attention", "math", "flash"]
    assert paper_table.main(argv) == 0
    assert len(fake.commands) == 1 and "train.micro_batch_size=1" in fake.commands[0]
    latest = paper_table.read_results(results)[-1]
    assert latest["attention"] == "math" and latest["status"] == "ok" and latest["micro_batch"] == 1
    assert "* mb1" in capsys.readouterr().out
    assert paper_table.main(argv) == 0 and len(fake.commands) == 1  # both held now
    paper_table.append_result(results, {**latest, "status": "oom"})  # out of memory at the last rung too
    assert paper_table.main(argv) == 0 and len(fake.commands) == 1
