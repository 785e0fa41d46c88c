"""engine.grad_sync=after_backward (training/engines/grad_allreduce.py): the gradient sum itself on 2 gloo
processes, the choice of sync, and 2-rank torchrun runs with the weight cache on (CPU, bf16 autocast)
against one process and against DDP."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from train_runner import losses, run, spawn_ranks

from training.config import load_config
from training.distributed import DistInfo
from training.engines.grad_allreduce import all_reduce_grads, grad_sync_choice
from training.engines.weight_cache import weight_cache_choice

SHAPES = [(37, 11), (300,), (5, 7, 3), (129, 65), (1,)]  # odd sizes; small_numel=64 below splits them


def _rank_grads(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _worker(rank: int, port: int, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
        for p, g in zip(params, _rank_grads(rank)):
            p.grad = g
        g2 = params[2].grad
        params[2].grad = g2.transpose(0, 2).contiguous().transpose(0, 2)  # same values, not contiguous: packed
        assert not params[2].grad.is_contiguous()
        params[4].grad = None  # no gradient on either rank: skipped
        all_reduce_grads(params, small_numel=64)
        out[rank] = [None if p.grad is None else p.grad.clone() for p in params]
    finally:
        dist.destroy_process_group()


def test_all_reduce_grads_sums_every_gradient_in_place():
    out = mp.Manager().dict()
    spawn_ranks(_worker, 2, out)
    want = [a + b for a, b in zip(_rank_grads(0), _rank_grads(1))]
    for rank in (0, 1):
        got = out[rank]
        for i in range(4):
            torch.testing.assert_close(got[i], want[i], rtol=1e-6, atol=1e-6, msg=f"rank {rank} grad {i}")
        assert got[4] is None


def _cfg(*overrides):
    return load_config("tiny_cpu.yaml", list(overrides))


def test_grad_sync_choice(monkeypatch):
    two = DistInfo(world_size=2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert grad_sync_choice(_cfg(), two, torch.bfloat16)[0] == "during_backward"  # one node, bf16
    assert weight_cache_choice(_cfg(), two, torch.bfloat16)[0]
    assert grad_sync_choice(_cfg(), two, None)[0] == "ddp"  # fp32: no cache to keep
    assert grad_sync_choice(_cfg("engine.weight_cache=disabled"), two, torch.bfloat16)[0] == "ddp"
    assert grad_sync_choice(_cfg("engine.grad_sync=ddp"), two, torch.bfloat16)[0] == "ddp"
    use, why = weight_cache_choice(_cfg("engine.grad_sync=ddp"), two, torch.bfloat16)
    assert not use and "DDP" in why
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # two nodes of one rank each
    sync, why = grad_sync_choice(_cfg(), two, torch.bfloat16)
    assert sync == "ddp" and "nodes" in why
    assert grad_sync_choice(_cfg("engine.grad_sync=after_backward"), two, torch.bfloat16)[0] == "after_backward"
    assert grad_sync_choice(_cfg("engine.grad_sync=during_backward"), two, torch.bfloat16)[0] == "during_backward"
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert grad_sync_choice(_cfg(), two, torch.bfloat16)[0] == "ddp"  # launcher did not say: assume nodes
    with pytest.raises(Exception, match="engine.grad_sync"):
        _cfg("engine.grad_sync=nccl")


BF16 = ["train.dtype=bf16", "train.max_steps=6"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("data_cache"))


@pytest.fixture(scope="module")
def after_backward(tmp_path_factory, cache_dir):
    """The 2-rank bf16 run with the weight cache and fp32 weight-gradient accumulation, and its output."""
    out = tmp_path_factory.mktemp("ab")
    proc = run(out, cache_dir, *BF16, "train.run_name=ab", "engine.wgrad_fp32=enabled",
               "engine.grad_sync=after_backward", nproc=2)
    return losses(out / "ab"), proc.stdout + proc.stderr, losses(out / "ab", "grad_norm")


def _same_curves(got: dict, want: dict, rel: float) -> None:
    assert sorted(got) == sorted(want) == list(range(1, 7))
    for step, value in want.items():
        assert got[step] == pytest.approx(value, rel=rel), step


def test_two_ranks_keep_the_weight_cache_and_train_the_one_process_curve(tmp_path, cache_dir, after_backward):
    """after_backward under a one-node torchrun: the curve is the one-process run's (same global batch,
    twice the accumulation there) to bf16 rounding of the summation order."""
    curve, log, norms = after_backward
    assert "gradients summed after the backward" in log and "weight cache + fp32 weight gradients" in log
    run(tmp_path, cache_dir, *BF16, "train.run_name=one", "engine.wgrad_fp32=enabled")
    _same_curves(curve, losses(tmp_path / "one"), rel=1e-4)
    # the gradient itself (clipping and Adam would hide a sum where a mean belongs in the loss curve)
    _same_curves(norms, losses(tmp_path / "one", "grad_norm"), rel=1e-3)
    assert curve[6] < curve[1] - 0.2  # it trains


def test_after_backward_trains_the_ddp_curve(tmp_path, cache_dir, after_backward):
    proc = run(tmp_path, cache_dir, *BF16, "train.run_name=ddp", "engine.grad_sync=ddp", nproc=2)
    assert "| DDP |" in proc.stdout + proc.stderr and "weight cache" not in proc.stdout + proc.stderr
    curve, _, norms = after_backward
    _same_curves(curve, losses(tmp_path / "ddp"), rel=1e-4)
    _same_curves(norms, losses(tmp_path / "ddp", "grad_norm"), rel=1e-3)


def test_after_backward_resume_is_bit_identical(tmp_path, cache_dir, after_backward):
    common = [*BF16, "train.run_name=r", "engine.wgrad_fp32=enabled"]
    run(tmp_path, cache_dir, *common, "train.stop_after=3", nproc=2)
    run(tmp_path, cache_dir, *common, nproc=2)
    assert losses(tmp_path / "r") == after_backward[0]


def test_during_backward_sums_the_same_gradients_while_the_backward_runs(tmp_path, cache_dir, after_backward):
    """auto under a one-node torchrun: each fp32 weight gradient's all-reduce starts as its GEMM writes it
    in the last micro-batch (2 layers x 4 weights here); two ranks' sums do not depend on when they run:
    the same losses and grad norms as after_backward, bit for bit."""
    proc = run(tmp_path, cache_dir, *BF16, "train.run_name=db", "engine.wgrad_fp32=enabled", nproc=2)
    log = proc.stdout + proc.stderr
    assert "gradients summed as the last backward writes them" in log
    assert "during_backward: 8 of " in log  # qkv, proj, fc1, fc2 of both blocks went early
    curve, _, norms = after_backward
    assert losses(tmp_path / "db") == curve
    assert losses(tmp_path / "db", "grad_norm") == norms


def test_during_backward_reduces_early_inside_compiled_graphs(tmp_path, cache_dir, after_backward):
    """Under train.compile the weight-gradient op runs inside the compiled backward: its hook still starts
    the all-reduces there, and the curve is the eager one to bf16 / fusion rounding."""
    proc = run(tmp_path, cache_dir, *BF16, "train.run_name=dbc", "engine.wgrad_fp32=enabled",
               "engine.grad_sync=during_backward", "train.compile=true", nproc=2)
    log = proc.stdout + proc.stderr
    assert "| torch.compile |" in log and "during_backward: 8 of " in log
    _same_curves(losses(tmp_path / "dbc"), after_backward[0], rel=1e-4)
