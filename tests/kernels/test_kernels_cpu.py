"""CPU-runnable checks: import, availability, clear errors, validation, reference math."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kernels
from kernels.reference import attention_ref, attention_varlen_ref

REPO = Path(__file__).resolve().parents[2]


def test_import_is_ours_and_cheap():
    assert Path(kernels.__file__).resolve().parent == REPO / "kernels"
    import subprocess
    import sys
    # A fresh interpreter: importing kernels must not even import the build module.
    code = "import sys, kernels; assert 'kernels.build' not in sys.modules; print('ok')"
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert r.stdout.strip() == "ok", r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_unavailable_on_cpu():
    assert kernels.is_available() is False
    reason = kernels.unavailable_reason()
    assert "CUDA is not available" in reason


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_cpu_tensors_clear_error():
    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="needs CUDA tensors.*Fix"):
        kernels.flash_attn_func(q, q, q)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_build_entry_point_fails_clearly_without_cuda():
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "kernels.build"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 1 and "CUDA is not available" in r.stderr


def _qkv(b=1, s=8, h=2, d=64, dtype=torch.bfloat16, hk=None):
    hk = hk or h
    return (torch.randn(b, s, h, d, dtype=dtype), torch.randn(b, s, hk, d, dtype=dtype),
            torch.randn(b, s, hk, d, dtype=dtype))


@pytest.mark.parametrize("make, match", [
    (lambda: _qkv(dtype=torch.float32), "dtype"),
    (lambda: _qkv(d=160), "head dim 160 > 128"),
    (lambda: (torch.randn(1, 8, 2, 64, dtype=torch.bfloat16),) + _qkv(s=8, d=32)[1:], "head dims differ"),
    (lambda: _qkv(h=3, hk=2), "multiple"),
    (lambda: _qkv(s=0), "empty"),
    (lambda: tuple(t.transpose(-1, -2) for t in _qkv(d=8, s=8)) , "last dim must be contiguous"),
    (lambda: (torch.randn(8, 2, 64, dtype=torch.bfloat16),) * 3, "4-D"),
])
def test_validation_value_errors(make, match):
    q, k, v = make()
    with pytest.raises(ValueError, match=match):
        kernels.flash_attn_func(q, k, v)


@pytest.mark.parametrize("make, kv, match", [
    (lambda: torch.randn(2, 8, 64, dtype=torch.bfloat16), None, "4-D"),
    (lambda: torch.randn(1, 8, 4, 64, dtype=torch.bfloat16), None, "not 3 x heads"),
    (lambda: torch.randn(1, 8, 4, 64, dtype=torch.bfloat16), 2, "leaves no q heads"),
    (lambda: torch.randn(1, 8, 7, 64, dtype=torch.bfloat16), 2, "multiple"),  # 3 q heads over 2 kv heads
    (lambda: torch.randn(1, 8, 6, 64, dtype=torch.float32), None, "dtype"),
    (lambda: torch.randn(1, 8, 5, 64, dtype=torch.bfloat16), 1, "CUDA"),  # valid (3 q heads, 1 kv): device
])
def test_qkvpacked_validation(make, kv, match):
    with pytest.raises(ValueError, match=match):
        kernels.flash_attn_qkvpacked_func(make(), n_kv_heads=kv)


def test_varlen_mismatched_cu_seqlens():
    q = torch.randn(10, 2, 64, dtype=torch.bfloat16)
    cu_q = torch.tensor([0, 4, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q has 3 entries"):
        kernels.flash_attn_varlen_func(q, q, q, cu_q, cu_k, 6, 10)
    with pytest.raises(ValueError, match="int32"):
        kernels.flash_attn_varlen_func(q, q, q, cu_q.long(), cu_q.long(), 6, 6)


def _naive(q, k, v, causal, scale):
    """Loop-per-row attention in float64 (independent of attention_ref's vectorised code)."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    out = torch.zeros(b, sq, h, d, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            kh = hi // (h // hk)
            for i in range(sq):
                s = [(q[bi, i, hi].double() @ k[bi, j, kh].double()) * scale for j in range(sk)
                     if not causal or j <= i + sk - sq]
                if not s:
                    continue
                s = torch.stack(s)
                p = torch.softmax(s, 0)
                out[bi, i, hi] = (p[:, None] * v[bi, :len(s), kh].double()).sum(0)
    return out


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk,h,hk", [(5, 5, 2, 2), (7, 4, 4, 2), (3, 9, 2, 1)])
def test_reference_matches_naive(causal, sq, sk, h, hk):
    torch.manual_seed(0)
    q = torch.randn(2, sq, h, 16)
    k = torch.randn(2, sk, hk, 16)
    v = torch.randn(2, sk, hk, 16)
    out, lse = attention_ref(q, k, v, causal=causal, softmax_scale=0.3)
    ref = _naive(q, k, v, causal, 0.3)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert lse.shape == (2, h, sq)


def test_varlen_reference_is_per_sequence():
    torch.manual_seed(1)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    q, k, v = (torch.randn(8, 2, 16) for _ in range(3))
    out, lse = attention_varlen_ref(q, k, v, cu, cu, causal=True)
    o1, _ = attention_ref(q[None, :3], k[None, :3], v[None, :3], causal=True)
    o2, _ = attention_ref(q[None, 3:], k[None, 3:], v[None, 3:], causal=True)
    torch.testing.assert_close(out, torch.cat([o1[0], o2[0]]))
    assert lse.shape == (2, 8)


def test_generator_is_in_sync():
    from kernels import generate_instantiations as gen
    for p in gen.generate(out_dir=Path("/tmp/flashgpt_gen_check")):
        committed = gen.OUT_DIR / p.name
        assert committed.read_text() == p.read_text(), f"regenerate: {p.name}"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk,h,hk", [(5, 7, 2, 2), (9, 3, 4, 2), (1, 1, 2, 1)])
def test_flash_backward_equations_match_autograd(causal, sq, sk, h, hk):
    """attention_grads_flash (the FlashAttention backward's equations, the NaN tests' second yardstick)
    gives autograd's gradients of attention_ref in fp64, also for rows that see no key and for GQA."""
    from kernels.reference import attention_grads_flash, attention_grads_flash_varlen
    torch.manual_seed(3)
    q = torch.randn(2, sq, h, 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, sk, hk, 16, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, sk, hk, 16, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(2, sq, h, 16, dtype=torch.float64)
    out, _ = attention_ref(q, k, v, causal, upcast=False)
    expected = torch.autograd.grad(out, (q, k, v), dout)
    for a, b in zip(attention_grads_flash(q, k, v, out.detach(), dout, causal), expected):
        torch.testing.assert_close(a, b)
    cu_q = torch.tensor([0, sq, 2 * sq], dtype=torch.int32)
    cu_k = torch.tensor([0, sk, 2 * sk], dtype=torch.int32)
    packed = attention_grads_flash_varlen(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), out.detach().flatten(0, 1),
                                          dout.flatten(0, 1), cu_q, cu_k, causal)
    for a, b in zip(packed, expected):
        torch.testing.assert_close(a, b.flatten(0, 1))
