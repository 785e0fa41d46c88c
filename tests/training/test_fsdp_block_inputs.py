"""FSDP2 hands each block the inputs the model made (engine.parallel=fsdp, training/engines/fsdp.py): the
RoPE tables stay fp32 under bf16 mixed precision, as under DDP, and a block recomputed in the backward
(model.recompute_blocks) sees the dtypes its forward saw. One gloo rank on CPU with train.dtype=bf16
(autocast bf16, FSDP2's bf16 parameters)."""
from types import SimpleNamespace

import torch
import torch.distributed as dist
from train_runner import spawn_ranks

from model.gpt import GPT
from training.config import load_config
from training.distributed import DistInfo
from training.engines.factory import build_engine


def _worker(rank: int, port: int):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=1)
    try:
        for recompute in (False, True):
            cfg = load_config("tiny_cpu.yaml", ["engine.type=torch", "engine.parallel=fsdp", "train.dtype=bf16",
                                                "model.pos_emb=rope", "model.n_layer=2", "model.seq_len=40",
                                                "model.residual=autocast",
                                                f"model.recompute_blocks={str(recompute).lower()}",
                                                "train.global_batch_size=3", "train.micro_batch_size=3"])
            torch.manual_seed(0)
            engine = build_engine(GPT(cfg.model), cfg, DistInfo())
            seen = []  # (x dtype, cos dtype, sin dtype) at each call of block 0: forward, then any recompute
            engine.model.blocks[0].register_forward_pre_hook(
                lambda _m, args: seen.append((args[0].dtype, args[1][0].dtype, args[1][1].dtype)))
            idx = torch.randint(0, cfg.model.vocab_size, (3, 40))
            loss = engine.forward_backward(SimpleNamespace(x=idx, y=torch.roll(idx, -1, 1)), sync=True)
            assert torch.isfinite(loss)
            assert seen[0] == (torch.bfloat16, torch.float32, torch.float32), seen  # tables fp32
            assert len(seen) == (2 if recompute else 1) and len(set(seen)) == 1, seen
            assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in engine.model.parameters())
    finally:
        dist.destroy_process_group()


def test_fsdp_blocks_get_the_models_dtypes_in_forward_and_recompute():
    spawn_ranks(_worker, 1)
