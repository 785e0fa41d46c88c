"""The GPU tests' tolerance (gpu_util.check_against_torch) on the CPU: it accepts an output that differs from
the fp32 reference by its rounding to bf16 even where PyTorch's own error is smaller, and rejects a wrong
element, a NaN and an error just past the bound."""
from __future__ import annotations

import pytest
import torch

from gpu_util import check_against_torch


def _case():
    torch.manual_seed(0)
    ref = torch.randn(256, 64) * 3
    # torch's result in fp32: its error only on the small elements (at most 2^-9), where ours rounds the
    # largest (near 10: half a ulp is 2^-5)
    pt = torch.where(ref.abs() < 1, ref.to(torch.bfloat16).float(), ref)
    return ref, pt


def test_accepts_the_reference_rounded_where_torch_rounded_less():
    ref, pt = _case()
    ours = (ref + 1e-3 * torch.randn_like(ref)).to(torch.bfloat16)
    check_against_torch("x", ours, ref, pt, 1e-3)


def test_rejects_a_wrong_element():
    ref, pt = _case()
    ours = ref.to(torch.bfloat16)
    ours[17, 5] += 0.25
    with pytest.raises(AssertionError, match="max err"):
        check_against_torch("x", ours, ref, pt, 1e-3)


def test_rejects_nan():
    ref, pt = _case()
    ours = ref.to(torch.bfloat16)
    ours[3, 3] = float("nan")
    with pytest.raises(AssertionError, match="NaN"):
        check_against_torch("x", ours, ref, pt, 1e-3)


def test_bound_is_tight():
    """An error just past 2 x torch's + eps + the rounding fails; just inside passes."""
    ref = torch.full((4, 4), 0.5)  # exact in bf16: no rounding term
    pt = ref.clone()
    pt[0, 0] = 0.5 + 2 ** -8  # torch's error 2^-8
    bound = 2 * 2 ** -8 + 1e-3
    ok = ref.clone()
    ok[1, 1] += bound * 0.99
    check_against_torch("x", ok, ref, pt, 1e-3)
    bad = ref.clone()
    bad[1, 1] += bound * 1.01
    with pytest.raises(AssertionError, match="max err"):
        check_against_torch("x", bad, ref, pt, 1e-3)
