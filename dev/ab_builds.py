"""A/B of source trees' attention kernels in one process: is a kernel change faster than the kept
code, row by row? Each tree's extension is built (or taken from the kernel cache) by that tree's own
`kernels.build` in a subprocess; the modules are then loaded side by side (their names carry the
source hash) and called directly, all candidates' calls interleaved (bench/cuda_timing.py), median of
`--rounds` medians. Several NEW trees are timed against the one OLD tree in the same run. On a GPU:

    git worktree add /tmp/old main        # or `git archive main kernels | tar -x -C /tmp/old`
    python dev/ab_builds.py /tmp/old . --pass bwd --hdims 128 64
    python dev/ab_builds.py /tmp/old /tmp/try1 /tmp/try2 --pass fwd --causal 1

Prints per row TFLOP/s of each (FLOPs 4·b·h·d per query-key pair: s² pairs, halved if causal, s·w - w(w-1)/2
under a causal window of w tokens; backward 2.5x that) and each new /
old, with the largest difference between a new tree's outputs and the old one's (gradients: the dQ
reduce order differs call to call, so expect a few bf16 units at most; a row whose new outputs are non-finite
where the old are not, or off by more than 2% of their scale, is marked WRONG); last, per new tree, the median
and range of new / old over the rows, and how many rows were WRONG. The shapes are the kernel sweep's: 16k tokens a batch, d_model 2048.

`--at-cap SECONDS` times instead at the board's power cap, the regime of a training step: per round each tree's
calls run back to back for SECONDS (the trees' order rotating from round to round), medians over each turn's
second half (dev/sustained_attention.py run_turn), with each tree's SM clock and joules per call (NVML). At the
cap the clock follows the energy a call takes, which bursts at full clock do not show:

    python dev/ab_builds.py /tmp/old . --pass bwd --hdims 128 --causal 1 --seqlens 8192 16384 --at-cap 3 [--cap-gemms 6]
"""
from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import statistics
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_timing import time_interleaved_ms  # noqa: E402

BUILD = "from kernels.build import load_extension; print(load_extension().__file__)"
WRONG_GAP = 0.02  # relative to the old outputs' largest magnitude (at least 1): a tree this far off is broken


def output_gap(old: list[torch.Tensor], new: list[torch.Tensor]) -> tuple[float, bool]:
    """The largest |old - new| over the compared tensors (NaN where new has a non-finite value old has not),
    and whether new is wrong: non-finite where old is finite, or off by more than WRONG_GAP x max(1, max |old|).
    A wrong tree's timings measure a broken kernel, whatever they say."""
    gap, wrong = 0.0, False
    for x, y in zip(old, new):
        x, y = x.float(), y.float()
        if bool((torch.isfinite(x) & ~torch.isfinite(y)).any()):
            return float("nan"), True
        both = torch.isfinite(x) & torch.isfinite(y)
        if not bool(both.any()):
            continue
        g = (x - y)[both].abs().max().item()
        gap, wrong = max(gap, g), wrong or g > WRONG_GAP * max(1.0, x[both].abs().max().item())
    return gap, wrong


