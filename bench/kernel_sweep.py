"""Kernel sweep of shared/BENCHMARKS.md: ours vs PyTorch SDPA (flash backend) vs SDPA (cuDNN backend)
vs FlashAttention-4 (package flash-attn-4, `flash_attn.cute`; a column whenever it is importable).

Same process, same inputs; head dim 64/128, seqlen 512..16k, batch*seqlen = 16k tokens,
d_model 2048 -> heads = 2048/hdim, bf16, causal and not.
Timing: CUDA events around each call, warm-up first, median of --reps calls per candidate, the
candidates of a row interleaved one call at a time in an order where each runs right after every
other equally often (bench/cuda_timing.py; --fixed-order: 5 passes in a fixed order). By default the
GPU time of a call (the host has queued the call before the first event fires, as in a training
step); --call-time: the time of a synchronised eager call, host launch time included.
TFLOP/s: FLOPs = 4*batch*heads*seqlen^2*hdim (halved if causal); fwd+bwd = 3.5 x fwd.
Error column: max |ours - fp32 reference| of the forward output on batch 0, heads 0-1
(the full fp32 reference at 16k would need tens of GB); likewise for SDPA flash and FA4.
Last, per peer and pass (summary): the range of ours / peer, the rows at >= 1.05x and the rows the peer
leads, from the unrounded figures (the table rounds ratios to two places).

    python bench/kernel_sweep.py [--reps 30] [--hdims 64 128] [--seqlens 512 1024 ...] [--json out.json]
                                 [--compare-fa2] [--compare-fa2bwd] [--compare-bwdlockstep]
                                 [--compare-bwdpingpong] [--only-ours] [--no-fa4] [--call-time] [--fixed-order]

--compare-<variant> also times our kernels with another choice of the Hopper dispatch table
(csrc/hopper/dispatch.cu, the table a tuning cache fills: bench/tune_kernels.py) for the row's shape
class; off Hopper the table is ignored and a variant runs the default's FA2 kernels.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: our kernels package

from cuda_timing import time_interleaved_ms  # noqa: E402
from kernels import flash_attn_func  # noqa: E402
from kernels.reference import attention_ref  # noqa: E402

TOKENS, D_MODEL = 16384, 2048


# Variants of our kernels timed beside the default dispatch: name -> ({pass: choice} written into the
# row's entries of the Hopper dispatch table (pass 0 forward, 1 backward; choice 0 FA2, 2 / 3 the Hopper
# backward with its consumer warpgroups in lock-step / taking turns), what it is). Each gives a
# --compare-<name> flag.
VARIANTS = {
    "fa2": ({0: 0, 1: 0}, "our FA2 path where the Hopper kernels would run"),
    "fa2bwd": ({1: 0}, "the Hopper forward with the FA2 backward"),
    "bwdlockstep": ({1: 2}, "the Hopper backward with its warpgroups in lock-step at every size"),
    "bwdpingpong": ({1: 3}, "the Hopper backward with its warpgroups in turns at every size "
                            "(default: from 1024 queries; 512 at head dim 128 without a causal mask)"),
}
TABLE_HEAD_DIMS = (64, 128)  # the head dims the dispatch table has entries for (others: FA2 only)


@contextlib.contextmanager
def variant(name: str | None, hdim: int, causal: bool, seqlen: int):
    """Within the block our kernels run as variant `name` at this row's shape class (None: the
    dispatch as it stands, a tuning cache's choices included); the entries are put back after."""
    if name is None or hdim not in TABLE_HEAD_DIMS:
        yield
        return
    from kernels.build import load_extension

    ext = load_extension()
    bucket = ext.seqlen_bucket(seqlen)
    choices = VARIANTS[name][0]
    saved = {p: ext.sm90_choice(p, hdim, causal, bucket) for p in choices}
    try:
        for p, choice in choices.items():
            ext.set_sm90_choice(p, hdim, causal, bucket, choice)
        yield
    finally:
        for p, choice in saved.items():
            ext.set_sm90_choice(p, hdim, causal, bucket, choice)


