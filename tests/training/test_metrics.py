"""FLOP formula, MFU arithmetic, peak table, deferred scalars and memory stats (CPU, fast)."""
import time

import pytest
import torch

from model.config import GPTConfig
from training.telemetry import metrics
from training.telemetry.metrics import (DeferredScalars, ThroughputMeter, format_mfu, measure_gemm_ceiling,
                                        memory_stats, peak_flops)


def test_flops_tiny_by_hand():
    # L=1, d=8, h=2, V=16, s=4, mlp 4·d=32, biases, learned positions:
    #   embeddings  16·8 + 4·8                       = 160
    #   LayerNorm   8 weight + 8 bias                 = 16   (two per block, one final)
    #   attention   qkv 8·24 + 24, out 8·8 + 8        = 216 + 72 = 288
    #   MLP         8·32 + 32 + 32·8 + 8               = 552
    #   block       2·16 + 288 + 552                   = 872
    #   N           160 + 1·872 + 16                   = 1048
    # per token: paper 6·1048 + 12·1·8·4 = 6288 + 384 = 6672; causal 6288 + 192 = 6480
    cfg = GPTConfig(n_layer=1, d_model=8, n_head=2, vocab_size=16, seq_len=4)
    assert cfg.num_params() == 1048
    assert cfg.flops_per_token() == 6672
    assert cfg.flops_per_token(causal_aware=True) == 6480


def test_flops_gpt3_1p3b_8k():
    # L=24, d=2048, V=50304, s=8192, biases: N = 12·L·d² + 13·L·d + V·d + s·d + 2·d
    #   = 1,207,959,552 + 638,976 + 103,022,592 + 16,777,216 + 4,096 = 1,328,402,432 (≈1.3B)
    # 6N = 7,970,414,592;  12·L·d·s = 12·24·2048·8192 = 4,831,838,208
    # paper 12,802,252,800 FLOP/token (≈12.8 GFLOP); causal 7,970,414,592 + 2,415,919,104
    cfg = GPTConfig(n_layer=24, d_model=2048, n_head=16, vocab_size=50304, seq_len=8192)
    assert cfg.num_params() == 1_328_402_432
    assert cfg.flops_per_token() == 12_802_252_800
    assert cfg.flops_per_token(causal_aware=True) == 10_386_333_696


def test_mfu_matches_benchmarks_table():
    # BENCHMARKS.md: 1.3B-8k, 43.9k tok/s on one H100 -> 562 TFLOP/s, 56.8% of 989
    cfg = GPTConfig(n_layer=24, d_model=2048, n_head=16, vocab_size=50304, seq_len=8192)
    tokens = 8192 * 8  # seq · (micro-batch 1 × accumulation 8)
    meter = ThroughputMeter.from_model(cfg, tokens, world_size=1, device="NVIDIA H100 80GB HBM3")
    m = meter.compute(step_time_s=tokens / 43.9e3)
    assert m["tokens_per_s"] == pytest.approx(43.9e3)
    assert m["tflops_paper"] == pytest.approx(562.0, abs=0.1)
    assert m["mfu_paper"] == pytest.approx(0.568, abs=0.001)
    assert m["tflops_causal"] == pytest.approx(43.9e3 * 10_386_333_696 / 1e12)
    assert m["mfu_causal"] == pytest.approx(m["tflops_causal"] * 1e12 / 989e12)
    assert format_mfu(m["mfu_paper"]) == "56.8%"


def test_throughput_per_gpu_and_no_peak():
    # 1000 tokens per step over 4 GPUs in 0.5 s: 2000 tok/s, 500 per GPU; 1e9 FLOP/token -> 0.5 TFLOP/s
    meter = ThroughputMeter(1e9, 0.8e9, tokens_per_step=1000, world_size=4, peak=1e12, gemm_ceiling=0.5e12)
    m = meter.compute(0.5)
    assert (m["tokens_per_s"], m["tokens_per_s_per_gpu"]) == (2000, 500)
    assert m["tflops_paper"] == pytest.approx(0.5) and m["tflops_causal"] == pytest.approx(0.4)
    assert m["mfu_paper"] == pytest.approx(0.5) and m["mfu_causal"] == pytest.approx(0.4)
    assert m["mfu_paper_gemm"] == pytest.approx(1.0)
    m = ThroughputMeter(1e9, 0.8e9, 1000, 4, peak=None).compute(0.5)
    assert m["mfu_paper"] is None and m["mfu_causal"] is None and "mfu_paper_gemm" not in m
    assert format_mfu(None) == "n/a"


