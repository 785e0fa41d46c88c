"""One attention pass of ours or FlashAttention-4 between cudaProfilerStart / Stop, for Nsight Compute:
where a kernel's time goes (tensor pipe, shared-memory wavefronts and bank conflicts, instructions),
ours beside FA4's on the same shape. On a GPU machine with ncu (the lent H100 image has it):

    M=sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,\\
    l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,\\
    smsp__inst_executed.sum,gpu__time_duration.sum
    ncu --profile-from-start off --metrics $M python dev/ncu_attention.py ours --causal --seqlen 8192
    ncu --profile-from-start off --metrics $M python dev/ncu_attention.py fa4 --causal --seqlen 8192

(add `--section SpeedOfLight --section WarpStateStats` for ncu's own reading). The shape is the kernel
sweep's: 16k tokens a batch, d_model 2048, bf16. Three untimed passes first (FA4 compiles its kernels
then); ncu profiles every kernel of the one pass after them (ours: pre-pass, main kernel, dQ post-pass).
ncu fixes the clocks at base: compare kernels within one ncu run, not with the sweep's TFLOP/s.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("impl", choices=["ours", "fa4"])
    ap.add_argument("--pass", dest="which", choices=["bwd", "fwd"], default="bwd")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--hdim", type=int, default=128, choices=[64, 128])
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    s, d = a.seqlen, a.hdim
    b, h = max(1, 16384 // s), 2048 // d
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    if a.impl == "ours":
        from kernels import flash_attn_func

        def attn() -> torch.Tensor:
            return flash_attn_func(q, k, v, causal=a.causal)
    else:
        from flash_attn.cute import flash_attn_func as fa4

        def attn() -> torch.Tensor:
            out = fa4(q, k, v, causal=a.causal, softmax_scale=d ** -0.5)
            return out[0] if isinstance(out, tuple) else out

    for _ in range(3):
        torch.autograd.grad(attn(), (q, k, v), dout)
    out = attn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    if a.which == "bwd":
        torch.autograd.grad(out, (q, k, v), dout)
    else:
        attn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"profiled: {a.impl} {a.which} {'causal' if a.causal else 'full'} seqlen {s} batch {b} heads {h} hdim {d}")


if __name__ == "__main__":
    main()
