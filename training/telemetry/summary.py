"""Steady-state summary of a run: medians of the throughput figures over its logged train steps after
a warm-up, and its peak memory. RunLogger puts them into the W&B run's summary and writes them to
<run_dir>/summary.json when the run ends (bench/paper_table.py reads that file).

Keys: steady/<name> for each name in STEADY_KEYS (median over the train records with
step > warmup_steps; None when none carries a number), steady/steps (how many train records that
window holds), steady/warmup_steps, and peak_mem_gb (max of mem_max_alloc_gb over all train records;
None where the device reports no allocator peak, e.g. CPU).
"""
from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path
from typing import Dict, Iterable, List, Optional

STEADY_KEYS = ("tokens_per_s_per_gpu", "tflops_paper", "tflops_causal", "mfu_paper", "mfu_causal",
               "gpu_sm_clock_mhz", "gpu_power_w")
PEAK_MEM_KEY = "mem_max_alloc_gb"


def _number(v) -> Optional[float]:
    """v as a finite float, else None (None, NaN, strings, bools)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def train_records(records: Iterable[dict]) -> List[dict]:
    """The train records (those with a step and a loss; eval records carry eval/* keys only), one per
    step (a later record of the same step wins), in step order."""
    by_step: Dict[int, dict] = {}
    for r in records:
        if isinstance(r.get("step"), int) and "loss" in r:
            by_step[r["step"]] = r
    return [by_step[s] for s in sorted(by_step)]


def steady_summary(records: Iterable[dict], warmup_steps: int) -> dict:
    """The summary dict (module docstring) of a run's metric records."""
    train = train_records(records)
    window = [r for r in train if r["step"] > warmup_steps]
    out: dict = {}
    for key in STEADY_KEYS:
        values = [v for v in (_number(r.get(key)) for r in window) if v is not None]
        out[f"steady/{key}"] = statistics.median(values) if values else None
    out["steady/steps"] = len(window)
    out["steady/warmup_steps"] = warmup_steps
    mem = [v for v in (_number(r.get(PEAK_MEM_KEY)) for r in train) if v is not None]
    out["peak_mem_gb"] = max(mem) if mem else None
    return out


def read_jsonl(path: Path) -> List[dict]:
    """Records of a metrics.jsonl (torn or non-object lines skipped)."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def write_summary(path: Path, summary: dict) -> None:
    """Write the summary as JSON, atomically (a reader never sees half a file)."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
