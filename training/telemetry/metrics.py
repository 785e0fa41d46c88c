"""Training metrics: peak FLOP/s, throughput and MFU, deferred device->host scalars, memory.

MFU conventions (see DESIGN.md "MFU"); model FLOPs per token come from `GPTConfig.flops_per_token`:
  paper  : 6·N + 12·L·d·s   (FlashAttention-2 §4.2, nanoGPT, torchtitan; attention as non-causal)
  causal : 6·N +  6·L·d·s   (Megatron's convention: the causal mask halves attention work)
MFU = achieved model FLOP/s per GPU ÷ peak FLOP/s of that GPU (datasheet dense bf16, or an override).

Timing without a GPU sync per step: the trainer reads host clocks (`time.perf_counter`) at logging
points and divides by the steps in between (`ThroughputMeter.mark`). CUDA work is queued
asynchronously, but the host cannot run more than a step or two ahead (the optimizer step and the
caching allocator make it wait), so over an interval of several steps the host time equals the
device time to within about one step. Loss and friends are fetched with `DeferredScalars` so that
logging itself never forces a sync.
"""
from __future__ import annotations

import os
import re
import resource
import statistics
import sys
import time
from typing import Dict, List, Optional, Tuple, Union

import torch

PEAK_ENV = "FLASHGPT_PEAK_TFLOPS"  # override: peak in TFLOP/s (10^12 FLOP/s) per device

# Dense (no sparsity) bf16 tensor-core peak per GPU, FLOP/s, from NVIDIA datasheets.
# First match wins, so more specific names come first. Matched case-insensitively against
# torch.cuda.get_device_name(), e.g. "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB".
PEAK_TABLE: List[Tuple[str, float]] = [
    (r"H100.*PCIe", 756e12),  # H100 PCIe
    (r"H100.*NVL", 835e12),  # H100 NVL (1671 sparse)
    (r"H200.*NVL", 835e12),  # H200 NVL (1671 sparse)
    (r"H100|H800", 989e12),  # H100 SXM ("H100 80GB HBM3"), H800 SXM
    (r"H200", 989e12),  # H200 SXM
    (r"B200", 2250e12),  # HGX B200 (4.5 PF sparse)
    (r"A100|A800", 312e12),  # A100 SXM and PCIe, 40/80 GB
    (r"L40S", 362e12),  # L40S (733 sparse)
    (r"\bL4\b", 121e12),  # L4 (242 sparse)
    (r"\bA10\b", 125e12),  # A10 (not A10G, not A100)
    (r"RTX 4090", 165e12),  # GeForce RTX 4090 with fp32 accumulate (what PyTorch uses); 330 with fp16 acc.
]


