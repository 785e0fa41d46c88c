"""Every data error names the problem and the fix, in one message."""
import json
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


def _gap_tokenizer(tmp_path, docs) -> str:
    """A tokenizer.json whose ids exceed the size it reports (WordLevel with a gap)."""
    words = sorted({w for d in docs for w in d.split()})
    vocab = {toklib.EOS: 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(words)}}
    vocab[words[0]] = 60_000  # reported size stays len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "gap.json"))
    return str(tmp_path / "gap.json")


def test_token_id_beyond_vocab(tmp_path, small_corpus):
    tok = _gap_tokenizer(tmp_path, random_docs(30, seed=1))
    with pytest.raises(DataError, match="produced id 60000 >= its vocab size .*inconsistent"):
        prepare(data_cfg(tmp_path, [small_corpus], tokenizer=tok), 65_536)


def test_empty_source_list(tmp_path):
    with pytest.raises(DataError, match="data.source is empty"):
        sources.resolve_sources([], "auto")


def _lines(docs, bad_at: int, bad: bytes) -> bytes:
    rows = [json.dumps({"text": d}).encode() + b"\n" for d in docs]
    rows[bad_at] = bad + b"\n"
    return b"".join(rows)


def _parquet_bytes(texts) -> bytes:
    """A parquet file with a string column "text" holding these raw bytes (no UTF-8 check on write)."""
    import io

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    offsets = np.cumsum([0] + [len(t) for t in texts]).astype(np.int32)
    col = pa.Array.from_buffers(pa.string(), len(texts), [None, pa.py_buffer(offsets.tobytes()),
                                                          pa.py_buffer(b"".join(texts))])
    out = io.BytesIO()
    pq.write_table(pa.table({"text": col}), out)
    return out.getvalue()


DOCS = random_docs(12, seed=2)
BAD_FILES = {  # name -> (bytes, what the one error line must say)
    "latin1.txt": ("caf\xe9 au lait\nsecond line".encode("latin-1"),
                   r"latin1.txt is not UTF-8 text: byte 0xe9 at byte offset 3 \(line 1\).*iconv"),
    "latin1.jsonl": (_lines(DOCS, 4, b'{"text": "na\xefve"}'),
                     r"latin1.jsonl is not UTF-8 text: byte 0xef at byte offset \d+ \(line 5\).*UTF-8"),
    "empty.jsonl": (b"", r"empty.jsonl is empty \(0 bytes\); remove it from data.source"),
    "broken.jsonl": (_lines(DOCS, 6, b'{"text": "unterminated'),
                     r"line 7 of .*broken.jsonl is not JSON \(Unterminated string.*column 10\)"),
    "prose.jsonl": (_lines(DOCS, 2, b"just some words"), r"line 3 of .*prose.jsonl is not JSON"),
    "array.jsonl": (_lines(DOCS, 8, b'["a", "b"]'),
                    r"line 9 of .*array.jsonl is a JSON array, not an object with a 'text' field"),
    "nofield.jsonl": (_lines(DOCS, 5, b'{"body": "x", "id": 5}'),
                      r"line 6 of .*nofield.jsonl has no 'text' field \(its keys: body, id\).*data.text_field"),
    "number.jsonl": (_lines(DOCS, 1, b'{"text": 17}'),
                     r"line 2 of .*number.jsonl holds a JSON number in 'text', not a string"),
    "list.json": (json.dumps([{"text": d} for d in DOCS] + [{"title": "x"}]).encode(),
                  r"element 12 of the JSON array in .*list.json has no 'text' field"),
    "random.parquet": (bytes(range(256)) * 16, r"random.parquet is not a parquet file \(Parquet magic bytes"),
    "latin1.parquet": (_parquet_bytes([d.encode() for d in DOCS[:3]] + [b"caf\xe9"]),
                       r"row 3 of .*latin1.parquet holds invalid UTF-8 in column 'text'"),
    "blank.jsonl": (b"\n  \n\n", r"blank.jsonl holds only blank lines"),
}


