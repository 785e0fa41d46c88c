"""Where an attention forward+backward spends its GPU time, kernel by kernel: ours vs SDPA flash vs
SDPA cuDNN (and FA4 with `--impls ... fa4` where flash_attn.cute imports) on one shape of the kernel
sweep (bench/kernel_sweep.py: 16k tokens, d_model 2048, bf16).

torch.profiler records `--iters` forward+backward calls after a warm-up; each kernel's device time
is summed per name and divided by the number of calls (microseconds per call). The table shows
which kernels beyond the main ones (zeroing, pre-/post-processing, copies) each backend launches
and what they cost: the short-sequence rows of the sweep are where these matter. Beside the kernel
sum: the CUDA-event time of a call the host has queued ahead (the sweep's default: GPU time) and
of one synchronised call (the sweep's --call-time; the difference is GPU idle time: host overhead
before and between launches), and the host time of one call on a tiny
shape (1 x 128 tokens x 1 head), where the GPU waits on the host.

    python dev/kernel_breakdown.py --hdim 128 --seqlen 512 [--causal] [--iters 20] [--impls ours fa4]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "bench")]  # our kernels package; the sweep and its timing

from cuda_timing import kernel_us_per_call, time_ms  # noqa: E402
from kernel_sweep import D_MODEL, TOKENS, impls, load_fa4  # noqa: E402


def kernel_times(fn, q, k, v, dout, iters: int) -> dict[str, float]:
    """Kernel name -> microseconds of device time per forward+backward call."""
    def step():
        q.grad = k.grad = v.grad = None
        fn(q, k, v).backward(dout)

    return kernel_us_per_call(step, iters)


def host_us(fn, d: int, iters: int = 200) -> float:
    """Host microseconds per forward+backward call on a 1 x 128 x 1 x d problem (GPU work ~10 us)."""
    q, k, v = (torch.randn(1, 128, 1, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn_like(q)
    for _ in range(10):
        torch.autograd.grad(fn(q, k, v), (q, k, v), dout)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        torch.autograd.grad(fn(q, k, v), (q, k, v), dout)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e6


def short(name: str, width: int = 70) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hdim", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--impls", nargs="+", default=["ours", "flash", "cudnn"])
    args = ap.parse_args()
    batch, heads = TOKENS // args.seqlen, D_MODEL // args.hdim
    torch.manual_seed(0)
    q, k, v = (torch.randn(batch, args.seqlen, heads, args.hdim, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    fa4 = None
    if "fa4" in args.impls:
        fa4, what = load_fa4()
        if fa4 is None:
            raise SystemExit(f"--impls fa4: flash_attn.cute does not import ({what})")
    fns = impls(args.causal, fa4=fa4)
    print(f"hdim {args.hdim} seqlen {args.seqlen} causal {int(args.causal)} batch×heads {batch}×{heads}: "
          f"us per forward+backward call, by kernel")
    for name in args.impls:
        fn = fns[name]
        times = kernel_times(fn, q, k, v, dout, args.iters)
        call = lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), dout)  # noqa: E731
        event_us = 1e3 * time_ms(call, args.iters, queue_ahead=False)
        gpu_us = 1e3 * time_ms(call, args.iters)
        print(f"  {name}: kernels {sum(times.values()):.1f} us, CUDA events {gpu_us:.1f} us per queued call, "
              f"{event_us:.1f} us per synchronised call; "
              f"host {host_us(fn, args.hdim):.1f} us per call on a tiny shape")
        for kname, us in sorted(times.items(), key=lambda kv: -kv[1]):
            print(f"    {us:9.1f}  {short(kname)}")


if __name__ == "__main__":
    main()