def test_mark_uses_interval_mean(monkeypatch):
    clock = iter([10.0, 12.0])  # s
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    meter = ThroughputMeter(1.0, 1.0, tokens_per_step=100)
    assert meter.mark(0) is None  # starts the clock
    assert meter.interval_steps == 0
    assert meter.mark(4)["step_time_s"] == pytest.approx(0.5)  # 2 s over 4 steps
    assert meter.interval_steps == 4


def test_mark_restart_leaves_no_interval(monkeypatch):
    clock = iter([0.0, 3.0, 7.0, 9.0])  # s
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    meter = ThroughputMeter(1.0, 1.0, tokens_per_step=100)
    meter.mark(0)
    assert meter.mark(3)["step_time_s"] == pytest.approx(1.0) and meter.interval_steps == 3
    assert meter.mark(3) is None and meter.interval_steps == 0  # restart after an evaluation at step 3
    assert meter.mark(5)["step_time_s"] == pytest.approx(1.0) and meter.interval_steps == 2  # eval time excluded


@pytest.mark.parametrize("name,peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H200", 989e12),
    ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA A100-PCIE-40GB", 312e12), ("NVIDIA L40S", 362e12),
    ("NVIDIA A10", 125e12), ("NVIDIA GeForce RTX 4090", 165e12), ("NVIDIA A10G", None),
    ("Some Future GPU", None)])
def test_peak_table(monkeypatch, name, peak):
    monkeypatch.delenv("FLASHGPT_PEAK_TFLOPS", raising=False)
    value, source = peak_flops(name)
    assert value == peak
    assert (name in source) and ("table" in source if peak else "MFU not reported" in source)


def test_peak_cpu_and_env_override(monkeypatch):
    monkeypatch.delenv("FLASHGPT_PEAK_TFLOPS", raising=False)
    value, source = peak_flops(torch.device("cpu"))
    assert value is None and source.startswith("cpu: no peak table; MFU not reported")
    monkeypatch.setenv("FLASHGPT_PEAK_TFLOPS", "100")
    value, source = peak_flops("cpu")
    assert value == 100e12 and "FLASHGPT_PEAK_TFLOPS" in source


def test_deferred_scalars_cpu():
    d = DeferredScalars()
    d.push(1, {"loss": torch.tensor(2.5), "lr": 1e-3})
    d.push(2, {"loss": torch.tensor(2.25), "grad_norm": 3})
    assert len(d) == 2
    assert d.pop_ready() == [(1, {"loss": 2.5, "lr": 1e-3}), (2, {"loss": 2.25, "grad_norm": 3.0})]
    assert d.pop_ready() == [] and d.flush() == []
    d.push(3, {"loss": torch.tensor(1.0)})
    assert d.flush() == [(3, {"loss": 1.0})] and len(d) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_deferred_scalars_cuda():
    d = DeferredScalars()
    for step in range(5):
        d.push(step, {"loss": torch.tensor(float(step), device="cuda") * 2, "lr": 0.1})
    got = d.pop_ready() + d.flush()
    assert [s for s, _ in got] == list(range(5))
    assert [v["loss"] for _, v in got] == [0.0, 2.0, 4.0, 6.0, 8.0]


def test_gemm_ceiling_cpu_and_memory():
    assert measure_gemm_ceiling("cpu", n=64, dtype=torch.float32, iters=3, warmup=1) > 0
    t0 = time.perf_counter()  # sustain_s keeps the device busy that long before timing
    assert measure_gemm_ceiling("cpu", n=64, dtype=torch.float32, iters=3, warmup=1, sustain_s=0.2) > 0
    assert time.perf_counter() - t0 >= 0.2
    mem = memory_stats("cpu")
    assert set(mem) == {"mem_max_rss_gb"} and 0 < mem["mem_max_rss_gb"] < 1e4
