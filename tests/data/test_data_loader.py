"""PackedLoader: windows, shift, seeded order, rank sharding, exact resume, cu_seqlens, val wrap."""
import json

import numpy as np
import pytest
import torch

from data.loader import PackedLoader, doc_segments
from data.sources import DataError
from data_helpers import random_stream, write_prepared

V, EOS = 1000, 0


@pytest.fixture(scope="module")
def stream():
    return random_stream(20_011, V, EOS, seed=11)  # odd length: the tail is dropped, shards cross windows


@pytest.fixture(scope="module")
def folder(tmp_path_factory, stream):
    val = random_stream(300, V, EOS, seed=12)
    return write_prepared(tmp_path_factory.mktemp("prep"), {"train": stream, "val": val}, V, EOS,
                          shard_tokens=777)


def take(loader, n):
    return [loader.next_batch() for _ in range(n)]


def window_ids(batch, stream, T):
    """Map each row of x back to its window index in the stream (rows start at multiples of T)."""
    out = []
    for row in batch.x.numpy():
        starts = [i for i in range(0, len(stream) - T, T) if np.array_equal(stream[i:i + T], row)]
        assert len(starts) == 1
        out.append(starts[0] // T)
    return out


def test_shapes_shift_and_windows(folder, stream):
    T, B = 64, 4
    with PackedLoader(folder, "train", T, B, num_workers=2) as L:
        assert L.n_windows == (len(stream) - 1) // T and L.len_per_epoch == L.n_windows // B
        b = L.next_batch()
        assert b.x.shape == b.y.shape == (B, T) and b.x.dtype == b.y.dtype == torch.int64
        assert b.cu_seqlens is None
        for row_x, row_y, w in zip(b.x.numpy(), b.y.numpy(), window_ids(b, stream, T)):
            np.testing.assert_array_equal(row_x, stream[w * T:w * T + T])  # non-overlapping stride-T
            np.testing.assert_array_equal(row_y, stream[w * T + 1:w * T + T + 1])  # next-token targets


def test_seeded_order(folder):
    def first(seed, n=6, workers=1):
        with PackedLoader(folder, "train", 32, 2, seed=seed, num_workers=workers) as L:
            return torch.cat([b.x for b in take(L, n)])
    assert torch.equal(first(1), first(1, workers=0))  # repeatable, threads or not
    assert not torch.equal(first(1), first(2))  # the seed matters


def test_epochs_cover_all_windows_in_new_orders(folder):
    with PackedLoader(folder, "train", 128, 3, seed=5, num_workers=2) as L:
        epochs = []
        for e in range(3):
            assert L.epoch == e
            xs = torch.cat([b.x for b in take(L, L.len_per_epoch)])
            epochs.append(xs)
        rows = [{tuple(r) for r in xs.tolist()} for xs in epochs]
        assert all(len(r) == L.len_per_epoch * 3 for r in rows)  # no window twice in an epoch
        assert not torch.equal(epochs[0], epochs[1])  # a new permutation each epoch
        assert len(rows[0] & rows[1]) >= len(rows[0]) - 3  # the same windows, bar the dropped tail


@pytest.mark.parametrize("world", [2, 3])
def test_rank_sharding_disjoint_and_covering(folder, world):
    T, B = 100, 2
    loaders = [PackedLoader(folder, "train", T, B, rank=r, world_size=world, seed=3) for r in range(world)]
    single = PackedLoader(folder, "train", T, B * world, seed=3, num_workers=0)  # same global order
    try:
        n = loaders[0].len_per_epoch
        assert all(L.len_per_epoch == n for L in loaders) and n == single.n_windows // (B * world)
        rows = {r: torch.cat([b.x for b in take(L, n)]) for r, L in enumerate(loaders)}
        sets = [{tuple(x) for x in rows[r].tolist()} for r in range(world)]
        for a in range(world):
            for b in range(a + 1, world):
                assert not sets[a] & sets[b]  # disjoint
        assert sum(len(s) for s in sets) == n * world * B  # together: the whole epoch minus the tail
        for step in range(n):  # step s of the group == step s of one rank with world x the batch
            joined = torch.cat([rows[r][step * B:(step + 1) * B] for r in range(world)])
            assert torch.equal(joined, single.next_batch().x)
    finally:
        for L in loaders + [single]:
            L.close()


@pytest.mark.parametrize("k", [0, 3, 27])  # 27 crosses the epoch end (len_per_epoch is 26)
def test_resume_is_exact_with_prefetch(folder, k):
    kw = dict(seq_len=96, micro_batch_size=8, seed=9, num_workers=3)
    with PackedLoader(folder, "train", **kw) as ref:
        assert ref.len_per_epoch == 26
        expected = take(ref, k + 5)
    with PackedLoader(folder, "train", **kw) as a:
        take(a, k)
        sd = json.loads(json.dumps(a.state_dict()))  # JSON round trip; the threads ran ahead meanwhile
        assert sd["position"] == (k % 26) * 8 and sd["epoch"] == k // 26
        take(a, 2)  # consuming more after saving must not matter
    with PackedLoader(folder, "train", **kw) as b:
        take(b, 4)  # a fresh loader that already moved
        b.load_state_dict(sd)
        for want, got in zip(expected[k:], take(b, 5)):
            assert torch.equal(want.x, got.x) and torch.equal(want.y, got.y)


def test_resume_with_other_world_size(folder):
    T, B = 64, 2
    two = [PackedLoader(folder, "train", T, B, rank=r, world_size=2, seed=4) for r in range(2)]
    for _ in range(6):  # 6 steps x 2 ranks x 2 = 24 global windows consumed
        for L in two:
            L.next_batch()
    sd = two[1].state_dict()  # any rank's state: positions are global
    global_next = []
    for _ in range(3):
        global_next += [two[0].next_batch().x, two[1].next_batch().x]
    one = PackedLoader(folder, "train", T, B, seed=4, num_workers=0)
    one.load_state_dict(sd)
    assert torch.equal(torch.cat([b.x for b in take(one, 6)]), torch.cat(global_next))
    four = PackedLoader(folder, "train", T, B, rank=0, world_size=4, seed=4)  # 24 % 8 == 0: allowed
    four.load_state_dict(sd)
    assert torch.equal(four.next_batch().x, global_next[0])
    three = PackedLoader(folder, "train", T, B, rank=0, world_size=3, seed=4)  # 24 % 6 == 0 too
    three.load_state_dict(sd)
    assert torch.equal(three.next_batch().x, global_next[0])
    five = PackedLoader(folder, "train", T, B, rank=0, world_size=5, seed=4)  # 24 % 10 != 0
    with pytest.raises(DataError, match="not a multiple of world_size x micro_batch_size = 10.*world_size=2"):
        five.load_state_dict(sd)
    for L in two + [one, four, three, five]:
        L.close()


def test_epoch_multiple_makes_order_independent_of_world_size(folder):
    """With the epoch cut to a multiple of the global batch, 1 and 2 ranks see the same windows in
    the same global order across epoch boundaries (20,011 tokens / 64 = 312 windows; global 8)."""
    T, B, G = 64, 2, 8
    one = PackedLoader(folder, "train", T, B, seed=4, num_workers=0, epoch_multiple=G)
    two = [PackedLoader(folder, "train", T, B, rank=r, world_size=2, seed=4, num_workers=0, epoch_multiple=G)
           for r in range(2)]
    assert one.len_per_epoch * B == two[0].len_per_epoch * B * 2 == 312 // G * G
    steps = 2 * one.len_per_epoch + 3  # crosses two epoch boundaries
    seq_one = [one.next_batch().x for _ in range(steps)]
    seq_two = []
    for _ in range(steps // 2):
        seq_two += [two[0].next_batch().x, two[1].next_batch().x]
    assert all(torch.equal(a, b) for a, b in zip(seq_one, seq_two))
    with pytest.raises(ValueError, match="epoch_multiple"):
        PackedLoader(folder, "train", T, B, world_size=2, epoch_multiple=6)
    for L in [one, *two]:
        L.close()


def test_incompatible_state(folder, tmp_path, stream):
    with PackedLoader(folder, "train", 64, 2, seed=1, num_workers=0) as L:
        take(L, 2)
        sd = L.state_dict()
    for kw, key in [(dict(seq_len=32), "seq_len"), (dict(micro_batch_size=4), "micro_batch_size"),
                    (dict(seed=2), "seed")]:
        args = {**dict(seq_len=64, micro_batch_size=2, seed=1, num_workers=0), **kw}
        with PackedLoader(folder, "train", **args) as other:
            with pytest.raises(DataError, match=f"loader state has {key}=.*resume with"):
                other.load_state_dict(sd)
    other_data = write_prepared(tmp_path / "o", {"train": stream[::-1].copy()}, V, EOS, key="otherkey")
    with PackedLoader(other_data, "train", 64, 2, seed=1, num_workers=0) as other:
        with pytest.raises(DataError, match="data_key.*same data.source"):
            other.load_state_dict(sd)


def test_cu_seqlens_match_eos(folder, stream):
    T, B = 50, 4
    with PackedLoader(folder, "train", T, B, seed=2, doc_boundaries=True) as L:
        for b in take(L, 20):
            cu = b.cu_seqlens.tolist()
            assert b.cu_seqlens.dtype == torch.int32 and cu[0] == 0 and cu[-1] == B * T
            flat = b.x.reshape(-1).tolist()
            want = sorted({0, *range(0, B * T, T), *(i + 1 for i, t in enumerate(flat[:-1]) if t == EOS)})
            assert cu == want + [B * T]
            assert b.max_seqlen == max(np.diff(cu)) <= T
            for s, e in zip(cu[:-1], cu[1:]):  # EOS only ever ends a segment
                assert EOS not in flat[s:e - 1]


def test_doc_segments_small():
    x = np.array([[5, 0, 7, 8], [0, 9, 9, 0]])  # EOS=0
    cu, m = doc_segments(x, 0)
    assert cu.tolist() == [0, 2, 4, 5, 8] and m == 3


def test_val_fixed_order_reset_and_wrap(folder, tmp_path):
    with PackedLoader(folder, "val", 32, 2, seed=1, num_workers=1) as L:  # 300 tokens: 9 windows
        assert L.len_per_epoch == 4
        first = [b.x for b in take(L, 6)]
        L.reset()
        again = [b.x for b in take(L, 6)]
        assert all(torch.equal(a, b) for a, b in zip(first, again))
        assert torch.equal(first[4], first[0])  # epoch 2 repeats epoch 1: no shuffle
    tiny = write_prepared(tmp_path / "t", {"train": random_stream(5000, V, EOS),
                                           "val": np.array([7, 8, 9, EOS])}, V, EOS)
    with PackedLoader(tiny, "val", 16, 3, num_workers=0) as L:  # 4 tokens < one batch: wrap around
        b = L.next_batch()
        assert b.x.shape == (3, 16)
        assert b.x[0, :8].tolist() == [7, 8, 9, EOS, 7, 8, 9, EOS] and torch.equal(b.y[0, :-1], b.x[0, 1:])


def test_train_too_small(tmp_path):
    f = write_prepared(tmp_path / "s", {"train": random_stream(100, V, EOS)}, V, EOS)
    with pytest.raises(DataError, match="fewer than one step.*lower model.seq_len"):
        PackedLoader(f, "train", 64, 2)


def test_close_stops_threads(folder):
    import threading
    L = PackedLoader(folder, "train", 32, 2, num_workers=2)
    take(L, 3)
    L.close()
    L.close()  # idempotent
    assert not [t for t in threading.enumerate() if t.name.startswith("loader-train")]
    with pytest.raises(RuntimeError, match="closed"):
        L.next_batch()


def test_not_prepared_folder(tmp_path):
    with pytest.raises(DataError, match="not a complete prepared data folder"):
        PackedLoader(tmp_path, "train", 8, 1)
