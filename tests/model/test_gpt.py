"""Model: shapes, parameter counts (meta device), init, backends agreeing, RoPE, GQA, document masks."""
import math

import pytest
import torch

from model.attention import doc_mask, reference_attention, resolve_backend
from model.config import GPTConfig
from model.gpt import GPT
from training.config import load_config


def small(**kw):
    base = dict(n_layer=2, d_model=64, n_head=4, vocab_size=128, seq_len=32)
    base.update(kw)
    return GPTConfig(**base)


@pytest.mark.parametrize("name, published, tol", [("gpt_1.3b_8k.yaml", 1.3e9, 0.03),
                                                  ("gpt_2.7b_8k.yaml", 2.7e9, 0.03)])
def test_param_count_matches_published_size(name, published, tol):
    cfg = load_config(name).model
    with torch.device("meta"):
        model = GPT(cfg)
    n = model.num_params()
    assert n == cfg.num_params()  # the closed form agrees with the modules
    assert abs(n - published) / published < tol, n


def test_param_count_hand_worked():
    # L=1, d=8, heads 2, vocab 16, seq 4, bias, learned positions, mlp 4x:
    # embeddings 16*8 + 4*8 = 160; block: 2 LN (2*16) + qkv 8*24+24 + proj 8*8+8 + fc 8*32+32
    # + out 32*8+8 = 32 + 216 + 72 + 288 + 264 = 872; final LN 16. Total 1048.
    cfg = GPTConfig(n_layer=1, d_model=8, n_head=2, vocab_size=16, seq_len=4)
    assert cfg.num_params() == 1048
    assert GPT(cfg).num_params() == 1048


@pytest.mark.parametrize("kw", [{}, {"pos_emb": "rope"}, {"n_kv_head": 2}, {"bias": False}])
def test_forward_shapes_and_loss(kw):
    cfg = small(**kw)
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (3, 17))  # odd length, shorter than seq_len
    logits = model(idx)
    assert logits.shape == (3, 17, cfg.vocab_size)
    loss = model(idx, torch.randint(0, cfg.vocab_size, (3, 17)))
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.5  # near uniform at init
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("fused", [True, False])
def test_strided_token_slices_are_accepted(fused):
    """x and y as the usual slices of one (B, T+1) tensor (not contiguous for B > 1): both loss paths
    take them and agree with contiguous copies."""
    cfg = small(fused_loss=fused)
    model = GPT(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (3, 18))
    x, y = tokens[:, :-1], tokens[:, 1:]
    assert not y.is_contiguous()
    assert torch.equal(model(x, y), model(x.contiguous(), y.contiguous()))


def test_too_long_sequence_is_a_clear_error():
    cfg = small()
    with pytest.raises(ValueError, match="seq_len"):
        GPT(cfg)(torch.randint(0, 128, (1, 33)))


def test_tied_head_and_scaled_init():
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=8, d_model=256, n_head=4, vocab_size=256, seq_len=16)
    model = GPT(cfg)
    assert model.lm_head.weight is model.wte.weight
    std_fc = model.blocks[0].mlp.fc.weight.std().item()
    std_proj = model.blocks[0].mlp.proj.weight.std().item()
    assert abs(std_fc - 0.02) < 0.002
    assert abs(std_proj - 0.02 / math.sqrt(16)) < 0.001


@pytest.mark.parametrize("kw", [{}, {"n_kv_head": 1}, {"pos_emb": "rope"}])
def test_sdpa_and_reference_backends_agree(kw):
    torch.manual_seed(1)
    a = GPT(small(attention="sdpa", **kw))
    b = GPT(small(attention="reference", **kw))
    b.load_state_dict(a.state_dict())
    idx = torch.randint(0, 128, (2, 29))
    torch.testing.assert_close(a(idx), b(idx), atol=1e-5, rtol=1e-5)


def test_reference_attention_matches_naive_loop():
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    out = reference_attention(q, k, v)
    for t in range(5):
        w = (q[0, :, t, None] @ k[0, :, : t + 1].transpose(-1, -2) / math.sqrt(8)).softmax(-1)
        torch.testing.assert_close(out[0, :, t], (w @ v[0, :, : t + 1])[:, 0])


