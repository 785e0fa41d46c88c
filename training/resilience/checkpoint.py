"""Atomic, verified checkpoints: keep-last-k by write order, auto-resume that falls back past damaged
ones, and loads that run no code.

Layout under <run_dir>/checkpoints/:
    step_00000100/            one complete checkpoint (never modified after its rename)
        engine.pt ...         the engine's files (model, optimizer, LR schedule; any names, any
                              sub-folders), written by engine.save
        client.pt             step, tokens seen, resolved config, W&B run id, world size, format
        rank00000.pt ...      per rank: loader state and RNG states (python, numpy, torch, cuda)
        manifest.json         size and hash of every other file, format version, the project version
                              that wrote it, write sequence number (training/resilience/manifest.py); written last
    latest                    text file naming the newest complete checkpoint, written last
    corrupt-step_*/           checkpoints that failed to verify or load, moved aside by auto-resume
A save writes into a hidden `.tmp-*` folder, hashes + fsyncs every file, writes the manifest, renames
the folder into place, then rewrites `latest` (temp + rename) and prunes old ones (renamed to
`.trash-*`, then removed): a crash at any moment leaves the last good checkpoint intact, and the next
start removes the leftovers. A failed write (disk full, permissions) removes the temp folder and
raises CheckpointError on every rank, naming the folder and the cause.

Our own files (client.pt, rank*.pt, engine.pt of the torch engine) load with weights_only=True: a
checkpoint is data, and a pickled payload in it fails to load (counted as damage) instead of running.
"""
from __future__ import annotations

import logging
import os
import pickle
import random
import shutil
import time
import warnings
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as tdist

from training.distributed import DistInfo
from training.resilience import faults
from training.resilience.manifest import ManifestMissing, fsync_dir, read_manifest, verify, write_manifest

log = logging.getLogger(__name__)

# 2: manifest.json carries format_version / written_by / sequence; RNG states are tensors and lists
FORMAT_VERSION = 2
POINTER = "latest"


def project_version() -> str:
    try:
        from importlib.metadata import version
        return f"flashgpt {version('flashgpt')}"
    except Exception:  # not installed (run from a bare checkout)
        return "flashgpt (uninstalled checkout)"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written, read or used by this run; the message names the folder,
    the cause and the fix."""


class CheckpointNotFound(CheckpointError, FileNotFoundError):
    pass


class IncompatibleCheckpoint(CheckpointError):
    """An intact checkpoint of another model or data: every checkpoint of the run would say the same,
    so resume stops instead of falling back."""


def load_data(path: Path, map_location="cpu"):
    """torch.load of one of our checkpoint files with weights_only=True. Format-1 rank files hold
    numpy's RNG state as a pickled array: numpy's array reconstructors are allowed (data only)."""
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy 1
        from numpy.core.multiarray import _reconstruct
    legacy = [np.ndarray, np.dtype, type(np.dtype(np.uint32)), _reconstruct,
              (_reconstruct, "numpy.core.multiarray._reconstruct")]  # the name numpy 1 pickled
    with torch.serialization.safe_globals(legacy), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected pickle protocol")  # a refused foreign pickle
        return torch.load(path, map_location=map_location, weights_only=True)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rng_state() -> dict:
    """This process's RNG states as tensors, ints and tuples (loadable with weights_only=True)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(),
             "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    if isinstance(numpy_state, (list, tuple)) and isinstance(numpy_state[1], torch.Tensor):
        name, keys, pos, has_gauss, gauss = numpy_state
        numpy_state = (name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss)
    np.random.set_state(numpy_state)  # else a format-1 tuple holding an ndarray
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _describe(e: BaseException) -> str:
    """'ENOSPC: No space left on device: /path' for OS errors; 'Type: first line of the message'
    otherwise (torch's unpickling errors run to a page)."""
    if isinstance(e, OSError) and e.errno:
        import errno
        where = f": {e.filename}" if e.filename else ""
        return f"{errno.errorcode.get(e.errno, e.errno)}: {e.strerror}{where}"
    if isinstance(e, pickle.UnpicklingError) and "weights_only" in str(e):
        return ("UnpicklingError: it holds objects other than tensors and plain data, which "
                "torch.load(weights_only=True) refuses without running them")
    first = next((line for line in str(e).splitlines() if line.strip()), "")
    return f"{type(e).__name__}: {first}"


