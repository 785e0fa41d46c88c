"""CUDA-event timing shared by kernels.bench and kernels.tune: warm-up, then the median of `reps`
calls, each between two events on the current stream (milliseconds)."""
from __future__ import annotations

import statistics
from typing import Callable

import torch


def time_ms(fn: Callable[[], object], reps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)
