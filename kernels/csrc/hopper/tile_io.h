// Global -> shared tile loads for the Hopper kernels: cp.async of an (R x 64) or (R x 128) tile of 16-bit
// elements into the 128B-swizzled layout that wgmma's descriptors read (wgmma.h).
#pragma once
#include "../utils.h"
#include "wgmma.h"

namespace flash {
namespace sm90 {

// R rows x C columns (C / 8 chunks of 16 bytes per row; C = 64 or 128) by NT threads; rows >=
// rows_left are zero-filled (their source address is clamped to row 0, never read). Thread tid keeps
// chunk column tid % (C / 8) and walks rows tid / (C / 8), + NT / (C / 8), ...
template <int R, int C, int NT, bool Is_even, typename T>
__device__ __forceinline__ void load_tile_swizzled(uint8_t *smem, const T *gmem, int64_t row_stride,
                                                   int rows_left, int tid) {
    constexpr int kChunks = C / 8;
    static_assert((R * kChunks) % NT == 0 && NT % kChunks == 0, "tile chunks must split evenly over the threads");
    const int c = (tid % kChunks) * 8;
#pragma unroll
    for (int i = 0; i < R * kChunks / NT; ++i) {
        const int r = tid / kChunks + i * (NT / kChunks);
        const bool pred = Is_even || r < rows_left;
        const T *src = pred ? gmem + r * row_stride + c : gmem;
        cp_async_16(smem_u32(smem + swizzled_offset<R>(r, c)), src, pred);
    }
}

}  // namespace sm90
}  // namespace flash