def _device_name(device: Union[torch.device, str]) -> Tuple[str, bool]:
    """(name, is_cpu). A string that is not a torch device ("NVIDIA H200") is taken as a GPU name."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        return str(device), False
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev), False
    return dev.type, True


def peak_flops(device: Union[torch.device, str]) -> Tuple[Optional[float], str]:
    """Peak dense bf16 FLOP/s of one device and where the figure came from.

    Order: env FLASHGPT_PEAK_TFLOPS (TFLOP/s) > table by GPU name > None (CPU or unknown GPU: MFU
    is then not reported, shown as "n/a")."""
    env = os.environ.get(PEAK_ENV)
    if env:
        try:
            return float(env) * 1e12, f"env {PEAK_ENV}={env} TFLOP/s"
        except ValueError:
            print(f"warning: {PEAK_ENV}={env!r} is not a number; ignored", file=sys.stderr)
    name, is_cpu = _device_name(device)
    if is_cpu:
        return None, f"{name}: no peak table; MFU not reported (set {PEAK_ENV} to use a nominal peak)"
    for pattern, value in PEAK_TABLE:
        if re.search(pattern, name, re.IGNORECASE):
            return value, f"table: '{name}' matched '{pattern}' -> {value / 1e12:.0f} TFLOP/s dense bf16"
    return None, f"'{name}': not in the peak table; MFU not reported (set {PEAK_ENV})"


def measure_gemm_ceiling(device: Union[torch.device, str], n: int = 8192, dtype: torch.dtype = torch.bfloat16,
                         iters: int = 20, warmup: int = 5, sustain_s: float = 0.0) -> float:
    """Measured n×n×n matmul FLOP/s (2·n³ per GEMM), median over `iters`. For benchmarks only.

    CUDA: timed with CUDA events after `warmup` GEMMs. CPU: host clock (use a small n there).
    sustain_s > 0 first keeps the GPU busy with GEMMs for that long, so the timed ones run at the
    clock the board's power limit allows under sustained load (what a training step sees), not at
    the full clock of a cold GPU."""
    dev = torch.device(device)
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    for _ in range(warmup):
        a @ b
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < sustain_s:  # the host waits on a full launch queue: no sync needed
        a @ b
    times_s = []
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            a @ b
            end.record()
            end.synchronize()
            times_s.append(start.elapsed_time(end) / 1e3)  # ms -> s
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            a @ b
            times_s.append(time.perf_counter() - t0)
    return 2 * n ** 3 / statistics.median(times_s)


def format_mfu(mfu: Optional[float]) -> str:
    """0.568 -> '56.8%'; None -> 'n/a'."""
    return "n/a" if mfu is None else f"{100 * mfu:.1f}%"


class ThroughputMeter:
    """Tokens/s, model TFLOP/s per GPU and MFU from the step time.

    Keys returned by `compute` (all per optimizer step):
      step_time_s          seconds per step
      tokens_per_s         global tokens/s (all ranks)
      tokens_per_s_per_gpu tokens/s / world_size
      tflops_paper         model TFLOP/s per GPU, paper convention (10^12 FLOP/s)
      tflops_causal        model TFLOP/s per GPU, causal-aware convention
      mfu_paper            tflops_paper / peak, a fraction in [0, 1]; None without a peak
      mfu_causal           tflops_causal / peak; None without a peak
      mfu_paper_gemm, mfu_causal_gemm   vs the measured GEMM ceiling, only when one is given
    """

    def __init__(self, flops_per_token_paper: float, flops_per_token_causal: float, tokens_per_step: int,
                 world_size: int = 1, peak: Optional[float] = None, gemm_ceiling: Optional[float] = None):
        self.fpt_paper = float(flops_per_token_paper)  # FLOPs per token, forward + backward
        self.fpt_causal = float(flops_per_token_causal)
        self.tokens_per_step = int(tokens_per_step)  # global: global_batch_size · seq_len
        self.world_size = int(world_size)
        self.peak = peak  # FLOP/s per GPU
        self.gemm_ceiling = gemm_ceiling  # FLOP/s per GPU, measured
        self._last: Optional[Tuple[int, float]] = None  # (step, perf_counter) at the last mark
        self.interval_steps = 0  # steps between the last two marks (0 until a mark closes an interval)

    @classmethod
    def from_model(cls, model_cfg, tokens_per_step: int, world_size: int = 1,
                   device: Union[torch.device, str, None] = None, peak: Optional[float] = None,
                   gemm_ceiling: Optional[float] = None) -> "ThroughputMeter":
        """From a GPTConfig; `peak` defaults to `peak_flops(device)` when a device is given."""
        if peak is None and device is not None:
            peak, _ = peak_flops(device)
        return cls(model_cfg.flops_per_token(causal_aware=False), model_cfg.flops_per_token(causal_aware=True),
                   tokens_per_step, world_size, peak, gemm_ceiling)

    def compute(self, step_time_s: float) -> Dict[str, Optional[float]]:
        tok_s = self.tokens_per_step / step_time_s
        per_gpu = tok_s / self.world_size
        out: Dict[str, Optional[float]] = {
            "step_time_s": step_time_s,
            "tokens_per_s": tok_s,
            "tokens_per_s_per_gpu": per_gpu,
        }
        for conv, fpt in (("paper", self.fpt_paper), ("causal", self.fpt_causal)):
            flops = fpt * per_gpu  # model FLOP/s per GPU
            out[f"tflops_{conv}"] = flops / 1e12
            out[f"mfu_{conv}"] = flops / self.peak if self.peak else None
            if self.gemm_ceiling:
                out[f"mfu_{conv}_gemm"] = flops / self.gemm_ceiling
        return out

    def mark(self, step: int) -> Optional[Dict[str, Optional[float]]]:
        """Host-clock interval timing: call at logging points (no sync). Returns `compute` of the mean
        step time since the previous mark, or None on the first call (it only starts the clock)."""
        now = time.perf_counter()
        last, self._last = self._last, (step, now)
        if last is None or step <= last[0]:
            self.interval_steps = 0
            return None
        self.interval_steps = step - last[0]
        return self.compute((now - last[1]) / self.interval_steps)


Scalar = Union[torch.Tensor, float, int]


class DeferredScalars:
    """Fetch logged scalars from the GPU without blocking the host.

    push() queues non-blocking copies into pinned host memory and records a CUDA event; pop_ready()
    returns, in push order, the entries whose copies have finished; flush() waits for the rest.
    Floats, ints and CPU tensors are available at once."""

    def __init__(self):
        # each entry: (step, {key: float}, [(keys, pinned buffer, event)])
        self._pending: List[Tuple[int, Dict[str, float], list]] = []

    def push(self, step: int, values: Dict[str, Scalar]) -> None:
        ready: Dict[str, float] = {}
        by_device: Dict[torch.device, List[Tuple[str, torch.Tensor]]] = {}
        for key, v in values.items():
            if isinstance(v, torch.Tensor) and v.device.type == "cuda":
                by_device.setdefault(v.device, []).append((key, v))
            elif isinstance(v, torch.Tensor):
                ready[key] = float(v.detach())
            else:
                ready[key] = None if v is None else float(v)
        copies = []
        for dev, items in by_device.items():
            stacked = torch.stack([t.detach().reshape(()).float() for _, t in items])  # (k,) on device
            host = torch.empty(stacked.shape, dtype=torch.float32, pin_memory=True)
            host.copy_(stacked, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(dev))
            copies.append(([k for k, _ in items], host, event))
        self._pending.append((step, ready, copies))

    @staticmethod
    def _resolve(entry) -> Tuple[int, Dict[str, float]]:
        step, ready, copies = entry
        out = dict(ready)
        for keys, host, _ in copies:
            out.update(zip(keys, host.tolist()))
        return step, out

    def pop_ready(self) -> List[Tuple[int, Dict[str, float]]]:
        """Completed entries in push order (stops at the first one still in flight)."""
        done = []
        while self._pending and all(ev.query() for _, _, ev in self._pending[0][2]):
            done.append(self._resolve(self._pending.pop(0)))
        return done

    def flush(self) -> List[Tuple[int, Dict[str, float]]]:
        """Wait for every pending copy and return all remaining entries."""
        for _, _, copies in self._pending:
            for _, _, ev in copies:
                ev.synchronize()
        done = [self._resolve(e) for e in self._pending]
        self._pending.clear()
        return done

    def __len__(self) -> int:
        return len(self._pending)


def memory_stats(device: Union[torch.device, str]) -> Dict[str, float]:
    """Peak memory in GB (10^9 bytes) since the last call.

    CUDA: mem_max_alloc_gb / mem_max_reserved_gb from the caching allocator (peaks reset after
    reading). CPU: mem_max_rss_gb, the process's peak resident set size (never resets)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        out = {"mem_max_alloc_gb": torch.cuda.max_memory_allocated(dev) / 1e9,
               "mem_max_reserved_gb": torch.cuda.max_memory_reserved(dev) / 1e9}
        torch.cuda.reset_peak_memory_stats(dev)
        return out
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    rss_bytes = rss if sys.platform == "darwin" else rss * 1024
    return {"mem_max_rss_gb": rss_bytes / 1e9}
