"""An out-of-memory error, told as one line: what filled the GPU and which settings free memory.

torch's own message ("CUDA out of memory. Tried to allocate 1.54 GiB ...") names the allocation
that failed, not the setting to change. A long-context run fills a GPU with two things: the fp32
weights, gradients and AdamW moments (16 bytes per parameter, 18 with the bf16 weight cache; fixed
by the model and the engine) and the activations of one micro-batch (about 17 d_model-wide bf16
values per token and block, fewer with the model's memory options; dev/saved_activations.py).
`explain` turns the error into `OutOfMemory`, whose message says both and lists the settings that
apply to this config, cheapest first. The launcher prints it as one line and exits 2 (README
"Errors and what to do"); no checkpoint is written after the failure, so the last one stays the
last good state.
"""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import torch

GIB = 2 ** 30


class OutOfMemory(RuntimeError):
    """The GPU ran out of memory; the message names the settings that would fit the run."""


def memory_options(cfg, world_size: int) -> List[str]:
    """The settings that lower this run's peak memory, cheapest in throughput first."""
    m, t, e = cfg.model, cfg.train, cfg.engine
    out = []
    if m.attention == "math" and not m.recompute_attention:  # the s x s probabilities of every layer
        out.append(f"model.recompute_attention=true (materialised attention keeps n_head x seq_len^2 "
                   f"probabilities per sequence and layer: {m.n_head * m.seq_len ** 2 * 2 / 2 ** 30:.2f} GB in bf16; "
                   f"or model.attention=auto)")
    if m.recompute_gelu and m.recompute_gelu_layers >= 0:
        out.append(f"model.recompute_gelu_layers=-1 (every block rebuilds its GELU output; now the first "
                   f"{m.recompute_gelu_layers} of {m.n_layer} do; -0.34 GB per block at 2.7B-8k micro-batch 2)")
    if not m.recompute_gelu and m.mlp in ("auto", "fused"):
        out.append("model.recompute_gelu=true (the MLP keeps only its GELU input: 4 of ~17 units per token and block)")
    if not m.norm_saves_output:
        out.append("model.norm_saves_output=true model.fused_add_norm=true (LayerNorms keep only their output)")
    if t.micro_batch_size > 1:
        out.append(f"train.micro_batch_size={t.micro_batch_size // 2} (now {t.micro_batch_size}; "
                   f"train.global_batch_size stays, so more micro-batches accumulate per step)")
    C, kv = e.context_parallel_size, m.n_kv_head or m.n_head  # a context-parallel run: a larger group
    if C > 1 and world_size % (2 * C) == 0 and m.n_head % (2 * C) == 0 and kv % (2 * C) == 0 and m.seq_len % (2 * C) == 0:
        out.append(f"engine.context_parallel_size={2 * C} (now {C}: each GPU holds seq_len / {2 * C} tokens of a "
                   f"window's activations; data parallel over {world_size // (2 * C)} groups)")
    if world_size > 1 and e.type == "torch" and e.parallel == "ddp":
        out.append(f"engine.parallel=fsdp or engine.type=deepspeed engine.zero_stage=1..3 (shard the weights' "
                   f"and AdamW's state over the {world_size} GPUs)")
    if not m.recompute_blocks:
        out.append("model.recompute_blocks=true (each block keeps only its input and runs its forward again in "
                   "the backward: ~1 of ~17 units per token and block, ~1/3 more compute)")
    if not out:
        out.append("a shorter model.seq_len, a smaller model, or a GPU with more memory")
    return out


def explain(err: BaseException, cfg, step: Optional[int], world_size: int, device: torch.device,
            num_params: int, last_checkpoint: Optional[Path]) -> OutOfMemory:
    """One line for an out-of-memory `err` raised while building (step None) or after `step` completed
    optimizer steps."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    first = first.split(" Including non-PyTorch memory")[0].rstrip(".")  # the allocator's breakdown follows
    where = "while building the model and optimizer" if step is None else f"after {step} completed steps"
    facts = []
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        capacity = torch.cuda.get_device_properties(index).total_memory / GIB
        peak = torch.cuda.max_memory_allocated(index) / GIB
        facts.append(f"{capacity:.1f} GiB on this GPU, {peak:.1f} GiB allocated at the peak so far")
    state = 16 * num_params
    state_txt = f"{state / GIB:.1f} GiB" if state >= GIB else f"{state / 2 ** 20:.1f} MiB"
    params_txt = f"{num_params / 1e9:.2f}B" if num_params >= 1e9 else f"{num_params / 1e6:.2f}M"
    facts.append(f"fp32 weights, gradients and AdamW moments take {state_txt} per GPU unsharded "
                 f"({params_txt} parameters x 16 bytes), the rest is the activations of "
                 f"{cfg.train.micro_batch_size} x {cfg.model.seq_len // cfg.engine.context_parallel_size} tokens")
    saved = (f"the last checkpoint, {last_checkpoint}, is intact: rerun with the change and train.resume=auto "
             f"continues from it" if last_checkpoint is not None else "no checkpoint was written yet")
    fixes = "; ".join(memory_options(cfg, world_size))
    return OutOfMemory(f"out of GPU memory {where} ({first}); {'; '.join(facts)}. To fit, try (cheapest "
                       f"first): {fixes}. Nothing was saved after the failure; {saved}")
