// The tiled dQ accumulator of the Hopper TMA backward (flash_bwd_sm90_ws.h) and its post-pass
// (flash_bwd_preprocess.h).
//
// Why: the backward adds each query block's fp32 dQ (32 KB) into the accumulator with the
// bulk unit. In the row-major (b, s, h, d) layout a query's row is 512 bytes (256 at head dim 64)
// away from the next one's, one bulk instruction each: 64 (128) instructions per block, ~3450 SM
// clocks per 32 KB with all 132 SMs adding, ~4400 in the kernel beside its TMA
// loads -- the step's critical path (an SM-clock trace: the consumers waited ~1200 of each ~5100-
// clock step for the bulk unit). Two 16 KB instructions move a block in ~2550: the backward runs at
// 578 TFLOP/s against 481 with the row-major layout (head dim 128, causal 8k, H100).
// So the accumulator is stored as whole query blocks ("tiles") of 8192 floats, 32 KB contiguous:
//   tile rows TR = 8192 / d (64 at head dim 128, 128 at 64: the kernel's query block);
//   tile (b, h, m) -- queries TR m .. of head h of sequence b -- at float offset
//     (h * tiles_per_head + first_tile(b) + m) * 8192,
//   first_tile(b) = b * ceil(seqlen_q / TR), or packed (varlen) floor(q_start / TR) + b: each
//   sequence's tiles stay clear of the next one's (its first tile index grows by at least its own
//   tile count); tiles_per_head = b * ceil(seqlen_q / TR), or packed ceil(total_q / TR) + b + 1.
//   A tile is two 16 KB sub-tiles of 64 rows x 64 columns, one per consumer warpgroup and one bulk
//   instruction each: head-dim columns 0..63 / 64..127 at head dim 128, queries 0..63 / 64..127 at
//   64. In a sub-tile, row r holds 16 chunks of 4 floats, chunk c stored at position chunk_slot(c, r)
//   (below): the swizzle that keeps the consumers' shared-memory staging stores (the staging buffer
//   is a copy of the tile) free of bank conflicts.
// Rows past a sequence's end are added to (zeros: their dS is masked) but never read back.
// Packed batches of many sequences much shorter than a tile would need several times the row-major
// size (the + b term): flash_api.cpp then allocates row-major room only and the TMA backward declines
// (run_flash_bwd_sm90_ws returns false), leaving the batch to the row-major kernels.
#pragma once
#include <cstdint>
#include "../flash.h"

namespace flash {
namespace dq_tiles {

constexpr int kFloats = 8192, kSubFloats = 64 * 64;

__host__ __device__ inline bool supported(int d) { return d == 64 || d == 128; }
__host__ __device__ inline int tile_rows(int d) { return kFloats / d; }
__host__ __device__ inline int cdiv_rows(int64_t n, int d) { return int((n + tile_rows(d) - 1) / tile_rows(d)); }

// d: the head dim (p.d), an argument of its own so that kernels templated on it divide by a constant.

// Tiles per head (the accumulator holds h * tiles_per_head * kFloats floats).
__host__ __device__ inline int64_t tiles_per_head(const Flash_bwd_params &p, int d) {
    return p.cu_seqlens_q != nullptr ? int64_t(cdiv_rows(p.total_q, d)) + p.b + 1
                                     : int64_t(p.b) * cdiv_rows(p.seqlen_q, d);
}

// Floats the tiled accumulator needs.
__host__ __device__ inline int64_t floats_needed(const Flash_bwd_params &p) {
    return int64_t(p.h) * tiles_per_head(p, p.d) * kFloats;
}

// Float offset of tile (b, h, 0); q_start: the sequence's first row (packed), else unused.
__host__ __device__ inline int64_t tile_offset(const Flash_bwd_params &p, int d, int b, int h, int q_start) {
    const int64_t first = p.cu_seqlens_q != nullptr ? int64_t(q_start / tile_rows(d)) + b
                                                    : int64_t(b) * cdiv_rows(p.seqlen_q, d);
    return (int64_t(h) * tiles_per_head(p, d) + first) * kFloats;
}

// Position of chunk c (0 .. 15: floats 4c .. 4c + 3) in row r of a sub-tile (rows of 256 bytes, so
// every row starts at bank 0). The consumers stage dQ from wgmma accumulators with 8-byte stores,
// which shared memory serves half a warp at a time: per store, half a warp writes rows r % 8 = 0..3
// (or 4..7), chunks 2j and 2j + 1 of each. XOR with 2 (r % 8) puts those 8 chunks at 8 positions that
// differ mod 8, i.e. on all 32 banks: one wavefront per half-warp (c ^ (r % 8) keeps a half-warp's
// chunks within 4 positions, a 2-way conflict). Its own inverse for a fixed r.
__host__ __device__ inline int chunk_slot(int c, int r) { return c ^ (2 * (r % 8)); }

// Row and column (in the tile) of the 4 floats at float4 index i (0 .. 2047) of a tile.
__host__ __device__ inline void chunk_position(int i, int d, int &row, int &col) {
    const int sub = i / (kSubFloats / 4), r = (i / 16) % 64, c = chunk_slot(i % 16, r);
    row = d == 128 ? r : sub * 64 + r;
    col = (d == 128 ? sub * 64 : 0) + c * 4;
}

}  // namespace dq_tiles
}  // namespace flash
