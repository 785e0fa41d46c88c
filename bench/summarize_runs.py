"""Summarise run folders' metrics.jsonl as a markdown table (steps after a warm-up).

    python bench/summarize_runs.py --warmup 3 runs/a runs/b ...
Per run: GPUs, median tokens/s per GPU, model TFLOP/s per GPU and MFU (paper and causal), peak memory
(max over steps of the allocator's peak), and the losses of every step (to compare runs). A step run
under the profiler (train.profile_step) is left out of the medians (the profiler slows it); its shares
of GPU kernel time (attention / matmul / communication / other) get a column.
"""
import argparse
import json
import statistics
import sys
from pathlib import Path


def summarize(run_dir: Path, warmup: int) -> dict:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if "loss" in r]
    profiled = next((r for r in train if "time_share_attention" in r), None)
    timed = [r for r in train if r["step"] > warmup and r.get("tokens_per_s_per_gpu") and r is not profiled]
    med = lambda key: statistics.median(r[key] for r in timed) if timed else float("nan")  # noqa: E731
    cfg = (run_dir / "config.yaml").read_text() if (run_dir / "config.yaml").exists() else ""
    return {"run": run_dir.name, "tok_gpu": med("tokens_per_s_per_gpu"), "tflops": med("tflops_paper"),
            "tflops_c": med("tflops_causal"), "mfu": med("mfu_paper") if timed and timed[0].get("mfu_paper") else None,
            "mfu_c": med("mfu_causal") if timed and timed[0].get("mfu_causal") else None,
            "mem": max((r.get("mem_max_alloc_gb") or 0) for r in train) if train else 0,
            "losses": [round(r["loss"], 4) for r in train], "config": cfg,
            "shares": None if profiled is None else " / ".join(
                f"{100 * profiled.get('time_share_' + k, 0.0):.0f}%" for k in SHARES)}


SHARES = ("attention", "matmul", "communication", "other")


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--baseline", default=None,
                   help="run folder whose tokens/s per GPU is 1.0 in an extra 'per GPU vs baseline' column "
                        "(scaling efficiency when the baseline is the 1-GPU run)")
    p.add_argument("runs", nargs="+")
    args = p.parse_args(argv)
    base = summarize(Path(args.baseline), args.warmup)["tok_gpu"] if args.baseline else None
    extra = f" per GPU vs {Path(args.baseline).name} |" if base else ""
    rows = [summarize(Path(d), args.warmup) for d in args.runs]
    shares = any(s["shares"] for s in rows)
    head = " GPU time: " + " / ".join(SHARES) + " (profiled step) |" if shares else ""
    print("| run | tokens/s per GPU | TFLOP/s per GPU (paper) | (causal) | MFU (paper) | (causal) | peak mem GB |"
          + extra + head + " losses |")
    print("|---|---|---|---|---|---|---|" + ("---|" if base else "") + ("---|" if shares else "") + "---|")
    for s in rows:
        mfu, mfu_c = ("n/a" if m is None else f"{100 * m:.1f}%" for m in (s["mfu"], s["mfu_c"]))
        ratio = f" {s['tok_gpu'] / base:.3f} |" if base else ""
        share = f" {s['shares'] or '-'} |" if shares else ""
        print(f"| {s['run']} | {s['tok_gpu'] / 1e3:.1f}k | {s['tflops']:.0f} | {s['tflops_c']:.0f} | {mfu} | {mfu_c} | "
              f"{s['mem']:.1f} |{ratio}{share} {' '.join(map(str, s['losses']))} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
