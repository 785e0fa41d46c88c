"""The test-only fault hook (training/resilience/faults.py): FLASHGPT_FAULT's spellings map to places, `reach` runs
the point's action only at its place, step and rank, and does nothing when the variable is unset."""
import pytest
import torch

from training.resilience import faults


def test_parse_maps_points_to_places_and_rank_defaults_to_zero():
    plan = faults.parse("step:5, ckpt_write:3:1,ckpt_commit:6,oom:2:1,stop:8:1,hang:4,nan_loss:2,nan_grad:2")
    assert plan == {
        ("update", 5, 0): {"step"}, ("ckpt_write", 3, 1): {"ckpt_write"}, ("ckpt_commit", 6, 0): {"ckpt_commit"},
        ("first_micro_batch", 2, 1): {"oom"}, ("first_micro_batch", 8, 1): {"stop"},
        ("first_micro_batch", 4, 0): {"hang"}, ("loss", 2, 0): {"nan_loss", "nan_grad"},
    }
    assert faults.parse("") == {}


@pytest.mark.parametrize("spec", ["kill:3", "step", "step:x", "step:1:2:3", "oom:-1"])
def test_parse_names_a_bad_item(spec):
    with pytest.raises(ValueError, match="<point>:<step>\\[:<rank>\\]"):
        faults.parse(spec)


def test_unset_does_nothing_and_parses_nothing(monkeypatch):
    monkeypatch.delenv(faults.FAULT_ENV, raising=False)
    monkeypatch.setattr(faults, "parse", lambda spec: pytest.fail("parsed with the variable unset"))
    for place in ("update", "first_micro_batch", "ckpt_write", "ckpt_commit"):
        faults.reach(place, 1, 0)
    model = torch.nn.Linear(2, 2)
    faults.install(model, lambda: 1, 0)
    assert not model._forward_hooks


def test_reach_acts_only_at_its_place_step_and_rank(monkeypatch):
    monkeypatch.setenv(faults.FAULT_ENV, "oom:2:1")
    faults.reach("first_micro_batch", 1, 1)  # another step
    faults.reach("first_micro_batch", 2, 0)  # another rank
    faults.reach("update", 2, 1)  # another place
    with pytest.raises(torch.OutOfMemoryError, match="FLASHGPT_FAULT=oom"):
        faults.reach("first_micro_batch", 2, 1)


def test_kill_points_call_kill_job(monkeypatch):
    killed = []
    monkeypatch.setitem(faults.POINTS, "ckpt_commit", ("ckpt_commit", lambda: killed.append("commit")))
    monkeypatch.setitem(faults.POINTS, "step", ("update", lambda: killed.append("step")))
    monkeypatch.setenv(faults.FAULT_ENV, "ckpt_commit:6,step:7")
    faults.reach("ckpt_write", 6, 0)
    faults.reach("ckpt_commit", 6, 0)
    faults.reach("update", 7, 0)
    assert killed == ["commit", "step"]


def test_nan_loss_hook_changes_that_training_step_only(monkeypatch):
    monkeypatch.setenv(faults.FAULT_ENV, "nan_loss:2")
    model = torch.nn.Linear(2, 1)
    step = [1]
    faults.install(model, lambda: step[0], 0)
    x = torch.ones(1, 2)
    assert torch.isfinite(model(x)).all()
    step[0] = 2
    assert torch.isnan(model(x)).all()
    model.eval()
    assert torch.isfinite(model(x)).all()  # evaluation is left alone
