"""Helpers for the data tests: tiny real-random corpora in tmp_path and hand-made prepared folders."""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np

from data.shards import FORMAT_VERSION, ShardWriter, dtype_for, write_meta
from training.config import DataConfig

SYLLABLES = ["ka", "to", "re", "mi", "su", "lo", "an", "ve", "ri", "do", "pe", "nu", "sh", "th", "qu"]


def random_text(rng: random.Random, n_words: int) -> str:
    """Sentences of random pseudo-words with punctuation, newlines and some non-ASCII."""
    words = ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(n_words)]
    out = []
    for i, w in enumerate(words):
        if rng.random() < 0.03:
            w = rng.choice(["café", "naïve", "日本", "🙂", "Ω", "\t"]) + w
        out.append(w + (rng.choice([".", ",", "!", "?\n", ".\n\n"]) if rng.random() < 0.1 else ""))
    return " ".join(out).strip()


def random_docs(n_docs: int, seed: int = 0, words=(20, 200)) -> list:
    rng = random.Random(seed)
    return [random_text(rng, rng.randint(*words)) for _ in range(n_docs)]


def write_jsonl(path: Path, docs, field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({field: d, "id": i}, ensure_ascii=False) + "\n")
    return path


def data_cfg(tmp_path: Path, source, **kw) -> DataConfig:
    """A DataConfig over `source` with its cache in tmp_path and a tiny tokenizer."""
    kw.setdefault("tokenizer_vocab_size", 320)
    kw.setdefault("num_proc", 1)
    kw.setdefault("val_fraction", 0.2)
    return DataConfig(source=[str(s) for s in source], cache_dir=str(tmp_path / "cache"), **kw)


def write_prepared(folder: Path, splits: dict, vocab_size: int, eos_id: int, shard_tokens: int = 1000,
                   key: str = "testkey") -> Path:
    """A prepared folder holding the given token arrays (split -> 1-D ints), as `prepare` lays it out."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text("{}")
    dtype, meta_splits = dtype_for(vocab_size), {}
    for name, ids in splits.items():
        w = ShardWriter(folder, name, dtype, shard_tokens)
        w.write(np.asarray(ids))
        meta_splits[name] = {"n_tokens": w.n_tokens, "n_docs": int((np.asarray(ids) == eos_id).sum()),
                             "shards": w.close()}
    write_meta(folder, {"format_version": FORMAT_VERSION, "key": key, "tokenizer_hash": "t" * 16,
                        "vocab_size": vocab_size, "eos_id": eos_id, "dtype": dtype, "splits": meta_splits})
    return folder


def random_stream(n_tokens: int, vocab: int, eos: int, seed: int = 0, mean_doc: int = 50) -> np.ndarray:
    """Random ids in [1, vocab) with EOS (id `eos`) ending documents of random length."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, vocab, size=n_tokens)
    ids[ids == eos] = 1
    ids[rng.random(n_tokens) < 1.0 / mean_doc] = eos
    ids[-1] = eos
    return ids
