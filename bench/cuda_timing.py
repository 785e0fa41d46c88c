"""CUDA-event timing shared by the kernel sweep (bench/kernel_sweep.py), the tuner
(bench/tune_kernels.py) and dev/'s probes: warm-up, then the median of `reps` calls, each between two
events on the current stream (milliseconds). And `kernel_us_per_call`: each kernel's device time per
call from torch.profiler (dev/kernel_breakdown.py).

Two modes (`queue_ahead`):
- True (the default, "GPU time"): before each timed call the stream is given a spin
  kernel (torch.cuda._sleep) longer than the call's host time, so the host has queued the whole call
  before the first event fires and the events see only GPU work -- as in a training step, where the
  host runs ahead of the GPU. This is how attention kernels are usually compared.
- False ("call time"): the GPU is idle at the first event, so the host's launch and
  dispatch time of the call (~0.3 ms for our forward+backward, ~0.7 ms for SDPA cuDNN's: breakdown)
  is inside the measurement: what an eager, synchronised single call costs.
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
    return 2.0 * max((_host_ms(fn) for fn in fns for _ in range(3)), default=0.0) + 0.2


def time_ms(fn: Callable[[], object], reps: int, warmup: int = 3, queue_ahead: bool = True) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    spin = _spin_for([fn], queue_ahead)
    return statistics.median(_call_ms(fn, spin) for _ in range(reps))


def balanced_order(names: list[str]) -> list[str]:
    """A cyclic visiting order of `names` in which every name follows every name -- itself included --
    exactly once: an Eulerian circuit over all n^2 ordered pairs (Hierholzer's algorithm), so each
    name appears n times per cycle."""
    n = len(names)
    if n == 0:  # e.g. every candidate of a sweep row refused the shape
        return []
    unused = {i: list(range(n)) for i in range(n)}  # pairs (i, j) not yet walked, self-pairs included
    stack, circuit = [0], []
    while stack:
        i = stack[-1]
        if unused[i]:
            stack.append(unused[i].pop())
        else:
            circuit.append(stack.pop())
    circuit.reverse()  # closed walk 0 ... 0 over all n^2 pairs; the last 0 closes the cycle
    return [names[i] for i in circuit[:-1]]


def time_interleaved_ms(fns: Dict[str, Callable[[], object]], reps: int, warmup: int = 3,
                        queue_ahead: bool = True, fixed_order: bool = False,
                        rounds: int = 5) -> Dict[str, float]:
    """Median milliseconds per call of each of `fns` (at least `reps` calls each), the candidates
    interleaved so that a clock or power state falls on every candidate alike instead of on whichever
    ran at that moment (timing each candidate in one block moved single rows by up to 40% on an
    H100).

    Default: one call per visit in balanced_order(), repeated -- every candidate runs right after
    every candidate (itself included) equally often. A call's time can depend on what ran just
    before it (the board's power and clock state: at non-causal 16k on an H100 our f+b ran 606
    TFLOP/s after itself, 614-627 after cuDNN or SDPA flash, while cuDNN's ran 617-620 after any),
    so the fixed order, where a candidate follows itself 2 calls in 3, biases long rows.
    fixed_order=True: `rounds` passes in dict order, reps / rounds calls of a candidate back to back
    per pass (to reproduce tables timed that way)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    spin = _spin_for(fns.values(), queue_ahead)
    times: Dict[str, list] = {name: [] for name in fns}
    if fixed_order:
        per_round = max(1, reps // rounds)
        for _ in range(rounds):
            for name, fn in fns.items():
                times[name] += [_call_ms(fn, spin) for _ in range(per_round)]
    else:
        order = balanced_order(list(fns))
        per_cycle = max(1, len(fns))  # visits of each candidate per cycle
        for _ in range(-(-reps // per_cycle)):
            for name in order:
                times[name].append(_call_ms(fns[name], spin))
    return {name: statistics.median(t) for name, t in times.items()}


def kernel_us_per_call(fn: Callable[[], object], iters: int, warmup: int = 3) -> Dict[str, float]:
    """Kernel name -> microseconds of device time per call of fn, from torch.profiler over `iters`
    calls after `warmup` (launch gaps and host time left out). CUDA only."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    per_name: Dict[str, float] = {}
    for ev in prof.events():
        # GPU-side spans of record_function ranges (e.g. a compiled graph's) would count their kernels twice
        if ev.device_type == torch.autograd.DeviceType.CUDA and not getattr(ev, "is_user_annotation", False):
            per_name[ev.name] = per_name.get(ev.name, 0.0) + ev.device_time_total / iters  # us
    return per_name
