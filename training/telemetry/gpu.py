"""SM clock, power and energy of this rank's GPU, read through NVML without touching the CUDA stream.

Why: a long training step on an H100 runs at its board power limit (700 W), and the GPU lowers its
SM clock to stay under it (1.47-1.68 GHz in a 1.3B-8k step against 1.98 GHz for a kernel run alone;
bench/RESULTS.md). Throughput per step then follows work per joule, not the kernels'
speed at full clock, so the log shows the clock, the power and the energy per token beside MFU.

NVML (libnvidia-ml, shipped with the driver) is loaded with ctypes, so no extra package is needed.
A daemon thread samples the SM clock and the clock-limit reasons every `period_s`; `mark()` (called
at logging points, like `ThroughputMeter.mark`) returns the averages since the previous mark and
the energy counter's difference. Without a driver (CPU machines, CI) `GpuTelemetry.open` returns
None and nothing is logged.
"""
from __future__ import annotations

import ctypes
import threading
import time
from typing import Dict, Optional

import torch

# nvmlClocksEventReasons bits (nvml.h): why the SM clock is below its maximum right now.
REASON_IDLE = 0x1
REASON_SW_POWER_CAP = 0x4  # board power limit: the clock is lowered to hold the power
REASON_HW_SLOWDOWN = 0x8  # thermal or power-brake slowdown by hardware
REASON_SW_THERMAL = 0x20
REASON_HW_THERMAL = 0x40
REASON_HW_POWER_BRAKE = 0x80
_HW_SLOWDOWN = REASON_HW_SLOWDOWN | REASON_HW_POWER_BRAKE  # the hardware's own clamp, not the power controller
_THERMAL_LIMITED = REASON_SW_THERMAL | REASON_HW_THERMAL
NVML_CLOCK_SM = 1
NVML_TEMPERATURE_GPU = 0
NVML_FI_DEV_MEMORY_TEMP = 82  # nvml.h field id: HBM temperature, degrees C
NVML_FI_DEV_POWER_INSTANT = 186  # nvml.h field id: board power now, mW (on the lent H100 it changes ~every 100 ms)


class _NvmlValue(ctypes.Union):  # nvmlValue_t
    _fields_ = [("dVal", ctypes.c_double), ("uiVal", ctypes.c_uint), ("ulVal", ctypes.c_ulong),
                ("ullVal", ctypes.c_ulonglong), ("sllVal", ctypes.c_longlong), ("siVal", ctypes.c_int)]


class _NvmlFieldValue(ctypes.Structure):  # nvmlFieldValue_t
    _fields_ = [("fieldId", ctypes.c_uint), ("scopeId", ctypes.c_uint), ("timestamp", ctypes.c_longlong),
                ("latencyUsec", ctypes.c_longlong), ("valueType", ctypes.c_int), ("nvmlReturn", ctypes.c_int),
                ("value", _NvmlValue)]


class NvmlDevice:
    """The three NVML readings we need for one GPU. Raises OSError/RuntimeError when unavailable."""

    def __init__(self, device: torch.device):
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        self._check(self.lib.nvmlInit_v2(), "nvmlInit_v2")
        self.handle = ctypes.c_void_p()
        uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
        if uuid is not None:  # robust to CUDA_VISIBLE_DEVICES reordering
            rc = self.lib.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}".encode(), ctypes.byref(self.handle))
        else:
            rc = self.lib.nvmlDeviceGetHandleByIndex_v2(device.index or 0, ctypes.byref(self.handle))
        self._check(rc, "nvmlDeviceGetHandle")
        reasons = getattr(self.lib, "nvmlDeviceGetCurrentClocksEventReasons", None)
        self._reasons = reasons or self.lib.nvmlDeviceGetCurrentClocksThrottleReasons

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"NVML {what} returned {rc}")

    def energy_mj(self) -> int:
        """Energy used by the GPU since the driver loaded, millijoules (Volta and newer)."""
        v = ctypes.c_ulonglong()
        self._check(self.lib.nvmlDeviceGetTotalEnergyConsumption(self.handle, ctypes.byref(v)), "energy")
        return v.value

    def sm_clock_mhz(self) -> int:
        v = ctypes.c_uint()
        self._check(self.lib.nvmlDeviceGetClockInfo(self.handle, NVML_CLOCK_SM, ctypes.byref(v)), "clock")
        return v.value

    def reasons(self) -> int:
        v = ctypes.c_ulonglong()
        self._check(self._reasons(self.handle, ctypes.byref(v)), "clock reasons")
        return v.value

    def temperatures_c(self) -> tuple:
        """(GPU die, HBM) temperature in degrees C; NaN for a reading the driver does not give."""
        die = ctypes.c_uint()
        gpu = (float(die.value) if self.lib.nvmlDeviceGetTemperature(self.handle, NVML_TEMPERATURE_GPU,
                                                                      ctypes.byref(die)) == 0 else float("nan"))
        fv = _NvmlFieldValue(fieldId=NVML_FI_DEV_MEMORY_TEMP)
        rc = self.lib.nvmlDeviceGetFieldValues(self.handle, 1, ctypes.byref(fv))
        return gpu, (float(fv.value.uiVal) if rc == 0 and fv.nvmlReturn == 0 else float("nan"))

    def power_instant_w(self) -> float:
        """Board power right now, watts (not the driver's 1 s average); NaN where the field is missing."""
        fv = _NvmlFieldValue(fieldId=NVML_FI_DEV_POWER_INSTANT)
        rc = self.lib.nvmlDeviceGetFieldValues(self.handle, 1, ctypes.byref(fv))
        if rc != 0 or fv.nvmlReturn != 0:
            return float("nan")
        return fv.value.uiVal / 1e3


