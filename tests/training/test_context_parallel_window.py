"""Local attention under context parallelism (training/context_parallel/ulysses.py) on 2 gloo processes
(CPU, fp32): the all-to-all hands each rank whole sequences (of a share of the heads), so a GPT with
alternating dense and local layers (model.attention_window) gives the one-process gradients with C=2, also
with packed documents whose boundaries cross the slice boundary and a window crossing it too."""
import torch
import torch.distributed as dist
from train_runner import spawn_ranks

from model.config import GPTConfig
from model.gpt import GPT

C = 2
B, T = 3, 22  # T/C = 11 tokens a slice
CU = [0, 5, 17, 22, 30, 44, 66]  # packed documents over the flattened (B*T) batch; some cross a slice boundary


def _worker(rank: int, port: int):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=C)
    try:
        from training.context_parallel import attach, detach

        for packed in (False, True):
            torch.manual_seed(0)
            cfg = GPTConfig(n_layer=2, d_model=48, n_head=4, n_kv_head=2, vocab_size=61, seq_len=T,
                            pos_emb="rope", attention="sdpa", attention_window=6)  # layer 1 local
            model = GPT(cfg)
            assert [b.attn.window for b in model.blocks] == [0, 6]
            idx = torch.randint(0, 61, (B, T))
            tgt = torch.randint(0, 61, (B, T))
            kw = dict(cu_seqlens=torch.tensor(CU, dtype=torch.int32), max_seqlen=14) if packed else {}
            model(idx, tgt, **kw).backward()  # one process, the full window
            want = {n: p.grad.clone() for n, p in model.named_parameters()}
            model.zero_grad()

            attach(model, dist.group.WORLD)
            s = slice(rank * T // C, (rank + 1) * T // C)
            model(idx[:, s], tgt[:, s], position_offset=s.start, **kw).backward()
            for p in model.parameters():  # equal slices: the mean of the ranks' means is the full mean
                dist.all_reduce(p.grad)
                p.grad /= C
            for n, p in model.named_parameters():
                torch.testing.assert_close(p.grad, want[n], rtol=1e-4, atol=1e-6,
                                           msg=f"{n} rank {rank} packed={packed}")
            detach(model)
    finally:
        dist.destroy_process_group()


def test_local_attention_with_context_parallel_equals_one_process():
    spawn_ranks(_worker, C)
