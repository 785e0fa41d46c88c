"""bench/summarize_runs.py: medians after the warm-up, and the per-GPU ratio against a baseline run
(the scaling efficiency of bench/scaling_run.sh)."""
import json
from pathlib import Path

import summarize_runs  # bench/ (tests/bench/conftest.py puts it on the path)


def fake_run(folder: Path, tok_per_gpu, profiled_step=None):
    folder.mkdir(parents=True)
    shares = {"time_share_attention": 0.3, "time_share_matmul": 0.5, "time_share_communication": 0.15,
              "time_share_other": 0.05}
    lines = [json.dumps({"step": i + 1, "loss": 10.0 - i, "tokens_per_s_per_gpu": t, "tflops_paper": t / 100,
                         "tflops_causal": t / 200, "mfu_paper": 0.5, "mfu_causal": 0.25, "mem_max_alloc_gb": 1.0 + i,
                         **(shares if i + 1 == profiled_step else {})})
             for i, t in enumerate(tok_per_gpu)]
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_baseline_column_is_the_per_gpu_ratio(tmp_path, capsys):
    fake_run(tmp_path / "n1", [1.0, 1.0, 1.0, 1000.0, 1000.0, 1000.0])
    fake_run(tmp_path / "n8", [5.0, 5.0, 5.0, 900.0, 950.0, 920.0])
    assert summarize_runs.main(["--warmup", "3", "--baseline", str(tmp_path / "n1"),
                                str(tmp_path / "n1"), str(tmp_path / "n8")]) == 0
    out = capsys.readouterr().out
    assert "| per GPU vs n1 |" in out.splitlines()[0]
    n1, n8 = [r for r in out.splitlines() if r.startswith("| n")]
    assert "| 1.000 |" in n1 and "| 0.920 |" in n8  # median of 900/950/920 over 1000; warm-up ignored
    assert "| 6.0 |" in n8  # peak memory: max over all steps
    assert "| 50.0% | 25.0% |" in n8  # MFU by the paper's formula, then causal-aware


def test_the_profiled_step_is_left_out_and_its_shares_shown(tmp_path, capsys):
    fake_run(tmp_path / "cp", [1.0, 1.0, 1.0, 1000.0, 1000.0, 10.0], profiled_step=6)  # the profiler: slow
    fake_run(tmp_path / "plain", [1.0, 1.0, 1.0, 1000.0, 1000.0, 1000.0])
    assert summarize_runs.main(["--warmup", "3", str(tmp_path / "cp"), str(tmp_path / "plain")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "attention / matmul / communication / other" in lines[0]
    cp, plain = [r for r in lines if r.startswith("| cp") or r.startswith("| plain")]
    assert "| 1.0k |" in cp  # median of 1000, 1000: step 6 (profiled) left out
    assert "| 30% / 50% / 15% / 5% |" in cp and "| - |" in plain
