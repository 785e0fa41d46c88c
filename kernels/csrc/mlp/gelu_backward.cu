// The GELU's backward and its bias gradient in one pass (kernels/gelu_mlp.py's backward):
//
//   dpre[r, c] = dg[r, c] * gelu_tanh'(pre[r, c])                       (M x N, 16-bit)
//   partial[b, c] = sum of dpre[r, c] over the rows r of row group b    (R x N, fp32)
//   g[r, c] = gelu_tanh(pre[r, c])                     (M x N, 16-bit; only when g is asked for)
//
// g is the forward's GELU output, rebuilt for the second projection's weight gradient when the MLP
// did not keep it (model.recompute_gelu: 4 of ~17 saved d-units per token and layer less, for one
// more write of M x N in this pass that reads pre anyway).
//
// The caller sums the R partial rows (a few MB; deterministic, no atomics). It replaces two
// memory-bound kernels torch.compile emits (the GELU backward, then a column sum that reads dpre
// again): at 1.3B-8k per layer and micro-batch of 3 that is 1.2 GB of traffic instead of 1.6 GB.
//
// Layout: a thread owns 8 adjacent columns (one 16-byte load of each input per row), a block of
// kThreads threads owns kThreads * 8 columns; blockIdx.y is the row group, whose rows are
// blockIdx.y, blockIdx.y + gridDim.y, ... (a block's loads of a row are contiguous). N % 8 == 0.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "mlp/gelu_backward.h"

