"""kernels.timing.time_interleaved_ms visits the candidates round-robin (CPU: the CUDA-event timer is
replaced by a recorder)."""
import torch

from kernels import timing


def test_interleaved_timing_alternates_candidates(monkeypatch):
    order = []
    fake_ms = {"a": 1.0, "b": 3.0}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(timing, "_call_ms", lambda fn: fn())

    def candidate(name):
        def call():
            order.append(name)
            return fake_ms[name]
        return call

    ms = timing.time_interleaved_ms({"a": candidate("a"), "b": candidate("b")}, reps=6, rounds=3, warmup=1)
    assert ms == {"a": 1.0, "b": 3.0}
    assert order == ["a", "b"] + ["a", "a", "b", "b"] * 3  # warm-up, then 3 passes of 2 calls each