class GpuTelemetry:
    """Background sampler; `mark()` -> averages since the previous mark.

    Keys of `mark()` (an empty dict on the first call, which only starts the interval):
      gpu_sm_clock_mhz    mean SM clock over the busy samples (idle samples left out)
      gpu_power_w         mean board power: energy counter difference / wall time
      gpu_power_capped    fraction of busy samples whose clock the board power limit held down (the
                          driver's power controller)
      gpu_hw_slowdown     the same for the hardware's own slowdown (power brake, or a thermal clamp such
                          as the HBM's): a clock this lowers is not the power limit's
      gpu_thermal_capped  the same for thermal limits
      gpu_temp_c, gpu_mem_temp_c  mean GPU die and HBM temperature over the busy samples (where the
                          driver gives them)
      gpu_energy_j        energy since the previous mark, joules
      gpu_j_per_token     gpu_energy_j / tokens, when `mark(tokens=...)` says how many this GPU ran
    """

    def __init__(self, reader, period_s: float = 0.1):
        self.reader = reader  # NvmlDevice or anything with energy_mj / sm_clock_mhz / reasons
        self.period_s = period_s
        self._lock = threading.Lock()
        self._sum = self._n = self._power = self._hw = self._thermal = 0
        self._temps = [0.0, 0, 0.0, 0]  # die sum, die count, HBM sum, HBM count
        self._last: Optional[tuple] = None  # (perf_counter, energy_mj) at the last mark
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-telemetry", daemon=True)
        self._thread.start()

    @classmethod
    def open(cls, device: torch.device, period_s: float = 0.1) -> Optional["GpuTelemetry"]:
        """A sampler for a CUDA device, or None (CPU, no driver, an NVML error: nothing to log)."""
        if torch.device(device).type != "cuda":
            return None
        try:
            return cls(NvmlDevice(torch.device(device)), period_s)
        except (OSError, RuntimeError, AttributeError):
            return None

    def sample(self) -> None:
        """One reading of the clock and its limit reasons (the thread calls this every period)."""
        reasons = self.reader.reasons()
        if reasons & REASON_IDLE:
            return  # an idle GPU sits at its lowest clock; it says nothing about the step
        clock = self.reader.sm_clock_mhz()
        temps = self.reader.temperatures_c() if hasattr(self.reader, "temperatures_c") else ()
        with self._lock:
            self._sum += clock
            self._n += 1
            self._power += bool(reasons & REASON_SW_POWER_CAP)
            self._hw += bool(reasons & _HW_SLOWDOWN)
            self._thermal += bool(reasons & _THERMAL_LIMITED)
            for i, value in enumerate(temps[:2]):
                if value == value:  # not NaN
                    self._temps[2 * i] += value
                    self._temps[2 * i + 1] += 1

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.sample()
            except RuntimeError:
                return  # the driver stopped answering: stop sampling, keep training

    def mark(self, tokens: Optional[int] = None) -> Dict[str, float]:
        now, energy = time.perf_counter(), self.reader.energy_mj()
        with self._lock:
            n, clock, power, hw, thermal, temps = self._n, self._sum, self._power, self._hw, self._thermal, self._temps
            self._sum = self._n = self._power = self._hw = self._thermal = 0
            self._temps = [0.0, 0, 0.0, 0]
        last, self._last = self._last, (now, energy)
        if last is None or now <= last[0]:
            return {}
        joules = (energy - last[1]) / 1e3
        out = {"gpu_power_w": joules / (now - last[0]), "gpu_energy_j": joules}
        if tokens:
            out["gpu_j_per_token"] = joules / tokens
        if n:
            out.update(gpu_sm_clock_mhz=clock / n, gpu_power_capped=power / n, gpu_hw_slowdown=hw / n,
                       gpu_thermal_capped=thermal / n)
        for key, (total, count) in (("gpu_temp_c", temps[:2]), ("gpu_mem_temp_c", temps[2:])):
            if count:
                out[key] = total / count
        return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)
