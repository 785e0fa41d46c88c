"""GPU checks: deterministic=True gives bit-identical results, call after call.

The forward and the deterministic backward repeated 50 times on the same inputs, with the caching
allocator's free memory refilled with random values between calls (a read of memory nothing wrote
would change the bits): out, dQ, dK and dV identical each time (torch.equal). Around 1k (1023 x 1024,
1024 x 1023: either side of the TMA backward's lock-step / turns threshold and of the tuning buckets),
odd lengths, grouped-query heads, packed batches of 3-query x 799-key documents and of 1-key ones;
head dims 64 / 96 / 128, causal or not, fp16 and bf16, on every backward path (FA2, the Hopper
TMA kernel in lock-step and in turns; tests/gpu_util.py BACKWARD_PATHS).
"""
from __future__ import annotations


import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from gpu_util import (BACKWARD_PATHS, InputSeeds, backward_path_fixture, cu_seqlens, every_case,  # noqa: E402
                      require_extension, skip_same_kernel)
from kernels import flash_attn_func, flash_attn_qkvpacked_func, flash_attn_varlen_func  # noqa: E402

REPEATS = 50
_seed = InputSeeds(4700)

PATHS = list(BACKWARD_PATHS)


@pytest.fixture(scope="module", autouse=True)
def _ext():
    require_extension()


path = backward_path_fixture(PATHS)


def _scramble_free_memory():
    """Refill the allocator's cached free blocks with random values (what the next call's buffers get)."""
    junk = torch.empty(32 << 20, device="cuda").normal_()
    del junk


def _assert_repeatable(fwd, inputs, dout):
    out = fwd()
    first = (out, *torch.autograd.grad(out, inputs, dout))
    assert all(torch.isfinite(t).all() for t in first)
    for i in range(REPEATS - 1):
        if i % 10 == 0:
            _scramble_free_memory()
        out = fwd()
        again = (out, *torch.autograd.grad(out, inputs, dout))
        for name, a, b in zip(("out", "dq", "dk", "dv"), first, again):
            assert torch.equal(a, b), f"{name} differs on call {i + 2}"


def _inputs(q_shape, k_shape, dtype):
    torch.manual_seed(next(_seed))
    q, k, v = (torch.randn(s, device="cuda", dtype=dtype, requires_grad=True) for s in (q_shape, k_shape, k_shape))
    return q, k, v, torch.randn(q_shape, device="cuda", dtype=dtype)


# (batch, heads, kv heads, seqlen_q, seqlen_k)
DENSE = {"1023x1024": (1, 3, 3, 1023, 1024), "1024x1023": (1, 3, 3, 1024, 1023), "odd": (2, 2, 2, 77, 333),
         "gqa": (1, 4, 2, 1023, 1024)}


@every_case
@pytest.mark.parametrize("shape", list(DENSE))
def test_deterministic_dense(shape, dtype, d, causal, path):
    skip_same_kernel(d, path)
    b, h, hk, sq, sk = DENSE[shape]
    q, k, v, dout = _inputs((b, sq, h, d), (b, sk, hk, d), dtype)
    _assert_repeatable(lambda: flash_attn_func(q, k, v, causal=causal, deterministic=True), (q, k, v), dout)


VARLEN = {"3x799": ([3] * 6, [799] * 6), "mixed": ([1, 1023, 5, 300, 2], [1024, 1, 5, 799, 3])}


@every_case
@pytest.mark.parametrize("batch", list(VARLEN))
def test_deterministic_varlen(batch, dtype, d, causal, path):
    skip_same_kernel(d, path)
    lens_q, lens_k = VARLEN[batch]
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    q, k, v, dout = _inputs((sum(lens_q), 3, d), (sum(lens_k), 3, d), dtype)
    _assert_repeatable(lambda: flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                                      deterministic=True), (q, k, v), dout)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("seqlen, heads, kv_heads", [(1023, 4, 4), (1024, 4, 2), (2048, 2, 1)])
def test_deterministic_qkvpacked(seqlen, heads, kv_heads, dtype, d, path):
    """The model's call: q, k and v packed in one tensor, one gradient for it (grouped-query too)."""
    torch.manual_seed(next(_seed))
    qkv = torch.randn(2, seqlen, heads + 2 * kv_heads, d, device="cuda", dtype=dtype, requires_grad=True)
    dout = torch.randn(2, seqlen, heads, d, device="cuda", dtype=dtype)
    _assert_repeatable(lambda: flash_attn_qkvpacked_func(qkv, n_kv_heads=kv_heads, causal=True, deterministic=True),
                       (qkv,), dout)
