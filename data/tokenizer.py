"""The tokenizer: a byte-level BPE (`tokenizers`) trained on the train split, or a tokenizer.json file.

Byte-level BPE is lossless: decode(encode(text)) == text for any Unicode string, because every byte
has a token. `<|endoftext|>` (GPT-2's name) is the one special token; `prepare` appends it after
every document.
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Iterable, Iterator, List, Optional

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from data.errors import DataError

EOS = "<|endoftext|>"
EOS_ALIASES = (EOS, "</s>", "<eos>", "<|end_of_text|>")  # accepted in a loaded tokenizer.json
MIN_VOCAB = 257  # 256 byte tokens + EOS
PIECE_CHARS = 1 << 18  # a document longer than this is encoded in pieces of at most this many characters
BATCH_CHARS = 1 << 20  # characters per encode_batch call: its Encodings take ~100 bytes per token
_SEAM = re.compile(r"[ \t\n\r](?=\S)")  # where `pieces` may cut: before this whitespace character


def train_bpe(texts: Iterable[List[str]], vocab_size: int, length: Optional[int] = None) -> Tokenizer:
    """Train on batches of texts; the result has at most `vocab_size` tokens (fewer on a tiny corpus)."""
    if vocab_size < MIN_VOCAB:
        raise DataError(f"data.tokenizer_vocab_size={vocab_size} is below {MIN_VOCAB} (256 bytes + "
                        f"{EOS}); raise it")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2 split regex
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    return tok


def load(path: Path) -> Tokenizer:
    if not path.is_file():
        raise DataError(f"tokenizer file {path} not found; set data.tokenizer to an existing "
                        f"tokenizer.json or to 'train'")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:
        raise DataError(f"cannot read tokenizer {path} ({e}); give a `tokenizers` tokenizer.json or set "
                        f"data.tokenizer=train") from None


def eos_id(tok: Tokenizer, where: str = "the tokenizer") -> int:
    for name in EOS_ALIASES:
        i = tok.token_to_id(name)
        if i is not None:
            return i
    raise DataError(f"{where} has no end-of-text token (looked for {', '.join(EOS_ALIASES)}); add "
                    f"{EOS} as a special token or set data.tokenizer=train")


def vocab_size(tok: Tokenizer) -> int:
    """Number of ids the tokenizer claims, special tokens included (model.vocab_size must be >= it)."""
    return tok.get_vocab_size(with_added_tokens=True)


def fingerprint(tok: Tokenizer) -> str:
    """sha256 of the canonical JSON, 16 hex digits: identifies the tokenizer in caches and checkpoints."""
    return hashlib.sha256(tok.to_str().encode()).hexdigest()[:16]


def encode_docs(tok: Tokenizer, texts: List[str], eos: int) -> List[np.ndarray]:
    """Token ids (int32) per document with EOS appended; no BOS/other special tokens a loaded one may
    add. Encoded in calls of at most BATCH_CHARS characters (a long document alone, in pieces), each
    call's Encodings dropped as soon as their ids are copied out."""
    out: List[np.ndarray] = []
    group: List[str] = []  # short documents not encoded yet, in order
    size = 0
    for t in texts:
        if group and (size + len(t) > BATCH_CHARS or len(t) > PIECE_CHARS):
            out += [_ids(e) for e in tok.encode_batch(group, add_special_tokens=False)]
            group, size = [], 0
        if len(t) > PIECE_CHARS:
            out.append(np.concatenate(list(encode_long(tok, t))))
        else:
            group.append(t)
            size += len(t)
    if group:
        out += [_ids(e) for e in tok.encode_batch(group, add_special_tokens=False)]
    return [np.append(ids, np.int32(eos)) for ids in out]


def encode_long(tok: Tokenizer, text: str, piece_chars: Optional[int] = None) -> Iterator[np.ndarray]:
    """int32 ids of one long document, piece by piece (see `pieces`); the memory held is a few groups
    of pieces' Encodings, not the whole document's."""
    piece_chars = piece_chars or PIECE_CHARS
    group: List[str] = []
    for piece in pieces(text, piece_chars):
        group.append(piece)
        if len(group) * piece_chars >= BATCH_CHARS:
            yield from (_ids(e) for e in tok.encode_batch(group, add_special_tokens=False))
            group = []
    yield from (_ids(e) for e in tok.encode_batch(group, add_special_tokens=False))


def _ids(encoding) -> np.ndarray:
    return np.asarray(encoding.ids, dtype=np.int32)


def pieces(text: str, size: int = PIECE_CHARS) -> Iterator[str]:
    """`text` in pieces of at most `size` characters, cut just before an ASCII whitespace character
    that is followed by a non-whitespace one. The byte-level pre-tokenizer (GPT-2's split regex) always
    starts a pre-token there and BPE never merges across pre-tokens, so for the tokenizer `train_bpe`
    builds the pieces' ids, concatenated, equal the whole text's. A loaded tokenizer with another
    pre-tokenizer (or add_prefix_space) may differ at a cut; so may a stretch of `size` characters with
    no such place (then cut at `size`). Cuts are at least size/2 apart: one per ~size characters."""
    start, n = 0, len(text)
    while n - start > size:
        end = _cut(text, start + max(1, size // 2), start + size)
        yield text[start:end]
        start = end
    yield text[start:]


def _cut(text: str, lo: int, hi: int) -> int:
    """The last cut place c in [lo, hi) (text[c] ASCII whitespace, text[c + 1] not whitespace), else hi."""
    for span in (256, hi - lo):  # nearly always one lies among the last few characters
        found = [m.start() for m in _SEAM.finditer(text, max(lo, hi - span), hi + 1)]
        if found:
            return found[-1]
    return hi


def batches(ds, size: int = 1000) -> Iterator[List[str]]:
    """The "text" column of a datasets.Dataset in lists of `size` (what train_from_iterator wants), a
    long document in pieces (`pieces`: the same pre-tokens, so the same word counts for BPE training)."""
    for i in range(0, len(ds), size):
        out: List[str] = []
        for t in ds[i:i + size]["text"]:
            out += pieces(t, PIECE_CHARS) if len(t) > PIECE_CHARS else [t]
        yield out
