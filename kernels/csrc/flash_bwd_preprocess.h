// Backward pre-pass and post-pass kernels (memory-bound, simple).
//   pre-pass:  D = rowsum(dO o O) in fp32, one warp per query row, laid out like LSE.
//   post-pass: dQ = dq_accum * softmax_scale, fp32 -> bf16/fp16, 4 elements per thread.
// (dq_accum is zeroed by the caller before the main kernel.)
#pragma once
#include "flash.h"
#include "flash_fwd_kernel.h"  // SeqInfo
#include "utils.h"

namespace flash {

constexpr int kPreRowsPerBlock = 8;  // one warp per row, 8 warps per block

template <typename T>
__global__ void __launch_bounds__(32 * kPreRowsPerBlock)
flash_bwd_preprocess_kernel(const Flash_bwd_params params) {
    const int b = blockIdx.z, h = blockIdx.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row = blockIdx.x * kPreRowsPerBlock + warp;
    const SeqInfo seq(params, b);
    if (row >= seq.sq) return;
    const T *o = reinterpret_cast<const T *>(params.o_ptr) +
                 seq.q_off(params, params.o_batch_stride, params.o_row_stride, params.o_head_stride, b, h) +
                 int64_t(row) * params.o_row_stride;
    const T *dout = reinterpret_cast<const T *>(params.do_ptr) +
                    seq.q_off(params, params.do_batch_stride, params.do_row_stride, params.do_head_stride, b, h) +
                    int64_t(row) * params.do_row_stride;
    float acc = 0.f;
    for (int p = lane; p < params.d / 2; p += 32) {  // pairs of elements, 4-byte loads
        const float2 x = unpack2<T>(reinterpret_cast<const uint32_t *>(o)[p]);
        const float2 y = unpack2<T>(reinterpret_cast<const uint32_t *>(dout)[p]);
        acc += x.x * y.x + x.y * y.y;
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffff, acc, off);
    if (lane == 0) params.dsoftmax_sum_ptr[seq.lse_off(params, b, h) + row] = acc;
}

template <typename T>
__global__ void flash_bwd_convert_dq_kernel(const float *__restrict__ dq_accum, T *__restrict__ dq,
                                            int64_t n4, float scale) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n4;
         i += int64_t(gridDim.x) * blockDim.x) {
        const float4 v = reinterpret_cast<const float4 *>(dq_accum)[i];
        uint2 out;
        out.x = pack2<T>(v.x * scale, v.y * scale);
        out.y = pack2<T>(v.z * scale, v.w * scale);
        reinterpret_cast<uint2 *>(dq)[i] = out;
    }
}

}  // namespace flash
