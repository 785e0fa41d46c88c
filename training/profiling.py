"""Where one training step's time goes: attention, matrix products, everything else.

`train.profile_step=N` runs optimizer step N under torch.profiler, writes a Chrome trace to
<run_dir>/profile_step_N.json and logs the shares. Kernels (on CUDA) or operators (on CPU) are put
in a class by name, which is a heuristic: attention = our kernels and SDPA's flash / cuDNN /
memory-efficient kernels; matmul = cuBLAS / CUTLASS GEMM kernels (or aten::mm-like ops on CPU).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Dict, Tuple

import torch
from torch.profiler import ProfilerActivity, profile

ATTENTION = re.compile(r"flash|fmha|sdpa|attention|attn|flashgpt", re.I)
MATMUL = re.compile(r"gemm|cutlass|nvjet|xmma|cublas|aten::(mm|addmm|bmm|matmul|linear)\b", re.I)


def classify(name: str) -> str:
    if ATTENTION.search(name):
        return "attention"
    if MATMUL.search(name):
        return "matmul"
    return "other"


def time_shares(events, device_type: str) -> Dict[str, float]:
    """Shares of the step's kernel (CUDA) or top-level operator (CPU) self time, by class."""
    totals = {"attention": 0.0, "matmul": 0.0, "other": 0.0}
    for e in events:
        if device_type == "cuda":  # kernels only (operators would count their kernels twice)
            if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
                continue
            t = e.self_device_time_total
        else:
            t = e.self_cpu_time_total
        if t > 0:
            totals[classify(e.key)] += t
    whole = sum(totals.values()) or 1.0
    return {f"time_share_{k}": v / whole for k, v in totals.items()}


def profile_call(fn: Callable, device: torch.device, trace: Path) -> Tuple[object, Dict[str, float]]:
    """Run fn() under the profiler; return its result and the time shares. Writes a Chrome trace."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    trace.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace))
    return result, time_shares(prof.key_averages(), device.type)
