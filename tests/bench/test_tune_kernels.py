"""The tuner (bench/tune_kernels.py) on CPU: the choice of the fastest candidate, its table, and the
message without a GPU."""
import pytest

import tune_kernels
from kernels import tune_cache


@pytest.mark.parametrize("pass_, bucket, ms, want", [
    (0, 1, {"fa2": 1.0, "hopper": 0.9}, 1), (0, 1, {"fa2": 1.0, "hopper": 1.1}, 0),
    (0, 1, {"fa2": 1.0, "hopper": 1.0}, 1),  # a tie: the Hopper kernel
    (1, 0, {"fa2": 1.0, "hopper": 0.9}, 1),  # the backward at <= 1k: the built-in schedule
    (1, 2, {"fa2": 1.0, "lockstep": 0.9, "turns": 0.8}, 3), (1, 2, {"fa2": 1.0, "lockstep": 0.8, "turns": 0.9}, 2),
    (1, 3, {"fa2": 0.7, "lockstep": 0.8, "turns": 0.9}, 0), (1, 3, {"fa2": 1.0, "lockstep": 0.8, "turns": 0.8}, 3)])
def test_choose_the_fastest_candidate(pass_, bucket, ms, want):
    names = [n for n, _ in tune_cache.candidates(pass_, bucket)]
    assert names == sorted(ms, key=["turns", "lockstep", "hopper", "fa2"].index)
    assert tune_kernels.choose(ms, pass_, bucket) == want


def test_every_bucket_has_a_length_to_time():
    assert {b for _, _, _, b in tune_cache.shape_classes()} == set(tune_kernels.BUCKET_SEQLEN)


def test_table_names_the_winner():
    out = tune_kernels.table([{"pass": 1, "d": 128, "causal": True, "bucket": 3, "choice": 3,
                               "ms": {"fa2": 2.0, "lockstep": 1.6, "turns": 1.5}},
                              {"pass": 0, "d": 64, "causal": False, "bucket": 0, "choice": 0,
                               "ms": {"fa2": 1.0, "hopper": 1.1}}])
    assert "| bwd | 128 | yes | >4k | 2.000 | - | 1.600 / 1.500 | Hopper, turns |" in out
    assert "| fwd | 64 | no | <=1k | 1.000 | 1.100 | - | FA2 |" in out


def test_without_a_gpu(capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    assert tune_kernels.main([]) == 1
    assert "no CUDA GPU" in capsys.readouterr().err
