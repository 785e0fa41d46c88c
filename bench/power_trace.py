"""A fast NVML sampler for looking at how the board's power limiter treats a workload.

Why: a training step on an H100 runs at the 700 W limit, yet at micro-batch 2 (2.7B-8k) the board
averaged 678 W while the limiter held the SM clock down in every 100 ms sample (bench/RESULTS.md
session 23). Which limit acts (the firmware's power cap or the hardware's fast slowdown / power brake)
and how the instantaneous power spreads decide whether a steadier power draw could buy throughput.

`PowerTrace` samples every `period_s` (default 5 ms) in a thread: time, SM clock, the clock-limit
reason bits, and the board's "instantaneous" power (NVML field 186; on the lent H100 it changes about
every 100 ms, so it resolves phases of that length, not single kernels; the SM clock changes every
~50 ms). `summarize()` gives the shares of
busy samples per reason bit and percentiles of clock and power; `write_csv()` keeps the raw samples.
"""
from __future__ import annotations

import csv
import math
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

from training.gpu_telemetry import (REASON_HW_POWER_BRAKE, REASON_HW_SLOWDOWN, REASON_HW_THERMAL, REASON_IDLE,
                                    REASON_SW_POWER_CAP, REASON_SW_THERMAL, NvmlDevice)

REASON_BITS = {"sw_power_cap": REASON_SW_POWER_CAP, "hw_slowdown": REASON_HW_SLOWDOWN,
               "hw_power_brake": REASON_HW_POWER_BRAKE, "sw_thermal": REASON_SW_THERMAL,
               "hw_thermal": REASON_HW_THERMAL}


class PowerTrace:
    """Samples (t_s, sm_mhz, reasons, power_w) until `stop()`; `samples` is the list of tuples."""

    def __init__(self, reader: NvmlDevice, period_s: float = 0.005):
        self.reader, self.period_s = reader, period_s
        self.samples: List[tuple] = []
        self._stop = threading.Event()
        self._t0, self._wall0 = time.perf_counter(), time.time()
        self._thread = threading.Thread(target=self._run, name="power-trace", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.samples.append((time.perf_counter() - self._t0, self.reader.sm_clock_mhz(),
                                     self.reader.reasons(), self.reader.power_instant_w()))
            except RuntimeError:
                return

    def now(self) -> float:
        """Seconds on the samples' time axis (for marking where a phase starts)."""
        return time.perf_counter() - self._t0

    def at(self, wall_time: float) -> float:
        """A time.time() value (e.g. a metrics.jsonl record's "time") on the samples' time axis."""
        return wall_time - self._wall0

    def stop(self) -> List[tuple]:
        self._stop.set()
        self._thread.join(timeout=1.0)
        return self.samples

    def write_csv(self, path: Path) -> None:
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["t_s", "sm_mhz", "reasons", "power_w"])
            w.writerows(self.samples)


def _pct(values: List[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def summarize(samples: List[tuple], since_s: float = 0.0, until_s: Optional[float] = None) -> Dict[str, float]:
    """Busy samples (reason bit IDLE clear) in [since_s, until_s): per-bit shares, clock and power spread."""
    busy = [s for s in samples if s[0] >= since_s and (until_s is None or s[0] < until_s)
            and not s[2] & REASON_IDLE]
    out: Dict[str, float] = {"samples": len(busy)}
    if not busy:
        return out
    for name, bit in REASON_BITS.items():
        out[name] = sum(bool(s[2] & bit) for s in busy) / len(busy)
    clocks = [s[1] for s in busy]
    power = [s[3] for s in busy if not math.isnan(s[3])]
    out.update(mhz_p10=_pct(clocks, 0.1), mhz_p50=_pct(clocks, 0.5), mhz_p90=_pct(clocks, 0.9),
               mhz_mean=sum(clocks) / len(clocks))
    if power:
        out.update(w_p10=_pct(power, 0.1), w_p50=_pct(power, 0.5), w_p90=_pct(power, 0.9), w_max=max(power),
                   w_mean=sum(power) / len(power), over_700=sum(p > 700 for p in power) / len(power))
    return out


def format_summary(name: str, s: Dict[str, float]) -> str:
    if s.get("samples", 0) == 0:
        return f"{name}: no busy samples"
    bits = " ".join(f"{k} {100 * s[k]:.0f}%" for k in REASON_BITS if s.get(k))
    power = (f"W p10/p50/p90/max {s['w_p10']:.0f}/{s['w_p50']:.0f}/{s['w_p90']:.0f}/{s['w_max']:.0f} "
             f"mean {s['w_mean']:.0f}, >700 W {100 * s['over_700']:.0f}%" if "w_mean" in s else "no power field")
    return (f"{name}: {s['samples']} samples | MHz p10/p50/p90 {s['mhz_p10']:.0f}/{s['mhz_p50']:.0f}/"
            f"{s['mhz_p90']:.0f} | {power} | reasons: {bits or 'none'}")
