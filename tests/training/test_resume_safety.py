"""Resume that can be trusted, at the Checkpointer level: files load as data (no code runs), malformed
manifests and failed loads fall back, pruning follows write order and never drops the checkpoint just
written or the one `latest` names, one run per run folder."""
import json
import logging
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from training.distributed import DistInfo
import training.resilience.checkpoint as ckmod
from training.resilience.checkpoint import (CheckpointError, Checkpointer, IncompatibleCheckpoint, rng_state,
                                            set_rng_state)
from training.resilience.manifest import verify, write_manifest
from training.resilience.run_folder import RunFolderBusy, RunLock, move_aside


class FakeEngine:
    def __init__(self, value=0.0):
        self.w = torch.full((3,), float(value))

    def save(self, d: Path):
        torch.save({"w": self.w}, Path(d) / "engine.pt")

    def load(self, d: Path):
        self.w = ckmod.load_data(Path(d) / "engine.pt")["w"]


def saved(tmp_path, steps=(10, 20, 30), keep_last=3):
    ck = Checkpointer(tmp_path, keep_last=keep_last, dist=DistInfo())
    for step in steps:
        ck.save(step, FakeEngine(step), {"tokens_seen": step}, {"loader": {"pos": step}, "rng": rng_state()})
    return ck


def reseal(path: Path) -> None:
    """Recompute the manifest over the folder as it is now (what an attacker, or a bug, could do)."""
    facts = {k: v for k, v in json.loads((path / "manifest.json").read_text()).items()
             if k not in ("version", "algorithm", "files")}
    write_manifest(path, facts)


class Payload:
    """Unpickling this creates a marker file (a stand-in for any code a pickle can run)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


# --- part 1: checkpoints carry no code ---------------------------------------------------------------
def test_pickled_payload_in_client_file_runs_nothing_and_falls_back(tmp_path, caplog):
    ck = saved(tmp_path)
    newest = tmp_path / "checkpoints" / "step_00000030"
    marker = tmp_path / "marker"
    client = torch.load(newest / "client.pt", weights_only=True)
    with open(newest / "client.pt", "wb") as f:  # a plain pickle, as torch.load(weights_only=False) reads
        pickle.dump({**client, "evil": Payload(marker)}, f)
    reseal(newest)
    assert verify(newest) is None  # the manifest cannot tell: the load must refuse it
    eng = FakeEngine()
    with caplog.at_level(logging.WARNING):
        path, client, _ = ck.resume("auto", eng)
    assert not marker.exists()
    assert path.name == "step_00000020" and eng.w[0].item() == 20.0
    assert "step_00000030 is damaged (loading it failed" in caplog.text


def test_pickled_payload_in_rank_and_engine_files_runs_nothing(tmp_path):
    ck = saved(tmp_path)
    marker = tmp_path / "marker"
    for name in ("rank00000.pt", "engine.pt"):
        folder = tmp_path / "checkpoints" / ("step_00000030" if name == "engine.pt" else "step_00000020")
        torch.save({"w": torch.zeros(3), "x": Payload(marker)}, folder / name)
        reseal(folder)
    path, _, _ = ck.resume("auto", FakeEngine())
    assert not marker.exists() and path.name == "step_00000010"


def test_rank_state_is_plain_data(tmp_path):
    """RNG states are tensors, ints and tuples: nothing weights_only=True refuses."""
    torch.save(rng_state(), tmp_path / "rank.pt")
    assert torch.serialization.get_unsafe_globals_in_checkpoint(tmp_path / "rank.pt") == []
    back = torch.load(tmp_path / "rank.pt", weights_only=True)
    a = (np.random.rand(), torch.rand(2))
    set_rng_state(back)
    b = (np.random.rand(), torch.rand(2))
    assert a[0] == b[0] and torch.equal(a[1], b[1])


def test_format_1_rank_file_with_numpy_state_still_loads(tmp_path):
    """Rank files of the previous format hold numpy's state as an ndarray: allowed as data."""
    legacy = {"python": __import__("random").getstate(), "numpy": np.random.get_state(),
              "torch": torch.get_rng_state()}
    torch.save({"loader": {}, "rng": legacy}, tmp_path / "r.pt")
    back = ckmod.load_data(tmp_path / "r.pt")
    expect = np.random.rand()
    set_rng_state(legacy)
    first = np.random.rand()
    set_rng_state(back["rng"])
    assert np.random.rand() == first and isinstance(expect, float)