def build(tree: Path) -> ModuleType:
    """Build (or find in the cache) TREE's extension and import it under its own module name."""
    done = subprocess.run([sys.executable, "-c", BUILD], cwd=tree, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"building the kernels of {tree} failed:\n{done.stderr[-3000:]}")
    path = done.stdout.strip().splitlines()[-1]
    name = Path(path).name.split(".")[0]
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader))
    loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path, nargs="+")
    ap.add_argument("--pass", dest="which", choices=["bwd", "fwd"], default="bwd")
    ap.add_argument("--hdims", type=int, nargs="+", default=[128, 64])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--causal", type=int, nargs="+", default=[1, 0])
    ap.add_argument("--windows", type=int, nargs="*", default=[],
                    help="also causal local windows of w tokens (window_size=(w - 1, 0)) at seqlens above w")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--at-cap", type=float, default=0.0, metavar="SECONDS",
                    help="time each tree's calls back to back for SECONDS per round at the power cap (clock, J per call)")
    ap.add_argument("--cap-gemms", type=int, default=0, metavar="N",
                    help="with --at-cap: N (16384 x 2048) x (2048 x 8192) GEMMs before each call, as between two "
                         "attention layers of a step (the calls' own time is timed; joules then include the GEMMs')")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    trees = {"old": a.old, **{f"new{i + 1}": t for i, t in enumerate(a.new)}}
    exts = {n: build(t.resolve()) for n, t in trees.items()}
    names = [e.__name__ for e in exts.values()]
    if len(set(names)) < len(names):
        raise SystemExit("two trees have the same kernel sources (one source hash): nothing to compare")
    news = [n for n in exts if n != "old"]
    for n in news:
        print(f"{n}: {trees[n]}")
    telemetry = None
    if a.at_cap:
        from sustained_attention import GpuTelemetry, run_turn, step_gemms
        telemetry = GpuTelemetry.open(torch.device("cuda"))
        if telemetry is None:
            raise SystemExit("--at-cap needs NVML (the driver's libnvidia-ml) for the clock and the energy")
        gemm = step_gemms(a.cap_gemms)
    cap = " | old MHz | old J" if a.at_cap else ""
    print(f"| pass | hdim | mask | seqlen | old TFLOP/s{cap} | "
          + " | ".join(f"{n} TFLOP/s | {n} / old" + (f" | {n} MHz | {n} J / old J" if a.at_cap else "") + f" | {n} max diff"
                       for n in news) + " |")
    print("|---|---|---|---|---|" + ("---|---|" if a.at_cap else "") + ("---|---|---|---|---|" if a.at_cap else "---|---|---|") * len(news))
    ratios = {n: [] for n in news}
    wrong_rows = {n: 0 for n in news}
    masks = [("causal" if c else "full", bool(c), 0) for c in a.causal] + [(f"win{w}", True, w) for w in a.windows]
    for d in a.hdims:
        for label, causal, w in masks:
            for s in (n for n in a.seqlens if n > w):
                b, h, scale = max(1, 16384 // s), 2048 // d, d ** -0.5
                left, right = (w - 1, 0) if w else (-1, -1)
                torch.manual_seed(0)
                q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                fwd = {n: e.fwd(q, k, v, None, None, s, s, scale, causal, left, right) for n, e in exts.items()}

                def call(n: str):
                    e = exts[n]
                    if a.which == "fwd":
                        return e.fwd(q, k, v, None, None, s, s, scale, causal, left, right)
                    out, lse = fwd[n]
                    return e.bwd(dout, q, k, v, out, lse, None, None, s, s, scale, causal, left, right, False)

                # compared: dq, dk, dv; or the forward's output (not its LSE)
                got = {n: call(n)[: 3 if a.which == "bwd" else 1] for n in exts}
                fns = {n: (lambda n=n: call(n)) for n in exts}
                mhz, joules = {}, {}
                if a.at_cap:
                    order, turns = list(exts), {n: [] for n in exts}
                    for r in range(a.rounds):
                        for n in order[r % len(order):] + order[:r % len(order)]:
                            turns[n].append(run_turn(fns[n], gemm, a.at_cap, telemetry))
                    ms = {n: statistics.median(t["ms"] for t in turns[n]) for n in exts}
                    nan = float("nan")
                    mhz = {n: statistics.median(t.get("gpu_sm_clock_mhz", nan) for t in turns[n]) for n in exts}
                    joules = {n: statistics.median(t.get("gpu_energy_j", nan) / t["calls"] for t in turns[n]) for n in exts}
                else:
                    runs = [time_interleaved_ms(fns, a.reps) for _ in range(a.rounds)]
                    ms = {n: statistics.median(r[n] for r in runs) for n in exts}
                pairs = s * w - w * (w - 1) // 2 if w else s * s * (0.5 if causal else 1.0)  # query-key pairs
                flops = 4 * b * h * pairs * d * (2.5 if a.which == "bwd" else 1.0)
                cells = []
                for n in news:
                    gap, wrong = output_gap(got["old"], got[n])
                    wrong_rows[n] += wrong
                    ratios[n].append(ms["old"] / ms[n])
                    at_cap = f" | {mhz[n]:.0f} | {joules[n] / joules['old']:.3f}" if a.at_cap else ""
                    cells.append(f"{flops / ms[n] / 1e9:.0f} | {ms['old'] / ms[n]:.3f}{at_cap} | {gap:.2e}"
                                 + (" WRONG" if wrong else ""))
                old_cap = f" | {mhz['old']:.0f} | {joules['old']:.3f}" if a.at_cap else ""
                print(f"| {a.which} | {d} | {label} | {s} | {flops / ms['old'] / 1e9:.0f}{old_cap} | "
                      + " | ".join(cells) + " |", flush=True)
    for n in news:
        r = ratios[n]
        broken = (f"; WRONG outputs on {wrong_rows[n]} rows (non-finite, or off by more than {WRONG_GAP} of the old "
                  f"outputs' scale): its timings measure a broken kernel") if wrong_rows[n] else ""
        print(f"{n} / old over {len(r)} rows: median {statistics.median(r):.3f}, range {min(r):.3f}-{max(r):.3f}{broken}")


if __name__ == "__main__":
    main()
