"""GPU checks of our FlashAttention-2 kernels against the fp32 reference.

Tolerance as in FlashAttention's own tests: for the output and every gradient, the kernel's max
abs error vs the fp32 reference must be <= 2 x PyTorch's own max error computing the same thing
in the low precision (reference math on bf16/fp16 inputs) + a small eps + the error of the reference
itself stored in that precision (gpu_util.check_against_torch). Every tensor allocated
uninitialised -- the binding's outputs and workspaces included -- is filled with NaN (PyTorch's
deterministic mode with fill_uninitialized_memory; the kernels take `deterministic` as an argument, so
the mode changes no kernel choice): an element a kernel leaves unwritten shows. Inputs are fresh
torch.randn draws.
"""
from __future__ import annotations

import itertools

import pytest
import torch

# The poison fixture's deterministic mode warns at every op without a deterministic version (cuBLAS
# without CUBLAS_WORKSPACE_CONFIG among them): expected here, not news.
pytestmark = [pytest.mark.gpu,
              pytest.mark.filterwarnings("ignore:Deterministic behavior was enabled:UserWarning"),
              pytest.mark.filterwarnings("ignore:.*does not have a deterministic implementation:UserWarning")]
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from kernels import flash_attn_func, flash_attn_qkvpacked_func, flash_attn_varlen_func  # noqa: E402
from kernels.reference import attention_ref, attention_varlen_ref  # noqa: E402
# built_and_poisoned (autouse): outputs start as NaN, so an element a kernel leaves unwritten fails the comparison
from gpu_util import (InputSeeds, backward_path_fixture, built_and_poisoned, check_against_torch,  # noqa: E402,F401
                      max_err)

DTYPES = [torch.bfloat16, torch.float16]
HDIMS = [64, 96, 128]
EPS_OUT, EPS_GRAD = 1e-4, 1e-3
_seed = InputSeeds(1234)


# Every check runs through the default dispatch (on Hopper the warp-specialised TMA kernels at head
# dims 64 and 128, FA2 at 96), and on Hopper also through the FA2 kernels, the Hopper kernels forced over
# any default, and the Hopper backward in lock-step and in turns at every size (by default in turns
# from 1024 queries, or 512 at head dim 128 without a causal mask). Paths: tests/gpu_util.py KERNEL_PATHS.
kernel_path = backward_path_fixture(["default", "fa2", "hopper", "lockstep", "turns"])


@pytest.fixture(autouse=True)
def _every_path(kernel_path):
    return kernel_path


def _grads(out, inputs, dout):
    return torch.autograd.grad(out, inputs, dout)


def run_dense(b, h, hk, sq, sk, d, dtype, causal, deterministic=False, scale=None):
    torch.manual_seed(next(_seed))
    dev = "cuda"
    q = torch.randn(b, sq, h, d, device=dev, dtype=dtype, requires_grad=True)
    k = torch.randn(b, sk, hk, d, device=dev, dtype=dtype, requires_grad=True)
    v = torch.randn(b, sk, hk, d, device=dev, dtype=dtype, requires_grad=True)
    dout = torch.randn(b, sq, h, d, device=dev, dtype=dtype)

    out = flash_attn_func(q, k, v, causal=causal, softmax_scale=scale, deterministic=deterministic)
    dq, dk, dv = _grads(out, (q, k, v), dout)

    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    out_ref, _ = attention_ref(qf, kf, vf, causal, scale, upcast=True)
    dq_ref, dk_ref, dv_ref = _grads(out_ref, (qf, kf, vf), dout.float())
    out_pt, _ = attention_ref(q, k, v, causal, scale, upcast=False)
    dq_pt, dk_pt, dv_pt = _grads(out_pt, (q, k, v), dout)

    check_against_torch("out", out, out_ref, out_pt, EPS_OUT)
    check_against_torch("dq", dq, dq_ref, dq_pt, EPS_GRAD)
    check_against_torch("dk", dk, dk_ref, dk_pt, EPS_GRAD)
    check_against_torch("dv", dv, dv_ref, dv_pt, EPS_GRAD)
    return q, k, v, dout, out, (dq, dk, dv)


