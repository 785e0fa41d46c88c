"""UlyssesAttention with our kernel (model.attention=flash) as the local attention, over NCCL on 2 GPUs:
output and q/k/v gradients equal the full-sequence kernel call on one GPU within bf16 rounding (plain,
grouped-query, packed documents through the varlen kernel), and the attention module compiled with
fullgraph=True (inductor) gives the same gradients. Skipped without 2 CUDA GPUs."""
import pytest
import torch

pytestmark = pytest.mark.gpu
if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA GPUs (one rank each)", allow_module_level=True)

import torch.distributed as dist  # noqa: E402
from train_runner import spawn_ranks  # noqa: E402

from model.config import GPTConfig  # noqa: E402

C = 2
B, T, D = 2, 2 * 301, 64  # odd slices of 301 tokens
CU = [0, 100, 350, 602, 700, 1204]  # over B*T = 1204 tokens; 350 and 903 lie inside documents


def _close(a, b, what):
    torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2, msg=what)


def _worker(rank: int, port: int):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=C,
                            device_id=torch.device("cuda", rank))
    try:
        from model.attention import CausalSelfAttention
        from model.gpt import GPT
        from training.context_parallel import UlyssesAttention, attach

        cp = UlyssesAttention(dist.group.WORLD)
        s = slice(rank * T // C, (rank + 1) * T // C)
        for n_head, n_kv_head, packed in ((4, 4, False), (8, 2, False), (4, 2, True)):
            cfg = GPTConfig(n_layer=1, d_model=n_head * D, n_head=n_head, n_kv_head=n_kv_head, seq_len=T)
            mod = CausalSelfAttention(cfg, "flash")
            cu = torch.tensor(CU, dtype=torch.int32, device="cuda") if packed else None
            maxlen = max(b - a for a, b in zip(CU, CU[1:])) if packed else None
            g = torch.Generator(device="cuda").manual_seed(n_head * 10 + n_kv_head)
            q = torch.randn(B, T, n_head, D, device="cuda", generator=g).bfloat16()
            k, v = (torch.randn(B, T, n_kv_head, D, device="cuda", generator=g).bfloat16() for _ in range(2))
            w = torch.randn(B, T, n_head, D, device="cuda", generator=g).bfloat16()

            def local(q, k, v):
                return mod._local(q, k, v, cu, maxlen)

            full = [t.clone().requires_grad_() for t in (q, k, v)]
            y_full = local(*full)
            (y_full.float() * w).sum().backward()
            part = [t[:, s].clone().requires_grad_() for t in (q, k, v)]
            y = cp(*part, local)
            (y.float() * w[:, s]).sum().backward()
            what = f"heads {n_head}/{n_kv_head} packed={packed} rank {rank}"
            _close(y, y_full[:, s], f"output, {what}")
            for name, a, b in zip("qkv", part, full):
                _close(a.grad, b.grad[:, s], f"d{name}, {what}")

        torch.manual_seed(0)
        cfg = GPTConfig(n_layer=1, d_model=4 * D, n_head=4, n_kv_head=2, seq_len=T, attention="flash",
                        pos_emb="rope")
        model = GPT(cfg, device=torch.device("cuda")).cuda()
        attn = model.blocks[0].attn
        x = torch.randn(B, T, cfg.d_model, device="cuda")
        w = torch.randn(B, T, cfg.d_model, device="cuda")
        xf = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):  # RoPE tables (T, D/2) of the full window
            (attn(xf, (model.rope_cos, model.rope_sin)).float() * w).sum().backward()
        want = {n: p.grad.clone() for n, p in attn.named_parameters()}
        attn.zero_grad()
        attach(model)
        xs = x[:, s].clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = torch.compile(attn, fullgraph=True)(xs, (model.rope_cos[s], model.rope_sin[s]))
            (y.float() * w[:, s]).sum().backward()
        _close(xs.grad, xf.grad[:, s], f"compiled dx rank {rank}")
        for n, p in attn.named_parameters():
            dist.all_reduce(p.grad)
            scale = want[n].abs().max().clamp(min=1)
            _close(p.grad / scale, want[n] / scale, f"compiled {n} rank {rank}")
    finally:
        dist.destroy_process_group()


def test_ulysses_with_our_kernel_over_nccl():
    spawn_ranks(_worker, C)
