"""bench/summarize_runs.py: medians after the warm-up, and the per-GPU ratio against a baseline run
(the scaling efficiency of bench/scaling_run.sh)."""
import json
from pathlib import Path

import summarize_runs  # bench/ (tests/bench/conftest.py puts it on the path)


def fake_run(folder: Path, tok_per_gpu):
    folder.mkdir(parents=True)
    lines = [json.dumps({"step": i + 1, "loss": 10.0 - i, "tokens_per_s_per_gpu": t, "tflops_paper": t / 100,
                         "tflops_causal": t / 200, "mfu_paper": 0.5, "mem_max_alloc_gb": 1.0 + i})
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
