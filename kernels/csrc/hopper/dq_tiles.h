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
//   64. A sub-tile is in the order of the warpgroup's wgmma accumulator registers (the staging buffer
//   the consumers fill is a copy of it): registers 4q .. 4q + 3 of thread x (0..127) are float4 q * 128
//   + x, so each consumer stores its slice with 8 16-byte stores, a warp's 512 contiguous bytes at a
//   time (no bank conflict), and no address arithmetic per row (staged_float4 below).
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

// A warpgroup's m64n64 fp32 wgmma accumulator: thread x = 32 w + 4 g + t holds in register i the
// element (row 16 w + g + 8 ((i / 2) % 2), column 8 (i / 4) + 2 t + i % 2) of its 64 x 64 slice.
__host__ __device__ inline void acc_position(int x, int i, int &row, int &col) {
    const int w = x / 32, g = (x % 32) / 4, t = x % 4;
    row = 16 * w + g + 8 * ((i / 2) % 2);
    col = 8 * (i / 4) + 2 * t + i % 2;
}

// Float4 index in its sub-tile of registers 4q .. 4q + 3 of thread x.
__host__ __device__ inline int staged_float4(int q, int x) { return q * 128 + x; }

// The post-pass's unit, quad v (0 .. 255) of a sub-tile: float4s 4v .. 4v + 3, registers 4q .. 4q + 3 of
// threads 4g .. 4g + 3 of warp w (v = 32 q + 8 w + g): the first two floats of each are row 16 w + g,
// columns 8q .. 8q + 7 in order; the last two, row 16 w + g + 8, the same columns.
__host__ __device__ inline void quad_rows(int v, int &row, int &col) {
    row = 16 * ((v / 8) % 4) + v % 8;
    col = 8 * (v / 32);
}

// Row and column in the tile of sub-tile `sub`'s row r, column c.
__host__ __device__ inline void tile_position(int sub, int r, int c, int d, int &row, int &col) {
    row = d == 128 ? r : sub * 64 + r;
    col = (d == 128 ? sub * 64 : 0) + c;
}

}  // namespace dq_tiles
}  // namespace flash
