"""Atomic, verified checkpoints with keep-last-k and auto-resume that falls back past damaged ones.

Layout under <run_dir>/checkpoints/:
    step_00000100/            one complete checkpoint (never modified after its rename)
        engine.pt ...         the engine's files (model, optimizer, LR schedule; any names, any
                              sub-folders), written by engine.save
        client.pt             step, tokens seen, resolved config, W&B run id, world size, format
        rank00000.pt ...      per rank: loader state and RNG states (python, numpy, torch, cuda)
        manifest.json         size and xxh3-128 hash of every other file in the folder, written last
    latest                    text file naming the newest complete checkpoint, written last
    corrupt-step_*/           damaged checkpoints that auto-resume moved aside (kept for inspection)
A save writes into a hidden `.tmp-*` folder, hashes + fsyncs every file, writes the manifest, renames
the folder into place, then rewrites `latest` (temp + rename) and prunes old ones: a crash at any
moment leaves the last good checkpoint intact. A failed write (disk full, permissions) removes the
temp folder and raises CheckpointError on every rank, naming the folder and the cause.

Hash: xxh3-128 (the `xxhash` package, a dependency of `datasets`) runs at ~20 GB/s on one core, so
hashing a multi-GB checkpoint costs a re-read from the page cache plus well under a second per
10 GB, small beside the write itself; files are hashed in parallel threads. Resume verifies sizes,
then hashes, on rank 0 only, and broadcasts its choice.
"""
from __future__ import annotations

import json
import logging
import os
import random
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional, Tuple

import numpy as np
import torch
import torch.distributed as tdist

