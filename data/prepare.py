"""Corpus -> tokenizer -> token shards, cached on disk: `prepare(cfg.data, model_vocab_size)`.

    python launch/prepare_data.py --config tiny_cpu.yaml [data.source=[my/folder] ...]   # ahead of a run

Steps: resolve `data.source` (data/sources.py), load documents with `datasets`, split them into
train/val by a hash of each document's text, train a byte-level BPE on train (or load a
tokenizer.json), encode every document + EOS, and stream the ids into shards (data/shards.py). A long
document is encoded in pieces (data/tokenizer.py `pieces`), one longer than STREAM_CHARS in this
process with its ids written as they come, so memory does not grow with a document's length.

Cache: the output folder is `cache_dir/<key>`, key = hash of (each source file's path, size, mtime;
tokenizer setting; split and format settings; FORMAT_VERSION). It is written as a hidden temporary
folder and published with one atomic `os.replace`, so a folder under its key is always complete; a
second call (or another rank after the barrier) finds it and returns at once. Concurrent callers are
safe too: each builds its own temp folder and the loser of the `os.replace` race keeps the winner's.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict

import numpy as np

from data import tokenizer as toklib
from data.shards import (FORMAT_VERSION, SHARD_TOKENS, ShardWriter, dtype_for, read_meta, write_meta)
from data.sources import DataError, load_documents, resolve_path, resolve_sources, signature

log = logging.getLogger(__name__)
STREAM_CHARS = 16 << 20  # a document longer than this is tokenized in the main process, ids streamed out
NO_IDS = np.zeros(0, dtype=np.int32)
MIN_DOCS_PER_PROC = 256  # below this many documents per worker, extra processes cost more than they save
STALE_TMP_S = 24 * 3600  # a temp folder of another host is removed after this long


@dataclass
class PreparedData:
    dir: Path  # the prepared folder (meta.json, tokenizer.json, *.bin)
    vocab_size: int  # the tokenizer's vocabulary (model.vocab_size must be >= it)
    eos_id: int  # id of <|endoftext|>, appended after every document
    tokenizer_path: Path
    tokenizer_hash: str  # 16 hex digits of sha256 of the tokenizer JSON
    n_tokens: Dict[str, int]  # split -> tokens (EOS included)
    dtype: str  # "uint16" | "uint32", the shards' element type
    n_docs: Dict[str, int] = field(default_factory=dict)  # split -> documents

    @classmethod
    def from_meta(cls, folder: Path, meta: dict) -> "PreparedData":
        return cls(dir=folder, vocab_size=meta["vocab_size"], eos_id=meta["eos_id"],
                   tokenizer_path=folder / "tokenizer.json", tokenizer_hash=meta["tokenizer_hash"],
                   n_tokens={k: v["n_tokens"] for k, v in meta["splits"].items()}, dtype=meta["dtype"],
                   n_docs={k: v["n_docs"] for k, v in meta["splits"].items()})

    def summary(self) -> str:
        rows = [f"data      {self.dir}",
                f"tokenizer vocab {self.vocab_size}, eos {self.eos_id}, hash {self.tokenizer_hash}, "
                f"shards {self.dtype}"]
        rows += [f"{k:<9} {self.n_tokens[k]:,} tokens in {self.n_docs.get(k, '?')} documents"
                 for k in self.n_tokens]
        return "\n".join(rows)


def prepare(cfg, model_vocab_size: int, *, shard_tokens: int = SHARD_TOKENS) -> PreparedData:
    """Return the prepared data for `cfg` (a DataConfig), building it unless the cache has it."""
    sources = resolve_sources(list(cfg.source), cfg.format)
    tok_file, tok = None, None
    if cfg.tokenizer != "train":
        tok_file = resolve_path(cfg.tokenizer)
        if tok_file is None or not tok_file.is_file():
            raise DataError(f"tokenizer file '{cfg.tokenizer}' not found (looked in {Path.cwd()} and the "
                            f"repository root); set data.tokenizer to a tokenizer.json or to 'train'")
        tok = toklib.load(tok_file)
        _check_model_vocab(toklib.vocab_size(tok), model_vocab_size)
    key, spec = cache_key(cfg, sources, tok, shard_tokens)
    root = Path(cfg.cache_dir).expanduser().resolve()
    final = root / key
    meta = read_meta(final)
    if meta is None:
        root.mkdir(parents=True, exist_ok=True)
        _clean_stale(root)
        t0 = time.time()
        import datasets

        datasets.disable_progress_bars()  # one log line per stage instead of a bar per map()
        _build(cfg, sources, tok, spec, root, final, model_vocab_size, shard_tokens)
        meta = read_meta(final)
        log.info("prepared %s in %.1f s", final, time.time() - t0)
    _check_model_vocab(meta["vocab_size"], model_vocab_size)
    _check_max_id(final, meta, model_vocab_size)
    return PreparedData.from_meta(final, meta)


def cache_key(cfg, sources, tok, shard_tokens: int) -> tuple:
    """(16-hex key, the spec it hashes): everything that changes the shards' bytes."""
    spec = {"format_version": FORMAT_VERSION, "sources": signature(sources), "format": cfg.format,
            "text_field": cfg.text_field, "val_fraction": cfg.val_fraction, "shard_tokens": shard_tokens,
            "tokenizer": (f"train:{cfg.tokenizer_vocab_size}" if tok is None
                          else f"file:{toklib.fingerprint(tok)}")}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16], spec


