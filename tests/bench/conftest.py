"""The tools under bench/ are scripts, not a package: put the folder on sys.path so their tests
import them as the scripts import each other."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