# (batch, heads, kv heads, seqlen_q, seqlen_k): the ragged-tile and alignment cases.
SHAPES = [
    (2, 4, 4, 1, 1), (1, 3, 3, 17, 17), (2, 2, 2, 127, 127), (1, 2, 2, 128, 128),
    (2, 2, 2, 129, 129), (1, 2, 2, 1000, 1000),
    (3, 2, 2, 113, 203),   # seqlen_q < seqlen_k
    (2, 2, 2, 256, 128),   # seqlen_q > seqlen_k: causal rows that see no key
    (1, 2, 2, 200, 64),
    (2, 1, 1, 64, 1000),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", HDIMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_dense(shape, dtype, d, causal):
    run_dense(*shape, d, dtype, causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("shape", [(2, 4, 4, 2048, 2048)], ids=["2k"])
def test_dense_2k(shape, d, causal):
    run_dense(*shape, d, torch.bfloat16, causal)


@pytest.mark.parametrize("causal", [False, True])
def test_dense_8k(causal):
    run_dense(1, 2, 2, 8192, 8192, 128, torch.bfloat16, causal)


# Causal, block-multiple lengths with seqlen_q != seqlen_k (bottom-right diagonal) in the backward's turns
# schedule (>= 1024 queries): the head-dim-128 walk splits each key block's query blocks at the diagonal,
# which here starts mid-walk or at its first block; below and from 4096 keys (with and without the
# empty-half skip).
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("shape", [(1, 2, 2, 2048, 1024), (1, 2, 2, 1024, 2048), (1, 1, 1, 8192, 4096),
                                   (1, 1, 1, 4096, 8192)], ids=lambda s: f"{s[3]}q{s[4]}k")
def test_causal_unequal_lengths_in_turns(shape, d, dtype):
    run_dense(*shape, d, dtype, True)


# Lengths that are not block multiples in the backward's turns schedule (>= 1024 queries; head dim 128
# without a causal mask from 512): the head-dim-128 ragged kernels walk each key block's query blocks in
# three parts (the blocks an edge crosses first and last, the unmasked ones between). Here with a partial
# last query block, a partial last key block (its whole walk masked), seqlen_q != seqlen_k both ways, and
# below and from 4096 keys (with and without the causal empty-half skip).
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("shape", [(1, 2, 2, 1100, 1100), (1, 2, 2, 1500, 1333), (1, 2, 2, 1333, 2500),
                                   (1, 1, 1, 4500, 4200), (1, 1, 1, 2100, 5000)], ids=lambda s: f"{s[3]}q{s[4]}k")
def test_ragged_lengths_in_turns(shape, d, dtype, causal):
    run_dense(*shape, d, dtype, causal)


# The Hopper forward's 160-key tiles (head dim 128, no causal mask, from 2048 keys;
# csrc/hopper/dispatch.h wide_key_tiles): keys a multiple of 160 (no tile masked), a last tile of one
# key with fewer queries than keys and GQA, and more queries than keys.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2, 2, 2080, 2080), (2, 2, 1, 300, 2241), (1, 3, 3, 4001, 4000)],
                         ids=lambda s: "x".join(map(str, s)))
def test_wide_key_tiles(shape, dtype):
    run_dense(*shape, 128, dtype, False)


@pytest.mark.parametrize("d", [32, 80, 112])
def test_padded_head_dims(d):
    run_dense(2, 2, 2, 77, 77, d, torch.bfloat16, True, scale=0.2)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("shape", [(2, 8, 2, 300, 300), (1, 4, 1, 128, 257), (2, 6, 3, 65, 33)],
                         ids=["gqa4", "mqa", "gqa2"])
def test_gqa(shape, d, causal):
    run_dense(*shape, d, torch.bfloat16, causal)


@pytest.mark.parametrize("d", [64, 128])
def test_strided_inputs(d):
    """q/k/v as views of a packed (b, s, 3, h, d) tensor: last dim contiguous, others strided."""
    torch.manual_seed(next(_seed))
    qkv = torch.randn(2, 150, 3, 4, d, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(2)
    assert not q.is_contiguous()
    out = flash_attn_func(q, k, v, causal=True)
    ref = flash_attn_func(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
    assert torch.equal(out, ref)


def test_lse():
    torch.manual_seed(next(_seed))
    q = torch.randn(2, 100, 2, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 60, 2, 64, device="cuda", dtype=torch.bfloat16)
    out, lse = flash_attn_func(q, k, k, causal=True, return_lse=True)
    _, lse_ref = attention_ref(q.float(), k.float(), k.float(), True)
    finite = torch.isfinite(lse_ref)
    assert (~finite).sum() > 0  # rows 0..39 see no key (bottom-right alignment)
    assert torch.isinf(lse[~finite]).all() and (out[:, :40] == 0).all()
    assert (lse[finite] - lse_ref[finite]).abs().max().item() < 1e-2


def test_forward_bitwise_repeatable():
    torch.manual_seed(next(_seed))
    q, k, v = (torch.randn(2, 777, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    o1 = flash_attn_func(q, k, v, causal=True)
    o2 = flash_attn_func(q, k, v, causal=True)
    assert torch.equal(o1, o2)


@pytest.mark.parametrize("d", [64, 128])
def test_forward_in_a_cuda_graph_and_on_two_streams(d):
    """The persistent forward's tile counter (one pair per stream, left at zero by each launch; a
    zeroed pair per call while a graph is captured): calls on a second stream, a captured graph
    replayed on new inputs, then eager calls again all give the eager result bit for bit."""
    torch.manual_seed(next(_seed))
    shape = (4, 1024, 8, d)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    expected = flash_attn_func(q, k, v, causal=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = [flash_attn_func(q, k, v, causal=True) for _ in range(3)]
    torch.cuda.current_stream().wait_stream(side)
    assert all(torch.equal(o, expected) for o in on_side)
    static = [t.clone() for t in (q, k, v)]
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = flash_attn_func(*static, causal=True)
    for _ in range(3):
        fresh = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        g.replay()
        assert torch.equal(out, flash_attn_func(*fresh, causal=True))
    assert torch.equal(flash_attn_func(q, k, v, causal=True), expected)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", HDIMS)
def test_deterministic_backward(d, causal):
    q, k, v, dout, _, g1 = run_dense(2, 4, 2, 600, 700, d, torch.bfloat16, causal, deterministic=True)
    for _ in range(2):
        out = flash_attn_func(q, k, v, causal=causal, deterministic=True)
        g2 = _grads(out, (q, k, v), dout)
        for a, b_ in zip(g1, g2):
            assert torch.equal(a, b_)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("shape", [(3, 16, 16, 384, 384), (5, 7, 7, 333, 333), (1, 8, 8, 8000, 8000)],
                         ids=["48heads", "35heads", "8heads_8000"])
def test_causal_head_groups(shape, d):
    """Causal Hopper grids interleave up to 16 heads a group (hopper/dispatch.h head_group): 48 heads are
    three groups, 35 lower the group to 7; at 8000 tokens a group's tensors are kept within L2, so the
    head-dim-128 backward runs 4 heads a group (two groups; its forward and head dim 64 one group of 8).
    Every block of every head runs, and the deterministic backward's in-order dQ additions still find the
    lower key blocks started first."""
    run_dense(*shape, d, torch.float16, True, deterministic=True)
    run_dense(*shape, d, torch.bfloat16, True)


def _cu(lens):
    return torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device="cuda")


def _check_varlen(lens_q, lens_k, h, hk, d, dtype, causal):
    """Packed sequences of lengths lens_q / lens_k (h query, hk key/value heads): output and gradients
    against the fp32 reference, within 2x PyTorch's own bf16/fp16 error (_check)."""
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    tq, tk = sum(lens_q), sum(lens_k)
    q = torch.randn(tq, h, d, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(tk, hk, d, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(tk, hk, d, device="cuda", dtype=dtype, requires_grad=True)
    dout = torch.randn(tq, h, d, device="cuda", dtype=dtype)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal)
    grads = _grads(out, (q, k, v), dout)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    out_ref, _ = attention_varlen_ref(qf, kf, vf, cu_q, cu_k, causal)
    grads_ref = _grads(out_ref, (qf, kf, vf), dout.float())
    out_pt, _ = attention_varlen_ref(q, k, v, cu_q, cu_k, causal, upcast=False)
    grads_pt = _grads(out_pt, (q, k, v), dout)
    check_against_torch("out", out, out_ref, out_pt, EPS_OUT)
    for n, a, r, p in zip(("dq", "dk", "dv"), grads, grads_ref, grads_pt):
        check_against_torch(n, a, r, p, EPS_GRAD)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen(dtype, d, causal):
    torch.manual_seed(next(_seed))
    _check_varlen([1, 17, 129, 300, 64, 1000], [5, 17, 100, 300, 200, 1000], 4, 2, d, dtype, causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_long_sequences_in_turns(dtype, causal):
    """Packed sequences long enough for the backward's turns schedule, of ragged and unequal query / key
    lengths (the ragged kernels' walk in parts, per sequence), head dim 128."""
    torch.manual_seed(next(_seed))
    _check_varlen([1100, 37, 2500, 700], [1200, 50, 2400, 700], 4, 2, 128, dtype, causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_varlen_many_short_sequences(d, causal):
    """A packed batch of ~200 sequences of 0-20 tokens and one of 300: the tiled dQ accumulator of the
    Hopper backward would need several times the row-major room (hopper/dq_tiles.h), so the binding
    allocates row-major only and the backward runs a row-major kernel instead. Gradients as usual."""
    torch.manual_seed(next(_seed))
    gen = torch.Generator().manual_seed(7)
    lens = [int(x) for x in torch.randint(0, 21, (200,), generator=gen)] + [300]
    _check_varlen(lens, lens, 2, 2, d, torch.bfloat16, causal)


@pytest.mark.parametrize("window_size", [(-1, -1), (63, 0)])  # dense, and a local layer's band
def test_torch_compile_fullgraph(window_size):
    torch.manual_seed(next(_seed))

    def f(q, k, v):
        return flash_attn_func(q, k, v, causal=True, window_size=window_size).float().square().sum()

    cf = torch.compile(f, fullgraph=True)
    q, k, v = (torch.randn(2, 300, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    l1 = f(q, k, v)
    g1 = torch.autograd.grad(l1, (q, k, v))
    l2 = cf(q, k, v)
    g2 = torch.autograd.grad(l2, (q, k, v))
    torch.testing.assert_close(l1, l2, rtol=1e-4, atol=1e-3)
    for a, b_ in zip(g1, g2):
        torch.testing.assert_close(a, b_, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("h,hk", [(5, 5), (6, 2)])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_qkvpacked_matches_the_slices(h, hk, d, causal):
    """flash_attn_qkvpacked_func against flash_attn_func on the q / k / v slices of the same tensor:
    forward and deterministic backward bit for bit (dq, dk, dv written into one dqkv; the poisoned
    outputs catch any slice left unwritten), and the forward against the fp32 reference. Odd length,
    batch 2, grouped-query (6 q heads over 2 kv heads) included."""
    torch.manual_seed(next(_seed))
    qkv = torch.randn(2, 700, h + 2 * hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(2, 700, h, d, device="cuda", dtype=torch.bfloat16)
    out_p = flash_attn_qkvpacked_func(qkv, n_kv_heads=hk, causal=causal, deterministic=True)
    (g_p,) = torch.autograd.grad(out_p, qkv, dout)
    q, k, v = qkv[:, :, :h], qkv[:, :, h:h + hk], qkv[:, :, h + hk:]
    out_s = flash_attn_func(q, k, v, causal=causal, deterministic=True)
    (g_s,) = torch.autograd.grad(out_s, qkv, dout)
    assert torch.equal(out_p, out_s)
    assert torch.equal(g_p, g_s)
    assert torch.isfinite(g_p).all() and g_p.abs().amax(dim=(0, 1, 3)).min() > 0  # every head has a gradient
    out_ref, _ = attention_ref(q.float(), k.float(), v.float(), causal, d ** -0.5, upcast=True)
    assert max_err(out_p, out_ref) < 2e-2


def test_qkvpacked_compiles_fullgraph():
    torch.manual_seed(next(_seed))

    def f(qkv):
        return flash_attn_qkvpacked_func(qkv, causal=True, deterministic=True).float().square().sum()

    qkv = torch.randn(2, 333, 12, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    l1 = f(qkv)
    (g1,) = torch.autograd.grad(l1, qkv)
    l2 = torch.compile(f, fullgraph=True)(qkv)
    (g2,) = torch.autograd.grad(l2, qkv)
    torch.testing.assert_close(l1, l2, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(g1, g2, rtol=1e-2, atol=1e-2)


def test_autocast_fp32_inputs():
    torch.manual_seed(next(_seed))
    q, k, v = (torch.randn(2, 100, 2, 64, device="cuda") for _ in range(3))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = flash_attn_func(q, k, v, causal=True)
    assert out.dtype == torch.bfloat16
    ref = flash_attn_func(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True)
    assert torch.equal(out, ref)


def test_opcheck():
    torch.manual_seed(next(_seed))
    q = torch.randn(2, 65, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 65, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, 65, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.library.opcheck(torch.ops.flashgpt.fwd.default,
                          (q, k, v, None, None, 65, 65, 0.125, True, False))
    cu = _cu([20, 45])
    qv = torch.randn(65, 4, 64, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(65, 2, 64, device="cuda", dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.flashgpt.fwd.default,
                          (qv, kv, kv, cu, cu, 45, 45, 0.125, False, False))
    out, lse = torch.ops.flashgpt.fwd(q.detach(), k.detach(), v.detach(), None, None, 65, 65, 0.125,
                                      True, False)
    dout = torch.randn_like(out)
    torch.library.opcheck(torch.ops.flashgpt.bwd.default,
                          (dout, q.detach(), k.detach(), v.detach(), out, lse, None, None, 65, 65,
                           0.125, True, True))


@pytest.mark.parametrize("varlen", [False, True])
def test_eager_path_matches_the_op(varlen):
    """Eager calls run _EagerFlash (the binding, no custom-op dispatch); the op that torch.compile
    traces, with its registered autograd, gives the same output and gradients bit for bit."""
    torch.manual_seed(next(_seed))
    shape = (301, 4, 128) if varlen else (2, 301, 4, 128)
    q, k, v = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    cu = _cu([100, 201]) if varlen else None
    max_len = 201 if varlen else 301
    if varlen:
        eager = flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, causal=True, deterministic=True)
    else:
        eager = flash_attn_func(q, k, v, causal=True, deterministic=True)
    op, _ = torch.ops.flashgpt.fwd(q, k, v, cu, cu, max_len, max_len, 128 ** -0.5, True, True)
    assert torch.equal(eager, op)
    for name, a, b in zip("qkv", torch.autograd.grad(eager, (q, k, v), dout),
                          torch.autograd.grad(op, (q, k, v), dout)):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("bad, match", [
    ("d160", "head dim 160"), ("fp32", "dtype"), ("lastdim", "last dim"), ("empty", "empty"),
])
def test_gpu_value_errors(bad, match):
    mk = lambda *s, **kw: torch.randn(*s, device="cuda", dtype=kw.get("dtype", torch.bfloat16))  # noqa: E731
    if bad == "d160":
        q = mk(1, 8, 2, 160)
    elif bad == "fp32":
        q = mk(1, 8, 2, 64, dtype=torch.float32)
    elif bad == "lastdim":
        q = mk(1, 8, 2, 64).transpose(1, 3)
    else:
        q = mk(1, 0, 2, 64)
    with pytest.raises(ValueError, match=match):
        flash_attn_func(q, q, q)


def test_more_heads_than_a_grid_dimension_holds():
    """batch * heads = 66000, above one grid dimension's 65535 (grid_order.h splits them over x and z): exact."""
    run_dense(33000, 2, 2, 3, 5, 64, torch.bfloat16, True)
