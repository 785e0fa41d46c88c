"""Hopper building blocks (kernels/csrc/hopper/wgmma.h) on one tile, against torch matmuls:
C1 = A B^T with both operands K-major in 128B-swizzled shared memory, and C2 = bf16(C1) V with the
A operand from registers and V MN-major (transposed B). Fresh random inputs every run; the check
fails on any layout mistake (a swapped row, chunk or register shows as an O(1) error)."""
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if torch.cuda.get_device_capability()[0] != 9:
    pytest.skip("needs a Hopper GPU (sm_90)", allow_module_level=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_wgmma_probe_matches_torch(dtype):
    from kernels.build import load_extension
    g = torch.Generator(device="cuda").manual_seed(7)
    a = torch.randn(64, 128, device="cuda", dtype=dtype, generator=g)
    b = torch.randn(128, 128, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(128, 128, device="cuda", dtype=dtype, generator=g)
    c1, c2 = load_extension().wgmma_probe(a, b, v)
    ref1 = a.float() @ b.float().T
    # fp32 accumulation of exact 16-bit products: only the summation order differs
    torch.testing.assert_close(c1, ref1, atol=1e-3, rtol=1e-4)
    ref2 = c1.to(dtype).float() @ v.float()  # the kernel rounds its own C1 to 16 bits for P
    torch.testing.assert_close(c2, ref2, atol=1e-2, rtol=1e-4)


def test_wgmma_probe_rejects_bad_shapes():
    from kernels.build import load_extension
    a = torch.randn(32, 128, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(128, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="shapes a"):
        load_extension().wgmma_probe(a, b, b)
