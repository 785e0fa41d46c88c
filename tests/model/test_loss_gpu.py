"""The fused head + cross-entropy on CUDA under bf16 autocast, eager and compiled, against the plain
fp32 cross-entropy of the same bf16 logits, vocabularies and row counts filling no tile (compiled, the
logits' gradient is the one-expression form inductor fuses with the logsumexp). Skipped without CUDA."""
import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from model.loss import fused_linear_cross_entropy  # noqa: E402


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("vocab, rows, chunk", [(520, 301, 128), (517, 77, 32), (4096, 1000, 1000)])
def test_fused_loss_bf16_matches_fp32_reference(vocab, rows, chunk, compiled):
    torch.manual_seed(vocab + rows)
    d = 64
    h1 = torch.randn(rows, d, device="cuda", requires_grad=True)
    w1 = (0.2 * torch.randn(vocab, d, device="cuda")).requires_grad_()
    t = torch.randint(0, vocab, (rows,), device="cuda")
    h2, w2 = h1.detach().clone().requires_grad_(), w1.detach().clone().requires_grad_()
    # reference: the same bf16 operands, everything after them in fp32
    ref = F.cross_entropy(h1.bfloat16().float() @ w1.bfloat16().float().t(), t)
    ref.backward()
    fn = torch.compile(fused_linear_cross_entropy, fullgraph=True) if compiled else fused_linear_cross_entropy
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = fn(h2, w2, t, chunk_rows=chunk)
    (out * 0.5).backward()  # a grad_loss other than 1 reaches both gradients
    assert out.dtype == torch.float32
    assert abs(out.item() - ref.item()) < 1e-3 * ref.item()
    assert rel(h2.grad, 0.5 * h1.grad) < 1e-2
    assert rel(w2.grad, 0.5 * w1.grad) < 1e-2
