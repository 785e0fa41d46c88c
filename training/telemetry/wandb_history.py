"""Which steps a W&B run's offline files hold, so a resumed run can log again what a crash lost.

W&B buffers history in its service process; a SIGKILL of the job loses what the service had not yet
written to `offline-run-*/run-<id>.wandb` (often everything since the run began). metrics.jsonl is
written and flushed line by line, so on resume the trainer logs again, into the resumed W&B run,
every step up to the checkpoint that metrics.jsonl has and the run's files lack.

File format (W&B's offline store): a 7-byte header (b":W&B", magic 0xBEE1, version 0), then records
in 32 KiB blocks, each record as <crc32 (4 B, of the type byte + data), length (2 B), type (1 B)>
+ data; a record that does not fit a block is split FIRST / MIDDLE... / LAST. The data is a
`wandb_internal_pb2.Record` protobuf; history records carry `history.step.num`. Reading stops at the
first torn or corrupt record (a crash mid-write).
"""
from __future__ import annotations

import struct
import zlib
from pathlib import Path
from typing import Iterator, Set

HEADER = struct.Struct("<4sHB")
RECORD = struct.Struct("<IHB")
BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> Iterator[bytes]:
    """The data of each intact record of one .wandb file, in order."""
    data = Path(path).read_bytes()
    if len(data) < HEADER.size or HEADER.unpack_from(data)[0] != b":W&B":
        return
    pos, parts = HEADER.size, []
    while True:
        room = BLOCK - pos % BLOCK
        if room < RECORD.size:  # the block's tail is padding
            pos += room
            continue
        if pos + RECORD.size > len(data):
            return
        crc, length, kind = RECORD.unpack_from(data, pos)
        body = data[pos + RECORD.size: pos + RECORD.size + length]
        if length > room - RECORD.size or len(body) < length or zlib.crc32(bytes([kind]) + body) != crc:
            return
        pos += RECORD.size + length
        if kind == FULL:
            yield body
        elif kind == FIRST:
            parts = [body]
        elif kind == MIDDLE:
            parts.append(body)
        elif kind == LAST:
            yield b"".join(parts + [body])
            parts = []
        else:
            return


def logged_steps(wandb_dir: Path, run_id: str) -> Set[int]:
    """Steps with history in every offline-run-*-<run_id> folder under wandb_dir."""
    from wandb.proto import wandb_internal_pb2 as pb

    steps = set()
    for path in sorted(Path(wandb_dir).glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")):
        for body in records(path):
            rec = pb.Record()
            try:
                rec.ParseFromString(body)
            except Exception:  # a record this wandb version does not know: skip it
                continue
            if rec.WhichOneof("record_type") == "history" and rec.history.HasField("step"):
                steps.add(rec.history.step.num)
    return steps
