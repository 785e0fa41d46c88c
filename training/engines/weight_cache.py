"""The low-precision weight cache and the fp32 weight-gradient GEMMs: this module owns the feature
(when it applies, building it, arming the early gradient reduction); the engine calls `setup` once.
The other pieces are slots and kernels it fills: model/linear.py and model/tied_grad.py (`main_grad`
buffers), model/gpt.py (`weight_lp`, the tied head's copy), model/loss.py and kernels/gelu_mlp.py
(backwards that add into main_grad), kernels/wgrad.py (the GEMM that adds dy^T x into fp32).

    cache, forward, reducer = setup(model, cfg, dist, amp_dtype, grad_sync, compile_options)
    loss = forward(cache.tensors(), *inputs)       # each micro-batch, under autocast
    with reducer.armed(): loss.backward()           # last micro-batch, grad_sync=during_backward
    reducer.finish(params)
    optimizer.step(); cache.invalidate()

Low-precision copies of the matmul weights, made once per optimizer step: under bf16 autocast every
forward casts each fp32 `nn.Linear` weight (and bias) to bf16, and every backward turns the bf16 weight
gradient back into fp32 before adding it to `.grad`: per micro-batch that is ~14 bytes of memory traffic
per parameter in small element-wise kernels (1.3B-8k on an H100: ~3% of the step, bench/RESULTS.md).
With 8 accumulated micro-batches the weights do not change between them, so the cast only needs to
happen once per optimizer step.

`WeightCache` holds one bf16 copy (a leaf tensor that requires grad) per cached fp32 parameter. The
engine runs the model with `torch.func.functional_call(model, cache.tensors(), ...)`, so the matmuls
see the copies and autocast's cast of an already-bf16 tensor is a no-op. A post-accumulate-grad hook
on each copy adds its bf16 gradient into the fp32 parameter's `.grad` (one kernel that reads the bf16
gradient directly) and frees it. The arithmetic is the same as autocast's: the same bf16 weights in
the forward, the same bf16 weight gradient added into fp32. The model, the optimizer, checkpoints,
gradient clipping and evaluation keep seeing the fp32 parameters only.

Cached: the weights and biases of `nn.Linear` modules whose weight is not shared with another module
(the output head is tied to the fp32 token embedding, which autocast does not cast). LayerNorm and
embedding parameters run in fp32 under autocast and stay as they are. A module with a `weight_lp`
buffer slot (GPT's output head, model/gpt.py) gets a copy of its weight in the cache's dtype for its
matmuls, without a gradient (the head casts its tied weight once per step instead of once per
micro-batch; the embedding keeps looking up fp32 rows).

With `fp32_wgrad=True`, the weights of modules that take a `main_grad` buffer (model/linear.py) skip
the fold: `tensors()` also hands each such module its fp32 parameter's .grad (zeroed when absent) as
`main_grad`, and the backward's weight-gradient GEMM adds its fp32 result straight into it
(kernels/wgrad.py): no bf16 weight gradient is written or folded, and the product is not rounded to
bf16 on the way (the run is then not bit-identical to autocast's, but closer to fp32). Biases still
fold. The tied embedding / head weight gets the same: both modules' `main_grad` is its fp32 .grad,
and their backwards add into it (model/tied_grad.py). The fp32 .grad of those weights then exists
from the first micro-batch's forward on, not from its backward.

With several ranks and engine.grad_sync=during_backward (training/engines/grad_allreduce.py `grad_sync_choice`),
`ReduceAsWritten` starts the all-reduce of each GEMM-written fp32 gradient as soon as the last
micro-batch's GEMM has written it (kernels/wgrad.py calls its hook), overlapping the rest of the backward.
"""
from __future__ import annotations

import collections
import contextlib
from typing import Callable, Dict, Iterable, List, NamedTuple, Optional, Tuple

import torch
import torch.nn as nn

from training.config import Config
from training.distributed import DistInfo
from training.engines.grad_allreduce import all_reduce_grads, grad_sync_choice


