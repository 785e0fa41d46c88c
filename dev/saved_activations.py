"""What the compiled training forward keeps for the backward, per token and layer.

Runs one micro-batch of the trainer's forward as the engine does on a GPU (the bf16 weight cache,
functional_call, bf16 autocast, torch.compile) on a small GPT and records every tensor the autograd
graph saves (a saved_tensors_hook sees the compiled graph's saves too). Prints the activation
bytes -- unique storages, weights and their bf16 copies left out -- per token per layer in units
of d_model bf16 values ("d-units": 2 * d_model bytes), and the saved tensors by shape and dtype.
The unit count does not depend on the model's size, so a tiny model on a CPU answers for 1.3B-8k
(bench/RESULTS.md: 18 units; 15 GB per 8k sequence at 1.3B on an H100).

    python dev/saved_activations.py                         # the default partitioner
    python dev/saved_activations.py --budget 0.8            # torch._functorch activation_memory_budget
    python dev/saved_activations.py --norm-saves-output --recompute-gelu     # model.* memory options
                                                            # (recompute_gelu: the fused MLP, CUDA only)

--budget < 1 lets the min-cut partitioner recompute more (a runtime estimate of FLOPs decides
what).
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from model.config import GPTConfig  # noqa: E402
from model.gpt import GPT  # noqa: E402
from training.engines.weight_cache import WeightCache, functional_forward  # noqa: E402


def saved_for_backward(model: GPT, batch: int, budget: float, device: str) -> list[tuple]:
    """(shape, dtype, bytes, storage pointer) of each tensor saved by one compiled training forward."""
    import torch._functorch.config as functorch_config

    functorch_config.activation_memory_budget = budget
    cache = WeightCache(model, torch.bfloat16)
    run = torch.compile(functional_forward(model))
    cfg = model.cfg
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), device=device)
    y = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), device=device)
    saved: list[tuple] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append((tuple(t.shape), t.dtype, t.untyped_storage().nbytes(), t.untyped_storage().data_ptr()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = run(cache.tensors(), x, y)
    loss.backward()  # the graph is complete; frees it
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weights |= {t.untyped_storage().data_ptr() for t in cache.tensors().values()}
    return [s for s in saved if s[3] not in weights]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--n-head", type=int, default=2, help="head dim = d_model / n_head (128 by default)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--budget", type=float, default=1.0,
                    help="torch._functorch.config.activation_memory_budget (1.0: torch's default)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--residual", default="autocast", help="model.residual (the 8k configs: autocast)")
    ap.add_argument("--norm-saves-output", action="store_true", help="model.norm_saves_output")
    ap.add_argument("--recompute-gelu", action="store_true", help="model.recompute_gelu (fused MLP: CUDA)")
    args = ap.parse_args()
    cfg = GPTConfig(n_layer=args.n_layer, d_model=args.d_model, n_head=args.n_head, vocab_size=512,
                    seq_len=args.seq_len, attention="sdpa" if args.device == "cpu" else "auto",
                    residual=args.residual, norm_saves_output=args.norm_saves_output,
                    recompute_gelu=args.recompute_gelu)
    torch.manual_seed(0)
    model = GPT(cfg, device=torch.device(args.device)).to(args.device)
    saved = saved_for_backward(model, args.batch, args.budget, args.device)
    unique = {s[3]: s for s in saved}  # views of one storage (q, k, v of the packed qkv) count once
    total = sum(s[2] for s in unique.values())
    tokens = args.batch * cfg.seq_len
    unit = 2 * cfg.d_model * tokens * cfg.n_layer
    print(f"GPT {cfg.n_layer} x d {cfg.d_model}, {tokens} tokens, activation_memory_budget {args.budget}, "
          f"{args.device}, residual {args.residual}, norm_saves_output {args.norm_saves_output}, "
          f"recompute_gelu {args.recompute_gelu}: {total / 1e6:.2f} MB saved for the backward = {total / unit:.2f} d-units per token "
          f"per layer ({len(saved)} saved tensors, {len(unique)} storages)")
    by_kind = collections.Counter((s[0], str(s[1]).replace("torch.", "")) for s in unique.values())
    for (shape, dtype), n in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {n:3d} x {dtype}{list(shape)}")


if __name__ == "__main__":
    main()
