"""Checkpoints: atomic layout, keep-last-k, resolve (auto / path / none), crash leftovers ignored."""
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from training.config import load_config, to_dict
from training.distributed import DistInfo
from training.resilience.checkpoint import CheckpointError, Checkpointer, rng_state, set_rng_state
from training.trainer import check_compatible


class FakeEngine:
    def __init__(self, value=0.0):
        self.w = torch.full((3,), value)

    def save(self, d: Path):
        torch.save({"w": self.w}, Path(d) / "engine.pt")

    def load(self, d: Path):
        self.w = torch.load(Path(d) / "engine.pt", weights_only=True)["w"]


def test_save_keep_last_and_pointer(tmp_path):
    ck = Checkpointer(tmp_path, keep_last=2, dist=DistInfo())
    for step in (10, 20, 30):
        ck.save(step, FakeEngine(step), {"tokens_seen": step * 5}, {"loader": {"pos": step}})
    names = [p.name for p in ck.complete()]
    assert names == ["step_00000020", "step_00000030"]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000030"
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
    eng = FakeEngine()
    _, client, rank = ck.resume("auto", eng)
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
    ck.resume("auto", eng)
    assert eng.w[0].item() == 2.0


def test_other_world_size_is_marked(tmp_path):
    ck = Checkpointer(tmp_path, keep_last=3, dist=DistInfo())
    path = ck.save(1, FakeEngine(), {}, {})
    client = torch.load(path / "client.pt", weights_only=True)
    torch.save({**client, "world_size": 4}, path / "client.pt")
    ckmod.write_manifest(path, json.loads((path / "manifest.json").read_text()))
    _, _, rank_state = ck.resume("auto", FakeEngine())  # every engine reshards; the trainer is told
    assert rank_state["resharded_from"] == 4


def test_rng_round_trip():
    state = rng_state()
    a = (random.random(), np.random.rand(), torch.rand(2))
    set_rng_state(state)
    b = (random.random(), np.random.rand(), torch.rand(2))
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


# --- integrity: manifest, verification, fallback, write errors ---------------------------------------
import errno  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402

import training.resilience.checkpoint as ckmod  # noqa: E402
from training.resilience.checkpoint import verify  # noqa: E402


class ShardedEngine(FakeEngine):
    """Writes a sub-folder, as sharded engines (DeepSpeed, DCP) do: the manifest must cover it."""

    def save(self, d: Path):
        (Path(d) / "shards").mkdir()
        torch.save({"w": self.w}, Path(d) / "shards" / "part0.pt")
        super().save(d)


def three(tmp_path, engine=FakeEngine):
    ck = Checkpointer(tmp_path, keep_last=3, dist=DistInfo())
    for step in (10, 20, 30):
        ck.save(step, engine(step), {"tokens_seen": step}, {"loader": {"pos": step}})
    return ck


def test_manifest_covers_every_file(tmp_path):
    ck = three(tmp_path, ShardedEngine)
    path = ck.resolve("auto")
    manifest = json.loads((path / "manifest.json").read_text())
    assert sorted(manifest["files"]) == ["client.pt", "engine.pt", "rank00000.pt", "shards/part0.pt"]
    assert manifest["algorithm"] == "xxh3_128" and verify(path) is None


@pytest.mark.parametrize("damage, words", [
    ("flip", "engine.pt does not match its xxh3_128 checksum"),
    ("truncate", "engine.pt has .* bytes, the manifest says .*truncated"),
    ("delete", "shards/part0.pt is missing"),
    ("manifest", "unreadable manifest.json"),
])
def test_damaged_newest_falls_back_with_a_warning(tmp_path, caplog, damage, words):
    ck = three(tmp_path, ShardedEngine)
    newest = tmp_path / "checkpoints" / "step_00000030"
    if damage == "flip":
        data = bytearray((newest / "engine.pt").read_bytes())
        data[len(data) // 2] ^= 0xFF
        (newest / "engine.pt").write_bytes(bytes(data))
    elif damage == "truncate":
        with open(newest / "engine.pt", "r+b") as f:
            f.truncate(100)
    elif damage == "delete":
        (newest / "shards" / "part0.pt").unlink()
    else:
        (newest / "manifest.json").write_text("{not json")
    assert re.search(words, verify(newest))
    eng = FakeEngine()
    with caplog.at_level(logging.WARNING):
        path, client, _ = ck.resume("auto", eng)
    assert path.name == "step_00000020"
    msg = caplog.text
    assert "step_00000030 is damaged" in msg and "resuming from" in msg and "step_00000020" in msg
    # moved aside (pruning and the next resume ignore it), pointer rewritten, older one loads
    assert not newest.exists() and (tmp_path / "checkpoints" / "corrupt-step_00000030").is_dir()
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000020"
    assert client["step"] == 20 and eng.w[0].item() == 20.0


def test_falls_back_through_several_and_fails_when_none_is_intact(tmp_path):
    ck = three(tmp_path)
    for step in (30, 20):
        with open(tmp_path / "checkpoints" / f"step_{step:08d}" / "engine.pt", "r+b") as f:
            f.truncate(10)
    assert ck.resume("auto", FakeEngine())[0].name == "step_00000010"
    with open(tmp_path / "checkpoints" / "step_00000010" / "rank00000.pt", "r+b") as f:
        f.truncate(10)
    with pytest.raises(CheckpointError, match="no intact checkpoint.*step_00000010: rank00000.pt.*"
                                              "resume=none train.overwrite=true"):
        ck.resume("auto", FakeEngine())


def test_explicit_damaged_path_is_refused(tmp_path):
    ck = three(tmp_path)
    path = tmp_path / "checkpoints" / "step_00000020"
    (path / "rank00000.pt").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="step_00000020 is damaged.*rank00000.pt.*resume=auto"):
        ck.resume(str(path), FakeEngine())


