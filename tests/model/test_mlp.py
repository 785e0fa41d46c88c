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


def test_model_logs_and_keeps_the_same_parameters():
    cfg = GPTConfig(n_layer=1, d_model=32, n_head=2, vocab_size=64, seq_len=16)
    model = GPT(cfg)
    assert model.mlp_impl == "torch"
    plain = GPT(GPTConfig(**{**cfg.__dict__, "mlp": "torch"}))
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
