"""Where one training step's time goes: attention, matrix products, communication, everything else.

`train.profile_step=N` runs optimizer step N under torch.profiler, writes a Chrome trace to
<run_dir>/profile_step_N.json and the 30 costliest kernels to profile_step_N.top.txt (name, class,
share of kernel time, calls), and logs the shares and, on CUDA, the step's summed kernel time
(`kernel_time_s`): against the step time of an unprofiled step it gives how busy the GPU is -- the
most CUDA graphs could give back is the rest. Kernels (on CUDA) or operators (on CPU) are put
in a class by name, which is a heuristic: attention = our kernels and SDPA's flash / cuDNN /
memory-efficient kernels; matmul = cuBLAS / CUTLASS GEMM kernels (or aten::mm-like ops on CPU), a
GEMM with the GELU in its epilogue included; communication = NCCL kernels (all-reduce, the context-parallel
all-to-alls: ncclDevKernel_SendRecv) or c10d / gloo operators on CPU -- on CUDA a collective's kernel also
spans its wait for the other ranks, so its share is an upper bound on what it costs; our MLP's
GELU-backward kernel and our residual-add + LayerNorm kernels are "other".
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Dict, Tuple

import torch
from torch.profiler import ProfilerActivity, profile

ATTENTION = re.compile(r"flash|fmha|sdpa|attention|attn|flashgpt", re.I)
MATMUL = re.compile(r"gemm|cutlass|nvjet|xmma|cublas|aten::(mm|addmm|bmm|matmul|linear)\b", re.I)
# Our kernels that are not attention although their names say flashgpt (the MLP's GELU backward, the
# residual add + LayerNorm and its weight-gradient column sum: csrc/norm/add_layer_norm.cu).
NOT_ATTENTION = re.compile(r"gelu_backward|add_layer_norm|param_grads_kernel", re.I)
COMMUNICATION = re.compile(r"nccl|c10d::|gloo:|all_?to_?all|all_?reduce|all_?gather|reduce_?scatter", re.I)


def classify(name: str) -> str:
    if COMMUNICATION.search(name):
        return "communication"
    if NOT_ATTENTION.search(name):
        return "other"
    if ATTENTION.search(name):
        return "attention"
    if MATMUL.search(name):
        return "matmul"
    return "other"


def _timed(events, device_type: str):
    """(self time in us, calls, name) of each kernel (CUDA) or operator (CPU) that took time. On CUDA
    only the GPU's own activity counts: operators would count their kernels twice, and so would the
    GPU-side spans of record_function ranges (user annotations, e.g. torch's
    "Optimizer.step#AdamW.step", which covers the optimizer's kernels)."""
    for e in events:
        if device_type == "cuda":
            if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
                continue
            if getattr(e, "is_user_annotation", False):
                continue
            t = e.self_device_time_total
        else:
            t = e.self_cpu_time_total
        if t > 0:
            yield t, e.count, e.key


def time_shares(events, device_type: str) -> Dict[str, float]:
    """Shares of the step's kernel (CUDA) or top-level operator (CPU) self time, by class; on CUDA
    also the summed kernel time in seconds (`kernel_time_s`)."""
    totals = {"attention": 0.0, "matmul": 0.0, "communication": 0.0, "other": 0.0}
    for t, _, name in _timed(events, device_type):
        totals[classify(name)] += t
    whole = sum(totals.values()) or 1.0
    shares = {f"time_share_{k}": v / whole for k, v in totals.items()}
    if device_type == "cuda":
        shares["kernel_time_s"] = sum(totals.values()) / 1e6  # self_device_time_total is in us
    return shares


def top_kernels(events, device_type: str, n: int = 60) -> str:
    """The n costliest kernels (CUDA) or operators (CPU) by self time, one per line:
    share of the step's total, class, calls, name (cut to 120 characters)."""
    rows = sorted(_timed(events, device_type), reverse=True)
    whole = sum(r[0] for r in rows) or 1.0
    lines = [f"{100 * t / whole:6.2f}%  {classify(k):13s} {c:6d}x  {k[:120]}" for t, c, k in rows[:n]]
    return "share   class         calls   name\n" + "\n".join(lines) + "\n"


def profile_call(fn: Callable, device: torch.device, trace: Path) -> Tuple[object, Dict[str, float]]:
    """Run fn() under the profiler; return its result and the time shares (plus `kernel_time_s` on
    CUDA). Writes a Chrome trace."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    trace.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace))
    events = prof.key_averages()
    trace.with_suffix(".top.txt").write_text(top_kernels(events, device.type))
    return result, time_shares(events, device.type)
