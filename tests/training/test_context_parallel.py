"""Context parallelism (engine.context_parallel_size=C) on CPU under 2-process torchrun (gloo): C=2 trains
the loss curve of C=1 on one process with the same global batch (learned positions, RoPE, documents
packed with data.doc_boundaries; DDP, our after_backward sum, FSDP2, DeepSpeed ZeRO-3), resumes
bit for bit at C=2 and continues the curve at C=1 (on 1 rank, and on 2 data-parallel ranks); each
configuration it cannot run is one line, exit 2."""
import json
import shutil
import subprocess

import pytest
import torch
from train_runner import REPO, env, losses, run, train_cmd

from training.config import ConfigError, grad_accum_steps, load_config, validate
from training.engines.deepspeed_config import deepspeed_config

STEPS = ["train.max_steps=6"]
VARIANTS = {
    "learned": [],
    "rope_docs": ["model.pos_emb=rope", "data.doc_boundaries=true"],  # RoPE, and documents packed
}
CP2 = ["engine.context_parallel_size=2"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("data_cache"))


@pytest.fixture(scope="module")
def curves(tmp_path_factory, cache_dir):
    """curves(name, nproc, *overrides) -> ({step: loss}, {step: eval loss}, console output, run folder) of
    an uninterrupted run (each run once per module)."""
    done = {}

    def get(name, nproc, *overrides):
        if name not in done:
            out = tmp_path_factory.mktemp(name)
            proc = run(out, cache_dir, *STEPS, "train.run_name=s", *overrides, nproc=nproc)
            done[name] = (losses(out / "s"), losses(out / "s", "eval/loss"), proc.stdout + proc.stderr, out / "s")
        return done[name]
    return get


def close(curve, ref, rel=1e-4):
    """fp32 on CPU: only the summation order differs (the slices' matmuls, the mean over two halves)."""
    assert sorted(curve) == sorted(ref) and len(ref) >= 4
    for step, loss in ref.items():
        assert curve[step] == pytest.approx(loss, rel=rel), (step, curve, ref)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_two_context_ranks_train_the_single_process_curve(curves, variant):
    one, one_eval, _, one_dir = curves(f"c1_{variant}", 1, *VARIANTS[variant])
    two, two_eval, log, two_dir = curves(f"c2_{variant}", 2, *VARIANTS[variant], *CP2)
    assert "(context 2 x data 1)" in log  # the banner: the run did split its windows
    close(two, one)
    assert one_eval and sorted(two_eval) == sorted(one_eval)
    for step in one_eval:
        assert two_eval[step] == pytest.approx(one_eval[step], rel=1e-4), step
    # each sequence counted once (not once per context rank); per-GPU figures over both GPUs
    assert losses(two_dir, "tokens_seen") == losses(one_dir, "tokens_seen")
    for step, total in losses(two_dir, "tokens_per_s").items():
        assert losses(two_dir, "tokens_per_s_per_gpu")[step] == pytest.approx(total / 2)


@pytest.mark.parametrize("engine", [["engine.grad_sync=after_backward"], ["engine.parallel=fsdp"],
                                    ["engine.type=deepspeed", "engine.zero_stage=3"]],
                         ids=["after_backward", "fsdp", "zero3"])
def test_context_parallel_under_other_engines(curves, engine):
    """Our own gradient sum (engine.grad_sync=after_backward), FSDP2 (parameters sharded over all ranks)
    and DeepSpeed ZeRO-3 (parameters gathered around each module; its data-parallel group is all ranks,
    training/engines/deepspeed_config.py): the C=1 curve."""
    one = curves("c1_learned", 1)[0]
    close(curves("c2_" + "_".join(engine), 2, *engine, *CP2)[0], one)


def test_a_profiled_step_reports_the_all_to_alls(tmp_path, cache_dir):
    """train.profile_step under C=2: the step's communication share (gloo's c10d operators on CPU, NCCL
    kernels on GPUs: the all-to-alls and the gradient sum) is logged, and the all-to-alls are in its top list."""
    run(tmp_path, cache_dir, "train.max_steps=2", "train.run_name=p", "train.profile_step=2",
        "train.eval_interval=0", "train.save_final=false", *CP2, nproc=2)
    step2 = next(r for r in (json.loads(x) for x in (tmp_path / "p" / "metrics.jsonl").read_text().splitlines())
                 if r["step"] == 2)
    assert 0 < step2["time_share_communication"] < 1
    top = (tmp_path / "p" / "profile_step_2.top.txt").read_text()
    assert any("communication" in line and "alltoall" in line for line in top.splitlines())


def test_context_groups_across_nodes_are_named():
    from training.context_parallel.groups import spans_nodes

    assert spans_nodes(4, 8) is None and spans_nodes(2, 2) is None
    assert "span two nodes" in spans_nodes(4, 6) and "6 ranks per node" in spans_nodes(4, 6)


