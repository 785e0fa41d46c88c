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
