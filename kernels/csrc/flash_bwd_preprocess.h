// Backward pre-pass and post-pass kernels (memory-bound, simple).
//   pre-pass:  D = rowsum(dO o O) in fp32, 16 threads per query row (8-byte loads), laid out like
//              LSE; and dq_accum zeroed (each block a contiguous slice of the flat buffer: no
//              separate memset kernel, and rows outside every varlen sequence are zeroed too).
//   post-pass: dQ = dq_accum * softmax_scale, fp32 -> bf16/fp16, 4 elements per thread; dQ's rows may
//              sit further apart than dq_accum's (a view of a packed dqkv gradient). dq_accum is
//              row-major, or tiled (hopper/dq_tiles.h: one thread block per tile).
#pragma once
#include "flash.h"
#include "flash_fwd_kernel.h"  // SeqInfo
#include "hopper/dq_tiles.h"
#include "utils.h"

namespace flash {

constexpr int kPreThreads = 256, kPreRowThreads = 16, kPreRowsPerBlock = kPreThreads / kPreRowThreads;

// dq_accum_n4: float4s in dq_accum (total_q * h * d / 4).
template <typename T>
__global__ void __launch_bounds__(kPreThreads)
flash_bwd_preprocess_kernel(const Flash_bwd_params params, int64_t dq_accum_n4) {
    const int64_t n_blocks = int64_t(gridDim.x) * gridDim.y * gridDim.z;
    const int64_t block = (int64_t(blockIdx.z) * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    const int64_t slice = (dq_accum_n4 + n_blocks - 1) / n_blocks;
    const int64_t zero_end = dq_accum_n4 < (block + 1) * slice ? dq_accum_n4 : (block + 1) * slice;
    float4 *dq_accum = reinterpret_cast<float4 *>(params.dq_accum_ptr);
    for (int64_t i = block * slice + threadIdx.x; i < zero_end; i += kPreThreads) dq_accum[i] = make_float4(0.f, 0.f, 0.f, 0.f);

    const int b = blockIdx.z, h = blockIdx.y;
    const int lane = threadIdx.x % kPreRowThreads;  // the 16 threads of a row sit in one half-warp
    const int row = blockIdx.x * kPreRowsPerBlock + threadIdx.x / kPreRowThreads;
    const SeqInfo seq(params, b);
    const bool in_seq = row < seq.sq;
    float acc = 0.f;
    if (in_seq) {
        const T *o = reinterpret_cast<const T *>(params.o_ptr) +
                     seq.q_off(params, params.o_batch_stride, params.o_row_stride, params.o_head_stride, b, h) +
                     int64_t(row) * params.o_row_stride;
        const T *dout = reinterpret_cast<const T *>(params.do_ptr) +
                        seq.q_off(params, params.do_batch_stride, params.do_row_stride, params.do_head_stride, b, h) +
                        int64_t(row) * params.do_row_stride;
        for (int p = lane; p < params.d / 4; p += kPreRowThreads) {  // 4 elements per 8-byte load
            const uint2 x = reinterpret_cast<const uint2 *>(o)[p], y = reinterpret_cast<const uint2 *>(dout)[p];
            const float2 x0 = unpack2<T>(x.x), x1 = unpack2<T>(x.y), y0 = unpack2<T>(y.x), y1 = unpack2<T>(y.y);
            acc += x0.x * y0.x + x0.y * y0.y + x1.x * y1.x + x1.y * y1.y;
        }
    }
#pragma unroll
    for (int off = kPreRowThreads / 2; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffff, acc, off);
    if (in_seq && lane == 0) params.dsoftmax_sum_ptr[seq.lse_off(params, b, h) + row] = acc;
}

// row4: float4s per dq_accum row (h * d / 4); out_row4: dQ's row stride in 4-element units.
template <typename T>
__global__ void flash_bwd_convert_dq_kernel(const float *__restrict__ dq_accum, T *__restrict__ dq,
                                            int64_t n4, float scale, int64_t row4, int64_t out_row4) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n4;
         i += int64_t(gridDim.x) * blockDim.x) {
        const float4 v = reinterpret_cast<const float4 *>(dq_accum)[i];
        uint2 out;
        out.x = pack2<T>(v.x * scale, v.y * scale);
        out.y = pack2<T>(v.z * scale, v.w * scale);
        int64_t o = i;
        if (out_row4 != row4) {  // uniform: a strided view (the division only then)
            const int64_t row = i / row4;
            o = row * out_row4 + (i - row * row4);
        }
        reinterpret_cast<uint2 *>(dq)[o] = out;
    }
}

// Tiled accumulator: block (m, h, b) converts tile (b, h, m) -- 8192 / d queries x d -- reading it in
// order (16-byte loads, coalesced) and writing each 4-column chunk to its row of dQ (8-byte stores).
constexpr int kConvertTileThreads = 256;
template <typename T>
__global__ void __launch_bounds__(kConvertTileThreads) flash_bwd_convert_dq_tiles_kernel(const Flash_bwd_params params) {
    const int m = blockIdx.x, h = blockIdx.y, b = blockIdx.z, d = params.d, tr = dq_tiles::tile_rows(d);
    const SeqInfo seq(params, b);
    const int rows = seq.sq - m * tr;  // rows of this tile inside the sequence
    if (rows <= 0) return;
    const float4 *tile = reinterpret_cast<const float4 *>(
        params.dq_accum_ptr + dq_tiles::tile_offset(params, b, h, seq.q_start) + int64_t(m) * dq_tiles::kFloats);
    // dQ at (query m * tr of this sequence, head h); rows of h * d elements, dq_out_row_stride apart
    T *dq0 = reinterpret_cast<T *>(params.dq_ptr) +
             (params.cu_seqlens_q ? int64_t(seq.q_start) : int64_t(b) * params.seqlen_q) * params.dq_out_row_stride +
             int64_t(m) * tr * params.dq_out_row_stride + int64_t(h) * d;
#pragma unroll 4
    for (int i = threadIdx.x; i < dq_tiles::kFloats / 4; i += kConvertTileThreads) {
        int r, col;
        dq_tiles::chunk_position(i, d, r, col);
        if (r >= rows) continue;
        const float4 v = tile[i];
        uint2 out;
        out.x = pack2<T>(v.x * params.scale_softmax, v.y * params.scale_softmax);
        out.y = pack2<T>(v.z * params.scale_softmax, v.w * params.scale_softmax);
        *reinterpret_cast<uint2 *>(dq0 + int64_t(r) * params.dq_out_row_stride + col) = out;
    }
}

}  // namespace flash