def load_fa4() -> tuple[Callable | None, str]:
    """(FlashAttention-4's flash_attn_func, the flash-attn-4 version), or (None, why it is not importable)."""
    try:
        from flash_attn.cute import flash_attn_func as fa4
    except Exception as e:  # ImportError, or a CUDA library its import loads raising
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    try:
        version = importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:  # e.g. a source checkout on PYTHONPATH
        version = "unknown"
    return fa4, version


def setup_fa4(wanted: bool) -> tuple[Callable | None, str | None]:
    """The sweep's FA4 column: (flash_attn_func, version) when wanted and importable; otherwise
    (None, None), and one line saying why when it was wanted."""
    if not wanted:
        return None, None
    fa4, what = load_fa4()
    if fa4 is None:
        print(f"FA4 not importable ({what}): column left out")
        return None, None
    return fa4, what


def impls(causal: bool, deterministic: bool = False, fa4: Callable | None = None):
    """name -> attention(q, k, v) -> out, q/k/v/out (batch, seqlen, heads, hdim): ours, SDPA flash,
    SDPA cuDNN, and FA4 when its flash_attn_func is given."""
    def ours(q, k, v):
        return flash_attn_func(q, k, v, causal=causal, deterministic=deterministic)

    def sdpa(backend):
        def f(q, k, v):
            with sdpa_kernel(backend):
                o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                   v.transpose(1, 2), is_causal=causal)
            return o.transpose(1, 2)
        return f

    def flash4(q, k, v):
        out = fa4(q, k, v, causal=causal, softmax_scale=q.shape[-1] ** -0.5)
        return out[0] if isinstance(out, tuple) else out  # some versions return (out, lse)

    fns = {"ours": ours, "flash": sdpa(SDPBackend.FLASH_ATTENTION), "cudnn": sdpa(SDPBackend.CUDNN_ATTENTION)}
    if fa4 is not None:
        fns["fa4"] = flash4
    return fns


def candidates(causal: bool, det: bool = False, only_ours: bool = False, variants: tuple[str, ...] = (),
               fa4: Callable | None = None) -> dict[str, Callable]:
    """The candidates of one sweep row, name -> attention(q, k, v): ours, the peers (SDPA flash and
    cuDNN, FA4 when given; none with only_ours), ours deterministic with det, and one entry per
    variant (our op again, timed with another kernel selected)."""
    fns = impls(causal, fa4=fa4)
    if only_ours:
        fns = {"ours": fns["ours"]}
    if det:
        fns["ours_det"] = impls(causal, deterministic=True)["ours"]
    for name in variants:
        fns[name] = fns["ours"]
    return fns


def add_tflops(row: dict, flops: float, fwd_ms: dict, fb_ms: dict) -> None:
    """row[<name>_fwd], row[<name>_fwdbwd]: TFLOP/s of each timed candidate (fwd+bwd = 3.5 x fwd FLOPs)."""
    for name in fwd_ms:
        row[f"{name}_fwd"] = flops / fwd_ms[name] / 1e9
        row[f"{name}_fwdbwd"] = 3.5 * flops / fb_ms[name] / 1e9


