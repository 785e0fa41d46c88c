"""Shared test set-up. pytest runs with --import-mode=importlib (pyproject.toml), which does not put
test folders on sys.path: add this folder so tests can import train_runner."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