def test_doc_mask_keeps_attention_inside_documents():
    # batch of 2 rows of 4 tokens; documents: [0,3) [3,6) [6,8) in the flattened 8 tokens
    cu = torch.tensor([0, 3, 4, 6, 8], dtype=torch.int32)  # row start at 4 splits doc 2
    m = doc_mask(cu, 2, 4)[:, 0]
    assert m[0, 3, 2].item() is False and m[0, 2, 0].item() is True
    assert m[0, 3, 3].item() is True  # a one-token document sees itself
    assert m[1, 1, 0].item() is True  # row 1: tokens 4, 5 are one document
    assert m[1, 2, 1].item() is False and m[1, 3, 2].item() is True and m[1, 0, 1].item() is False


def test_documents_do_not_leak():
    """With document boundaries, changing tokens of document 1 must not change document 2's logits."""
    torch.manual_seed(3)
    model = GPT(small())
    idx = torch.randint(0, 128, (1, 16))
    cu = torch.tensor([0, 7, 16], dtype=torch.int32)
    out1 = model(idx, cu_seqlens=cu, max_seqlen=9)
    idx2 = idx.clone()
    idx2[0, :7] = torch.randint(0, 128, (7,))
    out2 = model(idx2, cu_seqlens=cu, max_seqlen=9)
    torch.testing.assert_close(out1[0, 7:], out2[0, 7:])
    assert not torch.allclose(out1[0, :7], out2[0, :7])


def test_backend_resolution_on_cpu():
    assert resolve_backend("auto", torch.device("cpu"))[0] == "sdpa"
    # auto leaves our kernel out where it cannot run: fp32 attention, head dim > 128
    assert resolve_backend("auto", torch.device("cuda"), 64, torch.float32)[0] == "sdpa"
    assert resolve_backend("auto", torch.device("cuda"), 256, torch.bfloat16)[0] == "sdpa"
    assert resolve_backend("reference", torch.device("cpu"))[0] == "reference"
    with pytest.raises(RuntimeError, match="CUDA"):
        resolve_backend("flash", torch.device("cpu"))


def test_flops_per_token_formula():
    cfg = load_config("gpt_1.3b_8k.yaml").model
    N = cfg.num_params()
    assert cfg.flops_per_token() == 6 * N + 12 * 24 * 2048 * 8192
    assert cfg.flops_per_token(causal_aware=True) == 6 * N + 6 * 24 * 2048 * 8192


def test_residual_stream_dtype_under_autocast():
    """model.residual=autocast carries the residual stream in the autocast dtype (Megatron-LM's
    default); fp32 (the default) keeps it in the embedding's fp32. Same weights: same loss within
    bf16 rounding, and gradients that agree."""
    torch.manual_seed(0)
    idx = torch.randint(0, 96, (2, 33))
    seen, results = {}, {}
    for residual in ("fp32", "autocast"):
        torch.manual_seed(1)
        cfg = GPTConfig(n_layer=3, d_model=64, n_head=4, vocab_size=96, seq_len=64, attention="sdpa",
                        mlp="torch", residual=residual)
        model = GPT(cfg)
        hook = model.blocks[1].register_forward_pre_hook(lambda m, a, r=residual: seen.__setitem__(r, a[0].dtype))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(idx, targets=idx.roll(-1, 1))
        loss.backward()
        hook.remove()
        results[residual] = (loss.item(), model.blocks[0].mlp.fc.weight.grad.clone())
    assert seen == {"fp32": torch.float32, "autocast": torch.bfloat16}
    (l32, g32), (l16, g16) = results["fp32"], results["autocast"]
    assert abs(l32 - l16) < 2e-2 * abs(l32) and l32 != l16  # the stream's rounding changes the loss a little
    assert (g16 - g32).norm() < 0.1 * g32.norm()
    with torch.no_grad():  # outside autocast the residual=autocast model (the last built) is fp32
        assert model(idx).dtype == torch.float32


@pytest.mark.parametrize("recompute, layers, expected", [
    (False, -1, [False] * 4), (False, 2, [False] * 4), (True, -1, [True] * 4),
    (True, 0, [False] * 4), (True, 3, [True, True, True, False]), (True, 9, [True] * 4)])
def test_recompute_gelu_layers_picks_the_first_blocks(recompute, layers, expected):
    """model.recompute_gelu_layers: the first that-many blocks rebuild their GELU, the rest keep it."""
    cfg = GPTConfig(n_layer=4, recompute_gelu=recompute, recompute_gelu_layers=layers)
    assert [b.mlp.recompute_gelu for b in GPT(cfg).blocks] == expected
