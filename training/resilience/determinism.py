"""train.deterministic: a run whose every step is a function of its inputs, so that 2N steps and
N steps + a crash + N resumed steps give the same losses bit for bit, on a GPU too.

What varies run to run otherwise, and what this turns off:
- our attention backward adds dQ contributions with atomics in whatever order blocks finish; the
  attention modules' `deterministic` flag makes key blocks add in a fixed order (kernels/flash_attn.py);
- cuBLAS picks split-K reductions by workspace: CUBLAS_WORKSPACE_CONFIG=:4096:8 fixes it (read when
  cuBLAS starts, so this runs before the first GEMM);
- PyTorch ops with atomic-add kernels (index_add, scatter, embedding backward...) take their
  deterministic versions (torch.use_deterministic_algorithms; warn_only, so an op without one warns
  once instead of stopping a long run: the bit-identical resume test on a GPU is the check);
- cuDNN's autotuner (benchmark) and TorchInductor's on-device autotuning could pick other kernels in
  the resumed process: both off.
Cost: the attention backward's ordered dQ and inductor's untuned picks (bench/RESULTS.md).
"""
from __future__ import annotations

import os

import torch


def make_deterministic(model: torch.nn.Module) -> str:
    """Apply the settings above to this process and `model`; returns a line for the run banner."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    import torch._inductor.config as inductor_config

    inductor_config.deterministic = True
    flagged = 0
    for module in model.modules():
        if hasattr(module, "deterministic"):
            module.deterministic = True
            flagged += 1
    return f"deterministic ({flagged} attention layers ordered, torch deterministic algorithms, cuBLAS workspace fixed)"
