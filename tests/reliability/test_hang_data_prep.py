"""Rank 0 prepares the data while the other ranks wait through the rendezvous store, not in a
collective: a preparation longer than the collectives' timeout (a first run on a big corpus) does not
end the job, and rank 0's failure reaches the others, which leave without repeating its message."""
import datetime
import multiprocessing
import os
import socket
import time

import pytest
import torch.distributed as dist

from data.sources import DataError
from training.distributed import DistInfo, rank0_first

PG_TIMEOUT_S = 2
PREPARE_S = 5  # rank 0's preparation: longer than the collectives' timeout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, fail: bool, out, prepare_s: float, late_s: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    if rank == 1:
        time.sleep(late_s)  # rank 1 reaches the wait after rank 0 may have failed already

    def prepare():
        if rank == 0:
            time.sleep(prepare_s)
            if fail:
                raise DataError("empty corpus: no text in data.source [...]")
        return f"prepared on rank {rank}"

    try:
        out.put((rank, "ok", rank0_first(DistInfo(rank=rank, world_size=2), "preparing the data", prepare)))
        dist.barrier()  # the group still works after the long wait
    except Exception as e:
        out.put((rank, type(e).__name__, f"{e} | reported={getattr(e, 'reported', None)}"))
    dist.destroy_process_group()


def run_two(fail: bool, prepare_s: float = PREPARE_S, late_s: float = 0.0) -> dict:
    ctx = multiprocessing.get_context("spawn")
    out, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, fail, out, prepare_s, late_s)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = dict((r, (kind, text)) for r, kind, text in (out.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(30)
    return got


def test_a_long_preparation_on_rank_0_outlasts_the_collective_timeout():
    got = run_two(fail=False)
    assert got == {0: ("ok", "prepared on rank 0"), 1: ("ok", "prepared on rank 1")}, got


# rank 0 hosts the store here (no torchrun agent): its failure must be read before it exits, also by a
# rank that reaches the wait late
@pytest.mark.parametrize("prepare_s,late_s", [(PREPARE_S, 0.0), (0.0, 3.0)])
def test_rank_0_failure_reaches_the_other_ranks(prepare_s, late_s):
    got = run_two(fail=True, prepare_s=prepare_s, late_s=late_s)
    assert got[0] == ("DataError", "empty corpus: no text in data.source [...] | reported=None"), got
    assert got[1] == ("Rank0Failed", "rank 0 failed while preparing the data: DataError: empty corpus: no "
                                     "text in data.source [...] | reported=True"), got
