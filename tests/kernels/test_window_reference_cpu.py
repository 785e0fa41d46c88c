"""kernels/reference.py's local (sliding-window) attention against a brute-force definition on CPU.

The definition (docs/kernels.md, FlashAttention's convention), written out per (query, key) pair here,
independently of window_mask's vectorised code: with offset = sk - sq, query i sees key j iff
(left == -1 or j >= i + offset - left) and (right == -1 or j <= i + offset + right) and, if causal,
j <= i + offset. A row that sees no key gives output 0 and lse -inf. Odd shapes with sq != sk both ways,
windows of -1, 0, 1, 5 and more than sk on each side, fp32 and bf16, packed sequences, bad windows.
"""
import math

import pytest
import torch

from kernels.reference import (attention_grads_flash, attention_ref, attention_varlen_ref, check_window,
                               window_mask)

SIDES = [-1, 0, 1, 5, 80]  # 80 > every sk below: the same as unbounded


def _sees(i: int, j: int, sq: int, sk: int, causal: bool, left: int, right: int) -> bool:
    off = sk - sq
    return ((left == -1 or j >= i + off - left) and (right == -1 or j <= i + off + right)
            and (not causal or j <= i + off))


def _naive(q, k, v, causal, window, scale):
    """Loop-per-row attention in float64: (out (b, sq, h, d), lse (b, h, sq))."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    out = torch.zeros(b, sq, h, d, dtype=torch.float64)
    lse = torch.full((b, h, sq), -math.inf, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            kh = hi // (h // hk)
            for i in range(sq):
                js = [j for j in range(sk) if _sees(i, j, sq, sk, causal, *window)]
                if not js:
                    continue
                s = torch.stack([(q[bi, i, hi].double() @ k[bi, j, kh].double()) * scale for j in js])
                lse[bi, hi, i] = torch.logsumexp(s, 0)
                p = torch.softmax(s, 0)
                out[bi, i, hi] = (p[:, None] * v[bi, js, kh].double()).sum(0)
    return out, lse


@pytest.mark.parametrize("sq,sk", [(37, 53), (53, 37), (19, 19)])
@pytest.mark.parametrize("causal", [False, True])
def test_window_mask_matches_definition(sq, sk, causal):
    for left in SIDES:
        for right in SIDES:
            got = window_mask(sq, sk, causal, (left, right))
            want = torch.tensor([[_sees(i, j, sq, sk, causal, left, right) for j in range(sk)]
                                 for i in range(sq)])
            assert got.dtype == torch.bool and got.shape == (sq, sk)
            assert torch.equal(got, want), (sq, sk, causal, left, right)


def test_window_mask_unbounded_is_dense_and_causal_right_is_zero():
    assert window_mask(7, 11, False, (-1, -1)).all()
    causal = torch.ones(7, 11, dtype=torch.bool).tril(11 - 7)
    assert torch.equal(window_mask(7, 11, True, (-1, -1)), causal)
    # causal=True with (left, -1) is (left, 0); a window wider than sk is no window
    assert torch.equal(window_mask(7, 11, True, (3, -1)), window_mask(7, 11, True, (3, 0)))
    assert torch.equal(window_mask(7, 11, True, (3, -1)), window_mask(7, 11, False, (3, 0)))
    assert torch.equal(window_mask(7, 11, True, (40, 40)), causal)


@pytest.mark.parametrize("sq,sk", [(37, 53), (53, 37)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(-1, -1), (0, 0), (1, -1), (5, 0), (-1, 1), (5, 5), (0, 80), (80, 1)])
def test_attention_ref_window_matches_naive(sq, sk, causal, window):
    g = torch.Generator().manual_seed(sq + 3 * sk + 7 * causal + 11 * window[0] + 13 * window[1])
    q = torch.randn(1, sq, 4, 8, generator=g)
    k, v = (torch.randn(1, sk, 2, 8, generator=g) for _ in range(2))  # grouped-query: 2 kv heads
    out, lse = attention_ref(q, k, v, causal=causal, softmax_scale=0.4, window_size=window)
    want, want_lse = _naive(q, k, v, causal, window, 0.4)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)


def test_row_without_keys_gives_zero_and_minus_inf():
    # sq = 53 > sk = 37: offset -16, so with the window (0, 0) rows 0..15 have no key on their diagonal
    torch.manual_seed(0)
    q = torch.randn(2, 53, 2, 8)
    k, v = torch.randn(2, 37, 2, 8), torch.randn(2, 37, 2, 8)
    for causal in (False, True):
        for dtype, upcast in ((torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)):
            out, lse = attention_ref(q.to(dtype), k.to(dtype), v.to(dtype), causal=causal, upcast=upcast,
                                     window_size=(0, 0))
            assert torch.all(out[:, :16] == 0) and torch.isfinite(out).all()
            assert torch.all(lse[:, :, :16] == -math.inf) and torch.isfinite(lse[:, :, 16:]).all()
    # (0, 0) without causal: each later row sees exactly the key on its diagonal, so out = v there
    out, _ = attention_ref(q, k, v, window_size=(0, 0))
    torch.testing.assert_close(out[:, 16:], v)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_ref_window_bf16(causal):
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 37, 2, 16, generator=g).bfloat16()
    k, v = (torch.randn(2, 53, 2, 16, generator=g).bfloat16() for _ in range(2))
    want, want_lse = _naive(q, k, v, causal, (5, 1), 0.25)
    out, lse = attention_ref(q, k, v, causal=causal, softmax_scale=0.25, window_size=(5, 1))
    assert out.dtype == torch.float32  # upcast: computed and returned in fp32 from the bf16 values
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)
    out, lse = attention_ref(q, k, v, causal=causal, softmax_scale=0.25, upcast=False, window_size=(5, 1))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), want, atol=3e-2, rtol=3e-2)  # bf16 rounding of P and O


def test_varlen_window_is_per_sequence():
    # sequences of 9, 1 and 14 tokens (queries) against 12, 4 and 14 keys: each aligned bottom-right alone
    cu_q = torch.tensor([0, 9, 10, 24], dtype=torch.int32)
    cu_k = torch.tensor([0, 12, 16, 30], dtype=torch.int32)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(24, 2, 8, generator=g)
    k, v = (torch.randn(30, 2, 8, generator=g) for _ in range(2))
    for causal in (False, True):
        out, lse = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=causal, window_size=(2, 0))
        for a, b, c, d in ((0, 9, 0, 12), (9, 10, 12, 16), (10, 24, 16, 30)):
            want, want_lse = _naive(q[None, a:b], k[None, c:d], v[None, c:d], causal, (2, 0), 8 ** -0.5)
            torch.testing.assert_close(out[a:b].double(), want[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lse[:, a:b].double(), want_lse[0], atol=1e-5, rtol=1e-5)


def test_grads_flash_window_match_autograd():
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 37, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 53, 1, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    dout = torch.randn(1, 37, 2, 8, generator=g, dtype=torch.float64)
    out, _ = attention_ref(q, k, v, causal=True, upcast=False, window_size=(5, 0))
    out.backward(dout)
    dq, dk, dv = attention_grads_flash(q.detach(), k.detach(), v.detach(), out.detach(), dout, causal=True,
                                       window_size=(5, 0))
    for got, want in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("bad", [(-2, 0), (0, -5), (1,), (1, 2, 3), 5, (1.0, 0), (True, 0), "(1, 0)", None])
def test_bad_window_is_one_line_value_error(bad):
    q = torch.randn(1, 4, 1, 8)
    for call in (lambda: check_window(bad), lambda: window_mask(4, 4, True, bad),
                 lambda: attention_ref(q, q, q, causal=True, window_size=bad),
                 lambda: attention_varlen_ref(q[0], q[0], q[0], torch.tensor([0, 4], dtype=torch.int32),
                                              torch.tensor([0, 4], dtype=torch.int32), window_size=bad)):
        with pytest.raises(ValueError, match="window_size=") as e:
            call()
        assert "\n" not in str(e.value)
