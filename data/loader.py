"""PackedLoader: fixed-length training windows from the token shards, rank-sharded, seeded, resumable.

The split's shards form one token stream S of N tokens (documents separated by EOS). Window i is
S[i*T : i*T + T + 1] (T = seq_len), so windows overlap by exactly one token and there are
W = (N - 1) // T of them; x = window[:-1], y = window[1:].

Order: epoch e visits the windows in permutation P_e = rng(seed, e).permutation(W) (train) or in
stream order (val). P_e is cut into chunks of B = micro_batch_size windows; global step s of the epoch
uses chunks s*R ... s*R + R - 1 (R = world_size) and rank r takes chunk s*R + r. An epoch has
W // (R*B) steps; the remainder is dropped. Every batch is a pure function of (epoch, step), so the
state is just the position consumed so far: `position` = s*R*B global windows into epoch e.
Background threads build the next batches ahead of time; `state_dict` counts what `next_batch`
handed out, never what was prefetched.
"""
from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from data.shards import open_split
from data.errors import DataError

STATE_VERSION = 1
PREFETCH_PER_WORKER = 2  # batches built ahead per worker thread


@dataclass
class Batch:
    x: torch.Tensor  # (B, T) int64 input ids
    y: torch.Tensor  # (B, T) int64 targets: x shifted left by one token
    cu_seqlens: Optional[torch.Tensor] = None  # (n_segments + 1,) int32 starts in flattened x, 0 .. B*T
    max_seqlen: Optional[int] = None  # longest segment, tokens

    def to(self, device, non_blocking: bool = True) -> "Batch":
        mv = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        return Batch(mv(self.x), mv(self.y), mv(self.cu_seqlens), self.max_seqlen)


def doc_segments(x: np.ndarray, eos_id: int) -> tuple:
    """cu_seqlens (int32) and max_seqlen for x (B, T): a segment starts at every row start and at
    every position right after an EOS; the flattened batch is B*T tokens long."""
    B, T = x.shape
    flat = x.reshape(-1)
    after_eos = np.flatnonzero(flat[:-1] == eos_id) + 1  # an EOS in the last slot starts nothing
    starts = np.union1d(np.arange(0, B * T, T), after_eos)  # sorted, unique
    cu = np.append(starts, B * T).astype(np.int32)
    return torch.from_numpy(cu), int(np.diff(cu).max())


