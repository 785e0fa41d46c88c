"""Shared test set-up. pytest runs with --import-mode=importlib (pyproject.toml), which does not put
test folders on sys.path: add this folder so tests can import train_runner."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_dynamo_for_gpu_tests(request):
    """GPU tests start with dynamo's state as in a new process: one that compiled the trainer's step at
    other shapes (another test) would otherwise make the next compile of that code dynamic (automatic
    dynamic shapes), which no run meets (a run compiles one shape) and which dynamo cannot trace through
    our fused loss in torch 2.11 (kernels/NOTES.md)."""
    if request.node.get_closest_marker("gpu") is not None:
        import torch._dynamo

        torch._dynamo.reset()
    yield


@pytest.fixture(autouse=True)
def _inputs_by_test_id(request):
    """Each test's random inputs depend on its own id only (gpu_util.InputSeeds), not on which tests ran
    before it."""
    from gpu_util import InputSeeds

    InputSeeds.start_test(request.node.nodeid)
    yield
