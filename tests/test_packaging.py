"""The top-level packages import from this checkout (not a same-named package from the registry)."""
import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", ["model", "kernels", "training", "data", "launch"])
def test_package_is_ours(name):
    mod = importlib.import_module(name)
    assert Path(mod.__file__).resolve().parent == REPO / name, mod.__file__


def test_layout_is_the_users():
    for folder in ["model", "kernels", "training", "data", "configs", "launch", "tests"]:
        assert (REPO / folder).is_dir(), folder
    assert (REPO / "pyproject.toml").is_file()


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    assert "bash tests/run.sh" in readme
    assert "bash tests/run.sh" in (REPO / ".ci" / "run").read_text()
