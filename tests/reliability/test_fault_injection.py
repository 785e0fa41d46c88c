"""Crash anywhere, rerun the same command, get the same loss curve bit for bit (2-process torchrun on
CPU). Each trial SIGKILLs the torchrun agent and both workers at once, one or two times, then resumes
with train.resume=auto. bench/fault_trials.py --trials 20 runs many random trials."""
import random

import fault_trials  # bench/fault_trials.py (tests/reliability/conftest.py puts bench/ on the path)

STEPS = 12  # = conftest.STEPS, the reference run's length


def check(work, cache_dir, reference, name, kills):
    got, events = fault_trials.trial(work, cache_dir, name, STEPS, kills)
    assert got == reference, (kills, events)  # exact float equality at every step
    assert (work / name / "checkpoints" / "latest").read_text().strip() == f"step_{STEPS:08d}"
    assert not list((work / name / "checkpoints").glob(".tmp-*"))
    return events


def test_kill_during_checkpoint_write_then_mid_step(work, cache_dir, reference):
    """Rank 1 dies half-way through writing checkpoint 6 (engine files written, no manifest, no
    rename); the rerun resumes from 3 and is killed again mid-step 8 (after backward, before the
    update) by rank 0; the last rerun resumes from 6."""
    events = check(work, cache_dir, reference, "write_then_step",
                   [("hook", "ckpt_write:6:1"), ("hook", "step:8:0")])
    assert all("fired" in e for e in events), events


def test_kill_between_commit_and_pointer_then_at_random(work, cache_dir, reference):
    """Killed after checkpoint 3 is renamed in but before `latest` is written; then killed from
    outside at a random moment (a random step, a random delay into it). Kills from outside right
    after a checkpoint ('after_ckpt') run in bench/fault_trials.py."""
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    kill = ("time", rng.randint(4, STEPS - 2), rng.uniform(0.0, 0.3))
    events = check(work, cache_dir, reference, "commit_then_random",
                   [("hook", "ckpt_commit:3:0"), kill])
    assert "fired" in events[0], (seed, events)
