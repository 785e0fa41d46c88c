"""Warm-up + cosine schedule and parameter groups."""
import math

import pytest
import torch

from model.config import GPTConfig
from model.gpt import GPT
from training.config import OptimConfig
from training.optim import WarmupCosine, build_optimizer, param_groups


def test_param_groups_decay_only_matrices():
    model = GPT(GPTConfig(n_layer=1, d_model=16, n_head=2, vocab_size=32, seq_len=8))
    decay, no_decay = param_groups(model, 0.1)
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    n = sum(p.numel() for g in (decay, no_decay) for p in g["params"])
    assert n == model.num_params()  # every parameter once (tied head counted once)


def test_schedule_shape():
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=4)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.randn(2))], lr=0.0)
    s = WarmupCosine(opt, cfg, max_steps=14)
    lrs = []
    for _ in range(16):
        lrs.append(opt.param_groups[0]["lr"])
        s.step()
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lrs[4] == pytest.approx(1.0)
    assert lrs[9] == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))  # halfway down
    assert lrs[14] == pytest.approx(0.1) and lrs[15] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))


def test_schedule_state_round_trip():
    cfg = OptimConfig(lr=1.0, min_lr=0.0, warmup_steps=2)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.randn(2))], lr=0.0)
    s = WarmupCosine(opt, cfg, max_steps=10)
    for _ in range(5):
        s.step()
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.randn(2))], lr=0.0)
    s2 = WarmupCosine(opt2, cfg, max_steps=10)
    s2.load_state_dict(s.state_dict())
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == s.lr_at(5)


def test_adamw_unfused_on_cpu():
    model = torch.nn.Linear(4, 4)
    opt = build_optimizer(model, OptimConfig(), torch.device("cpu"))
    assert isinstance(opt, torch.optim.AdamW) and not opt.defaults["fused"]
