"""kernels.tune's bookkeeping on CPU: shape classes, the choice, the cache file and its use."""
import json

import pytest

from kernels import tune


def test_shape_classes_cover_every_choice_once():
    classes = list(tune.shape_classes())
    assert len(classes) == len(set(classes)) == 2 * 2 * 2 * 4  # pass x head dim x causal x bucket
    assert (1, 64, False, 0) in classes  # the head-dim-64 TMA backward (session 5) is a candidate too


@pytest.mark.parametrize("fa2, hopper, want", [(1.0, 0.9, 1), (1.0, 1.1, 0), (1.0, 1.0, 1)])
def test_choose_the_faster(fa2, hopper, want):
    assert tune.choose(fa2, hopper) == want


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
               {"pass": 1, "d": 128, "causal": False, "bucket": 3, "choice": 1}]
    path = tmp_path / "sub" / "gpu-hash.json"
    tune.save(path, entries, {"device": "x"})
    assert not path.with_suffix(".tmp").exists()
    ext = FakeExt()
    tune.apply(ext, tune.load(path))
    assert ext.calls == [(0, 64, True, 1, 0), (1, 128, False, 3, 1)]


@pytest.mark.parametrize("text", ["not json", json.dumps({"format": 99, "entries": []}),
                                  json.dumps({"format": 1, "entries": [{"pass": 0}]})])
def test_bad_cache_files_are_refused_with_the_reason(tmp_path, text):
    path = tmp_path / "c.json"
    path.write_text(text)
    with pytest.raises(ValueError):
        tune.load(path)


def test_table_names_the_winner():
    out = tune.table([{"pass": 1, "d": 128, "causal": True, "bucket": 3, "choice": 1,
                       "ms": {"fa2": 2.0, "hopper": 1.5}}])
    assert "| bwd | 128 | yes | >4k | 2.000 | 1.500 | Hopper |" in out


def test_without_a_gpu(capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    assert tune.apply_cached(FakeExt()) is None
    assert tune.main([]) == 1
    assert "no CUDA GPU" in capsys.readouterr().err
