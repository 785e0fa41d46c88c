"""Whether the attention kernels' local-window tile arithmetic visits, masks and orders the right tiles,
checked on a CPU against kernels.reference.window_mask for many small shapes (no GPU, no build).

A transcription, in Python, of every tile-range computation the kernels make under a window
(window_size = (left, right), flash.h's Window, the binding's conversion in flash_api.cpp
fill_fwd_params, C++ int arithmetic: `/` truncates toward zero -- _div):
  FA2 forward (flash_fwd_kernel.h): n_block_min / n_block_max / n_inside_min / n_inside_max, need_mask
    and the element mask; the Is_even kernel where the launch template sends a call there.
  Hopper forward (hopper/flash_fwd_sm90_ws.h, fwd_consumer.h): local_key_range in the producer (tiles
    loaded) and in the consumers (tiles run), mask_window's per-warp `inside` test and element mask.
  FA2 backward (flash_bwd_common.h BwdRange: make, apply_window, need_mask, masked, dq_order) and the
    Hopper backward's Is_local path (hopper/flash_bwd_sm90_ws.h: also masks queries >= sq).
For each (seqlen_q, seqlen_k, left, right, causal), dense and packed (the binding's bounds are then the
batch's longest sequences, so a side may stay bounded although it bounds nothing in this sequence),
and each kernel's tile sizes, it builds the (sq, sk) matrix of pairs the kernel lets through (a visited
tile, unmasked there) and requires it to equal window_mask; also: visited tiles / query blocks inside
the sequence, no unmasked key past sk (nor, Hopper backward, query past sq), the producer's and the
consumers' key-tile sequences equal, and, for the deterministic backward, that the key blocks adding to
a query block's dQ carry the orders 0, 1, ..., count - 1 in key-block order (else a GPU deadlocks).

The functions mirror the C++ line by line (names as there): a change to that arithmetic is to be made
here too, then this run again.
Run (CPU, one core): PYTHONPATH=$PWD python dev/window_ranges_check.py [--quick] [--random N]
(the full grid: ~290k cases, ~20 min; --quick: ~7k cases, ~30 s). Exit status 1 and the first
failures printed when any check fails.
"""
from __future__ import annotations

import argparse
import itertools
import random
import sys

import numpy as np

from kernels.reference import window_mask

K_NO_WINDOW = 1 << 30  # flash_fwd_kernel.h kNoWindow