@pytest.mark.parametrize("edit, words", [
    (lambda m: m.update(files={}), "lists no files"),
    (lambda m: m.update(algorithm="md5"), "unknown hash algorithm 'md5'"),
    (lambda m: m["files"].update({"../../escape.pt": {"size": 1, "hash": "00"}}), "path outside"),
    (lambda m: m["files"].update({"/etc/passwd": {"size": 1, "hash": "00"}}), "path outside"),
    (lambda m: m["files"].pop("engine.pt"), "engine.pt is not in the manifest"),
])
def test_malformed_manifest_counts_as_damaged(tmp_path, caplog, edit, words):
    ck = saved(tmp_path)
    newest = tmp_path / "checkpoints" / "step_00000030"
    manifest = json.loads((newest / "manifest.json").read_text())
    edit(manifest)
    (newest / "manifest.json").write_text(json.dumps(manifest))
    assert words in verify(newest)
    with caplog.at_level(logging.WARNING):
        assert ck.resume("auto", FakeEngine())[0].name == "step_00000020"
    assert "step_00000030 is damaged" in caplog.text and words in caplog.text


def test_file_added_after_the_save_counts_as_damaged(tmp_path):
    ck = saved(tmp_path)
    (tmp_path / "checkpoints" / "step_00000030" / "extra.pt").write_bytes(b"x")
    assert ck.resume("auto", FakeEngine())[0].name == "step_00000020"


# --- part 2: pruning never loses a run ---------------------------------------------------------------
def test_restarted_run_keeps_what_it_writes(tmp_path):
    """The audit's case at the Checkpointer level: an old run left step_6 and step_8; a new run from
    step 0 writes step_2 and step_3 with keep_last=2. Write order, not step number, decides."""
    ck = saved(tmp_path, steps=(6, 8), keep_last=2)
    for step in (2, 3):
        ck.save(step, FakeEngine(step), {"tokens_seen": step}, {"loader": {}, "rng": rng_state()})
        assert (tmp_path / "checkpoints" / f"step_{step:08d}").is_dir()
        assert (tmp_path / "checkpoints" / "latest").read_text().strip() == f"step_{step:08d}"
    assert [p.name for p in ck.complete()] == ["step_00000002", "step_00000003"]
    assert ck.resume("auto", FakeEngine())[0].name == "step_00000003"


def test_pruning_keeps_the_checkpoint_latest_names(tmp_path):
    ck = saved(tmp_path, steps=(10, 20), keep_last=1)
    (tmp_path / "checkpoints" / "latest").write_text("step_00000020\n")
    ck.keep_last = 1
    ck._prune(tmp_path / "checkpoints" / "step_00000020")
    assert [p.name for p in ck.complete()] == ["step_00000020"]


def test_missing_pointer_takes_the_newest_verified_with_a_warning(tmp_path, caplog):
    ck = saved(tmp_path, steps=(30, 10))  # written in this order: step_10 is the newest
    (tmp_path / "checkpoints" / "latest").unlink()
    with caplog.at_level(logging.WARNING):
        assert ck.resume("auto", FakeEngine())[0].name == "step_00000010"
    assert "no `latest` pointer" in caplog.text and "step_00000010" in caplog.text


def test_pruning_is_crash_safe(tmp_path):
    """A prune renames the folder out of the step_* namespace before deleting it: a crash mid-delete
    leaves a .trash-* folder (ignored, removed at the next start), never a half step_* folder."""
    ck = saved(tmp_path, steps=(10,))
    trash = tmp_path / "checkpoints" / ".trash-step_00000005-1"
    trash.mkdir()
    (trash / "engine.pt").write_bytes(b"half")
    tmp = tmp_path / "checkpoints" / ".tmp-step_00000011"
    tmp.mkdir()
    assert ck.resume("auto", FakeEngine())[0].name == "step_00000010"
    assert sorted(ck.remove_leftovers()) == [".tmp-step_00000011", ".trash-step_00000005-1"]
    assert not trash.exists() and not tmp.exists()


