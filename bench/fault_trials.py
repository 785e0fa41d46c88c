"""Fault-injection trials: SIGKILL a 2-process torchrun training run (the agent and every worker) at
chosen or random moments, rerun the same command (train.resume=auto) until it finishes, and compare
its loss curve (metrics.jsonl, loss per step) with an uninterrupted run's, bit for bit.

    python bench/fault_trials.py --trials 20            # random kills; prints "N/M matched"

Kills (one or two per trial):
    hook ckpt_write:S:R   rank R SIGKILLs the job inside the checkpoint save of step S, after the
                          engine files are written (training/resilience/faults.py, FLASHGPT_FAULT)
    hook ckpt_commit:S:R  ... after the checkpoint folder is renamed in, before `latest` is rewritten
    hook step:S:R         ... mid-step S, after backward, before the optimizer update
    time K D              from outside, D seconds after the K-th step's metrics appear
    after_ckpt S          from outside, as soon as `latest` names step S (between save and next step)
tests/reliability/test_fault_injection.py runs a few fixed trials of this harness in CI.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from process_tree import Launch  # bench/, beside this file

REPO = Path(__file__).resolve().parent.parent
TRAIN = str(REPO / "launch" / "train.py")
# tests/test_e2e.py's FAST settings: 2 layers, 64-token context, 2 micro-batches per step, evaluation
# and a checkpoint every 3 steps; W&B off (its service process is not what is under test).
FAST = ["model.n_layer=2", "model.seq_len=64", "train.global_batch_size=8", "train.micro_batch_size=4",
        "train.eval_interval=3", "train.eval_steps=2", "train.ckpt_interval=3", "logging.progress=false",
        "logging.wandb=disabled"]
TIMEOUT = 300  # seconds per launch; a normal one takes ~10 s on 2 cores


def command(out_dir, cache_dir, name, steps, nproc=2, extra=()) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            TRAIN, "--config", "tiny_cpu.yaml", f"train.out_dir={out_dir}", f"data.cache_dir={cache_dir}",
            f"train.run_name={name}", f"train.max_steps={steps}", *FAST, *extra]


def environment(fault=None) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("FLASHGPT_FAULT", None)
    if fault:
        env["FLASHGPT_FAULT"] = fault
    return env


def losses(run_dir: Path) -> dict:
    """step -> loss from metrics.jsonl (a torn last line from a kill is skipped)."""
    out = {}
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "loss" in rec:
            out[rec["step"]] = rec["loss"]
    return out


def newest_step(run_dir: Path, since: float) -> int:
    """Highest step logged by a launch that started at time `since` (older records don't count)."""
    path, best = Path(run_dir) / "metrics.jsonl", 0
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "loss" in rec and rec.get("time", 0) >= since:
                best = max(best, rec["step"])
    return best


def start(cmd, env, log_path: Path) -> Launch:
    """One launch of `cmd` in the repository root with `env`, appending to `log_path`."""
    return Launch(cmd, log_path, env=env, cwd=REPO)


def attempt(cmd, run_dir: Path, kill: tuple, log_path: Path) -> str:
    """One launch with one kill; returns what happened."""
    kind = kill[0]
    since = time.time()
    launch = start(cmd, environment(kill[1] if kind == "hook" else None), log_path)
    deadline = time.monotonic() + TIMEOUT
    if kind in ("time", "after_ckpt"):
        latest = run_dir / "checkpoints" / "latest"
        while launch.poll() is None and time.monotonic() < deadline:
            if kind == "time" and (kill[1] == 0 or newest_step(run_dir, since) >= kill[1]):
                time.sleep(kill[2])
                launch.kill()
                return f"killed {kill[2]:.2f}s after step {kill[1]}'s metrics"
            if kind == "after_ckpt" and latest.exists() and latest.read_text().strip() == f"step_{kill[1]:08d}":
                launch.kill()
                return f"killed right after checkpoint {kill[1]}"
            time.sleep(0.01)
    code = launch.finish(deadline)
    if code == 0:
        return f"{kill} never fired: finished"
    if kind == "hook" and code == -signal.SIGKILL:
        return f"{kill[1]} fired"
    raise RuntimeError(f"launch failed (not by the injected kill), exit {code}:\n{launch.tail()}")


def trial(work: Path, cache_dir, name: str, steps: int, kills: list, nproc=2) -> tuple:
    """Kill per `kills`, then run to the end with resume=auto; returns (losses, what happened)."""
    cmd = command(work, cache_dir, name, steps, nproc)
    events = []
    for i, kill in enumerate(kills):
        events.append(attempt(cmd, work / name, kill, work / f"{name}.{i}.log"))
    final = start(cmd, environment(), work / f"{name}.final.log")
    code = final.finish(time.monotonic() + TIMEOUT)
    if code != 0:
        raise RuntimeError(f"resume after {events} failed (exit {code}):\n{final.tail()}")
    return losses(work / name), events


def straight(work: Path, cache_dir, steps: int, nproc=2) -> dict:
    name = f"straight_{nproc}x{steps}"
    launch = start(command(work, cache_dir, name, steps, nproc), environment(), work / f"{name}.log")
    code = launch.finish(time.monotonic() + TIMEOUT)
    if code != 0:
        raise RuntimeError(f"uninterrupted run failed (exit {code}):\n{launch.tail()}")
    return losses(work / name)


def random_kill(rng: random.Random, steps: int, nproc: int) -> tuple:
    ckpts = list(range(3, steps + 1, 3))
    choice = rng.choice(["ckpt_write", "ckpt_commit", "step", "time", "time", "after_ckpt"])
    rank = rng.randrange(nproc)
    if choice in ("ckpt_write", "ckpt_commit"):  # only rank 0 commits (manifest, rename, pointer)
        return ("hook", f"{choice}:{rng.choice(ckpts)}:{rank if choice == 'ckpt_write' else 0}")
    if choice == "step":
        return ("hook", f"step:{rng.randint(1, steps)}:{rank}")
    if choice == "after_ckpt":
        return ("after_ckpt", rng.choice(ckpts[:-1]))
    return ("time", rng.randint(0, steps - 1), rng.uniform(0.0, 0.3))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--seed", type=int, default=None, help="kill schedule seed (default: random)")
    p.add_argument("--keep", action="store_true", help="keep the work folder")
    args = p.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    work = Path(tempfile.mkdtemp(prefix="fault_trials_"))
    cache = work / "cache"
    print(f"seed {seed}, work folder {work}", flush=True)
    reference = straight(work, cache, args.steps, args.nproc)
    assert sorted(reference) == list(range(1, args.steps + 1)), reference
    matched = fired = 0
    for i in range(args.trials):
        kills = [random_kill(rng, args.steps, args.nproc) for _ in range(rng.choice([1, 2]))]
        t0 = time.monotonic()
        try:
            got, events = trial(work, cache, f"trial{i:03d}", args.steps, kills, args.nproc)
            ok = got == reference
        except Exception as e:  # a failed resume counts as a mismatch
            ok, events = False, [f"error: {e}"]
        matched += ok
        fired += sum("fired" in e or "killed" in e for e in events)
        print(f"trial {i + 1}/{args.trials}: {'match' if ok else 'MISMATCH'} "
              f"({time.monotonic() - t0:.0f}s) kills={kills} -> {events}", flush=True)
    print(f"{matched}/{args.trials} matched ({fired} kills landed; scheduled kills a resumed run had "
          f"already passed do not fire)")
    if not args.keep and matched == args.trials:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if matched == args.trials else 1


if __name__ == "__main__":
    sys.exit(main())
