"""GPU checks: our attention's backward stays finite where a few keys meet large logits.

With 1-17 keys (not a multiple of any key block) and inputs of magnitude ~4, a query's LSE can be far
below zero; a key block's rows past the sequence's last key then give exp(S - LSE) = exp(-LSE), which
overflows (fp16 P^T from exp(11)) unless those keys are masked -- and the infinite dS^T times their zero
K rows made dQ NaN. Every backward path (FA2 1-D / 2-D, the Hopper TMA kernel in lock-step and in
turns; tests/gpu_util.py BACKWARD_PATHS) on dense and packed batches with 1-3-key documents, fp16 and bf16: O, LSE and
the gradients are finite and within 5x PyTorch's own low-precision error against the fp32 reference.
PyTorch's error is the larger of two computations in the inputs' dtype: autograd through the reference
attention, and the FlashAttention backward's equations (kernels.reference.attention_grads_flash), whose
D = rowsum(dO o O) from the rounded output carries an error the first lacks (e.g. a row with one key).
"""
from __future__ import annotations


import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from gpu_util import (BACKWARD_PATHS, InputSeeds, backward_path_fixture, cu_seqlens, every_case,  # noqa: E402
                      require_extension, skip_same_kernel)
from kernels import flash_attn_func, flash_attn_varlen_func  # noqa: E402
from kernels.reference import (attention_grads_flash, attention_grads_flash_varlen, attention_ref,  # noqa: E402
                               attention_varlen_ref)

SCALE = 4.0  # q, k, v ~ N(0, 4^2): logits of magnitude ~16 (d 128) to ~60
_seed = InputSeeds(4200)

PATHS = list(BACKWARD_PATHS)


@pytest.fixture(scope="module", autouse=True)
def _ext():
    require_extension()


path = backward_path_fixture(PATHS)


def _check(name, ours, ref, *pts):
    """Finite, and max error <= 5 x PyTorch's (the larger of pts') + one unit in the last place of the
    largest reference value in this dtype."""
    assert torch.isfinite(ours).all(), f"{name}: {int((~torch.isfinite(ours)).sum())} non-finite values"
    e = (ours.float() - ref).abs().max().item()
    e_pt = max((pt.float() - ref).abs().max().item() for pt in pts)
    eps = torch.finfo(ours.dtype).eps * max(1.0, ref.abs().max().item())
    assert e <= 5 * e_pt + eps, f"{name}: max err {e:.3e} > 5 x torch's {e_pt:.3e} + {eps:.1e}"


def _inputs(q_shape, k_shape, dtype):
    torch.manual_seed(next(_seed))
    q = (torch.randn(q_shape, device="cuda") * SCALE).to(dtype).requires_grad_()
    k = (torch.randn(k_shape, device="cuda") * SCALE).to(dtype).requires_grad_()
    v = (torch.randn(k_shape, device="cuda") * SCALE).to(dtype).requires_grad_()
    return q, k, v, torch.randn(q_shape, device="cuda").to(dtype)


def _compare(out, lse, inputs, dout, ref_fn, flash_grads_fn):
    """Our out / lse / grads against ref_fn(q, k, v, upcast) in fp32; PyTorch's error from ref_fn in the
    inputs' dtype (autograd) and flash_grads_fn(q, k, v, out, dout) on its output."""
    finite_or_empty = torch.isfinite(lse) | (lse == float("inf"))  # +inf: a causal row that sees no key
    assert finite_or_empty.all(), "lse: NaN or -inf"
    grads = torch.autograd.grad(out, inputs, dout)
    f32 = [t.detach().float().requires_grad_() for t in inputs]
    out_ref, _ = ref_fn(*f32, True)
    grads_ref = torch.autograd.grad(out_ref, f32, dout.float())
    out_pt, _ = ref_fn(*inputs, False)
    grads_pt = torch.autograd.grad(out_pt, inputs, dout)
    grads_pt_flash = flash_grads_fn(*(t.detach() for t in inputs), out_pt.detach(), dout)
    _check("out", out, out_ref, out_pt)
    for n, a, r, p, pf in zip(("dq", "dk", "dv"), grads, grads_ref, grads_pt, grads_pt_flash):
        _check(n, a, r, p, pf)


# (seqlen_q, seqlen_k): 1, 2, 5, 17 keys; 77 and 130 queries reach the TMA backward (its dQ tiles fit);
# 2241 keys, the forward's 160-key tiles with a last tile of one key at head dim 128.
DENSE = [(1, 1), (17, 2), (77, 5), (130, 17), (77, 1), (130, 2), (130, 2241)]


@every_case
@pytest.mark.parametrize("sq,sk", DENSE, ids=[f"{a}x{b}" for a, b in DENSE])
def test_few_keys_large_logits_dense(sq, sk, dtype, d, causal, path):
    skip_same_kernel(d, path)
    q, k, v, dout = _inputs((2, sq, 3, d), (2, sk, 3, d), dtype)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    _compare(out, lse, (q, k, v), dout, lambda q_, k_, v_, up: attention_ref(q_, k_, v_, causal, upcast=up),
             lambda *t: attention_grads_flash(*t, causal))


# Packed batches with 1-3-key documents: short ones (the row-major kernels) and, beside long query
# documents, enough queries for the TMA backward's dQ tiles.
VARLEN = {"short": ([1, 3, 2, 5, 17, 4, 1], [1, 2, 3, 1, 5, 17, 3]),
          "long": ([1, 300, 2, 600, 77, 3], [1, 2, 3, 1, 17, 5])}


@every_case
@pytest.mark.parametrize("batch", list(VARLEN))
def test_few_keys_large_logits_varlen(batch, dtype, d, causal, path):
    skip_same_kernel(d, path)
    lens_q, lens_k = VARLEN[batch]
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    q, k, v, dout = _inputs((sum(lens_q), 3, d), (sum(lens_k), 3, d), dtype)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                      return_lse=True)
    _compare(out, lse, (q, k, v), dout,
             lambda q_, k_, v_, up: attention_varlen_ref(q_, k_, v_, cu_q, cu_k, causal, upcast=up),
             lambda *t: attention_grads_flash_varlen(*t, cu_q, cu_k, causal))
