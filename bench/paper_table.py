"""The FlashAttention-2 paper's Table 1 (GPT-style training, model TFLOP/s per GPU) as real training
runs: for each cell one `launch/train.py` run under torchrun on N GPUs, identical in everything but the
attention, each a W&B run of one group; the cells go into one results file, then a markdown table
beside the paper's A100 figures and a PNG bar chart.

    python bench/paper_table.py --nproc 1                                  # all 16 cells
    python bench/paper_table.py --nproc 4 --seq 8k --steps 12              # the 8k rows on 4 GPUs
    python bench/paper_table.py --nproc 1 --models 1.3b --attention math flash
    python bench/paper_table.py --table-only                               # table and chart of the file

Columns (model.attention): math = "without FlashAttention" (scores materialised, fp32 softmax; a run
that runs out of memory is retried with model.recompute_attention=true, marked * in the table, then at
half the micro-batch and less (the same sequences per step through more accumulation, marked mbN), and
is OOM if all fail; where the s x s probabilities kept for the backward and the fp32 weights, gradients
and AdamW moments alone exceed the GPU's memory the first try is skipped), sdpa_flash = PyTorch SDPA's
FlashAttention-2 backend, sdpa_cudnn = SDPA's cuDNN backend (a column the paper could not have), flash =
ours. Rows: GPT3-1.3B / 2.7B
(configs/gpt_1.3b_8k.yaml, gpt_2.7b_8k.yaml) at 2k and 8k tokens; at 2k the micro-batch holds as many
tokens as the config's at 8k. Every run: the config's model and training settings, `--accum`
micro-batches per optimizer step per GPU, `--steps` steps, no evaluation or checkpoints; its figure is
the median over the steps after `--warmup` of its own metrics.jsonl (what its W&B run shows).

Model FLOPs per token by the paper's formula 6·N + 12·L·d·s (attention counted non-causal), MFU
against the GPU's dense bf16 peak (989 TFLOP/s on an H100 SXM; the paper's against the A100's 312).
Cells already in the results file are skipped unless --force (one held as out of memory goes on at the
try after its last, where the ladder has one); the file is appended to, so the grid can be run in parts
(a 10-minute window each).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from process_tree import Launch, terminate_raises  # noqa: E402  (bench/, beside this file)
from training.config import load_config  # noqa: E402
from training.telemetry.summary import read_jsonl  # noqa: E402

MODELS = {"1.3b": ("gpt_1.3b_8k.yaml", "GPT3-1.3B"), "2.7b": ("gpt_2.7b_8k.yaml", "GPT3-2.7B"),
          "tiny": ("tiny_cpu.yaml", "tiny (CPU test)")}
COLUMNS = {"math": "without FlashAttention", "sdpa_flash": "PyTorch SDPA FlashAttention-2",
           "sdpa_cudnn": "PyTorch SDPA cuDNN", "flash": "ours", "sdpa": "PyTorch SDPA (its own pick)"}
DEFAULT_COLUMNS = ["math", "sdpa_flash", "sdpa_cudnn", "flash"]
# The paper's Table 1: 8 x A100 80GB, model TFLOP/s per GPU; its columns "without FlashAttention",
# "FlashAttention" (v1) and "FlashAttention-2".
PAPER = {("1.3b", 2048): (142, 189, 196), ("1.3b", 8192): (72, 170, 220),
         ("2.7b", 2048): (149, 189, 205), ("2.7b", 8192): (80, 175, 225)}
A100_PEAK_TFLOPS = 312
OOM_TEXT = "out of GPU memory"  # training/resilience/out_of_memory.py's one line


def seq_tokens(text: str) -> int:
    """'2k' -> 2048, '8k' -> 8192, '128' -> 128."""
    t = text.strip().lower()
    try:
        return int(t[:-1]) * 1024 if t.endswith("k") else int(t)
    except ValueError:
        raise SystemExit(f"--seq {text!r}: give a length like 2k, 8k or 512") from None


def seq_label(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def query_gpu(field: str) -> Optional[str]:
    """One nvidia-smi field of the first GPU (no CUDA context in this process: the runs need the
    memory); None without a GPU."""
    smi = shutil.which("nvidia-smi")
    if smi:
        done = subprocess.run([smi, f"--query-gpu={field}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True)
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout.strip().splitlines()[0].strip()
    return None


def gpu_memory_gb() -> Optional[float]:
    """Memory of the first GPU, GB (None without one)."""
    total_mib = query_gpu("memory.total")
    return None if total_mib is None else float(total_mib) / 1024


def score_matrices_gb(n_layer: int, n_head: int, micro: int, seq: int) -> float:
    """What `math` attention keeps for the backward beyond the other columns: one s x s probability
    matrix per head and layer in bf16 (2 bytes), GB."""
    return n_layer * n_head * micro * seq * seq * 2 / 1e9


def model_state_gb(cfg, nproc: int) -> float:
    """fp32 weights, gradients and AdamW's two moments (16 bytes a parameter) per GPU, GB: divided over
    the GPUs only where the engine shards them (FSDP, DeepSpeed ZeRO)."""
    sharded = cfg.engine.parallel == "fsdp" or (cfg.engine.type == "deepspeed" and cfg.engine.zero_stage > 0)
    return 16 * cfg.model.num_params() / 1e9 / (nproc if sharded else 1)


def gpu_name() -> str:
    return query_gpu("name") or "cpu"


def run_training(cmd: List[str], log: Path, timeout_s: float) -> int:
    """One cell's torchrun in the repository root, its output in `log`; its exit code. Past `timeout_s`,
    or if this tool is stopped, the launch and every worker are killed (TimeoutError, or the stop goes on)."""
    return Launch(cmd, log, cwd=ROOT, append=False).finish(time.monotonic() + timeout_s)


def cell_key(rec: dict) -> tuple:
    return rec["model"], rec["seq"], rec["attention"], rec["nproc"], rec["gpu"]


def read_results(path: Path) -> List[dict]:
    """The results file's cells; a torn last line (a run killed while appending) is skipped."""
    return read_jsonl(path) if path.is_file() else []


