"""The residual add + output-keeping LayerNorm: our op (kernels/add_layer_norm.py) against what
torch.compile makes of the same module code (model.fused_add_norm off), forward and backward.

    python bench/add_layer_norm.py [--rows 16384] [--d 2560 2048] [--iters 50]

Each candidate runs h, y = add + LN(x, delta), then backward of sum(h * gh) + sum(y * gy) (the
gradient of h arriving from the next residual add, as in a GPT). GPU time by CUDA events, median of
--iters after warm-up, candidates interleaved; GB/s counts the bytes each direction must move (forward:
x, delta read, h, y written; backward: dh_in, dy, y read, dh written; 16-bit each).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.mlp_epilogue import time_ms  # noqa: E402  (median GPU ms by CUDA events, after warm-up)
from model.layernorm import LayerNorm  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=16384, help="tokens per micro-batch (2.7B-8k micro-batch 2)")
    ap.add_argument("--d", type=int, nargs="+", default=[2560, 2048])
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args(argv)
    print("| d | candidate | forward ms | GB/s | backward ms | GB/s |")
    print("|---|---|---|---|---|---|")
    for d in args.d:
        norm = LayerNorm(d, saves_output=True).cuda()
        with torch.no_grad():
            norm.weight.uniform_(0.8, 1.2)
            norm.bias.normal_(0, 0.1)
        x, delta, gh, gy = (torch.randn(args.rows, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))

        def ours(a, b):
            return norm.add_forward(a, b)

        def unfused(a, b):
            h = a + b
            return h, norm(h)

        cands = {"ours (fused_add_norm)": ours, "torch.compile (unfused module code)": torch.compile(unfused)}
        results = {k: ([], []) for k in cands}
        for _ in range(3):  # rounds, candidates interleaved
            for name, fn in cands.items():
                xs, ds = x.clone().requires_grad_(), delta.clone().requires_grad_()
                h, y = fn(xs, ds)
                fwd = time_ms(lambda: fn(xs, ds), args.iters)

                def bwd():
                    hh, yy = fn(xs, ds)
                    torch.autograd.backward((hh, yy), (gh, gy))

                both = time_ms(bwd, args.iters)
                results[name][0].append(fwd)
                results[name][1].append(both - fwd)
        for name, (f, b) in results.items():
            fm, bm = statistics.median(f), statistics.median(b)
            gb = args.rows * d * 2 * 4 / 1e9  # four 16-bit (rows, d) tensors each way
            print(f"| {d} | {name} | {fm:.3f} | {gb / fm * 1e3:.0f} | {bm:.3f} | {gb / bm * 1e3:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
