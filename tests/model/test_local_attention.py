"""Local (sliding-window) attention in the model, on CPU: model.attention_window = w makes the chosen layers
(attention_window_layers) attend causally to a band of w tokens. A local layer's output at token t does not
depend on tokens before t - w + 1 (while a dense layer's does); packed documents keep the band inside each
document; sdpa, math and reference agree with a window, forward and backward; the tiny model trains with
it; sdpa_flash / sdpa_cudnn (no mask) and bad values are refused in one line."""
import pytest
import torch

from kernels.reference import attention_ref, attention_varlen_ref
from model.attention import AttentionUnavailable, CausalSelfAttention, resolve_backend, window_refusal
from model.config import GPTConfig
from model.gpt import GPT
from training.config import ConfigError, load_config

W = 4  # window, tokens


def _cfg(**kw):
    base = dict(n_layer=2, d_model=32, n_head=4, n_kv_head=2, vocab_size=67, seq_len=24, attention="sdpa")
    return GPTConfig(**{**base, **kw})


@pytest.mark.parametrize("layers,local", [("odd", [0, W, 0, W, 0]), ("even", [W, 0, W, 0, W]),
                                          ("all", [W] * 5)])
def test_which_layers_are_local(layers, local):
    cfg = _cfg(n_layer=5, attention_window=W, attention_window_layers=layers)
    assert [cfg.window_of(i) for i in range(5)] == local
    assert [b.attn.window for b in GPT(cfg).blocks] == local
    assert [_cfg(n_layer=5).window_of(i) for i in range(5)] == [0] * 5  # attention_window=0: all dense


@pytest.mark.parametrize("backend", ["sdpa", "math", "reference"])
def test_a_local_layer_does_not_see_before_its_window(backend):
    torch.manual_seed(0)
    T, p = 20, 6  # perturb token p's input
    local = CausalSelfAttention(_cfg(attention_window=W), backend, window=W)
    dense = CausalSelfAttention(_cfg(), backend)
    dense.load_state_dict(local.state_dict())
    x = torch.randn(2, T, 32)
    x2 = x.clone()
    x2[:, p] += 1.0
    with torch.no_grad():
        for mod, sees_until in ((local, p + W), (dense, T)):
            moved = (mod(x2) - mod(x)).abs().amax(dim=(0, 2))  # (T,) largest change per position
            assert torch.all(moved[:p] == 0)  # causal
            assert torch.all(moved[p:sees_until] > 1e-4), (backend, mod.window, moved)
            assert torch.all(moved[sees_until:] == 0), (backend, mod.window, moved)


def test_a_local_only_model_does_not_see_before_its_receptive_field():
    """Two local layers: token t sees tokens back to t - 2 (W - 1); a dense model sees all before t."""
    torch.manual_seed(0)
    T, p = 24, 3
    idx = torch.randint(0, 67, (2, T))
    idx2 = idx.clone()
    idx2[:, p] = (idx[:, p] + 1) % 67
    reach = p + 2 * (W - 1) + 1  # first position neither layer stack lets token p reach
    for cfg, unchanged_from in ((_cfg(attention_window=W, attention_window_layers="all"), reach),
                                (_cfg(attention_window=W, attention_window_layers="odd"), T),
                                (_cfg(), T)):
        torch.manual_seed(1)
        model = GPT(cfg).eval()
        with torch.no_grad():
            moved = (model(idx2) - model(idx)).abs().amax(dim=(0, 2))  # (T,)
        assert torch.all(moved[:p] == 0) and torch.all(moved[p:unchanged_from] > 1e-6), (cfg, moved)
        assert torch.all(moved[unchanged_from:] == 0), (cfg.attention_window_layers, moved)


def _qkv(B, T, h, hk, D, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, h, D, generator=g)
    return q, torch.randn(B, T, hk, D, generator=g), torch.randn(B, T, hk, D, generator=g)


@pytest.mark.parametrize("backend", ["sdpa", "math", "reference"])
def test_local_layer_equals_reference_window(backend):
    q, k, v = _qkv(2, 19, 4, 2, 8, 1)
    mod = CausalSelfAttention(_cfg(attention_window=5), backend, window=5)
    want, _ = attention_ref(q, k, v, causal=True, window_size=(4, 0))
    torch.testing.assert_close(mod._local(q, k, v, None, None), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["sdpa", "math", "reference"])
