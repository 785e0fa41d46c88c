"""Byte-level BPE: training, lossless round trip, EOS, fingerprint, and its error messages."""
import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from data import tokenizer as toklib
from data.sources import DataError
from data_helpers import random_docs


@pytest.fixture(scope="module")
def tok():
    docs = random_docs(40, seed=3)
    return toklib.train_bpe(iter([docs[:20], docs[20:]]), vocab_size=400, length=40)


def test_train_vocab_and_eos(tok):
    assert 257 < toklib.vocab_size(tok) <= 400  # merges were learned, never more than asked
    eos = toklib.eos_id(tok)
    assert tok.encode(toklib.EOS).ids == [eos]  # the special token is one id, never split
    assert tok.token_to_id("ka") is not None  # a frequent syllable became a token


@pytest.mark.parametrize("text", random_docs(5, seed=9) + ["unseen: Ωμέγα 日本語 🙂🙂 \r\n\ttabs  spaces ", ""])
def test_round_trip(tok, text):
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text
    assert all(0 <= i < toklib.vocab_size(tok) for i in ids)


def test_encode_docs_appends_eos(tok):
    docs = random_docs(3, seed=4)
    out = toklib.encode_docs(tok, docs, toklib.eos_id(tok))
    for d, ids in zip(docs, out):
        assert ids[-1] == toklib.eos_id(tok) and toklib.eos_id(tok) not in ids[:-1]
        assert tok.decode(ids[:-1]) == d


def test_fingerprint_stable_and_distinct(tok, tmp_path):
    tok.save(str(tmp_path / "t.json"))
    assert toklib.fingerprint(toklib.load(tmp_path / "t.json")) == toklib.fingerprint(tok)
    other = toklib.train_bpe(iter([random_docs(40, seed=5)]), vocab_size=300)
    assert toklib.fingerprint(other) != toklib.fingerprint(tok)


def test_training_is_deterministic():
    docs = random_docs(20, seed=6)
    a = toklib.train_bpe(iter([docs]), vocab_size=300)
    b = toklib.train_bpe(iter([docs]), vocab_size=300)
    assert toklib.fingerprint(a) == toklib.fingerprint(b)


def test_vocab_too_small():
    with pytest.raises(DataError, match="below 257.*raise it"):
        toklib.train_bpe(iter([["abc"]]), vocab_size=100)


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="not found.*data.tokenizer"):
        toklib.load(tmp_path / "nope.json")


def test_unreadable_file(tmp_path):
    (tmp_path / "bad.json").write_text(json.dumps({"not": "a tokenizer"}))
    with pytest.raises(DataError, match="cannot read tokenizer"):
        toklib.load(tmp_path / "bad.json")


def test_no_eos():
    t = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    with pytest.raises(DataError, match="no end-of-text token"):
        toklib.eos_id(t)
