"""A non-finite loss or gradient norm is caught before the optimizer step: train.nonfinite=skip drops
that update (counted as skipped_steps; stops after train.max_skipped in a row), =stop raises naming
the step and the batch's place in the data. NaNs are injected with FLASHGPT_FAULT (training/resilience/faults.py)."""
import json
import math

import pytest
from train_runner import fit

from training.config import load_config
from training.trainer import NonFiniteError


@pytest.fixture(scope="module")
def straight(tmp_path_factory, cache_dir):
    mp = pytest.MonkeyPatch()
    try:
        return fit(tmp_path_factory.mktemp("nf"), cache_dir, "straight", monkeypatch=mp).records
    finally:
        mp.undo()


@pytest.mark.parametrize("fault", ["nan_loss:3", "nan_grad:3"])
def test_skip_drops_the_update_and_counts_it(tmp_path, cache_dir, straight, monkeypatch, fault):
    t = fit(tmp_path, cache_dir, "skip", fault=fault, monkeypatch=monkeypatch)
    r = t.records
    assert sorted(r) == [1, 2, 3, 4, 5] and t.step == 5
    assert [r[s]["loss"] for s in (1, 2)] == [straight[s]["loss"] for s in (1, 2)]
    assert r[3]["skipped"] == 1 and math.isnan(r[3]["grad_norm"])
    if fault.startswith("nan_loss"):
        assert math.isnan(r[3]["loss"])
    else:  # finite loss, NaN gradients: same weights and batch as the straight run's step 3
        assert r[3]["loss"] == straight[3]["loss"]
    assert [r[s]["skipped_steps"] for s in (1, 2, 3, 4, 5)] == [0, 0, 1, 1, 1]
    # the update was dropped: the optimizer made 4 steps and the LR schedule lags by one
    opt_steps = {int(s["step"]) for s in t.engine.optimizer.state.values()}
    assert opt_steps == {4}
    assert r[4]["lr"] == straight[3]["lr"] and r[5]["lr"] == straight[4]["lr"]
    assert all(math.isfinite(r[s]["loss"]) for s in (4, 5))


def test_stop_names_the_step_and_batch(tmp_path, cache_dir, monkeypatch):
    with pytest.raises(NonFiniteError, match=r"at step 3 .*epoch 0, window 16 of the train split.*"
                                             r"train.nonfinite=stop"):
        fit(tmp_path, cache_dir, "stop", "train.nonfinite=stop", fault="nan_loss:3", monkeypatch=monkeypatch)
    rec = [json.loads(x) for x in (tmp_path / "stop" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rec] == [1, 2]  # the steps before it are all logged


def test_too_many_in_a_row_stops(tmp_path, cache_dir, monkeypatch):
    with pytest.raises(NonFiniteError, match=r"3 steps in a row.*train.max_skipped=2.*step 4"):
        fit(tmp_path, cache_dir, "diverged", "train.max_skipped=2",
            fault="nan_loss:2,nan_loss:3,nan_grad:4", monkeypatch=monkeypatch)


def test_skip_counts_survive_resume(tmp_path, cache_dir, monkeypatch):
    """Stopped after 3 steps (one skipped) and resumed == straight through, skips included."""
    a = fit(tmp_path, cache_dir, "a", fault="nan_grad:2", monkeypatch=monkeypatch).records
    fit(tmp_path, cache_dir, "b", "train.stop_after=3", fault="nan_grad:2", monkeypatch=monkeypatch)
    b = fit(tmp_path, cache_dir, "b", fault="nan_grad:2", monkeypatch=monkeypatch).records
    strip = lambda r: {s: (v["loss"], v["lr"], v["skipped_steps"]) for s, v in r.items()}  # noqa: E731
    assert strip(a) == strip(b) and b[5]["skipped_steps"] == 1


@pytest.mark.parametrize("override, words", [("train.nonfinite=ignore", "train.nonfinite='ignore' is not one of"),
                                             ("train.max_skipped=0", "train.max_skipped=0 must be positive")])
def test_policy_is_validated(override, words):
    from training.config import ConfigError
    with pytest.raises(ConfigError, match=words):
        load_config("tiny_cpu.yaml", [override])
