"""The tuning cache the extension applies when it loads (kernels/tune_cache.py), on CPU: shape
classes and their candidates, the file's name, writing, reading, refusing and applying it."""
import json

import pytest

from kernels import tune_cache


def test_shape_classes_cover_every_choice_once():
    classes = list(tune_cache.shape_classes())
    assert len(classes) == len(set(classes)) == 2 * 2 * 2 * 4  # pass x head dim x causal x bucket
    assert (1, 64, False, 0) in classes  # the head-dim-64 TMA backward is a candidate too


def test_candidates_prefer_the_hopper_kernels():
    assert tune_cache.candidates(0, 2) == (("hopper", 1), ("fa2", 0))
    assert tune_cache.candidates(1, 0) == (("hopper", 1), ("fa2", 0))  # <= 1k: the built-in schedule
    assert tune_cache.candidates(1, 3) == (("turns", 3), ("lockstep", 2), ("fa2", 0))


def test_cache_path_is_per_gpu_and_build(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHGPT_TUNE_CACHE", str(tmp_path))
    a = tune_cache.cache_path("NVIDIA H100 80GB HBM3", "abc123")
    assert a.parent == tmp_path and a.name == "NVIDIA_H100_80GB_HBM3-abc123.json"
    assert tune_cache.cache_path("NVIDIA H200", "abc123") != a
    assert tune_cache.cache_path("NVIDIA H100 80GB HBM3", "def456") != a


class FakeExt:
    def __init__(self):
        self.calls = []

    def set_sm90_choice(self, *args):
        self.calls.append(args)


def test_save_load_apply_round_trip(tmp_path):
    entries = [{"pass": 0, "d": 64, "causal": True, "bucket": 1, "choice": 0, "ms": {"fa2": 1.0, "hopper": 1.2}},
               {"pass": 1, "d": 128, "causal": False, "bucket": 3, "choice": 3}]
    path = tmp_path / "sub" / "gpu-hash.json"
    tune_cache.save(path, entries, {"device": "x"})
    assert not path.with_suffix(".tmp").exists()
    ext = FakeExt()
    tune_cache.apply(ext, tune_cache.load(path))
    assert ext.calls == [(0, 64, True, 1, 0), (1, 128, False, 3, 3)]


def _entry(**kw):
    return {"pass": 1, "d": 128, "causal": True, "bucket": 3, "choice": 3, **kw}


@pytest.mark.parametrize("text", [
    "not json", json.dumps({"format": 99, "entries": []}),
    json.dumps({"format": 1, "entries": [_entry(choice=1)]}),  # an older format: another build's file
    json.dumps({"format": tune_cache.FORMAT, "entries": [{"pass": 0}]}),
    json.dumps({"format": tune_cache.FORMAT, "entries": [{**_entry(), "pass": 0}]}),  # the forward has no schedules
    json.dumps({"format": tune_cache.FORMAT, "entries": [_entry(bucket=0)]}),  # <= 1k: the threshold's bucket
    json.dumps({"format": tune_cache.FORMAT, "entries": [_entry(choice=1)]})])  # backward > 1k: a schedule
def test_bad_cache_files_are_refused_with_the_reason(tmp_path, text):
    path = tmp_path / "c.json"
    path.write_text(text)
    with pytest.raises(ValueError):
        tune_cache.load(path)


def test_nothing_is_applied_without_a_hopper_gpu():
    import torch
    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    ext = FakeExt()
    assert tune_cache.apply_cached(ext, "abc123") is None and ext.calls == []
