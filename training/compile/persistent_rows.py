"""Row reductions of up to `train.compile_persistent_rows` elements kept in registers by TorchInductor.

A LayerNorm over a row of d_model elements is one "inner" reduction per row. TorchInductor keeps the
row in registers (a persistent reduction: the row is read once) only up to 1024 elements; longer rows
get a looped kernel that reads the row twice (statistics, then the normalised output), and with
training/compile/inductor_barrier.py's fix a barrier per loop step. `triton.multi_kernel` generates both and
times them on first use, but in the 2.7B-8k step its pick can be the looped residual add + LayerNorm
forward at ~81 us per call where the persistent one takes ~60 us (bench/RESULTS.md), and forcing
persistence everywhere (`multi_kernel=3`) makes the bias-gradient column sums 2x slower.

`install(limit)` wraps TorchInductor's heuristic (`InductorChoices.should_use_persistent_reduction`,
the method its codegen asks) so that it also says yes to inner reductions of at most `limit` elements,
and otherwise defers to TorchInductor. The limit is process-wide (the backward graph compiles later, in
autograd's thread); `install(0)` turns it off again. training/compile/options.py's `prepare_compile`
installs it from `train.compile_persistent_rows` for every engine's compile (and bench/e2e.py's plain
compiled setups: a compile setting both sides share) and then compiles without `triton.multi_kernel`
(the choice is made here, not by timing). Besides its pick, multi_kernel's generated code failed to
load from TorchInductor's FX graph cache in torch 2.11 (a second run on the same machine stopped at
compile: `TypeError: 'NoneType' object does not support the context manager protocol` in triton's
`JITFunction.cache_key`); the rule leaves no multi-kernel in the code. The FX graph cache's key does
not include the limit: after changing it, a graph compiled before may come back from the cache with
its kernels (the same function, the old kernel choice). A torch without the method gets a warning
and inductor's own choice.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)

_limit = 0  # inner reductions up to this many elements are persistent (0: inductor decides)
_wrapped = False


def install(limit: int) -> bool:
    """From now on (any thread's compile), inner reductions of at most `limit` elements are persistent;
    0 (or <= 1024, inductor's own threshold) restores inductor's choice. True if this torch has the hook."""
    global _limit, _wrapped
    _limit = limit if limit > 1024 else 0
    if _wrapped or not _limit:
        return True
    try:
        import torch._inductor.config as config
        from torch._inductor.choices import InductorChoices
        from torch._inductor.runtime.hints import ReductionHint
        from torch._inductor.virtualized import V
    except ImportError as e:
        log.warning("train.compile_persistent_rows: this torch lacks TorchInductor's choices (%s); inductor decides", e)
        _limit = 0
        return False
    original = getattr(InductorChoices, "should_use_persistent_reduction", None)
    if original is None:
        log.warning("train.compile_persistent_rows: this torch's InductorChoices has no "
                    "should_use_persistent_reduction; inductor decides")
        _limit = 0
        return False

    def should_use_persistent_reduction(features, cooperative_reduction):
        if (_limit and config.triton.persistent_reductions and not cooperative_reduction
                and features.get_reduction_hint() == ReductionHint.INNER
                and V.graph.sizevars.statically_known_leq(features.reduction_numel, _limit)):
            return True
        return original(features, cooperative_reduction)

    InductorChoices.should_use_persistent_reduction = staticmethod(should_use_persistent_reduction)
    _wrapped = True
    return True


def current_limit() -> int:
    """The limit in force (0: inductor's own choice)."""
    return _limit
