"""Config: merge order, overrides, and one clear error for every bad input."""
import pytest

from training.config import CONFIG_DIR, ConfigError, grad_accum_steps, load_config, save_resolved, validate

SHIPPED = ["tiny_cpu.yaml", "gpt_125m_2k.yaml", "gpt_1.3b_8k.yaml", "gpt_2.7b_8k.yaml"]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_configs_load(name):
    cfg = load_config(name)
    assert cfg.train.run_name == name.removesuffix(".yaml")
    assert cfg.model.d_model % cfg.model.n_head == 0


def test_merge_order_base_then_file_then_overrides():
    cfg = load_config("tiny_cpu.yaml", ["train.max_steps=7", "optim.lr=0.01", "data.source=[a,b]"])
    assert cfg.train.max_steps == 7 and cfg.optim.lr == 0.01 and cfg.data.source == ["a", "b"]
    assert cfg.optim.beta2 == 0.95  # from base.yaml
    assert cfg.model.n_layer == 4  # from tiny_cpu.yaml


def test_a_plain_string_for_data_source_is_a_one_element_list(tmp_path):
    assert load_config("tiny_cpu.yaml", ["data.source=some/folder"]).data.source == ["some/folder"]
    assert load_config("tiny_cpu.yaml", ["data.source=/x/a.jsonl"]).data.source == ["/x/a.jsonl"]
    p = tmp_path / "mine.yaml"
    p.write_text("data:\n  source: my/folder\n")
    assert load_config(str(p)).data.source == ["my/folder"]
    assert load_config(str(p), ["data.source=[a,b]"]).data.source == ["a", "b"]


def test_config_by_name_without_suffix_and_by_path(tmp_path):
    assert load_config("tiny_cpu").model.n_layer == 4
    p = tmp_path / "mine.yaml"
    p.write_text("model:\n  n_layer: 3\n")
    assert load_config(str(p)).model.n_layer == 3


def test_paper_shapes():
    c13 = load_config("gpt_1.3b_8k.yaml").model
    assert (c13.n_layer, c13.d_model, c13.n_head, c13.seq_len, c13.vocab_size) == (24, 2048, 16, 8192, 50304)
    c27 = load_config("gpt_2.7b_8k.yaml").model
    assert (c27.n_layer, c27.d_model, c27.head_dim, c27.seq_len) == (32, 2560, 128, 8192)
    for name in ("gpt_1.3b_8k.yaml", "gpt_2.7b_8k.yaml"):
        t = load_config(name).train
        tokens = t.global_batch_size * 8192
        assert 0.5e6 <= tokens <= 1.1e6


@pytest.mark.parametrize("overrides, words", [
    (["model.n_layrs=3"], "n_layrs"),  # unknown key
    (["model.n_layer=three"], "n_layer"),  # wrong type
    (["model.d_model=100", "model.n_head=3"], "not divisible"),
    (["model.n_kv_head=3"], "n_kv_head"),
    (["model.pos_emb=alibi"], "model.pos_emb"),
    (["model.attention=xformers"], "model.attention"),
    (["model.mlp=swiglu"], "model.mlp"),
    (["model.residual=bf16"], "model.residual"),
    (["model.fused_add_norm=true"], "norm_saves_output=true"),
    (["model.recompute_gelu_layers=-3"], "or -1 for all"),
    (["model.mlp=fused", "engine.type=deepspeed", "engine.zero_stage=3"], "ZeRO-3"),
    (["train.global_batch_size=10", "train.micro_batch_size=4"], "global_batch_size"),
    (["train.max_steps=0"], "max_steps"),
    (["optim.min_lr=1.0"], "min_lr"),
    (["engine.zero_stage=4"], "zero_stage"),
    (["logging.wandb=sometimes"], "logging.wandb"),
    (["logging.tags=[a,[b]]"], "logging.tags: \\['b'\\] is not a tag"),
    (["logging.tags=[a,'']"], "1 to 64 characters"),
    (["logging.tags=[" + "x" * 65 + "]"], "1 to 64 characters"),
    (["logging.summary_warmup_steps=-1"], "summary_warmup_steps=-1 must be >= 0"),
    (["data.tokenizer_vocab_size=9000"], "model.vocab_size"),
    (["data.val_fraction=0"], "val_fraction"),
    (["max_steps"], "key=value"),
])
def test_bad_config_one_clear_error(overrides, words):
    with pytest.raises(ConfigError, match=words):
        load_config("tiny_cpu.yaml", overrides)


def test_wandb_group_and_tags_overrides():
    cfg = load_config("tiny_cpu.yaml", ["logging.group=paper", "logging.tags=[1.3b,8k,flash]"])
    assert cfg.logging.group == "paper" and cfg.logging.tags == ["1.3b", "8k", "flash"]
    assert load_config("tiny_cpu.yaml", ["logging.tags=solo"]).logging.tags == ["solo"]
    default = load_config("tiny_cpu.yaml")
    assert default.logging.group == "" and default.logging.tags == [] and default.logging.summary_warmup_steps == 3


def test_missing_config_file_lists_known():
    with pytest.raises(ConfigError, match="tiny_cpu.yaml"):
        load_config("no_such_config.yaml")


def test_unknown_key_in_yaml_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("train:\n  max_stepz: 3\n")
    with pytest.raises(ConfigError, match="max_stepz"):
        load_config(str(p))


def test_batch_must_divide_across_ranks():
    cfg = load_config("tiny_cpu.yaml", ["train.global_batch_size=24", "train.micro_batch_size=8"])
    validate(cfg, world_size=3)
    assert grad_accum_steps(cfg, 3) == 1
    with pytest.raises(ConfigError, match="ranks"):
        validate(cfg, world_size=2)


def test_resolved_config_round_trip(tmp_path):
    cfg = load_config("tiny_cpu.yaml", ["train.max_steps=9"])
    save_resolved(cfg, tmp_path / "config.yaml")
    again = load_config(str(tmp_path / "config.yaml"))
    assert again == cfg


def test_base_yaml_is_not_listed_as_a_config():
    assert (CONFIG_DIR / "base.yaml").is_file()


@pytest.mark.parametrize("word, want", [("true", "true"), ("false", "false"), ("auto", "auto"), ("True", "true")])
def test_fused_accepts_the_words_it_lists(word, want):
    """`optim.fused=true` is parsed as a bool by OmegaConf; it is accepted as the word 'true', not
    rejected as 'True', not one of auto, true, false."""
    assert load_config("tiny_cpu.yaml", [f"optim.fused={word}"]).optim.fused == want
    with pytest.raises(ConfigError, match="optim.fused"):
        load_config("tiny_cpu.yaml", ["optim.fused=sometimes"])


def test_zero3_is_where_modules_own_their_weights_only():
    """Under DeepSpeed ZeRO-3 model.mlp=auto builds the torch MLP (training/trainer.py): the fused MLP
    reads fc / proj weights without calling those modules, whose weights ZeRO-3 gathers."""
    from training.config import zero3_partitions_modules

    assert zero3_partitions_modules(load_config("tiny_cpu.yaml", ["engine.type=deepspeed", "engine.zero_stage=3"]))
    assert not zero3_partitions_modules(load_config("tiny_cpu.yaml", ["engine.type=deepspeed", "engine.zero_stage=2"]))
    assert not zero3_partitions_modules(load_config("tiny_cpu.yaml", ["engine.zero_stage=3"]))  # torch engine
