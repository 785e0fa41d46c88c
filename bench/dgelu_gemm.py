"""The MLP backward's first product with the GELU backward in its epilogue (issue 7, session 19).

    python3 bench/dgelu_gemm.py [--reps 60]

Per shape (tokens of a micro-batch x d -> h, bf16, one GPU): GPU time of
  separate   what the MLP ran before: dg = dy w2 (cuBLAS), then gelu_backward_bias (one memory pass
             writing dpre and b1's partial sums) and the partial sums' reduction
  gemm only  dy w2 alone (cuBLAS): the floor for any fused version
  fused <i>  csrc/mlp/dgelu_gemm*.cu variant i: one CUTLASS GEMM, dpre in its epilogue, and b1's
             gradient too (names ending _bias) or a column sum after it
CUDA events, GPU time (the host has queued each call before its first event: kernels/timing.py),
candidates interleaved in a balanced order, warm-up, median of --reps calls. TFLOP/s = 2 M d h / time.
Each row also gives the max error of dpre and b1's gradient against the fp32 reference.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.build import load_extension  # noqa: E402
from kernels.timing import time_interleaved_ms  # noqa: E402

SHAPES = {  # name: (tokens per micro-batch, d_model, MLP hidden)
    "2.7B-8k mb1": (8192, 2560, 10240),
    "1.3B-8k mb3": (24576, 2048, 8192),
    "1.3B-8k mb1": (8192, 2048, 8192),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=60)
    args = p.parse_args(argv)
    ext = load_extension()
    n = ext.dgelu_gemm_variants()
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | {n} fused variants built")
    rows = []
    for name, (m, d, h) in SHAPES.items():
        torch.manual_seed(0)
        dy = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
        w2 = (torch.randn(d, h, device="cuda") / d ** 0.5).bfloat16()
        pre = (torch.randn(m, h, device="cuda") * 1.5).bfloat16()
        ref = torch.ops.aten.gelu_backward(dy.float() @ w2.float(), pre.float(), approximate="tanh")
        ref_b = ref.sum(0)

        def separate():
            dpre, partial = ext.gelu_backward_bias(dy @ w2, pre)
            return dpre, partial.sum(0)

        fns = {"separate": separate, "gemm only": lambda: dy @ w2}
        for v in range(n):
            fns[f"fused {v} {ext.dgelu_gemm_variant_name(v)}"] = (lambda v=v: ext.dgelu_gemm(dy, w2, pre, v))
        ms = time_interleaved_ms(fns, reps=args.reps, warmup=5)
        for cand, t in ms.items():
            err = "-"
            if cand != "gemm only":
                dpre, db1 = fns[cand]()
                err = (f"{(dpre.float() - ref).abs().max().item():.2e} / "
                       f"{(db1.float() - ref_b).abs().max().item() / ref_b.abs().max().item():.1e}")
            rows.append((name, cand, t, 2 * m * d * h / t / 1e9, ms["separate"] / t, err))
        del dy, w2, pre, ref
        torch.cuda.empty_cache()
    print("| shape (M x d -> h) | candidate | ms | TFLOP/s | speed-up vs separate | max err dpre / db1 (rel) |")
    print("|---|---|---|---|---|---|")
    for name, cand, t, tf, ratio, err in rows:
        m, d, h = SHAPES[name]
        print(f"| {name} ({m} x {d} -> {h}) | {cand} | {t:.3f} | {tf:.0f} | {ratio:.3f}x | {err} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
