"""Data parallelism without DDP's hooks: the gradients are summed over the ranks after the last
micro-batch of an accumulation, in place.

Why: the weight cache (training/engines/weight_cache.py) and the weight-gradient GEMMs that add straight into
the fp32 .grad (kernels/wgrad.py) bypass the parameters' AccumulateGrad, which is where torch DDP hooks
its gradient reduction, so under DDP the trainer runs without them (several % of a step on an H100,
bench/RESULTS.md), and DDP's bucket copies of the gradients (+10.8 GB at 2.7B) keep
micro-batch 2 off 80 GB GPUs. Here whatever wrote a gradient (AccumulateGrad, the cache's fold hooks,
the fp32 GEMMs) wrote it into the parameter's own .grad, and `all_reduce_grads` sums those over the
ranks: each large gradient in place, the small ones (biases, norms) packed into one buffer first so
that they cost one collective, not one each. The caller scales its loss by 1 / world_size, so the sum
is the mean.

`all_reduce_grads` runs after the backward, not during it as DDP's reduction does: on one node
(NVLink) that costs about 1% of a step at 4 micro-batches per GPU (bench/RESULTS.md);
across nodes, where the all-reduce is slower, DDP's overlap wins, and `engine.grad_sync=auto` keeps
DDP there (`grad_sync_choice`). engine.grad_sync=during_backward (auto's pick on one node: +0.9% per
GPU on 2 H100s) starts each fp32 weight gradient's all-reduce as soon as its GEMM has written it in the
last micro-batch (`ReduceAsWritten`, training/engines/weight_cache.py, which owns those GEMMs' wiring).
"""
from __future__ import annotations

import os
from typing import Iterable

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from training.config import Config
from training.distributed import DistInfo

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


def grad_sync_choice(cfg: Config, dist: DistInfo, amp_dtype) -> tuple:
    """(how the replicated torch engine reduces gradients over ranks, why): "ddp" (torch DDP, overlapped
    with the backward) or "after_backward" (training/engines/grad_allreduce.py: after the last micro-batch, which
    lets the weight cache and the fp32 weight-gradient GEMMs run), or "during_backward" (the same, each
    fp32 weight gradient's all-reduce started as its GEMM writes it in the last micro-batch). auto:
    during_backward when the cache applies and all ranks are on one node (2 H100s, 1.3B-8k: 672 vs 666
    TFLOP/s per GPU after the backward, bench/RESULTS.md); DDP across nodes, whose slower
    links need DDP's bucketed overlap."""
    choice = cfg.engine.grad_sync
    if choice != "auto":
        return choice, f"engine.grad_sync={choice}"
    if cfg.engine.weight_cache == "disabled" or amp_dtype is None:
        return "ddp", "auto: no weight cache to keep (fp32 run, or engine.weight_cache=disabled)"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", -1)))
    if local != dist.world_size:
        return "ddp", (f"auto: {dist.world_size} ranks over several nodes (or a launcher that does not say"
                       f" LOCAL_WORLD_SIZE): DDP overlaps the slower all-reduce with the backward")
    return "during_backward", (f"auto: one node of {dist.world_size} ranks: each fp32 weight gradient summed "
                               f"as the last micro-batch's backward writes it, so the weight cache and fp32 "
                               f"weight-gradient GEMMs stay on")


@torch.no_grad()
def broadcast_from_rank0(module: torch.nn.Module) -> None:
    """Make every rank's parameters and buffers rank 0's (what DDP does when it wraps a module)."""
    for t in [*module.parameters(), *module.buffers()]:
        dist.broadcast(t.data, src=0)
