"""Warm-up + cosine schedule and parameter groups."""
import math
from types import SimpleNamespace

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


@pytest.mark.parametrize("max_norm", [0.05, 1e3])  # clipping active / inactive
def test_clip_folded_into_fused_adamw_matches_torch_clip(max_norm):
    """grad_scale = clip_scale(norm, max_norm) in fused AdamW's step == clip_grads_with_norm_ then step."""
    from training.optim import clip_scale, clips_in_step

    torch.manual_seed(0)
    shapes = [(37, 5), (5,), (3, 7, 2)]
    ref = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    ours = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    opt_ref = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, fused=True)
    opt_ours = torch.optim.AdamW(ours, lr=1e-2, weight_decay=0.1, fused=True)
    assert clips_in_step(opt_ours, ours)
    for _ in range(3):
        for a, b in zip(ref, ours):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        norm = torch.nn.utils.get_total_norm([p.grad for p in ref])
        torch.nn.utils.clip_grads_with_norm_(ref, max_norm, norm)
        opt_ref.step()
        opt_ours.grad_scale = clip_scale(norm, max_norm)
        opt_ours.step()
        opt_ours.grad_scale = None
        for a, b in zip(ref, ours):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    for a, b in zip(ref, ours):
        torch.testing.assert_close(opt_ours.state[b]["exp_avg_sq"], opt_ref.state[a]["exp_avg_sq"], rtol=1e-5, atol=0)


def test_clip_rides_in_the_step_only_for_fused_adam():
    from training.optim import clips_in_step

    params = [torch.nn.Parameter(torch.randn(3))]
    assert clips_in_step(torch.optim.AdamW(params, fused=True), params)
    assert not clips_in_step(torch.optim.AdamW(params), params)
    assert not clips_in_step(torch.optim.SGD(params, lr=0.1), params)


def test_engine_with_fused_adamw_trains_like_torch_clip():
    """The engine folds clipping into fused AdamW (optim.fused=true works on CPU too): the same
    parameters as with torch's clip pass, and no grad_scale left on the optimizer after a step."""
    from training.config import load_config
    from training.distributed import DistInfo
    from training.engines.replicas import TorchEngine

    cfg = load_config("tiny_cpu.yaml", ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.vocab_size=96",
                                        "model.seq_len=16", "data.tokenizer_vocab_size=96", "optim.fused=true",
                                        "optim.grad_clip=0.05", "optim.warmup_steps=1", "train.global_batch_size=2",
                                        "train.micro_batch_size=2", "train.dtype=fp32"])
    engines = []
    for fold in (True, False):
        torch.manual_seed(0)
        engine = TorchEngine(GPT(cfg.model), cfg, DistInfo())
        if not fold:
            engine._clips_in_step = False  # torch's clip pass (else the engine picks the fold itself)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            t = torch.randint(0, 96, (2, 17), generator=g)
            engine.forward_backward(SimpleNamespace(x=t[:, :-1], y=t[:, 1:]), sync=True)
            assert float(engine.grad_norm()) > 0.05  # the clip is active
            engine.step()
        assert getattr(engine.optimizer, "grad_scale", None) is None
        engines.append(engine)
    fold, plain = engines
    assert fold._clips_in_step and not plain._clips_in_step
    for (name, a), b in zip(fold.model.named_parameters(), plain.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)

