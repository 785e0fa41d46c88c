"""The GPT on CUDA with our kernel (model.attention=flash) against SDPA: same weights, same loss and
gradients within bf16 rounding; document boundaries through the varlen kernel; torch.compile with
fullgraph=True traces the model with our op; the fused GELU MLP against the torch one. Skipped without
CUDA."""
import copy

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from model.attention import resolve_backend  # noqa: E402
from model.config import GPTConfig  # noqa: E402
from model.gpt import GPT  # noqa: E402


def pair(**kw):
    cfg = GPTConfig(n_layer=2, d_model=256, n_head=2, vocab_size=512, seq_len=384, **kw)  # head dim 128
    torch.manual_seed(0)
    ref = GPT(GPTConfig(**{**cfg.__dict__, "attention": "sdpa"}), device=torch.device("cuda")).cuda()
    ours = GPT(GPTConfig(**{**cfg.__dict__, "attention": "flash"}), device=torch.device("cuda")).cuda()
    ours.load_state_dict(ref.state_dict())
    assert ours.attention_backend == "flash" and ref.attention_backend == "sdpa"
    return ref, ours


def test_auto_attention_is_our_kernel_on_cuda():
    backend, why = resolve_backend("auto", torch.device("cuda"))
    assert backend == "flash", why


def loss_and_grads(model, idx, tgt, **kw):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(idx, tgt, **kw)
    loss.backward()
    return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def assert_same_loss_and_grads(ref, ours, idx, tgt, **kw):
    l_ref, g_ref = loss_and_grads(ref, idx, tgt, **kw)
    l_ours, g_ours = loss_and_grads(ours, idx, tgt, **kw)
    assert abs(l_ref.item() - l_ours.item()) < 1e-2
    for name, g in g_ref.items():
        assert rel(g_ours[name], g) < 3e-2, name


@pytest.mark.parametrize("kw", [{}, {"n_kv_head": 1}, {"pos_emb": "rope"}])
def test_flash_model_matches_sdpa(kw):
    ref, ours = pair(**kw)
    idx = torch.randint(0, 512, (2, 301), device="cuda")  # odd length, not a tile multiple
    tgt = torch.randint(0, 512, (2, 301), device="cuda")
    assert_same_loss_and_grads(ref, ours, idx, tgt)


def test_flash_model_document_boundaries_match_sdpa_mask():
    ref, ours = pair()
    idx = torch.randint(0, 512, (2, 384), device="cuda")
    tgt = torch.randint(0, 512, (2, 384), device="cuda")
    cu = torch.tensor([0, 100, 384, 500, 768], dtype=torch.int32, device="cuda")
    assert_same_loss_and_grads(ref, ours, idx, tgt, cu_seqlens=cu, max_seqlen=284)


def test_compile_fullgraph_with_our_op():
    _, ours = pair()
    eager = copy.deepcopy(ours)
    compiled = torch.compile(ours, fullgraph=True)
    idx = torch.randint(0, 512, (1, 256), device="cuda")
    tgt = torch.randint(0, 512, (1, 256), device="cuda")
    l_e, g_e = loss_and_grads(eager, idx, tgt)
    l_c, _ = loss_and_grads(compiled, idx, tgt)
    g_c = {n: p.grad.float() for n, p in ours.named_parameters()}  # compiled shares ours' parameters
    assert abs(l_e.item() - l_c.item()) < 1e-2
    for name, g in g_e.items():
        assert rel(g_c[name], g) < 3e-2, name


def test_fused_mlp_model_matches_torch_mlp():
    """model.mlp=fused (GELU in cuBLASLt's epilogues; what auto picks on CUDA) against nn.Linear + F.gelu."""
    from model.mlp import resolve_mlp

    cuda = torch.device("cuda")
    assert resolve_mlp("auto", cuda)[0] == "fused"
    cfg = GPTConfig(n_layer=2, d_model=256, n_head=2, vocab_size=512, seq_len=384)
    torch.manual_seed(0)
    plain = GPT(GPTConfig(**{**cfg.__dict__, "mlp": "torch"}), device=cuda).cuda()
    fused = GPT(GPTConfig(**{**cfg.__dict__, "mlp": "fused"}), device=cuda).cuda()
    fused.load_state_dict(plain.state_dict())
    assert fused.mlp_impl == "fused" and plain.mlp_impl == "torch"
    idx = torch.randint(0, 512, (2, 301), device="cuda")
    tgt = torch.randint(0, 512, (2, 301), device="cuda")
    assert_same_loss_and_grads(plain, fused, idx, tgt)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("recompute_layers", [-1, 1])
def test_memory_options_match_the_plain_model(compiled, recompute_layers):
    """model.recompute_gelu + model.norm_saves_output (the 2.7B-8k config's micro-batch 2 fits an H100
    by them), bf16 residual stream, eager and compiled, against the model without them: same loss,
    gradients within bf16 rounding. recompute_layers 1: the first block rebuilds its GELU, the second
    keeps it (model.recompute_gelu_layers)."""
    cuda = torch.device("cuda")
    base = dict(n_layer=2, d_model=256, n_head=2, vocab_size=512, seq_len=384, residual="autocast")
    torch.manual_seed(0)
    plain = GPT(GPTConfig(**base), device=cuda).cuda()
    lean = GPT(GPTConfig(**base, recompute_gelu=True, recompute_gelu_layers=recompute_layers,
                         norm_saves_output=True), device=cuda).cuda()
    assert [b.mlp.recompute_gelu for b in lean.blocks] == ([True, True] if recompute_layers < 0 else [True, False])
    lean.load_state_dict(plain.state_dict())
    with torch.no_grad():  # gains and biases away from their init, as after training
        for p, q in zip(plain.parameters(), lean.parameters()):
            if p.dim() == 1:
                p.add_(0.2 * torch.randn_like(p))
                q.copy_(p)
    assert lean.mlp_impl == "fused"
    idx = torch.randint(0, 512, (2, 301), device="cuda")
    tgt = torch.randint(0, 512, (2, 301), device="cuda")
    l_ref, g_ref = loss_and_grads(plain, idx, tgt)
    run = torch.compile(lean) if compiled else lean
    l_lean, _ = loss_and_grads(run, idx, tgt)
    g_lean = {n: p.grad.float() for n, p in lean.named_parameters()}
    assert abs(l_ref.item() - l_lean.item()) < 1e-2
    for name, g in g_ref.items():
        assert rel(g_lean[name], g) < 3e-2, name
