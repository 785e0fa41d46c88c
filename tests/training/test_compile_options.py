"""train.compile_options (training/compile/options.py): the config's TorchInductor settings reach every
torch.compile of the model, by their dotted names, and a wrong name or value is one clear error."""
from __future__ import annotations

import pytest
import torch

from model.gpt import GPT
from training.compile.options import inductor_options
from training.config import ConfigError, load_config
from training.distributed import DistInfo
from training.engines.replicas import TorchEngine

TINY = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.vocab_size=64", "model.seq_len=8",
        "data.tokenizer_vocab_size=64", "train.global_batch_size=2", "train.micro_batch_size=2"]


def test_nested_and_dotted_names_are_the_same_option():
    nested = load_config("tiny_cpu.yaml", ["train.compile_options.triton.enable_pdl=true",
                                           "train.compile_options.max_autotune=false"])
    assert inductor_options(nested.train.compile_options) == {"triton.enable_pdl": True, "max_autotune": False}
    assert inductor_options({"triton.enable_pdl": True}) == {"triton.enable_pdl": True}
    assert inductor_options({}) == {} and inductor_options(None) == {}


@pytest.mark.parametrize("options,message", [
    ({"triton.enable_pdll": True}, "triton.enable_pdll is not a TorchInductor setting"),
    ({"triton": {"enable_pdl": "yes"}}, "must be true or false"),
    ({"triton.mix_order_reduction_initial_xblock": True}, "must be a number"),
])
def test_a_wrong_option_is_a_config_error(options, message):
    with pytest.raises(ConfigError, match=message):
        inductor_options(options)


def test_the_engine_compiles_with_the_options(monkeypatch):
    """Both of the one-process engine's compiles (the model, and the weight cache's functional forward)
    get the config's options; without options torch.compile gets none."""
    calls = []

    def fake_compile(fn, **kwargs):
        calls.append(kwargs)
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    cfg = load_config("tiny_cpu.yaml", [*TINY, "train.compile=true", "train.dtype=bf16",
                                        "train.compile_options.triton.mix_order_reduction_autotune_split_size=true"])
    engine = TorchEngine(GPT(cfg.model), cfg, DistInfo())
    assert engine.compiled and len(calls) == 1 + (engine.weight_cache is not None)
    assert all(c["options"] == {"triton.mix_order_reduction_autotune_split_size": True} for c in calls)
    calls.clear()
    TorchEngine(GPT(cfg.model), load_config("tiny_cpu.yaml", [*TINY, "train.compile=true"]), DistInfo())
    assert calls and all(c["options"] is None for c in calls)


def test_persistent_rows_replace_multi_kernel_in_our_compile(monkeypatch):
    """train.compile_persistent_rows installs training/compile/persistent_rows.py's rule (process-wide; 0 turns
    it off again) and the compile then runs without triton.multi_kernel; without it the config's options
    pass unchanged."""
    from training.compile import persistent_rows

    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: calls.append(kw) or fn)
    monkeypatch.setattr(persistent_rows, "_limit", 0)
    cfg = load_config("tiny_cpu.yaml", [*TINY, "train.compile=true", "train.compile_persistent_rows=4096",
                                        "train.compile_options.triton.multi_kernel=1"])
    TorchEngine(GPT(cfg.model), cfg, DistInfo())
    assert calls and all(c["options"] == {"triton.multi_kernel": 0} for c in calls)
    assert persistent_rows.current_limit() == 4096
    from torch._inductor.choices import InductorChoices

    assert InductorChoices.should_use_persistent_reduction.__module__ == "training.compile.persistent_rows"
    persistent_rows.install(0)  # a later compile without the setting: inductor's own choice again
    assert persistent_rows.current_limit() == 0
    calls.clear()
    cfg = load_config("tiny_cpu.yaml", [*TINY, "train.compile=true", "train.compile_options.triton.multi_kernel=1"])
    TorchEngine(GPT(cfg.model), cfg, DistInfo())
    assert calls and all(c["options"] == {"triton.multi_kernel": 1} for c in calls)
    assert persistent_rows.current_limit() == 0
    with pytest.raises(ConfigError, match="compile_persistent_rows=-1"):
        load_config("tiny_cpu.yaml", [*TINY, "train.compile_persistent_rows=-1"])
