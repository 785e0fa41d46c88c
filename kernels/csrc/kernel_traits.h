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

// Backward with a 2-D warp layout (the FA2 paper's partition for large head dims): the warps tile
//   S^T / dP^T (kBlockN keys x kBlockM queries) as kWarpsK x kWarpsQ, each 16*kMTiles keys x
//       kQCols queries;
//   dK / dV    (kBlockN keys x kHeadDim)        as kWarpsK x kWarpsD, each 16*kMTiles keys x kDCols;
//   dQ         (kBlockM queries x kHeadDim)     as kDQWarpsM x kDQWarpsN.
// P^T and dS^T go through shared memory between the phases. Against the 1-D layout (16 keys per
// warp, every warp reading the whole Q and dO tile twice) this cuts shared-memory reads per HMMA by
// ~20% at the same dK/dV register budget (kernels/NOTES.md).
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kWarpsK_, typename elem_type,
          int kDQMTiles_ = 2>
struct Flash_bwd_2d_kernel_traits {
    using T = elem_type;
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kBlockM = kBlockM_;   // query rows per inner-loop step
    static constexpr int kBlockN = kBlockN_;   // keys per thread block
    static constexpr int kNWarps = kNWarps_;
    static constexpr int kNThreads = kNWarps * 32;
    static constexpr int kWarpsK = kWarpsK_;
    static constexpr int kWarpsQ = kNWarps / kWarpsK;
    static constexpr int kWarpsD = kNWarps / kWarpsK;
    static constexpr int kMTiles = kBlockN / (16 * kWarpsK);   // 16-key slabs per warp
    static constexpr int kQCols = kBlockM / kWarpsQ;           // queries per warp in S^T / dP^T
    static constexpr int kDCols = kHeadDim / kWarpsD;          // head-dim columns per warp in dK / dV
    static_assert(kWarpsK * kWarpsQ == kNWarps && kMTiles * 16 * kWarpsK == kBlockN, "key tiling");
    static_assert(kQCols % 16 == 0 && kQCols * kWarpsQ == kBlockM, "query tiling");
    static_assert(kDCols % 16 == 0 && kDCols * kWarpsD == kHeadDim, "head-dim tiling");
    static constexpr int kDQMTiles = kDQMTiles_;
    static constexpr int kDQWarpsM = kBlockM / (16 * kDQMTiles);
    static constexpr int kDQWarpsN = kNWarps / kDQWarpsM;
    static_assert(kDQWarpsM * 16 * kDQMTiles == kBlockM && kDQWarpsM * kDQWarpsN == kNWarps,
                  "warps must tile dQ");
    static constexpr int kDQCols = kHeadDim / kDQWarpsN;
    static_assert(kDQCols % 16 == 0 && kDQCols * kDQWarpsN == kHeadDim, "dQ columns per warp");

    static constexpr int kSmemStride = kHeadDim + 8;
    static constexpr int kSmemPStride = kBlockM + 8;   // P^T / dS^T tiles: keys x queries
    static constexpr int kSmemKVElems = kBlockN * kSmemStride;
    static constexpr int kSmemQElems = kBlockM * kSmemStride;
    static constexpr int kSmemPElems = kBlockN * kSmemPStride;
    // K, V (once) + double-buffered Q and dO + P^T and dS^T, then fp32 LSE and D (double-buffered).
    static constexpr int kSmemElems = 2 * kSmemKVElems + 4 * kSmemQElems + 2 * kSmemPElems;
    static constexpr int kSmemBytes = kSmemElems * int(sizeof(T)) + 4 * kBlockM * int(sizeof(float));
};
