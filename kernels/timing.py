"""CUDA-event timing shared by kernels.bench, kernels.tune and kernels.breakdown: warm-up, then the
median of `reps` calls, each between two events on the current stream (milliseconds).

Two modes (`queue_ahead`):
- True (the default since session 9, "GPU time"): before each timed call the stream is given a spin
  kernel (torch.cuda._sleep) longer than the call's host time, so the host has queued the whole call
  before the first event fires and the events see only GPU work -- as in a training step, where the
  host runs ahead of the GPU. This is how attention kernels are usually compared.
- False ("call time", sessions 1-8): the GPU is idle at the first event, so the host's launch and
  dispatch time of the call (~0.3 ms for our forward+backward, ~0.7 ms for SDPA cuDNN's: breakdown)
  is inside the measurement. Still what an eager, synchronised single call costs.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Dict

import torch

_SPIN_CYCLES_PER_MS: float | None = None


def _spin_cycles_per_ms() -> float:
    """SM clock cycles per millisecond of torch.cuda._sleep, measured once per process."""
    global _SPIN_CYCLES_PER_MS
    if _SPIN_CYCLES_PER_MS is None:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # warm
        s.record()
        torch.cuda._sleep(10_000_000)
        e.record()
        e.synchronize()
        _SPIN_CYCLES_PER_MS = 10_000_000 / s.elapsed_time(e)
    return _SPIN_CYCLES_PER_MS


def _host_ms(fn: Callable[[], object]) -> float:
    """Host time of one call (ms), GPU kept busy so no launch waits on a full queue."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    host = 1e3 * (time.perf_counter() - t0)
    torch.cuda.synchronize()
    return host


def _call_ms(fn: Callable[[], object], spin_ms: float = 0.0) -> float:
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if spin_ms > 0:
        torch.cuda._sleep(int(spin_ms * _spin_cycles_per_ms()))
    s.record()
    fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e)


def _spin_for(fns, queue_ahead: bool) -> float:
    """Spin length covering the host time of each of `fns` (2x the slowest of 3 calls + 0.2 ms)."""
    if not queue_ahead:
        return 0.0
    return 2.0 * max(_host_ms(fn) for fn in fns for _ in range(3)) + 0.2


def time_ms(fn: Callable[[], object], reps: int, warmup: int = 3, queue_ahead: bool = True) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    spin = _spin_for([fn], queue_ahead)
    return statistics.median(_call_ms(fn, spin) for _ in range(reps))


def time_interleaved_ms(fns: Dict[str, Callable[[], object]], reps: int, rounds: int = 5,
                        warmup: int = 3, queue_ahead: bool = True) -> Dict[str, float]:
    """Median milliseconds per call of each of `fns`, timed round-robin: `rounds` passes over all of
    them, reps / rounds calls each per pass. A clock or power dip during the measurement then falls
    on every candidate alike instead of on whichever ran at that moment, so the ratios between them
    (what a sweep reports) hold up; timing each candidate in one block moved single rows by up to 40%
    on the lent H100 (bench/RESULTS.md v10)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    spin = _spin_for(fns.values(), queue_ahead)
    per_round = max(1, reps // rounds)
    times: Dict[str, list] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name] += [_call_ms(fn, spin) for _ in range(per_round)]
    return {name: statistics.median(t) for name, t in times.items()}
