"""A bounded description of a custom op's arguments in TorchInductor's "implicit fallback" message.

The first time a compiled graph reaches an op TorchInductor has no lowering for (each of our
`flashgpt::` custom ops), `GraphLowering.call_function` formats "Creating implicit fallback for:"
with `OperatorIssue.operator_str(target, args, kwargs)`, which calls `str()` on every input -- an IR
node whose text includes its producers' text, recursively. In torch 2.11 that string is built even
when the message is not logged. Where only our extern kernels (GEMMs, attention, the MLP's and the
add + LayerNorm's ops) lie between the layers -- the backward with model.fused_add_norm -- an input
deep in the graph has a producer DAG dozens of kernels deep, and its text, every shared producer
written out once per path, grows exponentially: the compile never finishes (e.g. 2.7B with
model.recompute_gelu_layers, whose two MLP backward ops meet the second one 18 blocks deep; the
fallback is registered once per op and process, so it bites only when an op first appears deep).
Upstream: pytorch/pytorch#139501 (ExternKernel.__str__ recursion).

`install()` replaces `operator_str` with one that names each argument (its IR name, size and dtype,
or its value for numbers, strings, dtypes and devices) without calling its `str()`. Only that message
changes; the fallback itself is inductor's own. Idempotent; a no-op (with a warning) on a torch
without the hook.
"""
from __future__ import annotations

import logging
import textwrap
from typing import Any

import torch

log = logging.getLogger(__name__)
_installed = False
_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)


def describe(arg: Any, depth: int = 0) -> str:
    """A short description of an inductor lowering argument that never calls an IR node's str()."""
    if isinstance(arg, _PLAIN):
        return repr(arg)
    if isinstance(arg, (list, tuple)) and depth < 2:
        inner = ", ".join(describe(a, depth + 1) for a in arg[:8]) + (", ..." if len(arg) > 8 else "")
        return f"[{inner}]" if isinstance(arg, list) else f"({inner})"
    parts = [type(arg).__name__]
    for attr in ("get_name", "get_size", "get_dtype"):
        try:
            parts.append(str(getattr(arg, attr)()))  # names, sympy sizes and dtypes: short, no recursion
        except Exception:  # unrealized boxes have no name, symbols no dtype, ...: leave it out
            pass
    return " ".join(parts)


def bounded_operator_str(target: Any, args: Any, kwargs: dict) -> str:
    lines = [f"target: {target}"] + [f"args[{i}]: {describe(a)}" for i, a in enumerate(args)]
    if kwargs:
        lines.append("kwargs: {" + ", ".join(f"{k}: {describe(v)}" for k, v in kwargs.items()) + "}")
    return textwrap.indent("\n".join(lines), "  ")


def install() -> bool:
    """Make inductor's missing-lowering messages describe arguments without their IR text. Returns
    whether the replacement is in place."""
    global _installed
    if _installed:
        return True
    try:
        from torch._inductor.exc import OperatorIssue
    except Exception as e:  # noqa: BLE001 -- any torch without it: leave inductor as it is
        log.warning("inductor fallback message left as is (deep graphs may compile slowly): %s", e)
        return False
    if not callable(getattr(OperatorIssue, "operator_str", None)):
        log.warning("inductor fallback message left as is: torch has no OperatorIssue.operator_str")
        return False
    OperatorIssue.operator_str = staticmethod(bounded_operator_str)
    _installed = True
    return True
