"""launch/plot_runs.py: PNG for two fake runs, clear error for a folder without metrics.jsonl."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from launch import plot_runs

SCRIPT = Path(plot_runs.__file__).resolve()


def fake_run(path: Path, mfu: bool, steps: int = 20) -> Path:
    path.mkdir(parents=True)
    with open(path / "metrics.jsonl", "w") as f:
        for s in range(1, steps + 1):
            rec = {"step": s, "time": 1e9 + s, "loss": 5.0 / s, "tflops_paper": 0.5 + 0.01 * s,
                   "mfu_paper": 0.4 if mfu else None}
            f.write(json.dumps(rec) + "\n")
            if s % 10 == 0:
                f.write(json.dumps({"step": s, "time": 1e9 + s, "eval/loss": 6.0 / s}) + "\n")
        f.write('{"step": 99, "lo')  # torn last line
    return path


def is_png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_two_runs_png(tmp_path, capsys):
    a, b = fake_run(tmp_path / "run_a", mfu=True), fake_run(tmp_path / "run_b", mfu=False)
    out = tmp_path / "plots" / "compare.png"
    assert plot_runs.main([str(a), str(b), "-o", str(out), "--smooth", "3"]) == 0
    assert is_png(out) and "wrote" in capsys.readouterr().out


def test_series_and_smooth(tmp_path):
    recs = plot_runs.read_metrics(fake_run(tmp_path / "r", mfu=False))
    steps, values = plot_runs.series(recs, "eval/loss")
    assert steps == [10, 20] and values == pytest.approx([0.6, 0.3])
    assert plot_runs.series(recs, "mfu_paper") == ([], [])
    assert plot_runs.smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


def test_missing_run_errors_clearly(tmp_path):
    a = fake_run(tmp_path / "run_a", mfu=True)
    with pytest.raises(SystemExit, match="no metrics.jsonl in .*nope"):
        plot_runs.main([str(a), str(tmp_path / "nope"), "-o", str(tmp_path / "x.png")])
    assert not (tmp_path / "x.png").exists()


def test_runs_as_script_from_any_directory(tmp_path):
    a, b = fake_run(tmp_path / "run_a", mfu=True), fake_run(tmp_path / "run_b", mfu=True)
    r = subprocess.run([sys.executable, str(SCRIPT), "run_a", "run_b", "-o", "c.png"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert is_png(tmp_path / "c.png")
    r = subprocess.run([sys.executable, str(SCRIPT), "missing", "-o", "d.png"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "no metrics.jsonl in 'missing'" in r.stderr
