"""Atomic checkpoints with keep-last-k and auto-resume.

Layout under <run_dir>/checkpoints/:
    step_00000100/            one complete checkpoint (never modified after its rename)
        engine.pt             the engine's files (model, optimizer, LR schedule), written by the engine
        client.pt             step, tokens seen, resolved config, W&B run id, world size, format
        rank00000.pt ...      per rank: loader state and RNG states (python, numpy, torch, cuda)
    latest                    text file naming the newest complete checkpoint, written last
A save writes into a hidden `.tmp-*` folder, fsyncs, renames it into place, then rewrites `latest`
(temp + rename) and prunes old ones: a crash at any moment leaves the last good checkpoint intact.
"""
from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Optional, Tuple

import numpy as np
import torch

from training.distributed import DistInfo

FORMAT_VERSION = 1
POINTER = "latest"


def _fsync_tree(directory: Path) -> None:
    for path in sorted(directory.iterdir()):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Checkpointer:
    def __init__(self, run_dir: Path, keep_last: int, dist: DistInfo):
        self.root = Path(run_dir) / "checkpoints"
        self.keep_last, self.dist = keep_last, dist

    def name(self, step: int) -> str:
        return f"step_{step:08d}"

    def complete(self) -> list:
        """Complete checkpoint folders, oldest first."""
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.glob("step_*") if p.is_dir() and (p / "client.pt").is_file())

    def save(self, step: int, engine, client_state: dict, rank_state: dict) -> Path:
        """Every rank calls this at the same step (it holds two barriers)."""
        final = self.root / self.name(step)
        tmp = self.root / f".tmp-{self.name(step)}"
        if self.dist.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save
            tmp.mkdir()
        self.dist.barrier()
        engine.save(tmp)
        torch.save(rank_state, tmp / f"rank{self.dist.rank:05d}.pt")
        if self.dist.is_main:
            torch.save({**client_state, "format_version": FORMAT_VERSION, "step": step,
                        "world_size": self.dist.world_size}, tmp / "client.pt")
        self.dist.barrier()  # all ranks' files are in tmp
        if self.dist.is_main:
            _fsync_tree(tmp)
            if final.exists():  # same step saved by an earlier, abandoned attempt
                shutil.rmtree(final)
            os.replace(tmp, final)
            _atomic_write_text(self.root / POINTER, final.name + "\n")
            self._prune()
        self.dist.barrier()
        return final

    def _prune(self) -> None:
        done = self.complete()
        for old in done[: max(0, len(done) - self.keep_last)]:
            shutil.rmtree(old, ignore_errors=True)

    def resolve(self, resume: str) -> Optional[Path]:
        """train.resume: 'none' -> None; 'auto' -> the newest complete checkpoint or None; else a path."""
        if resume == "none":
            return None
        if resume != "auto":
            path = Path(resume)
            if not (path / "client.pt").is_file():
                raise FileNotFoundError(f"train.resume={resume}: no checkpoint there (no client.pt); "
                                        f"point it at a step_* folder or use train.resume=auto")
            return path
        pointer = self.root / POINTER
        if pointer.is_file():
            path = self.root / pointer.read_text().strip()
            if (path / "client.pt").is_file():
                return path
        done = self.complete()
        return done[-1] if done else None

    def load(self, path: Path, engine) -> Tuple[dict, dict]:
        """Load engine state; return (client_state, this rank's state)."""
        client = torch.load(path / "client.pt", map_location="cpu", weights_only=False)
        if client.get("format_version", 0) > FORMAT_VERSION:
            raise RuntimeError(f"{path} was written by a newer version (format "
                               f"{client['format_version']} > {FORMAT_VERSION}); upgrade this checkout")
        if client["world_size"] != self.dist.world_size:
            raise RuntimeError(
                f"{path} was saved with {client['world_size']} ranks, this run has "
                f"{self.dist.world_size}; resume with the same number of processes")
        engine.load(path)
        rank_file = path / f"rank{self.dist.rank:05d}.pt"
        rank_state = torch.load(rank_file, map_location="cpu", weights_only=False)
        return client, rank_state
