"""Would a GEMM-epilogue GELU pay in the trainer's MLP? (issue 7, session 13)

At the 1.3B-8k micro-batch-3 shape (24,576 tokens x d 2048 -> 8192 -> 2048, bf16) on one GPU:
the compiled MLP's forward + backward (what the trainer runs: cuBLAS GEMMs and Triton element-wise
kernels), its six GEMMs alone, and the first projection + GELU as inductor runs it (a bias GEMM, then
a GELU kernel) against cuBLASLt's GELU epilogue (torch._addmm_activation). Per kernel GPU times of
the compiled f+b come from the profiler. CUDA events, 5 warm-up calls, median of 20.

Since session 14 it also times the MLP with the GELU in cuBLASLt's epilogues (kernels/gelu_mlp.py).

    python bench/mlp_epilogue.py [--tokens 24576] [--d-model 2048]
    FLASHGPT_MLP_BWD=dgelu python bench/mlp_epilogue.py    # another backward (kernels/gelu_mlp.py)
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F


def time_ms(fn, reps: int = 20, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def mlp(x, w1, b1, w2, b2):  # model/mlp.py's torch MLP: (M, d) -> (M, d)
    return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=24576)
    ap.add_argument("--d-model", type=int, default=2048)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/mlp_epilogue.py needs a CUDA GPU")
    torch.manual_seed(0)
    m, d, h, dt, dev = args.tokens, args.d_model, 4 * args.d_model, torch.bfloat16, "cuda"
    w1 = (torch.randn(h, d, device=dev, dtype=dt) * 0.02).requires_grad_()
    b1 = (torch.randn(h, device=dev, dtype=dt) * 0.02).requires_grad_()
    w2 = (torch.randn(d, h, device=dev, dtype=dt) * 0.02).requires_grad_()
    b2 = (torch.randn(d, device=dev, dtype=dt) * 0.02).requires_grad_()
    x = torch.randn(m, d, device=dev, dtype=dt, requires_grad=True)
    dy = torch.randn(m, d, device=dev, dtype=dt)
    compiled = torch.compile(mlp)

    def fwd_bwd(fn):
        def run():
            for t in (x, w1, b1, w2, b2):
                t.grad = None
            fn(x, w1, b1, w2, b2).backward(dy)
        return run

    with torch.no_grad():
        g = F.gelu(F.linear(x, w1, b1), approximate="tanh")
        dh = torch.randn(m, h, device=dev, dtype=dt)

    @torch.no_grad()
    def gemms():  # forward 2, backward 4 (input and weight gradients of both projections)
        torch.addmm(b1, x, w1.t())
        torch.addmm(b2, g, w2.t())
        dy @ w2
        dy.t() @ g
        dh @ w1
        dh.t() @ x

    @torch.no_grad()
    def fc1_then_gelu():
        return F.gelu(torch.addmm(b1, x, w1.t()), approximate="tanh")

    @torch.no_grad()
    def fc1_epilogue_gelu():
        return torch._addmm_activation(b1, x, w1.t(), use_gelu=True)

    compiled_fc1_gelu = torch.compile(fc1_then_gelu)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from kernels.gelu_mlp import gelu_mlp  # noqa: E402  (session 14: the epilogues built)

    fused = torch.compile(gelu_mlp)
    rows = [("compiled MLP forward + backward", time_ms(fwd_bwd(compiled))),
            ("compiled MLP f+b, GELU in cuBLASLt's epilogues (kernels.gelu_mlp, model.mlp=fused)",
             time_ms(fwd_bwd(fused))),
            ("compiled MLP forward + backward, again (order check)", time_ms(fwd_bwd(compiled))),
            ("eager MLP f+b, GELU in the epilogues", time_ms(fwd_bwd(gelu_mlp))),
            ("eager MLP forward + backward", time_ms(fwd_bwd(mlp))),
            ("its 6 GEMMs alone", time_ms(gemms)),
            ("fc1 + GELU, compiled (bias GEMM, Triton GELU)", time_ms(compiled_fc1_gelu)),
            ("fc1 + GELU in cuBLASLt's epilogue (_addmm_activation)", time_ms(fc1_epilogue_gelu))]

    from torch.profiler import ProfilerActivity, profile
    for name, fn in (("compiled plain MLP", compiled), ("compiled GELU-epilogue MLP", fused)):
        run = fwd_bwd(fn)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                run()
            torch.cuda.synchronize()
        print(f"{name}, 3 forward + backward:")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {m} tokens x d {d} -> {h} -> {d}, bf16")
    print("| what | ms (median of 20) |")
    print("|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms:.3f} |")


if __name__ == "__main__":
    main()
