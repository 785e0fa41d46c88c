"""Helpers of the GPU tests of our extension's ops (import after the module's CUDA skip)."""
from __future__ import annotations

import itertools

import pytest
import torch


def require_extension():
    """Fail (not skip) when the extension did not build: on a GPU machine that is a defect."""
    import kernels

    if not kernels.is_available():
        pytest.fail("extension did not build: " + kernels.unavailable_reason())


def ext():
    from kernels.build import load_extension

    return load_extension()


def fresh_factory(first_seed: int):
    """fresh(*shape, dtype=bf16, scale=1.0): a new seeded N(0, scale^2) CUDA tensor per call."""
    seeds = itertools.count(first_seed)

    def fresh(*shape, dtype=torch.bfloat16, scale=1.0):
        torch.manual_seed(next(seeds))
        return (torch.randn(*shape, device="cuda") * scale).to(dtype)

    return fresh


# Attention backward paths: name -> the environment switch that selects it (kernels/csrc/hopper/dispatch.h),
# None = the default dispatch. On Hopper the default is the TMA kernel (head dims 64 / 128) unless the
# dQ tiles would not fit, then the cp.async kernel (128) or FA2 (64); head dim 96 is always FA2.
BACKWARD_PATHS = {"default": None, "fa2": ("FLASHGPT_SM90", "0"), "fa2_bwd": ("FLASHGPT_SM90_BWD", "0"),
                  "cpasync": ("FLASHGPT_SM90_WS", "0"), "lockstep": ("FLASHGPT_SM90_BWD_PINGPONG", "0"),
                  "turns": ("FLASHGPT_SM90_BWD_PINGPONG", "1"), "headmajor": ("FLASHGPT_GRID_ORDER", "head")}
ANY_GPU_PATHS = ("default", "headmajor")  # the others choose between Hopper kernel families


def select_backward_path(name: str, monkeypatch) -> str:
    """Set `name`'s switch for this test (skip where it selects nothing: off Hopper)."""
    if name not in ANY_GPU_PATHS and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("one kernel family off Hopper")
    if BACKWARD_PATHS[name] is not None:
        monkeypatch.setenv(*BACKWARD_PATHS[name])
    return name


def skip_same_kernel(d: int, path: str) -> None:
    if d == 96 and path not in ("default", "fa2", "headmajor"):
        pytest.skip("head dim 96 runs FA2 on every path")


def every_case(test):
    """Parametrize over both 16-bit dtypes, head dims 64 / 96 / 128, causal or not."""
    test = pytest.mark.parametrize("causal", [False, True])(test)
    test = pytest.mark.parametrize("d", [64, 96, 128])(test)
    return pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])(test)


def cu_seqlens(lengths) -> torch.Tensor:
    """Cumulative offsets [0, l0, l0 + l1, ...] (int32, CUDA) of packed sequences."""
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")


def backward_path_fixture(names):
    """A `path` fixture over `names` of BACKWARD_PATHS (assign it to `path` in the test module)."""
    @pytest.fixture(params=list(names))
    def path(request, monkeypatch):
        return select_backward_path(request.param, monkeypatch)

    return path
