"""model/layernorm.py: the output-keeping LayerNorm against nn.LayerNorm (fresh random inputs, odd
sizes, with and without bias, fp32 and bf16 autocast, eager and compiled), and what it keeps."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn as nn

from model.config import GPTConfig
from model.gpt import GPT
from model.layernorm import LayerNorm

_seed = itertools.count(4242)


def pair(d: int, bias: bool):
    """nn.LayerNorm and ours with the same random (non-trivial) gains and biases."""
    torch.manual_seed(next(_seed))
    ref = nn.LayerNorm(d, bias=bias)
    with torch.no_grad():
        ref.weight.copy_(1 + 0.5 * torch.randn(d).clamp(-1.5, 1.5))  # |gain| in [0.25, 1.75]
        if bias:
            ref.bias.copy_(0.3 * torch.randn(d))
    ours = LayerNorm(d, bias=bias, saves_output=True)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def run(ln, x, dy, autocast=False):
    x = x.detach().clone().requires_grad_()
    ln.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = ln(x)
    y.backward(dy.to(y.dtype))
    grads = [x.grad] + [p.grad for p in ln.parameters()]
    return y.detach(), [g.detach().clone() for g in grads]


@pytest.mark.parametrize("shape", [(3, 5, 64), (1, 77), (2, 13, 136), (300, 40)])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_nn_layernorm_fp32(shape, bias):
    ref, ours = pair(shape[-1], bias)
    x = 3 * torch.randn(shape) + 0.5
    dy = torch.randn(shape)
    y0, g0 = run(ref, x, dy)
    y1, g1 = run(ours, x, dy)
    assert y1.dtype == torch.float32
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-5)
    for name, a, b in zip(["dx", "dweight", "dbias"], g0, g1):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4, msg=name)


@pytest.mark.parametrize("shape", [(4, 9, 128), (2, 33, 264)])
def test_bf16_autocast_within_bf16_rounding(shape):
    """Under autocast the output is bf16 (what the projection after it computes in) and x_hat comes
    from that rounded output: gradients agree with nn.LayerNorm's (fp32 output, input kept) to about
    bf16's resolution, and a bf16 residual stream keeps its dtype."""
    ref, ours = pair(shape[-1], True)
    for x_dtype in (torch.float32, torch.bfloat16):
        x = (2 * torch.randn(shape) - 0.3).to(x_dtype)
        dy = torch.randn(shape)
        y0, g0 = run(ref, x, dy, autocast=True)
        y1, g1 = run(ours, x, dy, autocast=True)
        assert y1.dtype == torch.bfloat16 and g1[0].dtype == x_dtype
        torch.testing.assert_close(y1.float(), y0.float(), rtol=1e-2, atol=1e-2)
        for name, a, b in zip(["dx", "dweight", "dbias"], g0, g1):
            a, b = a.float(), b.float()
            err = (a - b).abs().max().item()
            assert err <= 2e-2 * a.abs().max().item(), f"{name}: {err:.3e} vs max {a.abs().max().item():.3e}"


@pytest.mark.parametrize("autocast", [False, True])
def test_compiled_matches_eager(autocast):
    """Compiled, fp32 (output dtype = input dtype: torch 2.11 returned zero gradients when the forward
    ended in a no-op .to()) and bf16 autocast."""
    ref, ours = pair(96, True)
    x, dy = torch.randn(5, 7, 96), torch.randn(5, 7, 96)
    y0, g0 = run(ours, x, dy, autocast)
    compiled = torch.compile(ours)
    y1, g1 = run(compiled, x, dy, autocast)
    tol = 2e-2 if autocast else 1e-4
    torch.testing.assert_close(y1.float(), y0.float(), rtol=tol, atol=tol)
    for a, b in zip(g0, g1):
        assert b.abs().max() > 0.1 * a.abs().max()
        torch.testing.assert_close(b.float(), a.float(), rtol=tol, atol=tol * a.abs().max().item())


def test_no_grad_and_state_dict_are_nn_layernorms():
    ref, ours = pair(48, True)
    x = torch.randn(6, 48)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x))
    assert set(ours.state_dict()) == set(ref.state_dict())


def saved_bytes(model: GPT, idx: torch.Tensor) -> int:
    """Bytes of the unique storages autograd keeps for the backward, parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(idx, idx)
    loss.backward()
    return sum(seen.values())


def test_gpt_keeps_one_unit_less_per_layernorm_and_same_gradients():
    """In the GPT (bf16 residual stream, autocast): norm_saves_output drops each block LayerNorm's
    input from what the backward keeps -- 2 d-units per token and layer -- and the gradients stay
    those of nn.LayerNorm to bf16's resolution."""
    base = dict(n_layer=2, d_model=64, n_head=2, vocab_size=128, seq_len=32, residual="autocast", attention="sdpa")
    torch.manual_seed(0)
    a = GPT(GPTConfig(**base))
    b = GPT(GPTConfig(**base, norm_saves_output=True))
    b.load_state_dict(a.state_dict())
    idx = torch.randint(0, 128, (3, 32))
    kept_a, kept_b = saved_bytes(a, idx), saved_bytes(b, idx)
    unit = 2 * 64 * idx.numel()  # one bf16 value per feature and token
    # per block LayerNorm, nn.LayerNorm keeps its bf16 input x and an fp32 mean and 1/std per token, ours
    # the 1/std only; both outputs are kept once, as the next projection's input
    assert kept_a - kept_b == 2 * 2 * (unit + 4 * idx.numel())
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        err = (pa.grad - pb.grad).abs().max().item()
        assert err <= 3e-2 * pa.grad.abs().max().item() + 1e-6, f"{name}: {err:.3e}"
