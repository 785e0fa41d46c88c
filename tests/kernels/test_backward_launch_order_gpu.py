"""GPU checks: the Hopper backward's main kernel, launched as a programmatic dependent of the pre-pass
(csrc/grid_dependency.h), reads D and adds into dQ's accumulator only after the pre-pass has written them.

Both buffers come from at::empty inside the binding; here every uninitialised float tensor is filled
with NaN first (gpu_util.poison_uninitialised_memory), so a read of D before the pre-pass wrote it, or a
reduce-add into dQ's accumulator before it was zeroed, leaves NaN in the gradients. Shapes with many
pre-pass blocks per main-kernel block (short sequences, many heads: the main kernel's blocks start
while the pre-pass's last blocks still run), packed batches whose short documents leave key blocks with
no keys (those blocks end at once), GQA; both schedules (lock-step and turns), fp16 and bf16, head dims
64 and 128, causal or not. dK and dV must be bit-identical to a call without the poison (each is one
block's sum, in a fixed order), dQ within a few units of it (its reduce-adds come in any order).

In most shapes the race is narrow: the main kernel's blocks start in grid order, so the first of them
read the D rows the pre-pass's first blocks wrote (a build without the waits passed the dense and packed
cases, H200, 48 cases x 4 calls). test_few_keys_many_queries opens the window: under a bottom-right causal
mask with 64k queries and 192 keys per head, each key block's first query block is the head's last, whose
D rows and dQ tiles the pre-pass's last blocks write, while SMs that ran only its first wave are already
free for the main kernel. A build without the waits fails all 8 of its cases (512 to 10752 non-finite dQ
values each, H200). test_backward_in_a_cuda_graph captures the dependent launch in a CUDA graph.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from gpu_util import (backward_path_fixture, cu_seqlens, fresh_factory, is_hopper,  # noqa: E402
                      poison_uninitialised_memory, require_extension)
from kernels import flash_attn_func, flash_attn_varlen_func  # noqa: E402

REPEATS = 4
fresh = fresh_factory(5100)
path = backward_path_fixture(["lockstep", "turns"])


@pytest.fixture(scope="module", autouse=True)
def _ext():
    require_extension()
    if not is_hopper():
        pytest.skip("the dependent launch is the Hopper backward's")


def _grads(run, inputs, dout):
    out = run()
    return torch.autograd.grad(out, inputs, dout)


def _assert_dq_close(dq, ref, what):
    """dQ's reduce-adds come in any order: within 8 units in the last place of ref's largest value."""
    err = (dq.float() - ref.float()).abs().max().item()
    tol = 8 * torch.finfo(dq.dtype).eps * max(1.0, ref.abs().max().item())
    assert err <= tol, f"dq differs from {what} by {err:.3e} > {tol:.1e}"


def _check_poisoned_like_clean(run, inputs, dout):
    clean = _grads(run, inputs, dout)
    assert all(torch.isfinite(g).all() for g in clean)
    for _ in range(REPEATS):
        with poison_uninitialised_memory():
            dq, dk, dv = _grads(run, inputs, dout)
        for name, got in (("dq", dq), ("dk", dk), ("dv", dv)):
            bad = int((~torch.isfinite(got)).sum())
            assert bad == 0, f"{name}: {bad} non-finite values (read before the pre-pass wrote)"
        assert torch.equal(dk, clean[1]) and torch.equal(dv, clean[2]), "dK / dV differ from the clean call"
        _assert_dq_close(dq, clean[0], "the clean call")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("b, s, h, h_k", [(48, 256, 24, 24), (6, 1531, 16, 4)])
def test_dense(path, dtype, d, causal, b, s, h, h_k):
    q = fresh(b, s, h, d, dtype=dtype).requires_grad_()
    k = fresh(b, s, h_k, d, dtype=dtype).requires_grad_()
    v = fresh(b, s, h_k, d, dtype=dtype).requires_grad_()
    dout = fresh(b, s, h, d, dtype=dtype)
    _check_poisoned_like_clean(lambda: flash_attn_func(q, k, v, causal=causal), (q, k, v), dout)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_packed_with_empty_key_blocks(path, dtype, d, causal):
    lengths = [1100, 37, 2048, 5, 700]  # key blocks past 37 or 5 keys hold no key of their document
    cu, total, longest = cu_seqlens(lengths), sum(lengths), max(lengths)
    q = fresh(total, 8, d, dtype=dtype).requires_grad_()
    k = fresh(total, 8, d, dtype=dtype).requires_grad_()
    v = fresh(total, 8, d, dtype=dtype).requires_grad_()
    dout = fresh(total, 8, d, dtype=dtype)

    def run():
        return flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=causal)

    _check_poisoned_like_clean(run, (q, k, v), dout)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("d", [64, 128])
def test_few_keys_many_queries(path, dtype, d):
    sq, sk, h = 65536, 192, 2  # rows before sq - sk see no key: output 0, gradients 0
    q = fresh(1, sq, h, d, dtype=dtype).requires_grad_()
    k = fresh(1, sk, h, d, dtype=dtype).requires_grad_()
    v = fresh(1, sk, h, d, dtype=dtype).requires_grad_()
    dout = fresh(1, sq, h, d, dtype=dtype)
    _check_poisoned_like_clean(lambda: flash_attn_func(q, k, v, causal=True), (q, k, v), dout)


@pytest.mark.parametrize("d", [64, 128])
def test_backward_in_a_cuda_graph(path, d):
    """The dependent launch under stream capture (a programmatic edge in the graph): a captured forward
    + backward replayed on new inputs gives the eager gradients (dK, dV bit for bit)."""
    shape = (2, 1536, 8, d)
    static = [fresh(*shape).requires_grad_() for _ in range(3)]
    static_dout = fresh(*shape)

    def step():
        out = flash_attn_func(*static, causal=True)
        return torch.autograd.grad(out, static, static_dout)

    side = torch.cuda.Stream()  # warm-up off the capture stream, as torch.cuda.graph asks
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for _ in range(3):
        inputs = [fresh(*shape) for _ in range(3)]
        dout = fresh(*shape)
        with torch.no_grad():
            for dst, src in zip(static, inputs):
                dst.copy_(src)
            static_dout.copy_(dout)
        graph.replay()
        eager = [t.clone().requires_grad_() for t in inputs]
        expected = torch.autograd.grad(flash_attn_func(*eager, causal=True), eager, dout)
        assert torch.equal(captured[1], expected[1]) and torch.equal(captured[2], expected[2])
        _assert_dq_close(captured[0], expected[0], "the eager call")
