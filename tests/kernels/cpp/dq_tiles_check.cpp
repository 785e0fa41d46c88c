// Host checks of the tiled dQ accumulator's layout (kernels/csrc/hopper/dq_tiles.h), built and run by
// tests/kernels/test_dq_tiles_cpu.py:
//   1. the consumers' staging (bwd_consumer.h store_acc_subtile: thread x's registers 4q .. 4q + 3 at
//      float4 staged_float4(q, x)) and the post-pass's reading (quad v: float4s 4v .. 4v + 3 as two rows'
//      8-column runs, quad_rows) agree: every register of every thread lands where the post-pass reads
//      its element (acc_position), and each sub-tile's 4096 cells are read exactly once; the tile's two
//      sub-tiles cover its rows and columns once at head dims 64 and 128;
//   2. each warp's 16-byte staging store writes 512 contiguous bytes (no bank conflict);
//   3. the tiles of packed (varlen) sequences never overlap and fit in tiles_per_head, for random
//      sequence lengths (zero-length ones included), and dense batches tile without gaps.
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

int main() {
    // float index in a sub-tile -> (row, col) as the post-pass reads it
    std::vector<std::pair<int, int>> read_as(dq_tiles::kSubFloats, {-1, -1});
    for (int v = 0; v < dq_tiles::kSubFloats / 16; ++v) {
        int r, c;
        dq_tiles::quad_rows(v, r, c);
        for (int i = 0; i < 4; ++i)      // float4 4v + i: columns c + 2i, + 1 of rows r and r + 8
            for (int e = 0; e < 4; ++e)  // .x .y: row r; .z .w: row r + 8
                read_as[(4 * v + i) * 4 + e] = {r + 8 * (e / 2), c + 2 * i + e % 2};
    }
    std::set<std::pair<int, int>> cells(read_as.begin(), read_as.end());
    if (int(cells.size()) != dq_tiles::kSubFloats) return fail("post-pass reads a cell twice", long(cells.size()), 0);
    for (auto [r, c] : cells)
        if (r < 0 || r >= 64 || c < 0 || c >= 64) return fail("post-pass cell outside the sub-tile", r, c);
    for (int x = 0; x < 128; ++x)
        for (int i = 0; i < 32; ++i) {
            int r, c;
            dq_tiles::acc_position(x, i, r, c);
            const int at = dq_tiles::staged_float4(i / 4, x) * 4 + i % 4;
            if (at < 0 || at >= dq_tiles::kSubFloats) return fail("staged outside the sub-tile", x, i);
            if (read_as[at] != std::make_pair(r, c)) return fail("staged where the post-pass reads another cell", x, i);
        }
    for (int q = 0; q < 8; ++q)
        for (int w = 0; w < 4; ++w)
            for (int lane = 0; lane < 32; ++lane)
                if (dq_tiles::staged_float4(q, 32 * w + lane) != dq_tiles::staged_float4(q, 32 * w) + lane)
                    return fail("a warp's staging store is not contiguous", q, w);
    for (int d : {64, 128}) {
        std::set<std::pair<int, int>> seen;
        for (int sub = 0; sub < 2; ++sub)
            for (auto [r, c] : cells) {
                int row, col;
                dq_tiles::tile_position(sub, r, c, d, row, col);
                if (row < 0 || row >= dq_tiles::tile_rows(d) || col < 0 || col >= d) return fail("cell outside the tile", row, col);
                if (!seen.insert({row, col}).second) return fail("tile cell written twice", row, col);
            }
        if (int(seen.size()) != dq_tiles::kFloats) return fail("tile cells missed", d, long(seen.size()));
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
