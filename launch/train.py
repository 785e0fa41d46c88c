"""Entry point: parse -> build -> fit.

    python launch/train.py --config tiny_cpu.yaml [key=value ...]
    torchrun --nproc_per_node=8 launch/train.py --config gpt_1.3b_8k.yaml train.max_steps=500
    deepspeed launch/train.py --config gpt_1.3b_8k.yaml engine.type=deepspeed
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository's packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from training.allocator import expandable_segments_by_default  # noqa: E402

expandable_segments_by_default()  # before anything touches CUDA

import torch  # noqa: E402

from data.sources import DataError  # noqa: E402
from training.config import ConfigError, load_config, validate  # noqa: E402
from training.distributed import Rank0Failed, all_reached, init_distributed  # noqa: E402
from training.resilience.checkpoint import CheckpointError  # noqa: E402
from training.resilience.out_of_memory import explain as explain_oom  # noqa: E402
from training.gradient_check import GradientLostError  # noqa: E402
from training.trainer import NonFiniteError, Trainer  # noqa: E402

# Known errors end the run with one line on stderr and this exit code, no traceback (README
# "Errors and what to do"); anything else is a bug and keeps its traceback. Exit code 4 is the hang
# watchdog's (training/resilience/watchdog.py).
KNOWN_ERRORS = ((ConfigError, "config error", 2), (DataError, "data error", 2),
                (CheckpointError, "checkpoint error", 2), (Rank0Failed, "error", 2),
                (NonFiniteError, "training stopped", 3), (GradientLostError, "training stopped", 3))


def _fail(label: str, err: BaseException, code: int) -> int:
    """Print the one line. Under several ranks it is prefixed `[rank N]`, except where every rank has
    the same error and rank 0 alone prints it: a config error (the same command line everywhere) and
    a failure of rank 0 that the others waited for (rank 0 printed its own)."""
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    if world > 1 and isinstance(err, ConfigError):
        if rank == 0:
            print(f"{label}: {err}", file=sys.stderr, flush=True)
        # torchrun SIGTERMs the other workers once one exits: each rank waits for all to have this error
        # and ignores that SIGTERM meanwhile, so that every rank exits 2 (and rank 0's line is out first)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if all_reached(label, world) or rank == 0:
            return code
    elif world > 1 and getattr(err, "reported", False):
        return code
    prefix = f"[rank {rank}] " if world > 1 else ""
    print(f"{prefix}{label}: {err}", file=sys.stderr, flush=True)
    return code


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", "-c", default="tiny_cpu.yaml", help="NAME.yaml in configs/, or a path")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None,
                   help="set by the deepspeed launcher; LOCAL_RANK in the environment wins")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.max_steps=20")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.config, args.overrides)
        validate(cfg, world_size=int(os.environ.get("WORLD_SIZE", 1)))
    except ConfigError as e:
        return _fail("config error", e, 2)
    try:
        dist = init_distributed(cfg.train.device, cfg.engine.backend)
    except RuntimeError as e:  # e.g. train.device=cuda on a machine without a GPU
        return _fail("device error", e, 2)
    trainer = None
    try:
        trainer = Trainer.build(cfg, dist)
        trainer.fit()
    except tuple(cls for cls, _, _ in KNOWN_ERRORS) as e:
        label, code = next((lbl, c) for cls, lbl, c in KNOWN_ERRORS if isinstance(e, cls))
        return _fail(label, e, code)
    except torch.OutOfMemoryError as e:  # the settings that would fit, not the allocation that failed
        saved = trainer.checkpointer.complete() if trainer is not None else []
        code = _fail("out of memory", explain_oom(e, cfg, None if trainer is None else trainer.step,
                                                  dist.world_size, dist.device, cfg.model.num_params(),
                                                  saved[-1] if saved else None), 2)
        if dist.world_size > 1:  # the other ranks wait in a collective this one will never join: leave
            _exit_now(code)  # without the process group's teardown (it could wait on them); torchrun
        return code          # then stops the job
    finally:
        dist.shutdown()
    return 0


def _exit_now(code: int) -> None:
    """End a rank of a multi-process run without the interpreter's teardown. Everything the run keeps is
    written and closed by then (checkpoints fsynced, metrics and W&B closed, the process group
    destroyed), but a C++ thread of the distributed stack was seen still joinable at teardown in a rare
    2-rank gloo run, which then aborted ("terminate called without an active exception", exit -6) after
    a complete run (kernels/NOTES.md); skipping the teardown keeps the exit code."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    code = main()
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        _exit_now(code)
    sys.exit(code)
