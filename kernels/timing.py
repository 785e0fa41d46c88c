"""CUDA-event timing shared by kernels.bench, kernels.tune and kernels.breakdown: warm-up, then the
median of `reps` calls, each between two events on the current stream (milliseconds)."""
from __future__ import annotations

import statistics
from typing import Callable, Dict

import torch


def _call_ms(fn: Callable[[], object]) -> float:
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e)


def time_ms(fn: Callable[[], object], reps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return statistics.median(_call_ms(fn) for _ in range(reps))


def time_interleaved_ms(fns: Dict[str, Callable[[], object]], reps: int, rounds: int = 5,
                        warmup: int = 3) -> Dict[str, float]:
    """Median milliseconds per call of each of `fns`, timed round-robin: `rounds` passes over all of
    them, reps / rounds calls each per pass. A clock or power dip during the measurement then falls
    on every candidate alike instead of on whichever ran at that moment, so the ratios between them
    (what a sweep reports) hold up; timing each candidate in one block moved single rows by up to 40%
    on the lent H100 (bench/RESULTS.md v10)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    per_round = max(1, reps // rounds)
    times: Dict[str, list] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name] += [_call_ms(fn) for _ in range(per_round)]
    return {name: statistics.median(t) for name, t in times.items()}
