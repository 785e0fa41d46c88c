"""The fused head + cross-entropy equals the plain one (values and gradients), on odd sizes."""
import pytest
import torch
import torch.nn.functional as F

from model.loss import fused_linear_cross_entropy


def plain(h, w, t):
    return F.cross_entropy((h @ w.t()).float().view(-1, w.shape[0]), t.view(-1))


@pytest.mark.parametrize("shape, vocab, chunk", [((3, 17, 24), 101, 7), ((1, 5, 8), 13, 64), ((2, 64, 16), 50, 32)])
def test_fused_matches_plain_fp32(shape, vocab, chunk):
    torch.manual_seed(0)
    h1 = torch.randn(*shape, requires_grad=True)
    w1 = torch.randn(vocab, shape[-1], requires_grad=True)
    t = torch.randint(0, vocab, shape[:-1])
    h2, w2 = h1.detach().clone().requires_grad_(), w1.detach().clone().requires_grad_()
    ref = plain(h1, w1, t)
    ref.backward()
    out = fused_linear_cross_entropy(h2, w2, t, chunk_rows=chunk)
    (out * 1.0).backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h2.grad, h1.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w2.grad, w1.grad, rtol=1e-4, atol=1e-6)


def test_fused_under_bf16_autocast_close_to_fp32():
    torch.manual_seed(1)
    h = torch.randn(2, 33, 32, requires_grad=True)
    w = torch.randn(77, 32, requires_grad=True)
    t = torch.randint(0, 77, (2, 33))
    ref = plain(h, w, t)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fused_linear_cross_entropy(h, w, t, chunk_rows=16)
    assert out.dtype == torch.float32
    assert abs(out.item() - ref.item()) / ref.item() < 2e-2


def test_no_grad_path_matches():
    torch.manual_seed(2)
    h, w, t = torch.randn(9, 8), torch.randn(11, 8), torch.randint(0, 11, (9,))
    with torch.no_grad():
        torch.testing.assert_close(fused_linear_cross_entropy(h, w, t, chunk_rows=4), plain(h, w, t))


@pytest.mark.parametrize("vocab, chunk", [(101, 7), (64, 64)])
def test_compiled_matches_plain(vocab, chunk):
    """Under torch.compile the gradient of the logits is one expression (a one-hot compare instead of
    the eager in-place scatter) so inductor can fuse it with the logsumexp: the same values."""
    torch.manual_seed(3)
    h1 = torch.randn(2, 37, 24, requires_grad=True)
    w1 = torch.randn(vocab, 24, requires_grad=True)
    t = torch.randint(0, vocab, (2, 37))
    h2, w2 = h1.detach().clone().requires_grad_(), w1.detach().clone().requires_grad_()
    ref = plain(h1, w1, t)
    ref.backward()
    out = torch.compile(fused_linear_cross_entropy, fullgraph=True)(h2, w2, t, chunk_rows=chunk)
    out.backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h2.grad, h1.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w2.grad, w1.grad, rtol=1e-4, atol=1e-6)
