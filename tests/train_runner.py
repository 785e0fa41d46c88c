"""Run launch/train.py as a user would (python or torchrun) and read back its loss curve."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRAIN = str(REPO / "launch" / "train.py")

# A smaller, faster variant of tiny_cpu: 2 layers, 64-token context, 2 micro-batches per step
# (gradient accumulation) on one rank, evaluation and a checkpoint every 3 steps.
FAST = ["model.n_layer=2", "model.seq_len=64", "train.global_batch_size=8", "train.micro_batch_size=4",
        "train.eval_interval=3", "train.eval_steps=2", "train.ckpt_interval=3", "logging.progress=false",
        "logging.wandb=offline"]


def _run_then_exit(rank: int, worker, port: int, *args) -> None:
    """One spawned rank: worker(rank, port, *args), then leave without the interpreter's teardown once it
    returned (its process group destroyed). A 2-rank gloo process that imported DeepSpeed was seen to
    abort at teardown after passing ("terminate called without an active exception", a C++ thread still
    joinable), as launch/train.py's ranks would without its _exit_now. An exception still reaches
    mp.spawn (its traceback, exit 1)."""
    worker(rank, port, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(worker, nprocs: int, *args) -> None:
    """worker(rank, port, *args) on `nprocs` spawned processes sharing a free TCP port; raises if any
    rank failed."""
    import torch.multiprocessing as mp

    mp.spawn(_run_then_exit, args=(worker, free_port(), *args), nprocs=nprocs, join=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_cmd(out_dir, cache_dir, *overrides, nproc=1, config="tiny_cpu.yaml"):
    args = [f"train.out_dir={out_dir}", f"data.cache_dir={cache_dir}", *FAST, *overrides]
    if nproc == 1:
        return [sys.executable, TRAIN, "--config", config, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            TRAIN, "--config", config, *args]


def env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def check(proc, cmd):
    assert proc.returncode == 0, (f"{' '.join(map(str, cmd))}\n--- stdout\n{proc.stdout[-3000:]}\n"
                                  f"--- stderr\n{proc.stderr[-6000:]}")
    return proc


def run(out_dir, cache_dir, *overrides, nproc=1, timeout=600):
    cmd = train_cmd(out_dir, cache_dir, *overrides, nproc=nproc)
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=timeout)
    return check(proc, cmd)


def losses(run_dir: Path, key: str = "loss") -> dict:
    """{step: loss} (or another logged metric, e.g. "grad_norm") from a run's metrics.jsonl."""
    out = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if key in rec:
            out[rec["step"]] = rec[key]
    return out


# in-process runs (Trainer.fit on one rank): FAST without evaluation, checkpoints or W&B (later keys win)
IN_PROCESS = [*FAST, "train.eval_interval=0", "train.ckpt_interval=0", "logging.wandb=disabled"]


def fit(tmp_path, cache_dir, name, *overrides, fault=None, monkeypatch=None):
    """Trainer.fit of tiny_cpu for 5 steps in this process, FLASHGPT_FAULT set to `fault` (or unset);
    returns the trainer with .records = {step: its metrics} (also when fit raised). The fault plan that
    training/resilience/faults.py caches is put back when the test ends."""
    from training.config import load_config
    from training.distributed import DistInfo
    from training.resilience import faults
    from training.trainer import Trainer

    monkeypatch.setattr(faults, "_parsed", faults._parsed)
    if fault:
        monkeypatch.setenv("FLASHGPT_FAULT", fault)
    else:
        monkeypatch.delenv("FLASHGPT_FAULT", raising=False)
    cfg = load_config("tiny_cpu.yaml", [f"train.out_dir={tmp_path}", f"data.cache_dir={cache_dir}",
                                        f"train.run_name={name}", "train.max_steps=5", *IN_PROCESS, *overrides])
    trainer = Trainer.build(cfg, DistInfo())
    try:
        trainer.fit()
    finally:
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        trainer.records = {r["step"]: r for r in records if "loss" in r}
    return trainer
