"""Find the first bad byte, line or row of a local source file, so a load that fails (or loads something
it should not) ends with one `DataError` naming the file, the place and the fix.

`datasets` reports such problems deep inside its builders (DatasetGenerationError, StopIteration,
ArrowInvalid) without the file or the line, and it loads some of them silently: invalid UTF-8 inside a
JSON string, a JSON line without the text field. `load_documents` (data/sources.py) calls `problem`
when a load raises and `check_loaded` after a load; the scans here read each file once, in a stream,
and only on those paths, so a good corpus costs nothing extra.
"""
from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import Iterable, Optional

from data.errors import DataError

CHUNK = 1 << 20  # bytes read at a time when checking UTF-8
UTF8_FIX = "convert it to UTF-8 (e.g. `iconv -f latin1 -t utf-8 in > out`) or remove it from data.source"


def problem(files: Iterable[str], kind: str, field: str) -> Optional[str]:
    """The first problem found in `files` of format `kind` (text | json | parquet), or None."""
    for f in files:
        path = Path(f)
        try:
            msg = (empty(path, kind) or {"text": _text_problem, "json": _json_problem,
                                         "parquet": _parquet_problem}[kind](path, field))
        except OSError as e:  # unreadable (permissions, I/O error, removed meanwhile)
            msg = f"cannot read {path} ({e.strerror or e}); fix its permissions or remove it from data.source"
        if msg:
            return msg
    return None


def empty(path: Path, kind: str) -> Optional[str]:
    """A 0-byte JSON or parquet file cannot be parsed (a 0-byte text file is an empty document)."""
    if kind != "text" and path.stat().st_size == 0:
        return f"{path} is empty (0 bytes); remove it from data.source or write documents into it"
    return None


def _utf8_error(path: Path, err: UnicodeDecodeError, offset: int, line: int) -> str:
    bad = err.object[err.start:err.start + 1].hex()
    return (f"{path} is not UTF-8 text: byte 0x{bad} at byte offset {offset} (line {line}) cannot be "
            f"decoded; {UTF8_FIX}")


def _text_problem(path: Path, field: str) -> Optional[str]:
    """Invalid UTF-8 anywhere in the file: offset and line of the first bad byte."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    pos, lines = 0, 1  # bytes of the file before `data`; the line `data` starts in
    with open(path, "rb") as f:
        while True:
            data = f.read(CHUNK)
            pending = decoder.getstate()[0]  # bytes of a character cut by the previous read (no b"\n")
            try:
                decoder.decode(data, final=not data)
            except UnicodeDecodeError as e:
                start = e.start - len(pending)  # in `data`; negative when the cut character is bad
                return _utf8_error(path, e, pos + start, lines + data.count(b"\n", 0, max(start, 0)))
            if not data:
                return None
            pos += len(data)
            lines += data.count(b"\n")


def _json_problem(path: Path, field: str) -> Optional[str]:
    """JSON lines: the first line that is not UTF-8, not JSON, not an object, lacks `field`, or holds a
    non-string there. A file starting with '[' is one JSON array of objects, parsed as a whole."""
    with open(path, "rb") as f:
        head = f.read(CHUNK).lstrip()
    if head.startswith(b"["):
        return _json_array_problem(path, field)
    offset, rows = 0, 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return _utf8_error(path, e, offset + e.start, lineno)
            offset += len(raw)
            if not line.strip():
                continue  # blank lines are skipped by the loader too
            try:
                row = json.loads(line.rstrip("\r\n"))
            except ValueError as e:
                col = getattr(e, "colno", None)
                what = getattr(e, "msg", str(e)).removesuffix(" at")
                return (f"line {lineno} of {path} is not JSON ({what}{f' at column {col}' if col else ''}); "
                        f"fix or delete that line (JSON lines: one object per line)")
            msg = _row_problem(row, field, f"line {lineno} of {path}")
            if msg:
                return msg
            rows += 1
    if rows == 0:
        return f"{path} holds only blank lines; remove it from data.source or write documents into it"
    return None


def _json_array_problem(path: Path, field: str) -> Optional[str]:
    try:
        rows = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        before = path.read_bytes()[:e.start]
        return _utf8_error(path, e, e.start, before.count(b"\n") + 1)
    except ValueError as e:
        where = f"line {e.lineno} column {e.colno}" if hasattr(e, "lineno") else "somewhere"
        return f"{path} is not valid JSON ({getattr(e, 'msg', e)} at {where}); fix the file"
    if not isinstance(rows, list):
        return None
    for i, row in enumerate(rows):
        msg = _row_problem(row, field, f"element {i} of the JSON array in {path}")
        if msg:
            return msg
    return None


def _json_type(value) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "number",
            float: "number"}.get(type(value), type(value).__name__)


def _row_problem(row, field: str, where: str) -> Optional[str]:
    if not isinstance(row, dict):
        return (f"{where} is a JSON {_json_type(row)}, not an object with a '{field}' field; make every "
                f"line an object like {{\"{field}\": \"...\"}}")
    if field not in row:
        keys = ", ".join(sorted(row)) or "none"
        return (f"{where} has no '{field}' field (its keys: {keys}); add it, delete the line, or set "
                f"data.text_field")
    if row[field] is not None and not isinstance(row[field], str):
        return (f"{where} holds a JSON {_json_type(row[field])} in '{field}', not a string; make it text "
                f"or set data.text_field to a text field")
    return None  # a null text is an empty document, dropped like ""


def _parquet_problem(path: Path, field: str) -> Optional[str]:
    """Not a parquet file at all, or invalid UTF-8 in the text column (row number)."""
    import pyarrow.parquet as pq
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # ArrowInvalid "Parquet magic bytes not found", OSError, ...
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        return (f"{path} is not a parquet file ({first}); replace it with a valid parquet file, or give "
                f"it the extension of its real format")
    if field not in pf.schema_arrow.names:
        return None  # the column check in sources._text_column names the columns
    row = 0
    for batch in pf.iter_batches(columns=[field]):
        col = batch.column(0)
        try:
            col.validate(full=True)
        except Exception:  # find the row; Arrow's message gives no file
            for i in range(len(col)):
                try:
                    col[i].as_py()
                except UnicodeDecodeError:
                    return (f"row {row + i} of {path} holds invalid UTF-8 in column '{field}'; re-write "
                            f"that column as UTF-8 text or remove the file from data.source")
        row += len(col)
    return None


def check_loaded(ds, files: Iterable[str], kind: str, field: str) -> None:
    """After a load that raised nothing: a JSON row with no text (a line missing the field is loaded as
    null) or text that is not valid UTF-8 (Arrow's JSON reader does not check) is found in the files
    and reported; explicit nulls are fine (empty documents)."""
    col = ds.data.table.column("text")
    suspicious = kind == "json" and col.null_count > 0
    if not suspicious:
        try:
            for chunk in col.chunks:
                chunk.validate(full=True)  # UTF-8 of every string, in C++
        except Exception:
            suspicious = True
    if suspicious:
        msg = problem(files, kind, field)
        if msg:
            raise DataError(msg)
