"""Token shards on disk: flat little-endian binary files plus one meta.json per prepared folder.

Layout of a prepared folder (what `prepare` writes, what `PackedLoader` reads):
  meta.json            format version, tokenizer hash/vocab/eos, dtype, per split: tokens, docs, shards
  tokenizer.json       the tokenizer that produced the ids
  train_000000.bin     at most `shard_tokens` ids each, dtype uint16 (vocab <= 65536) else uint32;
  val_000000.bin       a split is the concatenation of its shards in order, EOS after every document
Documents may cross shard boundaries: readers see one stream per split.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import numpy as np

from data.errors import DataError

FORMAT_VERSION = 1
META = "meta.json"
SHARD_TOKENS = 1 << 26  # 64 Mi tokens per shard: 128 MiB as uint16


def dtype_for(vocab_size: int) -> str:
    """Smallest unsigned type holding ids 0..vocab_size-1."""
    return "uint16" if vocab_size <= (1 << 16) else "uint32"


def np_dtype(name: str) -> np.dtype:
    return np.dtype({"uint16": "<u2", "uint32": "<u4"}[name])  # fixed byte order on disk


class ShardWriter:
    """Streams token ids of one split into `{split}_{i:06d}.bin` files of at most `shard_tokens` ids."""

    def __init__(self, folder: Path, split: str, dtype: str, shard_tokens: int = SHARD_TOKENS):
        self.folder, self.split, self.shard_tokens = folder, split, shard_tokens
        self.dtype = np_dtype(dtype)
        self.shards: List[dict] = []  # {"file", "n_tokens"}
        self.n_tokens, self.max_id = 0, -1
        self._f = None

    def write(self, ids: np.ndarray) -> None:
        if ids.size == 0:
            return
        self.max_id = max(self.max_id, int(ids.max()))
        ids = ids.astype(self.dtype, copy=False)  # caller checked ids < vocab, so this cannot wrap
        while ids.size:
            if self._f is None or self.shards[-1]["n_tokens"] == self.shard_tokens:
                self._open_next()
            room = self.shard_tokens - self.shards[-1]["n_tokens"]
            chunk, ids = ids[:room], ids[room:]
            chunk.tofile(self._f)
            self.shards[-1]["n_tokens"] += int(chunk.size)
            self.n_tokens += int(chunk.size)

    def _open_next(self) -> None:
        if self._f is not None:
            self._f.close()
        name = f"{self.split}_{len(self.shards):06d}.bin"
        self._f = open(self.folder / name, "wb")
        self.shards.append({"file": name, "n_tokens": 0})

    def close(self) -> List[dict]:
        if self._f is not None:
            self._f.flush()
            self._f.close()
            self._f = None
        return self.shards


def read_meta(folder: Path) -> Optional[dict]:
    """The meta of a complete prepared folder, or None if it is absent, stale or incomplete."""
    try:
        meta = json.loads((Path(folder) / META).read_text())
    except (OSError, ValueError):
        return None
    if meta.get("format_version") != FORMAT_VERSION or not (Path(folder) / "tokenizer.json").is_file():
        return None
    item = np_dtype(meta["dtype"]).itemsize
    for split in meta["splits"].values():
        for s in split["shards"]:
            p = Path(folder) / s["file"]
            if not p.is_file() or p.stat().st_size != s["n_tokens"] * item:
                return None
    return meta


def open_split(folder: Path, split: str) -> tuple:
    """(meta, [np.memmap per shard]) for one split of a prepared folder; read-only."""
    folder = Path(folder)
    meta = read_meta(folder)
    if meta is None:
        raise DataError(f"{folder} is not a complete prepared data folder (no valid {META}); run "
                        f"`python launch/prepare_data.py --config ...` or point the loader at PreparedData.dir")
    if split not in meta["splits"]:
        raise DataError(f"split '{split}' not in {folder}; it has {sorted(meta['splits'])}")
    dt = np_dtype(meta["dtype"])
    maps = [np.memmap(folder / s["file"], dtype=dt, mode="r")
            for s in meta["splits"][split]["shards"] if s["n_tokens"] > 0]
    return meta, maps


def write_meta(folder: Path, meta: dict) -> None:
    (Path(folder) / META).write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
