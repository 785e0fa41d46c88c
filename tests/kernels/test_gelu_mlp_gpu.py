"""GPU checks of the GELU-epilogue MLP (kernels/gelu_mlp.py) against the fp32 reference.

Tolerance as in the attention tests: max abs error vs the fp32 reference (the same math on the
bf16/fp16 inputs upcast) <= 2 x PyTorch's own error computing the same MLP in the low precision + a
small eps, for the output and every gradient. Inputs are fresh torch.randn draws scaled so the GELU
input spans its curved range (std ~1); row counts include odd ones.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import kernels  # noqa: E402
from gpu_util import InputSeeds  # noqa: E402
from kernels.gelu_mlp import gelu_mlp, gelu_mlp_supported, reference_mlp  # noqa: E402

_seed = InputSeeds(777)
EPS = 1e-3


@pytest.fixture(scope="module", autouse=True)
def _ext():
    if not kernels.is_available():
        pytest.fail("extension did not build: " + kernels.unavailable_reason())


def make(m, d, h, dtype, bias=True, lead=None):
    torch.manual_seed(next(_seed))
    dev = "cuda"
    x = torch.randn(*(lead or (m,)), d, device=dev, dtype=dtype)
    w1 = torch.randn(h, d, device=dev, dtype=dtype) / d ** 0.5  # pre-activation std ~1
    b1 = torch.randn(h, device=dev, dtype=dtype) * 0.5 if bias else None
    w2 = torch.randn(d, h, device=dev, dtype=dtype) / h ** 0.5
    b2 = torch.randn(d, device=dev, dtype=dtype) * 0.5 if bias else None
    dy = torch.randn(*(lead or (m,)), d, device=dev, dtype=dtype)
    return [x, w1, b1, w2, b2], dy


def leaf(t, upcast):
    if t is None:
        return None
    return (t.detach().float() if upcast else t.detach().clone()).requires_grad_()


def out_and_grads(fn, inputs, dy, upcast=False):
    leaves = [leaf(t, upcast) for t in inputs]
    y = fn(*leaves)
    y.backward(dy.float() if upcast else dy)
    return [y.detach().float()] + [t.grad.float() if t is not None else None for t in leaves]


def check_against_reference(fn, inputs, dy):
    ours = out_and_grads(fn, inputs, dy)
    ref = out_and_grads(reference_mlp, inputs, dy, upcast=True)
    low = out_and_grads(reference_mlp, inputs, dy)
    names = ["y", "dx", "dw1", "db1", "dw2", "db2"]
    for name, o, r, lo in zip(names, ours, ref, low):
        if r is None:
            assert o is None, name
            continue
        assert torch.isfinite(o).all(), name
        err, torch_err = (o - r).abs().max().item(), (lo - r).abs().max().item()
        scale = r.abs().max().item()
        assert err <= 2 * torch_err + EPS * scale, f"{name}: ours {err:.3e} vs torch {torch_err:.3e} (max {scale:.2e})"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,d,h", [(1, 64, 256), (77, 128, 512), (1000, 256, 1024), (4099, 512, 2048),
                                   (333, 136, 520)])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_fp32_reference(m, d, h, dtype, bias):
    inputs, dy = make(m, d, h, dtype, bias)
    assert gelu_mlp_supported(*inputs) == ""
    check_against_reference(gelu_mlp, inputs, dy)


def test_batched_input_and_compile():
    inputs, dy = make(0, 256, 1024, torch.bfloat16, lead=(3, 129))
    check_against_reference(gelu_mlp, inputs, dy)
    check_against_reference(torch.compile(gelu_mlp, fullgraph=True), inputs, dy)


def test_epilogue_outputs_are_tanh_gelu_and_its_input():
    """The binding's two outputs by themselves: pre = x w1^T + b1, g = gelu_tanh(pre) (not erf)."""
    from kernels.build import load_extension

    (x, w1, b1, _, _), _ = make(2048, 256, 1024, torch.float16)
    g, pre = load_extension().linear_gelu(x, w1, b1)
    pre_ref = x.float() @ w1.float().t() + b1.float()
    assert (pre.float() - pre_ref).abs().max().item() < 1e-2
    p = pre.float()  # the GELU is applied to the fp32 accumulator; compare against both variants
    tanh_err = (g.float() - F.gelu(p, approximate="tanh")).abs().mean().item()
    erf_err = (g.float() - F.gelu(p)).abs().mean().item()
    assert tanh_err < erf_err, (tanh_err, erf_err)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,cols", [(1, 8), (7, 136), (1531, 1032), (4099, 8192)])
