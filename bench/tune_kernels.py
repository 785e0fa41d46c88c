"""Measure this GPU's fastest attention kernel per shape class and write the tuning cache that the
extension applies when it loads (kernels/tune_cache.py has the classes, the candidates and the file).

Each class -- pass (forward, backward) x head dim (64, 128) x causal x seqlen bucket (<= 1k, 2k, 4k,
longer) -- is timed at 16k tokens a batch and d_model 2048, the kernel sweep's shapes
(bench/kernel_sweep.py), with every candidate forced in turn: FA2 and Hopper, and above 1k keys for
the backward FA2, Hopper in lock-step and Hopper in turns. The winner of each class goes to

    ~/.cache/flashgpt/tune/<gpu name>-<kernel source hash>.json   ($FLASHGPT_TUNE_CACHE: the folder)

Another GPU model or changed kernel sources mean another file name: run it again there (it prints
the table; --force re-measures an existing file). Off Hopper there is one kernel family: nothing to do.

    python bench/tune_kernels.py [--reps 20] [--force]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict, List, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: our kernels package

from cuda_timing import time_ms  # noqa: E402
from kernel_sweep import D_MODEL, TOKENS  # noqa: E402  the sweep's shapes: 16k tokens a batch, d_model 2048
from kernels.tune_cache import (apply, cache_path, candidates, hopper_visible, load, save,  # noqa: E402
                                shape_classes)

BUCKET_SEQLEN = {0: 1024, 1: 2048, 2: 4096, 3: 8192}  # bucket (csrc/hopper/dispatch.cu) -> length timed
BUCKET_LABEL = {0: "<=1k", 1: "2k", 2: "4k", 3: ">4k"}
PASSES = {0: "fwd", 1: "bwd"}
# choice -> what it runs (csrc/flash.h): -1 is the built-in default, never cached.
LABELS = {0: "FA2", 1: "Hopper", 2: "Hopper, lock-step", 3: "Hopper, turns"}


def choose(ms: Dict[str, float], pass_: int, bucket: int) -> int:
    """The choice of the candidate that took least time (ties: the earlier in `candidates`)."""
    return min(candidates(pass_, bucket), key=lambda c: ms[c[0]])[1]


def measure(ext, reps: int) -> List[dict]:
    """Time every candidate of every shape class (the extension's choice forced per class, then put
    back to the default). Returns the cache entries."""
    from kernels import flash_attn_func

    entries = []
    for p, d, causal, bucket in shape_classes():
        s = BUCKET_SEQLEN[bucket]
        batch, heads = TOKENS // s, D_MODEL // d
        torch.manual_seed(0)
        q, k, v = (torch.randn(batch, s, heads, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        dout = torch.randn_like(q)
        ms: Dict[str, float] = {}
        try:
            for name, choice in candidates(p, bucket):
                ext.set_sm90_choice(p, d, causal, bucket, choice)
                if p == 0:
                    with torch.no_grad():
                        ms[name] = time_ms(lambda: flash_attn_func(q, k, v, causal=causal), reps)
                else:
                    out = flash_attn_func(q, k, v, causal=causal)
                    ms[name] = time_ms(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
                                        reps)
        finally:
            ext.set_sm90_choice(p, d, causal, bucket, -1)
        entries.append({"pass": p, "d": d, "causal": causal, "bucket": bucket,
                        "choice": choose(ms, p, bucket), "ms": ms})
        torch.cuda.empty_cache()
    return entries


def table(entries: List[dict]) -> str:
    lines = ["| pass | hdim | causal | seqlen | FA2 ms | Hopper ms | Hopper lock-step / turns ms | chosen |",
             "|---|---|---|---|---|---|---|---|"]
    nan = float("nan")  # a hand-written cache without timings
    for e in entries:
        ms = e.get("ms", {})
        hopper = f"{ms['hopper']:.3f}" if "hopper" in ms else "-"
        schedules = f"{ms['lockstep']:.3f} / {ms['turns']:.3f}" if "turns" in ms else "-"
        lines.append(f"| {PASSES[e['pass']]} | {e['d']} | {'yes' if e['causal'] else 'no'} | "
                     f"{BUCKET_LABEL[e['bucket']]} | {ms.get('fa2', nan):.3f} | {hopper} | {schedules} | "
                     f"{LABELS[int(e['choice'])]} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20, help="timed calls per candidate (median)")
    ap.add_argument("--force", action="store_true", help="re-measure even if this GPU's cache file exists")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_kernels: no CUDA GPU is visible here; tuning measures the kernels on the GPU that will "
              "run them (run it on that machine)", file=sys.stderr)
        return 1
    if not hopper_visible():
        print(f"tune_kernels: {torch.cuda.get_device_name()} has one kernel family (FA2); nothing to tune")
        return 0
    from kernels.build import load_extension, source_hash

    ext = load_extension()
    path = cache_path(torch.cuda.get_device_name(), source_hash())
    if path.is_file() and not args.force:
        print(f"tune_kernels: {path} exists (in use); --force re-measures\n")
        print(table(load(path)))
        return 0
    entries = measure(ext, args.reps)
    save(path, entries, {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                         "source_hash": source_hash(), "reps": args.reps})
    apply(ext, entries)
    print(f"tune_kernels: wrote {path} (applied from now on, in every process of this build on this GPU)\n")
    print(table(entries))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