# --- part 4: a failed load falls back ----------------------------------------------------------------
class BrokenEngine(FakeEngine):
    """Loads fail for the folders named (a missing key, as a checkpoint of a broken writer would)."""

    def __init__(self, broken):
        super().__init__()
        self.broken = broken

    def load(self, d: Path):
        if Path(d).name in self.broken:
            raise KeyError("optimizer")
        super().load(d)


def test_engine_load_error_falls_back_naming_both(tmp_path, caplog):
    ck = saved(tmp_path)
    with caplog.at_level(logging.WARNING):
        path, client, _ = ck.resume("auto", BrokenEngine({"step_00000030"}))
    assert path.name == "step_00000020" and client["step"] == 20
    assert "step_00000030 is damaged (loading it failed: KeyError: 'optimizer')" in caplog.text
    assert "resuming from" in caplog.text and (tmp_path / "checkpoints" / "corrupt-step_00000030").is_dir()


def test_truncated_engine_file_behind_a_resealed_manifest_falls_back(tmp_path):
    ck = saved(tmp_path)
    newest = tmp_path / "checkpoints" / "step_00000030"
    with open(newest / "engine.pt", "r+b") as f:
        f.truncate(40)
    reseal(newest)
    assert ck.resume("auto", FakeEngine())[0].name == "step_00000020"


def test_newer_format_falls_back_naming_the_version_that_wrote_it(tmp_path, caplog):
    ck = saved(tmp_path)
    newest = tmp_path / "checkpoints" / "step_00000030"
    manifest = json.loads((newest / "manifest.json").read_text())
    manifest.update(format_version=99, written_by="flashgpt 9.0")
    (newest / "manifest.json").write_text(json.dumps(manifest))
    (newest / "client.pt").write_bytes(b"a format this checkout cannot read")  # never opened
    with caplog.at_level(logging.WARNING):
        assert ck.resume("auto", FakeEngine())[0].name == "step_00000020"
    assert "written by flashgpt 9.0 in checkpoint format 99, newer than this checkout's" in caplog.text
    with pytest.raises(CheckpointError, match="flashgpt 9.0.*upgrade"):
        ck.resume(str(tmp_path / "checkpoints" / "corrupt-step_00000030"), FakeEngine())


def test_incompatible_checkpoint_stops_instead_of_falling_back(tmp_path):
    ck = saved(tmp_path)

    def check(client, path):
        raise IncompatibleCheckpoint(f"{path} holds a model of another shape")

    with pytest.raises(IncompatibleCheckpoint, match="step_00000030 holds a model of another shape"):
        ck.resume("auto", FakeEngine(), check)
    assert len(ck.complete()) == 3  # nothing moved aside


# --- part 3: one run per run folder ------------------------------------------------------------------
def test_second_lock_names_the_holder(tmp_path):
    with RunLock(tmp_path):
        with pytest.raises(RunFolderBusy, match=f"in use by pid {os.getpid()} on host .*run_name"):
            RunLock(tmp_path).acquire()
    RunLock(tmp_path).acquire().release()  # free again once released


def test_lock_of_a_dead_process_is_taken_over_with_a_warning(tmp_path, caplog):
    code = ("import sys, os; sys.path.insert(0, sys.argv[2]); from training.resilience.run_folder import RunLock; "
            "RunLock(sys.argv[1]).acquire(); os._exit(0)")  # exits holding the lock, never releasing
    repo = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code, str(tmp_path), str(repo)], check=True)
    dead = json.loads((tmp_path / ".lock").read_text())
    with caplog.at_level(logging.WARNING):
        lock = RunLock(tmp_path).acquire()
    lock.release()
    assert f"left by pid {dead['pid']}" in caplog.text and "no longer running" in caplog.text


def test_move_aside_keeps_everything(tmp_path):
    saved(tmp_path, steps=(1,))
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with RunLock(tmp_path):
        aside = move_aside(tmp_path)
    assert aside.name.startswith("replaced-") and (aside / "checkpoints" / "step_00000001").is_dir()
    assert (aside / "metrics.jsonl").is_file() and not (tmp_path / "checkpoints").exists()
