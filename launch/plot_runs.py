"""Compare runs side by side from their metrics.jsonl files.

    python launch/plot_runs.py runs/a runs/b -o compare.png [--smooth 20] [--x tokens]
        [--label model.attention --label model.seq_len]

Panels (x = optimizer step, or with --x tokens the tokens trained on (key tokens_seen); one line per
run, labelled by run folder name, or with --label KEY by that key's value in the run's config.yaml):
  loss              train (the run's line) and eval (its marker, open, no line) when logged
  (--smooth N: trailing moving average of N logged points on the train curves, not on eval)
  TFLOP/s per GPU   model FLOPs, paper convention (key tflops_paper)
  MFU (paper)       percent of peak (key mfu_paper); only when some run reports it (not on CPU)
Overlapping curves stay visible: each run has its own colour, line style and marker (style_for),
lines are slightly transparent, and a shorter run is drawn above a longer one (z_orders).
Reads only JSON and YAML, so it imports nothing from this repository and runs from any directory.
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

Series = Tuple[List[float], List[float]]
X_KEYS = {"step": "step", "tokens": "tokens_seen"}  # --x choice -> record key
LINE_STYLES = ["-", "--", "-.", ":"]
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]
ALPHA = 0.8  # lines slightly transparent, so one under another still shows


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


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def series(records: List[dict], key: str, x: str = "step") -> Series:
    """(xs, values) of the records that carry a number under `key`, x = "step" or "tokens" (the
    record's tokens_seen, else that of the train record of the same step: eval records of older runs
    lack it); records without an x are left out; a later duplicate step wins."""
    tokens = {int(r["step"]): r["tokens_seen"] for r in records
              if "step" in r and _is_number(r.get("tokens_seen"))}
    by_step: Dict[int, Tuple[float, float]] = {}
    for r in records:
        v = r.get(key)
        if not _is_number(v) or "step" not in r:
            continue
        step = int(r["step"])
        xv = step if x == "step" else r.get("tokens_seen", tokens.get(step))
        if _is_number(xv):
            by_step[step] = (float(xv) if x != "step" else step, float(v))
    steps = sorted(by_step)
    return [by_step[s][0] for s in steps], [by_step[s][1] for s in steps]


def style_for(i: int) -> dict:
    """Colour, line style and marker of the i-th run: the three cycle at different lengths (10, 4, 8),
    so the first 40 runs each get a combination of their own, and two runs of one colour differ in
    line style or marker."""
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return {"color": colors[i % len(colors)], "linestyle": LINE_STYLES[i % len(LINE_STYLES)],
            "marker": MARKERS[i % len(MARKERS)]}


def z_orders(runs: Dict[str, List[dict]]) -> Dict[str, float]:
    """Drawing order: a run with fewer logged steps above a longer one (higher zorder), so a long
    run's curve cannot hide a short one; ties keep the command line's order."""
    length = {name: len({r["step"] for r in recs if "step" in r}) for name, recs in runs.items()}
    ranked = sorted(runs, key=lambda name: -length[name])  # longest first, stable
    return {name: 2.0 + i / max(1, len(ranked)) for i, name in enumerate(ranked)}


def _markevery(n: int, i: int):
    """About 8 markers along a curve of n points, offset per run so markers of overlapping runs do
    not sit on each other."""
    every = max(1, n // 8)
    return (i % every, every)


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


def plot(runs: Dict[str, List[dict]], out: Path, smooth_n: int = 1, x: str = "step") -> Path:
    has_mfu = any(series(recs, "mfu_paper", x)[0] for recs in runs.values())
    ncols = 3 if has_mfu else 2
    fig, axes = plt.subplots(1, ncols, figsize=(6 * ncols, 4.5))
    z = z_orders(runs)

    def line(ax, xs, ys, i, name, label):
        ax.plot(xs, ys, **style_for(i), ms=4, alpha=ALPHA, zorder=z[name], label=label,
                markevery=_markevery(len(xs), i))

    for i, (name, recs) in enumerate(runs.items()):
        xs, loss = series(recs, "loss", x)
        if xs:
            line(axes[0], xs, smooth(loss, smooth_n), i, name, f"{name} train")
        xs, loss = series(recs, "eval/loss", x)
        if xs:  # eval: the run's colour and marker, points only, open
            style = style_for(i)
            axes[0].plot(xs, loss, linestyle="none", marker=style["marker"], color=style["color"], ms=6,
                         mfc="none", alpha=ALPHA, zorder=z[name], label=f"{name} eval")
        xs, tflops = series(recs, "tflops_paper", x)
        line(axes[1], xs, smooth(tflops, smooth_n), i, name, name)
        if has_mfu:
            xs, mfu = series(recs, "mfu_paper", x)
            line(axes[2], xs, [100 * m for m in smooth(mfu, smooth_n)], i, name, name)
    titles = ["loss", "model TFLOP/s per GPU (paper formula)", "MFU % (paper formula)"]
    for ax, title in zip(axes, titles):
        ax.set_title(title)
        ax.set_xlabel("tokens" if x == "tokens" else "step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def config_value(run_dir: Path, key: str) -> str:
    """The value of dotted `key` (e.g. model.attention) in run_dir/config.yaml, as text; SystemExit
    with a clear message if the file or the key is missing."""
    import yaml  # PyYAML, installed with omegaconf

    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise SystemExit(f"plot_runs: --label {key}: no config.yaml in '{run_dir}' (expected {path}); "
                         f"label by folder name instead (leave out --label)")
    node = yaml.safe_load(path.read_text())
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            raise SystemExit(f"plot_runs: --label {key}: no such key in {path}; give a dotted key of "
                             f"that file, e.g. --label model.attention")
        node = node[part]
    return str(node)


def run_label(run_dir: Path, keys: List[str]) -> str:
    """The folder name, or with --label keys 'attention=flash seq_len=8192' from config.yaml."""
    if not keys:
        return run_dir.resolve().name
    return " ".join(f"{k.split('.')[-1]}={config_value(run_dir, k)}" for k in keys)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description="Plot loss and throughput of runs side by side.")
    p.add_argument("run_dirs", nargs="+", type=Path, help="run folders holding metrics.jsonl")
    p.add_argument("-o", "--output", type=Path, default=Path("compare.png"), help="PNG to write")
    p.add_argument("--smooth", type=int, default=1, help="moving-average window in logged points")
    p.add_argument("--x", choices=sorted(X_KEYS), default="step",
                   help="x axis: optimizer step, or tokens trained on (key tokens_seen)")
    p.add_argument("--label", action="append", default=[], metavar="KEY",
                   help="label runs by this dotted key of their config.yaml (e.g. model.attention); repeatable")
    args = p.parse_args(argv)
    runs: Dict[str, List[dict]] = {}
    for d in args.run_dirs:
        name = run_label(d, args.label)
        while name in runs:  # two runs with one label: keep both
            name += "'"
        runs[name] = read_metrics(d)
    out = plot(runs, args.output, args.smooth, args.x)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
