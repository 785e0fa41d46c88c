"""Checkpoints: atomic layout, keep-last-k, resolve (auto / path / none), crash leftovers ignored."""
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from training.checkpoint import Checkpointer, rng_state, set_rng_state
from training.distributed import DistInfo


class FakeEngine:
    def __init__(self, value=0.0):
        self.w = torch.full((3,), value)

    def save(self, d: Path):
        torch.save({"w": self.w}, Path(d) / "engine.pt")

    def load(self, d: Path):
        self.w = torch.load(Path(d) / "engine.pt")["w"]


def test_save_keep_last_and_pointer(tmp_path):
    ck = Checkpointer(tmp_path, keep_last=2, dist=DistInfo())
    for step in (10, 20, 30):
        ck.save(step, FakeEngine(step), {"tokens_seen": step * 5}, {"loader": {"pos": step}})
    names = [p.name for p in ck.complete()]
    assert names == ["step_00000020", "step_00000030"]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000030"
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
    eng = FakeEngine()
    client, rank = ck.load(ck.resolve("auto"), eng)
    assert client["step"] == 30 and client["tokens_seen"] == 150 and rank["loader"]["pos"] == 30
    assert torch.equal(eng.w, torch.full((3,), 30.0))


def test_resolve_none_path_and_missing(tmp_path):
    ck = Checkpointer(tmp_path, keep_last=3, dist=DistInfo())
    assert ck.resolve("auto") is None and ck.resolve("none") is None
    path = ck.save(5, FakeEngine(1), {}, {})
    assert ck.resolve(str(path)) == path
    with pytest.raises(FileNotFoundError, match="resume"):
        ck.resolve(str(tmp_path / "nowhere"))


def test_crash_leftovers_are_ignored(tmp_path):
    """A save killed half-way leaves a .tmp folder: auto-resume uses the last complete one."""
    ck = Checkpointer(tmp_path, keep_last=3, dist=DistInfo())
    ck.save(10, FakeEngine(10), {}, {})
    tmp = tmp_path / "checkpoints" / ".tmp-step_00000020"
    tmp.mkdir()
    (tmp / "engine.pt").write_bytes(b"half a file")
    assert ck.resolve("auto").name == "step_00000010"
    (tmp_path / "checkpoints" / "latest").unlink()  # pointer lost too: newest complete folder wins
    assert ck.resolve("auto").name == "step_00000010"
    ck.save(20, FakeEngine(20), {}, {})  # the next save of that step replaces the leftovers
    assert ck.resolve("auto").name == "step_00000020" and not tmp.exists()


def test_resave_same_step_replaces(tmp_path):
    ck = Checkpointer(tmp_path, keep_last=3, dist=DistInfo())
    ck.save(10, FakeEngine(1), {}, {})
    ck.save(10, FakeEngine(2), {}, {})
    eng = FakeEngine()
    ck.load(ck.resolve("auto"), eng)
    assert eng.w[0].item() == 2.0


def test_newer_format_and_other_world_size_are_refused(tmp_path):
    ck = Checkpointer(tmp_path, keep_last=3, dist=DistInfo())
    path = ck.save(1, FakeEngine(), {}, {})
    client = torch.load(path / "client.pt", weights_only=False)
    torch.save({**client, "world_size": 4}, path / "client.pt")
    with pytest.raises(RuntimeError, match="4 ranks"):
        ck.load(path, FakeEngine())
    torch.save({**client, "format_version": 99}, path / "client.pt")
    with pytest.raises(RuntimeError, match="newer"):
        ck.load(path, FakeEngine())


def test_rng_round_trip():
    state = rng_state()
    a = (random.random(), np.random.rand(), torch.rand(2))
    set_rng_state(state)
    b = (random.random(), np.random.rand(), torch.rand(2))
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])
