// Global -> shared tile loads for the Hopper kernels: cp.async of an (R x 128) tile of 16-bit
// elements into the 128B-swizzled layout that wgmma's descriptors read (wgmma.h).
#pragma once
#include "../utils.h"
#include "wgmma.h"

namespace flash {
namespace sm90 {

// R rows x 128 columns (16 chunks of 16 bytes per row) by NT threads; rows >= rows_left are
// zero-filled (their source address is clamped to row 0, never read). Thread tid keeps chunk column
// tid % 16 and walks rows tid / 16, + NT / 16, ...
template <int R, int NT, bool Is_even, typename T>
__device__ __forceinline__ void load_tile_swizzled(uint8_t *smem, const T *gmem, int64_t row_stride,
                                                   int rows_left, int tid) {
    static_assert((R * 16) % NT == 0 && NT % 16 == 0, "tile chunks must split evenly over the threads");
    const int c = (tid % 16) * 8;
#pragma unroll
    for (int i = 0; i < R * 16 / NT; ++i) {
        const int r = tid / 16 + i * (NT / 16);
        const bool pred = Is_even || r < rows_left;
        const T *src = pred ? gmem + r * row_stride + c : gmem;
        cp_async_16(smem_u32(smem + swizzled_offset<R>(r, c)), src, pred);
    }
}

}  // namespace sm90
}  // namespace flash
