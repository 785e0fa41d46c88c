"""prepare(): documents -> split -> tokenizer -> shards, cache key, idempotence, atomicity, formats."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import data.prepare as prep
from data import tokenizer as toklib
from data.prepare import prepare
from data.shards import open_split
from data.sources import REPO_ROOT
from data_helpers import data_cfg, random_docs, write_jsonl


def decode_docs(p, split):
    """The documents of a split, read back from its shards (EOS-separated)."""
    tok = toklib.load(p.tokenizer_path)
    _, maps = open_split(p.dir, split)
    ids = np.concatenate(maps).astype(np.int64)
    assert ids[-1] == p.eos_id
    ends = np.flatnonzero(ids == p.eos_id)
    starts = np.r_[0, ends[:-1] + 1]
    return [tok.decode(ids[s:e].tolist()) for s, e in zip(starts, ends)]


def test_prepare_round_trip(tmp_path, small_corpus):
    docs = random_docs(30, seed=1)
    p = prepare(data_cfg(tmp_path, [small_corpus]), model_vocab_size=512)
    assert p.vocab_size <= 320 and p.dtype == "uint16" and p.dir.parent == tmp_path / "cache"
    train, val = decode_docs(p, "train"), decode_docs(p, "val")
    assert len(val) >= 1 and len(train) + len(val) == 30
    assert sorted(train + val) == sorted(docs)  # every document exactly once, text intact
    assert [d for d in docs if d in train] == train  # corpus order kept inside a split
    assert p.n_docs == {"train": len(train), "val": len(val)}
    meta = json.loads((p.dir / "meta.json").read_text())
    assert meta["tokenizer_hash"] == p.tokenizer_hash == toklib.fingerprint(toklib.load(p.tokenizer_path))
    assert meta["eos_id"] == p.eos_id and meta["vocab_size"] == p.vocab_size
    assert {k: v["n_tokens"] for k, v in meta["splits"].items()} == p.n_tokens
    assert meta["key"] == p.dir.name and meta["format_version"] == 1
    assert meta["max_token_id"] < p.vocab_size


def test_split_is_deterministic_and_min_one_val(tmp_path, small_corpus):
    a = prepare(data_cfg(tmp_path, [small_corpus], val_fraction=0.001), 512)  # 0.03 expected val docs
    assert a.n_docs["val"] == 1 and a.n_docs["train"] == 29
    b = prepare(data_cfg(tmp_path / "other", [small_corpus], val_fraction=0.001), 512)
    assert decode_docs(a, "val") == decode_docs(b, "val") and a.tokenizer_hash == b.tokenizer_hash


def test_idempotent_cache(tmp_path, small_corpus, monkeypatch):
    cfg = data_cfg(tmp_path, [small_corpus])
    first = prepare(cfg, 512)
    monkeypatch.setattr(prep, "_build", lambda *a, **k: pytest.fail("rebuilt a cached folder"))
    assert prepare(cfg, 512) == first
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.name != "hf"] == [first.dir.name]


def test_key_follows_content_and_settings(tmp_path, small_corpus):
    base = prepare(data_cfg(tmp_path, [small_corpus]), 512)
    other_vocab = prepare(data_cfg(tmp_path, [small_corpus], tokenizer_vocab_size=300), 512)
    write_jsonl(small_corpus, random_docs(30, seed=2))  # same path, new content
    other_text = prepare(data_cfg(tmp_path, [small_corpus]), 512)
    assert len({base.dir, other_vocab.dir, other_text.dir}) == 3


def test_crash_leaves_no_valid_cache(tmp_path, small_corpus, monkeypatch):
    cfg = data_cfg(tmp_path, [small_corpus])

    def boom(self, ids):
        raise KeyboardInterrupt("killed while writing shards")
    monkeypatch.setattr(prep.ShardWriter, "write", boom)
    with pytest.raises(KeyboardInterrupt):
        prepare(cfg, 512)
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.name != "hf"] == []  # temp folder gone
    monkeypatch.undo()
    assert prepare(cfg, 512).n_tokens["train"] > 0


def test_leftover_temp_folder_ignored_and_cleaned(tmp_path, small_corpus):
    cfg = data_cfg(tmp_path, [small_corpus])
    key, _ = prep.cache_key(cfg, prep.resolve_sources(cfg.source, "auto"), None, prep.SHARD_TOKENS)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer runs: the crashed builder
    host = prep.socket.gethostname()
    tmp = tmp_path / "cache" / f".tmp-{key}-{host}-{dead.pid}"
    tmp.mkdir(parents=True)
    (tmp / ".owner").write_text(json.dumps({"host": host, "pid": dead.pid}))
    (tmp / "train_000000.bin").write_bytes(b"\x01\x02" * 10)  # half-written shard
    live = tmp_path / "cache" / f".tmp-{key}-{host}-{os.getpid()}x"  # a live builder's: left alone
    live.mkdir()
    (live / ".owner").write_text(json.dumps({"host": host, "pid": os.getpid()}))
    p = prepare(cfg, 512)
    assert p.dir.name == key and not tmp.exists() and live.exists()
    assert p.n_tokens["train"] > 0


def test_formats_and_folders(tmp_path):
    docs = random_docs(12, seed=7)
    folder = tmp_path / "mixed"
    for i, d in enumerate(docs[:4]):  # text: one document per file
        (folder / "txt" / f"doc{i}.txt").parent.mkdir(parents=True, exist_ok=True)
        (folder / "txt" / f"doc{i}.txt").write_text(d)
    write_jsonl(folder / "a.jsonl", docs[4:8], field="body")
    import pyarrow as pa, pyarrow.parquet as pq
    pq.write_table(pa.table({"body": docs[8:], "n": list(range(4))}), folder / "b.parquet")
    (folder / "README.md").write_text("not a document")  # unknown extensions in folders are skipped
    (folder / ".hidden").mkdir()
    (folder / ".hidden" / "x.txt").write_text("hidden files are skipped")
    p = prepare(data_cfg(tmp_path, [folder], text_field="body", val_fraction=0.3), 512)
    got = decode_docs(p, "train") + decode_docs(p, "val")
    assert sorted(got) == sorted(docs)


def test_relative_source_resolves_against_repo_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # data/corpus is not under the cwd
    sources = prep.resolve_sources(["data/corpus"], "auto")
    assert sources[0].files and all(f.is_relative_to(REPO_ROOT / "data" / "corpus") for f in sources[0].files)
    (tmp_path / "data" / "corpus").mkdir(parents=True)  # the cwd wins when it has the path
    write_jsonl(tmp_path / "data" / "corpus" / "x.jsonl", ["local"])
    assert prep.resolve_sources(["data/corpus"], "auto")[0].files == (tmp_path / "data" / "corpus" / "x.jsonl",)


def test_parallel_tokenization_matches_serial(tmp_path, small_corpus, monkeypatch):
    serial = prepare(data_cfg(tmp_path / "s", [small_corpus], num_proc=1), 512)
    monkeypatch.setattr(prep, "MIN_DOCS_PER_PROC", 1)  # force datasets.map worker processes
    par = prepare(data_cfg(tmp_path / "p", [small_corpus], num_proc=2), 512)
    for split in ("train", "val"):
        a, b = open_split(serial.dir, split)[1], open_split(par.dir, split)[1]
        np.testing.assert_array_equal(np.concatenate(a), np.concatenate(b))


def test_tokenizer_file_and_uint32(tmp_path, small_corpus):
    """A given tokenizer.json is used as is; a vocab over 65536 switches the shards to uint32."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    words = sorted({w for d in random_docs(30, seed=1) for w in d.split()})
    vocab = {toklib.EOS: 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(words)}}
    n = len(vocab)
    vocab.update({f"filler{i}": n + i for i in range(70_000 - n)})  # ids up to 69999
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "big.json"))
    p = prepare(data_cfg(tmp_path, [small_corpus], tokenizer=str(tmp_path / "big.json")), 70_000)
    assert p.dtype == "uint32" and p.vocab_size == 70_000 and p.eos_id == 0
    assert p.tokenizer_hash == toklib.fingerprint(tok)
    ids = np.concatenate(open_split(p.dir, "train")[1])
    assert ids.dtype == np.uint32 and 1 not in ids  # every word known: no [UNK]
    assert (ids == 0).sum() == p.n_docs["train"]


