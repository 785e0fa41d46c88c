"""Local (sliding-window) attention timings: our kernels with a causal window of w tokens
(window_size=(w - 1, 0)) against our dense causal kernels and SDPA given the same window as a boolean
mask (SDPA has no mask-free window; its masked backends visit every tile). Forward and forward + backward,
bf16, head dim 128, 2048 model width, ~32k tokens per call, CUDA-event medians (bench/cuda_timing.py,
candidates interleaved).

    python bench/window_sweep.py                           # windows 1k, 4k at 8k, 16k, 32k
    python bench/window_sweep.py --windows 1024 --seqlens 16384 --no-sdpa

On sm_90 both "dense" and "window" run the Hopper TMA kernels at head dims 64 / 128 (docs/kernels.md,
dispatch). TFLOP/s count only the query-key pairs each call must compute (the band for a window, the causal
triangle for dense), so a kernel that skips the tiles outside the band keeps its rate while its time
falls with the window.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: our kernels package

from cuda_timing import time_interleaved_ms  # noqa: E402
from kernels import flash_attn_func  # noqa: E402
from kernels.reference import window_mask  # noqa: E402

D_MODEL, HDIM, TOKENS = 2048, 128, 32768


def pairs(seqlen: int, window: int | None) -> int:
    """Query-key pairs a causal (window None) or windowed causal row set attends to."""
    if window is None or window >= seqlen:
        return seqlen * (seqlen + 1) // 2
    return seqlen * window - window * (window - 1) // 2


def row(seqlen: int, window: int, reps: int, sdpa: bool) -> dict:
    batch, heads = max(1, TOKENS // seqlen), D_MODEL // HDIM
    torch.manual_seed(0)
    q, k, v = (torch.randn(batch, seqlen, heads, HDIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn_like(q)
    fns = {
        "window": lambda: flash_attn_func(q, k, v, causal=True, window_size=(window - 1, 0)),
        "dense": lambda: flash_attn_func(q, k, v, causal=True),
    }
    if sdpa:
        mask = window_mask(seqlen, seqlen, True, (window - 1, 0), "cuda")

        def sdpa_masked():
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               attn_mask=mask)
            return o.transpose(1, 2)
        fns["sdpa_mask"] = sdpa_masked

    def fwd(fn):
        def call():
            with torch.no_grad():
                return fn()
        return call

    def fwd_bwd(fn):
        return lambda: torch.autograd.grad(fn(), (q, k, v), dout)

    fwd_ms = time_interleaved_ms({n: fwd(f) for n, f in fns.items()}, reps)
    fb_ms = time_interleaved_ms({n: fwd_bwd(f) for n, f in fns.items()}, reps)
    out = {"seqlen": seqlen, "window": window, "batch": batch}
    for name in fns:
        work = pairs(seqlen, None if name == "dense" else window)
        flops = 4 * batch * heads * work * HDIM
        out[name] = (fwd_ms[name], fb_ms[name], flops / fwd_ms[name] / 1e9, 3.5 * flops / fb_ms[name] / 1e9)
    with torch.no_grad():  # ours against SDPA's masked fp32 math on a causal prefix (sanity, not a test)
        n = min(seqlen, 4096)
        qs, ks, vs = (t[:1, :n, :2].detach() for t in (q, k, v))
        m = window_mask(n, n, True, (window - 1, 0), "cuda")
        ref = F.scaled_dot_product_attention(*(t.transpose(1, 2).float() for t in (qs, ks, vs)), attn_mask=m)
        ours = flash_attn_func(qs, ks, vs, causal=True, window_size=(window - 1, 0))
        out["err"] = (ours.float() - ref.transpose(1, 2)).abs().max().item()
    del fns
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--windows", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-sdpa", action="store_true", help="skip SDPA with a boolean mask (slow, seqlen^2 mask)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("window_sweep needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}, bf16, head dim {HDIM}, {TOKENS} tokens per call; "
          "ms (TFLOP/s over the pairs attended) for forward | forward + backward")
    names = ["window", "dense"] + ([] if args.no_sdpa else ["sdpa_mask"])
    print("| seqlen | window | " + " | ".join(f"{n} fwd | {n} f+b" for n in names) + " | max err |")
    print("|---|---|" + "---|---|" * len(names) + "---|")
    for s in args.seqlens:
        for w in args.windows:
            r = row(s, w, args.reps, not args.no_sdpa)
            cells = [f"{r[n][0]:.2f} ({r[n][2]:.0f}) | {r[n][1]:.2f} ({r[n][3]:.0f})" for n in names]
            print(f"| {s} | {w} | " + " | ".join(cells) + f" | {r['err']:.1e} |", flush=True)


if __name__ == "__main__":
    main()
