"""model.attention's SDPA-held-to-one-backend choices (sdpa_flash, sdpa_cudnn) and model.recompute_attention,
on the CPU: what this device refuses and why, agreement with the fp32 reference, the same loss and gradients
with the attention recomputed in the backward (under torch.compile: tests/model/test_attention_compile.py)."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from model.attention import AttentionUnavailable, CausalSelfAttention, resolve_backend
from model.config import GPTConfig
from model.gpt import GPT
from training.config import ConfigError, load_config
from training.trainer import check_compatible


def small(**kw):
    base = dict(n_layer=2, d_model=64, n_head=4, vocab_size=128, seq_len=32, fused_loss=False)
    base.update(kw)
    return GPTConfig(**base)


def _torch_runs_flash_on_cpu(dtype) -> bool:
    try:
        q = torch.ones(1, 1, 4, 16, dtype=dtype, requires_grad=True)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
        return True
    except RuntimeError:
        return False


def test_sdpa_cudnn_on_a_cpu_is_refused_with_what_to_use():
    with pytest.raises(AttentionUnavailable, match=r"model.attention=sdpa_cudnn needs a CUDA GPU.*use "
                                                   r"model.attention=sdpa_flash, sdpa or math"):
        resolve_backend("sdpa_cudnn", torch.device("cpu"), 16, torch.float32)


def test_sdpa_held_to_one_backend_on_cuda_without_a_gpu_is_refused():
    if torch.cuda.is_available():
        pytest.skip("needs a machine without a GPU")
    for name in ("sdpa_flash", "sdpa_cudnn"):
        with pytest.raises(AttentionUnavailable, match=f"model.attention={name} cannot run on cuda.*no CUDA GPU"):
            resolve_backend(name, torch.device("cuda"), 64, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_flash_on_a_cpu_runs_or_is_refused_as_torch_decides(dtype):
    """This torch's CPU build has a FlashAttention kernel of its own or not: sdpa_flash then runs (and agrees
    with the fp32 reference backend), or is refused at build time with the line naming the alternatives."""
    cfg = small()
    if not _torch_runs_flash_on_cpu(dtype):
        with pytest.raises(AttentionUnavailable, match="model.attention=sdpa_flash cannot run on cpu.*use "
                                                       "model.attention=sdpa"):
            GPT(small(attention="sdpa_flash"), torch.device("cpu"), dtype)
        return
    assert resolve_backend("sdpa_flash", torch.device("cpu"), cfg.head_dim, dtype)[0] == "sdpa_flash"
    torch.manual_seed(0)
    ours, ref = CausalSelfAttention(cfg, "sdpa_flash").to(dtype), CausalSelfAttention(cfg, "reference").to(dtype)
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(2, 21, 64, dtype=dtype)
    y, y_ref = ours(x), ref(x)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y, y_ref, **tol)
    g = torch.autograd.grad(y.float().square().sum(), list(ours.parameters()))
    g_ref = torch.autograd.grad(y_ref.float().square().sum(), list(ref.parameters()))
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol["rtol"] * 5, atol=tol["atol"] * 5)


def test_the_resolved_backends_and_their_reasons():
    assert resolve_backend("math", torch.device("cpu"))[0] == "math"
    assert resolve_backend("math", torch.device("cuda"))[0] == "math"  # no GPU needed to decide
    with pytest.raises(RuntimeError, match="model.attention=flash needs a CUDA device"):
        resolve_backend("flash", torch.device("cpu"))


def test_the_resolving_probe_leaves_the_weights_alone():
    """sdpa_flash's probe uses fixed values: the model built with it starts from the same weights as sdpa's."""
    if not _torch_runs_flash_on_cpu(torch.float32):
        pytest.skip("this torch has no FlashAttention on the CPU")
    torch.manual_seed(0)
    a = GPT(small(attention="sdpa"))
    torch.manual_seed(0)
    b = GPT(small(attention="sdpa_flash"))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_config_choices_and_document_boundaries():
    for name in ("math", "sdpa_flash", "sdpa_cudnn"):
        assert load_config("tiny_cpu.yaml", [f"model.attention={name}"]).model.attention == name
    assert load_config("tiny_cpu.yaml", ["model.attention=math", "data.doc_boundaries=true"]).model.attention
    for name in ("sdpa_flash", "sdpa_cudnn"):
        with pytest.raises(ConfigError, match=f"model.attention={name} does not take data.doc_boundaries"):
            load_config("tiny_cpu.yaml", [f"model.attention={name}", "data.doc_boundaries=true"])
    with pytest.raises(ConfigError, match="model.attention"):
        load_config("tiny_cpu.yaml", ["model.attention=unfused"])


def test_a_run_may_resume_with_the_attention_recomputed(tmp_path):
    cfg = load_config("tiny_cpu.yaml")
    saved = {"model": {k: v for k, v in vars(cfg.model).items() if k != "recompute_attention"}}
    check_compatible(saved, load_config("tiny_cpu.yaml", ["model.recompute_attention=true",
                                                          "model.attention=math"]), tmp_path)


def test_sdpa_flash_refuses_document_boundaries_in_the_model():
    if not _torch_runs_flash_on_cpu(torch.float32):
        pytest.skip("this torch has no FlashAttention on the CPU")
    model = GPT(small(attention="sdpa_flash"))
    with pytest.raises(ValueError, match="sdpa_flash does not take document boundaries"):
        model(torch.randint(0, 128, (1, 16)), cu_seqlens=torch.tensor([0, 7, 16], dtype=torch.int32), max_seqlen=9)


def _loss_and_grads(model, idx):
    model.zero_grad()
    loss = model(idx, idx.roll(-1, 1))
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("backend", ["math", "sdpa", "reference"])
def test_recomputed_attention_gives_the_same_loss_and_gradients(backend):
    torch.manual_seed(1)
    plain = GPT(small(attention=backend, n_kv_head=2))
    again = GPT(small(attention=backend, n_kv_head=2, recompute_attention=True))
    again.load_state_dict(plain.state_dict())
    idx = torch.randint(0, 128, (2, 27))
    loss, grads = _loss_and_grads(plain, idx)
    loss_r, grads_r = _loss_and_grads(again, idx)
    assert torch.equal(loss, loss_r)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_r))


def _saved_square_tensors(model, idx, t):
    """Shapes of the (.., t, t) tensors autograd keeps for the backward of one forward."""
    shapes = []

    def pack(x):
        if x.dim() >= 2 and x.shape[-2:] == (t, t) and x.dtype.is_floating_point:
            shapes.append(tuple(x.shape))
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        model(idx, idx)
    return shapes


def test_recompute_keeps_no_score_matrix_for_the_backward():
    """math keeps its (B, H, T, T) probabilities per layer; recomputed, it keeps none (the point of it)."""
    torch.manual_seed(2)
    idx = torch.randint(0, 128, (2, 19))
    assert len(_saved_square_tensors(GPT(small(attention="math")), idx, 19)) == 2  # one per layer
    assert _saved_square_tensors(GPT(small(attention="math", recompute_attention=True)), idx, 19) == []
