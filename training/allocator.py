"""The CUDA caching allocator's setting for our training processes (launch/train.py, bench/e2e.py)."""
from __future__ import annotations

import os


def expandable_segments_by_default() -> None:
    """Let the caching allocator map memory into growing segments instead of carving fixed-size ones.

    No fragmentation between the micro-batches' differently sized tensors, which the 2.7B-8k config's
    micro-batch 2 needs: ~84 of an H100's 85 GB with model.recompute_gelu_layers (bench/RESULTS.md).
    The setting is read at the process's first CUDA allocation, so call this before any;
    a user's own PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF wins.
    """
    if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ and "PYTORCH_ALLOC_CONF" not in os.environ:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
