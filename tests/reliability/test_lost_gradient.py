"""The attention's backward must run: after the first step's backward every attention layer's q/k/v weight
holds a gradient (training/gradient_check.py), else the run stops before the optimizer step with one
line (exit 3). A backward that never ran is injected with FLASHGPT_FAULT=lost_grad (the attention output
reaches its projection detached, as a gradient lost in a compiled graph leaves it)."""
import subprocess

import pytest
import torch
from train_runner import REPO, env, fit, train_cmd

from model.config import GPTConfig
from model.gpt import GPT
from training.gradient_check import GradientLostError, attention_weights_without_gradient
from training.resilience import faults

NAMES = ["blocks.0.attn.qkv.weight", "blocks.1.attn.qkv.weight"]


@pytest.fixture(autouse=True)
def _fault_plan_restored(monkeypatch):
    """The fault plan parsed here (a module-level cache) is put back after each test."""
    monkeypatch.setattr(faults, "_parsed", faults._parsed)


def _model():
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, d_model=32, n_head=4, vocab_size=53, seq_len=9, attention="reference"))


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 53, (3, 9), generator=g), torch.randint(0, 53, (3, 9), generator=g)


def test_every_layer_has_a_gradient_after_a_backward():
    model = _model()
    assert attention_weights_without_gradient(model) == NAMES  # no backward yet: none has one
    model(*_batch()).backward()
    assert attention_weights_without_gradient(model) == []
    model.blocks[1].attn.qkv.weight.grad.zero_()  # a gradient buffer the backward never wrote (main_grad)
    assert attention_weights_without_gradient(model) == NAMES[1:]


def test_a_detached_attention_output_is_found(monkeypatch):
    monkeypatch.setenv("FLASHGPT_FAULT", "lost_grad:1")
    model = _model()
    faults.install(model, lambda: 1, 0)
    loss = model(*_batch())
    loss.backward()  # the loss still has a gradient path (MLP, embeddings): only the attention lost it
    assert torch.isfinite(loss) and model.blocks[0].mlp.fc.weight.grad.abs().sum() > 0
    assert attention_weights_without_gradient(model) == NAMES


def test_training_stops_before_the_first_update(tmp_path, cache_dir, monkeypatch):
    with pytest.raises(GradientLostError, match=r"blocks\.0\.attn\.qkv\.weight, blocks\.1\.attn\.qkv\.weight "
                                                r"is zero in every element.*before the optimizer step"):
        fit(tmp_path, cache_dir, "lost", fault="lost_grad:1", monkeypatch=monkeypatch)
    assert (tmp_path / "lost" / "metrics.jsonl").read_text().strip() == ""  # no step was logged


def test_the_launcher_prints_one_line_and_exits_3(tmp_path, cache_dir):
    cmd = train_cmd(tmp_path, cache_dir, "train.max_steps=2", "train.run_name=lost")
    proc = subprocess.run(cmd, cwd=REPO, env={**env(), "FLASHGPT_FAULT": "lost_grad:1"}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "training stopped: the first step's gradient of blocks.0.attn.qkv.weight" in proc.stderr
    assert "Traceback" not in proc.stderr
