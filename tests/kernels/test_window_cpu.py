"""CPU checks of local (sliding-window) attention in our kernels' Python layer: the window_size argument's
validation in every public function, the ops' schemas and fake kernels. (The reference's window:
test_window_reference_cpu.py.)"""
from __future__ import annotations

import pytest
import torch

from kernels import flash_attn_func, flash_attn_qkvpacked_func, flash_attn_varlen_func


BAD_WINDOWS = [(-2, 0), (0, -5), (1,), (1, 2, 3), (1.5, 0), ("1", 0), 5, None, (True, 0)]


@pytest.mark.parametrize("window", BAD_WINDOWS, ids=repr)
def test_bad_window_is_one_clear_value_error(window):
    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    calls = [lambda: flash_attn_func(q, q, q, window_size=window),
             lambda: flash_attn_qkvpacked_func(torch.cat([q, q, q], 2), window_size=window),
             lambda: flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 8, 8, window_size=window)]
    for call in calls:
        with pytest.raises(ValueError, match=r"^flash_attn_\w+: window_size=.* is not two ints >= -1; give"):
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
