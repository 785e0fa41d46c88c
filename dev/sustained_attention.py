"""Attention forward+backward (or the forward alone, `--pass fwd`) under sustained load: the regime a
training step runs in.

A 1.3B-8k training step holds an H100 at its 700 W board limit, and the GPU lowers its SM clock to
stay there (1.47-1.68 GHz against 1.98 GHz for a kernel timed alone). The kernel sweep
(bench/kernel_sweep.py) times short bursts at full clock; this module keeps the GPU busy for
`--seconds` per candidate and reports what the kernels reach there, and the energy they take:

  alone       f+b calls back to back: TFLOP/s at the clock the kernel's own power draw allows, board
              power, joules per call (energy counter difference / calls)
  with GEMMs  each f+b call after `--gemms` (16384 x 2048) x (2048 x 8192) GEMMs, as between two
              attention layers of the step: the attention calls' time alone is timed (CUDA events)

Candidates rotate in `--rounds` rounds so warming of the board is shared out. Medians over the
second half of each turn's calls (steady clock). TFLOP/s: 4·b·h·s²·d per forward (halved when
causal), f+b = 3.5 x forward. Needs NVML (the driver's libnvidia-ml) for clock and power.

    python dev/sustained_attention.py [--hdim 128] [--seqlen 8192] [--batch 2] [--heads 16] [--causal 1]
        [--impls ours cudnn flash fa4] [--pass fwd]   # fa4: FlashAttention-4 where flash_attn.cute imports
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "bench")]  # our packages; the kernel sweep

from kernel_sweep import impls, load_fa4  # noqa: E402
from training.telemetry.gpu import GpuTelemetry  # noqa: E402


def step_gemms(count: int):
    """A callable running `count` (16384 x 2048) x (2048 x 8192) bf16 GEMMs -- a step's MLP-sized products, as
    between two attention layers -- or None for count 0."""
    if count <= 0:
        return None
    x = torch.randn(16384, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16)

    def gemm():
        for _ in range(count):
            torch.mm(x, w.t())
    return gemm


QUEUED_CALLS = 4  # calls the host keeps queued ahead of the GPU: enough to keep it busy, few enough that a
                  # turn of long calls (~0.2 s each at 64k keys) ends near `seconds`, not a full launch queue later


def run_turn(fb, gemm, seconds: float, telemetry) -> dict:
    """Calls of fb() (after gemm() if given) for `seconds`; medians over the second half."""
    events = []
    if telemetry is not None:
        telemetry.mark()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        if gemm is not None:
            gemm()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fb()
        e.record()
        events.append((s, e))
        if len(events) > QUEUED_CALLS:
            events[-1 - QUEUED_CALLS][1].synchronize()
    torch.cuda.synchronize()
    ms = [s.elapsed_time(e) for s, e in events[len(events) // 2:]]
    out = {"ms": statistics.median(ms), "calls": len(events)}
    if telemetry is not None:
        out.update(telemetry.mark())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hdim", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--causal", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=3.0, help="per candidate and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--gemms", type=int, default=6, help="GEMMs before each call in the loaded mode; 0: skip it")
    ap.add_argument("--impls", nargs="+", default=["ours", "cudnn", "flash"])
    ap.add_argument("--pass", dest="which", choices=["fb", "fwd"], default="fb",
                    help="time forward+backward calls, or forward calls alone (no autograd graph)")
    args = ap.parse_args(argv)

    b, s, h, d, causal = args.batch, args.seqlen, args.heads, args.hdim, bool(args.causal)
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    fa4 = None
    if "fa4" in args.impls:
        fa4, what = load_fa4()
        if fa4 is None:
            raise SystemExit(f"--impls fa4: FlashAttention-4 is not importable ({what})")
    fns = impls(causal, fa4=fa4)
    gemm = step_gemms(args.gemms)

    def fb_of(fn):
        if args.which == "fwd":
            def fwd():
                with torch.no_grad():
                    fn(q, k, v)
            return fwd
        return lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), dout)

    telemetry = GpuTelemetry.open(torch.device("cuda"))
    modes = [("alone", None)] + ([("with GEMMs", gemm)] if args.gemms > 0 else [])
    results = {}
    for name in args.impls:
        fb_of(fns[name])()  # compile / plan once before the clock starts
    for _ in range(args.rounds):
        for mode, g in modes:
            for name in args.impls:
                results.setdefault((name, mode), []).append(run_turn(fb_of(fns[name]), g, args.seconds, telemetry))
    if telemetry is not None:
        telemetry.close()

    flops = (1 if args.which == "fwd" else 3.5) * 4 * b * h * s * s * d / (2 if causal else 1)
    what = "forward" if args.which == "fwd" else "f+b"
    print(f"\nsustained {what}, {torch.cuda.get_device_name()}, torch {torch.__version__}: b{b} s{s} h{h} d{d} "
          f"causal={causal}, {args.rounds} rounds x {args.seconds:g} s per candidate"
          + ("" if telemetry else " (no NVML: clock and power not shown)"))
    print(f"| candidate | load | {what} ms (median) | TFLOP/s | vs cudnn | SM MHz | board W | J per {what} (alone) |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, _ in modes:
        base = statistics.median(r["ms"] for r in results.get(("cudnn", mode), [{"ms": float("nan")}]))
        for name in args.impls:
            rs = results[(name, mode)]
            ms = statistics.median(r["ms"] for r in rs)
            clock = statistics.median(r.get("gpu_sm_clock_mhz", float("nan")) for r in rs)
            watts = statistics.median(r.get("gpu_power_w", float("nan")) for r in rs)
            joules = (statistics.median(r["gpu_energy_j"] / r["calls"] for r in rs)
                      if mode == "alone" and all("gpu_energy_j" in r for r in rs) else float("nan"))
            print(f"| {name} | {mode} | {ms:.3f} | {flops / ms / 1e9:.0f} | {base / ms:.2f} | {clock:.0f} | "
                  f"{watts:.0f} | {joules:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
