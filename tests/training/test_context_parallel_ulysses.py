"""training/context_parallel/ulysses.py on 2 gloo processes (CPU, fp32): UlyssesAttention with C=2 gives
the full-sequence attention of one process (output, and the q/k/v gradients) for the sdpa, math and
reference backends, with grouped-query heads and with packed documents whose boundaries cross the slice
boundary; attach() on a GPT (positions offset per slice; also with every block recomputed in the
backward) gives the one-process gradients; the attention compiles into one graph (fullgraph) with the
same gradients; head counts that do not divide by C are refused with one ValueError."""
import pytest
import torch
import torch.distributed as dist
from train_runner import spawn_ranks

from model.attention import CausalSelfAttention
from model.config import GPTConfig
from model.gpt import GPT
from training.context_parallel.ulysses import check_heads

C = 2
B, T, D = 3, 22, 12  # T/C = 11 tokens a slice: odd
# packed documents over the flattened (B*T) batch: [5, 17) and [22+8, 44) cross the slice boundary (11, 33)
CU = [0, 5, 17, 22, 30, 44, 66]


def _init(rank: int, port: int):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=C)


def _spawn(fn, *args):
    spawn_ranks(fn, C, *args)


def _check_attention(backend: str, n_head: int, n_kv_head: int, packed: bool, rank: int, cp):
    cfg = GPTConfig(n_layer=1, d_model=n_head * D, n_head=n_head, n_kv_head=n_kv_head, seq_len=T)
    mod = CausalSelfAttention(cfg, backend)
    cu = torch.tensor(CU, dtype=torch.int32) if packed else None
    maxlen = max(b - a for a, b in zip(CU, CU[1:])) if packed else None
    g = torch.Generator().manual_seed(100 * n_head + 10 * n_kv_head + packed)  # the same inputs on both ranks
    q = torch.randn(B, T, n_head, D, generator=g)
    k, v = (torch.randn(B, T, n_kv_head, D, generator=g) for _ in range(2))
    w = torch.randn(B, T, n_head, D, generator=g)  # loss = sum(y * w): a gradient that differs per element

    def local(q, k, v):
        return mod._local(q, k, v, cu, maxlen)

    full = [t.clone().requires_grad_() for t in (q, k, v)]
    y_full = local(*full)
    (y_full * w).sum().backward()

    s = slice(rank * T // C, (rank + 1) * T // C)
    part = [t[:, s].clone().requires_grad_() for t in (q, k, v)]
    y = cp(*part, local)
    assert y.shape == (B, T // C, n_head, D)
    (y * w[:, s]).sum().backward()
    what = f"{backend} heads {n_head}/{n_kv_head} packed={packed} rank {rank}"
    torch.testing.assert_close(y, y_full[:, s], rtol=1e-5, atol=1e-5, msg=f"output, {what}")
    for name, a, b in zip("qkv", part, full):
        torch.testing.assert_close(a.grad, b.grad[:, s], rtol=1e-4, atol=1e-5, msg=f"d{name}, {what}")


def _attention_worker(rank: int, port: int, backend: str):
    _init(rank, port)
    try:
        from training.context_parallel import UlyssesAttention

        cp = UlyssesAttention(dist.group.WORLD)
        for n_head, n_kv_head in ((6, 6), (6, 2)):
            for packed in (False, True):
                _check_attention(backend, n_head, n_kv_head, packed, rank, cp)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["sdpa", "math", "reference"])
def test_ulysses_equals_full_sequence_attention(backend):
    _spawn(_attention_worker, backend)


def _gpt_worker(rank: int, port: int, recompute_blocks: bool):
    _init(rank, port)
    try:
        from training.context_parallel import attach, detach

        torch.manual_seed(0)
        # recompute_blocks: the backward runs each block's forward again, all-to-alls included
        cfg = GPTConfig(n_layer=2, d_model=4 * D, n_head=4, n_kv_head=2, vocab_size=61, seq_len=T,
                        pos_emb="rope", attention="sdpa", recompute_blocks=recompute_blocks)
        model = GPT(cfg)
        idx = torch.randint(0, 61, (B, T))
        tgt = torch.randint(0, 61, (B, T))
        cu = torch.tensor(CU, dtype=torch.int32)
        model(idx, tgt, cu_seqlens=cu, max_seqlen=14).backward()  # one process, the full window
        want = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()

        cp = attach(model, dist.group.WORLD)
        assert all(b.attn.context_parallel is cp for b in model.blocks)
        s = slice(rank * T // C, (rank + 1) * T // C)
        loss = model(idx[:, s], tgt[:, s], cu_seqlens=cu, max_seqlen=14, position_offset=s.start)
        loss.backward()
        for p in model.parameters():  # equal slices: the mean of the ranks' means is the full mean
            dist.all_reduce(p.grad)
            p.grad /= C
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, want[n], rtol=1e-4, atol=1e-6, msg=f"{n} rank {rank}")
        detach(model)
        assert all(b.attn.context_parallel is None for b in model.blocks)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("recompute_blocks", [False, True])
def test_attach_gpt_gradients_equal_one_process(recompute_blocks):
    _spawn(_gpt_worker, recompute_blocks)


def _compiled_worker(rank: int, port: int):
    _init(rank, port)
    try:
        from training.context_parallel import attach

        torch.manual_seed(0)
        cfg = GPTConfig(n_layer=1, d_model=4 * D, n_head=4, n_kv_head=2, seq_len=T, attention="sdpa")
        model = GPT(cfg)
        attn = model.blocks[0].attn
        x = torch.randn(B, T, cfg.d_model)
        w = torch.randn(B, T, cfg.d_model)
        xf = x.clone().requires_grad_()
        (attn(xf) * w).sum().backward()
        want = {n: p.grad.clone() for n, p in attn.named_parameters()}
        attn.zero_grad()

        attach(model)
        s = slice(rank * T // C, (rank + 1) * T // C)
        xs = x[:, s].clone().requires_grad_()
        # fullgraph: DeepSpeed's all-to-all (an autograd function around all_to_all_single) traces without a
        # graph break; aot_eager runs AOTAutograd's joint graph (where a collective that the tracer sees as
        # producing no data would give zero gradients) without inductor's code generation (~1 min on 2 cores)
        y = torch.compile(attn, fullgraph=True, backend="aot_eager")(xs)
        (y * w[:, s]).sum().backward()
        torch.testing.assert_close(xs.grad, xf.grad[:, s], rtol=1e-4, atol=1e-6, msg=f"dx rank {rank}")
        for n, p in attn.named_parameters():
            dist.all_reduce(p.grad)  # each rank's gradient is its slice's share
            torch.testing.assert_close(p.grad, want[n], rtol=1e-4, atol=1e-6, msg=f"{n} rank {rank}")
    finally:
        dist.destroy_process_group()


def test_compiled_attention_one_graph_and_equal_gradients():
    _spawn(_compiled_worker)


def _error_worker(rank: int, port: int):
    _init(rank, port)
    try:
        from training.context_parallel import UlyssesAttention, attach

        cp = UlyssesAttention()
        q = torch.randn(1, 4, 3, D)
        with pytest.raises(ValueError, match="3 query heads and 3 kv heads.*context_parallel_size to one of 1"):
            cp(q, q, q, lambda *a: a[0])
        kv = torch.randn(1, 4, 1, D)
        with pytest.raises(ValueError, match="4 query heads and 1 kv heads"):
            cp(torch.randn(1, 4, 4, D), kv, kv, lambda *a: a[0])
        model = GPT(GPTConfig(n_layer=1, d_model=6 * D, n_head=6, n_kv_head=3, vocab_size=61, seq_len=T,
                              attention="sdpa"))
        with pytest.raises(ValueError, match="6 query heads and 3 kv heads.*one of 1, 3"):
            attach(model)
        assert model.blocks[0].attn.context_parallel is None  # nothing half-attached
        with pytest.raises(ValueError, match="no attention module"):
            attach(torch.nn.Linear(2, 2))
    finally:
        dist.destroy_process_group()


def test_errors_on_heads_not_divisible():
    _spawn(_error_worker)


def test_check_heads_message():
    check_heads(8, 4, 4)
    with pytest.raises(ValueError) as e:
        check_heads(12, 6, 4)
    assert str(e.value).count("\n") == 0
    assert "12 query heads and 6 kv heads" in str(e.value) and "one of 1, 2, 3, 6" in str(e.value)


def test_needs_torch_distributed():
    from training.context_parallel import UlyssesAttention

    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="needs torch.distributed initialised"):
        UlyssesAttention()
