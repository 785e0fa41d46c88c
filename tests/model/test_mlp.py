"""The MLP's implementation choice on a CPU machine (the fused GELU-epilogue MLP is CUDA-only; its
GPU checks are tests/kernels/test_gelu_mlp_gpu.py)."""
import pytest
import torch

from kernels.gelu_mlp import gelu_mlp, gelu_mlp_supported, reference_mlp
from model.config import GPTConfig
from model.gpt import GPT
from model.mlp import resolve_mlp


def test_auto_is_torch_off_cuda_and_fused_is_refused():
    impl, why = resolve_mlp("auto", torch.device("cpu"))
    assert impl == "torch" and "CUDA" in why
    assert resolve_mlp("torch", torch.device("cpu"))[0] == "torch"
    with pytest.raises(RuntimeError, match="model.mlp=fused"):
        resolve_mlp("fused", torch.device("cpu"))
    assert resolve_mlp("auto", torch.device("cuda"), torch.float32)[0] == "torch"  # fp32: no epilogue GEMM
    assert resolve_mlp("auto", torch.device("cuda"), torch.bfloat16, 100, 400)[0] == "torch"  # 100 % 8


def test_gelu_mlp_off_cuda_is_the_plain_mlp():
    torch.manual_seed(3)
    x, w1, b1 = torch.randn(2, 5, 16), torch.randn(64, 16), torch.randn(64)
    w2, b2 = torch.randn(16, 64), torch.randn(16)
    assert "CUDA" in gelu_mlp_supported(x, w1, b1, w2, b2)
    assert torch.equal(gelu_mlp(x, w1, b1, w2, b2), reference_mlp(x, w1, b1, w2, b2))
    assert torch.equal(gelu_mlp(x, w1, None, w2, None), reference_mlp(x, w1, None, w2, None))


def test_gelu_mlp_off_cuda_puts_weight_gradients_into_main_grads():
    """The fallback with fp32 gradient buffers: the same output and dx / db as the plain MLP, and each
    weight's gradient added into its buffer (odd row count; buffers start non-zero)."""
    torch.manual_seed(4)
    x, w1, b1 = torch.randn(3, 7, 16), torch.randn(64, 16) / 4, torch.randn(64)
    w2, b2, dy = torch.randn(16, 64) / 8, torch.randn(16), torch.randn(3, 7, 16)
    plain = [t.clone().requires_grad_() for t in (x, w1, b1, w2, b2)]
    reference_mlp(*plain).backward(dy)
    mains = [torch.randn(64, 16), torch.randn(16, 64)]
    starts = [m.clone() for m in mains]
    ours = [t.clone().requires_grad_() for t in (x, w1, b1, w2, b2)]
    y = gelu_mlp(*ours, *mains)
    torch.testing.assert_close(y, reference_mlp(x, w1, b1, w2, b2))
    y.backward(dy)
    assert ours[1].grad is None and ours[3].grad is None
    for i in (0, 2, 4):
        torch.testing.assert_close(ours[i].grad, plain[i].grad)
    for main, start, i in zip(mains, starts, (1, 3)):
        torch.testing.assert_close(main - start, plain[i].grad, rtol=1e-5, atol=1e-5)


def test_model_logs_and_keeps_the_same_parameters():
    cfg = GPTConfig(n_layer=1, d_model=32, n_head=2, vocab_size=64, seq_len=16)
    model = GPT(cfg)
    assert model.mlp_impl == "torch"
    plain = GPT(GPTConfig(**{**cfg.__dict__, "mlp": "torch"}))
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
