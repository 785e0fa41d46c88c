"""CPU checks of local (sliding-window) attention: the window_size argument's validation in every public
function, the ops' schemas and fake kernels, and the reference's window mask and attention."""
from __future__ import annotations

import itertools

import pytest
import torch

from kernels import flash_attn_func, flash_attn_qkvpacked_func, flash_attn_varlen_func
from kernels.reference import attention_ref, attention_varlen_ref, window_mask


def _naive_mask(sq, sk, causal, window):
    """The interface's definition, element by element."""
    left, right = window
    off = sk - sq
    m = torch.zeros(sq, sk, dtype=torch.bool)
    for i, j in itertools.product(range(sq), range(sk)):
        m[i, j] = ((left == -1 or j >= i + off - left) and (right == -1 or j <= i + off + right)
                   and (not causal or j <= i + off))
    return m


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(-1, -1), (0, 0), (1, 0), (3, 2), (-1, 2), (4, -1), (0, -1)])
@pytest.mark.parametrize("sq,sk", [(7, 7), (5, 9), (9, 5)])
def test_window_mask_matches_the_definition(sq, sk, causal, window):
    assert torch.equal(window_mask(sq, sk, causal, window), _naive_mask(sq, sk, causal, window))


def test_causal_with_unbounded_right_is_right_zero():
    assert torch.equal(window_mask(9, 12, True, (3, -1)), window_mask(9, 12, True, (3, 0)))
    assert torch.equal(window_mask(9, 12, True, (3, -1)), window_mask(9, 12, False, (3, 0)))


def _softmax_attention(q, k, v, mask):
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.nan_to_num(torch.softmax(s, -1), nan=0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(0, 0), (2, 1), (-1, 1), (3, -1)])
def test_reference_attention_with_a_window(window, causal):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 11, 2, 8), torch.randn(2, 6, 2, 8), torch.randn(2, 6, 2, 8)
    out, lse = attention_ref(q, k, v, causal, window_size=window)
    out_n, lse_n = _softmax_attention(q, k, v, _naive_mask(11, 6, causal, window))
    torch.testing.assert_close(out, out_n)
    torch.testing.assert_close(lse, lse_n)
    if causal or window[1] >= 0:  # offset -5: the first rows' bands end before key 0
        assert torch.isneginf(lse).any()
    assert (out.transpose(1, 2)[torch.isneginf(lse)] == 0).all()


def test_varlen_reference_windows_each_sequence():
    torch.manual_seed(1)
    lens = [3, 8, 5]
    cu = torch.tensor([0, 3, 11, 16], dtype=torch.int32)
    q, k, v = (torch.randn(16, 2, 8) for _ in range(3))
    out, lse = attention_varlen_ref(q, k, v, cu, cu, True, window_size=(2, 0))
    for i, n in enumerate(lens):
        s = slice(int(cu[i]), int(cu[i + 1]))
        o, l_ = attention_ref(q[s][None], k[s][None], v[s][None], True, window_size=(2, 0))
        torch.testing.assert_close(out[s], o[0])
        torch.testing.assert_close(lse[:, s], l_[0])


BAD_WINDOWS = [(-2, 0), (0, -5), (1,), (1, 2, 3), (1.5, 0), ("1", 0), 5, None, (True, 0)]


@pytest.mark.parametrize("window", BAD_WINDOWS, ids=repr)
def test_bad_window_is_one_clear_value_error(window):
    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    calls = [lambda: flash_attn_func(q, q, q, window_size=window),
             lambda: flash_attn_qkvpacked_func(torch.cat([q, q, q], 2), window_size=window),
             lambda: flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 8, 8, window_size=window)]
    for call in calls:
        with pytest.raises(ValueError, match=r"window_size must be two ints >= -1 .*Fix"):
            call()


def test_ops_take_the_window_with_unwindowed_defaults():
    fwd = torch.ops.flashgpt.fwd.default._schema
    bwd = torch.ops.flashgpt.bwd.default._schema
    for schema in (fwd, bwd, torch.ops.flashgpt.fwd_qkvpacked.default._schema,
                   torch.ops.flashgpt.bwd_qkvpacked.default._schema):
        args = {a.name: a for a in schema.arguments}
        assert args["window_left"].default_value == -1 and args["window_right"].default_value == -1, schema


def test_fake_kernels_accept_the_window():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 100, 4, 64, dtype=torch.bfloat16, device="cuda")
        out, lse = torch.ops.flashgpt.fwd(q, q, q, None, None, 100, 100, 0.125, True, False, 31, 0)
        assert out.shape == q.shape and lse.shape == (2, 4, 100)
        dq, dk, dv = torch.ops.flashgpt.bwd(q, q, q, q, out, lse, None, None, 100, 100, 0.125, True, False, 31, 0)
        assert dq.shape == q.shape
