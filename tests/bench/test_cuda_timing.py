"""bench/cuda_timing.py's time_interleaved_ms visits the candidates in a balanced order (each right after
every other equally often) or, on request, a fixed round-robin, and in GPU-time mode gives
every timed call a spin longer than the slowest candidate's host time (CPU: the CUDA-event timer and
the host clock are replaced by recorders)."""
import collections

import pytest
import torch

import cuda_timing as timing


def _candidates(order, fake_ms):
    def candidate(name):
        def call():
            order.append(name)
            return fake_ms[name]
        return call
    return {name: candidate(name) for name in fake_ms}


def test_fixed_order_alternates_candidates_in_passes(monkeypatch):
    order = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(timing, "_call_ms", lambda fn, spin_ms=0.0: fn())
    ms = timing.time_interleaved_ms(_candidates(order, {"a": 1.0, "b": 3.0}), reps=6, rounds=3, warmup=1,
                                    queue_ahead=False, fixed_order=True)
    assert ms == {"a": 1.0, "b": 3.0}
    assert order == ["a", "b"] + ["a", "a", "b", "b"] * 3  # warm-up, then 3 passes of 2 calls each


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5, 7])
def test_balanced_order_puts_every_candidate_after_every_candidate_once(n):
    names = [f"c{i}" for i in range(n)]
    order = timing.balanced_order(names)
    assert len(order) == n * n
    assert all(order.count(name) == n for name in names)
    pairs = [(order[i - 1], order[i]) for i in range(len(order))]  # cyclic: the order repeats
    assert sorted(pairs) == sorted((a, b) for a in names for b in names)


def test_balanced_timing_gives_each_candidate_reps_calls_after_each_other(monkeypatch):
    order = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(timing, "_call_ms", lambda fn, spin_ms=0.0: fn())
    fake = {"ours": 2.0, "flash": 5.0, "cudnn": 3.0}
    ms = timing.time_interleaved_ms(_candidates(order, fake), reps=7, warmup=1, queue_ahead=False)
    assert ms == fake
    timed = order[3:]  # after one warm-up call each
    assert all(timed.count(name) == 9 for name in fake)  # reps rounded up to whole cycles (3 visits each)
    follows = collections.Counter(zip(timed, timed[1:]))
    assert all(follows[(a, b)] >= 2 for a in fake for b in fake)  # 3 cycles: each ordered pair 2-3 times


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
    timing.time_interleaved_ms(fns, reps=4, warmup=1, queue_ahead=queue_ahead)
    assert spins == pytest.approx([expected_spin] * 8)  # 2 candidates x 4 calls (2 cycles of 2 visits)


@pytest.mark.parametrize("fixed_order", [False, True])
def test_no_candidates_time_nothing(monkeypatch, fixed_order):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    assert timing.time_interleaved_ms({}, reps=5, fixed_order=fixed_order) == {}  # every backend refused the shape