# A JSON number in the text field among good .jsonl files is cast to a string by datasets' loader and
# trains as text: a known limit (bench/RESULTS.md fault catalogue), so that pair is not listed.
@pytest.mark.parametrize("name, alone", [(n, a) for n in sorted(BAD_FILES) for a in (True, False)
                                         if a or n != "number.jsonl"])
def test_bad_source_file_is_one_data_error(tmp_path, name, alone):
    """A file datasets cannot read (or reads wrongly) ends in one DataError naming it and the place,
    alone or among good files of the same folder; nothing is published in the cache."""
    folder = tmp_path / "src"
    folder.mkdir()
    if not alone:
        write_jsonl(folder / "good.jsonl", random_docs(10, seed=3))
        (folder / "good.txt").write_text(random_docs(1, seed=4)[0])
    data, pattern = BAD_FILES[name]
    (folder / name).write_bytes(data)
    with pytest.raises(DataError, match=pattern) as err:
        prepare(data_cfg(tmp_path, [folder]), 512)
    assert "\n" not in str(err.value) and str(folder / name) in str(err.value)
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.name != "hf"] == []


def test_null_text_is_an_empty_document(tmp_path):
    src = tmp_path / "nulls.jsonl"
    src.write_bytes(_lines(DOCS, 3, b'{"text": null}'))
    assert sum(prepare(data_cfg(tmp_path, [src]), 512).n_docs.values()) == len(DOCS) - 1


def test_bad_file_with_tokenizer_processes(tmp_path):
    """Enough documents for data.num_proc=2 worker processes: still the same one line."""
    src = tmp_path / "many.jsonl"
    src.write_bytes(_lines(random_docs(1000, seed=5, words=(5, 20)), 950, b'{"text": "\xff"}'))
    with pytest.raises(DataError, match=r"many.jsonl is not UTF-8 text: .*\(line 951\)"):
        prepare(data_cfg(tmp_path, [src], num_proc=2), 512)


def test_error_in_a_tokenizer_process_is_one_data_error(tmp_path):
    """The id check runs in the data.num_proc worker processes; its DataError reaches the caller."""
    src = write_jsonl(tmp_path / "many.jsonl", random_docs(1000, seed=6, words=(5, 20)))
    tok = _gap_tokenizer(tmp_path, random_docs(1000, seed=6, words=(5, 20)))
    with pytest.raises(DataError, match="produced id 60000 >= its vocab size .*inconsistent"):
        prepare(data_cfg(tmp_path, [src], tokenizer=tok, num_proc=2), 65_536)


@pytest.mark.parametrize("max_id", [600, "damaged", None])
def test_cached_shards_with_ids_beyond_the_model(tmp_path, small_corpus, max_id):
    """meta.json's max_token_id is checked against model.vocab_size when a run reuses the cache."""
    cfg = data_cfg(tmp_path, [small_corpus])
    p = prepare(cfg, 512)
    meta = json.loads((p.dir / "meta.json").read_text())
    assert 0 < meta["max_token_id"] < p.vocab_size
    meta["vocab_size"] = 512  # as if written with a larger tokenizer, or edited
    if max_id is None:
        del meta["max_token_id"]
    else:
        meta["max_token_id"] = max_id
    (p.dir / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match=rf"shards in {p.dir} record max token id {max_id!r}.*"
                                        rf"model.vocab_size=512.*delete {p.dir} to rebuild"):
        prepare(cfg, 512)


@pytest.mark.parametrize("data, offset, line", [
    (b"ab\ncd\nef\ngh\nij\xff", 14, 5),
    ("ab\ncd\n\u00e9\u00e9\u00e9".encode() + b"\xc3\nx", 12, 3),
    ("abcdef\u00e9".encode() + b"\xc3\n", 8, 1),  # a character cut by the read, then a bad one
])
def test_utf8_offset_and_line_across_reads(tmp_path, monkeypatch, data, offset, line):
    from data import file_checks
    monkeypatch.setattr(file_checks, "CHUNK", 7)
    (tmp_path / "t.txt").write_bytes(data)
    msg = file_checks.problem([str(tmp_path / "t.txt")], "text", "text")
    assert f"at byte offset {offset} (line {line})" in msg