def weight_cache_choice(cfg: Config, dist: DistInfo, amp_dtype) -> tuple:
    """(use the low-precision weight cache?, why) for the plain torch engine."""
    if cfg.engine.weight_cache == "disabled":
        return False, "engine.weight_cache=disabled"
    if amp_dtype is None:
        return False, "no autocast (fp32 run): nothing to cast"
    if dist.enabled and grad_sync_choice(cfg, dist, amp_dtype)[0] == "ddp":
        # DDP's hooks sit on the parameters' AccumulateGrad, which the cache's copies bypass
        return False, "engine.grad_sync=ddp: DDP reduces the gradients from the fp32 parameters' own hooks"
    return True, f"matmul weights cast to {str(amp_dtype).split('.')[-1]} once per optimizer step"


def wgrad_fp32_choice(cfg: Config, device: torch.device) -> tuple:
    """(weight-gradient GEMMs accumulate into the fp32 .grad?, why), given that the weight cache is on."""
    choice = cfg.engine.wgrad_fp32
    if choice != "auto":
        return choice == "enabled", f"engine.wgrad_fp32={choice}"
    if device.type != "cuda":
        return False, f"auto: on {device.type} the bf16 gradients fold as before"
    import kernels

    if not kernels.is_available():
        return False, f"auto: our CUDA extension is unavailable ({kernels.unavailable_reason()})"
    return True, "weight gradients accumulate in fp32 inside their GEMMs (kernels/wgrad.py)"


def functional_forward(model: nn.Module):
    """model(*inputs) with some parameters replaced by the given tensors (the weight cache)."""
    def run(params, *inputs):
        return torch.func.functional_call(model, params, inputs)
    return run


class Setup(NamedTuple):
    """What the plain torch engine runs with; all None when the cache is off (`reducer` may still be
    set: engine.grad_sync=during_backward then reduces every gradient after the backward)."""
    cache: Optional["WeightCache"]
    forward: Optional[Callable]  # forward(cache.tensors(), *inputs) -> loss; compiled with train.compile
    reducer: Optional["ReduceAsWritten"]  # engine.grad_sync=during_backward


def setup(model: nn.Module, cfg: Config, dist: DistInfo, amp_dtype, grad_sync: Optional[str],
          compile_options: Optional[dict]) -> Setup:
    """The weight cache of `model` (fp32 parameters, on their device) if `weight_cache_choice` allows
    it, with fp32 weight-gradient GEMMs if `wgrad_fp32_choice` does, and for
    grad_sync=during_backward the reducer that sums each GEMM-written fp32 gradient as it is written."""
    cache = forward = reducer = None
    if weight_cache_choice(cfg, dist, amp_dtype)[0]:
        cache = WeightCache(model, amp_dtype, wgrad_fp32_choice(cfg, dist.device)[0])
        forward = functional_forward(model)
        if cfg.train.compile:
            forward = torch.compile(forward, options=compile_options)
    if grad_sync == "during_backward":  # the weights whose fp32 gradient a GEMM writes, once each
        written = [m for _, m in cache.accumulated] if cache is not None else []
        times = collections.Counter(id(m) for m in written)  # the tied weight has two writers: not early
        reducer = ReduceAsWritten(m for m in written if times[id(m)] == 1)
    return Setup(cache, forward, reducer)


def cacheable_parameters(model: nn.Module) -> List[Tuple[str, nn.Parameter]]:
    """(name, fp32 parameter) of every `nn.Linear` weight / bias that autocast would cast and that no
    other module uses (tied weights: see `low_precision_slots`)."""
    owners = _owner_counts(model)
    out = []
    for prefix, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        for name, p in module.named_parameters(recurse=False):
            if p.requires_grad and p.dtype == torch.float32 and owners[id(p)] == 1:
                out.append((f"{prefix}.{name}" if prefix else name, p))
    return out


