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
    fake_run(tmp_path / "run_a", mfu=True), fake_run(tmp_path / "run_b", mfu=True)
    r = subprocess.run([sys.executable, str(SCRIPT), "run_a", "run_b", "-o", "c.png"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert is_png(tmp_path / "c.png")
    r = subprocess.run([sys.executable, str(SCRIPT), "missing", "-o", "d.png"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "no metrics.jsonl in 'missing'" in r.stderr


def with_tokens(path: Path, steps: int, tokens_per_step: int = 512, eval_tokens: bool = True) -> Path:
    """A run whose train records carry tokens_seen (and its eval records too unless eval_tokens=False)."""
    path.mkdir(parents=True)
    with open(path / "metrics.jsonl", "w") as f:
        for s in range(1, steps + 1):
            f.write(json.dumps({"step": s, "loss": 5.0 / s, "tflops_paper": 1.0, "mfu_paper": 0.4,
                                "tokens_seen": s * tokens_per_step}) + "\n")
            if s % 5 == 0:
                ev = {"step": s, "eval/loss": 6.0 / s}
                if eval_tokens:
                    ev["tokens_seen"] = s * tokens_per_step
                f.write(json.dumps(ev) + "\n")
    (path / "config.yaml").write_text(f"model:\n  attention: a{steps}\n  seq_len: 64\n")
    return path


def test_series_against_tokens(tmp_path):
    recs = plot_runs.read_metrics(with_tokens(tmp_path / "new", 10))
    assert plot_runs.series(recs, "loss", "tokens")[0] == [512.0 * s for s in range(1, 11)]
    assert plot_runs.series(recs, "eval/loss", "tokens")[0] == [2560.0, 5120.0]
    old = plot_runs.read_metrics(with_tokens(tmp_path / "old", 10, eval_tokens=False))
    assert plot_runs.series(old, "eval/loss", "tokens")[0] == [2560.0, 5120.0]  # from the train record
    assert plot_runs.series(plot_runs.read_metrics(fake_run(tmp_path / "none", mfu=True)), "loss", "tokens") == ([], [])


def test_style_for_gives_each_run_its_own_style():
    styles = [plot_runs.style_for(i) for i in range(40)]
    assert len({(s["color"], s["linestyle"], s["marker"]) for s in styles}) == 40
    first8 = styles[:8]  # distinct even where colours cannot be told apart
    assert len({(s["linestyle"], s["marker"]) for s in first8}) == 8 and len({s["color"] for s in first8}) == 8


def test_short_run_drawn_on_top():
    runs = {"long": [{"step": s} for s in range(1, 101)], "short": [{"step": s} for s in range(1, 11)],
            "mid": [{"step": s} for s in range(1, 51)]}
    z = plot_runs.z_orders(runs)
    assert z["short"] > z["mid"] > z["long"]


def test_plot_against_tokens_with_visible_overlaps(tmp_path, monkeypatch):
    a, b = with_tokens(tmp_path / "run_a", 40), with_tokens(tmp_path / "run_b", 12)
    figs = []
    monkeypatch.setattr(plot_runs.plt, "close", figs.append)  # keep the figure to inspect it
    out = tmp_path / "tokens.png"
    assert plot_runs.main([str(a), str(b), "-o", str(out), "--x", "tokens", "--label", "model.attention"]) == 0
    assert is_png(out)
    (fig,) = figs
    mfu_ax = fig.axes[2]
    assert all(ax.get_xlabel() == "tokens" for ax in fig.axes)
    la, lb = mfu_ax.get_lines()
    assert (la.get_label(), lb.get_label()) == ("attention=a40", "attention=a12")
    assert list(la.get_xdata()) == [512.0 * s for s in range(1, 41)]
    assert la.get_linestyle() != lb.get_linestyle() and la.get_marker() != lb.get_marker()
    assert la.get_color() != lb.get_color() and la.get_alpha() < 1
    assert lb.get_zorder() > la.get_zorder()  # the short run above


def test_label_key_missing_errors_clearly(tmp_path):
    a = with_tokens(tmp_path / "run_a", 5)
    with pytest.raises(SystemExit, match="--label model.nope: no such key"):
        plot_runs.main([str(a), "-o", str(tmp_path / "x.png"), "--label", "model.nope"])
    with pytest.raises(SystemExit, match="no config.yaml in"):
        plot_runs.main([str(fake_run(tmp_path / "b", mfu=True)), "-o", str(tmp_path / "x.png"), "--label", "model.attention"])
    assert not (tmp_path / "x.png").exists()
