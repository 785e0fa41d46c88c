// Kernel traits: tile sizes, warp counts and shared-memory layouts, all compile-time constants.
//
// Shared-memory layout: every tile is row-major with a row stride of (cols + 8) elements, i.e.
// 16 bytes of padding per row. ldmatrix reads 8 rows x 16 bytes at one column; with the pad, the
// 8 row starts fall in 8 different 16-byte bank groups for every head dim we use (row stride
// 144 / 208 / 272 bytes for d = 64 / 96 / 128 -> offsets mod 128 are all distinct), so the reads
// are conflict-free without an XOR swizzle. Cost: 6-12% more shared memory.
#pragma once
#include "utils.h"

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, typename elem_type,
          int kMinBlocks_ = 1>
struct Flash_fwd_kernel_traits {
    using T = elem_type;
    // Blocks per SM promised to the compiler (__launch_bounds__): caps registers per thread
    // at 65536 / (threads * kMinBlocks).
    static constexpr int kMinBlocks = kMinBlocks_;
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kBlockM = kBlockM_;   // query rows per thread block
    static constexpr int kBlockN = kBlockN_;   // keys per inner-loop step
    static constexpr int kNWarps = kNWarps_;
    static constexpr int kNThreads = kNWarps * 32;
    // FA2 partition: each warp owns kMTiles consecutive 16-row slabs of Q; all warps read the
    // same K/V tile.
    static constexpr int kMTiles = kBlockM / (16 * kNWarps);
    static_assert(kMTiles * 16 * kNWarps == kBlockM, "kBlockM must be a multiple of 16*warps");
    static_assert(kHeadDim % 32 == 0 && kBlockN % 16 == 0, "tile shape");
    static constexpr int kSmemStride = kHeadDim + 8;  // elements, see the padding note above
    static constexpr int kSmemQElems = kBlockM * kSmemStride;
    static constexpr int kSmemKVElems = kBlockN * kSmemStride;
    // Q (reused for the O epilogue) + double-buffered K and V.
    static constexpr int kSmemBytes = (kSmemQElems + 4 * kSmemKVElems) * int(sizeof(T));
};

// Backward: one thread block per (batch, head, key block of kBlockN keys); loops over query
// blocks of kBlockM rows. Warps own 16-key slabs of the key block (S^T, dP^T, dK, dV in registers);
// for dQ = dS K the warps are re-partitioned as (kBlockM/16) x kDQWarpsN.
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, typename elem_type,
          int kMinBlocks_ = 1, int kKsUnroll_ = 1, int kDQMTiles_ = 1>
struct Flash_bwd_kernel_traits {
    using T = elem_type;
    static constexpr int kMinBlocks = kMinBlocks_;
    // Unroll factor of the head-dim loop of S^T/dP^T (1 = rolled: fewer registers; more lets
    // the compiler overlap the next ldmatrix with this step's HMMAs).
    static constexpr int kKsUnroll = kKsUnroll_;
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kBlockM = kBlockM_;   // query rows per inner-loop step
    static constexpr int kBlockN = kBlockN_;   // keys per thread block
    static constexpr int kNWarps = kNWarps_;
    static constexpr int kNThreads = kNWarps * 32;
    static constexpr int kMTiles = kBlockN / (16 * kNWarps);  // 16-key slabs per warp
    static_assert(kMTiles * 16 * kNWarps == kBlockN, "kBlockN must be a multiple of 16*warps");
    static_assert(kBlockM % 16 == 0, "kBlockM must be a multiple of 16");
    // dQ partition: warps tile the (kBlockM x kHeadDim) output, kDQMTiles 16-row slabs each
    // (2 slabs: each K fragment read from shared memory feeds 2 HMMAs).
    static constexpr int kDQMTiles = kDQMTiles_;
    static constexpr int kDQWarpsM = kBlockM / (16 * kDQMTiles);
    static constexpr int kDQWarpsN = kNWarps / kDQWarpsM;
    static_assert(kDQWarpsM * 16 * kDQMTiles == kBlockM && kDQWarpsM * kDQWarpsN == kNWarps,
                  "warps must tile dQ");
    static constexpr int kDQCols = kHeadDim / kDQWarpsN;  // dQ columns per warp
    static_assert(kDQCols % 16 == 0, "dQ columns per warp must be a multiple of 16");

    static constexpr int kSmemStride = kHeadDim + 8;
    static constexpr int kSmemDSStride = kBlockM + 8;   // dS^T tile: (kBlockN keys) x (kBlockM queries)
    static constexpr int kSmemKVElems = kBlockN * kSmemStride;
    static constexpr int kSmemQElems = kBlockM * kSmemStride;
    static constexpr int kSmemDSElems = kBlockN * kSmemDSStride;
    // K, V (once) + double-buffered Q and dO + dS^T, then fp32 LSE and D (double-buffered).
    static constexpr int kSmemElems = 2 * kSmemKVElems + 4 * kSmemQElems + kSmemDSElems;
    static constexpr int kSmemBytes = kSmemElems * int(sizeof(T)) + 4 * kBlockM * int(sizeof(float));
};