def _div(a: int, b: int) -> int:
    """C++ int division (truncates toward zero)."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b > 0) else -q


def cdiv(a: int, b: int) -> int:  # utils.h
    return _div(a + b - 1, b)


class Window:  # flash_fwd_kernel.h
    def __init__(self, wl: int | None = None, wr: int | None = None):
        if wl is None:  # the default constructor: unbounded
            self.left = self.right = K_NO_WINDOW
        else:
            self.left = K_NO_WINDOW if wl < 0 else wl
            self.right = K_NO_WINDOW if wr < 0 else wr

    def first_key(self, row, off):
        return row + off - self.left

    def last_key(self, row, off):
        return row + off + self.right

    def masked(self, key, row, off):
        return (key < self.first_key(row, off)) | (key > self.last_key(row, off))


def binding_window(left, right, causal, max_q, max_k):
    """flash_api.cpp fill_fwd_params: (window_left, window_right) as the kernels read them."""
    wl = -1 if left >= max_k else left
    wr = -1 if right >= max_q else right
    if causal and wr >= 0:
        wr = -1
    return wl, wr


def has_window(wl, wr):
    return wl >= 0 or wr >= 0


class Fail(Exception):
    pass


def _keys_rows(sq, sk):
    rows = np.arange(sq)[:, None]
    keys = np.arange(sk)[None, :]
    return rows, keys


# ---- FA2 forward -------------------------------------------------------------------------------
def fa2_fwd(sq, sk, wl, wr, causal, varlen, BM, BN):
    """The (sq, sk) pairs the FA2 forward lets through, checking tile indices on the way."""
    off = sk - sq
    is_even = (not varlen) and sq % BM == 0 and sk % BN == 0 and not has_window(wl, wr)
    rows, keys = _keys_rows(sq, sk)
    if is_even:
        win = None
        elem_masked = (keys >= sk) | (causal & (keys > rows + off))
    else:
        win = Window(wl, wr)
        if causal:
            win.right = min(win.right, 0)
        elem_masked = (keys >= sk) | win.masked(keys, rows, off)
    seen = np.zeros((sq, sk), dtype=bool)
    n_keys_tiles = cdiv(sk, BN)
    for m_block in range(cdiv(sq, BM)):
        rows_left = sq - m_block * BM
        # FwdBlock::make
        n_block_max = cdiv(sk, BN)
        if causal:
            last_key = min(sq, (m_block + 1) * BM) - 1 + off
            n_block_max = 0 if last_key < 0 else min(n_block_max, _div(last_key, BN) + 1)
        n_block_min = n_inside_min = n_inside_max = 0
        if not is_even:
            last_key = win.last_key(m_block * BM + min(rows_left, BM) - 1, off)
            n_block_max = 0 if last_key < 0 else min(n_block_max, _div(last_key, BN) + 1)
            n_block_min = _div(max(0, win.first_key(m_block * BM, off)), BN)
            fklr = win.first_key(m_block * BM + BM - 1, off)
            lkfr = win.last_key(m_block * BM, off)
            n_inside_min = 0 if fklr <= 0 else cdiv(fklr, BN)
            n_inside_max = 0 if lkfr < 0 else _div(lkfr + 1, BN)
        if n_block_max <= n_block_min:
            continue  # write_empty: O = 0, LSE = +inf for the block's rows
        r0, r1 = m_block * BM, min(sq, m_block * BM + BM)
        n_block = n_block_max - 1
        while n_block >= n_block_min:
            if not 0 <= n_block < n_keys_tiles:
                raise Fail(f"key tile {n_block} outside [0, {n_keys_tiles}) at m_block {m_block}")
            if is_even:
                need_mask = causal and (n_block + 1) * BN - 1 > m_block * BM + off
            else:
                need_mask = (n_block + 1) * BN > sk or n_block < n_inside_min or n_block >= n_inside_max
            k0, k1 = n_block * BN, min(sk, n_block * BN + BN)
            if not need_mask and n_block * BN + BN > sk:
                raise Fail(f"unmasked key tile {n_block} runs past sk at m_block {m_block}")
            seen[r0:r1, k0:k1] |= ~elem_masked[r0:r1, k0:k1] if need_mask else True
            n_block -= 1
    return seen


# ---- Hopper forward (Is_local) -----------------------------------------------------------------
def local_key_range(wl, wr, causal, BN, row_start, rows, sq, sk):
    win = Window(wl, wr)
    if causal:
        win.right = min(win.right, 0)
    off = sk - sq
    last_key = win.last_key(row_start + rows - 1, off)
    n_max = 0 if last_key < 0 else min(cdiv(sk, BN), _div(last_key, BN) + 1)
    n_min = _div(max(0, win.first_key(row_start, off)), BN)
    return n_min, max(0, n_max - n_min)


def hopper_fwd(sq, sk, wl, wr, causal, varlen, NC):
    BM, BN = 64 * NC, 128
    off = sk - sq
    win = Window(wl, wr)
    if causal:
        win.right = min(win.right, 0)
    rows, keys = _keys_rows(sq, sk)
    elem_masked = (keys >= sk) | win.masked(keys, rows, off)
    seen = np.zeros((sq, sk), dtype=bool)
    # The grid's query blocks: cdiv(params.seqlen_q, BM); packed, params.seqlen_q is the longest sequence.
    num_blocks = cdiv(sq, BM) + (2 if varlen else 0)
    for m_block in range(num_blocks):
        # producer
        row_x = m_block * BM  # block_rows<BM, false>
        if m_block * BM >= sq:
            p_tiles, p_first = -1, 0
        else:
            p_first, p_tiles = local_key_range(wl, wr, causal, BN, row_x, min(sq - row_x, BM), sq, sk)
        loaded = []
        if p_tiles > 0:
            row = (p_first + p_tiles - 1) * BN
            while row >= p_first * BN:
                loaded.append(row // BN)
                row -= BN
        # consumers
        if p_tiles < 0:
            continue
        row_start = m_block * BM
        rows_left = sq - m_block * BM  # FwdBlock::make
        c_first, c_tiles = local_key_range(wl, wr, causal, BN, row_start, min(rows_left, BM), sq, sk)
        if c_tiles <= 0:
            if loaded:
                raise Fail(f"m_block {m_block}: producer loads {loaded}, consumers run none")
            continue
        run = [c_first + c_tiles - 1 - it for it in range(c_tiles)]
        if run != loaded:
            raise Fail(f"m_block {m_block}: producer loads {loaded}, consumers run {run}")
        for n_block in run:
            if not 0 <= n_block < cdiv(sk, BN):
                raise Fail(f"key tile {n_block} outside [0, {cdiv(sk, BN)}) at m_block {m_block}")
        for cw in range(NC):
            for warp in range(4):
                qrow0 = row_start + cw * 64 + warp * 16
                r0, r1 = qrow0, min(sq, qrow0 + 16)
                if r0 >= r1:
                    continue  # rows past the sequence: never stored
                for n_block in run:
                    key0, key_end = n_block * BN, n_block * BN + BN
                    inside = (key_end <= sk and key0 >= win.first_key(qrow0 + 15, off)
                              and key_end - 1 <= win.last_key(qrow0, off))
                    k1 = min(sk, key_end)
                    seen[r0:r1, key0:k1] |= True if inside else ~elem_masked[r0:r1, key0:k1]
    return seen


# ---- backward (FA2 1-D / 2-D, Hopper Is_local) -------------------------------------------------
class BwdRange:
    def __init__(self, sq, sk, n_block, BM, BN, causal):  # make
        self.keys_left = sk - n_block * BN
        self.causal_off = sk - sq
        self.m_min = _div(max(0, n_block * BN - self.causal_off), BM) if causal else 0
        self.m_max = cdiv(sq, BM)
        self.sk = sk
        self.win = Window()

    def apply_window(self, wl, wr, causal, n_block, BM, BN):
        self.win = Window(wl, wr)
        if causal:
            self.win.right = min(self.win.right, 0)
        first_q = n_block * BN - self.causal_off - self.win.right
        last_q = n_block * BN + min(self.keys_left, BN) - 1 - self.causal_off + self.win.left
        self.m_min = max(self.m_min, _div(max(0, first_q), BM))
        self.m_max = 0 if last_q < 0 else min(self.m_max, _div(last_q, BM) + 1)

    def need_mask(self, causal, is_even, m, n_block, BM, BN):
        if is_even:
            return causal and n_block * BN + BN - 1 > m * BM + self.causal_off
        return (self.keys_left < BN or n_block * BN < self.win.first_key(m * BM + BM - 1, self.causal_off)
                or n_block * BN + BN - 1 > self.win.last_key(m * BM, self.causal_off))

    def masked(self, causal, is_even, key, q):
        if is_even:
            return (key >= self.sk) | (causal & (key > q + self.causal_off))
        return (key >= self.sk) | self.win.masked(key, q, self.causal_off)

    def dq_order(self, is_even, m, n_block, BM, BN):
        if is_even:
            return n_block
        return n_block - _div(max(0, self.win.first_key(m * BM, self.causal_off)), BN)


def bwd(sq, sk, wl, wr, causal, varlen, BM, BN, hopper):
    """(seen, orders): the pairs the backward lets through; orders[m] = [(n_block, dq order), ...]."""
    local = has_window(wl, wr)
    if hopper:
        if not local:
            return None, None  # the unwindowed Hopper kernels: not this branch's code
        is_even = False
    else:
        is_even = (not varlen) and sq % BM == 0 and sk % BN == 0 and not local
    rows, keys = _keys_rows(sq, sk)
    seen = np.zeros((sq, sk), dtype=bool)
    num_m = cdiv(sq, BM)
    orders = {m: [] for m in range(num_m)}
    num_n = cdiv(sk, BN) + (2 if varlen else 0)  # packed: the grid is for the longest sequence
    for n_block in range(num_n):
        if n_block * BN >= sk:
            continue
        r = BwdRange(sq, sk, n_block, BM, BN, causal)
        if not is_even:  # FA2: apply_window unless Is_even; Hopper: Is_local
            r.apply_window(wl, wr, causal, n_block, BM, BN)
        k0, k1 = n_block * BN, min(sk, n_block * BN + BN)
        skipped = ([], [])  # per warpgroup, per visited query block: half_empty
        for m in range(r.m_min, r.m_max):
            if not 0 <= m < num_m:
                raise Fail(f"query block {m} outside [0, {num_m}) at key block {n_block}")
            if hopper:
                need_mask = r.need_mask(causal, False, m, n_block, BM, BN) or (m + 1) * BM > sq
            else:
                need_mask = r.need_mask(causal, is_even, m, n_block, BM, BN)
            if not need_mask and r.keys_left < BN:
                raise Fail(f"unmasked key block {n_block} runs past sk (query block {m})")
            if hopper and not need_mask and (m + 1) * BM > sq:
                raise Fail(f"unmasked query block {m} runs past sq (key block {n_block})")
            q0, q1 = m * BM, min(sq, m * BM + BM)
            # Hopper head dim 128: a consumer warpgroup (keys 64 cw ..) whose half is empty (half_empty)
            # skips it; its pairs are then not let through.
            halves = [(k0, k1)]
            if hopper and BM == 64:
                empty = [half_empty(r, sk, n_block, cw, m, BM, BN) for cw in (0, 1)]
                if all(empty):
                    raise Fail(f"both warpgroups skip query block {m} at key block {n_block}")
                for cw in (0, 1):
                    skipped[cw].append(empty[cw])
                halves = [(k0 + 64 * cw, min(k1, k0 + 64 * cw + 64)) for cw in (0, 1) if not empty[cw]]
            for h0, h1 in halves:
                if h0 >= h1:
                    continue
                if need_mask:
                    el = r.masked(causal, is_even, keys[:, h0:h1], rows[q0:q1])
                    seen[q0:q1, h0:h1] |= ~el
                else:
                    seen[q0:q1, h0:h1] = True
            orders[m].append((n_block, r.dq_order(False if hopper else is_even, m, n_block, BM, BN)))
        if hopper and BM == 64:  # the skips skip no wait a later step needs (flash_bwd_sm90_ws.h)
            s0, s1 = skipped
            if any(s0) and (not s0[-1] or s0 != sorted(s0)):
                raise Fail(f"key block {n_block}: the first warpgroup's skipped blocks are not a suffix: {s0}")
            if any(s1) and not all(s1) and s1 != sorted(s1, reverse=True):
                raise Fail(f"key block {n_block}: the second warpgroup's skipped blocks are not a prefix: {s1}")
    return seen, orders


def half_empty(r, sk, n_block, cw, m, BM, BN):
    """hopper/flash_bwd_sm90_ws.h half_empty: no key of warpgroup cw's 64 is visible to a query of
    block m (the kernel's local form; its causal form, used by the lock-step loop, is this one with the
    window unbounded on the left)."""
    first_key, q0 = n_block * BN + 64 * cw, m * BM
    q1 = q0 + BM - 1
    if first_key >= sk:
        return True
    return first_key > r.win.last_key(q1, r.causal_off) or first_key + 63 < r.win.first_key(q0, r.causal_off)


def check_orders(orders, hopper):
    for m, lst in orders.items():
        lst.sort()
        got = [o for _, o in lst]
        if got != list(range(len(got))):
            raise Fail(f"deterministic dQ of query block {m}: key blocks {[n for n, _ in lst]} wait for "
                       f"counts {got} (a GPU deadlocks unless 0, 1, ..)")
        ns = [n for n, _ in lst]
        if ns and ns != list(range(ns[0], ns[0] + len(ns))):
            raise Fail(f"query block {m}: the key blocks adding to it are not consecutive: {ns}")


FWD_KERNELS = [("fa2_fwd hd64/128", lambda *a: fa2_fwd(*a, 128, 64)),
               ("fa2_fwd hd96", lambda *a: fa2_fwd(*a, 128, 32)),
               ("hopper_fwd hd64", lambda *a: hopper_fwd(*a, 3)),
               ("hopper_fwd hd128", lambda *a: hopper_fwd(*a, 2))]
BWD_KERNELS = [("fa2_bwd hd64", 32, 128, False), ("fa2_bwd hd96/128", 64, 128, False),
               ("hopper_bwd hd64", 128, 128, True), ("hopper_bwd hd128", 64, 128, True)]


def check_case(sq, sk, left, right, causal):
    """Every kernel, dense and packed (bounds from this sequence, or from a longer one in the batch)."""
    ref = window_mask(sq, sk, causal, (left, right)).numpy()
    for varlen, (max_q, max_k) in ((False, (sq, sk)), (True, (sq, sk)), (True, (4096, 4096))):
        wl, wr = binding_window(left, right, causal, max_q, max_k)
        tag = f"sq={sq} sk={sk} window=({left}, {right}) causal={causal} " + \
              (f"packed (max {max_q}, {max_k}) -> ({wl}, {wr})" if varlen else f"dense -> ({wl}, {wr})")
        for name, fn in FWD_KERNELS:
            if name.startswith("hopper") and not has_window(wl, wr):
                continue  # the unwindowed Hopper kernels: not this branch's code
            try:
                seen = fn(sq, sk, wl, wr, causal, varlen)
            except Fail as e:
                raise Fail(f"{name} {tag}: {e}") from None
            _compare(seen, ref, f"{name} {tag}")
        for name, BM, BN, hopper in BWD_KERNELS:
            try:
                seen, orders = bwd(sq, sk, wl, wr, causal, varlen, BM, BN, hopper)
                if seen is None:
                    continue
                check_orders(orders, hopper)
            except Fail as e:
                raise Fail(f"{name} {tag}: {e}") from None
            _compare(seen, ref, f"{name} {tag}")


def _compare(seen, ref, tag):
    if not np.array_equal(seen, ref):
        extra = np.argwhere(seen & ~ref)
        missing = np.argwhere(ref & ~seen)
        raise Fail(f"{tag}: {len(extra)} (row, key) pairs let through that the window masks (first "
                   f"{extra[:3].tolist()}), {len(missing)} it allows that are never visited (first "
                   f"{missing[:3].tolist()})")


LENGTHS = [1, 2, 3, 5, 16, 31, 32, 33, 63, 64, 65, 96, 127, 128, 129, 150, 191, 192, 193, 255, 256, 257, 300]
SIDES = [-1, 0, 1, 2, 31, 32, 33, 63, 64, 65, 127, 128, 129, 191, 192, 193, 255, 256, 299, 300, 301, 1000]
QUICK_LENGTHS = [1, 5, 63, 64, 65, 129, 192, 193, 300]
QUICK_SIDES = [-1, 0, 1, 63, 64, 128, 129, 300]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small grid (seconds)")
    ap.add_argument("--random", type=int, default=0, help="also N random cases, lengths 1-300, sides -1-350")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    lengths, sides = (QUICK_LENGTHS, QUICK_SIDES) if args.quick else (LENGTHS, SIDES)
    cases = []
    for sq, sk in itertools.product(lengths, lengths):
        for left, right in itertools.product(sides, sides):
            cases.append((sq, sk, left, right, False))
        for left, right in itertools.product(sides, [-1, 0, 5]):  # causal: a right side folds to 0
            cases.append((sq, sk, left, right, True))
    rng = random.Random(args.seed)
    for _ in range(args.random):
        cases.append((rng.randint(1, 300), rng.randint(1, 300), rng.randint(-1, 350), rng.randint(-1, 350),
                      rng.random() < 0.5))
    failures = []
    for i, case in enumerate(cases):
        try:
            check_case(*case)
        except Fail as e:
            failures.append(str(e))
            if len(failures) >= 10:
                break
    for f in failures:
        print("FAIL", f)
    print(f"{len(cases) if not failures else i + 1} cases checked, {len(failures)} failing")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
