"""Data parallelism without DDP's hooks: the gradients are summed over the ranks after the last
micro-batch of an accumulation, in place.

Why: the weight cache (training/weight_cache.py) and the weight-gradient GEMMs that add straight into
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
DDP there (training/engine.py `grad_sync_choice`). `ReduceAsWritten` (engine.grad_sync=during_backward,
auto's pick on one node: +0.9% per GPU on 2 H100s) starts each fp32 weight gradient's
all-reduce as soon as its GEMM has written it in the last micro-batch.
"""
from __future__ import annotations

import contextlib
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


class ReduceAsWritten:
    """engine.grad_sync=during_backward: in the last micro-batch, each fp32 weight gradient that a
    weight-gradient GEMM writes (kernels/wgrad.py, the weight cache's main_grad weights) is all-reduced
    as soon as that GEMM is queued, so its transfer overlaps the rest of the backward, as DDP's buckets
    do; `finish()` waits for those and sums the other gradients (biases, norms, the tied embedding / head
    weight, whose two writers come at both ends of the backward) as `all_reduce_grads` does.

        reducer = ReduceAsWritten(early_params)
        with reducer.armed():      # after the last micro-batch's forward (its .grad buffers exist)
            loss.backward()
        reducer.finish(all_params)

    Every rank's backward writes the same gradients in the same order (one model, one graph), so the
    collectives match across ranks. A gradient written by a copy rather than in place (a compiled graph
    that did not reinplace the op) is not recognised and simply waits for `finish()`.
    """

    def __init__(self, early_params: Iterable[torch.nn.Parameter]):
        self.early = list(early_params)
        self._by_ptr, self._works, self._reduced = {}, [], set()

    def _written(self, main_grad: torch.Tensor) -> None:
        p = self._by_ptr.pop(main_grad.data_ptr(), None)
        if p is not None:  # its last write in this accumulation: sum it while the backward goes on
            self._works.append(dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, async_op=True))
            self._reduced.add(id(p))

    @contextlib.contextmanager
    def armed(self):
        from kernels.wgrad import set_written_hook

        self._by_ptr = {p.grad.data_ptr(): p for p in self.early if p.grad is not None}
        self._works, self._reduced = [], set()
        set_written_hook(self._written)
        try:
            yield self
        finally:
            set_written_hook(None)

    @torch.no_grad()
    def finish(self, params: Iterable[torch.nn.Parameter]) -> int:
        """Wait for the early all-reduces, then sum the rest; returns how many went early."""
        for work in self._works:
            work.wait()
        all_reduce_grads(p for p in params if id(p) not in self._reduced)
        early, self._works, self._by_ptr = len(self._reduced), [], {}
        return early


@torch.no_grad()
def broadcast_from_rank0(module: torch.nn.Module) -> None:
    """Make every rank's parameters and buffers rank 0's (what DDP does when it wraps a module)."""
    for t in [*module.parameters(), *module.buffers()]:
        dist.broadcast(t.data, src=0)
