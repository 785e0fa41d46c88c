"""The tokenizer: a byte-level BPE (`tokenizers`) trained on the train split, or a tokenizer.json file.

Byte-level BPE is lossless: decode(encode(text)) == text for any Unicode string, because every byte
has a token. `<|endoftext|>` (GPT-2's name) is the one special token; `prepare` appends it after
every document.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable, Iterator, List, Optional

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from data.sources import DataError

EOS = "<|endoftext|>"
EOS_ALIASES = (EOS, "</s>", "<eos>", "<|end_of_text|>")  # accepted in a loaded tokenizer.json
MIN_VOCAB = 257  # 256 byte tokens + EOS


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


def encode_docs(tok: Tokenizer, texts: List[str], eos: int) -> List[List[int]]:
    """Token ids per document with EOS appended; no BOS/other special tokens a loaded one may add."""
    return [e.ids + [eos] for e in tok.encode_batch(texts, add_special_tokens=False)]


def batches(ds, size: int = 1000) -> Iterator[List[str]]:
    """The "text" column of a datasets.Dataset in lists of `size` (what train_from_iterator wants)."""
    for i in range(0, len(ds), size):
        yield ds[i:i + size]["text"]
