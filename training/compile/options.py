"""train.compile_options: TorchInductor settings for the model's torch.compile, from the config.

    train:
      compile: true
      compile_options:                  # names as in torch/_inductor/config.py
        triton.mix_order_reduction_autotune_split_size: true

On the command line `train.compile_options.triton.enable_pdl=true` nests (OmegaConf splits the dots);
both forms mean the same dotted name. The options go to torch.compile(options=...) (scoped to our model's
graphs, not process-wide) in every engine: the one-process / DDP engine, FSDP2's per-block compile and
DeepSpeed's engine.compile. An unknown name or a value of the wrong type is a ConfigError naming it.

`prepare_compile(cfg.train)` is what each engine runs before its compile: training/compile/inductor_barrier.py's
fix, training/compile/persistent_rows.py's rule (train.compile_persistent_rows; with it active the compile runs
without triton.multi_kernel, whose timed pick the rule replaces), and these options.
"""
from __future__ import annotations

from typing import Any, Mapping

from training.config import ConfigError


def _flatten(options: Mapping, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in options.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def inductor_options(options: Mapping | None) -> dict[str, Any]:
    """The config's compile options as torch.compile's `options` dict (dotted names), checked against
    this torch's TorchInductor settings."""
    flat = _flatten(options or {})
    if not flat:
        return {}
    import torch
    import torch._inductor.config as inductor_config

    known = inductor_config.get_config_copy()
    for name, value in flat.items():
        if name not in known:
            close = sorted(k for k in known if name.rsplit(".", 1)[-1] in k)[:3]
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ConfigError(f"train.compile_options.{name} is not a TorchInductor setting in torch "
                              f"{torch.__version__}{hint}; the names are those of torch/_inductor/config.py")
        default = known[name]
        if isinstance(default, bool) and not isinstance(value, bool):
            raise ConfigError(f"train.compile_options.{name}={value!r} must be true or false")
        if isinstance(default, (int, float)) and not isinstance(default, bool) and (
                isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ConfigError(f"train.compile_options.{name}={value!r} must be a number (default {default!r})")
    return flat


def prepare_compile(train) -> dict[str, Any]:
    """Before an engine's torch.compile (train = cfg.train, with compile on): install the inductor
    barrier, the bounded fallback message and the persistent-rows rule; return torch.compile's options."""
    from training.compile import inductor_fallback_log, persistent_rows
    from training.compile.inductor_barrier import install as install_inductor_barrier

    install_inductor_barrier()  # a race in inductor's LayerNorm kernels (training/compile/inductor_barrier.py)
    inductor_fallback_log.install()  # a compile that never ends on deep graphs (inductor_fallback_log.py)
    options = inductor_options(train.compile_options)
    persistent_rows.install(train.compile_persistent_rows)  # a torch without the hook leaves no limit
    if persistent_rows.current_limit():
        options["triton.multi_kernel"] = 0  # the rule chooses the persistent rows, not a timed pick
    elif options.get("triton.multi_kernel"):
        import logging

        logging.getLogger(__name__).warning(
            "train.compile_options.triton.multi_kernel: in torch 2.11 its generated code failed to load from "
            "TorchInductor's FX graph cache (a second run on the same machine stopped at compile); "
            "train.compile_persistent_rows makes the LayerNorm rows persistent without it "
            "(training/compile/persistent_rows.py)")
    return options
