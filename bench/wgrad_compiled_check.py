"""Does the inductor-compiled step give eager's gradients with fp32 weight-gradient accumulation?
(issue 7, sessions 16-17: kernels/NOTES.md)

A 2-layer GPT (d 256, head dim 128, 2 x 256 tokens) on CUDA, bf16 autocast, weight cache: one
micro-batch through the trainer's engine, compiled and eager, with engine.wgrad_fp32 on (all four
projections of a block accumulate, as shipped since session 17; --fold qkv / proj gives attention's
back to nn.Linear, whose bf16 gradients fold). Prints each run's loss, read before and after the
backward, the loss of the same compiled graph called again, and the largest relative L2 gradient
differences from eager.
On an H100 (torch 2.11), before the fix: only the MLP accumulating (--fold qkv proj), right at width
256; with qkv accumulating, 8-23% off and a forward loss that changed from call to call -- also with
--torch-accumulate --set model.mlp=torch model.attention=sdpa (no code of ours on the path); right
with --no-ln-bias (or model.bias=false), under compute-sanitizer, and on CPU; at width 2048
(--set model.d_model=2048 model.n_head=16) wrong even with only the MLP accumulating. The cause:
inductor's looped LayerNorm kernel reads back a buffer it wrote without a barrier
(training/inductor_barrier.py, installed by the engine; --no-barrier-fix leaves it out).

    python bench/wgrad_compiled_check.py [--fold qkv proj] [--runs 2] [--no-barrier-fix]
        [--torch-accumulate] [--no-ln-bias] [--set model.attention=sdpa ...]
        [--knob torch._functorch.config.donated_buffer=False ...]
"""
from __future__ import annotations

import argparse
import ast
import importlib
from types import SimpleNamespace

import torch

from model.gpt import GPT
from training.config import load_config
from training.distributed import DistInfo
from training.engine import TorchEngine

OVERRIDES = ["model.n_layer=2", "model.d_model=256", "model.n_head=2", "model.vocab_size=512",
             "model.seq_len=256", "data.tokenizer_vocab_size=512", "train.device=cuda", "train.dtype=bf16",
             "train.micro_batch_size=2", "train.global_batch_size=6"]


def engine(compile: bool, extra=(), fold=(), ln_bias=True) -> TorchEngine:
    cfg = load_config("tiny_cpu.yaml", [*OVERRIDES, f"train.compile={str(compile).lower()}", *extra])
    torch.manual_seed(0)
    device = torch.device(cfg.train.device)
    model = GPT(cfg.model, device=device)
    for block in model.blocks:
        for name in fold:  # attention's Linear -> nn.Linear with the same parameters: its gradient folds
            old = getattr(block.attn, name)
            new = torch.nn.Linear(old.in_features, old.out_features, bias=old.bias is not None, device=device)
            new.load_state_dict(old.state_dict())
            setattr(block.attn, name, new)
    for module in model.modules() if not ln_bias else ():
        if isinstance(module, torch.nn.LayerNorm):
            module.bias = None
    return TorchEngine(model, cfg, DistInfo(device=device))


def loss_and_grads(e: TorchEngine):
    """(loss read before the backward, read after it, fp32 gradients): the engine's forward_backward
    in two halves, so a backward that writes where it should not shows in the second loss."""
    t = torch.randint(0, 512, (2, 257), generator=torch.Generator().manual_seed(7))
    inputs = e._inputs(SimpleNamespace(x=t[:, :-1], y=t[:, 1:]))
    with e.autocast():
        loss = e.cached_forward(e.weight_cache.tensors(), *inputs)
    before = loss.item()
    (loss / e.accum).backward()
    return (before, loss.item()), {k: p.grad.clone() for k, p in e.model.named_parameters()}


def worst(a, b, n=3) -> str:
    rel = {k: ((a[k] - b[k]).norm() / b[k].norm()).item() for k in b}
    return ", ".join(f"{k} {v:.2e}" for k, v in sorted(rel.items(), key=lambda kv: -kv[1])[:n])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fold", nargs="*", choices=("qkv", "proj"), default=[],
                    help="these attention Linears fold bf16 gradients instead of accumulating in fp32")
    ap.add_argument("--torch-accumulate", action="store_true",
                    help="torch's fp32 addmm_ inside the op instead of our cuBLASLt binding")
    ap.add_argument("--no-ln-bias", action="store_true", help="LayerNorms without a bias")
    ap.add_argument("--no-barrier-fix", action="store_true",
                    help="compile without training/inductor_barrier.py's fix (reproduces the race)")
    ap.add_argument("--runs", type=int, default=2, help="compiled runs (does the loss change between them?)")
    ap.add_argument("--set", nargs="*", default=[], help="config overrides, e.g. model.attention=sdpa")
    ap.add_argument("--knob", nargs="*", default=[],
                    help="compiler settings for the compiled runs, e.g. torch._inductor.config.x=False")
    args = ap.parse_args()
    if args.no_barrier_fix:
        import training.inductor_barrier

        training.inductor_barrier._installed = True  # the engine's install() then leaves inductor as it is
    if args.torch_accumulate:
        import kernels.wgrad

        kernels.wgrad._binding = lambda: None  # accumulate() then falls back to reference_accumulate
    for knob in args.knob:  # module.path[.attr...].name=python literal
        path, value = knob.split("=", 1)
        parts = path.split(".")
        for cut in range(len(parts) - 1, 0, -1):  # the longest importable module prefix
            try:
                target = importlib.import_module(".".join(parts[:cut]))
                break
            except ImportError:
                continue
        for attr in parts[cut:-1]:
            target = getattr(target, attr)
        setattr(target, parts[-1], ast.literal_eval(value))
    eager_loss, eager = loss_and_grads(engine(False, args.set, args.fold, not args.no_ln_bias))
    print(f"eager: loss {eager_loss[0]:.6f} (after the backward {eager_loss[1]:.6f})")
    for run in range(args.runs):
        torch._dynamo.reset()
        e = engine(True, args.set, args.fold, not args.no_ln_bias)
        loss, grads = loss_and_grads(e)
        again, _ = loss_and_grads(e)  # the same compiled graph, same weights: the same loss?
        print(f"compiled run {run + 1}: loss {loss[0]:.6f} (after the backward {loss[1]:.6f}; same graph "
              f"again {again[0]:.6f}) | largest differences from eager: {worst(grads, eager)}")


if __name__ == "__main__":
    main()
