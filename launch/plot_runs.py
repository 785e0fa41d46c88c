"""Compare runs side by side from their metrics.jsonl files.

    python launch/plot_runs.py runs/a runs/b -o compare.png [--smooth 20]

Panels (x = optimizer step, one line per run, labelled by run folder name):
  loss              train (solid) and eval (dashed, dots) when logged
  (--smooth N: trailing moving average of N logged points on the train curves, not on eval)
  TFLOP/s per GPU   model FLOPs, paper convention (key tflops_paper)
  MFU (paper)       percent of peak (key mfu_paper); only when some run reports it (not on CPU)
Reads only JSON, so it imports nothing from this repository and runs from any directory.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402

Series = Tuple[List[int], List[float]]


def read_metrics(run_dir: Path) -> List[dict]:
    """Records of run_dir/metrics.jsonl (torn lines skipped); SystemExit with a clear message if absent."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"plot_runs: no metrics.jsonl in '{run_dir}' (expected {path}); "
                         f"is it a run folder written with logging.jsonl=true?")
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def series(records: List[dict], key: str) -> Series:
    """(steps, values) of the records that carry a number under `key`; a later duplicate step wins."""
    by_step: Dict[int, float] = {}
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and "step" in r:
            by_step[int(r["step"])] = float(v)
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def smooth(values: List[float], n: int) -> List[float]:
    """Trailing moving average over up to n points (n <= 1: unchanged)."""
    if n <= 1:
        return list(values)
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= n:
            total -= values[i - n]
        out.append(total / min(i + 1, n))
    return out


def plot(runs: Dict[str, List[dict]], out: Path, smooth_n: int = 1) -> Path:
    has_mfu = any(series(recs, "mfu_paper")[0] for recs in runs.values())
    ncols = 3 if has_mfu else 2
    fig, axes = plt.subplots(1, ncols, figsize=(6 * ncols, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, recs) in enumerate(runs.items()):
        c = colors[i % len(colors)]
        steps, loss = series(recs, "loss")
        if steps:
            axes[0].plot(steps, smooth(loss, smooth_n), color=c, label=f"{name} train")
        steps, loss = series(recs, "eval/loss")
        if steps:
            axes[0].plot(steps, loss, "o--", color=c, ms=3, label=f"{name} eval")
        steps, tflops = series(recs, "tflops_paper")
        axes[1].plot(steps, smooth(tflops, smooth_n), color=c, label=name)
        if has_mfu:
            steps, mfu = series(recs, "mfu_paper")
            axes[2].plot(steps, [100 * m for m in smooth(mfu, smooth_n)], color=c, label=name)
    titles = ["loss", "model TFLOP/s per GPU (paper formula)", "MFU % (paper formula)"]
    for ax, title in zip(axes, titles):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description="Plot loss and throughput of runs side by side.")
    p.add_argument("run_dirs", nargs="+", type=Path, help="run folders holding metrics.jsonl")
    p.add_argument("-o", "--output", type=Path, default=Path("compare.png"), help="PNG to write")
    p.add_argument("--smooth", type=int, default=1, help="moving-average window in logged points")
    args = p.parse_args(argv)
    runs: Dict[str, List[dict]] = {}
    for d in args.run_dirs:
        name = d.resolve().name
        while name in runs:  # two folders with one name: keep both
            name += "'"
        runs[name] = read_metrics(d)
    out = plot(runs, args.output, args.smooth)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