def test_shipped_corpus_prepare(tmp_path):
    p = prepare(data_cfg(tmp_path, ["data/corpus"], tokenizer_vocab_size=1024, val_fraction=0.05), 1024)
    assert p.n_docs["train"] + p.n_docs["val"] == 91 and p.n_docs["val"] >= 1
    assert p.vocab_size == 1024 and p.n_tokens["train"] > 150_000
    val = decode_docs(p, "val")
    assert all(len(d) > 100 for d in val)


def test_cli(tmp_path, small_corpus):
    """launch/prepare_data.py: the summary on stdout; bad data is one line and exit code 2."""
    script = str(REPO_ROOT / "launch" / "prepare_data.py")
    out = subprocess.run([sys.executable, script, f"data.source=[{small_corpus}]",
                          f"data.cache_dir={tmp_path / 'cache'}", "data.tokenizer_vocab_size=300",
                          "data.num_proc=1"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "tokens in" in out.stdout and str(tmp_path / "cache") in out.stdout
    bad = subprocess.run([sys.executable, script, f"data.source=[{tmp_path / 'nope.txt'}]"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.startswith("data error: ") and "not found" in bad.stderr
    config = subprocess.run([sys.executable, script, "data.nope=1"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert config.returncode == 2 and config.stderr.startswith("config error: "), config.stderr


def test_the_data_package_has_no_command_line(tmp_path):
    """`python -m data.prepare` names the command that prepares data rather than doing nothing."""
    out = subprocess.run([sys.executable, "-m", "data.prepare"], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0 and "launch/prepare_data.py" in out.stderr and "Traceback" not in out.stderr


def test_concurrent_builders_agree(tmp_path, small_corpus):
    """Ranks that forget the barrier race to build the same key: all succeed and see one folder."""
    code = ("import sys; from data.prepare import prepare; from training.config import DataConfig;"
            f"p = prepare(DataConfig(source=[{str(small_corpus)!r}], cache_dir={str(tmp_path / 'c')!r},"
            "tokenizer_vocab_size=320, num_proc=1), 512); print(p.dir, p.tokenizer_hash)")
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs) and outs[0] == outs[1] != ""
    assert not list((tmp_path / "c").glob(".tmp-*"))


def test_losing_the_publish_race_keeps_the_winner(tmp_path, small_corpus, monkeypatch):
    cfg = data_cfg(tmp_path, [small_corpus])
    winner = prepare(data_cfg(tmp_path / "w", [small_corpus]), 512)
    real_write = prep._write

    def write_then_someone_publishes(cfg_, sources, tok, spec, root, tmp, *a):
        meta = real_write(cfg_, sources, tok, spec, root, tmp, *a)
        import shutil
        shutil.copytree(winner.dir, root / winner.dir.name)  # another rank finished first
        return meta
    monkeypatch.setattr(prep, "_write", write_then_someone_publishes)
    p = prepare(cfg, 512)
    assert p.dir == tmp_path / "cache" / winner.dir.name and p.tokenizer_hash == winner.tokenizer_hash
    assert not list((tmp_path / "cache").glob(".tmp-*"))
