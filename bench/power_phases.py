"""Does the board's power limiter charge for long phases? GEMM bursts alternated with copy bursts.

    python bench/power_phases.py --seconds 4 --out /tmp/phases

The question (bench/RESULTS.md session 23): at micro-batch 2 the 2.7B-8k step's kernels are twice as
long as at micro-batch 1, its energy per token 4% lower, yet its throughput only 1.2% higher, because
the board averaged 678 W instead of 697 W while the limit held the clock down. If the limiter leaves
power unused when high-power and low-power phases are long, the same work cut into shorter phases
would run faster.

Each pattern repeats [n bf16 GEMMs (M, N, K) = (8192, 4096, 4096), then 2n copies of 64 MiB] for
`--seconds` after a settle second, for n = 1 .. 128 (periods ~0.5 ms to ~60 ms, the same 85 / 15 time
split between GEMMs and copies), interleaved over `--rounds` so that each pattern follows the others
equally often. Reported per pattern: the GEMMs' delivered TFLOP/s over the whole interval (copies
included), mean power from the energy counter, energy per GEMM TFLOP, and bench/power_trace.py's
summary (SM clock, instantaneous power, which clock-limit reasons were set).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.power_trace import PowerTrace, format_summary, summarize  # noqa: E402
from training.gpu_telemetry import NvmlDevice  # noqa: E402

M, N, K = 8192, 4096, 4096
COPY_BYTES = 64 << 20


def run_pattern(n_gemm: int, seconds: float, a, b, c, src, dst, nvml: NvmlDevice, trace: PowerTrace) -> dict:
    """Run the pattern for ~`seconds` after a 1 s settle; returns rates and the trace summary."""

    def period():
        for _ in range(n_gemm):
            torch.mm(a, b, out=c)
        for _ in range(2 * n_gemm):
            dst.copy_(src)

    def run_for(seconds_: float) -> int:
        periods, t_end, marks = 0, time.perf_counter() + seconds_, []
        while time.perf_counter() < t_end:
            for _ in range(max(1, 32 // n_gemm)):
                period()
                periods += 1
            marks.append(torch.cuda.Event())
            marks[-1].record()
            if len(marks) > 2:  # the host stays <= ~64 GEMMs ahead (an honest window); the queue never empties
                marks.pop(0).synchronize()
        return periods

    run_for(1.0)  # settle: the limiter reaches its steady state for this pattern
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()  # queued behind the settle's work: the window opens when the GPU gets here
    torch.cuda.synchronize()
    since, e0 = trace.now(), nvml.energy_mj()
    periods = run_for(seconds)
    end.record()
    end.synchronize()
    gpu_s = start.elapsed_time(end) / 1e3
    joules = (nvml.energy_mj() - e0) / 1e3
    tflop = periods * n_gemm * 2 * M * N * K / 1e12
    wall = trace.now() - since
    return {"tflops": tflop / gpu_s, "power_w": joules / wall, "j_per_tflop": joules / tflop,
            "period_ms": 1e3 * gpu_s / periods, "trace": summarize(trace.samples, since_s=since)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=4.0, help="timed seconds per pattern and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--gemms", default="1,2,4,8,16,32,64,128", help="GEMMs per burst, one pattern each")
    p.add_argument("--out", type=Path, default=None, help="folder for the raw traces (CSV)")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    nvml = NvmlDevice(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(M, K, device=dev, dtype=torch.bfloat16, generator=g)  # random: zeros draw less power
    b = torch.randn(K, N, device=dev, dtype=torch.bfloat16, generator=g)
    c = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
    src = torch.randn(COPY_BYTES // 2, device=dev, dtype=torch.bfloat16, generator=g)
    dst = torch.empty_like(src)
    counts = [int(x) for x in args.gemms.split(",")]
    results = {n: [] for n in counts}
    trace = PowerTrace(nvml)
    for r in range(args.rounds):
        order = counts if r % 2 == 0 else counts[::-1]  # each pattern after the others equally often
        for n in order:
            res = run_pattern(n, args.seconds, a, b, c, src, dst, nvml, trace)
            results[n].append(res)
            print(f"[phases] round {r} n={n}: {res['tflops']:.0f} TFLOP/s, {res['power_w']:.0f} W, "
                  f"period {res['period_ms']:.2f} ms | {format_summary('trace', res['trace'])}", flush=True)
    trace.stop()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        trace.write_csv(args.out / "power_phases.csv")
    print(f"\n{torch.cuda.get_device_name()} | torch {torch.__version__} | GEMM ({M}, {N}, {K}) bf16, "
          f"copies of {COPY_BYTES >> 20} MiB, 2 per GEMM | median over {args.rounds} rounds")
    print("| GEMMs per burst | period ms | GEMM TFLOP/s (whole interval) | mean W | J per GEMM TFLOP | "
          "SM MHz p50 | instant W p10 / p50 / p90 | sw_power_cap / hw_slowdown / hw_power_brake |")
    print("|---|---|---|---|---|---|---|---|")
    for n in counts:
        rs = results[n]
        med = {k: statistics.median(x[k] for x in rs) for k in ("tflops", "power_w", "j_per_tflop", "period_ms")}
        t = rs[-1]["trace"]
        w = f"{t.get('w_p10', float('nan')):.0f} / {t.get('w_p50', float('nan')):.0f} / {t.get('w_p90', float('nan')):.0f}"
        bits = " / ".join(f"{100 * t.get(k, 0):.0f}%" for k in ("sw_power_cap", "hw_slowdown", "hw_power_brake"))
        print(f"| {n} | {med['period_ms']:.2f} | {med['tflops']:.0f} | {med['power_w']:.0f} | "
              f"{med['j_per_tflop']:.3f} | {t.get('mhz_p50', float('nan')):.0f} | {w} | {bits} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
