"""The low-precision weight cache (training/engines/weight_cache.py): on CPU under bf16 autocast, a run that
casts the matmul weights once per optimizer step must train exactly like autocast's cast per
micro-batch (same bf16 weights, same bf16 weight gradients added into fp32)."""
from types import SimpleNamespace

import pytest
import torch

from model.gpt import GPT
from training.config import ConfigError, load_config
from training.distributed import DistInfo
from training.engines.replicas import TorchEngine
from training.engines.weight_cache import (WeightCache, cacheable_parameters, setup, weight_cache_choice,
                                           wgrad_fp32_choice)

SMALL = ["model.n_layer=2", "model.d_model=64", "model.n_head=4", "model.vocab_size=320", "model.seq_len=24",
         "data.tokenizer_vocab_size=320", "train.dtype=bf16", "train.global_batch_size=6", "train.micro_batch_size=2", "train.max_steps=10",
         "optim.warmup_steps=1"]


def small_cfg(*overrides):
    return load_config("tiny_cpu.yaml", [*SMALL, *overrides])


def batches(cfg, n, seed=0):
    """n micro-batches of fresh random tokens: SimpleNamespace(x, y), each (micro, seq_len) int64."""
    g = torch.Generator().manual_seed(seed)
    shape = (cfg.train.micro_batch_size, cfg.model.seq_len + 1)
    out = []
    for _ in range(n):
        t = torch.randint(0, cfg.model.vocab_size, shape, generator=g)
        out.append(SimpleNamespace(x=t[:, :-1], y=t[:, 1:]))
    return out


def engine_for(cfg):
    torch.manual_seed(0)  # the same initial weights for every engine built here
    return TorchEngine(GPT(cfg.model), cfg, DistInfo())


def train(engine, data, steps):
    """`steps` optimizer steps of engine.accum micro-batches each; returns the per-step mean losses."""
    losses, it = [], iter(data)
    for _ in range(steps):
        total = 0.0
        for m in range(engine.accum):
            total += float(engine.forward_backward(next(it), sync=m == engine.accum - 1))
        engine.grad_norm()
        engine.step()
        losses.append(total / engine.accum)
    return losses


def test_cached_parameters_are_the_untied_linear_weights_and_biases():
    model = GPT(small_cfg().model)
    names = [n for n, _ in cacheable_parameters(model)]
    per_block = ["attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight", "attn.proj.bias",
                 "mlp.fc.weight", "mlp.fc.bias", "mlp.proj.weight", "mlp.proj.bias"]
    assert names == [f"blocks.{i}.{n}" for i in range(2) for n in per_block]
    # not the output head (tied to the fp32 token embedding), the embeddings or the LayerNorms
    assert not any(n.startswith(("lm_head", "wte", "wpe", "ln")) or ".ln" in n for n in names)


def test_copies_track_the_weights_only_after_invalidate():
    model = GPT(small_cfg().model)
    cache = WeightCache(model, torch.bfloat16)
    w = dict(cacheable_parameters(model))["blocks.0.mlp.fc.weight"]
    first = cache.tensors()["blocks.0.mlp.fc.weight"]
    assert first.dtype == torch.bfloat16 and torch.equal(first, w.detach().to(torch.bfloat16))
    with torch.no_grad():
        w.add_(torch.randn_like(w))
    assert not torch.equal(cache.tensors()["blocks.0.mlp.fc.weight"], w.detach().to(torch.bfloat16))
    cache.invalidate()
    assert torch.equal(cache.tensors()["blocks.0.mlp.fc.weight"], w.detach().to(torch.bfloat16))


