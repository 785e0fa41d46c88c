"""Does the inductor-compiled step give eager's gradients with fp32 weight-gradient accumulation?
(issue 7, session 16: kernels/NOTES.md)

A 2-layer GPT (d 256, head dim 128, 2 x 256 tokens) on CUDA, bf16 autocast, weight cache: one
micro-batch through the trainer's engine, compiled and eager, with engine.wgrad_fp32 on (the MLP's
Linears, as shipped) or also on attention's qkv / proj (--attention: they are swapped for
model/linear.py's Linear). Prints each run's loss and the largest relative L2 gradient differences.
Session 16 on an H100: MLP only, compiled vs eager 4.6e-3 (the same as the fold's, compiled);
--attention 8-18% and a loss that changes from run to run (eager and backend="aot_eager": exact).

    python bench/wgrad_compiled_check.py [--attention] [--runs 2]
"""
from __future__ import annotations

import argparse
from types import SimpleNamespace

import torch

from model.gpt import GPT
from model.linear import Linear
from training.config import load_config
from training.distributed import DistInfo
from training.engine import TorchEngine

OVERRIDES = ["model.n_layer=2", "model.d_model=256", "model.n_head=2", "model.vocab_size=512",
             "model.seq_len=256", "data.tokenizer_vocab_size=512", "train.device=cuda", "train.dtype=bf16",
             "train.micro_batch_size=2", "train.global_batch_size=6"]


def engine(compile: bool, attention: bool, *extra) -> TorchEngine:
    cfg = load_config("tiny_cpu.yaml", [*OVERRIDES, f"train.compile={str(compile).lower()}", *extra])
    torch.manual_seed(0)
    model = GPT(cfg.model, device=torch.device("cuda"))
    if attention:  # give attention's Linears the main_grad slot the MLP's have
        for block in model.blocks:
            for name in ("qkv", "proj"):
                old = getattr(block.attn, name)
                new = Linear(old.in_features, old.out_features, bias=old.bias is not None)
                new.load_state_dict(old.state_dict())
                new.is_residual_out = getattr(old, "is_residual_out", False)
                setattr(block.attn, name, new)
    return TorchEngine(model, cfg, DistInfo(device=torch.device("cuda")))


def loss_and_grads(e: TorchEngine):
    t = torch.randint(0, 512, (2, 257), generator=torch.Generator().manual_seed(7))
    loss = float(e.forward_backward(SimpleNamespace(x=t[:, :-1], y=t[:, 1:]), sync=True))
    return loss, {k: p.grad.clone() for k, p in e.model.named_parameters()}


def worst(a, b, n=3) -> str:
    rel = {k: ((a[k] - b[k]).norm() / b[k].norm()).item() for k in b}
    return ", ".join(f"{k} {v:.2e}" for k, v in sorted(rel.items(), key=lambda kv: -kv[1])[:n])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attention", action="store_true", help="attention's Linears accumulate too")
    ap.add_argument("--runs", type=int, default=2, help="compiled runs (does the loss change between them?)")
    args = ap.parse_args()
    eager_loss, eager = loss_and_grads(engine(False, args.attention))
    print(f"eager: loss {eager_loss:.6f}")
    for run in range(args.runs):
        torch._dynamo.reset()
        loss, grads = loss_and_grads(engine(True, args.attention))
        print(f"compiled run {run + 1}: loss {loss:.6f} | largest differences from eager: {worst(grads, eager)}")


if __name__ == "__main__":
    main()
