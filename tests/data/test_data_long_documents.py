"""A long document is tokenized in pieces cut where the byte-level pre-tokenizer splits anyway (same ids
as in one piece) and its ids are streamed into the shards, in bounded memory."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import data.prepare as prep
from data import tokenizer as toklib
from data.prepare import prepare
from data.shards import open_split
from data.sources import REPO_ROOT
from data_helpers import data_cfg, random_docs, write_jsonl

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def tok():
    return toklib.train_bpe(iter([random_docs(60, seed=3)]), vocab_size=400)


def awkward_text(n_docs: int, seed: int) -> str:
    """Random documents joined by runs of mixed whitespace (the places where cuts could go wrong)."""
    rng = np.random.default_rng(seed)
    seps = [" ", "  ", "\n", "\n\n", " \t", "\r\n", "\u00a0 ", " \u3000", "   \n  "]
    docs = random_docs(n_docs, seed=seed)
    return "".join(d + seps[rng.integers(len(seps))] for d in docs) + "don't 'quote' 123 456"


@pytest.mark.parametrize("size", [7, 64, 1000])
def test_pieces_give_the_same_ids_as_the_whole_text(tok, size):
    text = awkward_text(40, seed=size)
    parts = list(toklib.pieces(text, size))
    assert "".join(parts) == text and all(0 < len(p) <= size for p in parts)
    assert len(parts) <= 2 * len(text) // size + 1  # cuts at least size/2 apart
    if size >= 64:  # every window of size/2 characters holds a cut place (words are shorter)
        whole = tok.encode(text, add_special_tokens=False).ids
        assert np.concatenate(list(toklib.encode_long(tok, text, size))).tolist() == whole


def test_pieces_without_a_cut_place_are_cut_at_the_size():
    text = "x" * 1000 + " y"
    parts = list(toklib.pieces(text, 300))
    assert "".join(parts) == text and [len(p) for p in parts] == [300, 300, 300, 102]


def test_encode_docs_splits_long_documents(tok, monkeypatch):
    docs = [awkward_text(30, seed=1), "short one", awkward_text(5, seed=2), "two", "", "x " * 99]
    want = [tok.encode(d, add_special_tokens=False).ids + [toklib.eos_id(tok)] for d in docs]
    monkeypatch.setattr(toklib, "PIECE_CHARS", 200)
    monkeypatch.setattr(toklib, "BATCH_CHARS", 100_000)  # short ones wait in a group: order kept
    assert [g.tolist() for g in toklib.encode_docs(tok, docs, toklib.eos_id(tok))] == want
    monkeypatch.setattr(toklib, "BATCH_CHARS", 150)
    got = toklib.encode_docs(tok, docs, toklib.eos_id(tok))
    assert [g.tolist() for g in got] == want and all(g.dtype == np.int32 for g in got)


def test_prepare_streams_long_documents_with_the_same_tokens(tmp_path, monkeypatch):
    docs = random_docs(20, seed=4)
    docs[3], docs[11] = awkward_text(60, seed=5), awkward_text(80, seed=6)  # ~40 kB each
    src = write_jsonl(tmp_path / "docs.jsonl", docs)
    plain = prepare(data_cfg(tmp_path / "a", [src]), 512)
    monkeypatch.setattr(prep, "STREAM_CHARS", 5_000)  # the two long ones go the streaming way
    monkeypatch.setattr(toklib, "PIECE_CHARS", 700)
    streamed = prepare(data_cfg(tmp_path / "b", [src]), 512)
    for split in ("train", "val"):
        a = np.concatenate(open_split(plain.dir, split)[1])
        b = np.concatenate(open_split(streamed.dir, split)[1])
        assert np.array_equal(a, b)
    assert streamed.n_docs == plain.n_docs


MEASURE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import data.prepare as prep
from data.prepare import prepare
from data_helpers import data_cfg

prep.STREAM_CHARS = 1 << 20  # the long document is streamed; the others go through datasets.map


def rss(field):
    line = next(x for x in open("/proc/self/status") if x.startswith(field))
    return int(line.split()[1]) * 1024


encode = prep._encoded_chunks


def measured(*args, **kwargs):  # from just before tokenization to the end of the shards
    open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
    base = rss("VmRSS:")
    yield from encode(*args, **kwargs)
    print(json.dumps({"growth": rss("VmHWM:") - base}))


prep._encoded_chunks = measured
p = prepare(data_cfg(__import__("pathlib").Path(sys.argv[2]), [sys.argv[3]], tokenizer=sys.argv[4]), 512)
print(json.dumps({"tokens": sum(p.n_tokens.values())}))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_a_long_document_is_tokenized_in_bounded_memory(tmp_path, tok):
    """One 8 M-character document (non-ASCII in it: 32 MB as a Python str). Tokenized in one call its
    Encoding and id lists took ~1.4 GB more; in pieces the growth is ~170 MB (two copies of the str)."""
    tok.save(str(tmp_path / "tok.json"))
    block = awkward_text(200, seed=7)
    big = block * (8_000_000 // len(block) + 1)
    write_jsonl(tmp_path / "big.jsonl", random_docs(10, seed=8) + [big] + random_docs(10, seed=9))
    del big
    out = subprocess.run([sys.executable, "-c", MEASURE, str(HERE), str(tmp_path), str(tmp_path / "big.jsonl"),
                          str(tmp_path / "tok.json")], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    growth = max(r.get("growth", 0) for r in rows) / 2 ** 20
    assert rows[-1]["tokens"] > 2_000_000
    assert growth < 400, f"tokenizing grew the process by {growth:.0f} MB"