def _stopped_at_3(tmp_path, cache_dir):
    """A C=2 run of the learned variant stopped after step 3 (checkpoint of step 3) in tmp_path/r."""
    run(tmp_path, cache_dir, *STEPS, "train.run_name=r", "train.stop_after=3", *CP2, nproc=2)
    return tmp_path / "r"


def test_resume_at_the_same_context_size_is_bit_identical(tmp_path, cache_dir, curves):
    folder = _stopped_at_3(tmp_path, cache_dir)
    run(tmp_path, cache_dir, *STEPS, "train.run_name=r", *CP2, nproc=2)
    assert losses(folder) == curves("c2_learned", 2, *CP2)[0]


def test_resume_onto_another_context_size(tmp_path, cache_dir, curves):
    """Saved at C=2 x data 1, resumed at C=1 on one rank and at C=1 x data 2 on two ranks: the same
    weights, optimizer state and data order, so the curve goes on as the uninterrupted C=2 run's."""
    folder = _stopped_at_3(tmp_path, cache_dir)
    shutil.copytree(folder, tmp_path / "r2")
    ref = curves("c2_learned", 2, *CP2)[0]
    one = run(tmp_path, cache_dir, *STEPS, "train.run_name=r", nproc=1)
    assert "context_parallel_size=2" in one.stderr
    two = run(tmp_path, cache_dir, *STEPS, "train.run_name=r2", nproc=2)
    assert "context_parallel_size=2" in two.stderr
    for curve in (losses(folder), losses(tmp_path / "r2")):
        close(curve, ref)


@pytest.mark.parametrize("overrides, world, words", [
    (["engine.context_parallel_size=0"], 2, ["context_parallel_size=0", ">= 1"]),
    (["engine.context_parallel_size=2"], 3, ["does not divide the 3 ranks"]),
    (["engine.context_parallel_size=2"], 1, ["needs 2 ranks", "torchrun"]),
    (["engine.context_parallel_size=4", "model.n_head=2", "model.d_model=64"], 4, ["model.n_head=2"]),
    (["engine.context_parallel_size=4", "model.n_head=8", "model.n_kv_head=2"], 4, ["model.n_kv_head=2"]),
    (["engine.context_parallel_size=4", "model.seq_len=66"], 4, ["model.seq_len=66"]),
])
def test_config_errors(overrides, world, words):
    with pytest.raises(ConfigError) as e:  # load_config checks what needs no rank count, validate the rest
        cfg = load_config("tiny_cpu.yaml", ["train.global_batch_size=16", "train.micro_batch_size=4", *overrides])
        validate(cfg, world_size=world)
    assert "\n" not in str(e.value)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_context_parallel_batch_arithmetic():
    """4 ranks at C=2: 2 data-parallel ranks share the global batch (16 = 4 x 2 ranks x 2 accumulations);
    DeepSpeed, whose data-parallel group is all 4 ranks, is told 4 x 4 ranks x 2 = 32."""
    cfg = load_config("tiny_cpu.yaml", ["train.global_batch_size=16", "train.micro_batch_size=4", *CP2])
    validate(cfg, world_size=4)
    assert grad_accum_steps(cfg, 4) == 2
    ds = deepspeed_config(cfg, 4, torch.device("cpu"))  # DeepSpeed counts each sequence once per context rank
    assert ds["train_batch_size"] == 32 and ds["gradient_accumulation_steps"] == 2
    with pytest.raises(ConfigError, match="data-parallel ranks"):
        validate(load_config("tiny_cpu.yaml", ["train.global_batch_size=12", "train.micro_batch_size=4", *CP2]),
                 world_size=8)


def test_out_of_memory_suggests_a_larger_context_group():
    """On 4 GPUs at C=2 a larger context group (C=4) halves each GPU's activations; at C=4 there is none."""
    from training.resilience.out_of_memory import memory_options

    two = load_config("gpt_1.3b_32k.yaml", ["engine.context_parallel_size=2"])
    assert any(o.startswith("engine.context_parallel_size=4 (now 2") for o in memory_options(two, 4))
    four = load_config("gpt_1.3b_32k.yaml")
    assert not any("context_parallel_size" in o for o in memory_options(four, 4))


@pytest.mark.parametrize("nproc, cp, words", [(1, 2, "needs 2 ranks"), (2, 4, "does not divide the 2 ranks")])
def test_launch_prints_one_line(tmp_path, cache_dir, nproc, cp, words):
    """One config-error line (rank 0's under torchrun), every rank exiting 2, no traceback of ours."""
    cmd = train_cmd(tmp_path, cache_dir, f"engine.context_parallel_size={cp}", nproc=nproc)
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    lines = [x for x in out.splitlines() if "config error" in x]
    assert len(lines) == 1 and words in lines[0], out[-3000:]
    if nproc == 1:
        assert proc.returncode == 2 and "Traceback" not in out, out[-3000:]
    else:  # torchrun reports its workers' exit codes (and its own ChildFailedError)
        assert proc.returncode != 0 and out.count("exitcode  : 2") == nproc, out[-3000:]
