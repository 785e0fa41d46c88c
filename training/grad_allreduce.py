"""Data parallelism without DDP's hooks: the gradients are summed over the ranks after the last
micro-batch of an accumulation, in place.

Why: the weight cache (training/weight_cache.py) and the weight-gradient GEMMs that add straight into
the fp32 .grad (kernels/wgrad.py) bypass the parameters' AccumulateGrad, which is where torch DDP hooks
its gradient reduction, so under DDP the trainer ran without them (several % of a step on an H100,
bench/RESULTS.md sessions 14-16), and DDP's bucket copies of the gradients (+10.8 GB at 2.7B) kept
micro-batch 2 off 80 GB GPUs. Here whatever wrote a gradient (AccumulateGrad, the cache's fold hooks,
the fp32 GEMMs) wrote it into the parameter's own .grad, and `all_reduce_grads` sums those over the
ranks: each large gradient in place, the small ones (biases, norms) packed into one buffer first so
that they cost one collective, not one each. The caller scales its loss by 1 / world_size, so the sum
is the mean.

The reduction runs after the backward, not during it as DDP's does: on one node (NVLink) that is about
1% of a step at 8 accumulated micro-batches (bench/RESULTS.md session 24); across nodes, where the
all-reduce is slower, DDP's overlap wins, and `engine.grad_sync=auto` keeps DDP there
(training/engine.py `grad_sync_choice`).
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

SMALL_NUMEL = 1 << 20  # gradients below this many elements share one packed all-reduce


@torch.no_grad()
def all_reduce_grads(params: Iterable[torch.nn.Parameter], small_numel: int = SMALL_NUMEL) -> None:
    """Sum every parameter's .grad over all ranks, in place (queued on the device; no host sync).
    Parameters without a .grad are skipped, so every rank must have the same ones (a replicated model
    trained on the same code path does)."""
    small = []
    for p in params:
        if p.grad is None:
            continue
        if p.grad.numel() >= small_numel and p.grad.is_contiguous():
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        else:
            small.append(p.grad)
    by_dtype = {}
    for g in small:
        by_dtype.setdefault((g.dtype, g.device), []).append(g)
    for grads in by_dtype.values():
        packed = _flatten_dense_tensors(grads)
        dist.all_reduce(packed, op=dist.ReduceOp.SUM)
        for g, reduced in zip(grads, _unflatten_dense_tensors(packed, grads)):
            g.copy_(reduced)


@torch.no_grad()
def broadcast_from_rank0(module: torch.nn.Module) -> None:
    """Make every rank's parameters and buffers rank 0's (what DDP does when it wraps a module)."""
    for t in [*module.parameters(), *module.buffers()]:
        dist.broadcast(t.data, src=0)
