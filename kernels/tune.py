"""Per-GPU, per-shape-class choice of attention kernel family, measured once and cached on disk.

On Hopper our extension has two kernel families at run time: the wgmma kernels (csrc/hopper/,
warp-specialised with TMA loads since session 4) and the FA2 mma.sync kernels (tiles in
csrc/tile_config.h).
Which one is faster depends on the pass, head dim, causal mask and sequence length (bench/RESULTS.md
v8). The Hopper backward has two schedules besides: its consumer warpgroups in lock-step or in turns
(v25 / v26; built-in: turns from 1024 queries). `python -m kernels.tune` times the candidates of every
shape class — pass (forward, backward) x head dim (64, 128) x causal x seqlen bucket (<= 1k, 2k, 4k,
longer) at 16k tokens a batch and d_model 2048, as kernels.bench: FA2 and Hopper, and above 1k keys
for the backward FA2, Hopper in lock-step and Hopper in turns — and caches the winner of each in

    ~/.cache/flashgpt/tune/<gpu name>-<kernel source hash>.json   ($FLASHGPT_TUNE_CACHE: the folder)

The extension applies that file when it loads (kernels/build.py); without one, the built-in defaults
of csrc/hopper/dispatch.h hold. Another GPU model or changed kernel sources mean another file name:
re-run the command (it prints the table; --force re-measures an existing file).

    python -m kernels.tune [--reps 20] [--force]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from .bench import D_MODEL, TOKENS  # the sweep's shapes: 16k tokens a batch, d_model 2048
from .timing import time_ms

BUCKET_SEQLEN = {0: 1024, 1: 2048, 2: 4096, 3: 8192}  # bucket (csrc/hopper/dispatch.cu) -> length timed
BUCKET_LABEL = {0: "<=1k", 1: "2k", 2: "4k", 3: ">4k"}
PASSES = {0: "fwd", 1: "bwd"}
FORMAT = 2  # 2: backward choices 2 / 3 (the Hopper schedules; session 15)
# choice -> what it runs (csrc/flash.h): -1 is the built-in default, never cached.
LABELS = {0: "FA2", 1: "Hopper", 2: "Hopper, lock-step", 3: "Hopper, turns"}
log = logging.getLogger(__name__)


def shape_classes() -> Iterator[Tuple[int, int, bool, int]]:
    """(pass, head dim, causal, bucket) of every class (candidates: `candidates`)."""
    for p in PASSES:
        for d in (64, 128):
            for causal in (False, True):
                for bucket in BUCKET_SEQLEN:
                    yield p, d, causal, bucket


def cache_dir() -> Path:
    env = os.environ.get("FLASHGPT_TUNE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "flashgpt" / "tune"


def cache_path(device_name: str, source_hash: str) -> Path:
    """One file per GPU model and kernel build (names like 'NVIDIA H100 80GB HBM3' made file-safe)."""
    safe = re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_")
    return cache_dir() / f"{safe}-{source_hash}.json"


def candidates(pass_: int, bucket: int) -> Tuple[Tuple[str, int], ...]:
    """(name, choice) of a class's candidates, in order of preference on a tie: the Hopper kernels
    first. The backward above 1k keys has the Hopper kernel's two schedules; at <= 1k keys the bucket
    holds both sides of the built-in threshold (512 in lock-step, 1k in turns), so it keeps that."""
    if pass_ == 1 and bucket > 0:
        return (("turns", 3), ("lockstep", 2), ("fa2", 0))
    return (("hopper", 1), ("fa2", 0))


def choose(ms: Dict[str, float], pass_: int, bucket: int) -> int:
    """The choice of the candidate that took least time (ties: the earlier in `candidates`)."""
    return min(candidates(pass_, bucket), key=lambda c: ms[c[0]])[1]


def save(path: Path, entries: List[dict], meta: dict) -> None:
    """Written to a temporary file and renamed: a crash never leaves half a cache behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"format": FORMAT, **meta, "entries": entries}, indent=1) + "\n")
    tmp.replace(path)


def load(path: Path) -> List[dict]:
    data = json.loads(Path(path).read_text())
    if data.get("format") != FORMAT or not isinstance(data.get("entries"), list):
        raise ValueError(f"{path}: not a kernels.tune cache of format {FORMAT}")
    keys = {"pass", "d", "causal", "bucket", "choice"}
    for e in data["entries"]:
        if not keys <= set(e):
            raise ValueError(f"{path}: entry {e} lacks one of {sorted(keys)}")
        if e["choice"] not in [c for _, c in candidates(int(e["pass"]), int(e["bucket"]))]:
            raise ValueError(f"{path}: entry {e} has a choice its shape class does not have")
    return data["entries"]


def apply(ext, entries: List[dict]) -> None:
    for e in entries:
        ext.set_sm90_choice(int(e["pass"]), int(e["d"]), bool(e["causal"]), int(e["bucket"]), int(e["choice"]))


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def apply_cached(ext) -> Optional[Path]:
    """Apply this GPU's cache file if there is one (called by kernels/build.py after loading the
    extension). A file that cannot be read is reported and ignored: the defaults stay."""
    if not _hopper():
        return None
    from .build import source_hash

    path = cache_path(torch.cuda.get_device_name(), source_hash())
    if not path.is_file():
        return None
    try:
        apply(ext, load(path))
    except (OSError, ValueError, TypeError) as e:
        log.warning("ignoring the kernel tuning cache %s (%s); re-create it with `python -m kernels.tune "
                    "--force`", path, e)
        return None
    log.info("kernel dispatch from the tuning cache %s", path)
    return path


def measure(ext, reps: int) -> List[dict]:
    """Time every candidate of every shape class (the extension's choice forced per class, then put
    back to the default). Returns the cache entries."""
    from .flash_attn import flash_attn_func

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
        print("kernels.tune: no CUDA GPU is visible here; tuning measures the kernels on the GPU that will "
              "run them (run it on that machine)", file=sys.stderr)
        return 1
    if not _hopper():
        print(f"kernels.tune: {torch.cuda.get_device_name()} has one kernel family (FA2); nothing to tune")
        return 0
    from .build import load_extension, source_hash

    ext = load_extension()
    path = cache_path(torch.cuda.get_device_name(), source_hash())
    if path.is_file() and not args.force:
        print(f"kernels.tune: {path} exists (in use); --force re-measures\n")
        print(table(load(path)))
        return 0
    entries = measure(ext, args.reps)
    save(path, entries, {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                         "source_hash": source_hash(), "reps": args.reps})
    apply(ext, entries)
    print(f"kernels.tune: wrote {path} (applied from now on, in every process of this build on this GPU)\n")
    print(table(entries))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