def _check_model_vocab(vocab: int, model_vocab_size: int) -> None:
    if model_vocab_size < vocab:
        raise DataError(f"the tokenizer has {vocab} tokens but model.vocab_size={model_vocab_size}; "
                        f"raise model.vocab_size to >= {vocab} (a multiple of 64 is fastest)")


def _check_max_id(folder: Path, meta: dict, model_vocab_size: int) -> None:
    """The largest id in the shards (meta.json records it) must be an embedding row of the model."""
    max_id = meta.get("max_token_id")
    if not isinstance(max_id, int) or not 0 <= max_id < min(model_vocab_size, meta["vocab_size"]):
        raise DataError(f"the token shards in {folder} record max token id {max_id!r} (meta.json "
                        f"max_token_id), but ids must be < model.vocab_size={model_vocab_size} and < the "
                        f"tokenizer's {meta['vocab_size']}: the folder is damaged or from another "
                        f"tokenizer; delete {folder} to rebuild it")


# --- building ---------------------------------------------------------------------------------------
def _build(cfg, sources, tok, spec, root: Path, final: Path, model_vocab_size: int, shard_tokens: int):
    """Write everything into a temp folder of ours, then publish it with one os.replace."""
    tmp = root / f".tmp-{final.name}-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        meta = _write(cfg, sources, tok, spec, root, tmp, model_vocab_size, shard_tokens)
        meta["key"] = final.name
        write_meta(tmp, meta)  # last: a folder with a valid meta.json is complete
        if final.exists() and read_meta(final) is None:  # an incomplete folder under our key
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.replace(tmp, final)
        except OSError:
            if read_meta(final) is None:
                raise
            log.info("another process published %s first; using it", final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write(cfg, sources, tok, spec, root: Path, tmp: Path, model_vocab_size: int, shard_tokens: int) -> dict:
    hf_cache = str(root / "hf")  # datasets' Arrow files stay under our cache, not in $HOME
    docs = load_documents(sources, cfg.format, cfg.text_field, hf_cache, cfg.num_proc)
    train, val = split_documents(docs, cfg.val_fraction)
    if tok is None:
        log.info("training a %d-token byte-level BPE on %d documents", cfg.tokenizer_vocab_size, len(train))
        tok = toklib.train_bpe(toklib.batches(train), cfg.tokenizer_vocab_size, length=len(train))
    vocab, eos = toklib.vocab_size(tok), toklib.eos_id(tok)
    _check_model_vocab(vocab, model_vocab_size)
    tok.save(str(tmp / "tokenizer.json"))
    dtype = dtype_for(vocab)
    splits, max_id = {}, -1
    for name, ds in (("train", train), ("val", val)):
        writer = ShardWriter(tmp, name, dtype, shard_tokens)
        for ids in _encoded_chunks(ds, tok, eos, vocab, cfg.num_proc):
            writer.write(ids)
        splits[name] = {"n_tokens": writer.n_tokens, "n_docs": len(ds), "shards": writer.close()}
        max_id = max(max_id, writer.max_id)
    return {"format_version": FORMAT_VERSION, "spec": spec,
            "tokenizer_hash": toklib.fingerprint(tok), "vocab_size": vocab, "eos_id": eos,
            "dtype": dtype, "max_token_id": max_id, "splits": splits,
            "sources": [s.entry for s in sources], "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def split_documents(ds, val_fraction: float) -> tuple:
    """(train, val) datasets: a document is val iff hash(text) in [0, val_fraction). Depends only on the
    text, so it is stable across runs and sources' order; at least one document on each side."""
    if len(ds) < 2:
        raise DataError(f"the corpus has {len(ds)} document; need >= 2 (one for train, one for val). A "
                        f"text file is one document: split the text into several files, or use JSON "
                        f"lines with one document per line")
    u = np.asarray(ds.map(_doc_units, batched=True, remove_columns=["text"]).with_format("numpy")["_u"])
    is_val = u < val_fraction
    if not is_val.any():
        is_val[np.argmin(u)] = True
    if is_val.all():
        is_val[np.argmax(u)] = False
    idx = np.arange(len(ds))
    return ds.select(idx[~is_val]), ds.select(idx[is_val])


def _doc_units(batch: dict) -> dict:
    """A number in [0, 1) per document from blake2b of its UTF-8 text."""
    h = (hashlib.blake2b(t.encode(), digest_size=8).digest() for t in batch["text"])
    return {"_u": [int.from_bytes(d, "little") / 2.0 ** 64 for d in h]}


def _check_ids(ids: np.ndarray, vocab: int) -> np.ndarray:
    if ids.size and int(ids.max()) >= vocab:
        raise DataError(f"the tokenizer produced id {int(ids.max())} >= its vocab size {vocab}; "
                        f"its tokenizer.json is inconsistent (ids must be < vocab size); fix or "
                        f"replace it, or set data.tokenizer=train")
    return ids


def _encode_batch(batch: dict, tok, eos: int, vocab: int) -> dict:
    """ids per document (runs in the map's worker processes); a document longer than STREAM_CHARS
    gets no ids here (a real document has at least its EOS): `_encoded_chunks` streams it."""
    texts = batch["text"]
    enc = iter(toklib.encode_docs(tok, [t for t in texts if len(t) <= STREAM_CHARS], eos))
    return {"ids": [_check_ids(next(enc), vocab) if len(t) <= STREAM_CHARS else NO_IDS for t in texts]}


def _encoded_chunks(ds, tok, eos: int, vocab: int, num_proc: int):
    """Yield flat int arrays of token ids (documents in order, EOS after each), tokenized in parallel:
    `datasets.map` worker processes for large corpora, the tokenizer's own threads always. A document
    longer than STREAM_CHARS is tokenized here piece by piece and its ids yielded as they come, so
    memory stays bounded however long it is."""
    import datasets
    import pyarrow.compute as pc
    nproc = num_proc if num_proc > 1 and len(ds) >= MIN_DOCS_PER_PROC * num_proc else None
    if nproc:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # processes replace Rust threads
    enc = ds.map(functools.partial(_encode_batch, tok=tok, eos=eos, vocab=vocab), batched=True,
                 batch_size=256, num_proc=nproc, remove_columns=ds.column_names,
                 features=datasets.Features({"ids": datasets.Sequence(datasets.Value("int32"))}))
    row = 0  # index in ds of the table's first row
    for table in enc.with_format("arrow").iter(batch_size=1024):
        ids = table["ids"]
        start = 0
        for j in np.flatnonzero(pc.list_value_length(ids).to_numpy(zero_copy_only=False) == 0):
            if j > start:
                yield from _flat(ids.slice(start, j - start))
            for piece in toklib.encode_long(tok, ds[row + int(j)]["text"]):
                yield _check_ids(piece, vocab)
            yield np.array([eos], dtype=np.int32)
            start = j + 1
        if start < table.num_rows:
            yield from _flat(ids.slice(start))
        row += table.num_rows


def _flat(ids) -> list:
    """The ids of a ChunkedArray of lists, one numpy array per chunk (views of the Arrow buffers)."""
    import pyarrow.compute as pc
    return [pc.list_flatten(c).to_numpy() for c in ids.chunks if len(c)]


# The temp folders _build makes: .tmp-<16-hex cache key>-<host>-<pid>
OWN_TMP = re.compile(r"^\.tmp-[0-9a-f]{16}-(?P<host>.+)-(?P<pid>\d+)$")


def _clean_stale(root: Path) -> None:
    """Remove temp folders left by crashed builds, and only those (the cache folder may be shared):
    a folder is ours when its name has _build's pattern; one of this host is removed once its
    process is gone, one of another host after STALE_TMP_S without a change."""
    for tmp in root.glob(".tmp-*"):
        mine = OWN_TMP.match(tmp.name)
        if mine is None or not tmp.is_dir():
            continue
        if mine["host"] == socket.gethostname():
            dead = not _pid_alive(int(mine["pid"]))
        else:
            dead = time.time() - tmp.stat().st_mtime > STALE_TMP_S
        if dead:
            log.info("removing leftover %s", tmp)
            shutil.rmtree(tmp, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


if __name__ == "__main__":  # the command line needs the run config (training/), so it lives in launch/
    raise SystemExit("error: prepare data with `python launch/prepare_data.py --config NAME.yaml [key=value ...]`")
