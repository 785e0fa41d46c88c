"""Does a call's time depend on the candidate that ran just before it? One row of the kernel sweep
(`python -m kernels.bench`), forward+backward of ours, SDPA flash and SDPA cuDNN, timed call by call
in three sequences -- the sweep's old fixed order (5 passes, 3 calls of a candidate back to back),
the balanced order it uses now (kernels/timing.py: each candidate right after every one equally
often), the fixed order again -- and reported per (candidate, predecessor): median TFLOP/s, count,
range. Found the 16k rows' order bias (bench/RESULTS.md v19): under the board's power limit a long
call that follows tens of milliseconds of high-power work starts at a lower clock.

    python bench/order_effect.py [--hdim 128] [--seqlen 16384] [--causal 0]
"""
from __future__ import annotations

import argparse
import collections
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels import timing  # noqa: E402
from kernels.bench import D_MODEL, TOKENS, impls  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hdim", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--causal", type=int, default=0)
    ap.add_argument("--cycles", type=int, default=5, help="repeats of the balanced order")
    args = ap.parse_args(argv)
    d, s, causal = args.hdim, args.seqlen, bool(args.causal)
    b, h = max(1, TOKENS // s), D_MODEL // d
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    fns = {name: (lambda fn: lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), dout))(fn)
           for name, fn in impls(causal).items()}
    for fn in fns.values():
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    spin = timing._spin_for(fns.values(), True)  # as the sweep: the host queues each call ahead
    flops = 3.5 * 4 * b * h * s * s * d / (2 if causal else 1)
    names = list(fns)
    fixed = [name for _ in range(5) for name in names for _ in range(3)]
    print(f"{torch.cuda.get_device_name()}: hdim {d} seqlen {s} causal {int(causal)} b x h {b} x {h}, "
          f"f+b TFLOP/s by the candidate that ran just before (spin {spin:.2f} ms before each call)")
    for label, seq in (("fixed", fixed), ("balanced", timing.balanced_order(names) * args.cycles),
                       ("fixed again", fixed)):
        by_pair, prev = collections.defaultdict(list), None
        for name in seq:
            by_pair[(name, prev)].append(timing._call_ms(fns[name], spin))
            prev = name
        print(f"  {label}:")
        for name in names:
            cells = [f"after {p}: {flops / statistics.median(t) / 1e9:.0f} (n={len(t)}, "
                     f"{flops / max(t) / 1e9:.0f}-{flops / min(t) / 1e9:.0f})"
                     for (n, p), t in sorted(by_pair.items(), key=lambda kv: str(kv[0][1])) if n == name]
            print(f"    {name:6s} " + "; ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