def test_training_with_the_cache_is_bit_identical_to_autocast():
    """3 optimizer steps x 3 micro-batches, bf16 autocast on CPU: every loss and every fp32 parameter
    equal bit for bit (the same bf16 weights forward, the same bf16 gradients folded into fp32)."""
    cfg_on, cfg_off = small_cfg(), small_cfg("engine.weight_cache=disabled")
    on, off = engine_for(cfg_on), engine_for(cfg_off)
    assert on.weight_cache is not None and len(on.weight_cache) == 16 and off.weight_cache is None
    assert on.accum == 3
    data = batches(cfg_on, 9)
    losses_on, losses_off = train(on, data, 3), train(off, data, 3)
    assert losses_on == losses_off
    for (name, p), q in zip(on.model.named_parameters(), off.model.parameters()):
        assert p.dtype == torch.float32
        assert torch.equal(p, q), name
    # the copies hold no gradients between steps; the fp32 parameters' grads were cleared by step()
    assert all(c.grad is None for c in on.weight_cache.copies)
    assert all(p.grad is None for p in on.model.parameters())


def test_gradients_fold_into_fp32_grads_across_micro_batches():
    cfg = small_cfg()
    on, off = engine_for(cfg), engine_for(small_cfg("engine.weight_cache=disabled"))
    for b in batches(cfg, 3, seed=1):
        on.forward_backward(b, sync=True)
        off.forward_backward(b, sync=True)
    for (name, p), q in zip(on.model.named_parameters(), off.model.parameters()):
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        assert p.grad.abs().sum() > 0, name  # the test could not pass with missing gradients
        assert torch.equal(p.grad, q.grad), name


def test_checkpoint_load_refreshes_the_copies(tmp_path):
    cfg = small_cfg()
    a, b = engine_for(cfg), engine_for(cfg)
    data = batches(cfg, 6, seed=2)
    train(a, data, 2)  # a's weights move on; b's copies are of the initial weights
    b.weight_cache.tensors()
    a.save(tmp_path)
    b.load(tmp_path)
    probe = batches(cfg, 1, seed=3)[0]
    with torch.no_grad(), a.autocast():
        la = a.cached_forward(a.weight_cache.tensors(), probe.x, probe.y)
        lb = b.cached_forward(b.weight_cache.tensors(), probe.x, probe.y)
    assert torch.equal(la, lb)


def test_compiled_training_with_the_cache_matches_autocast():
    """torch.compile of the functional call: the same gradients as the uncompiled autocast run within
    the rounding that kernel fusion changes, and the same loss curve."""
    cfg = small_cfg("train.compile=true")
    on, off = engine_for(cfg), engine_for(small_cfg("engine.weight_cache=disabled"))
    data = batches(cfg, 9, seed=4)
    for b in data[:3]:
        on.forward_backward(b, sync=True)
        off.forward_backward(b, sync=True)
    for (name, p), q in zip(on.model.named_parameters(), off.model.parameters()):
        scale = float(q.grad.abs().max())
        assert scale > 0, name
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=2e-2 * scale, msg=name)
    for e in (on, off):
        e.grad_norm()
        e.step()
    assert train(on, data[3:], 2) == pytest.approx(train(off, data[3:], 2), rel=5e-3)


def test_when_the_cache_is_used():
    on = small_cfg()
    assert weight_cache_choice(on, DistInfo(), torch.bfloat16)[0]
    assert not weight_cache_choice(on, DistInfo(), None)[0]  # fp32: nothing to cast
    ddp = DistInfo(world_size=2)  # under DDP: test_grad_allreduce.py covers engine.grad_sync's choices
    use, why = weight_cache_choice(small_cfg("engine.grad_sync=ddp"), ddp, torch.bfloat16)
    assert not use and "DDP" in why
    assert not weight_cache_choice(small_cfg("engine.weight_cache=disabled"), DistInfo(), torch.bfloat16)[0]
    with pytest.raises(ConfigError, match="engine.weight_cache"):
        small_cfg("engine.weight_cache=yes")
    # fp32 weight-gradient accumulation: auto only where our CUDA extension runs it
    cpu = torch.device("cpu")
    assert not wgrad_fp32_choice(on, cpu)[0]
    assert wgrad_fp32_choice(small_cfg("engine.wgrad_fp32=enabled"), cpu)[0]
    assert not wgrad_fp32_choice(small_cfg("engine.wgrad_fp32=disabled"), cpu)[0]
    with pytest.raises(ConfigError, match="engine.wgrad_fp32"):
        small_cfg("engine.wgrad_fp32=yes")
    # the tiny CPU run (fp32) and its config defaults keep the plain path
    tiny = load_config("tiny_cpu.yaml")
    assert tiny.engine.weight_cache == "auto" and tiny.train.dtype == "auto"


