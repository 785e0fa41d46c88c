"""Fixtures for the data tests. Helpers live in data_helpers.py; pytest runs with
--import-mode=importlib (pyproject), which does not put test folders on sys.path, so we do it here."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data_helpers import random_docs, write_jsonl  # noqa: E402


@pytest.fixture
def small_corpus(tmp_path) -> Path:
    """30 random documents in one JSON-lines file."""
    return write_jsonl(tmp_path / "corpus" / "docs.jsonl", random_docs(30, seed=1))
