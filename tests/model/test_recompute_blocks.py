"""model.recompute_blocks (every block under torch.utils.checkpoint: its inputs kept, its forward run again
in the backward) computes the same loss and gradients as the plain model, on CPU in fp32: learned positions
and RoPE, packed documents, the fused residual add + LayerNorm (tuple outputs), dropout (the recomputed
masks are the first pass's), recompute_attention on top (superseded: one recomputation), and compiled;
the backward really recomputes (each block's forward runs twice)."""
import pytest
import torch

from model.config import GPTConfig
from model.gpt import GPT

B, T, V = 2, 24, 67
CU = [0, 7, 24, 31, 48]  # documents over the flattened (B*T) batch, one crossing the row boundary


def _cfg(**kw) -> GPTConfig:
    base = dict(n_layer=3, d_model=32, n_head=4, vocab_size=V, seq_len=T, attention="sdpa", mlp="torch")
    return GPTConfig(**{**base, **kw})


def _loss_and_grads(cfg: GPTConfig, idx, tgt, cu, compiled=False):
    torch.manual_seed(0)  # the same weights for both models
    model = GPT(cfg)
    fwd = torch.compile(model, backend="aot_eager") if compiled else model
    torch.manual_seed(1)  # the same dropout masks for both models
    loss = fwd(idx, tgt, cu_seqlens=cu, max_seqlen=max(b - a for a, b in zip(CU, CU[1:])) if cu is not None else None)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


CASES = {
    "learned": {},
    "rope_documents": dict(pos_emb="rope"),
    "fused_add_norm": dict(norm_saves_output=True, fused_add_norm=True),
    "dropout": dict(dropout=0.2),
    "with_recompute_attention": dict(recompute_attention=True, pos_emb="rope"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_same_loss_and_gradients(case):
    g = torch.Generator().manual_seed(hash(case) % 1000)
    idx, tgt = (torch.randint(0, V, (B, T), generator=g) for _ in range(2))
    cu = torch.tensor(CU, dtype=torch.int32) if case == "rope_documents" else None
    kw = CASES[case]
    want_loss, want = _loss_and_grads(_cfg(**kw), idx, tgt, cu)
    loss, got = _loss_and_grads(_cfg(recompute_blocks=True, **kw), idx, tgt, cu)
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=0)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-7, msg=f"{n} ({case})")


def test_compiled_same_gradients():
    g = torch.Generator().manual_seed(5)
    idx, tgt = (torch.randint(0, V, (B, T), generator=g) for _ in range(2))
    want_loss, want = _loss_and_grads(_cfg(pos_emb="rope"), idx, tgt, None)
    loss, got = _loss_and_grads(_cfg(pos_emb="rope", recompute_blocks=True), idx, tgt, None, compiled=True)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("recompute", [False, True])
def test_backward_runs_each_block_again(recompute):
    model = GPT(_cfg(recompute_blocks=recompute))
    calls = []
    for block in model.blocks:
        block.attn.register_forward_hook(lambda *_: calls.append(1))
    idx = torch.randint(0, V, (B, T))
    loss = model(idx, idx)
    assert len(calls) == 3
    loss.backward()
    assert len(calls) == (6 if recompute else 3)
    with torch.no_grad():  # evaluation keeps nothing for a backward, so there is nothing to recompute
        model(idx, idx)
    assert len(calls) == (9 if recompute else 6)