@pytest.mark.parametrize("compile", [False, True])
def test_fp32_weight_gradients_replace_the_fold(compile):
    """engine.wgrad_fp32=enabled (on the CPU through torch's fp32 addmm): the Linear weights' gradients
    are added into the fp32 .grad by the backward itself, not folded from bf16 copies' grads. Against
    the fold: every gradient equal up to the bf16 rounding of the weight gradients that the fold adds
    (and biases, still folded, within that too), and the same loss curve."""
    flags = ["train.compile=true"] if compile else []
    on, fold = engine_for(small_cfg("engine.wgrad_fp32=enabled", *flags)), engine_for(small_cfg(*flags))
    assert [n for n, _ in on.weight_cache.accumulated] == ["wte.main_grad"] + [
        f"blocks.{i}.{m}.main_grad" for i in range(2) for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
    ] + ["lm_head.main_grad"]  # the tied embedding / head weight's buffer is its .grad for both modules
    assert fold.weight_cache.accumulated == []
    data = batches(on.cfg, 9, seed=5)
    for b in data[:3]:
        on.forward_backward(b, sync=True)
        fold.forward_backward(b, sync=True)
    assert all(c.grad is None for c in on.weight_cache.copies)  # nothing left in bf16
    for (name, p), q in zip(on.model.named_parameters(), fold.model.parameters()):
        scale = float(q.grad.abs().max())
        assert scale > 0 and p.grad.dtype == torch.float32, name
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=2e-2 * scale, msg=name)
    for e in (on, fold):
        e.grad_norm()
        e.step()
    assert all(p.grad is None for p in on.model.parameters())  # step() cleared; tensors() re-zeroes
    assert train(on, data[3:], 2) == pytest.approx(train(fold, data[3:], 2), rel=5e-3)


def test_fp32_weight_gradients_follow_a_replaced_grad():
    """If something replaces a weight's fp32 .grad between micro-batches (a clone, a loaded state),
    the next micro-batch accumulates into the new tensor, not the old one."""
    on = engine_for(small_cfg("engine.wgrad_fp32=enabled"))
    fold = engine_for(small_cfg())
    data = batches(on.cfg, 2, seed=6)
    for e in (on, fold):
        e.forward_backward(data[0], sync=True)
    _, master = on.weight_cache.accumulated[0]
    master.grad = master.grad.clone()
    for e in (on, fold):
        e.forward_backward(data[1], sync=True)
    ref = dict(fold.model.named_parameters())
    for name, p in on.model.named_parameters():
        scale = float(ref[name].grad.abs().max())
        torch.testing.assert_close(p.grad, ref[name].grad, rtol=0, atol=2e-2 * scale, msg=name)


def test_setup_is_the_engines_one_entry():
    """weight_cache.setup decides and wires the feature: nothing for an fp32 run; the cache and its
    forward under bf16; for grad_sync=during_backward a reducer whose early gradients are the
    GEMM-written fp32 ones, each written once (the tied embedding / head weight has two writers)."""
    cfg = small_cfg("engine.wgrad_fp32=enabled")
    model = GPT(cfg.model)
    assert setup(model, cfg, DistInfo(), None, None, None) == (None, None, None)
    cache, forward, reducer = setup(model, cfg, DistInfo(), torch.bfloat16, None, None)
    assert isinstance(cache, WeightCache) and callable(forward) and reducer is None
    cache, _, reducer = setup(model, cfg, DistInfo(), torch.bfloat16, "during_backward", None)
    tied = model.lm_head.weight
    assert [n for n, _ in cache.accumulated][0] == "wte.main_grad"
    assert len(reducer.early) == len(cache.accumulated) - 2 and all(p is not tied for p in reducer.early)
    _, _, reducer = setup(model, cfg, DistInfo(), None, "during_backward", None)
    assert reducer.early == []  # no cache: every gradient is summed after the backward
