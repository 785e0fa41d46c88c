"""The MLP's forward GELU GEMM held at the board's power limit: what its GELU costs.

A training step holds an H100 at its 700 W limit, where a GEMM's speed follows its energy per FLOP.
Held there one candidate at a time (bench/gemm_sustained.cu, session 25), cuBLASLt's GELU_AUX_BIAS
kernels for the 2.7B-8k shape ran at 595 TFLOP/s against 664-693 for the step's plain bias GEMMs.
This script compares, per shape (tokens of a micro-batch x d -> h, bf16):

  cublaslt          ext.linear_gelu: one cuBLASLt GEMM writing pre = x w1^T + b1 and g = gelu_tanh(pre)
                    (what the fused MLP runs, kernels/gelu_mlp.py)
  bias_gemm         torch.addmm(b1, x, w1^T) alone: the floor (no GELU, one output written)
  bias_gemm+gelu    that, then F.gelu(pre, tanh) as a second kernel: the unfused alternative

(Session 25 also held three CUTLASS 3 GEMMs with the same epilogue -- LinCombPerRowBiasEltActAux,
cooperative 128x256 / 256x128 and ping-pong 128x128 tiles -- here: 0.89-0.98x cuBLASLt's; not kept,
bench/RESULTS.md.)

Each candidate runs back to back for --seconds per turn, candidates rotating over --rounds rounds
after --heat seconds of warming (so none always follows a hotter one); per turn the median GPU time
of the second half of its calls (CUDA events) and, from NVML, SM clock, board power and joules per
call; the table gives the median over rounds. TFLOP/s = 2 M d h / time. Before timing, each fused
candidate's g and pre are checked against an fp32 reference (max error printed; a wrong one is not
timed).

    python3 bench/gelu_gemm_sustained.py [--shapes 2.7b-mb2 1.3b-mb3] [--seconds 1] [--rounds 3] [--heat 3]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernels.build import load_extension  # noqa: E402
from sustained_attention import run_turn  # noqa: E402
from training.gpu_telemetry import GpuTelemetry  # noqa: E402

SHAPES = {  # name: (tokens per micro-batch, d_model, MLP hidden)
    "2.7b-mb2": (16384, 2560, 10240),
    "2.7b-mb1": (8192, 2560, 10240),
    "1.3b-mb3": (24576, 2048, 8192),
}


def turn(fn, seconds: float, telemetry) -> dict:
    """Calls of fn() for `seconds` (bench/sustained_attention.py's loop): median GPU time over the
    second half, SM clock, board power and joules per call."""
    out = run_turn(fn, None, seconds, telemetry)
    energy = out.get("gpu_energy_j")
    return {"ms": out["ms"], "mhz": out.get("gpu_sm_clock_mhz"), "w": out.get("gpu_power_w"),
            "j": energy / out["calls"] if energy is not None else None}


def candidates(ext, x, w1, b1) -> dict:
    c = {"cublaslt": lambda: ext.linear_gelu(x, w1, b1)}
    c["bias_gemm"] = lambda: torch.addmm(b1, x, w1.t())
    c["bias_gemm+gelu"] = lambda: F.gelu(torch.addmm(b1, x, w1.t()), approximate="tanh")
    return c


def check(fused: dict, x, w1, b1) -> dict:
    """Max |error| of g and pre against fp32 math on the same bf16 operands, per fused candidate
    (several when comparing other implementations of the epilogue beside cuBLASLt's)."""
    pre_ref = torch.addmm(b1.float(), x.float(), w1.float().t())
    g_ref = F.gelu(pre_ref, approximate="tanh")
    errors = {}
    for name, fn in fused.items():
        g, pre = fn()
        errors[name] = ((g.float() - g_ref).abs().max().item(), (pre.float() - pre_ref).abs().max().item())
    return errors


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["2.7b-mb2", "1.3b-mb3"], choices=sorted(SHAPES))
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--heat", type=float, default=3.0)
    args = ap.parse_args(argv)
    ext = load_extension()
    telemetry = GpuTelemetry.open(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}; "
          f"{args.rounds} rounds of {args.seconds:g} s per candidate after {args.heat:g} s of heating")
    for shape in args.shapes:
        M, d, h = SHAPES[shape]
        torch.manual_seed(0)
        x = torch.randn(M, d, device="cuda").to(torch.bfloat16)
        w1 = (torch.randn(h, d, device="cuda") * d ** -0.5).to(torch.bfloat16)
        b1 = (torch.randn(h, device="cuda") * 0.1).to(torch.bfloat16)
        cands = candidates(ext, x, w1, b1)
        errors = check({"cublaslt": cands["cublaslt"]}, x, w1, b1)
        for name, (eg, ep) in errors.items():
            # |pre| stays below ~8 here: one bf16 rounding of it is <= 2^-5, plus fp32 summation order
            if max(eg, ep) > 2 ** -4:
                print(f"  {name}: g error {eg:.3g} / pre error {ep:.3g}: WRONG, not timed")
                cands.pop(name)
        for fn in cands.values():  # lazy module loading and autotuning outside the timed turns
            fn()
        turn(next(iter(cands.values())), args.heat, None)
        results = {name: [] for name in cands}
        names = list(cands)
        for r in range(args.rounds):
            order = names if r % 2 == 0 else names[::-1]
            for name in order:
                results[name].append(turn(cands[name], args.seconds, telemetry))
        flop = 2.0 * M * d * h
        base = statistics.median(t["ms"] for t in results["cublaslt"])
        print(f"\n{shape}: x ({M}, {d}) w1 ({h}, {d}), {flop / 1e9:.0f} GFLOP per call")
        print("| candidate | TFLOP/s | vs cublaslt | SM MHz | W | J per call | max err g / pre |")
        print("|---|---|---|---|---|---|---|")
        for name in names:
            ts = results[name]
            ms = statistics.median(t["ms"] for t in ts)
            med = lambda k: statistics.median(t[k] for t in ts) if all(t.get(k) is not None for t in ts) else None  # noqa: E731
            mhz, w, j = med("mhz"), med("w"), med("j")
            err = errors.get(name)
            print(f"| {name} | {flop / ms / 1e9:.0f} | {base / ms:.3f}x | {mhz or 0:.0f} | {w or 0:.0f} | "
                  f"{j or 0:.3f} | {'%.3g / %.3g' % err if err else '-'} |")
    if telemetry is not None:
        telemetry.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
