"""manifest.json: the size and hash of every file of a checkpoint folder, plus the facts resume reads
before it opens any other file (format version, the project version that wrote it, write sequence).

    {"version": 2, "algorithm": "xxh3_128", "format_version": 2, "written_by": "flashgpt 0.1.0",
     "sequence": 7, "files": {"engine.pt": {"size": 123, "hash": "..."}, "dcp/__0_0.distcp": {...}}}

Hash: xxh3-128 (the `xxhash` package, a dependency of `datasets`) runs at ~20 GB/s on one core, so
hashing a multi-GB checkpoint costs a re-read from the page cache, small beside the write; files are
hashed in parallel threads. It detects truncation and corruption, not tampering: a checkpoint is data
from a trusted place (our own files load with torch.load(weights_only=True); DeepSpeed's and torch
DCP's formats unpickle, README "Checkpoints").
"""
from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Optional, Tuple

MANIFEST = "manifest.json"
ALGORITHMS = ("xxh3_128", "sha256")
CHUNK = 8 << 20  # bytes read per hash update
# Folders a checkpoint gains after it was written, rebuilt from its verified files before each use
# (DeepSpeed's universal conversion, for a resume on another rank count): not in the manifest.
DERIVED = ("deepspeed_universal",)


def default_algorithm() -> str:
    try:
        import xxhash  # noqa: F401
        return "xxh3_128"
    except ImportError:  # slower, same format
        return "sha256"


def hash_file(path: Path, algorithm: str, fsync: bool = False) -> Tuple[int, str]:
    """(size in bytes, hex digest); fsync the file too when asked (saves)."""
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


def files_of(folder: Path) -> list:
    """Every file under folder (sub-folders included) except the manifest and derived folders, as
    sorted POSIX relative paths."""
    out = []
    for p in folder.rglob("*"):
        rel = p.relative_to(folder)
        if p.is_file() and rel.as_posix() != MANIFEST and not rel.parts[0].startswith(DERIVED):
            out.append(rel.as_posix())
    return sorted(out)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _map(fn, items: list, threads: int) -> list:
    with ThreadPoolExecutor(max(1, min(threads, len(items)))) as pool:
        return list(pool.map(fn, items))


def write_manifest(folder: Path, facts: dict, threads: int = 8) -> None:
    """Hash (and fsync) every file, write manifest.json with `facts` (format_version, written_by,
    sequence), then fsync the folders."""
    algorithm = default_algorithm()
    names = files_of(folder)
    results = _map(lambda n: hash_file(folder / n, algorithm, fsync=True), names, threads)
    files = {n: {"size": s, "hash": h} for n, (s, h) in zip(names, results)}
    with open(folder / MANIFEST, "w") as f:
        json.dump({"version": 2, "algorithm": algorithm, **facts, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    for sub in sorted({(folder / n).parent for n in names} | {folder}, reverse=True):
        fsync_dir(sub)


class ManifestMissing(Exception):
    """The folder has no manifest.json: nothing to verify it against."""


def read_manifest(folder: Path) -> dict:
    """The parsed manifest, checked for shape: raises ManifestMissing when absent, ValueError naming
    what is malformed (unreadable JSON, no files, an unknown algorithm, a path outside the folder)."""
    path = folder / MANIFEST
    if not path.is_file():
        raise ManifestMissing(str(path))
    try:
        manifest = json.loads(path.read_text())
    except (ValueError, OSError) as e:
        raise ValueError(f"unreadable {MANIFEST}: {e}") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"{MANIFEST} is not a JSON object")
    files, algorithm = manifest.get("files"), manifest.get("algorithm")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"{MANIFEST} names an unknown hash algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})")
    if not isinstance(files, dict) or not files:
        raise ValueError(f"{MANIFEST} lists no files")
    for name, want in files.items():
        rel = PurePosixPath(name)
        if rel.is_absolute() or ".." in rel.parts or not rel.parts or "\\" in name:
            raise ValueError(f"{MANIFEST} names a path outside the checkpoint folder: {name!r}")
        if not (isinstance(want, dict) and isinstance(want.get("size"), int) and isinstance(want.get("hash"), str)):
            raise ValueError(f"{MANIFEST} has a malformed entry for {name!r}")
    return manifest


def verify(folder: Path, threads: int = 8) -> Optional[str]:
    """None when the manifest is well formed and every file of the folder is listed in it with its
    size and hash; else what is wrong. Raises ManifestMissing when there is no manifest."""
    try:
        manifest = read_manifest(folder)
    except ValueError as e:
        return str(e)
    files, algorithm = manifest["files"], manifest["algorithm"]
    for name, want in files.items():  # sizes first: cheap, and catch truncation
        try:
            size = (folder / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if size != want["size"]:
            return f"{name} has {size} bytes, the manifest says {want['size']} (truncated?)"
    extra = sorted(set(files_of(folder)) - set(files))
    if extra:
        return f"{extra[0]} is not in the manifest (a file added after the save)"
    names = list(files)
    got = _map(lambda n: hash_file(folder / n, algorithm)[1], names, threads)
    for name, digest in zip(names, got):
        if digest != files[name]["hash"]:
            return f"{name} does not match its {algorithm} checksum (corrupted)"
    return None
