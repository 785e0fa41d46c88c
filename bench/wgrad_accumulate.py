"""What a block's weight-gradient GEMMs cost with the weight cache's fold and with fp32 accumulation
inside the GEMM (kernels/wgrad.py; issue 7, session 16).

Per transformer block at a model's shapes -- the four Linear weights qkv (3d x d), attention proj
(d x d), fc (4d x d), MLP proj (d x 4d); M tokens per micro-batch -- GPU time of:
  bf16 GEMMs           dW = dy^T x for the four, written in bf16 (what the backward computes)
  bf16 GEMMs + fold    the same, then master.grad.add_(dW) per weight (training/weight_cache.py's fold)
  fp32 accumulate      the four GEMMs adding into the fp32 .grad themselves (beta = 1)
CUDA events, the three interleaved (kernels.timing), median of --reps; fresh random operands. (The
trainer accumulates the MLP's two weights this way, not attention's: model/attention.py says why.)

    python bench/wgrad_accumulate.py [--reps 40]
"""
from __future__ import annotations

import argparse

import torch

from kernels.timing import time_interleaved_ms
from kernels.wgrad import accumulate

SHAPES = {  # name: (tokens per micro-batch, d_model, layers)
    "1.3B-8k micro-batch 3": (3 * 8192, 2048, 24),
    "2.7B-8k micro-batch 1": (8192, 2560, 32),
}


def block_weights(d: int):
    """(out, in) of a block's four Linear weights."""
    return [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=40)
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| shape | bf16 GEMMs ms | + fold ms | fp32 accumulate ms | saved per block ms | per micro-batch ms |")
    print("|---|---|---|---|---|---|")
    for name, (m, d, layers) in SHAPES.items():
        ops = []
        for n, k in block_weights(d):
            dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            main_grad = torch.randn(n, k, device="cuda")
            ops.append((dy, x, main_grad))

        def gemms():
            return [dy.t() @ x for dy, x, _ in ops]

        def gemms_fold():
            for (dy, x, main_grad) in ops:
                main_grad.add_(dy.t() @ x)

        def fp32_accumulate():
            for dy, x, main_grad in ops:
                accumulate(dy, x, main_grad)

        ms = time_interleaved_ms({"gemms": gemms, "fold": gemms_fold, "accumulate": fp32_accumulate},
                                 reps=args.reps)
        saved = ms["fold"] - ms["accumulate"]
        print(f"| {name} (M {m}, d {d}) | {ms['gemms']:.3f} | {ms['fold']:.3f} | {ms['accumulate']:.3f} | "
              f"{saved:.3f} ({saved / ms['fold']:.1%}) | {saved * layers:.1f} ({layers} layers) |")


if __name__ == "__main__":
    main()