def bench_row(hdim: int, seqlen: int, causal: bool, reps: int, det: bool,
              only_ours: bool = False, variants: tuple[str, ...] = (), tokens: int = TOKENS,
              queue_ahead: bool = True, fixed_order: bool = False, fa4: Callable | None = None) -> dict:
    batch, heads = max(1, tokens // seqlen), D_MODEL // hdim
    torch.manual_seed(0)
    q, k, v = (torch.randn(batch, seqlen, heads, hdim, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    flops = 4 * batch * heads * seqlen * seqlen * hdim / (2 if causal else 1)
    row = {"hdim": hdim, "causal": causal, "seqlen": seqlen, "batch": batch, "heads": heads}
    fns = candidates(causal, det, only_ours, variants, fa4)

    def forward(name, fn):
        def call():
            with variant(name if name in VARIANTS else None, hdim, causal, seqlen), torch.no_grad():
                return fn(q, k, v)
        return call

    def forward_backward(name, fn):
        def call():
            with variant(name if name in VARIANTS else None, hdim, causal, seqlen):
                return torch.autograd.grad(fn(q, k, v), (q, k, v), dout)
        return call

    runnable = {}
    for name, fn in fns.items():
        try:
            forward_backward(name, fn)()  # also FA4's compile of this shape class, kept out of the timing
            runnable[name] = fn
        except Exception as e:  # e.g. a backend that refuses the shape; FA4: its DSL compiler's errors too
            if name != "fa4" and not isinstance(e, RuntimeError):
                raise
            print(f"  {name} failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}")
            row[f"{name}_fwd"] = row[f"{name}_fwdbwd"] = float("nan")
    fwd_ms = time_interleaved_ms({n: forward(n, fn) for n, fn in runnable.items()}, reps, queue_ahead=queue_ahead,
                                 fixed_order=fixed_order)
    fb_ms = time_interleaved_ms({n: forward_backward(n, fn) for n, fn in runnable.items()}, reps,
                                queue_ahead=queue_ahead, fixed_order=fixed_order)
    add_tflops(row, flops, fwd_ms, fb_ms)
    with torch.no_grad():
        qs, ks, vs = (t[:1, :, :2].detach() for t in (q, k, v))
        ref, _ = attention_ref(qs.float(), ks.float(), vs.float(), causal)
        row["err"] = (flash_attn_func(qs, ks, vs, causal=causal).float() - ref).abs().max().item()
        if "flash" in fns:
            row["err_flash"] = (fns["flash"](qs, ks, vs).float() - ref).abs().max().item()
        if "fa4" in runnable:  # the row's full call, sliced: the slice's own shape would compile again
            row["err_fa4"] = (fns["fa4"](q, k, v)[:1, :, :2].float() - ref).abs().max().item()
        del ref
    torch.cuda.empty_cache()
    return row


def table(rows: list[dict], det: bool, variants: tuple[str, ...] = ()) -> str:
    """Markdown table of the rows: TFLOP/s of ours and each peer (SDPA flash, cuDNN, and FA4 when the
    rows have it), ours/peer ratios, fwd then fwd+bwd, then extra columns and the max errors."""
    peers = ["flash", "cudnn"] + (["fa4"] if any("fa4_fwd" in r for r in rows) else [])
    nan = float("nan")
    head = "| hdim | causal | seqlen | batch×heads |"
    for speed, ratio in ((" fwd", ""), (" f+b", " f+b")):  # column labels: TFLOP/s, ours/peer
        head += "".join(f" {n}{speed} |" for n in ["ours"] + peers)
        head += "".join(f" ours/{n}{ratio} |" for n in peers)
    head += (" ours det f+b |" if det else "") + "".join(f" {v} fwd | {v} f+b |" for v in variants)
    head += f" max err ({', '.join(n + ' err' for n in peers if n != 'cudnn')}) |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        cells = [r["hdim"], "yes" if r["causal"] else "no", r["seqlen"], f"{r['batch']}×{r['heads']}"]
        for key in ("fwd", "fwdbwd"):
            cells += [f"{r.get(f'{n}_{key}', nan):.0f}" for n in ["ours"] + peers]
            cells += [f"{r[f'ours_{key}'] / r.get(f'{n}_{key}', nan):.2f}" for n in peers]
        if det:
            cells.append(f"{r['ours_det_fwdbwd']:.0f}")
        for v in variants:
            cells += [f"{r[v + '_fwd']:.0f}", f"{r[v + '_fwdbwd']:.0f}"]
        errs = ", ".join(f"{r.get('err_' + n, nan):.1e}" for n in peers if n != "cudnn")
        cells.append(f"{r['err']:.1e} ({errs})")
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def summary(rows: list[dict], target: float = 1.05) -> str:
    """Per peer and pass, from the unrounded TFLOP/s: the range of ours / peer over the rows, how many rows
    reach `target` (issue 46's bar against FA4), and each row where the peer leads (ratio < 1)."""
    peers = ["flash", "cudnn"] + (["fa4"] if any("fa4_fwd" in r for r in rows) else [])
    lines = []
    for peer in peers:
        for key, label in (("fwd", "fwd"), ("fwdbwd", "f+b")):
            ratios = [(r["ours_" + key] / r[f"{peer}_{key}"], r) for r in rows
                      if r.get(f"{peer}_{key}", float("nan")) > 0]  # NaN (a failed peer) compares False
            if not ratios:
                continue
            behind = [f"{r['hdim']} {'causal' if r['causal'] else 'non-causal'} {r['seqlen']} ({x:.3f})"
                      for x, r in ratios if x < 1.0]
            xs = [x for x, _ in ratios]
            lines.append(f"ours/{peer} {label}: {min(xs):.3f}-{max(xs):.3f}x, >= {target:.2f}x on "
                         f"{sum(x >= target for x in xs)} of {len(xs)} rows; {peer} ahead on {len(behind)}"
                         + (": " + ", ".join(behind) if behind else ""))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hdims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--det", action="store_true", help="also time the deterministic backward")
    ap.add_argument("--only-ours", action="store_true", help="tuning sweeps: skip SDPA and FA4")
    ap.add_argument("--no-fa4", action="store_true",
                    help="leave out the FlashAttention-4 column (otherwise timed whenever flash_attn.cute imports)")
    for name, (choices, what) in VARIANTS.items():
        table_entry = ", ".join(f"{('fwd', 'bwd')[p]} {c}" for p, c in choices.items())
        ap.add_argument(f"--compare-{name}", action="store_true",
                        help=f"also time {what} (dispatch table: {table_entry})")
    ap.add_argument("--tokens", type=int, default=TOKENS,
                    help="batch * seqlen per row (16k: the sweep of BENCHMARKS.md; 8k at seqlen 8k = batch 1, "
                         "the end-to-end step's shape)")
    ap.add_argument("--call-time", action="store_true",
                    help="time synchronised eager calls, host launch time included, instead of the GPU time "
                         "of calls the host has already queued")
    ap.add_argument("--fixed-order", action="store_true",
                    help="interleave the candidates in a fixed order (5 passes, each candidate's calls back to "
                         "back) instead of the balanced one where each runs after every other equally often")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    fa4, fa4_version = setup_fa4(wanted=not (args.no_fa4 or args.only_ours))
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"cuDNN {torch.backends.cudnn.version()}" + (f", flash-attn-4 {fa4_version}" if fa4 else ""))
    variants = tuple(v for v in VARIANTS if getattr(args, f"compare_{v}"))
    if variants and torch.cuda.get_device_capability()[0] != 9:
        print(f"  not a Hopper GPU: {', '.join(variants)} run the same FA2 kernels as ours")
    rows = []
    for hdim in args.hdims:
        for causal in args.causal:
            for s in args.seqlens:
                r = bench_row(hdim, s, bool(causal), args.reps, args.det, args.only_ours, variants, args.tokens,
                              queue_ahead=not args.call_time, fixed_order=args.fixed_order, fa4=fa4)
                if fa4:
                    r["fa4_version"] = fa4_version
                line = f"  hdim {hdim} causal {causal} seqlen {s}: ours {r['ours_fwd']:.0f}/{r['ours_fwdbwd']:.0f}"
                if "ours_det_fwdbwd" in r:
                    line += f" (det f+b {r['ours_det_fwdbwd']:.0f})"
                for v in variants:
                    line += f" ({v} {r[v + '_fwd']:.0f}/{r[v + '_fwdbwd']:.0f})"
                if not args.only_ours:
                    line += (f"  flash {r['flash_fwd']:.0f}/{r['flash_fwdbwd']:.0f}  "
                             f"cudnn {r['cudnn_fwd']:.0f}/{r['cudnn_fwdbwd']:.0f}")
                if fa4:
                    line += f"  fa4 {r['fa4_fwd']:.0f}/{r['fa4_fwdbwd']:.0f}"
                print(line + f" TFLOP/s (fwd/fwd+bwd)  err {r['err']:.1e}", flush=True)
                rows.append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if not args.only_ours:
        timing = "call time, host included" if args.call_time else "GPU time, host queued ahead"
        timing += ", fixed order" if args.fixed_order else ", balanced order"
        print(f"\nTFLOP/s (fwd; f+b = fwd+bwd; {timing}), bf16, batch*seqlen = {args.tokens} tokens, d_model 2048\n")
        print(table(rows, args.det, variants))
        print("\n" + summary(rows))


if __name__ == "__main__":
    main()
