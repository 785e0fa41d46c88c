"""The rank layout of context parallelism (engine.context_parallel_size = C): context groups of C
consecutive ranks (ranks g*C .. g*C + C - 1 hold the C slices of the same windows, so on nodes of a
multiple of C GPUs a group's all-to-alls stay inside one node), and D = world_size / C data-parallel
ranks across them (data rank g = rank // C).

Gradients need no group of their own: parameters are replicated on every rank and each rank's loss is
the mean over its slice, all slices of the same size, so the mean over all ranks (DDP's all-reduce,
FSDP2's reduce-scatter over the world) is the mean over every data-parallel sequence's whole window.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch.distributed as tdist

from training.distributed import DistInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ContextLayout:
    size: int = 1  # C: ranks sharing one window
    rank: int = 0  # this rank's slice, 0 .. C - 1
    data_rank: int = 0  # which data-parallel shard of the batch this rank's group reads
    data_size: int = 1  # D = world_size / C data-parallel ranks
    group: Optional[object] = None  # the process group of this rank's context group (None when C == 1)

    @property
    def enabled(self) -> bool:
        return self.size > 1


def spans_nodes(size: int, ranks_per_node: int) -> Optional[str]:
    """The warning for context groups that cross a node boundary (None when each lies inside a node)."""
    if ranks_per_node % size == 0:
        return None
    return (f"engine.context_parallel_size={size} does not divide the {ranks_per_node} ranks per node: some "
            f"context groups span two nodes and their all-to-alls cross the slower inter-node link")


def context_layout(dist: DistInfo, size: int) -> ContextLayout:
    """Collective when size > 1 (every rank creates every context group, in the same order)."""
    if size <= 1:
        return ContextLayout(1, 0, dist.rank, dist.world_size, None)
    if dist.world_size % size:
        raise ValueError(f"context_parallel_size={size} does not divide world_size={dist.world_size}")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.world_size))  # ranks per node (torchrun sets it)
    warning = spans_nodes(size, local)
    if warning and dist.is_main:
        log.warning(warning)
    mine = None
    for first in range(0, dist.world_size, size):
        group = tdist.new_group(list(range(first, first + size)))
        if first <= dist.rank < first + size:
            mine = group
    return ContextLayout(size, dist.rank % size, dist.rank // size, dist.world_size // size, mine)