namespace flashgpt {
namespace {

constexpr int kThreads = 128;
constexpr int kCols = 8;    // per thread: 8 x 16 bits = one 16-byte vector
constexpr int kUnroll = 4;  // rows in flight per thread (memory-level parallelism)
// Blocks per launch (~8 per SM of an H100): a function of the shape only, so that kernels/gelu_mlp.py
// can tell torch.compile the partial sums' shape (_row_groups there mirrors this).
constexpr int64_t kTargetBlocks = 1024;

__device__ __forceinline__ float2 to_float2(__nv_bfloat162 v) { return __bfloat1622float2(v); }
__device__ __forceinline__ float2 to_float2(__half2 v) { return __half22float2(v); }
template <typename T2> __device__ __forceinline__ T2 from_float2(float2 v);
template <> __device__ __forceinline__ __nv_bfloat162 from_float2(float2 v) { return __float22bfloat162_rn(v); }
template <> __device__ __forceinline__ __half2 from_float2(float2 v) { return __float22half2_rn(v); }

// tanh(k0 (x + k1 x^3)) for the tanh-approximation GELU, as 1 - 2 / (1 + e^(2u)) through the fast
// exponential: ~1e-7 absolute error (what a 16-bit output can hold is 2^-9 at best), a handful of
// instructions instead of tanhf's ~20, which made the kernel issue-bound (441 us for 1.2 GB on an H100).
// Saturates cleanly: e^(2u) -> inf gives 1, -> 0 gives -1.
constexpr float kGeluK0 = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluK1 = 0.044715f;
__device__ __forceinline__ float gelu_tanh_inner(float x) {
    return 1.f - __fdividef(2.f, 1.f + __expf(2.f * kGeluK0 * (x + kGeluK1 * x * x * x)));
}

// d/dx of 0.5 x (1 + tanh(k0 (x + k1 x^3))), as PyTorch's tanh-approximation GELU backward; t = the tanh.
__device__ __forceinline__ float gelu_tanh_grad(float x, float t) {
    return 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * kGeluK0 * (1.f + 3.f * kGeluK1 * x * x);
}

// One thread's 8 columns of one row: dpre = dg * gelu'(pre), rounded to T2, added to `sum` as stored;
// with kGelu also gelu(pre) into `gelu_out`.
template <typename T2, bool kGelu>
__device__ __forceinline__ uint4 gelu_backward_8(const uint4 &g, const uint4 &p, float (&sum)[kCols],
                                                 uint4 &gelu_out) {
    uint4 out;
    const T2 *gv = reinterpret_cast<const T2 *>(&g);
    const T2 *pv = reinterpret_cast<const T2 *>(&p);
    T2 *ov = reinterpret_cast<T2 *>(&out);
    T2 *yv = reinterpret_cast<T2 *>(&gelu_out);
#pragma unroll
    for (int j = 0; j < kCols / 2; ++j) {
        const float2 gf = to_float2(gv[j]), pf = to_float2(pv[j]);
        const float tx = gelu_tanh_inner(pf.x), ty = gelu_tanh_inner(pf.y);
        ov[j] = from_float2<T2>(make_float2(gf.x * gelu_tanh_grad(pf.x, tx), gf.y * gelu_tanh_grad(pf.y, ty)));
        if constexpr (kGelu) {
            yv[j] = from_float2<T2>(make_float2(0.5f * pf.x * (1.f + tx), 0.5f * pf.y * (1.f + ty)));
        }
        const float2 rounded = to_float2(ov[j]);  // the bias gradient sums what dpre holds
        sum[2 * j] += rounded.x;
        sum[2 * j + 1] += rounded.y;
    }
    return out;
}

template <typename T2, bool kGelu>  // T2: __nv_bfloat162 or __half2; kGelu: also write gelu(pre)
__global__ void __launch_bounds__(kThreads) gelu_backward_bias_kernel(const T2 *__restrict__ dg,
                                                                      const T2 *__restrict__ pre,
                                                                      T2 *__restrict__ dpre,
                                                                      T2 *__restrict__ gelu,
                                                                      float *__restrict__ partial, int64_t rows,
                                                                      int64_t cols) {
    const int64_t col = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * kCols;
    if (col >= cols) return;
    const int64_t pairs_per_row = cols / 2;  // row stride in T2 units
    const int64_t first = col / 2;
    float sum[kCols] = {};
    uint4 y;
    int64_t r = blockIdx.y;
    const int64_t step = gridDim.y;
    for (; r + (kUnroll - 1) * step < rows; r += kUnroll * step) {  // kUnroll rows' loads in flight
        uint4 g[kUnroll], p[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int64_t at = (r + u * step) * pairs_per_row + first;
            g[u] = *reinterpret_cast<const uint4 *>(dg + at);
            p[u] = *reinterpret_cast<const uint4 *>(pre + at);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int64_t at = (r + u * step) * pairs_per_row + first;
            *reinterpret_cast<uint4 *>(dpre + at) = gelu_backward_8<T2, kGelu>(g[u], p[u], sum, y);
            if constexpr (kGelu) *reinterpret_cast<uint4 *>(gelu + at) = y;
        }
    }
    for (; r < rows; r += step) {  // the last rows of this group, one at a time
        const int64_t at = r * pairs_per_row + first;
        *reinterpret_cast<uint4 *>(dpre + at) = gelu_backward_8<T2, kGelu>(
            *reinterpret_cast<const uint4 *>(dg + at), *reinterpret_cast<const uint4 *>(pre + at), sum, y);
        if constexpr (kGelu) *reinterpret_cast<uint4 *>(gelu + at) = y;
    }
    float4 *dst = reinterpret_cast<float4 *>(partial + blockIdx.y * cols + col);
    dst[0] = make_float4(sum[0], sum[1], sum[2], sum[3]);
    dst[1] = make_float4(sum[4], sum[5], sum[6], sum[7]);
}

template <typename T2>
void launch(dim3 grid, cudaStream_t stream, const void *dg, const void *pre, void *dpre, void *gelu, float *partial,
            int64_t rows, int64_t cols) {
    const T2 *dg2 = static_cast<const T2 *>(dg), *pre2 = static_cast<const T2 *>(pre);
    T2 *dpre2 = static_cast<T2 *>(dpre), *gelu2 = static_cast<T2 *>(gelu);
    if (gelu != nullptr) {
        gelu_backward_bias_kernel<T2, true><<<grid, kThreads, 0, stream>>>(dg2, pre2, dpre2, gelu2, partial, rows, cols);
    } else {
        gelu_backward_bias_kernel<T2, false><<<grid, kThreads, 0, stream>>>(dg2, pre2, dpre2, nullptr, partial, rows,
                                                                             cols);
    }
}

}  // namespace

int gelu_backward_row_groups(int64_t rows, int64_t cols) {
    const int64_t col_blocks = (cols + kThreads * kCols - 1) / (kThreads * kCols);
    int64_t groups = (kTargetBlocks + col_blocks - 1) / col_blocks;
    groups = groups < rows ? groups : rows;
    return static_cast<int>(groups < 1 ? 1 : groups);
}

cudaError_t gelu_backward_bias(bool bf16, const void *dg, const void *pre, void *dpre, void *gelu, float *partial,
                               int64_t rows, int64_t cols, int row_groups, cudaStream_t stream) {
    const dim3 grid(static_cast<unsigned>((cols + kThreads * kCols - 1) / (kThreads * kCols)),
                    static_cast<unsigned>(row_groups));
    if (bf16) {
        launch<__nv_bfloat162>(grid, stream, dg, pre, dpre, gelu, partial, rows, cols);
    } else {
        launch<__half2>(grid, stream, dg, pre, dpre, gelu, partial, rows, cols);
    }
    return cudaGetLastError();
}

}  // namespace flashgpt
