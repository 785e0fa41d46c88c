"""bench/e2e.py --rounds: the setups run A B, B A, ... so a board's drift over the run falls on every
setup alike; each setup's figure is the median of its rounds, the profile comes from the first round,
and every round's ratio against the fastest plain setup is printed. Run on CPU with the GPU parts
(ceilings, telemetry, the setups themselves) replaced by stand-ins."""
import pytest
import torch

import e2e  # bench/ (tests/bench/conftest.py puts it on the path)


def test_order_reverses_every_other_round():
    assert e2e.setup_order(["a", "b", "c"], 3) == [(0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a"),
                                                   (2, "a"), (2, "b"), (2, "c")]
    assert e2e.setup_order(["a"], 1) == [(0, "a")]


def test_combine_takes_medians_and_the_first_rounds_profile():
    rounds = [
        {"step_s": 1.0, "tokens": 100, "mem_gb": 5.0, "attention": "flash", "attn_share": 0.3, "mm_share": 0.6,
         "kernel_s": 0.9, "gpu_sm_clock_mhz": 1500.0, "event_step_s": 1.01},
        {"step_s": 3.0, "tokens": 100, "mem_gb": 7.0, "attention": "flash", "attn_share": None, "mm_share": None,
         "kernel_s": None, "gpu_sm_clock_mhz": 1600.0, "event_step_s": None},
        {"step_s": 2.0, "tokens": 100, "mem_gb": 6.0, "attention": "flash", "attn_share": None, "mm_share": None,
         "kernel_s": None, "gpu_sm_clock_mhz": 1700.0, "event_step_s": 2.02},
    ]
    out = e2e.combine_rounds(rounds)
    assert out["step_s"] == 2.0 and out["gpu_sm_clock_mhz"] == 1600.0
    assert out["mem_gb"] == 7.0  # the peak of all rounds
    assert (out["attn_share"], out["mm_share"], out["kernel_s"]) == (0.3, 0.6, 0.9)  # the profiled round's
    assert out["event_step_s"] == 1.01  # missing in one round: the first round's, not a median of a subset
    assert out["tokens"] == 100 and out["attention"] == "flash"


@pytest.fixture
def no_gpu(monkeypatch):
    """Stand-ins for e2e's GPU-only calls; returns the list of (setup, profiled) runs made."""
    calls = []
    speeds = iter([1.00, 1.10, 1.04, 0.98])  # tokens per second per token of the step, in run order

    def fake_setup(args, setup, n_micro, micro, run_name, trace_dir, profile):
        calls.append((setup, profile, run_name))
        return {"step_s": 1.0 / next(speeds), "tokens": 1, "mem_gb": 1.0, "attention": "x",
                "attn_share": 0.25 if profile else None, "mm_share": 0.5 if profile else None,
                "kernel_s": 0.9 if profile else None}

    monkeypatch.setattr(e2e, "run_setup", fake_setup)
    monkeypatch.setattr(e2e, "peak_flops", lambda device: (1e15, "test"))
    monkeypatch.setattr(e2e, "measure_gemm_ceiling", lambda device, **kw: 5e14)
    monkeypatch.setattr(e2e.GpuTelemetry, "open", staticmethod(lambda device: None))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "stand-in GPU")
    return calls


def test_rounds_run_abba_and_report_each_rounds_ratio(no_gpu, tmp_path, capsys):
    assert e2e.main(["--config", "tiny_cpu.yaml", "--setups", "ours_compile,compile_cudnn", "--rounds", "2",
                     "--accum", "1", "--trace-dir", str(tmp_path)]) == 0
    assert [(s, p) for s, p, _ in no_gpu] == [("ours_compile", True), ("compile_cudnn", True),
                                              ("compile_cudnn", False), ("ours_compile", False)]
    assert len({name for _, _, name in no_gpu}) == 4  # every run its own folder
    out = capsys.readouterr().out
    # round 1: ours 1.00 against plain 1.10; round 2: plain 1.04, then ours 0.98
    assert "[e2e] round 1: vs compile_cudnn: ours_compile 0.909" in out
    assert "[e2e] round 2: vs compile_cudnn: ours_compile 0.942" in out
    ours = next(line for line in out.splitlines() if line.startswith("| ours_compile |"))
    assert "| 0.926 (compile_cudnn) |" in ours  # the medians of the rounds: 0.99 / 1.07
    assert "25.0% / 50.0% / 25.0%" in ours  # the first round's profile


def test_rounds_must_be_positive(no_gpu):
    with pytest.raises(SystemExit, match="--rounds 0"):
        e2e.main(["--config", "tiny_cpu.yaml", "--setups", "compile_cudnn", "--rounds", "0", "--accum", "1"])