def test_pointer_wins_over_a_newer_folder(tmp_path):
    """A crash between the rename and the pointer update leaves a newer folder than `latest`:
    resume from `latest` (redoing a few steps gives the same result)."""
    ck = three(tmp_path)
    (tmp_path / "checkpoints" / "latest").write_text("step_00000020\n")
    assert ck.resolve("auto").name == "step_00000020"


def test_checkpoint_without_manifest_is_refused_unless_asked(tmp_path, caplog):
    ck = three(tmp_path)
    (tmp_path / "checkpoints" / "step_00000030" / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="step_00000030 has no manifest.json.*train.resume_unverified=true"):
        ck.resume("auto", FakeEngine())
    unverified = Checkpointer(tmp_path, keep_last=3, dist=DistInfo(), accept_unverified=True)
    with caplog.at_level(logging.WARNING):
        assert unverified.resume("auto", FakeEngine())[0].name == "step_00000030"
    assert "no manifest.json" in caplog.text and "unverified" in caplog.text


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device", "engine.pt")


@pytest.mark.parametrize("where", ["torch.save", "engine", "manifest"])
def test_disk_full_raises_clearly_and_keeps_the_last_good(tmp_path, monkeypatch, where):
    ck = three(tmp_path)
    engine = FakeEngine(40)
    if where == "torch.save":
        monkeypatch.setattr(ckmod.torch, "save", _enospc)
    elif where == "engine":  # torch.save reports a full disk as RuntimeError
        def failing(d):
            raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")
        engine.save = failing
    else:
        monkeypatch.setattr(ckmod, "write_manifest", _enospc)
    with pytest.raises(CheckpointError) as info:
        ck.save(40, engine, {}, {})
    msg = str(info.value)
    assert "step_00000040" in msg and "step_00000030) is intact" in msg and "GiB free" in msg
    assert ("ENOSPC" in msg) if where != "engine" else ("file write failed" in msg)
    monkeypatch.undo()
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
    assert not (tmp_path / "checkpoints" / "step_00000040").exists()
    assert ck.resolve("auto").name == "step_00000030" and verify(ck.resolve("auto")) is None


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file permissions")
def test_read_only_folder_raises_clearly(tmp_path):
    ck = three(tmp_path)
    root = tmp_path / "checkpoints"
    root.chmod(0o555)
    try:
        with pytest.raises(CheckpointError, match="EACCES.*step_00000030\\) is intact.*permissions"):
            ck.save(40, FakeEngine(40), {}, {})
    finally:
        root.chmod(0o755)
    assert ck.resolve("auto").name == "step_00000030"


def test_resume_check_compares_the_model_not_its_implementation(tmp_path):
    """Resuming needs the same weights and function: model.attention / mlp / fused_loss / residual /
    recompute_gelu / norm_saves_output may change between runs, and a key a checkpoint predates counts
    as its default."""
    cfg = load_config("tiny_cpu.yaml")
    saved = {"model": to_dict(cfg)["model"]}
    check_compatible(saved, cfg, tmp_path)
    for key, value in [("attention", "reference"), ("mlp", "fused"), ("fused_loss", "false"),
                       ("residual", "autocast"), ("recompute_gelu", "true"), ("norm_saves_output", "true")]:
        check_compatible(saved, load_config("tiny_cpu.yaml", [f"model.{key}={value}"]), tmp_path)
    older = {"model": {k: v for k, v in saved["model"].items() if k not in ("residual", "norm_eps")}}
    check_compatible(older, cfg, tmp_path)  # saved before those keys existed, at their defaults
    before_options = {"model": {k: v for k, v in saved["model"].items()
                                if k not in ("recompute_gelu", "norm_saves_output")}}
    check_compatible(before_options, load_config(  # a run saved without those keys, resumed with them on
        "tiny_cpu.yaml", ["model.recompute_gelu=true", "model.norm_saves_output=true"]), tmp_path)
    with pytest.raises(CheckpointError, match=r"n_layer.*\(4, 3\)"):
        check_compatible(saved, load_config("tiny_cpu.yaml", ["model.n_layer=3"]), tmp_path)
    with pytest.raises(CheckpointError, match="norm_eps"):
        check_compatible(older, load_config("tiny_cpu.yaml", ["model.norm_eps=1e-6"]), tmp_path)
