"""The tuner on a Hopper GPU: it times every candidate of every shape class, writes the cache, applies
it, and a new process's loader (kernels/tune_cache.apply_cached) applies the same choices."""
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
    pytest.skip("needs a Hopper GPU (one kernel family elsewhere: nothing to tune)", allow_module_level=True)

import tune_kernels  # noqa: E402
from kernels import tune_cache  # noqa: E402
from kernels.build import load_extension, source_hash  # noqa: E402
from gpu_util import reset_dispatch  # noqa: E402


def test_tune_command_writes_and_applies_a_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FLASHGPT_TUNE_CACHE", str(tmp_path))
    ext = load_extension()
    try:
        assert tune_kernels.main(["--reps", "2"]) == 0
        path = tune_cache.cache_path(torch.cuda.get_device_name(), source_hash())
        entries = tune_cache.load(path)
        assert len(entries) == len(list(tune_cache.shape_classes()))
        for e in entries:  # every candidate timed, the fastest chosen, the choice applied
            names = [n for n, _ in tune_cache.candidates(e["pass"], e["bucket"])]
            assert sorted(e["ms"]) == sorted(names) and all(t > 0 for t in e["ms"].values())
            assert e["choice"] == tune_kernels.choose(e["ms"], e["pass"], e["bucket"])
            assert ext.sm90_choice(e["pass"], e["d"], e["causal"], e["bucket"]) == e["choice"]
        assert any(e["choice"] in (2, 3) for e in entries)  # the backward's schedules are candidates
        rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| fwd", "| bwd"))]
        assert [r.rstrip(" |").rsplit("| ", 1)[-1] for r in rows] == [
            tune_kernels.LABELS[e["choice"]] for e in entries]  # the printed table is the cache's
        reset_dispatch()
        # what a new process does when the extension loads
        assert tune_cache.apply_cached(ext, source_hash()) == path
        assert all(ext.sm90_choice(e["pass"], e["d"], e["causal"], e["bucket"]) == e["choice"] for e in entries)
    finally:
        reset_dispatch()
