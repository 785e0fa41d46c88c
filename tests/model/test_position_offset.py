"""The model's context-parallel hooks on one process: GPT.forward(position_offset=...) and the attention
module's `context_parallel` callable. A sequence computed whole gives the same logits as its two halves
computed one after the other with position offsets 0 and T/2, the attention seeing the full sequence
through an in-process stand-in for the exchange (fp32)."""
import pytest
import torch

from model.attention import CausalSelfAttention
from model.config import GPTConfig
from model.gpt import GPT


class FullSequenceInProcess:
    """Stands in for the all-to-all on one process: slices of T/2 tokens arrive in order (slice 0, then
    slice 1); `local` runs on the full-length q/k/v with the slices seen so far and zeros after them
    (causal attention never reads later tokens), and this slice's rows come back."""

    def __init__(self, slices: int):
        self.slices, self.rank, self.seen = slices, 0, {}
        self.calls = 0

    def __call__(self, q, k, v, local):
        self.calls += 1
        B, t = q.shape[:2]
        key = len([s for s in self.seen if s[1] == self.rank])  # the layer, by call order within the slice
        full = []
        for i, x in enumerate((q, k, v)):
            parts = [self.seen[(key, r)][i] if r < self.rank else (x if r == self.rank else torch.zeros_like(x))
                     for r in range(self.slices)]
            full.append(torch.cat(parts, dim=1))  # (B, T, h, D)
        self.seen[(key, self.rank)] = (q, k, v)
        y = local(*full)  # (B, T, H, D)
        return y[:, self.rank * t:(self.rank + 1) * t]


def _cfg(**kw):
    base = dict(n_layer=2, d_model=48, n_head=6, vocab_size=97, seq_len=40, attention="sdpa")
    base.update(kw)
    return GPTConfig(**base)


def _halves(model, idx, slices=2, **kw):
    cp = FullSequenceInProcess(slices)
    for blk in model.blocks:
        blk.attn.context_parallel = cp
    t = idx.shape[1] // slices
    out = []
    for r in range(slices):
        cp.rank = r
        out.append(model(idx[:, r * t:(r + 1) * t], position_offset=r * t, **kw))
    assert cp.calls == slices * len(model.blocks)  # every attention went through the hook
    for blk in model.blocks:
        blk.attn.context_parallel = None
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("kw", [dict(pos_emb="learned"), dict(pos_emb="rope"),
                                dict(pos_emb="rope", n_kv_head=2), dict(pos_emb="learned", attention="math"),
                                dict(pos_emb="rope", attention="reference", n_kv_head=3)])
def test_halves_with_position_offsets_equal_the_whole(kw):
    torch.manual_seed(0)
    model = GPT(_cfg(**kw)).eval()
    idx = torch.randint(0, 97, (3, 36))  # T = 36 of seq_len 40: offsets within the table
    with torch.no_grad():
        whole = model(idx)
        halves = _halves(model, idx)
    torch.testing.assert_close(halves, whole, rtol=1e-5, atol=1e-5)


def test_offset_matters():
    """A slice given offset 0 instead of its own (here T/2) gets other logits: the offset is used."""
    for pos in ("learned", "rope"):
        torch.manual_seed(0)
        model = GPT(_cfg(pos_emb=pos, n_layer=1)).eval()
        idx = torch.randint(0, 97, (2, 8))
        with torch.no_grad():
            assert not torch.allclose(model(idx, position_offset=0), model(idx, position_offset=16))


def test_packed_documents_full_window_boundaries():
    """cu_seqlens of the full window (documents crossing the slice boundary) reach the local attention,
    which runs on full-length tensors."""
    torch.manual_seed(0)
    model = GPT(_cfg(pos_emb="rope", n_kv_head=3)).eval()
    B, T = 2, 20
    idx = torch.randint(0, 97, (B, T))
    cu = torch.tensor([0, 7, 13, 20, 31, 40], dtype=torch.int32)  # 13 and 31 lie inside slices, 10/30 inside docs
    with torch.no_grad():
        whole = model(idx, cu_seqlens=cu, max_seqlen=11)
        halves = _halves(model, idx, cu_seqlens=cu, max_seqlen=11)
        assert not torch.allclose(whole, model(idx), atol=1e-3)  # the boundaries change the result
    torch.testing.assert_close(halves, whole, rtol=1e-5, atol=1e-5)


def test_gradients_through_the_hook_match():
    """Backward through the hook: the sum of the halves' losses' gradients equals the whole's (fp32)."""
    torch.manual_seed(0)
    cfg = _cfg(pos_emb="rope", n_kv_head=2, n_layer=1)
    model = GPT(cfg)
    idx = torch.randint(0, 97, (2, 16))
    tgt = torch.randint(0, 97, (2, 16))
    model(idx, tgt).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    cp = FullSequenceInProcess(2)
    model.blocks[0].attn.context_parallel = cp
    losses = []
    for r in range(2):
        cp.rank = r
        losses.append(model(idx[:, r * 8:(r + 1) * 8], tgt[:, r * 8:(r + 1) * 8], position_offset=r * 8))
    (sum(losses) / 2).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-4, atol=1e-6, msg=n)


def test_offset_past_the_table_is_refused():
    model = GPT(_cfg(n_layer=1))
    with pytest.raises(ValueError, match="exceeds model.seq_len=40"):
        model(torch.zeros(1, 8, dtype=torch.long), position_offset=33)


def test_context_parallel_defaults_to_none():
    assert CausalSelfAttention(_cfg(), "sdpa").context_parallel is None
