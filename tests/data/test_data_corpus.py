"""The shipped corpus: clean, documented, real documents."""
import json

from data.sources import REPO_ROOT

CORPUS = REPO_ROOT / "data" / "corpus"


def test_corpus_files_are_clean_and_documented():
    readme = (CORPUS / "README.md").read_text()
    files = sorted(CORPUS.glob("*.jsonl"))
    assert [f.name for f in files] == ["botchan.jsonl", "python_docs.jsonl"]
    assert sum(f.stat().st_size for f in files) < 1_500_000
    n = 0
    for f in files:
        assert f"`{f.name}`" in readme and "icence" in readme  # source and licence named
        raw = f.read_bytes()
        assert b"\r" not in raw and not raw.startswith(b"\xef\xbb\xbf")
        docs = [json.loads(line) for line in raw.decode().splitlines()]
        assert all(d["text"].strip() and d["title"] for d in docs)
        assert not any("Gutenberg" in d["text"] for d in docs)  # header and licence stripped
        n += len(docs)
    assert n == 91
    botchan = [json.loads(line) for line in (CORPUS / "botchan.jsonl").read_text().splitlines()]
    assert botchan[1]["title"] == "CHAPTER I" and botchan[-1]["text"].rstrip().endswith("--(THE END)--")