def append_result(path: Path, rec: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())


class Cell:
    """One run of the grid: model, sequence length, attention column, GPUs."""

    def __init__(self, args, model: str, seq: int, attention: str, gpu: str):
        self.model, self.seq, self.attention, self.nproc, self.gpu = model, seq, attention, args.nproc, gpu
        self.args = args
        cfg = load_config(MODELS[model][0], list(args.override))
        self.config_seq = cfg.model.seq_len
        tokens_per_micro = cfg.train.micro_batch_size * cfg.model.seq_len
        self.micro = max(1, tokens_per_micro // seq)
        self.scores_gb = score_matrices_gb(cfg.model.n_layer, cfg.model.n_head, self.micro, seq)
        self.state_gb = model_state_gb(cfg, args.nproc)
        self.global_batch = self.micro * args.accum * args.nproc
        self.name = f"{model}-{seq_label(seq)}-{attention}-{args.nproc}gpu"

    def run_name(self, recompute: bool, micro: int) -> str:
        return self.name + ("-recompute" if recompute else "") + ("" if micro == self.micro else f"-mb{micro}")

    def tries(self) -> List[tuple]:
        """(recompute_attention, micro-batch) in order: math plain, then recomputed, then recomputed at
        half the micro-batch and less (the same sequences per step through more accumulation) while the
        global batch divides; every other column once, as configured."""
        if self.attention != "math":
            return [(False, self.micro)]
        out, m = [(False, self.micro), (True, self.micro)], self.micro // 2
        while m >= 1 and self.global_batch % (m * self.nproc) == 0:
            out.append((True, m))
            m //= 2
        return out

    def key(self) -> tuple:
        return self.model, self.seq, self.attention, self.nproc, self.gpu

    def command(self, recompute: bool, micro: int) -> List[str]:
        a = self.args
        tags = [self.model, seq_label(self.seq), self.attention, f"{self.nproc}gpu", self.gpu.replace(" ", "_")]
        overrides = [
            f"model.seq_len={self.seq}", f"model.attention={self.attention}",
            f"model.recompute_attention={str(recompute).lower()}",
            f"train.micro_batch_size={micro}", f"train.global_batch_size={self.global_batch}",
            f"train.max_steps={a.steps}", f"train.run_name={self.run_name(recompute, micro)}",
            f"train.out_dir={a.out_dir}", "train.resume=none", "train.overwrite=true",
            "train.eval_interval=0", "train.ckpt_interval=0", "train.save_final=false",
            f"logging.wandb={a.wandb}", f"logging.project={a.project}", f"logging.group={a.group}",
            "logging.tags=[" + ",".join(tags) + "]", "logging.progress=false",
            f"logging.summary_warmup_steps={a.warmup}",
            *a.override,
        ]
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={self.nproc}",
                "launch/train.py", "--config", MODELS[self.model][0], *overrides]  # run from ROOT

    def resume_from(self, prev: dict) -> Optional[int]:
        """Where a cell already in the results file goes on: at the try after the one its record ran out
        of memory at (a ladder that gained rungs since, e.g. a smaller micro-batch), else None (held)."""
        if prev.get("status") != "oom":
            return None
        tries = self.tries()
        last = (prev.get("recompute"), prev.get("micro_batch"))
        after = tries.index(last) + 1 if last in tries else len(tries)
        return after if after < len(tries) else None

    def run(self, start: int = 0) -> dict:
        """The cell's record, from try `start` of tries() on."""
        rec = {"model": self.model, "seq": self.seq, "attention": self.attention, "nproc": self.nproc,
               "gpu": self.gpu, "micro_batch": self.micro, "config_micro_batch": self.micro,
               "global_batch": self.global_batch,
               "steps": self.args.steps, "warmup": self.args.warmup,
               "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
        tries = self.tries()[start:]
        memory = gpu_memory_gb()
        if start == 0 and self.attention == "math" and memory is not None and self.scores_gb + self.state_gb > memory:
            # the probabilities and the optimizer state alone exceed the GPU: straight to the recomputed
            # attention (a plain try would compile, then fail at its first step)
            print(f"[{self.name}] the s x s scores ({self.scores_gb:.0f} GB) and the weights, gradients and "
                  f"AdamW moments ({self.state_gb:.0f} GB) exceed {memory:.0f} GB: model.recompute_attention=true",
                  flush=True)
            tries = tries[1:]
            rec.update(scores_gb=round(self.scores_gb, 1), state_gb=round(self.state_gb, 1))
        for recompute, micro in tries:
            cmd = self.command(recompute, micro)
            run_dir = Path(self.args.out_dir) / self.run_name(recompute, micro)
            log = Path(self.args.out_dir) / f"{run_dir.name}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            print(f"[{self.name}] {' '.join(cmd[3:])}", flush=True)
            try:
                code = run_training(cmd, log, self.args.run_timeout)
            except TimeoutError:
                raise SystemExit(f"[{self.name}] launch/train.py ran past --run-timeout {self.args.run_timeout:.0f} s "
                                 f"and was stopped; log {log}") from None
            text = log.read_text(errors="replace")
            rec.update(recompute=recompute, micro_batch=micro, run_dir=str(run_dir), log=str(log),
                       command=" ".join(cmd[1:]))
            if code == 0:  # the run's own medians after the warm-up (logging.summary_warmup_steps)
                s = json.loads((run_dir / "summary.json").read_text())
                rec.update(status="ok", tflops_paper=s["steady/tflops_paper"], tflops_causal=s["steady/tflops_causal"],
                           tokens_per_s_per_gpu=s["steady/tokens_per_s_per_gpu"], mfu_paper=s["steady/mfu_paper"],
                           peak_mem_gb=s["peak_mem_gb"], timed_steps=s["steady/steps"])
                return rec
            if OOM_TEXT in text:
                rec["status"] = "oom"
                continue
            tail = "\n".join(text.splitlines()[-15:])
            raise SystemExit(f"[{self.name}] launch/train.py exited {code}; log {log}:\n{tail}")
        return rec


# --- the table and the chart ---------------------------------------------------------------------
def _cell_text(rec: Optional[dict], with_mfu: bool = True) -> str:
    if rec is None:
        return "-"
    if rec["status"] == "oom":
        return "OOM"
    mfu = f" ({100 * rec['mfu_paper']:.0f}%)" if with_mfu and rec.get("mfu_paper") else ""
    tflops = rec["tflops_paper"]
    micro = f" mb{rec['micro_batch']}" if rec.get("micro_batch", 0) < rec.get("config_micro_batch", 0) else ""
    return (f"{tflops:.0f}" if tflops >= 10 else f"{tflops:.2g}") + mfu + ("*" if rec.get("recompute") else "") + micro


def _ratio(a: Optional[dict], b: Optional[dict]) -> str:
    if not a or not b or a["status"] != "ok" or b["status"] != "ok":
        return "-"
    return f"{a['tflops_paper'] / b['tflops_paper']:.2f}x"


def markdown(results: List[dict], nproc: int, gpu: str, columns: List[str]) -> str:
    """Our cells (model TFLOP/s per GPU, paper formula; MFU vs this GPU's peak) beside the paper's A100."""
    mine = {(r["model"], r["seq"], r["attention"]): r for r in results if r["nproc"] == nproc and r["gpu"] == gpu}
    rows = sorted({(m, s) for m, s, _ in mine})
    if not rows:
        return f"(no cells for {nproc} GPU(s) of {gpu} in the results file)"
    head = " | ".join(COLUMNS.get(c, c) for c in columns)
    lines = [f"Model TFLOP/s per GPU (MFU), {nproc} x {gpu}; * = with activation checkpointing of the "
             "attention; mbN = at micro-batch N (the same sequences per step, more accumulation)",
             "", f"| model | {head} | ours / without | ours / PyTorch FA2 | paper A100: without / FA / FA2 "
                 f"| paper FA2 / without | paper FA2 / FA |",
             "|---|" + "---|" * len(columns) + "---|---|---|---|---|"]
    for m, s in rows:
        cells = [_cell_text(mine.get((m, s, c))) for c in columns]
        ours = mine.get((m, s, "flash"))
        p = PAPER.get((m, s))
        paper = (f"{p[0]} / {p[1]} / {p[2]} ({100 * p[2] / A100_PEAK_TFLOPS:.0f}%)" if p else "-")
        pr1 = f"{p[2] / p[0]:.2f}x" if p else "-"
        pr2 = f"{p[2] / p[1]:.2f}x" if p else "-"
        lines.append(f"| {MODELS[m][1]}, {seq_label(s)} | {' | '.join(cells)} | {_ratio(ours, mine.get((m, s, 'math')))}"
                     f" | {_ratio(ours, mine.get((m, s, 'sdpa_flash')))} | {paper} | {pr1} | {pr2} |")
    return "\n".join(lines)


def chart(results: List[dict], nproc: int, gpu: str, columns: List[str], path: Path) -> Optional[Path]:
    """Grouped bars: model TFLOP/s per GPU per row and column, ours hatched; the paper's A100 FA2 as a
    marker per row. OOM cells are drawn as an empty bar labelled OOM."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mine = {(r["model"], r["seq"], r["attention"]): r for r in results if r["nproc"] == nproc and r["gpu"] == gpu}
    rows = sorted({(m, s) for m, s, _ in mine})
    if not rows:
        return None
    width = 0.8 / len(columns)
    fig, ax = plt.subplots(figsize=(3.2 + 1.9 * len(rows), 5.0))
    for j, c in enumerate(columns):
        xs, ys, labels = [], [], []
        for i, (m, s) in enumerate(rows):
            rec = mine.get((m, s, c))
            xs.append(i + (j - (len(columns) - 1) / 2) * width)
            ok = rec is not None and rec["status"] == "ok"
            ys.append(rec["tflops_paper"] if ok else 0.0)
            labels.append(_cell_text(rec, with_mfu=False) if rec else "")
        bars = ax.bar(xs, ys, width, label=COLUMNS.get(c, c), hatch="//" if c == "flash" else None,
                      edgecolor="black", linewidth=0.5)
        for b, text in zip(bars, labels):
            ax.annotate(text, (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                        va="bottom", fontsize=7, xytext=(0, 2), textcoords="offset points")
    paper = [(i, PAPER[(m, s)][2]) for i, (m, s) in enumerate(rows) if (m, s) in PAPER]
    if paper:
        ax.scatter([i for i, _ in paper], [v for _, v in paper], marker="_", s=900, color="black", zorder=3,
                   label="paper: FlashAttention-2 on A100")
    ax.set_xticks(range(len(rows)), [f"{MODELS[m][1]}\n{seq_label(s)}" for m, s in rows])
    ax.set_ylabel("model TFLOP/s per GPU (paper formula)")
    ax.set_title(f"GPT training, {nproc} x {gpu}")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False,
              markerscale=0.35)  # the paper's marker spans a bar group; its legend key, a short dash
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=1, help="GPUs (torchrun processes) per run")
    p.add_argument("--models", nargs="+", default=["1.3b", "2.7b"], choices=sorted(MODELS))
    p.add_argument("--seq", nargs="+", default=["2k", "8k"], help="context lengths, e.g. 2k 8k")
    p.add_argument("--attention", nargs="+", default=DEFAULT_COLUMNS, choices=sorted(COLUMNS))
    p.add_argument("--steps", type=int, default=10, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the medians (compilation)")
    p.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step per GPU")
    p.add_argument("--out-dir", default="runs/paper_table", help="run folders (and their W&B offline runs)")
    p.add_argument("--results", default=None, help="results file (default: <out-dir>/cells.jsonl)")
    p.add_argument("--wandb", default="offline", choices=["offline", "online", "disabled"])
    p.add_argument("--project", default="flashgpt")
    p.add_argument("--group", default="paper-table", help="W&B group of every cell's run")
    p.add_argument("--force", action="store_true", help="run cells already in the results file again")
    p.add_argument("--table-only", action="store_true", help="no runs: the table and chart of the results file")
    p.add_argument("--chart", default=None, help="PNG path (default: <out-dir>/paper_table_<N>gpu.png)")
    p.add_argument("--run-timeout", type=float, default=3600,
                   help="seconds before a run is stopped (with its workers)")
    p.add_argument("override", nargs="*", help="key=value overrides for every run (e.g. train.compile=false)")
    args = p.parse_args(argv)
    for o in args.override:
        if "=" not in o:
            p.error(f"override {o!r}: expected key=value")
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} leaves no step after --warmup {args.warmup}")
    args.out_dir = str(Path(args.out_dir).resolve())  # the runs start in ROOT, not in the caller's folder
    args.results = Path(args.results or Path(args.out_dir) / "cells.jsonl")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    gpu = gpu_name()
    seqs = [seq_tokens(s) for s in args.seq]
    if not args.table_only:
        held = {cell_key(r): r for r in read_results(args.results)}  # the latest record of each cell
        for model in args.models:
            for seq in seqs:
                for attention in args.attention:
                    cell = Cell(args, model, seq, attention, gpu)
                    start = 0
                    if cell.key() in held and not args.force:
                        start = cell.resume_from(held[cell.key()])
                        if start is None:
                            print(f"[{cell.name}] in {args.results} already (--force to run it again)", flush=True)
                            continue
                        print(f"[{cell.name}] out of memory in {args.results} at its last try: going on from "
                              f"try {start + 1} of {len(cell.tries())}", flush=True)
                    rec = cell.run(start)
                    append_result(args.results, rec)
                    print(f"[{cell.name}] {_cell_text(rec)}", flush=True)
    results = read_results(args.results)
    if args.table_only:  # the GPUs the file's cells ran on, not this machine's (tables are made anywhere)
        gpus = sorted({r["gpu"] for r in results if r["nproc"] == args.nproc}) or [gpu]
    else:
        gpus = [gpu]
    for g in gpus:
        print()
        print(markdown(results, args.nproc, g, args.attention))
        name = f"paper_table_{args.nproc}gpu" + ("" if len(gpus) == 1 else "_" + g.replace(" ", "_"))
        png = chart(results, args.nproc, g, args.attention, Path(args.chart or Path(args.out_dir) / f"{name}.png"))
        if png:
            print(f"\nchart: {png}; W&B runs (group {args.group}): {args.out_dir}/*/wandb")
    return 0


if __name__ == "__main__":
    terminate_raises()  # a stopped table (timeout, SIGTERM) stops its run's workers too
    sys.exit(main())
