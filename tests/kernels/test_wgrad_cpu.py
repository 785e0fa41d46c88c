"""kernels/wgrad.py on the CPU (torch's fp32 addmm path): a Linear whose weight gradient is added into
an fp32 buffer must give F.linear's output and input / bias gradients, and put the weight gradient
-- accumulated over calls -- into the buffer instead of w.grad. Eager and torch.compile; odd sizes."""
import pytest
import torch
import torch.nn.functional as F

from kernels.wgrad import accumulate, linear, reference_accumulate


def make(lead, k, n, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    dy = torch.randn(*lead, n, generator=g).to(dtype)
    return x, w, b, dy


def plain(x, w, b, dy):
    """F.linear's output and gradients of (x, w, b), in fp64."""
    leaves = [t.detach().double().requires_grad_() for t in (x, w, b)]
    y = F.linear(*leaves)
    y.backward(dy.double())
    return y.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("lead,k,n", [((1,), 8, 8), ((37,), 24, 40), ((3, 29), 13, 21), ((2, 5, 7), 64, 33)])
@pytest.mark.parametrize("compiled", [False, True])
def test_linear_puts_the_weight_gradient_into_main_grad(lead, k, n, compiled):
    fn = torch.compile(linear, fullgraph=True) if compiled else linear
    main = torch.randn(n, k, generator=torch.Generator().manual_seed(9))  # not zero: it must add
    start = main.clone()
    expected_w = torch.zeros(n, k, dtype=torch.float64)
    for seed in (1, 2):  # two micro-batches accumulate
        x, w, b, dy = make(lead, k, n, seed=seed)
        xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
        y = fn(xs, ws, bs, main)
        y.backward(dy)
        y_ref, (dx_ref, dw_ref, db_ref) = plain(x, w, b, dy)
        torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(xs.grad.double(), dx_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(bs.grad.double(), db_ref, rtol=1e-5, atol=1e-5)
        assert ws.grad is None  # the weight's gradient went into main instead
        expected_w += dw_ref
    torch.testing.assert_close(main.double() - start.double(), expected_w, rtol=1e-5, atol=1e-4)


def test_bf16_autocast_computes_in_bf16_and_accumulates_in_fp32():
    x, w, b, dy = make((4, 19), 32, 48, seed=3)
    main = torch.zeros(48, 32)
    wc, bc = w.bfloat16().requires_grad_(), b.bfloat16().requires_grad_()  # the weight cache's copies
    xs = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = linear(xs, wc, bc, main)
        y_ref = F.linear(x, wc.detach(), bc.detach())
    assert y.dtype == torch.bfloat16 and torch.equal(y, y_ref)
    y.backward(dy.bfloat16())
    assert xs.grad.dtype == torch.float32 and bc.grad.dtype == torch.bfloat16 and wc.grad is None
    # the product of the bf16 operands, summed in fp32 and never rounded to bf16
    ref = dy.bfloat16().reshape(-1, 48).double().t() @ x.bfloat16().reshape(-1, 32).double()
    torch.testing.assert_close(main.double(), ref, rtol=1e-5, atol=1e-5)


def test_accumulate_is_the_reference_on_cpu_and_checks_its_buffer():
    x, _, _, dy = make((30,), 16, 24, seed=4)
    a, r = torch.ones(24, 16), torch.ones(24, 16)
    accumulate(dy, x, a)
    reference_accumulate(dy, x, r)
    assert torch.equal(a, r) and not torch.equal(a, torch.ones(24, 16))
    with pytest.raises(ValueError, match="main_grad must be float32"):
        accumulate(dy, x, torch.zeros(24, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="shape"):
        accumulate(dy, x, torch.zeros(16, 24))
