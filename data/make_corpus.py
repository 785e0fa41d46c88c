"""Rebuild the small English corpus shipped in data/corpus/ (run once; the output is committed).

    pip download --no-binary :all: --no-deps sentencepiece -d /tmp/sp && tar xzf /tmp/sp/*.tar.gz -C /tmp/sp
    python -m data.make_corpus --botchan /tmp/sp/sentencepiece-*/test/botchan.txt

Writes two JSON-lines files, one document per line as {"text": ..., "title": ...}:
  botchan.jsonl      Natsume's *Botchan* (Project Gutenberg #8868): the translator's note + 11 chapters
  python_docs.jsonl  the Python language reference topics from the standard library's pydoc_data
Documents are real units (a chapter, a reference topic), so the EOS between them marks a true boundary.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

CORPUS_DIR = Path(__file__).resolve().parent / "corpus"
START = "*** START OF THIS PROJECT GUTENBERG EBOOK"
END = "--(THE END)--"  # last line of the story; the transcriber's errata list and licence follow
CHAPTER = re.compile(r"^CHAPTER [IVX]+\.?$")


def botchan_documents(raw: bytes) -> list[dict]:
    """Strip BOM, CRLF and the Gutenberg header/footer; one document per chapter (+ the note)."""
    text = raw.decode("utf-8-sig").replace("\r\n", "\n").replace("\r", "\n")
    lines = text.split("\n")
    start = next(i for i, l in enumerate(lines) if l.startswith(START))
    end = next(i for i, l in enumerate(lines) if l.strip() == END)
    body = lines[start + 1:end + 1]
    # the header block before the translator's note: "Produced by", title page lines
    note = next(i for i, l in enumerate(body) if l.strip() == "A NOTE BY THE TRANSLATOR")
    body = body[note:]
    docs, title, buf = [], "A NOTE BY THE TRANSLATOR", []
    for line in body[1:]:
        if CHAPTER.match(line.strip()):
            docs.append({"title": title, "text": _clean(buf)})
            title, buf = line.strip().rstrip("."), []
        elif line.strip() != "BOTCHAN (MASTER DARLING)":  # repeated book title before chapter I
            buf.append(line)
    docs.append({"title": title, "text": _clean(buf)})
    return docs


def _clean(lines: list[str]) -> str:
    return "\n".join(l.rstrip() for l in lines).strip() + "\n"


def python_doc_documents() -> list[dict]:
    """pydoc_data.topics: {topic: text}, ~465k characters of the Python reference (PSF licence)."""
    from pydoc_data.topics import topics
    return [{"title": k, "text": topics[k].strip() + "\n"} for k in sorted(topics)]


def write_jsonl(path: Path, docs: list[dict]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for d in docs:
            f.write(json.dumps({"text": d["text"], "title": d["title"]}, ensure_ascii=False) + "\n")
    print(f"{path}: {len(docs)} documents, {path.stat().st_size} bytes")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--botchan", required=True, help="test/botchan.txt from the sentencepiece sdist")
    ap.add_argument("--out", default=str(CORPUS_DIR))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "botchan.jsonl", botchan_documents(Path(args.botchan).read_bytes()))
    write_jsonl(out / "python_docs.jsonl", python_doc_documents())
    print(f"python_docs from Python {sys.version.split()[0]}")


if __name__ == "__main__":
    main()