def on_main(dist: DistInfo, fn: Callable[[], object]):
    """Run fn on rank 0 and hand its result (or its error, as CheckpointError) to every rank, so no
    rank waits in a collective that rank 0 will never reach."""
    if not dist.enabled:
        return fn()
    box = [None]
    if dist.is_main:
        try:
            box[0] = ("ok", fn())
        except Exception as e:
            box[0] = ("error", (type(e).__name__, str(e) if isinstance(e, CheckpointError) else _describe(e)))
            tdist.broadcast_object_list(box, src=0)
            raise
    tdist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise (IncompatibleCheckpoint if value[0] == "IncompatibleCheckpoint" else CheckpointError)(value[1])
    return value


class Checkpointer:
    def __init__(self, run_dir: Path, keep_last: int, dist: DistInfo, accept_unverified: bool = False):
        self.root = Path(run_dir) / "checkpoints"
        self.keep_last, self.dist = keep_last, dist
        self.accept_unverified = accept_unverified  # train.resume_unverified: folders without a manifest

    def name(self, step: int) -> str:
        return f"step_{step:08d}"

    def complete(self) -> list:
        """Complete checkpoint folders (renamed into place), oldest first by write sequence."""
        if not self.root.is_dir():
            return []
        done = [p for p in self.root.glob("step_*") if p.is_dir() and (p / "client.pt").is_file()]
        return sorted(done, key=lambda p: (self._sequence(p), p.name))

    @staticmethod
    def _sequence(path: Path) -> int:
        """The write sequence number from the manifest; -1 for folders without one (they then order by
        step, before every numbered one)."""
        try:
            return int(read_manifest(path).get("sequence", -1))
        except (ManifestMissing, ValueError, TypeError):
            return -1

    def _pointer_target(self) -> Optional[Path]:
        pointer = self.root / POINTER
        try:
            name = pointer.read_text().strip()
        except OSError:
            return None
        return self.root / name if name else None

    def remove_leftovers(self) -> List[str]:
        """Temporary folders of crashed saves and half-removed pruned ones (call with the run folder's
        lock held: then no other run is writing them). Returns the names removed."""
        if not self.root.is_dir():
            return []
        gone = []
        for p in sorted(self.root.iterdir()):
            if p.name.startswith((".tmp-", ".trash-", f".{POINTER}.tmp-")):
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
                gone.append(p.name)
        return gone

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
            faults.reach("ckpt_write", step, rank)  # tests only
            if self.dist.is_main:
                torch.save({**client_state, "format_version": FORMAT_VERSION, "step": step,
                            "world_size": self.dist.world_size}, tmp / "client.pt")

        def commit():
            if not self.dist.is_main:
                return
            sequence = 1 + max([self._sequence(p) for p in self.complete()], default=0)
            write_manifest(tmp, {"format_version": FORMAT_VERSION, "written_by": project_version(),
                                 "sequence": sequence, "step": step})
            if final.exists():  # same step saved by an earlier, abandoned attempt
                self._remove(final)
            os.replace(tmp, final)
            fsync_dir(self.root)
            faults.reach("ckpt_commit", step, rank)  # tests only
            _atomic_write_text(self.root / POINTER, final.name + "\n")
            self._prune(final)

        for fn in (prepare, write, commit):
            self._phase(fn, final, tmp)
        return final

    def _remove(self, path: Path) -> None:
        """Rename out of the step_* namespace first (atomic), then delete: a crash mid-delete leaves a
        `.trash-*` folder that the next start removes, never a half-deleted step_* folder."""
        trash = path.parent / f".trash-{path.name}-{time.time_ns()}"
        os.replace(path, trash)
        shutil.rmtree(trash, ignore_errors=True)

    def _prune(self, just_written: Path) -> None:
        """Keep the keep_last newest checkpoints by write sequence (not by step: a run restarted from an
        earlier step writes smaller step numbers), and always the one just written and the one
        `latest` names."""
        done = self.complete()
        keep = set(done[-self.keep_last:]) | {just_written, self._pointer_target()}
        for old in done:
            if old not in keep:
                self._remove(old)

    # --- resume -----------------------------------------------------------------------------------
    def _candidates(self) -> list:
        """auto-resume order: the checkpoint `latest` names, then older ones by write sequence, newest
        first. Folders written after `latest` come from a crash between the rename and the pointer
        update (or an abandoned branch): redoing those steps from `latest` gives the same result.
        Without a usable pointer: every complete folder, newest first, with a warning."""
        done = self.complete()
        target = self._pointer_target()
        if target in done:  # then the older ones (all others when the target's manifest is unreadable)
            seq = self._sequence(target)
            older = [p for p in done if p != target and (seq < 0 or self._sequence(p) < seq)]
            return [target, *older[::-1]]
        if done:
            what = f"`{POINTER}` names {target.name}, which is not a complete checkpoint" if target else \
                f"there is no `{POINTER}` pointer"
            log.warning(f"{what} in {self.root}: resuming from the newest checkpoint by write order that "
                        f"verifies, starting with {done[-1].name}")
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

    def _check_folder(self, path: Path) -> Optional[str]:
        """Rank 0: None when `path` may be loaded, else why it is damaged. The manifest is read before
        any other file: a newer format is reported with the project version that wrote it. A folder
        without a manifest stops the run (CheckpointError) unless train.resume_unverified=true."""
        try:
            manifest = read_manifest(path)
        except ManifestMissing:
            if not (path / "client.pt").is_file():
                return "no client.pt and no manifest.json: not a checkpoint folder"
            if self.accept_unverified:
                log.warning(f"{path} has no manifest.json: loading it unverified (train.resume_unverified=true)")
                return None
            raise CheckpointError(
                f"{path} has no manifest.json, so nothing can verify its files; if it comes from a place you "
                f"trust (an older version of this project wrote it), rerun with train.resume_unverified=true, "
                f"else start a new run (train.run_name=...)") from None
        except ValueError as e:
            return str(e)
        fmt = manifest.get("format_version", 1)
        if not isinstance(fmt, int) or fmt > FORMAT_VERSION:
            return (f"written by {manifest.get('written_by', 'an unknown version')} in checkpoint format {fmt}, "
                    f"newer than this checkout's {FORMAT_VERSION}; upgrade this checkout to resume it")
        return verify(path)

    def _try_load(self, path: Path, engine, check: Callable[[dict, Path], None]):
        """This rank's load: (("ok", (client, rank_state)) | ("incompatible", msg) | ("damaged", msg))."""
        try:
            client = load_data(path / "client.pt")
            if not isinstance(client, dict):
                raise ValueError("client.pt does not hold a dict")
            if client.get("format_version", 0) > FORMAT_VERSION:
                raise ValueError(f"client.pt has format {client['format_version']} > {FORMAT_VERSION} (a newer "
                                 f"version wrote it); upgrade this checkout")
            check(client, path)
            saved_ranks = client["world_size"]
            engine.load(path)
            # Loader positions are global, so any rank's file continues the data order; on a new rank
            # count, ranks without a file of their own read rank 0's and the trainer re-seeds their RNG.
            own = path / f"rank{self.dist.rank:05d}.pt"
            rank_state = load_data(own if saved_ranks == self.dist.world_size else path / "rank00000.pt")
            rank_state["resharded_from"] = saved_ranks if saved_ranks != self.dist.world_size else None
            return "ok", (client, rank_state)
        except IncompatibleCheckpoint as e:
            return "incompatible", str(e)
        except Exception as e:  # unpickling refused, truncated, a missing key, a shape mismatch...
            return "damaged", f"loading it failed: {_describe(e)}"

    def _agree(self, outcome: tuple) -> tuple:
        """Every rank's load outcome -> one verdict for all: incompatible wins, then damaged."""
        if not self.dist.enabled:
            return outcome
        kinds = [None] * self.dist.world_size
        tdist.all_gather_object(kinds, outcome[0] if outcome[0] == "ok" else outcome)
        for kind in ("incompatible", "damaged"):
            for rank, o in enumerate(kinds):
                if o != "ok" and o[0] == kind:
                    return kind, f"rank {rank}: {o[1]}"
        return outcome

    def resume(self, resume: str, engine, check: Callable[[dict, Path], None] = lambda c, p: None
               ) -> Optional[Tuple[Path, dict, dict]]:
        """train.resume: 'none' -> None; 'auto' -> the checkpoint `latest` names, falling back (with a
        warning naming both) past any that fails to verify or load, or None when there is none; else
        that path, which must verify and load. Every file read loads as data (weights_only). `check`
        (the trainer's: same model and data) raises IncompatibleCheckpoint to stop the run.
        Returns (path, client state, this rank's state)."""
        if resume == "none":
            return None
        explicit = resume != "auto"
        if explicit and not (Path(resume) / "client.pt").is_file():
            raise CheckpointNotFound(f"train.resume={resume}: no checkpoint there (no client.pt); point it at "
                                     f"a step_* folder or use train.resume=auto")
        candidates = [Path(resume)] if explicit else on_main(self.dist, self._candidates)
        bad = []
        for path in candidates:
            reason = on_main(self.dist, lambda: self._check_folder(path))
            loaded = None
            if reason is None:
                kind, value = self._agree(self._try_load(path, engine, check))
                if kind == "incompatible":
                    raise IncompatibleCheckpoint(value)
                reason, loaded = (value, None) if kind == "damaged" else (None, value)
            if loaded is not None:
                if self.dist.is_main:
                    for old, why in bad:
                        log.warning(f"checkpoint {old} is damaged ({why}); resuming from {path} instead"
                                    + self._quarantine(old))
                    if bad:
                        _atomic_write_text(self.root / POINTER, path.name + "\n")
                return (path, *loaded)
            if explicit:
                raise CheckpointError(f"train.resume={resume}: {path} is damaged ({reason}); point it at another "
                                      f"step_* folder, or use train.resume=auto, which falls back to the newest "
                                      f"intact checkpoint")
            bad.append((path, reason))
        if bad:  # left in place: a fix (an upgrade, a restored file) may make them load
            raise CheckpointError(
                f"no intact checkpoint in {self.root} (" + "; ".join(f"{p.name}: {r}" for p, r in bad)
                + "). Nothing was changed: to start this run over, rerun with train.resume=none "
                  "train.overwrite=true (the old files are moved to a dated folder), or choose a new "
                  "train.run_name")
        return None

    def resolve(self, resume: str) -> Optional[Path]:
        """The checkpoint train.resume would pick, verified but not loaded (tests, tools)."""
        if resume == "none":
            return None
        if resume != "auto":
            if not (Path(resume) / "client.pt").is_file():
                raise CheckpointNotFound(f"train.resume={resume}: no checkpoint there (no client.pt)")
            reason = self._check_folder(Path(resume))
            if reason:
                raise CheckpointError(f"train.resume={resume}: {resume} is damaged ({reason})")
            return Path(resume)
        for path in self._candidates():
            if self._check_folder(path) is None:
                return path
        return None
