"""GpuTelemetry's arithmetic with a scripted NVML reader (CPU), and its absence on a CPU device."""
import torch

from training.telemetry.gpu import (REASON_HW_POWER_BRAKE, REASON_HW_SLOWDOWN, REASON_HW_THERMAL, REASON_IDLE,
                                    REASON_SW_POWER_CAP, GpuTelemetry)


class ScriptedReader:
    """Stands in for NvmlDevice: clocks and reasons from lists, energy set by the test."""

    def __init__(self, clocks, reasons):
        self.clocks, self.reasons_list, self.energy = list(clocks), list(reasons), 0

    def energy_mj(self):
        return self.energy

    def sm_clock_mhz(self):
        return self.clocks.pop(0)

    def reasons(self):
        return self.reasons_list.pop(0)


def make(reader):
    t = GpuTelemetry(reader, period_s=3600.0)  # the thread never samples by itself in a test
    t.close()
    return t


def test_mark_averages_busy_samples_and_counts_power_cap(monkeypatch):
    reader = ScriptedReader(clocks=[1980, 1500, 1620], reasons=[0, REASON_SW_POWER_CAP, REASON_IDLE,
                                                                 REASON_SW_POWER_CAP | REASON_HW_THERMAL])
    t = make(reader)
    clock = iter([100.0, 102.0])
    monkeypatch.setattr("training.telemetry.gpu.time.perf_counter", lambda: next(clock))
    reader.energy = 5_000_000
    assert t.mark() == {}  # first mark only starts the interval
    for _ in range(4):
        t.sample()  # the idle sample (third) is left out: its clock is not read
    reader.energy += 1_300_000  # 1300 J in 2 s
    out = t.mark(tokens=65536)
    assert abs(out["gpu_power_w"] - 650.0) < 1e-9
    assert abs(out["gpu_energy_j"] - 1300.0) < 1e-9
    assert abs(out["gpu_j_per_token"] - 1300.0 / 65536) < 1e-12
    assert abs(out["gpu_sm_clock_mhz"] - (1980 + 1500 + 1620) / 3) < 1e-9
    assert abs(out["gpu_power_capped"] - 2 / 3) < 1e-9
    assert abs(out["gpu_thermal_capped"] - 1 / 3) < 1e-9
    assert out["gpu_hw_slowdown"] == 0.0
    assert "gpu_temp_c" not in out  # this reader gives no temperatures


class HotReader(ScriptedReader):
    """A reader that also gives (die, HBM) temperatures; NaN where the driver has none."""

    def __init__(self, clocks, reasons, temps):
        super().__init__(clocks, reasons)
        self.temps = list(temps)

    def temperatures_c(self):
        return self.temps.pop(0)


def test_hardware_slowdown_is_not_the_power_limit_and_temperatures_average(monkeypatch):
    nan = float("nan")
    reader = HotReader(clocks=[1700, 1500, 1400],
                       reasons=[REASON_SW_POWER_CAP, REASON_HW_SLOWDOWN, REASON_HW_POWER_BRAKE | REASON_SW_POWER_CAP],
                       temps=[(60.0, 80.0), (64.0, nan), (68.0, 86.0)])
    t = make(reader)
    clock = iter([0.0, 1.0, 2.0])
    monkeypatch.setattr("training.telemetry.gpu.time.perf_counter", lambda: next(clock))
    t.mark()
    for _ in range(3):
        t.sample()
    reader.energy = 700_000
    out = t.mark()
    assert abs(out["gpu_power_capped"] - 2 / 3) < 1e-9  # the power controller: samples 1 and 3
    assert abs(out["gpu_hw_slowdown"] - 2 / 3) < 1e-9  # hardware slowdown / power brake: samples 2 and 3
    assert out["gpu_thermal_capped"] == 0.0
    assert out["gpu_temp_c"] == 64.0
    assert out["gpu_mem_temp_c"] == 83.0  # the NaN reading left out
    assert t.mark() == {"gpu_power_w": 0.0, "gpu_energy_j": 0.0}  # the sums restart at each mark


def test_mark_without_busy_samples_reports_power_only(monkeypatch):
    reader = ScriptedReader(clocks=[], reasons=[REASON_IDLE])
    t = make(reader)
    clock = iter([0.0, 4.0])
    monkeypatch.setattr("training.telemetry.gpu.time.perf_counter", lambda: next(clock))
    t.mark()
    t.sample()
    reader.energy = 280_000
    out = t.mark()
    assert out == {"gpu_power_w": 70.0, "gpu_energy_j": 280.0}


def test_open_on_cpu_is_none():
    assert GpuTelemetry.open(torch.device("cpu")) is None
