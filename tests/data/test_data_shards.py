"""Shard files: exact round trip, dtype choice, splitting at shard_tokens, completeness check."""
import numpy as np
import pytest

from data.shards import ShardWriter, dtype_for, np_dtype, open_split, read_meta
from data.sources import DataError
from data_helpers import random_stream, write_prepared


def test_dtype_choice():
    assert dtype_for(257) == "uint16" and dtype_for(65536) == "uint16"  # ids 0..65535 fit
    assert dtype_for(65537) == "uint32" and dtype_for(200_000) == "uint32"


@pytest.mark.parametrize("vocab", [50257, 100_000])
def test_round_trip(tmp_path, vocab):
    eos = vocab - 1
    train = random_stream(5_000, vocab, eos, seed=1)
    val = random_stream(700, vocab, eos, seed=2)
    folder = write_prepared(tmp_path / "p", {"train": train, "val": val}, vocab, eos, shard_tokens=1_500)
    meta, maps = open_split(folder, "train")
    assert meta["dtype"] == dtype_for(vocab) and maps[0].dtype == np_dtype(dtype_for(vocab))
    assert [len(m) for m in maps] == [1500, 1500, 1500, 500]  # full shards, then the rest
    np.testing.assert_array_equal(np.concatenate(maps), train)  # nothing lost, reordered or wrapped
    assert (folder / "train_000003.bin").stat().st_size == 500 * np_dtype(meta["dtype"]).itemsize
    _, vmaps = open_split(folder, "val")
    np.testing.assert_array_equal(np.concatenate(vmaps), val)


def test_uint32_keeps_large_ids(tmp_path):
    ids = np.array([0, 65535, 65536, 99_999, 123_456], dtype=np.int64)
    folder = write_prepared(tmp_path / "p", {"train": ids}, 200_000, 0)
    _, maps = open_split(folder, "train")
    np.testing.assert_array_equal(maps[0], ids)


def test_writer_counts_and_max(tmp_path):
    w = ShardWriter(tmp_path, "train", "uint16", shard_tokens=4)
    for chunk in ([5, 1, 2], [], [9, 3, 3, 7, 2]):
        w.write(np.array(chunk, dtype=np.int64))
    shards = w.close()
    assert [s["n_tokens"] for s in shards] == [4, 4] and w.n_tokens == 8 and w.max_id == 9


def test_incomplete_folder_is_not_valid(tmp_path):
    folder = write_prepared(tmp_path / "p", {"train": random_stream(3000, 500, 0)}, 500, 0)
    assert read_meta(folder) is not None
    with open(folder / "train_000001.bin", "r+b") as f:  # a truncated shard (crash while copying)
        f.truncate(10)
    assert read_meta(folder) is None
    with pytest.raises(DataError, match="not a complete prepared data folder"):
        open_split(folder, "train")


def test_unknown_split(tmp_path):
    folder = write_prepared(tmp_path / "p", {"train": random_stream(100, 500, 0)}, 500, 0)
    with pytest.raises(DataError, match="split 'test' not in"):
        open_split(folder, "test")
