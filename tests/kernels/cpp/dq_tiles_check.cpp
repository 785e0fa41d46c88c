// Host checks of the tiled dQ accumulator's layout (kernels/csrc/hopper/dq_tiles.h), built and run by
// tests/kernels/test_dq_tiles_cpu.py:
//   1. chunk_position maps a tile's 2048 float4 slots one-to-one onto its (row, 4-column chunk)
//      cells, at head dims 64 and 128;
//   2. the tiles of packed (varlen) sequences never overlap and fit in tiles_per_head, for random
//      sequence lengths (zero-length ones included), and dense batches tile without gaps;
//   3. the consumers' staging stores (bwd_consumer.h store_acc_subtile: thread (warp, g = lane / 4,
//      t = lane % 4) writes floats (row warp * 16 + g + 8 hr, columns 8j + 2t, + 1) with one 8-byte
//      store per (hr, j)) are free of bank conflicts: shared memory serves an 8-byte store half a warp
//      at a time, and each half-warp's 16 stores must cover the 32 banks once;
//   4. float4 slots 2p and 2p + 1 of a tile are columns c .. c + 7 of one row, c a multiple of 8 (the
//      post-pass converts them with one 16-byte store).
// Prints "ok" and exits 0, or names the first failure and exits 1.
#include <cstdio>
#include <cstdlib>
#include <random>
#include <set>
#include <utility>
#include <vector>
#include "../../../kernels/csrc/hopper/dq_tiles.h"

using namespace flash;

static int fail(const char *what, long a, long b) {
    std::printf("FAIL: %s (%ld, %ld)\n", what, a, b);
    return 1;
}

// Byte offset in a staging sub-tile of float (row, col): rows of 256 bytes, 16-byte chunks at chunk_slot.
static int staged_byte(int row, int col) { return row * 256 + dq_tiles::chunk_slot(col / 4, row) * 16 + (col % 4) * 4; }

int main() {
    for (int warp = 0; warp < 4; ++warp)
        for (int hr = 0; hr < 2; ++hr)
            for (int j = 0; j < 8; ++j)
                for (int half = 0; half < 2; ++half) {
                    int words_on_bank[32] = {0};
                    for (int lane = 16 * half; lane < 16 * half + 16; ++lane) {
                        const int g = lane / 4, t = lane % 4, off = staged_byte(warp * 16 + g + 8 * hr, 8 * j + 2 * t);
                        if (off % 8 != 0 || staged_byte(warp * 16 + g + 8 * hr, 8 * j + 2 * t + 1) != off + 4)
                            return fail("staging store not one aligned 8-byte pair", lane, off);
                        ++words_on_bank[(off / 4) % 32];
                        ++words_on_bank[(off / 4 + 1) % 32];
                    }
                    for (int bank = 0; bank < 32; ++bank)
                        if (words_on_bank[bank] != 1) return fail("staging store bank conflict (warp, bank)", warp, bank);
                }
    for (int d : {64, 128}) {
        std::set<std::pair<int, int>> seen;
        for (int i = 0; i < dq_tiles::kFloats / 4; ++i) {
            int r, c;
            dq_tiles::chunk_position(i, d, r, c);
            if (r < 0 || r >= dq_tiles::tile_rows(d) || c < 0 || c >= d || c % 4 != 0) return fail("cell outside the tile", r, c);
            if (!seen.insert({r, c}).second) return fail("cell written twice", r, c);
        }
        if (int(seen.size()) != dq_tiles::kFloats / 4) return fail("cells missed", d, long(seen.size()));
        for (int p = 0; p < dq_tiles::kFloats / 8; ++p) {
            int r0, c0, r1, c1;
            dq_tiles::chunk_position(2 * p, d, r0, c0);
            dq_tiles::chunk_position(2 * p + 1, d, r1, c1);
            if (r1 != r0 || c1 != c0 + 4 || c0 % 8 != 0) return fail("slot pair not 8 aligned columns of a row", d, p);
        }
    }
    std::mt19937 rng(1234);
    for (int trial = 0; trial < 2000; ++trial) {
        Flash_bwd_params p{};
        p.d = trial % 2 ? 64 : 128;
        p.h = 1 + int(rng() % 3);
        p.b = 1 + int(rng() % 9);
        const bool packed = trial % 3 != 0;
        std::vector<int> cu(p.b + 1, 0);
        int max_len = 0;
        for (int i = 0; i < p.b; ++i) {
            const int len = rng() % 5 == 0 ? 0 : 1 + int(rng() % 700);
            cu[i + 1] = cu[i] + len;
            max_len = std::max(max_len, len);
        }
        std::vector<int> lens(p.b);
        for (int i = 0; i < p.b; ++i) lens[i] = packed ? cu[i + 1] - cu[i] : max_len;
        p.cu_seqlens_q = packed ? cu.data() : nullptr;  // only compared with nullptr on the host
        p.seqlen_q = max_len;
        p.total_q = packed ? cu[p.b] : p.b * max_len;
        const int64_t per_head = dq_tiles::tiles_per_head(p, p.d);
        std::vector<int> owner(size_t(p.h * per_head), -1);
        for (int h = 0; h < p.h; ++h)
            for (int b = 0; b < p.b; ++b) {
                const int64_t first = dq_tiles::tile_offset(p, p.d, b, h, packed ? cu[b] : 0) / dq_tiles::kFloats;
                for (int m = 0; m < dq_tiles::cdiv_rows(lens[b], p.d); ++m) {
                    const int64_t t = first + m;
                    if (t < h * per_head || t >= (h + 1) * per_head) return fail("tile outside its head", trial, long(t));
                    if (owner[size_t(t)] != -1) return fail("tiles overlap", trial, long(t));
                    owner[size_t(t)] = b;
                }
            }
        if (!packed)
            for (size_t t = 0; t < owner.size(); ++t)
                if (max_len > 0 && owner[t] == -1) return fail("dense layout has a gap", trial, long(t));
    }
    std::printf("ok\n");
    return 0;
}
