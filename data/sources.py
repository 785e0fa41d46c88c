"""Find and load the documents named by `data.source`: local text/json/parquet files or folders, or a
dataset on the Hugging Face hub.

A *document* is one unit the trainer separates with EOS:
  text     one document per file (the `datasets` text builder with sample_by="document")
  json     one document per row (JSON lines or a JSON array), text in column `text_field`
  parquet  one document per row, text in column `text_field`
  hub      one document per row of the `train` split, text in column `text_field`
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

from data.errors import DataError  # also the public name data.sources.DataError

REPO_ROOT = Path(__file__).resolve().parent.parent
EXTENSIONS = {"text": (".txt", ".text"), "json": (".jsonl", ".json"), "parquet": (".parquet",)}
# "owner/name" or "name", optionally ":config" — anything else that is not on disk is a missing path
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?(:[\w.-]+)?$")


@dataclass(frozen=True)
class Source:
    entry: str  # as written in data.source
    files: tuple = ()  # resolved local files, sorted (empty for a hub dataset)
    hub: Optional[str] = None  # hub dataset id ("owner/name" or "owner/name:config")


def resolve_path(entry: str) -> Optional[Path]:
    """A relative path is looked up in the current directory first, then in the repository root."""
    p = Path(entry).expanduser()
    for cand in ([p] if p.is_absolute() else [Path.cwd() / p, REPO_ROOT / p]):
        if cand.exists():
            return cand.resolve()
    return None


def file_format(path: Path, fmt: str) -> str:
    """The loader for one file: `fmt` unless auto, else picked by the file extension."""
    if fmt != "auto":
        return fmt
    name = path.name.lower()
    for kind, exts in EXTENSIONS.items():
        if name.endswith(exts):
            return kind
    raise DataError(f"cannot tell the format of {path} from its extension; name it .txt/.jsonl/.json/"
                    f".parquet or set data.format=text|json|parquet")


def _folder_files(folder: Path, fmt: str) -> List[Path]:
    exts = sum(EXTENSIONS.values(), ()) if fmt == "auto" else EXTENSIONS[fmt]
    files = [p for p in folder.rglob("*") if p.is_file() and p.name.lower().endswith(exts)
             and not any(part.startswith(".") for part in p.relative_to(folder).parts)]
    if not files:
        raise DataError(f"data.source folder {folder} holds no {'/'.join(exts)} files; add documents "
                        f"there or point data.source at another folder")
    return sorted(files)


def resolve_sources(entries: Sequence[str], fmt: str) -> List[Source]:
    """Each entry -> a local file, a folder (expanded, sorted) or a hub id; a missing path is an error."""
    if not entries:
        raise DataError("data.source is empty: name at least one file, folder or hub dataset")
    out = []
    for entry in entries:
        entry = str(entry)
        path = resolve_path(entry)
        if path is not None:
            files = _folder_files(path, fmt) if path.is_dir() else [path]
            for f in files:
                file_format(f, fmt)  # fail early on an unknown extension
            out.append(Source(entry, files=tuple(files)))
        elif HUB_ID.match(entry) and not entry.lower().endswith(sum(EXTENSIONS.values(), ())):
            out.append(Source(entry, hub=entry))
        else:
            raise DataError(f"data.source '{entry}' not found (looked in {Path.cwd()} and {REPO_ROOT}); "
                            f"fix the path or name a hub dataset as owner/name")
    return out


def signature(sources: Sequence[Source]) -> list:
    """What identifies the input: (path, size, mtime) per local file; the id for a hub dataset."""
    sig = []
    for s in sources:
        if s.hub:
            sig.append({"hub": s.hub})
        for f in s.files:
            st = f.stat()
            sig.append({"path": str(f), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    return sig


def _text_column(ds, field: str, where: str):
    """Keep only the text column, renamed to "text"; check it holds strings."""
    import datasets
    if field not in ds.column_names:
        raise DataError(f"column '{field}' not found in {where}; its columns are {ds.column_names}; "
                        f"set data.text_field to the one holding the text")
    dtype = getattr(ds.features[field], "dtype", None)
    if dtype not in ("string", "large_string"):
        raise DataError(f"column '{field}' in {where} holds {ds.features[field]}, not text; set "
                        f"data.text_field to a string column")
    ds = ds.select_columns([field])
    if field != "text":
        ds = ds.rename_column(field, "text")
    return ds.cast_column("text", datasets.Value("string"))


def _load_hub(source: Source, field: str, cache_dir: str, num_proc: int):
    import datasets
    name, _, config = source.hub.partition(":")
    try:
        ds = datasets.load_dataset(name, config or None, split="train", cache_dir=cache_dir,
                                   num_proc=num_proc if num_proc > 1 else None)
    except Exception as e:  # offline, no such dataset, gated, ...
        raise DataError(f"data.source '{source.entry}' is not a local file or folder (looked in "
                        f"{Path.cwd()} and {REPO_ROOT}) and loading it from the hub failed "
                        f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); fix the path, or "
                        f"check the dataset name and the network") from None
    return _text_column(ds, field, f"hub dataset {source.hub}")


def _load_local(kind: str, files: List[str], field: str, entry: str, cache_dir: str):
    """One format's files of a source as a dataset with the column "text". A file that cannot be
    read, or holds rows that are not documents, is a DataError naming the file and the line."""
    import datasets
    from data import file_checks
    for f in files:
        msg = file_checks.empty(Path(f), kind)
        if msg:
            raise DataError(msg)
    kwargs = {"sample_by": "document", "keep_linebreaks": True} if kind == "text" else {}
    quiet = logging.getLogger("datasets")  # its builders log the raw parse error: we report it below
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        ds = datasets.load_dataset(kind, data_files=files, split="train", cache_dir=cache_dir, **kwargs)
    except MemoryError:
        raise
    except Exception as e:  # datasets wraps the cause (DatasetGenerationError, StopIteration, ...)
        msg = file_checks.problem(files, kind, field)
        if msg is None:  # nothing found by our own scan: name the files and the innermost cause
            while (e.__cause__ or e.__context__) is not None:
                e = e.__cause__ or e.__context__
            first = str(e).splitlines()[0] if str(e) else ""
            names = ", ".join(files) if len(files) <= 3 else f"{files[0]} ... ({len(files)} files)"
            msg = (f"cannot load {names} as {kind} ({type(e).__name__}: {first}); check that the files "
                   f"are valid {kind}, or set data.format")
        raise DataError(msg) from None
    finally:
        quiet.setLevel(level)
    try:
        ds = _text_column(ds, field, entry)
    except DataError:  # the column is there but not text (numbers in some JSON lines): name the line
        msg = file_checks.problem(files, kind, field) if field in ds.column_names else None
        if msg is None:
            raise
        raise DataError(msg) from None
    file_checks.check_loaded(ds, files, kind, field)
    return ds


def load_documents(sources: Sequence[Source], fmt: str, field: str, cache_dir: str, num_proc: int):
    """All documents as one `datasets.Dataset` with a single string column "text"; empty ones dropped."""
    import datasets
    parts = []
    for s in sources:
        if s.hub:
            parts.append(_load_hub(s, field, cache_dir, num_proc))
            continue
        groups: dict = {}  # format -> files, in first-seen order (deterministic)
        for f in s.files:
            groups.setdefault(file_format(f, fmt), []).append(str(f))
        for kind, files in groups.items():
            parts.append(_load_local(kind, files, "text" if kind == "text" else field, s.entry, cache_dir))
    ds = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    ds = ds.filter(_non_empty, batched=True)
    if len(ds) == 0:
        names = ", ".join(s.entry for s in sources)
        raise DataError(f"empty corpus: no text in data.source [{names}] (column '{field}'); point "
                        f"data.source at files with text, or fix data.text_field")
    return ds


def _non_empty(batch: dict) -> List[bool]:
    return [bool(t and t.strip()) for t in batch["text"]]