from training import faults
from training.distributed import DistInfo

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
POINTER = "latest"
MANIFEST = "manifest.json"
CHUNK = 8 << 20  # bytes read per hash update


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written, read or used by this run; the message names the folder,
    the cause and the fix."""


class CheckpointNotFound(CheckpointError, FileNotFoundError):
    pass


# --- hashing and the manifest ---------------------------------------------------------------------
def _hasher():
    try:
        import xxhash
        return "xxh3_128", xxhash.xxh3_128
    except ImportError:  # a slower fallback, same format
        import hashlib
        return "sha256", hashlib.sha256


def _hash_file(path: Path, algorithm: str, fsync: bool = False) -> Tuple[int, str]:
    if algorithm == "xxh3_128":
        import xxhash
        h = xxhash.xxh3_128()
    else:
        import hashlib
        h = hashlib.new(algorithm)
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
        if fsync:
            os.fsync(f.fileno())
    return size, h.hexdigest()


def _files(folder: Path) -> list:
    """Every file under folder (sub-folders included) except the manifest, as sorted relative paths."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(folder: Path, threads: int = 8) -> None:
    """Hash (and fsync) every file, then write manifest.json and fsync the folders."""
    algorithm, _ = _hasher()
    names = _files(folder)
    with ThreadPoolExecutor(max(1, min(threads, len(names)))) as pool:
        results = list(pool.map(lambda n: _hash_file(folder / n, algorithm, fsync=True), names))
    files = {n: {"size": s, "hash": h} for n, (s, h) in zip(names, results)}
    with open(folder / MANIFEST, "w") as f:
        json.dump({"version": 1, "algorithm": algorithm, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    for sub in sorted({(folder / n).parent for n in names} | {folder}, reverse=True):
        _fsync_dir(sub)


def verify(folder: Path, threads: int = 8) -> Optional[str]:
    """None when every file in the manifest is there with its size and hash; else what is wrong.
    Checkpoints written before manifests existed pass with a warning (nothing to check against)."""
    path = folder / MANIFEST
    if not path.is_file():
        if (folder / "client.pt").is_file():
            log.warning(f"{folder} has no {MANIFEST} (written before checksums): loading it unverified")
            return None
        return "no client.pt"
    try:
        manifest = json.loads(path.read_text())
        files, algorithm = manifest["files"], manifest["algorithm"]
    except (ValueError, KeyError, OSError) as e:
        return f"unreadable {MANIFEST}: {e}"
    for name, want in files.items():  # sizes first: cheap, and catch truncation
        try:
            size = (folder / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if size != want["size"]:
            return f"{name} has {size} bytes, the manifest says {want['size']} (truncated?)"
    names = list(files)
    with ThreadPoolExecutor(max(1, min(threads, len(names)))) as pool:
        got = list(pool.map(lambda n: _hash_file(folder / n, algorithm)[1], names))
    for name, digest in zip(names, got):
        if digest != files[name]["hash"]:
            return f"{name} does not match its {algorithm} checksum (corrupted)"
    return None


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


def _describe(e: BaseException) -> str:
    """'ENOSPC: No space left on device: /path' for OS errors; 'Type: message' otherwise."""
    if isinstance(e, OSError) and e.errno:
        import errno
        where = f": {e.filename}" if e.filename else ""
        return f"{errno.errorcode.get(e.errno, e.errno)}: {e.strerror}{where}"
    return f"{type(e).__name__}: {e}"


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

    # --- save -------------------------------------------------------------------------------------
    def _any_failed(self, failure: Optional[str]) -> list:
        """Collective: every rank learns every rank's failure (a 1-element MAX all-reduce; the
        messages are gathered only when something failed)."""
        if not self.dist.enabled:
            return [f"{failure}"] if failure else []
        flag = torch.tensor([1.0 if failure else 0.0], device=self.dist.device)
        tdist.all_reduce(flag, op=tdist.ReduceOp.MAX)
        if flag.item() == 0:
            return []
        msgs = [None] * self.dist.world_size
        tdist.all_gather_object(msgs, failure)
        return [f"rank {r}: {m}" for r, m in enumerate(msgs) if m]

    def _phase(self, fn: Callable[[], None], final: Path, tmp: Path) -> None:
        """Run this rank's part of a save, then agree with the others; on any failure clean up and raise."""
        failure = cause = None
        try:
            fn()
        except Exception as e:  # torch.save reports a full disk as RuntimeError: catch all
            failure, cause = _describe(e), e
        msgs = self._any_failed(failure)
        if not msgs:
            return
        if self.dist.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        good = self.complete()
        try:
            free = f"{shutil.disk_usage(self.root).free / 2**30:.2f} GiB free on that file system; "
        except OSError:
            free = ""
        err = CheckpointError(
            f"could not save checkpoint {final} ({'; '.join(msgs)}). {free}the last good checkpoint "
            f"({good[-1] if good else 'none'}) is intact and the temporary folder was removed. Free disk "
            f"space or fix permissions on {self.root}, then rerun the same command to resume")
        raise err from cause

    def save(self, step: int, engine, client_state: dict, rank_state: dict) -> Path:
        """Every rank calls this at the same step (it holds three agreement points)."""
        final = self.root / self.name(step)
        tmp = self.root / f".tmp-{self.name(step)}"
        rank = self.dist.rank

        def prepare():
            if self.dist.is_main:
                self.root.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save
                tmp.mkdir()

        def write():
            engine.save(tmp)
            torch.save(rank_state, tmp / f"rank{rank:05d}.pt")
            faults.maybe_kill("ckpt_write", step, rank)
            if self.dist.is_main:
                torch.save({**client_state, "format_version": FORMAT_VERSION, "step": step,
                            "world_size": self.dist.world_size}, tmp / "client.pt")

        def commit():
            if not self.dist.is_main:
                return
            write_manifest(tmp)
            if final.exists():  # same step saved by an earlier, abandoned attempt
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(self.root)
            faults.maybe_kill("ckpt_commit", step, rank)
            _atomic_write_text(self.root / POINTER, final.name + "\n")
            self._prune()

        for fn in (prepare, write, commit):
            self._phase(fn, final, tmp)
        return final

    def _prune(self) -> None:
        done = self.complete()
        for old in done[: max(0, len(done) - self.keep_last)]:
            shutil.rmtree(old, ignore_errors=True)

    # --- resolve ----------------------------------------------------------------------------------
    def _candidates(self) -> list:
        """auto-resume order: the `latest` target, then older complete ones, newest first. Folders
        newer than `latest` come from a crash between rename and pointer, or an abandoned branch."""
        done = self.complete()
        pointer = self.root / POINTER
        if pointer.is_file():
            target = self.root / pointer.read_text().strip()
            if target in done:
                done = done[: done.index(target) + 1]
        return done[::-1]

    def _quarantine(self, path: Path) -> str:
        """Move a damaged checkpoint out of the step_* namespace (so pruning and the next resume
        ignore it), keeping it for inspection."""
        aside = path.parent / f"corrupt-{path.name}"
        try:
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(path, aside)
            return f" (the damaged one is kept as {aside})"
        except OSError as e:
            return f" (could not move it aside: {_describe(e)})"

    def _resolve_main(self, resume: str) -> Optional[Path]:
        if resume != "auto":
            path = Path(resume)
            if not (path / "client.pt").is_file():
                raise CheckpointNotFound(f"train.resume={resume}: no checkpoint there (no client.pt); "
                                         f"point it at a step_* folder or use train.resume=auto")
            reason = verify(path)
            if reason:
                raise CheckpointError(f"train.resume={resume}: {path} is damaged ({reason}); point it at "
                                      f"another step_* folder, or use train.resume=auto, which falls back "
                                      f"to the newest intact checkpoint")
            return path
        bad = []
        for path in self._candidates():
            reason = verify(path)
            if reason is None:
                for old, why in bad:
                    log.warning(f"checkpoint {old} is damaged ({why}); resuming from {path} instead"
                                + self._quarantine(old))
                if bad:
                    _atomic_write_text(self.root / POINTER, path.name + "\n")
                return path
            bad.append((path, reason))
        if bad:
            raise CheckpointError(f"no intact checkpoint in {self.root} ("
                                  + "; ".join(f"{p.name}: {r}" for p, r in bad)
                                  + "); start over with train.resume=none or a new train.run_name")
        return None

    def resolve(self, resume: str) -> Optional[Path]:
        """train.resume: 'none' -> None; 'auto' -> the newest intact checkpoint (falling back past
        damaged ones, with a warning) or None; else that path (verified). Rank 0 decides for all."""
        if resume == "none":
            return None
        if not self.dist.enabled:
            return self._resolve_main(resume)
        box = [None]
        if self.dist.is_main:
            try:
                path = self._resolve_main(resume)
                box[0] = ("ok", None if path is None else str(path))
            except Exception as e:  # tell the other ranks, or they wait in the broadcast forever
                box[0] = ("error", str(e) if isinstance(e, CheckpointError) else _describe(e))
                tdist.broadcast_object_list(box, src=0)
                raise
        tdist.broadcast_object_list(box, src=0)
        kind, value = box[0]
        if kind == "error":
            raise CheckpointError(value)
        return None if value is None else Path(value)

    # --- load -------------------------------------------------------------------------------------
    def load(self, path: Path, engine) -> Tuple[dict, dict]:
        """Load engine state; return (client_state, this rank's state)."""
        client = torch.load(path / "client.pt", map_location="cpu", weights_only=False)
        if client.get("format_version", 0) > FORMAT_VERSION:
            raise CheckpointError(f"{path} was written by a newer version (format "
                                  f"{client['format_version']} > {FORMAT_VERSION}); upgrade this checkout")
        saved_ranks = client["world_size"]
        engine.load(path)
        # Loader positions are global, so any rank's file continues the data order; on a new rank
        # count, ranks without a file of their own read rank 0's and the trainer re-seeds their RNG.
        own = path / f"rank{self.dist.rank:05d}.pt"
        rank_file = own if saved_ranks == self.dist.world_size else path / "rank00000.pt"
        rank_state = torch.load(rank_file, map_location="cpu", weights_only=False)
        rank_state["resharded_from"] = saved_ranks if saved_ranks != self.dist.world_size else None
        return client, rank_state
