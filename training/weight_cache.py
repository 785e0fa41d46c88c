"""Low-precision copies of the matmul weights, made once per optimizer step.

Under bf16 autocast every forward casts each fp32 `nn.Linear` weight (and bias) to bf16, and every
backward turns the bf16 weight gradient back into fp32 before adding it to `.grad`: per micro-batch
that is ~14 bytes of memory traffic per parameter in small element-wise kernels (1.3B-8k on an H100:
~3% of the step, bench/RESULTS.md). With 8 accumulated micro-batches the weights do not
change between them, so the cast only needs to happen once per optimizer step.

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
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch
import torch.nn as nn


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
