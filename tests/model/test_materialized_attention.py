"""model.attention=math (model/materialized_attention.py): the scores-materialising attention against the fp32
reference, forward and gradients (under torch.compile: tests/model/test_attention_compile.py)."""
import pytest
import torch

from kernels.reference import attention_ref
from model.attention import CausalSelfAttention, doc_mask
from model.config import GPTConfig
from model.materialized_attention import materialized_attention

EPS = 1e-4  # absolute slack beside 2x PyTorch's own error, as tests/kernels do


def _err(a, ref):
    return (a.float() - ref.float()).abs().max().item()


def _to_bhtd(t):
    return t.transpose(1, 2)  # (B, T, H, D) <-> (B, H, T, D)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,h,t,d", [(2, 3, 17, 16), (1, 2, 33, 32), (2, 4, 64, 64), (1, 1, 1, 8)])
def test_forward_and_gradients_match_the_fp32_reference(dtype, b, h, t, d):
    torch.manual_seed(t * 31 + d)
    q, k, v = (torch.randn(b, t, h, d, dtype=dtype, requires_grad=True) for _ in range(3))  # (B, T, H, D)
    dout = torch.randn(b, t, h, d, dtype=dtype)
    out = _to_bhtd(materialized_attention(_to_bhtd(q), _to_bhtd(k), _to_bhtd(v)))
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)

    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref, _ = attention_ref(qf, kf, vf, causal=True)
    ref_grads = torch.autograd.grad(ref, (qf, kf, vf), dout.float())
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)
        return
    # bf16: within 2x PyTorch's own error (its attention computed in bf16) from the fp32 reference
    pt, _ = attention_ref(q, k, v, causal=True, upcast=False)
    pt_grads = torch.autograd.grad(pt, (q, k, v), dout)
    for name, ours, r, p in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads), (pt, *pt_grads)):
        e, e_pt = _err(ours, r), _err(p, r)
        assert e <= 2 * e_pt + EPS, f"{name}: max err {e:.3e} > 2 x torch's {e_pt:.3e}"


def test_a_document_mask_keeps_documents_apart():
    """With a boolean mask (model: data.doc_boundaries) the op agrees with the reference under the same mask."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 2, 11, 8, requires_grad=True) for _ in range(3))  # (B, H, T, D)
    mask = doc_mask(torch.tensor([0, 4, 11, 15, 22], dtype=torch.int32), 2, 11)  # (B, 1, T, T)
    out = materialized_attention(q, k, v, mask)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    qf, kf, vf = (x.detach().double().requires_grad_() for x in (q, k, v))
    scores = (qf @ kf.transpose(-2, -1) / 8 ** 0.5).masked_fill(~mask, float("-inf"))
    ref = scores.softmax(-1) @ vf
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, torch.autograd.grad(ref.sum(), (qf, kf, vf))):
        torch.testing.assert_close(g.double(), r, rtol=1e-4, atol=1e-5)


def test_opcheck():
    """torch.library's own checks: the fake kernels' shapes/strides, the autograd registration, schema."""
    torch.manual_seed(2)
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(2, 3, 9, 8, dtype=dtype, requires_grad=True) for _ in range(3))
        torch.library.opcheck(torch.ops.flashgpt.math_attn_fwd.default, (q, k, v, None, 0.3, True))
        qt = torch.randn(2, 9, 3, 8, dtype=dtype, requires_grad=True).transpose(1, 2)  # strided, as the model's
        torch.library.opcheck(torch.ops.flashgpt.math_attn_fwd.default, (qt, k, v, None, 0.3, True))


@pytest.mark.parametrize("n_kv_head", [4, 2, 1])
def test_module_with_grouped_query_heads_matches_reference_backend(n_kv_head):
    """The attention module with backend math against the same weights on the fp32 reference backend,
    grouped-query heads included (K/V heads repeated for the group, as for SDPA)."""
    cfg = GPTConfig(d_model=64, n_head=4, n_kv_head=n_kv_head, seq_len=32)
    torch.manual_seed(3)
    ours, ref = CausalSelfAttention(cfg, "math"), CausalSelfAttention(cfg, "reference")
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(2, 23, 64)
    y, y_ref = ours(x), ref(x)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    g = torch.autograd.grad(y.square().sum(), list(ours.parameters()))
    g_ref = torch.autograd.grad(y_ref.square().sum(), list(ref.parameters()))
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
