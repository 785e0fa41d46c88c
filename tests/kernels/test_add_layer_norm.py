"""The residual add + output-keeping LayerNorm op (kernels/add_layer_norm.py) on CPU, where it runs in
torch ops: against autograd through x + delta and F.layer_norm, odd shapes, with and without bias;
opcheck; and a GPT with model.fused_add_norm against the same GPT without it. The CUDA kernels:
tests/kernels/test_add_layer_norm_gpu.py."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from kernels.add_layer_norm import _backward_op, _forward_op, add_layer_norm

_seed = itertools.count(77)


def fresh(*shape, dtype=torch.bfloat16, scale=1.0):
    torch.manual_seed(next(_seed))
    return (torch.randn(*shape) * scale).to(dtype)


def through_autograd(x, delta, w, b, eps, gh, gy):
    """h, y and the gradients of sum(h * gh) + sum(y * gy) by autograd through plain ops."""
    x, delta, w = (t.detach().clone().requires_grad_() for t in (x, delta, w))
    b = b.detach().clone().requires_grad_() if b is not None else None
    h = x + delta
    y = F.layer_norm(h.float(), (h.shape[-1],), w, b, eps).to(h.dtype)
    ((h.float() * gh.float()).sum() + (y.float() * gy.float()).sum()).backward()
    return h, y, x.grad, delta.grad, w.grad, (b.grad if b is not None else None)


@pytest.mark.parametrize("shape", [(1, 8), (3, 5, 64), (37, 104), (2, 9, 2560)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_matches_autograd_through_plain_ops(shape, with_bias):
    d = shape[-1]
    x, delta = fresh(*shape, scale=2.0), fresh(*shape)
    w = (1 + 0.2 * fresh(d, dtype=torch.float32))
    b = 0.3 * fresh(d, dtype=torch.float32) if with_bias else None
    gh, gy = fresh(*shape), fresh(*shape)
    xs, ds, ws = (t.clone().requires_grad_() for t in (x, delta, w))
    bs = b.clone().requires_grad_() if b is not None else None
    h, y = add_layer_norm(xs, ds, ws, bs, 1e-5)
    ((h.float() * gh.float()).sum() + (y.float() * gy.float()).sum()).backward()
    h_ref, y_ref, dx_ref, dd_ref, dw_ref, db_ref = through_autograd(x, delta, w, b, 1e-5, gh, gy)
    assert torch.equal(h, h_ref) and h.dtype == y.dtype == torch.bfloat16
    assert (y.float() - y_ref.float()).abs().max().item() <= 2 ** -7 * y_ref.abs().max().item()
    assert torch.equal(xs.grad, ds.grad)  # both inputs get dh
    # bf16 outputs: a rounding apart; the weight's gradient sees y's rounding through x_hat = (y - b) / w
    assert (xs.grad.float() - dx_ref.float()).abs().max().item() <= 2 ** -6 * dx_ref.abs().max().item()
    assert (ws.grad - dw_ref).abs().max().item() <= 2 ** -5 * dw_ref.abs().max().item()
    if b is not None:
        assert torch.allclose(bs.grad, db_ref, rtol=1e-4, atol=1e-4)
    else:
        assert bs is None


def test_opcheck():
    x, delta, w, b = fresh(6, 16), fresh(6, 16), 1 + 0.1 * fresh(16, dtype=torch.float32), fresh(16, dtype=torch.float32)
    torch.library.opcheck(_forward_op, (x, delta, w, b, 1e-5))
    h, y, rstd = _forward_op(x, delta, w, b, 1e-5)
    torch.library.opcheck(_backward_op, (fresh(6, 16), fresh(6, 16), y, w, b, rstd))


@pytest.mark.parametrize("compiled", [False, True])
def test_gpt_with_fused_add_norm_matches_without(compiled):
    """One bf16-autocast step of a small GPT with the bf16 residual stream: same loss, close gradients
    (the fused model compiled or not)."""
    from model.config import GPTConfig
    from model.gpt import GPT

    results = {}
    for fused in (False, True):
        cfg = GPTConfig(n_layer=3, d_model=64, n_head=4, vocab_size=96, seq_len=32, residual="autocast",
                        norm_saves_output=True, fused_add_norm=fused)
        torch.manual_seed(0)
        model = GPT(cfg)
        run = torch.compile(model) if compiled and fused else model
        idx = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(1))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = run(idx, idx)
        loss.backward()
        results[fused] = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    (l0, g0), (l1, g1) = results[False], results[True]
    assert abs(l0 - l1) < 1e-2 and g0.keys() == g1.keys()
    for name in g0:
        scale = g0[name].abs().max().item() + 1e-6
        assert (g0[name] - g1[name]).abs().max().item() <= 0.05 * scale, name


def test_needs_norm_saves_output():
    from model.config import GPTConfig
    from model.gpt import GPT

    with pytest.raises(ValueError, match="norm_saves_output"):
        GPT(GPTConfig(n_layer=1, d_model=32, n_head=2, vocab_size=64, seq_len=16, fused_add_norm=True))
