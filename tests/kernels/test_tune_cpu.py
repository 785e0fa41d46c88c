"""kernels.tune's bookkeeping on CPU: shape classes, the choice, the cache file and its use."""
import json

import pytest

from kernels import tune


def test_shape_classes_cover_every_choice_once():
    classes = list(tune.shape_classes())
    assert len(classes) == len(set(classes)) == 2 * 2 * 2 * 4  # pass x head dim x causal x bucket
    assert (1, 64, False, 0) in classes  # the head-dim-64 TMA backward is a candidate too


@pytest.mark.parametrize("pass_, bucket, ms, want", [
    (0, 1, {"fa2": 1.0, "hopper": 0.9}, 1), (0, 1, {"fa2": 1.0, "hopper": 1.1}, 0),
    (0, 1, {"fa2": 1.0, "hopper": 1.0}, 1),  # a tie: the Hopper kernel
    (1, 0, {"fa2": 1.0, "hopper": 0.9}, 1),  # the backward at <= 1k: the built-in schedule
    (1, 2, {"fa2": 1.0, "lockstep": 0.9, "turns": 0.8}, 3), (1, 2, {"fa2": 1.0, "lockstep": 0.8, "turns": 0.9}, 2),
    (1, 3, {"fa2": 0.7, "lockstep": 0.8, "turns": 0.9}, 0), (1, 3, {"fa2": 1.0, "lockstep": 0.8, "turns": 0.8}, 3)])
def test_choose_the_fastest_candidate(pass_, bucket, ms, want):
    assert [n for n, _ in tune.candidates(pass_, bucket)] == sorted(ms, key=["turns", "lockstep", "hopper", "fa2"].index)
    assert tune.choose(ms, pass_, bucket) == want


def test_cache_path_is_per_gpu_and_build(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHGPT_TUNE_CACHE", str(tmp_path))
    a = tune.cache_path("NVIDIA H100 80GB HBM3", "abc123")
    assert a.parent == tmp_path and a.name == "NVIDIA_H100_80GB_HBM3-abc123.json"
    assert tune.cache_path("NVIDIA H200", "abc123") != a != tune.cache_path("NVIDIA H100 80GB HBM3", "def456")


class FakeExt:
    def __init__(self):
        self.calls = []

    def set_sm90_choice(self, *args):
        self.calls.append(args)


def test_save_load_apply_round_trip(tmp_path):
    entries = [{"pass": 0, "d": 64, "causal": True, "bucket": 1, "choice": 0, "ms": {"fa2": 1.0, "hopper": 1.2}},
               {"pass": 1, "d": 128, "causal": False, "bucket": 3, "choice": 3}]
    path = tmp_path / "sub" / "gpu-hash.json"
    tune.save(path, entries, {"device": "x"})
    assert not path.with_suffix(".tmp").exists()
    ext = FakeExt()
    tune.apply(ext, tune.load(path))
    assert ext.calls == [(0, 64, True, 1, 0), (1, 128, False, 3, 3)]


def _entry(**kw):
    return {"pass": 1, "d": 128, "causal": True, "bucket": 3, "choice": 3, **kw}


@pytest.mark.parametrize("text", [
    "not json", json.dumps({"format": 99, "entries": []}),
    json.dumps({"format": 1, "entries": [_entry(choice=1)]}),  # an older format: another build's file
    json.dumps({"format": tune.FORMAT, "entries": [{"pass": 0}]}),
    json.dumps({"format": tune.FORMAT, "entries": [{**_entry(), "pass": 0}]}),  # the forward has no schedules
    json.dumps({"format": tune.FORMAT, "entries": [_entry(bucket=0)]}),  # <= 1k: the threshold's bucket
    json.dumps({"format": tune.FORMAT, "entries": [_entry(choice=1)]})])  # backward > 1k: a schedule
def test_bad_cache_files_are_refused_with_the_reason(tmp_path, text):
    path = tmp_path / "c.json"
    path.write_text(text)
    with pytest.raises(ValueError):
        tune.load(path)


def test_table_names_the_winner():
    out = tune.table([{"pass": 1, "d": 128, "causal": True, "bucket": 3, "choice": 3,
                       "ms": {"fa2": 2.0, "lockstep": 1.6, "turns": 1.5}},
                      {"pass": 0, "d": 64, "causal": False, "bucket": 0, "choice": 0,
                       "ms": {"fa2": 1.0, "hopper": 1.1}}])
    assert "| bwd | 128 | yes | >4k | 2.000 | - | 1.600 / 1.500 | Hopper, turns |" in out
    assert "| fwd | 64 | no | <=1k | 1.000 | 1.100 | - | FA2 |" in out


def test_without_a_gpu(capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    assert tune.apply_cached(FakeExt()) is None
    assert tune.main([]) == 1
    assert "no CUDA GPU" in capsys.readouterr().err