class PackedLoader:
    def __init__(self, data_dir, split: str, seq_len: int, micro_batch_size: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0, num_workers: int = 1, doc_boundaries: bool = False,
                 eos_id: Optional[int] = None, epoch_multiple: Optional[int] = None):
        """epoch_multiple: windows an epoch is cut to a multiple of (the trainer passes the global
        batch), so the epoch length, and with it the data order, does not depend on the number of
        ranks; default: world_size x micro_batch_size."""
        if seq_len <= 0 or micro_batch_size <= 0 or world_size <= 0 or not 0 <= rank < world_size:
            raise ValueError(f"bad loader shape: seq_len={seq_len} micro_batch_size={micro_batch_size} "
                             f"rank={rank} world_size={world_size}")
        self.data_dir, self.split = Path(data_dir), split
        self.seq_len, self.micro_batch_size = seq_len, micro_batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.doc_boundaries = doc_boundaries
        self.meta, self._maps = open_split(self.data_dir, split)
        self.eos_id = self.meta["eos_id"] if eos_id is None else eos_id
        self._offsets = np.cumsum([0] + [len(m) for m in self._maps])  # (n_shards + 1,) token offsets
        self.n_tokens = int(self._offsets[-1])
        self.shuffle = split != "val"
        per_step = world_size * micro_batch_size  # windows per global step
        n_windows = max(self.n_tokens - 1, 0) // seq_len
        self._wrap = n_windows < per_step  # too little data for one step: read the stream cyclically
        if self._wrap and (self.shuffle or self.n_tokens == 0):
            need = per_step * seq_len + 1
            raise DataError(f"split '{split}' of {self.data_dir} has {self.n_tokens} tokens, fewer than one "
                            f"step of {world_size} data-parallel rank(s) x micro_batch_size {micro_batch_size} x "
                            f"seq_len {seq_len} + 1 = {need}; lower model.seq_len or train.micro_batch_size, "
                            f"or add data")
        self.n_windows = per_step if self._wrap else n_windows
        multiple = epoch_multiple or per_step
        if multiple % per_step:
            raise ValueError(f"epoch_multiple={multiple} is not a multiple of world_size x "
                             f"micro_batch_size = {per_step}")
        usable = self.n_windows if self._wrap else max(per_step, self.n_windows // multiple * multiple)
        self.len_per_epoch = usable // per_step  # batches per rank per epoch
        self._epoch, self._step = 0, 0  # consumed position
        self._perms: dict = {}  # epoch -> permutation (the newest two)
        self._perm_lock = threading.Lock()
        self._pin = torch.cuda.is_available()
        self._pool = (ThreadPoolExecutor(num_workers, thread_name_prefix=f"loader-{split}")
                      if num_workers > 0 else None)
        self._prefetch = PREFETCH_PER_WORKER * max(num_workers, 1)
        self._pending: deque = deque()  # ((epoch, step), Future) in yield order
        self._closed = False

    # --- building one batch (pure function of epoch, step; runs in worker threads) ----------------
    def _perm(self, epoch: int) -> np.ndarray:
        with self._perm_lock:
            if epoch not in self._perms:
                if self.shuffle:
                    rng = np.random.default_rng([self.seed % (1 << 64), epoch])
                    self._perms[epoch] = rng.permutation(self.n_windows)
                else:
                    self._perms[epoch] = np.arange(self.n_windows)
                for old in sorted(self._perms)[:-2]:
                    del self._perms[old]
            return self._perms[epoch]

    def _read(self, start: int, n: int) -> np.ndarray:
        """n tokens of the split's stream from `start` (across shards; modulo N when wrapping)."""
        out = np.empty(n, dtype=np.int64)
        pos = 0
        while pos < n:
            g = (start + pos) % self.n_tokens if self._wrap else start + pos
            s = int(np.searchsorted(self._offsets, g, side="right")) - 1
            lo = g - int(self._offsets[s])
            take = min(n - pos, len(self._maps[s]) - lo)
            out[pos:pos + take] = self._maps[s][lo:lo + take]
            pos += take
        return out

    def _make(self, epoch: int, step: int) -> Batch:
        B, T = self.micro_batch_size, self.seq_len
        chunk = step * self.world_size + self.rank
        windows = self._perm(epoch)[chunk * B:(chunk + 1) * B]  # (B,) window ids
        tokens = np.stack([self._read(int(w) * T, T + 1) for w in windows])  # (B, T+1) int64
        x, y = np.ascontiguousarray(tokens[:, :-1]), np.ascontiguousarray(tokens[:, 1:])
        batch = Batch(torch.from_numpy(x), torch.from_numpy(y))
        if self.doc_boundaries:
            batch.cu_seqlens, batch.max_seqlen = doc_segments(x, self.eos_id)
        if self._pin:
            batch.x, batch.y = batch.x.pin_memory(), batch.y.pin_memory()
        return batch

    # --- consuming -------------------------------------------------------------------------------
    def _advance(self, key: tuple) -> tuple:
        epoch, step = key
        return (epoch + 1, 0) if step + 1 >= self.len_per_epoch else (epoch, step + 1)

    def _fill(self) -> None:
        cursor = self._advance(self._pending[-1][0]) if self._pending else (self._epoch, self._step)
        while len(self._pending) < self._prefetch:
            self._pending.append((cursor, self._pool.submit(self._make, *cursor)))
            cursor = self._advance(cursor)

    def _drop_prefetched(self) -> None:
        for _, fut in self._pending:
            fut.cancel()  # one already running just finishes and is dropped
        self._pending.clear()

    def next_batch(self) -> Batch:
        if self._closed:
            raise RuntimeError("PackedLoader is closed")
        key = (self._epoch, self._step)
        if self._pool is None:
            batch = self._make(*key)
        else:
            self._fill()
            got, fut = self._pending.popleft()
            assert got == key, (got, key)
            batch = fut.result()
            self._fill()  # keep the workers busy while the caller trains on this batch
        self._epoch, self._step = self._advance(key)
        return batch

    def __iter__(self):
        while True:
            yield self.next_batch()

    @property
    def epoch(self) -> int:
        return self._epoch

    def reset(self) -> None:
        """Back to the first batch of epoch 0 (evaluation restarts the val split this way)."""
        self._drop_prefetched()
        self._epoch, self._step = 0, 0

    # --- resume ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Where the consumer is (not the prefetcher): JSON-serialisable."""
        return {"version": STATE_VERSION, "split": self.split, "epoch": self._epoch,
                "position": self._step * self.world_size * self.micro_batch_size,  # global windows
                "seed": self.seed, "world_size": self.world_size, "rank": self.rank,
                "seq_len": self.seq_len, "micro_batch_size": self.micro_batch_size,
                "tokenizer_hash": self.meta["tokenizer_hash"], "data_key": self.meta.get("key"),
                "n_tokens": self.n_tokens}

    def load_state_dict(self, sd: dict) -> None:
        """Continue exactly where `sd` was taken. Any rank's state works (positions are global); a new
        world_size works when the position is a multiple of the new world_size x micro_batch_size."""
        mine = self.state_dict()
        for key, fix in [("seq_len", "model.seq_len"), ("micro_batch_size", "train.micro_batch_size"),
                         ("seed", "train.seed"), ("split", "the same split"),
                         ("tokenizer_hash", "the same data.* settings"),
                         ("data_key", "the same data.source files"), ("n_tokens", "the same data")]:
            if sd.get(key) != mine[key]:
                raise DataError(f"loader state has {key}={sd.get(key)!r} but this loader has "
                                f"{mine[key]!r}; resume with {fix}, or start a new run")
        per_step = self.world_size * self.micro_batch_size
        if sd["position"] % per_step:
            raise DataError(f"loader state is {sd['position']} windows into epoch {sd['epoch']} (taken "
                            f"with world_size={sd['world_size']}), not a multiple of world_size x "
                            f"micro_batch_size = {per_step} of this run; resume with world_size="
                            f"{sd['world_size']} or from a checkpoint at another step")
        self._drop_prefetched()
        self._epoch, self._step = int(sd["epoch"]), sd["position"] // per_step
        if self._step >= self.len_per_epoch:  # old epoch was longer (smaller global micro-batch)
            self._epoch, self._step = self._epoch + 1, 0

    # --- lifetime --------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._drop_prefetched()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "PackedLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
