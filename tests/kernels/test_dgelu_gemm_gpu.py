"""GPU checks of the fused dgelu GEMM (csrc/mlp/dgelu_gemm*.cu): dpre = (dy w2) * gelu_tanh'(pre) and
db1 = dpre's column sums from one CUTLASS GEMM, against the fp32 reference, every built variant; and the
GELU MLP's backward with each variant and with the fused GEMM off.

Tolerance: max abs error vs the fp32 reference (the same math on the bf16 inputs upcast) <= 2 x torch's
own error doing it in bf16 (a bf16 product, then the GELU backward) + a small eps. Fresh randn inputs;
sizes include ones that fill no tile (rows, h and d not multiples of the 128 / 256 / 64 tile sides).
"""
from __future__ import annotations

import itertools

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import kernels  # noqa: E402
from kernels import gelu_mlp as gm  # noqa: E402

_seed = itertools.count(4242)


@pytest.fixture(scope="module")
def ext():
    if not kernels.is_available():
        pytest.fail("extension did not build: " + kernels.unavailable_reason())
    from kernels.build import load_extension

    return load_extension()


def variants(ext) -> list[int]:
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the fused dgelu GEMM is Hopper code")
    n = ext.dgelu_gemm_variants()
    if n == 0:
        pytest.skip("built without CUTLASS headers (pip install nvidia-cutlass)")
    return list(range(n))


def make(m, d, h):
    torch.manual_seed(next(_seed))
    dy = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
    w2 = (torch.randn(d, h, device="cuda") / d ** 0.5).bfloat16()
    pre = (torch.randn(m, h, device="cuda") * 1.5).bfloat16()  # the GELU's curved range
    return dy, w2, pre


@pytest.mark.parametrize("m,d,h", [(1, 64, 256), (77, 128, 520), (1000, 136, 1024), (4099, 512, 2056),
                                   (8192, 256, 1032)])
def test_matches_fp32_reference(ext, m, d, h):
    dy, w2, pre = make(m, d, h)
    ref = torch.ops.aten.gelu_backward(dy.float() @ w2.float(), pre.float(), approximate="tanh")
    low = torch.ops.aten.gelu_backward(dy @ w2, pre, approximate="tanh").float()
    for variant in variants(ext):
        dpre, db1 = ext.dgelu_gemm(dy, w2, pre, variant)
        assert dpre.shape == (m, h) and dpre.dtype == torch.bfloat16 and db1.shape == (h,)
        assert db1.dtype == torch.float32
        err, torch_err = (dpre.float() - ref).abs().max().item(), (low - ref).abs().max().item()
        assert err <= 2 * torch_err + 1e-3 * ref.abs().max().item(), (variant, err, torch_err)
        # db1 sums the fp32 values before their bf16 rounding: compare with the reference's sums
        col, col_low = ref.sum(0), low.sum(0)
        b_err, b_torch = (db1 - col).abs().max().item(), (col_low - col).abs().max().item()
        assert b_err <= 2 * b_torch + 1e-3 * col.abs().max().item(), (variant, b_err, b_torch)


def test_bias_sum_is_deterministic(ext):
    dy, w2, pre = make(3000, 256, 1024)
    for variant in variants(ext):
        first = ext.dgelu_gemm(dy, w2, pre, variant)
        again = ext.dgelu_gemm(dy, w2, pre, variant)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1]), variant


def test_rejects_what_it_cannot_run(ext):
    dy, w2, pre = make(64, 128, 256)
    with pytest.raises(RuntimeError, match="bf16"):
        ext.dgelu_gemm(dy.half(), w2.half(), pre.half(), 0)
    with pytest.raises(RuntimeError, match="do not fit"):
        ext.dgelu_gemm(dy, w2, pre[:, :128].contiguous(), 0)
    with pytest.raises(RuntimeError, match="not built"):
        ext.dgelu_gemm(dy, w2, pre, 99)


@pytest.mark.parametrize("recompute_gelu", [False, True])
@pytest.mark.parametrize("variant", [-1, 0, 1, 2])
def test_mlp_backward_each_way(ext, variant, recompute_gelu):
    """The whole GELU MLP (eager and compiled) with each variant and with the fused GEMM off; with the
    GELU output kept, and rebuilt in the backward (model.recompute_gelu)."""
    import torch.nn.functional as F

    if variant >= 0 and variant not in variants(ext):
        pytest.skip(f"variant {variant} not built")
    torch.manual_seed(next(_seed))
    m, d, h = 1531, 256, 1032
    x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
    w1 = (torch.randn(h, d, device="cuda") / d ** 0.5).bfloat16()
    b1 = (torch.randn(h, device="cuda") * 0.5).bfloat16()
    w2 = (torch.randn(d, h, device="cuda") / h ** 0.5).bfloat16()
    b2 = (torch.randn(d, device="cuda") * 0.5).bfloat16()
    dy = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)

    def grads(fn, upcast):
        leaves = [(t.float() if upcast else t.clone()).requires_grad_() for t in (x, w1, b1, w2, b2)]
        y = fn(*leaves)
        y.backward(dy.float() if upcast else dy)
        return [y.float()] + [t.grad.float() for t in leaves]

    def ref_mlp(*a):
        return F.linear(F.gelu(F.linear(a[0], a[1], a[2]), approximate="tanh"), a[3], a[4])

    old = gm._dgelu_variant
    try:
        gm.set_dgelu_gemm(variant)
        torch._dynamo.reset()  # the variant is read when the backward is traced
        ref, low = grads(ref_mlp, True), grads(ref_mlp, False)
        def mlp(*a):
            return gm.gelu_mlp(*a, recompute_gelu=recompute_gelu)

        for fn in (mlp, torch.compile(mlp, fullgraph=True)):
            ours = grads(fn, False)
            for name, o, r, lo in zip(["y", "dx", "dw1", "db1", "dw2", "db2"], ours, ref, low):
                err, torch_err = (o - r).abs().max().item(), (lo - r).abs().max().item()
                assert err <= 2 * torch_err + 1e-3 * r.abs().max().item(), (variant, name, err, torch_err)
    finally:
        gm.set_dgelu_gemm(old)
        torch._dynamo.reset()


def test_opcheck(ext):
    variant = variants(ext)[0]
    dy, w2, pre = make(40, 64, 256)
    torch.library.opcheck(gm._dgelu_gemm_op, (dy, w2, pre, variant))
