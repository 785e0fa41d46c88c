"""The attention choices under torch.compile (inductor, fullgraph, as train.compile=true compiles the model):
model.attention=math stays our op (TorchInductor's pattern passes, torch/_inductor/fx_passes/fuse_attention.py,
would otherwise be free to rewrite a matmul-softmax-matmul chain into SDPA), SDPA held to its FlashAttention
backend compiles, and model.recompute_attention recomputes inside the compiled backward with the eager results."""
import pytest
import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code
from torch.nn.attention import SDPBackend, sdpa_kernel

from model.attention import CausalSelfAttention
from model.config import GPTConfig


def _step(module, params, x):
    """Forward and backward of one attention module: (output, parameter gradients)."""
    for p in params:
        p.grad = None
    y = module(x)
    y.square().sum().backward()
    return y.detach(), [p.grad.clone() for p in params]


def _compiled_step(attn, x):
    """(output, gradients) of the compiled module, and inductor's generated code, forward then backward."""
    torch._dynamo.reset()
    compiled = torch.compile(attn, fullgraph=True)
    with torch._inductor.config.patch(fx_graph_cache=False):  # compile here: generated code to read
        (y, grads), code = run_and_get_code(_step, compiled, list(attn.parameters()), x)
    assert len(code) == 2, len(code)  # forward, backward
    return y, grads, code


def _pair(backend, recompute, n_kv_head=None):
    """The module under test and an eager twin with the same weights, without recompute."""
    cfg = dict(d_model=32, n_head=4, n_kv_head=n_kv_head, seq_len=16, attention=backend)
    torch.manual_seed(4)
    attn = CausalSelfAttention(GPTConfig(**cfg, recompute_attention=recompute), backend)
    eager = CausalSelfAttention(GPTConfig(**cfg), backend)
    eager.load_state_dict(attn.state_dict())
    return attn, eager


def _same(compiled, eager):
    (y, grads), (y_e, grads_e) = compiled, eager
    torch.testing.assert_close(y, y_e, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, grads_e):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("recompute", [False, True])
def test_math_stays_our_op_under_compile(recompute):
    """Forward and backward call flashgpt::math_attn_*, never an SDPA op; recomputed, the backward runs the
    forward op again. The compiled results are the eager ones without recompute."""
    attn, eager = _pair("math", recompute, n_kv_head=2)
    x = torch.randn(2, 15, 32)
    y, grads, (fwd, bwd) = _compiled_step(attn, x)
    for code in (fwd, bwd):
        assert "scaled_dot_product" not in code and "_flash_attention" not in code, code[-3000:]
    assert "flashgpt.math_attn_fwd" in fwd and "flashgpt.math_attn_bwd" in bwd
    assert ("flashgpt.math_attn_fwd" in bwd) == recompute
    _same((y, grads), _step(eager, list(eager.parameters()), x))


def test_sdpa_recomputed_under_compile():
    attn, eager = _pair("sdpa", True)
    x = torch.randn(2, 16, 32)
    y, grads, (fwd, bwd) = _compiled_step(attn, x)
    assert "scaled_dot_product" in bwd  # the forward again, for the backward
    _same((y, grads), _step(eager, list(eager.parameters()), x))


def test_sdpa_flash_compiles_to_its_backend():
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            q = torch.ones(1, 1, 4, 8, requires_grad=True)
            F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    except RuntimeError:
        pytest.skip("this torch has no FlashAttention on the CPU")
    attn, eager = _pair("sdpa_flash", False)
    x = torch.randn(2, 16, 32)
    y, grads, (fwd, bwd) = _compiled_step(attn, x)
    assert "_scaled_dot_product_flash_attention" in fwd, fwd[-3000:]
    assert "_scaled_dot_product_flash_attention" in bwd and "backward" in bwd, bwd[-3000:]
    _same((y, grads), _step(eager, list(eager.parameters()), x))
