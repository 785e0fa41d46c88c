"""The tied embedding / output-head weight's gradient into an fp32 buffer (model/tied_grad.py): the
embedding's rows and the head's gradient (times the loss's incoming gradient) add into main_grad,
the weight gets none from autograd, and the sum equals autograd's gradient of the tied weight, eager
and compiled, accumulated over calls; odd sizes, repeated token ids."""
import pytest
import torch
import torch.nn.functional as F

from model.config import GPTConfig
from model.gpt import GPT
from model.loss import fused_linear_cross_entropy
from model.tied_grad import embedding


def test_embedding_rows_add_into_main_grad():
    torch.manual_seed(0)
    w = torch.randn(13, 6, requires_grad=True)
    idx = torch.tensor([[3, 3, 0, 12], [5, 3, 12, 1]])  # repeated ids add up
    up = torch.randn(2, 4, 6)
    (F.embedding(idx, w) * up).sum().backward()
    main = torch.randn(13, 6)
    before = main.clone()
    w2 = w.detach().clone().requires_grad_()
    out = embedding(idx, w2, main)
    torch.testing.assert_close(out, F.embedding(idx, w))
    (out * up).sum().backward()
    assert w2.grad is None
    torch.testing.assert_close(main - before, w.grad)


@pytest.mark.parametrize("compiled", [False, True])
def test_tied_gradient_equals_autograd(compiled):
    """A GPT with main_grad set on both tied modules (as the weight cache sets them): after two
    micro-batches (loss scaled by 0.5 each) the buffer holds autograd's tied-weight gradient."""
    cfg = GPTConfig(n_layer=1, d_model=24, n_head=2, vocab_size=37, seq_len=19, init_std=0.2)
    torch.manual_seed(1)
    ref, ours = GPT(cfg), GPT(cfg)
    ours.load_state_dict(ref.state_dict())
    batches = [torch.randint(0, 37, (2, 20)) for _ in range(2)]
    for b in batches:
        (0.5 * ref(b[:, :-1], b[:, 1:])).backward()
    main = torch.zeros_like(ours.wte.weight)
    buffers = {"wte.main_grad": main, "lm_head.main_grad": main}

    def loss(x, y):
        return torch.func.functional_call(ours, buffers, (x, y))

    fn = torch.compile(loss, fullgraph=True) if compiled else loss
    for b in batches:
        (0.5 * fn(b[:, :-1], b[:, 1:])).backward()
    assert ours.wte.weight.grad is None  # everything went into the buffer
    torch.testing.assert_close(main, ref.wte.weight.grad, rtol=1e-4, atol=1e-6)
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        if name != "wte.weight":
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_head_uses_the_low_precision_copy():
    """weight_lp (the weight cache's copy) is what the head multiplies by: the same loss as casting the
    weight under autocast when it holds the cast, a different one when it holds other values."""
    torch.manual_seed(2)
    h, w, t = torch.randn(2, 9, 16), torch.randn(29, 16), torch.randint(0, 29, (2, 9))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = fused_linear_cross_entropy(h, w, t, chunk_rows=5)
        copy = fused_linear_cross_entropy(h, w, t, chunk_rows=5, weight_lp=w.bfloat16())
        other = fused_linear_cross_entropy(h, w, t, chunk_rows=5, weight_lp=(2 * w).bfloat16())
    assert torch.equal(copy, cast) and not torch.equal(other, cast)