class WeightCache:
    """bf16 (or fp16) copies of a model's matmul parameters, refreshed once per optimizer step.

        cache = WeightCache(model, torch.bfloat16)
        loss = torch.func.functional_call(model, cache.tensors(), (x, y))   # each micro-batch
        loss.backward()                     # the hooks add the copies' grads into the fp32 .grad
        optimizer.step(); cache.invalidate()  # the next tensors() call copies the new weights
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype, fp32_wgrad: bool = False):
        self.names, self.masters = [], []
        for name, p in cacheable_parameters(model):
            self.names.append(name)
            self.masters.append(p)
        # (module's main_grad buffer name, fp32 weight) for the weights whose GEMM accumulates in fp32
        self.accumulated = fp32_wgrad_targets(model, dict(zip(self.names, self.masters))) if fp32_wgrad else []
        in_gemm = {id(master) for _, master in self.accumulated}
        self.copies = []
        for master in self.masters:
            copy = torch.empty_like(master, dtype=dtype)
            if id(master) not in in_gemm:  # its bf16 gradient is folded into the fp32 .grad
                copy.requires_grad_()
                copy.register_post_accumulate_grad_hook(self._folder(master))
            self.copies.append(copy)
        # copies without a gradient, for matmuls of weights cached nowhere else (the tied output head)
        self.lp_slots = [(name, master, torch.empty_like(master, dtype=dtype)) for name, master in
                         low_precision_slots(model)]
        self.by_name = dict(zip(self.names, self.copies))  # the same tensors every step: built once
        self.by_name.update((name, copy) for name, _, copy in self.lp_slots)
        self.stale = True

    @staticmethod
    def _folder(master: nn.Parameter):
        def fold(copy: torch.Tensor) -> None:
            """Add this micro-batch's low-precision gradient into the fp32 .grad; free it."""
            if master.grad is None:
                master.grad = copy.grad.to(master.dtype)
            else:
                master.grad.add_(copy.grad)  # fp32 += bf16, in one kernel
            copy.grad = None
        return fold

    def __len__(self) -> int:
        return len(self.copies)

    def invalidate(self) -> None:
        """The fp32 parameters changed (optimizer step, checkpoint load): copy again before use."""
        self.stale = True

    @torch.no_grad()
    def refresh(self) -> None:
        torch._foreach_copy_(self.copies + [c for _, _, c in self.lp_slots],
                             self.masters + [m for _, m, _ in self.lp_slots])  # one multi-tensor cast kernel
        self.stale = False

    def tensors(self) -> Dict[str, torch.Tensor]:
        """name -> low-precision copy, current with the fp32 parameters (for functional_call); with
        fp32_wgrad also `<module>.main_grad` -> the fp32 weight's .grad (allocated as zeros if None)."""
        if self.stale:
            self.refresh()
        with torch.no_grad():
            for buffer_name, master in self.accumulated:
                if master.grad is None:  # first micro-batch of an accumulation: free the last step's
                    self.by_name[buffer_name] = None  # buffers first (keys keep their order: no recompiles)
            for buffer_name, master in self.accumulated:
                if master.grad is None:
                    master.grad = torch.zeros_like(master)
                if self.by_name.get(buffer_name) is not master.grad:  # also if .grad was replaced
                    self.by_name[buffer_name] = master.grad
        return self.by_name


def fp32_wgrad_targets(model: nn.Module, cached: Dict[str, nn.Parameter]) -> List[Tuple[str, nn.Parameter]]:
    """(`<module>.main_grad`, fp32 weight) for each module with a main_grad buffer slot whose weight
    is cached (model/linear.py) or tied between modules (the embedding and the output head,
    model/tied_grad.py)."""
    cached_ids = {id(p) for p in cached.values()}
    tied_ids = {i for i, n in _owner_counts(model).items() if n > 1}
    out = []
    for prefix, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if "main_grad" in module._buffers and isinstance(weight, nn.Parameter) and weight.requires_grad \
                and weight.dtype == torch.float32 and (id(weight) in cached_ids or id(weight) in tied_ids):
            out.append((f"{prefix}.main_grad" if prefix else "main_grad", weight))
    return out


def low_precision_slots(model: nn.Module) -> List[Tuple[str, nn.Parameter]]:
    """(`<module>.weight_lp`, fp32 weight) for each module with a weight_lp buffer slot (the output
    head, model/gpt.py) whose weight is an fp32 parameter."""
    out = []
    for prefix, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if "weight_lp" in module._buffers and isinstance(weight, nn.Parameter) and weight.dtype == torch.float32:
            out.append((f"{prefix}.weight_lp" if prefix else "weight_lp", weight))
    return out


def _owner_counts(model: nn.Module) -> Dict[int, int]:
    """id(parameter) -> how many modules hold it (2 for GPT's tied embedding / output head weight)."""
    owners: Dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    return owners


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
            self._works.append(torch.distributed.all_reduce(p.grad, op=torch.distributed.ReduceOp.SUM, async_op=True))
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
