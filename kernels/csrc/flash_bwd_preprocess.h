// Backward pre-pass and post-pass kernels (memory-bound, simple).
//   pre-pass:  D = rowsum(dO o O) in fp32, kRowThreads threads per query row (16-byte loads of 8
//              elements), laid out like LSE; and dq_accum zeroed (each block a contiguous slice of the
//              flat buffer: no separate memset kernel, and rows outside every varlen sequence are zeroed
//              too).
//   post-pass: dQ = dq_accum * softmax_scale, fp32 -> bf16/fp16; dQ's rows may sit further apart than
//              dq_accum's (a view of a packed dqkv gradient). dq_accum is row-major (4 elements per
//              step), or tiled (hopper/dq_tiles.h: one thread block per tile, 8 elements per store).
#pragma once
#include "flash.h"
#include "flash_fwd_kernel.h"  // SeqInfo
#include "grid_dependency.h"
#include "hopper/dq_tiles.h"
#include "utils.h"

namespace flash {

// Pre-pass: 64 query rows of one (batch, head) per block. Each thread takes kPreRowsPerBlock * kRowThreads
// / kPreThreads rows (unrolled), with 16-byte loads, so more bytes are in flight per thread (with 8-byte
// loads and 16 rows per block the head-dim-64 pre-pass reached two thirds of FA4's rate, ncu).
constexpr int kPreThreads = 256, kPreRowsPerBlock = 64;

// Threads per query row at head dim d: the row's 16-byte chunks (d / 8) on at most 16 threads, a power
// of two, so a row's threads sit in one half-warp for the shuffle reduction.
constexpr int pre_row_threads(int d) { return d <= 64 ? 8 : 16; }

// dq_accum_n4: float4s in dq_accum (total_q * h * d / 4). d: a multiple of 8; rows 16-byte aligned
// (flash_api.cpp aligned()).
template <typename T, int kRowThreads>
__global__ void __launch_bounds__(kPreThreads)
flash_bwd_preprocess_kernel(const Flash_bwd_params params, int64_t dq_accum_n4) {
    constexpr int kRowsPerPass = kPreThreads / kRowThreads, kPasses = kPreRowsPerBlock / kRowsPerPass;
    static_assert(kRowThreads <= 16 && kPasses * kRowsPerPass == kPreRowsPerBlock, "rows per block");
    allow_dependents();  // the Hopper main kernel (grid_dependency.h) may start its loads of K, V, Q, dO
    const int64_t n_blocks = int64_t(gridDim.x) * gridDim.y * gridDim.z;
    const int64_t block = (int64_t(blockIdx.z) * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    const int64_t slice = (dq_accum_n4 + n_blocks - 1) / n_blocks;
    const int64_t zero_end = dq_accum_n4 < (block + 1) * slice ? dq_accum_n4 : (block + 1) * slice;
    float4 *dq_accum = reinterpret_cast<float4 *>(params.dq_accum_ptr);
    for (int64_t i = block * slice + threadIdx.x; i < zero_end; i += kPreThreads) dq_accum[i] = make_float4(0.f, 0.f, 0.f, 0.f);

    const int b = blockIdx.z, h = blockIdx.y;
    const int lane = threadIdx.x % kRowThreads;
    const int row0 = blockIdx.x * kPreRowsPerBlock + threadIdx.x / kRowThreads;  // + pass * kRowsPerPass
    const SeqInfo seq(params, b);
    const T *o = reinterpret_cast<const T *>(params.o_ptr) +
                 seq.q_off(params, params.o_batch_stride, params.o_row_stride, params.o_head_stride, b, h);
    const T *dout = reinterpret_cast<const T *>(params.do_ptr) +
                    seq.q_off(params, params.do_batch_stride, params.do_row_stride, params.do_head_stride, b, h);
    float acc[kPasses];
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
        const int row = row0 + pass * kRowsPerPass;
        acc[pass] = 0.f;
        if (row < seq.sq) {
            const uint4 *o_row = reinterpret_cast<const uint4 *>(o + int64_t(row) * params.o_row_stride);
            const uint4 *do_row = reinterpret_cast<const uint4 *>(dout + int64_t(row) * params.do_row_stride);
            for (int p = lane; p < params.d / 8; p += kRowThreads) {  // 8 elements per 16-byte load
                const uint4 x = o_row[p], y = do_row[p];
                const uint32_t xs[4] = {x.x, x.y, x.z, x.w}, ys[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float2 xe = unpack2<T>(xs[e]), ye = unpack2<T>(ys[e]);
                    acc[pass] += xe.x * ye.x + xe.y * ye.y;
                }
            }
        }
    }
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
        float a = acc[pass];
#pragma unroll
        for (int off = kRowThreads / 2; off > 0; off /= 2) a += __shfl_xor_sync(0xffffffff, a, off);
        const int row = row0 + pass * kRowsPerPass;
        if (row < seq.sq && lane == 0) params.dsoftmax_sum_ptr[seq.lse_off(params, b, h) + row] = a;
    }
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

// Tiled accumulator: block (m, h, b) converts tile (b, h, m) -- 8192 / D queries x D, two sub-tiles in
// wgmma register order (hopper/dq_tiles.h) -- reading the whole tile (rows past the sequence too: every
// tile is allocated; 16-byte loads) and writing each 8-column run to its row of dQ (16-byte stores). D a
// template argument: the tile arithmetic divides by constants.
constexpr int kConvertTileThreads = 256;  // one quad of each sub-tile per thread
template <typename T, int D>
__global__ void __launch_bounds__(kConvertTileThreads) flash_bwd_convert_dq_tiles_kernel(const Flash_bwd_params params) {
    constexpr int tr = dq_tiles::kFloats / D;
    const int m = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const SeqInfo seq(params, b);
    const int rows = seq.sq - m * tr;  // rows of this tile inside the sequence
    if (rows <= 0) return;
    const float4 *tile = reinterpret_cast<const float4 *>(
        params.dq_accum_ptr + dq_tiles::tile_offset(params, D, b, h, seq.q_start) + int64_t(m) * dq_tiles::kFloats);
    // dQ at (query m * tr of this sequence, head h); rows of h * D elements, dq_out_row_stride apart
    T *dq0 = reinterpret_cast<T *>(params.dq_ptr) +
             (params.cu_seqlens_q ? int64_t(seq.q_start) : int64_t(b) * params.seqlen_q) * params.dq_out_row_stride +
             int64_t(m) * tr * params.dq_out_row_stride + int64_t(h) * D;
    // Quad v of sub-tile `sub` (dq_tiles::quad_rows): 64 contiguous bytes, two rows' 8-column runs.
    // Thread x takes quad 32 (x % 8) + x / 8 of each sub-tile, so a warp's stores are 4 rows x 128
    // contiguous bytes (dQ rows are 16-byte aligned). All of a thread's loads are issued first.
    static_assert(kConvertTileThreads * 16 == dq_tiles::kSubFloats, "a quad per thread and sub-tile");
    const float s = params.scale_softmax;
    const int v = 32 * (threadIdx.x % 8) + threadIdx.x / 8;
    float4 f[2][4];
#pragma unroll
    for (int sub = 0; sub < 2; ++sub)
#pragma unroll
        for (int i = 0; i < 4; ++i) f[sub][i] = tile[sub * (dq_tiles::kSubFloats / 4) + 4 * v + i];
    int r, c;
    dq_tiles::quad_rows(v, r, c);
#pragma unroll
    for (int sub = 0; sub < 2; ++sub) {
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            int row, col;
            dq_tiles::tile_position(sub, r + 8 * hr, c, D, row, col);
            if (row >= rows) continue;
            const float4 *q4 = f[sub];
            uint32_t w[4];
#pragma unroll
            for (int i = 0; i < 4; ++i)
                w[i] = hr == 0 ? pack2<T>(q4[i].x * s, q4[i].y * s) : pack2<T>(q4[i].z * s, q4[i].w * s);
            // one 16-byte store instruction (ptxas otherwise splits it where the packed halves land in
            // registers that do not form an aligned quad)
            asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(dq0 + int64_t(row) * params.dq_out_row_stride + col),
                         "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3])
                         : "memory");
        }
    }
}

}  // namespace flash
