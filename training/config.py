"""Typed run configuration: OmegaConf schema, YAML merge, CLI overrides, validation.

A run's config is built as  schema defaults <- configs/base.yaml <- configs/NAME.yaml <- key=value
overrides, then checked once by `validate`. Any problem raises `ConfigError` with one message that
names the key and the fix. The resolved config is saved with every run (`save_resolved`).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from model.attention import window_refusal
from model.config import GPTConfig

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
BASE_CONFIG = "base.yaml"


class ConfigError(ValueError):
    """A bad configuration, with one message naming the problem and the fix."""


@dataclass
class DataConfig:
    source: List[str] = field(default_factory=lambda: ["data/corpus"])  # files, folders or a hub name
    format: str = "auto"  # auto | text | json | parquet
    text_field: str = "text"  # column holding the text (json/parquet)
    tokenizer: str = "train"  # train (byte-level BPE on the corpus) | path to tokenizer.json
    tokenizer_vocab_size: int = 4096  # vocab size when training the tokenizer
    cache_dir: str = ".cache/data"  # token shards, keyed by a hash of source + tokenizer
    val_fraction: float = 0.05  # share of documents held out for evaluation
    num_proc: int = 2  # tokenizer worker processes
    num_workers: int = 1  # loader prefetch threads (0 = none)
    doc_boundaries: bool = False  # hand document offsets (cu_seqlens) to the model (varlen attention)


@dataclass
class OptimConfig:
    lr: float = 6e-4  # peak learning rate
    min_lr: float = 6e-5  # floor of the cosine decay
    warmup_steps: int = 10  # linear warm-up, in optimizer steps
    decay_steps: Optional[int] = None  # cosine length; None = train.max_steps
    weight_decay: float = 0.1  # on 2-D weights only
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global L2 norm; 0 disables
    fused: str = "auto"  # auto (fused AdamW on CUDA) | true | false


@dataclass
class EngineConfig:
    type: str = "torch"  # torch | deepspeed
    parallel: str = "ddp"  # ddp | fsdp (torch engine with >1 process)
    zero_stage: int = 0  # DeepSpeed ZeRO stage 0..3
    ds_optimizer: str = "ours"  # DeepSpeed: ours (torch AdamW, fused on CUDA) | deepspeed (its FusedAdam)
    overlap_comm: bool = True  # DeepSpeed ZeRO: overlap gradient reduction with the backward pass
    bucket_mb: int = 200  # DeepSpeed ZeRO / DDP: gradient bucket size, MB
    backend: str = "auto"  # process-group backend: auto (nccl on CUDA, gloo on CPU) | nccl | gloo
    # torch engine with autocast, one process or engine.grad_sync=after/during_backward: cast the matmul weights
    # to bf16 once per optimizer step, not once per micro-batch (training/engines/weight_cache.py) | disabled
    weight_cache: str = "auto"
    # with the weight cache: the weight-gradient GEMMs add their fp32 result straight into the fp32
    # .grad (kernels/wgrad.py) instead of writing a bf16 gradient for a second kernel to add | auto (on
    # CUDA where our extension loads) | enabled (also on CPU, slowly: for tests) | disabled
    wgrad_fp32: str = "auto"
    # torch engine on several ranks (engine.parallel=ddp): how gradients are averaged | ddp (torch DDP,
    # reduced during the backward; no weight cache) | after_backward (summed after the last micro-batch:
    # the weight cache and fp32 weight gradients stay on; training/engines/grad_allreduce.py) | during_backward
    # (as after_backward, but each fp32 weight gradient's all-reduce starts as soon as its GEMM wrote it
    # in the last micro-batch: +0.9% per GPU on 2 H100s, bench/RESULTS.md) | auto
    # (during_backward on one node when the weight cache applies, else ddp)
    grad_sync: str = "auto"
    # context parallelism: each window's tokens split over C consecutive ranks (Ulysses all-to-all over
    # heads, training/context_parallel/); data parallel over world_size / C groups. 1 = off
    context_parallel_size: int = 1


@dataclass
class LoggingConfig:
    wandb: str = "offline"  # offline | online | disabled
    project: str = "flashgpt"  # W&B project
    log_interval: int = 1  # steps between log lines
    progress: bool = True  # console progress bar
    jsonl: bool = True  # metrics.jsonl in the run folder
    group: str = ""  # W&B run group (runs compared side by side); "" = none
    tags: List[str] = field(default_factory=list)  # W&B run tags, 1 to 64 characters each
    # logged train steps left out of the steady/* medians of the run's summary (they include compilation)
    summary_warmup_steps: int = 3


@dataclass
class TrainConfig:
    run_name: str = "run"  # run folder name under out_dir
    out_dir: str = "runs"  # parent of run folders
    seed: int = 1337
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto (bf16 autocast on CUDA, fp32 on CPU) | bf16 | fp32
    max_steps: int = 100  # optimizer steps
    global_batch_size: int = 8  # sequences per optimizer step, all ranks together
    micro_batch_size: int = 4  # sequences per forward pass, per rank
    eval_interval: int = 50  # steps between evaluations (0 = never)
    eval_steps: int = 4  # micro-batches per evaluation
    ckpt_interval: int = 50  # steps between checkpoints (0 = only at the end)
    save_final: bool = True  # checkpoint when the run ends (benchmarks turn it off)
    profile_step: int = 0  # profile this optimizer step: Chrome trace + attention/matmul time shares
    keep_last: int = 3  # checkpoints kept
    resume: str = "auto"  # auto | none | path to a checkpoint folder
    # a checkpoint folder without manifest.json (nothing to verify it against) is refused unless true
    resume_unverified: bool = False
    # a fresh run (resume=none, or auto finding nothing usable) into a run folder that holds checkpoints
    # stops unless true; then the old checkpoints are moved aside to checkpoints-replaced-<UTC time>/
    overwrite: bool = False
    # seconds without a finished step, evaluation or checkpoint save before every rank dumps its Python
    # stack and the job ends (exit 4) naming the stuck rank; the first step of a session gets 4x (it
    # includes torch.compile and communicator set-up); several ranks only (training/resilience/watchdog.py); 0 = never
    hang_timeout_s: float = 300.0
    # bit-identical GPU runs: our deterministic attention backward, torch's deterministic algorithms,
    # a fixed cuBLAS workspace (costs throughput; bench/RESULTS.md)
    deterministic: bool = False
    compile: bool = False  # torch.compile the model (per block under FSDP2; DeepSpeed's engine.compile)
    # TorchInductor settings for that compile, by torch/_inductor/config.py's names (training/compile/options.py)
    compile_options: Dict[str, Any] = field(default_factory=dict)
    # Row reductions (the LayerNorm forward) up to this many elements kept in registers by the compile
    # (training/compile/persistent_rows.py; inductor's own limit is 1024); 0 = inductor decides
    compile_persistent_rows: int = 0
    stop_after: Optional[int] = None  # leave after this many steps this session (tests, pre-emption drills)
    # A non-finite loss or gradient norm, caught before the optimizer step: skip (drop that update, keep
    # the step count and data order, log skipped_steps; stop after max_skipped in a row) | stop (raise,
    # naming the step and the batch's place in the data)
    nonfinite: str = "skip"
    max_skipped: int = 10  # with nonfinite=skip: consecutive skipped steps before the run stops


@dataclass
class Config:
    model: GPTConfig = field(default_factory=GPTConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.train.out_dir) / self.train.run_name


def find_config_file(name: str) -> Path:
    """`name` as a path, else under configs/ (with or without .yaml)."""
    candidates = [Path(name), CONFIG_DIR / name, CONFIG_DIR / f"{name}.yaml"]
    for path in candidates:
        if path.is_file():
            return path
    known = ", ".join(sorted(p.name for p in CONFIG_DIR.glob("*.yaml") if p.name != BASE_CONFIG))
    raise ConfigError(f"config file '{name}' not found (looked in . and {CONFIG_DIR}); known: {known}")


def _listify(schema: DictConfig, other: Any) -> None:
    """A plain string where the schema holds a list is a one-element list (data.source=some/folder)."""
    if not isinstance(other, DictConfig):
        return
    for key in list(other.keys()):
        if key not in schema or OmegaConf.is_interpolation(other, key):
            continue
        want, got = schema.get(key), other.get(key)
        if isinstance(want, ListConfig) and isinstance(got, str):
            other[key] = [got]
        elif isinstance(want, DictConfig):
            _listify(want, got)


def _merge(schema: DictConfig, other: Any, what: str) -> DictConfig:
    _listify(schema, other)
    try:
        return OmegaConf.merge(schema, other)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        msg = str(e).splitlines()[0]
        raise ConfigError(f"{what}: bad key '{key}': {msg}. Check the spelling and type against "
                          f"training/config.py") from None


def zero3_partitions_modules(cfg: "Config") -> bool:
    """DeepSpeed ZeRO-3: parameters exist only inside their own module's forward (so model.mlp=auto
    means the torch MLP there, see training/trainer.py)."""
    return cfg.engine.type == "deepspeed" and cfg.engine.zero_stage == 3


def load_config(name: Optional[str] = None, overrides: Optional[List[str]] = None) -> Config:
    """Schema <- base.yaml <- NAME.yaml <- overrides; validated; returned as a typed Config."""
    cfg = OmegaConf.structured(Config)
    base = CONFIG_DIR / BASE_CONFIG
    if base.is_file():
        cfg = _merge(cfg, OmegaConf.load(base), str(base))
    if name:
        path = find_config_file(name)
        try:
            loaded = OmegaConf.load(path)
        except Exception as e:  # YAML syntax errors
            raise ConfigError(f"{path}: cannot parse YAML: {e}") from None
        cfg = _merge(cfg, loaded, str(path))
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not key=value (e.g. train.max_steps=10)")
        try:
            dotlist = OmegaConf.from_dotlist([item])
        except Exception as e:
            raise ConfigError(f"override '{item}': {e}") from None
        cfg = _merge(cfg, dotlist, f"override '{item}'")
    config: Config = OmegaConf.to_object(cfg)
    validate(config)
    return config


def _choice(value: str, allowed: tuple, key: str) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}='{value}' is not one of {', '.join(allowed)}")


def _check_tags(tags: Any) -> None:
    """W&B run tags: a list of strings of 1 to 64 characters (wandb.init refuses others)."""
    if not isinstance(tags, (list, tuple, ListConfig)):
        raise ConfigError(f"logging.tags={tags!r} is not a list; write logging.tags=[a,b]")
    for tag in tags:
        if not isinstance(tag, str) or not 1 <= len(tag) <= 64:
            raise ConfigError(f"logging.tags: {tag!r} is not a tag; each tag is a string of 1 to 64 "
                              f"characters, e.g. logging.tags=[1.3b,8k,flash]")


def validate(cfg: Config, world_size: Optional[int] = None) -> None:
    """Check shapes and cross-field consistency; raise ConfigError naming the key and the fix.
    world_size: the number of ranks when known (launch/train.py), None before (load_config)."""
    m, t, o = cfg.model, cfg.train, cfg.optim
    for key, value in [("model.n_layer", m.n_layer), ("model.d_model", m.d_model),
                       ("model.n_head", m.n_head), ("model.vocab_size", m.vocab_size),
                       ("model.seq_len", m.seq_len), ("model.mlp_ratio", m.mlp_ratio),
                       ("train.max_steps", t.max_steps), ("train.global_batch_size", t.global_batch_size),
                       ("train.micro_batch_size", t.micro_batch_size), ("train.keep_last", t.keep_last),
                       ("logging.log_interval", cfg.logging.log_interval)]:
        if value <= 0:
            raise ConfigError(f"{key}={value} must be positive")
    if m.d_model % m.n_head:
        raise ConfigError(f"model.d_model={m.d_model} is not divisible by model.n_head={m.n_head}; "
                          f"pick n_head dividing d_model (head_dim = d_model / n_head)")
    kv = m.n_kv_head or m.n_head
    if kv <= 0 or m.n_head % kv:
        raise ConfigError(f"model.n_kv_head={m.n_kv_head} must divide model.n_head={m.n_head}")
    head_dim = m.d_model // m.n_head
    if m.pos_emb == "rope" and head_dim % 2:
        raise ConfigError(f"pos_emb=rope needs an even head_dim, got {head_dim}")
    _choice(m.pos_emb, ("learned", "rope"), "model.pos_emb")
    _choice(m.residual, ("fp32", "autocast"), "model.residual")
    _choice(m.attention, ("auto", "flash", "sdpa", "sdpa_flash", "sdpa_cudnn", "math", "reference"),
            "model.attention")
    if cfg.data.doc_boundaries and m.attention in ("sdpa_flash", "sdpa_cudnn"):
        raise ConfigError(f"model.attention={m.attention} does not take data.doc_boundaries (that SDPA backend "
                          f"has no document mask); use model.attention=sdpa, math or auto, or doc_boundaries=false")
    # a window >= model.seq_len is allowed: every token then sees all before it, the same as dense
    if m.attention_window < 0:
        raise ConfigError(f"model.attention_window={m.attention_window} must be >= 0 (tokens a local layer "
                          f"sees, itself included; 0 = every layer dense)")
    _choice(m.attention_window_layers, ("odd", "even", "all"), "model.attention_window_layers")
    if window_refusal(m.attention, m.attention_window):
        raise ConfigError(window_refusal(m.attention, m.attention_window))
    _choice(m.mlp, ("auto", "fused", "torch"), "model.mlp")
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"model.dropout={m.dropout} must be in [0, 1)")
    if m.fused_add_norm and not m.norm_saves_output:
        raise ConfigError("model.fused_add_norm=true needs model.norm_saves_output=true (the fused op is the "
                          "output-keeping LayerNorm's): set both, or model.fused_add_norm=false")
    if m.recompute_gelu_layers < -1:
        raise ConfigError(f"model.recompute_gelu_layers={m.recompute_gelu_layers}: give how many blocks (the first "
                          f"ones) rebuild their GELU output, 0 to {m.n_layer}, or -1 for all")
    _choice(cfg.data.format, ("auto", "text", "json", "parquet"), "data.format")
    if not 0.0 < cfg.data.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction={cfg.data.val_fraction} must be in (0, 1)")
    if cfg.data.tokenizer == "train" and cfg.data.tokenizer_vocab_size > m.vocab_size:
        raise ConfigError(f"data.tokenizer_vocab_size={cfg.data.tokenizer_vocab_size} exceeds "
                          f"model.vocab_size={m.vocab_size}; raise model.vocab_size or lower the tokenizer's")
    if not cfg.data.source:
        raise ConfigError("data.source is empty: name at least one file, folder or dataset")
    # `optim.fused=true` on the command line (or `fused: true` in YAML) arrives as a bool, which
    # OmegaConf stores in this string field as 'True': accept it as the word the user wrote.
    if o.fused in ("True", "False"):
        o.fused = o.fused.lower()
    _choice(o.fused, ("auto", "true", "false"), "optim.fused")
    if o.lr <= 0 or o.min_lr < 0 or o.min_lr > o.lr:
        raise ConfigError(f"optim.lr={o.lr} / optim.min_lr={o.min_lr}: need 0 <= min_lr <= lr, lr > 0")
    if o.warmup_steps < 0 or o.grad_clip < 0:
        raise ConfigError("optim.warmup_steps and optim.grad_clip must be >= 0")
    _choice(cfg.engine.type, ("torch", "deepspeed"), "engine.type")
    _choice(cfg.engine.parallel, ("ddp", "fsdp"), "engine.parallel")
    _choice(cfg.engine.backend, ("auto", "nccl", "gloo"), "engine.backend")
    _choice(cfg.engine.weight_cache, ("auto", "disabled"), "engine.weight_cache")
    _choice(cfg.engine.wgrad_fp32, ("auto", "enabled", "disabled"), "engine.wgrad_fp32")
    _choice(cfg.engine.grad_sync, ("auto", "ddp", "after_backward", "during_backward"), "engine.grad_sync")
    _choice(cfg.engine.ds_optimizer, ("ours", "deepspeed"), "engine.ds_optimizer")
    if cfg.engine.bucket_mb <= 0:
        raise ConfigError(f"engine.bucket_mb={cfg.engine.bucket_mb} must be positive")
    if cfg.engine.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"engine.zero_stage={cfg.engine.zero_stage} must be 0, 1, 2 or 3")
    if zero3_partitions_modules(cfg) and m.mlp == "fused":
        raise ConfigError("model.mlp=fused cannot run under DeepSpeed ZeRO-3 (it gathers a module's weights "
                          "only around that module's own forward, which the fused MLP does not call); use "
                          "model.mlp=auto (the torch MLP there) or torch")
    check_context_parallel(cfg, world_size)
    _choice(cfg.logging.wandb, ("offline", "online", "disabled"), "logging.wandb")
    _check_tags(cfg.logging.tags)
    if cfg.logging.summary_warmup_steps < 0:
        raise ConfigError(f"logging.summary_warmup_steps={cfg.logging.summary_warmup_steps} must be >= 0")
    _choice(t.device, ("auto", "cpu", "cuda"), "train.device")
    _choice(t.dtype, ("auto", "bf16", "fp32"), "train.dtype")
    data_ranks = max((world_size or 1) // cfg.engine.context_parallel_size, 1)
    per_step = t.micro_batch_size * data_ranks
    if t.global_batch_size % per_step:
        ranks = (f"ranks ({world_size or 1})" if data_ranks == (world_size or 1) else
                 f"data-parallel ranks ({world_size} / engine.context_parallel_size)")
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} is not divisible by micro_batch_size "
            f"({t.micro_batch_size}) x {ranks} = {per_step}; set global_batch_size to a "
            f"multiple of {per_step}")
    _choice(t.nonfinite, ("skip", "stop"), "train.nonfinite")
    if t.max_skipped <= 0:
        raise ConfigError(f"train.max_skipped={t.max_skipped} must be positive")
    if t.compile_persistent_rows < 0:
        raise ConfigError(f"train.compile_persistent_rows={t.compile_persistent_rows} must be >= 0 (0 = inductor decides)")
    if t.hang_timeout_s < 0:
        raise ConfigError(f"train.hang_timeout_s={t.hang_timeout_s} must be >= 0 (0 = never)")
    if t.profile_step < 0:
        raise ConfigError(f"train.profile_step={t.profile_step} must be >= 0 (0 = no profiling)")
    if t.eval_interval < 0 or t.ckpt_interval < 0 or t.eval_steps < 0:
        raise ConfigError("train.eval_interval, train.eval_steps and train.ckpt_interval must be >= 0")


def check_context_parallel(cfg: Config, world_size: Optional[int]) -> None:
    """engine.context_parallel_size=C: a window's T tokens as C slices of T/C on C consecutive ranks,
    whose attention exchanges heads by all-to-all (each rank then holds H/C heads of the whole window).
    world_size None (not known yet): the checks that need it wait for the launch."""
    C, m = cfg.engine.context_parallel_size, cfg.model
    if C < 1:
        raise ConfigError(f"engine.context_parallel_size={C} must be >= 1 (1 = no context parallelism)")
    if C == 1:
        return
    if world_size is not None and world_size > 1 and world_size % C:
        raise ConfigError(f"engine.context_parallel_size={C} does not divide the {world_size} ranks; launch a "
                          f"multiple of {C} processes or pick a context_parallel_size dividing {world_size}")
    if world_size == 1:  # torchrun gives WORLD_SIZE; a plain `python launch/train.py` is 1
        raise ConfigError(f"engine.context_parallel_size={C} needs {C} ranks (one per slice of the window) but "
                          f"this is a single process; launch with torchrun --nproc_per_node={C} (or a multiple)")
    kv = m.n_kv_head or m.n_head
    if m.n_head % C or kv % C:
        raise ConfigError(f"engine.context_parallel_size={C} does not divide model.n_head={m.n_head}"
                          f"{'' if kv == m.n_head else f' and model.n_kv_head={kv}'} (each rank attends with "
                          f"heads / C of them); pick a context_parallel_size dividing the head count(s)")
    if m.seq_len % C:
        raise ConfigError(f"engine.context_parallel_size={C} does not divide model.seq_len={m.seq_len} (each rank "
                          f"holds seq_len / C tokens of a window); pick a seq_len that is a multiple of {C}")


def grad_accum_steps(cfg: Config, world_size: int) -> int:
    """Micro-batches per rank per optimizer step. The ranks of a context group share their
    micro-batches, so the batch divides over world_size / engine.context_parallel_size ranks."""
    data_ranks = max(world_size // cfg.engine.context_parallel_size, 1)
    return cfg.train.global_batch_size // (cfg.train.micro_batch_size * data_ranks)


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def save_resolved(cfg: Config, path: os.PathLike) -> None:
    """Write the resolved config as YAML (atomically) so a run can be reproduced from its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    os.replace(tmp, path)


def from_dict(d: dict) -> Config:
    """Rebuild a Config from `to_dict` output (checkpoints store that)."""
    return OmegaConf.to_object(_merge(OmegaConf.structured(Config), OmegaConf.create(d), "checkpoint config"))
