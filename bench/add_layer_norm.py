"""The residual add + output-keeping LayerNorm: our op (kernels/add_layer_norm.py) against what
torch.compile makes of the same module code (model.fused_add_norm off), forward and backward.

    python bench/add_layer_norm.py [--rows 16384] [--d 2560 2048] [--iters 30]

Each candidate runs h, y = add + LN(x, delta), then the gradients of x and delta from h's gradient gh
(the next residual add's, as in a GPT) and y's gy (torch.autograd.grad: no .grad accumulation kernels).
Times are the GPU's kernel time from the profiler, summed per iteration (launch gaps and Python cost
left out: a GPT step keeps the GPU busy), forward alone and forward + backward, the backward their
difference; the last table lists each kernel. GB/s counts the bytes each direction must move (forward:
x, delta read, h, y written; backward: dh_in, dy, y read, dh written; 16-bit each).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from model.layernorm import LayerNorm  # noqa: E402
from kernels.timing import kernel_us_per_call  # noqa: E402


def kernel_us(fn, iters: int):
    """GPU kernel time per call of fn (us) and {kernel name: us per call}, after a warm-up."""
    per = kernel_us_per_call(fn, iters)
    return sum(per.values()), per


def cpu_us_per_call(d: int, calls: int = 2000):
    """Host microseconds per call of flashgpt::add_layer_norm and its backward op on a tiny problem:
    what the ops cost the CPU that launches a compiled step's kernels (a step launches 64 of each per
    micro-batch at 32 layers)."""
    import time

    w, b = torch.ones(d, device="cuda"), torch.zeros(d, device="cuda")
    x = torch.randn(8, d, device="cuda", dtype=torch.bfloat16)
    fwd = torch.ops.flashgpt.add_layer_norm
    bwd = torch.ops.flashgpt.add_layer_norm_backward
    h, y, rstd = fwd(x, x, w, b, 1e-5)
    out = []
    for fn in (lambda: fwd(x, x, w, b, 1e-5), lambda: bwd(x, x, y, w, b, rstd)):
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) / calls * 1e6)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=16384, help="tokens per micro-batch (2.7B-8k micro-batch 2)")
    ap.add_argument("--d", type=int, nargs="+", default=[2560, 2048])
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/add_layer_norm.py needs a CUDA GPU")
    rows, kernels = [], []
    for d in args.d:
        norm = LayerNorm(d, saves_output=True).cuda()
        with torch.no_grad():
            norm.weight.uniform_(0.8, 1.2)
            norm.bias.normal_(0, 0.1)
        x, delta, gh, gy = (torch.randn(args.rows, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        xs, ds = x.requires_grad_(), delta.requires_grad_()

        def unfused(a, b):
            h = a + b
            return h, norm(h)

        compiled = torch.compile(unfused)
        for name, fn in (("ours (model.fused_add_norm)", norm.add_forward),
                         ("torch.compile (unfused module code)", compiled)):
            fwd, _ = kernel_us(lambda: fn(xs, ds), args.iters)
            both, per = kernel_us(lambda: torch.autograd.grad(fn(xs, ds), (xs, ds), (gh, gy)), args.iters)
            rows.append((d, name, fwd, both - fwd))
            kernels += [(d, name, k, us) for k, us in sorted(per.items(), key=lambda kv: -kv[1])]
    cpu = cpu_us_per_call(args.d[0])
    gb = {d: args.rows * d * 2 * 4 / 1e9 for d in args.d}  # four 16-bit (rows, d) tensors each way
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.rows} rows, bf16, {args.iters} iterations")
    print("| d | candidate | forward us | GB/s | backward us | GB/s |")
    print("|---|---|---|---|---|---|")
    for d, name, f, b in rows:
        print(f"| {d} | {name} | {f:.1f} | {gb[d] / f * 1e6:.0f} | {b:.1f} | {gb[d] / b * 1e6:.0f} |")
    print(f"\nhost time per call of the ops (8 rows, d {args.d[0]}, GPU never the bottleneck): "
          f"forward {cpu[0]:.1f} us, backward {cpu[1]:.1f} us")
    print("\n| d | candidate | kernel (forward + backward) | us per iteration |\n|---|---|---|---|")
    for d, name, k, us in kernels:
        print(f"| {d} | {name} | {k[:90]} | {us:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
