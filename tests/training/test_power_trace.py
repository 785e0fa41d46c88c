"""bench/power_trace.py's summary over scripted samples (CPU): window, idle samples, reason bits, spread."""
import math

from bench.power_trace import format_summary, summarize
from training.gpu_telemetry import REASON_HW_SLOWDOWN, REASON_IDLE, REASON_SW_POWER_CAP


def test_summary_counts_busy_samples_in_the_window_only():
    samples = [  # (t_s, sm_mhz, reasons, power_w)
        (0.0, 1980, 0, 650.0),                        # before the window
        (1.0, 1500, REASON_SW_POWER_CAP, 720.0),
        (1.1, 1600, REASON_SW_POWER_CAP | REASON_HW_SLOWDOWN, 690.0),
        (1.2, 345, REASON_IDLE, 80.0),                # idle: left out
        (1.3, 1700, 0, float("nan")),                 # no power field: clock counted, power not
        (2.0, 1400, REASON_SW_POWER_CAP, 705.0),      # at the window's end: left out
    ]
    s = summarize(samples, since_s=0.5, until_s=2.0)
    assert s["samples"] == 3
    assert math.isclose(s["sw_power_cap"], 2 / 3) and math.isclose(s["hw_slowdown"], 1 / 3)
    assert s["hw_power_brake"] == 0
    assert math.isclose(s["mhz_mean"], 1600) and s["mhz_p50"] == 1600
    assert math.isclose(s["w_mean"], 705.0) and s["w_max"] == 720.0
    assert math.isclose(s["over_700"], 0.5)
    line = format_summary("x", s)
    assert "sw_power_cap 67%" in line and "hw_slowdown 33%" in line and "mean 705" in line


def test_summary_of_an_empty_window():
    assert summarize([(0.0, 1500, 0, 700.0)], since_s=1.0) == {"samples": 0}
    assert format_summary("x", {"samples": 0}) == "x: no busy samples"