def test_gelu_backward_bias_kernel(rows, cols, dtype):
    """gelu_backward_bias: dpre = dg * gelu_tanh'(pre); its partial sums add up to dpre's column sums."""
    from kernels.build import load_extension
    from kernels.gelu_mlp import _row_groups

    torch.manual_seed(next(_seed))
    dg = torch.randn(rows, cols, device="cuda", dtype=dtype)
    pre = torch.randn(rows, cols, device="cuda", dtype=dtype) * 2
    dpre, partial = load_extension().gelu_backward_bias(dg, pre)
    ref = torch.ops.aten.gelu_backward(dg.float(), pre.float(), approximate="tanh")
    assert partial.shape == (_row_groups(rows, cols), cols) and partial.dtype == torch.float32
    low = torch.ops.aten.gelu_backward(dg, pre, approximate="tanh").float()  # torch in the low precision
    assert (dpre.float() - ref).abs().max().item() <= 2 * (low - ref).abs().max().item() + 1e-6
    col_sums = dpre.float().sum(0)  # the kernel sums what it stored
    assert torch.allclose(partial.sum(0), col_sums, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,cols", [(1, 8), (7, 136), (1531, 1032)])
def test_gelu_backward_bias_kernel_rebuilds_gelu(rows, cols, dtype):
    """with_gelu: the same dpre and partial sums, and g = gelu_tanh(pre) as torch computes it."""
    from kernels.build import load_extension

    torch.manual_seed(next(_seed))
    dg = torch.randn(rows, cols, device="cuda", dtype=dtype)
    pre = torch.randn(rows, cols, device="cuda", dtype=dtype) * 3
    ext = load_extension()
    dpre, partial, g = ext.gelu_backward_bias(dg, pre, True)
    dpre0, partial0 = ext.gelu_backward_bias(dg, pre)
    assert torch.equal(dpre, dpre0) and torch.equal(partial, partial0)
    ref = F.gelu(pre.float(), approximate="tanh")
    low = F.gelu(pre, approximate="tanh").float()  # torch in the low precision
    assert g.dtype == dtype and g.shape == pre.shape
    assert (g.float() - ref).abs().max().item() <= 2 * (low - ref).abs().max().item() + 1e-6


@pytest.mark.parametrize("m,d,h", [(77, 128, 512), (1000, 256, 1024), (333, 136, 520)])
@pytest.mark.parametrize("compiled", [False, True])
def test_recompute_gelu_matches_fp32_reference(m, d, h, compiled):
    """recompute_gelu=True (g not kept, rebuilt for w2's gradient): the same tolerance vs fp32."""
    inputs, dy = make(m, d, h, torch.bfloat16)

    def fn(*a):
        return gelu_mlp(*a, recompute_gelu=True)

    check_against_reference(torch.compile(fn, fullgraph=True) if compiled else fn, inputs, dy)


def test_recompute_gelu_keeps_less_and_adds_into_main_grads():
    """What the backward keeps drops by g's (M, h); with fp32 gradient buffers the weight gradients
    land in them as without recompute (to the rounding of g)."""
    inputs, dy = make(1024, 256, 1024, torch.bfloat16)
    saved_bytes, grads = {}, {}
    for recompute in (False, True):
        x, w1, b1, w2, b2 = [leaf(t, False) for t in inputs]
        main1, main2 = torch.zeros_like(w1, dtype=torch.float32), torch.zeros_like(w2, dtype=torch.float32)
        sizes = []

        def pack(t):
            sizes.append((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = gelu_mlp(x, w1, b1, w2, b2, main1, main2, recompute_gelu=recompute)
        y.backward(dy)
        saved_bytes[recompute] = sum(dict(sizes).values())
        grads[recompute] = (x.grad.float(), main1, main2, b1.grad.float())
    m, h = 1024, 1024
    assert saved_bytes[False] - saved_bytes[True] == m * h * 2  # g: (M, h) bf16
    for a, b in zip(grads[False], grads[True]):
        assert torch.isfinite(b).all()
        assert (a - b).abs().max().item() <= 0.02 * a.abs().max().item()


def test_autocast_casts_like_linear():
    """fp32 parameters under bf16 autocast: a bf16 output and fp32 gradients, as with F.linear."""
    inputs, dy = make(300, 128, 512, torch.float32)
    leaves = [t.clone().requires_grad_() for t in inputs]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert gelu_mlp_supported(*leaves) == ""
        y = gelu_mlp(*leaves)
        ref = reference_mlp(*[t.detach() for t in inputs])
    assert y.dtype == torch.bfloat16
    y.backward(dy.bfloat16())
    assert all(t.grad.dtype == torch.float32 for t in leaves)
    assert (y.float() - ref.float()).abs().max().item() < 0.05 * ref.float().abs().max().item()


def test_unsupported_sizes_fall_back_to_torch():
    inputs, dy = make(50, 60, 240, torch.bfloat16)  # d = 60: rows not a multiple of 8
    assert "multiples of 8" in gelu_mlp_supported(*inputs)
    out = gelu_mlp(*inputs)
    assert torch.equal(out, reference_mlp(*inputs))


def test_opcheck():
    """torch.library's own checks of the op's schema, fake kernel and autograd registration."""
    from kernels.gelu_mlp import _gelu_mlp_op

    inputs, _ = make(40, 64, 256, torch.bfloat16)
    args = [t.requires_grad_() if t is not None else None for t in inputs]
    torch.library.opcheck(_gelu_mlp_op, args + [None, None, True])  # no fp32 gradient buffers; g saved
    torch.library.opcheck(_gelu_mlp_op, args + [None, None, False])  # g rebuilt in the backward


def test_in_a_cuda_graph():
    """The fused MLP captured in a CUDA graph (its first call, the cuBLASLt heuristic's pick, inside the
    capture) and replayed on new inputs gives what eager calls give."""
    inputs, _ = make(200, 192, 768, torch.bfloat16)  # a shape no other test uses: first call is captured
    static = [t.clone() for t in inputs]
    g = torch.cuda.CUDAGraph()
    with torch.no_grad():
        with torch.cuda.graph(g):
            out = gelu_mlp(*static)
        for _ in range(2):
            fresh, _ = make(200, 192, 768, torch.bfloat16)
            for dst, src in zip(static, fresh):
                dst.copy_(src)
            g.replay()
            torch.cuda.synchronize()
            ref = reference_mlp(*[t.float() for t in fresh])
            assert (out.float() - ref).abs().max().item() < 0.03 * ref.abs().max().item()
