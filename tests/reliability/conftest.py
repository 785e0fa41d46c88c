"""Shared fixtures for the reliability tests: one data cache and one uninterrupted 2-process reference
run for the whole session. The launch/kill/resume harness is bench/fault_trials.py."""
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
import fault_trials  # noqa: E402

STEPS = 12  # 4 checkpoints (every 3 steps), 2 micro-batches per step, 2 ranks


@pytest.fixture(scope="session")
def steps() -> int:
    return STEPS


@pytest.fixture(scope="session")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("reliability")


@pytest.fixture(scope="session")
def cache_dir(work) -> Path:
    return work / "cache"


@pytest.fixture(scope="session")
def reference(work, cache_dir) -> dict:
    """step -> loss of an uninterrupted 2-process run of STEPS steps."""
    curve = fault_trials.straight(work, cache_dir, STEPS, nproc=2)
    assert sorted(curve) == list(range(1, STEPS + 1))
    return curve