def test_packed_documents_keep_the_window_inside_each_document(backend):
    B, T = 2, 19
    cu = torch.tensor([0, 3, 12, 19, 25, 38], dtype=torch.int32)  # documents of 3, 9, 7 | 6, 13 tokens
    q, k, v = _qkv(B, T, 4, 2, 8, 2)
    mod = CausalSelfAttention(_cfg(attention_window=5), backend, window=5)
    got = mod._local(q, k, v, cu, 13)
    want, _ = attention_varlen_ref(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, causal=True,
                                   window_size=(4, 0))
    torch.testing.assert_close(got.flatten(0, 1), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
def test_sdpa_math_and_reference_agree_with_a_window(pos_emb):
    idx = torch.randint(0, 67, (2, 24), generator=torch.Generator().manual_seed(3))
    tgt = torch.roll(idx, -1, 1)
    results = {}
    for backend in ("reference", "sdpa", "math"):
        torch.manual_seed(0)
        model = GPT(_cfg(attention=backend, attention_window=5, pos_emb=pos_emb, n_layer=3))
        loss = model(idx, tgt)
        loss.backward()
        results[backend] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    ref_loss, ref_grads = results["reference"]
    for backend in ("sdpa", "math"):
        loss, grads = results[backend]
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        for n, g in grads.items():
            torch.testing.assert_close(g, ref_grads[n], rtol=1e-4, atol=1e-6, msg=f"{backend} {n}")


def test_a_window_at_least_the_context_is_dense():
    idx = torch.randint(0, 67, (2, 24), generator=torch.Generator().manual_seed(4))
    outs = []
    for window in (0, 24, 100):
        torch.manual_seed(0)
        outs.append(GPT(_cfg(attention_window=window, attention_window_layers="all"))(idx))
    torch.testing.assert_close(outs[1], outs[0])
    torch.testing.assert_close(outs[2], outs[0])


def test_the_tiny_model_trains_with_local_layers():
    """configs/tiny_cpu_local.yaml's model (alternating dense and local layers), smaller: the loss on a
    repeated batch falls over a handful of AdamW steps."""
    cfg = load_config("tiny_cpu_local.yaml", ["model.n_layer=2", "model.seq_len=64", "model.d_model=64"]).model
    assert cfg.attention_window == 32 and [cfg.window_of(i) for i in range(2)] == [0, 32]
    torch.manual_seed(0)
    model = GPT(cfg)
    assert model.blocks[1].attn.window == 32 and model.blocks[0].attn.window == 0
    idx = torch.randint(0, cfg.vocab_size, (4, 65))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = model(idx[:, :-1], idx[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.parametrize("backend", ["sdpa_flash", "sdpa_cudnn"])
def test_sdpa_backends_without_a_mask_refuse_a_window(backend):
    for device in ("cpu", "cuda"):  # decided before any device check
        with pytest.raises(AttentionUnavailable, match=f"model.attention={backend} cannot run a local window") as e:
            resolve_backend(backend, torch.device(device), 16, torch.float32, window=W)
        assert "\n" not in str(e.value) and "use model.attention=flash or sdpa" in str(e.value)
    with pytest.raises(AttentionUnavailable, match="cannot run a local window"):
        CausalSelfAttention(_cfg(attention_window=W), backend, window=W)
    with pytest.raises(ConfigError, match=f"model.attention={backend} cannot run a local window"):
        load_config("tiny_cpu.yaml", [f"model.attention={backend}", "model.attention_window=16"])


@pytest.mark.parametrize("override,line", [
    ("model.attention_window=-1", "model.attention_window=-1 must be >= 0"),
    ("model.attention_window_layers=every", "model.attention_window_layers='every' is not one of odd, even, all"),
])
def test_bad_window_config_is_one_config_error(override, line):
    with pytest.raises(ConfigError, match=line) as e:
        load_config("tiny_cpu_local.yaml", [override])
    assert "\n" not in str(e.value)
    assert load_config("tiny_cpu.yaml", ["model.attention_window=4096"]).model.attention_window == 4096  # dense


def test_model_flops_count_a_local_layer_at_its_window():
    """Paper convention: a local layer attends w keys per query (12·d·w per token) instead of s;
    causal-aware: the mean keys a query sees, w - w²/(2s); a window >= s is dense."""
    dense = GPTConfig(n_layer=4, d_model=64, n_head=4, vocab_size=128, seq_len=1024)
    local = GPTConfig(n_layer=4, d_model=64, n_head=4, vocab_size=128, seq_len=1024, attention_window=256)
    base = 6 * dense.num_params()
    assert dense.flops_per_token() == base + 12 * 64 * 4 * 1024
    assert dense.flops_per_token(causal_aware=True) == base + 6 * 64 * 4 * 1024
    # layers 1 and 3 local ("odd"), 0 and 2 dense
    assert local.flops_per_token() == base + 12 * 64 * (2 * 1024 + 2 * 256)
    assert local.flops_per_token(causal_aware=True) == pytest.approx(
        base + 12 * 64 * (2 * 512 + 2 * (256 - 256 ** 2 / 2048)))
    wide = GPTConfig(n_layer=4, d_model=64, n_head=4, vocab_size=128, seq_len=1024, attention_window=4096)
    assert wide.flops_per_token() == dense.flops_per_token()


def test_flash_takes_a_window_and_maskless_sdpa_backends_do_not():
    assert window_refusal("flash", 32) is None and window_refusal("auto", 32) is None
    assert window_refusal("sdpa_cudnn", 0) is None
    with pytest.raises(ConfigError, match="model.attention=sdpa_cudnn cannot run a local window"):
        load_config("tiny_cpu_local.yaml", ["model.attention=sdpa_cudnn"])
    assert load_config("tiny_cpu_local.yaml", ["model.attention=flash"]).model.attention_window == 32
