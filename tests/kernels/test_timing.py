"""kernels.timing.time_interleaved_ms visits the candidates round-robin, and in GPU-time mode gives
every timed call a spin longer than the slowest candidate's host time (CPU: the CUDA-event timer and
the host clock are replaced by recorders)."""
import pytest
import torch

from kernels import timing


def _candidates(order, fake_ms):
    def candidate(name):
        def call():
            order.append(name)
            return fake_ms[name]
        return call
    return {name: candidate(name) for name in fake_ms}


def test_interleaved_timing_alternates_candidates(monkeypatch):
    order = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(timing, "_call_ms", lambda fn, spin_ms=0.0: fn())
    ms = timing.time_interleaved_ms(_candidates(order, {"a": 1.0, "b": 3.0}), reps=6, rounds=3, warmup=1,
                                    queue_ahead=False)
    assert ms == {"a": 1.0, "b": 3.0}
    assert order == ["a", "b"] + ["a", "a", "b", "b"] * 3  # warm-up, then 3 passes of 2 calls each


@pytest.mark.parametrize("queue_ahead, expected_spin", [(True, 2 * 0.7 + 0.2), (False, 0.0)])
def test_spin_covers_the_slowest_host_time(monkeypatch, queue_ahead, expected_spin):
    host = {"a": 0.3, "b": 0.7}  # ms of host time per call
    spins, order = [], []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(timing, "_host_ms", lambda fn: host[fn.__name__])
    monkeypatch.setattr(timing, "_call_ms", lambda fn, spin_ms=0.0: spins.append(spin_ms) or 1.0)
    fns = {}
    for name in host:
        fn = _candidates(order, {name: 1.0})[name]
        fn.__name__ = name
        fns[name] = fn
    timing.time_interleaved_ms(fns, reps=4, rounds=2, warmup=1, queue_ahead=queue_ahead)
    assert spins == pytest.approx([expected_spin] * 8)  # 2 rounds x 2 candidates x 2 calls
