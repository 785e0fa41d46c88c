"""The tuning cache: this GPU's measured choice of attention kernel per shape class, read and applied
when the extension loads (kernels/build.py).

On Hopper the extension has two kernel families at run time: the wgmma kernels (csrc/hopper/,
warp-specialised with TMA loads) and the FA2 mma.sync kernels (tiles in csrc/tile_config.h); the
Hopper backward has two schedules besides, its consumer warpgroups in lock-step or in turns. Which
is fastest depends on the pass, head dim, causal mask and sequence length, so a shape class is
pass (forward, backward) x head dim (64, 128) x causal x seqlen bucket (<= 1k, 2k, 4k, longer).
`python bench/tune_kernels.py` times the candidates of every class and writes the winners to

    ~/.cache/flashgpt/tune/<gpu name>-<kernel source hash>.json   ($FLASHGPT_TUNE_CACHE: the folder)

Without that file the built-in defaults of csrc/hopper/dispatch.h hold. Another GPU model or changed
kernel sources mean another file name. This module only reads, checks, writes and applies the file;
it imports nothing else of the package, so the extension's loader can use it.
"""
from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

FORMAT = 2  # entries' choices: 0 FA2, 1 Hopper, 2 / 3 the Hopper backward in lock-step / in turns
PASSES = (0, 1)  # forward, backward
HEAD_DIMS = (64, 128)
BUCKETS = (0, 1, 2, 3)  # csrc/hopper/dispatch.cu's seqlen buckets: <= 1k, 2k, 4k, longer
TUNE_COMMAND = "python bench/tune_kernels.py"
log = logging.getLogger(__name__)


def shape_classes() -> Iterator[Tuple[int, int, bool, int]]:
    """(pass, head dim, causal, bucket) of every class (candidates: `candidates`)."""
    for p in PASSES:
        for d in HEAD_DIMS:
            for causal in (False, True):
                for bucket in BUCKETS:
                    yield p, d, causal, bucket


def candidates(pass_: int, bucket: int) -> Tuple[Tuple[str, int], ...]:
    """(name, choice) of a class's candidates, in order of preference on a tie: the Hopper kernels
    first. The backward above 1k keys has the Hopper kernel's two schedules; at <= 1k keys the bucket
    holds both sides of the built-in threshold (lock-step below 1k queries, or 512 at head dim 128
    without a causal mask; turns from there), so it keeps that."""
    if pass_ == 1 and bucket > 0:
        return (("turns", 3), ("lockstep", 2), ("fa2", 0))
    return (("hopper", 1), ("fa2", 0))


def cache_dir() -> Path:
    env = os.environ.get("FLASHGPT_TUNE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "flashgpt" / "tune"


def cache_path(device_name: str, source_hash: str) -> Path:
    """One file per GPU model and kernel build (names like 'NVIDIA H100 80GB HBM3' made file-safe)."""
    safe = re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_")
    return cache_dir() / f"{safe}-{source_hash}.json"


def save(path: Path, entries: List[dict], meta: dict) -> None:
    """Written to a temporary file and renamed: a crash never leaves half a cache behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"format": FORMAT, **meta, "entries": entries}, indent=1) + "\n")
    tmp.replace(path)


def load(path: Path) -> List[dict]:
    """The file's entries; ValueError naming the file when it is not a cache of this format."""
    data = json.loads(Path(path).read_text())
    if data.get("format") != FORMAT or not isinstance(data.get("entries"), list):
        raise ValueError(f"{path}: not a kernel tuning cache of format {FORMAT}")
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


def hopper_visible() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def apply_cached(ext, source_hash: str) -> Optional[Path]:
    """Apply this GPU's cache file for the build `source_hash` if there is one (kernels/build.py,
    after loading the extension). A file that cannot be read is reported and ignored: the defaults
    stay."""
    if not hopper_visible():
        return None
    import torch

    path = cache_path(torch.cuda.get_device_name(), source_hash)
    if not path.is_file():
        return None
    try:
        apply(ext, load(path))
    except (OSError, ValueError, TypeError) as e:
        log.warning("ignoring the kernel tuning cache %s (%s); re-create it with `%s --force`",
                    path, e, TUNE_COMMAND)
        return None
    log.info("kernel dispatch from the tuning cache %s", path)
    return path
