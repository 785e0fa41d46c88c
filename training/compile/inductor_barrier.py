"""A barrier before a compiled Triton kernel reads back memory it wrote: works around a race in
TorchInductor's generated code (torch 2.11 on an H100: silently wrong losses and gradients).

TorchInductor fuses a LayerNorm with what surrounds it into one "looped" reduction kernel when a
row is too long for one block: a first loop computes the row's statistics, a second writes the
normalised row to a buffer (kept for the backward), and a third loop reads that buffer back to apply
the affine weight and bias. The write and the read-back are done by different threads of the
program when Triton lays the two loops out differently, and nothing orders them (no barrier;
upstream: pytorch/pytorch PR 190519, "Add barrier before reading back a buffer stored in a
reduction loop", July 2026). Some rows then see stale values (kernels/NOTES.md): a 2-layer GPT at
width 2048, compiled, gives a different loss on each call with the same weights (6.519 / 6.572 vs
eager's 6.595, gradients 80% off); at width 256 it takes qkv's fp32 weight-gradient accumulation to
change the fusion enough to show it. compute-sanitizer, `max_fusion_size=1` and this barrier each
make it exact.

`install()` wraps `AsyncCompile.triton`, the call every generated Triton kernel's source goes through
before it is compiled (also when the wrapper code comes from inductor's cache), and inserts
`tl.debug_barrier()` before each load of a pointer the kernel stored earlier (`add_reload_barriers`).
The cost is one block-wide barrier per loop iteration in the few kernels that read back their own
output. Idempotent; a no-op (with a warning) if this torch has no such hook.
"""
from __future__ import annotations

import logging
import re

log = logging.getLogger(__name__)

_STORE = re.compile(r"\btl\.store\((\w+) \+")
_LOAD = re.compile(r"\btl\.load\((\w+) \+")
BARRIER = "tl.debug_barrier()"
_installed = False


def add_reload_barriers(source: str) -> tuple[str, int]:
    """(source with a `tl.debug_barrier()` line before every load of a pointer stored earlier in the
    kernel, number of barriers added). Lines keep their order and indentation; a source without such
    a load comes back unchanged."""
    stored: set = set()
    out, added = [], 0
    for line in source.split("\n"):
        load = _LOAD.search(line)
        if load and load.group(1) in stored and (not out or out[-1].strip() != BARRIER):
            out.append(line[: len(line) - len(line.lstrip())] + BARRIER)
            added += 1
        store = _STORE.search(line)
        if store:
            stored.add(store.group(1))
        out.append(line)
    return ("\n".join(out) if added else source), added


def install() -> bool:
    """Route every Triton kernel inductor compiles in this process through add_reload_barriers.
    Returns whether the hook is in place."""
    global _installed
    if _installed:
        return True
    try:
        from torch._inductor.async_compile import AsyncCompile
    except ImportError as e:  # no inductor: nothing compiles Triton kernels
        log.warning("inductor barrier fix not installed: %s", e)
        return False
    original = getattr(AsyncCompile, "triton", None)
    if original is None:
        log.warning("inductor barrier fix not installed: torch has no AsyncCompile.triton")
        return False

    def triton(self, kernel_name, source_code, *args, **kwargs):
        source_code, added = add_reload_barriers(source_code)
        if added:
            log.debug("%s: %d barrier(s) before read-backs", kernel_name, added)
        return original(self, kernel_name, source_code, *args, **kwargs)

    AsyncCompile.triton = triton
    _installed = True
    log.info("torch.compile: a barrier before each read-back in inductor's Triton kernels "
             "(training/compile/inductor_barrier.py)")
    return True
