"""The data package's one error class, in a module of its own so every data module can raise it without
importing another (data/sources.py re-exports it: `from data.sources import DataError` is the public
name the launcher and the tests use)."""


class DataError(ValueError):
    """A data problem, with one message naming the problem and the fix."""
