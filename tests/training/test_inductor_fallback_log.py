"""training/compile/inductor_fallback_log.py: inductor's missing-lowering message must not stringify IR nodes
(their text grows exponentially with the depth of a DAG of extern kernels: a compile that never ends)."""
import logging

import pytest
import torch

from training.compile import inductor_fallback_log
from training.compile.inductor_fallback_log import bounded_operator_str, describe


class NoStr:
    """Stands for an IR node whose text would take forever: str() and repr() fail the test."""

    def __str__(self):
        raise AssertionError("str() called on an IR-like argument")

    __repr__ = __str__

    def get_name(self):
        return "buf7"

    def get_size(self):
        return [3, 5]

    def get_dtype(self):
        return torch.bfloat16


def test_describe_names_nodes_without_their_text():
    text = bounded_operator_str("flashgpt::op", [NoStr(), (NoStr(), 2), 0.5, None, torch.float32], {"eps": 1e-5})
    assert "args[0]: NoStr buf7 [3, 5] torch.bfloat16" in text
    assert "args[1]: (NoStr buf7 [3, 5] torch.bfloat16, 2)" in text
    assert "args[2]: 0.5" in text and "args[4]: torch.float32" in text and "eps: 1e-05" in text
    assert describe(list(range(20))).endswith(", ...]")


@torch.library.custom_op("fallbacktest::mix", mutates_args=())
def _mix(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return a + b, a - b


@_mix.register_fake
def _(a, b):
    return torch.empty_like(a), torch.empty_like(a)


@torch.library.custom_op("fallbacktest::last", mutates_args=())
def _last(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a * b


@_last.register_fake
def _(a, b):
    return torch.empty_like(a)


def chain(a, b, depth=12):
    """A DAG of extern kernels only, each using both outputs of the one before, then an op whose
    first appearance is at the bottom (what model.fused_add_norm's backward looks like to inductor)."""
    for _ in range(depth):
        a, b = torch.ops.fallbacktest.mix(a, b)
    return torch.ops.fallbacktest.last(a, b)


def test_compiling_a_deep_extern_chain_never_stringifies_ir(monkeypatch):
    ir = pytest.importorskip("torch._inductor.ir")
    from torch._inductor import config as inductor_config
    from torch._inductor import lowering
    from torch._inductor.exc import OperatorIssue

    assert inductor_fallback_log.install() and inductor_fallback_log.install()  # idempotent
    messages, calls = [], []
    bounded = OperatorIssue.operator_str
    monkeypatch.setattr(OperatorIssue, "operator_str",
                        staticmethod(lambda *a: messages.append(1) or bounded(*a)))
    original = ir.ExternKernel.__str__
    monkeypatch.setattr(ir.ExternKernel, "__str__", lambda self: calls.append(1) or original(self))
    graph_log = logging.getLogger("torch._inductor.graph")
    monkeypatch.setattr(graph_log, "level", logging.INFO)  # the message is built (torch 2.13 builds it lazily)
    # lower the graph afresh: no cached compile, and the ops not yet known to inductor (a fallback is
    # registered once per op and process)
    for op in (torch.ops.fallbacktest.mix.default, torch.ops.fallbacktest.last.default):
        monkeypatch.delitem(lowering.lowerings, op, raising=False)
    torch._dynamo.reset()
    a, b = torch.randn(7, 5), torch.randn(7, 5)
    with torch.compiler.config.patch(force_disable_caches=True), inductor_config.patch(fx_graph_cache=False):
        got = torch.compile(chain, backend="inductor")(a, b)
    torch._dynamo.reset()
    torch.testing.assert_close(got, chain(a, b))
    assert messages, "inductor's implicit fallback message was not built: the test checks nothing"
    assert not calls, f"ExternKernel.__str__ ran {len(calls)} times during the compile"
