"""The Hopper backward's tiled dQ accumulator layout (kernels/csrc/hopper/dq_tiles.h), checked on the host.

The layout math is plain C++ shared by the kernel, the post-pass and the allocation in flash_api.cpp;
`cpp/dq_tiles_check.cpp` compiles it with the host compiler and checks that a tile's slots map one to
one onto its cells, that packed sequences' tiles never overlap (2000 random batches) and that the
consumers' dQ staging stores into shared memory are free of bank conflicts. The GPU tests
check the values end to end (tests/kernels/test_kernels_gpu.py).
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _cuda_include() -> Path | None:
    """A folder holding cuda_runtime.h (dq_tiles.h includes flash.h, which includes it)."""
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and (Path(root) / "include" / "cuda_runtime.h").is_file():
            return Path(root) / "include"
    return None


def test_dq_tile_layout(tmp_path):
    cxx = shutil.which("g++") or shutil.which("c++")
    inc = _cuda_include()
    if cxx is None or inc is None:
        pytest.skip("needs a host C++ compiler and the CUDA headers (cuda_runtime.h)")
    exe = tmp_path / "dq_tiles_check"
    build = subprocess.run([cxx, "-std=c++17", "-O1", f"-I{inc}", str(HERE / "cpp" / "dq_tiles_check.cpp"),
                            "-o", str(exe)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr
