"""Every data error names the problem and the fix, in one message."""
import os
import subprocess
import sys

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

import data.sources as sources
from data import tokenizer as toklib
from data.prepare import prepare
from data.sources import REPO_ROOT, DataError
from data_helpers import data_cfg, random_docs, write_jsonl


def test_missing_path(tmp_path):
    with pytest.raises(DataError, match=r"'.*nope\.jsonl' not found.*fix the path"):
        prepare(data_cfg(tmp_path, [tmp_path / "nope.jsonl"]), 512)
    with pytest.raises(DataError, match="not found"):  # relative, with an extension: not a hub id
        prepare(data_cfg(tmp_path, ["no/such/file.txt"]), 512)


def test_hub_name_failure_is_one_clear_message(tmp_path, monkeypatch):
    import datasets
    calls = []

    def offline(*args, **kwargs):
        calls.append((args, kwargs))
        raise ConnectionError("Couldn't reach the Hub")
    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match="not a local file or folder.*hub failed.*ConnectionError.*network"):
        prepare(data_cfg(tmp_path, ["someone/tiny_stories:en"]), 512)
    assert calls[0][0] == ("someone/tiny_stories", "en") and calls[0][1]["split"] == "train"


def test_hub_offline_for_real(tmp_path):
    code = ("from data.sources import *; s = resolve_sources(['someone/some_set'], 'auto');"
            f"load_documents(s, 'auto', 'text', {str(tmp_path)!r}, 1)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=60)
    assert "DataError" in out.stderr and "hub failed" in out.stderr


def test_empty_corpus(tmp_path):
    src = write_jsonl(tmp_path / "e.jsonl", ["", "   \n\t", ""])
    with pytest.raises(DataError, match="empty corpus.*data.text_field"):
        prepare(data_cfg(tmp_path, [src]), 512)


def test_folder_without_documents(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.md").write_text("markdown is not a corpus format")
    with pytest.raises(DataError, match="holds no .*files"):
        prepare(data_cfg(tmp_path, [tmp_path / "d"]), 512)


def test_unknown_extension(tmp_path):
    (tmp_path / "x.csv").write_text("a,b\n1,2\n")
    with pytest.raises(DataError, match="cannot tell the format.*data.format"):
        prepare(data_cfg(tmp_path, [tmp_path / "x.csv"]), 512)


def test_wrong_text_field(tmp_path, small_corpus):
    with pytest.raises(DataError, match=r"column 'body' not found.*\['text', 'id'\].*data.text_field"):
        prepare(data_cfg(tmp_path, [small_corpus], text_field="body"), 512)
    with pytest.raises(DataError, match="line 1 of .*docs.jsonl holds a JSON number in 'id', not a string"):
        prepare(data_cfg(tmp_path, [small_corpus], text_field="id"), 512)


def test_single_document(tmp_path):
    (tmp_path / "book.txt").write_text(random_docs(1)[0])
    with pytest.raises(DataError, match="need >= 2.*several files"):
        prepare(data_cfg(tmp_path, [tmp_path / "book.txt"]), 512)


def test_tokenizer_file_missing(tmp_path, small_corpus):
    with pytest.raises(DataError, match="tokenizer file .*missing.json' not found.*data.tokenizer"):
        prepare(data_cfg(tmp_path, [small_corpus], tokenizer=str(tmp_path / "missing.json")), 512)


def test_model_vocab_too_small(tmp_path, small_corpus):
    cfg = data_cfg(tmp_path, [small_corpus])
    with pytest.raises(DataError, match=r"has \d+ tokens but model.vocab_size=256; raise model.vocab_size to >= \d+"):
        prepare(cfg, 256)  # trained tokenizer: checked before any shard is written
    assert [p for p in (tmp_path / "cache").iterdir() if p.name != "hf"] == []
    p = prepare(cfg, 512)
    with pytest.raises(DataError, match=f"raise model.vocab_size to >= {p.vocab_size}"):
        prepare(cfg, p.vocab_size - 1)  # cache hit: checked from meta.json
    p.tokenizer_path.replace(tmp_path / "tok.json")
    with pytest.raises(DataError, match=f"raise model.vocab_size to >= {p.vocab_size}"):
        prepare(data_cfg(tmp_path, [small_corpus], tokenizer=str(tmp_path / "tok.json")), 300)


def test_token_id_beyond_vocab(tmp_path, small_corpus):
    """A tokenizer.json whose ids exceed the size it reports (WordLevel with a gap)."""
    words = sorted({w for d in random_docs(30, seed=1) for w in d.split()})
    vocab = {toklib.EOS: 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(words)}}
    vocab[words[0]] = 60_000  # reported size stays len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "gap.json"))
    with pytest.raises(DataError, match="produced id 60000 >= its vocab size .*inconsistent"):
        prepare(data_cfg(tmp_path, [small_corpus], tokenizer=str(tmp_path / "gap.json")), 65_536)


def test_empty_source_list(tmp_path):
    with pytest.raises(DataError, match="data.source is empty"):
        sources.resolve_sources([], "auto")
