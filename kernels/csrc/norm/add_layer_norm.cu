// The residual add + LayerNorm of a pre-LN block, forward and backward (add_layer_norm.h), for the
// output-keeping LayerNorm (model.norm_saves_output): the backward rebuilds x_hat from y, so the
// forward keeps y and rstd only. Why ours: torch.compile fuses the add into its LayerNorm kernels as
// well, but its backward (a "mix-order" reduction) reads at ~2.1 TB/s on an H100 at 2.7B-8k and sums
// its (1024 x d) fp32 workspace with an eager torch.sum at ~0.6 TB/s (bench/RESULTS.md).
//
// Layout: one block per row at a time, a thread per 8 adjacent columns (16-byte loads; d / 8 threads
// rounded up to whole warps, the rest idle), blocks striding over rows. Row statistics in fp32 by
// warp shuffles, then one shared-memory exchange across the block's warps.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <utility>
#include <vector>

#include "norm/add_layer_norm.h"

namespace flashgpt {
namespace {

constexpr int kCols = 8;
constexpr int kMaxD = 8192;
constexpr int kMaxWarps = kMaxD / kCols / 32;

__device__ __forceinline__ float2 f2(__nv_bfloat162 v) { return __bfloat1622float2(v); }
__device__ __forceinline__ float2 f2(__half2 v) { return __half22float2(v); }
template <typename T2> __device__ __forceinline__ T2 to2(float a, float b);
template <> __device__ __forceinline__ __nv_bfloat162 to2(float a, float b) { return __floats2bfloat162_rn(a, b); }
template <> __device__ __forceinline__ __half2 to2(float a, float b) { return __floats2half2_rn(a, b); }

template <typename T2>
__device__ __forceinline__ void unpack(const uint4 &v, float (&out)[kCols]) {
    const T2 *p = reinterpret_cast<const T2 *>(&v);
#pragma unroll
    for (int j = 0; j < kCols / 2; ++j) {
        const float2 f = f2(p[j]);
        out[2 * j] = f.x;
        out[2 * j + 1] = f.y;
    }
}

template <typename T2>
__device__ __forceinline__ uint4 pack(const float (&in)[kCols]) {
    uint4 v;
    T2 *p = reinterpret_cast<T2 *>(&v);
#pragma unroll
    for (int j = 0; j < kCols / 2; ++j) p[j] = to2<T2>(in[2 * j], in[2 * j + 1]);
    return v;
}

// Sums of (a, b) over the block's threads; every thread gets them. red: 2 x kMaxWarps floats of
// shared memory, one barrier. A caller must not pass the same `red` to two calls in a row: a thread
// may still be reading the partials of the previous call when a faster one writes the next. Callers
// alternate between two (a thread writes buffer k again only after the barrier of the call between,
// which every thread reaches after reading buffer k).
__device__ __forceinline__ float2 block_sum2(float a, float b, float *red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        a += __shfl_xor_sync(0xffffffffu, a, o);
        b += __shfl_xor_sync(0xffffffffu, b, o);
    }
    const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
    if (threadIdx.x % 32 == 0) {
        red[warp] = a;
        red[kMaxWarps + warp] = b;
    }
    __syncthreads();
    float2 s = make_float2(0.f, 0.f);
    for (int i = 0; i < warps; ++i) {  // every thread reads the few partials: no second round
        s.x += red[i];
        s.y += red[kMaxWarps + i];
    }
    return s;
}

// The LayerNorm's weight and bias (0 without one) at this thread's 8 columns.
__device__ __forceinline__ void load_params(const float *w, const float *b, int c, float (&wv)[kCols],
                                            float (&bv)[kCols]) {
#pragma unroll
    for (int j = 0; j < kCols; ++j) {
        wv[j] = w[kCols * c + j];
        bv[j] = b != nullptr ? b[kCols * c + j] : 0.f;
    }
}

// kMaxThreads: 512 for d <= 4096 (room for ~128 registers a thread), 1024 above (64).
template <typename T2, int kMaxThreads>
__global__ void __launch_bounds__(kMaxThreads) add_layer_norm_forward_kernel(const uint4 *__restrict__ x, const uint4 *__restrict__ delta,
                                              const float *__restrict__ w, const float *__restrict__ b,
                                              uint4 *__restrict__ h, uint4 *__restrict__ y,
                                              float *__restrict__ rstd_out, int64_t rows, int d, float eps) {
    __shared__ float red[2][2 * kMaxWarps];  // [0]: the mean's exchange, [1]: the variance's (block_sum2)
    const int c = threadIdx.x, chunks = d / kCols;  // this thread's 8 columns: 8c..8c+7
    const bool active = c < chunks;
    float wv[kCols] = {}, bv[kCols] = {};
    if (active) load_params(w, b, c, wv, bv);
    const float inv_d = 1.f / d;
    // Each row's loads are issued one row ahead, so they are in flight across the row statistics'
    // block-wide exchanges.
    uint4 next_x = make_uint4(0, 0, 0, 0), next_delta = next_x;
    if (active && blockIdx.x < rows) {
        next_x = x[blockIdx.x * chunks + c];
        next_delta = delta[blockIdx.x * chunks + c];
    }
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const uint4 xr = next_x, dr = next_delta;
        if (active && r + gridDim.x < rows) {
            next_x = x[(r + gridDim.x) * chunks + c];
            next_delta = delta[(r + gridDim.x) * chunks + c];
        }
        float v[kCols] = {};
        if (active) {
            float xv[kCols], dv[kCols];
            unpack<T2>(xr, xv);
            unpack<T2>(dr, dv);
#pragma unroll
            for (int j = 0; j < kCols; ++j) v[j] = xv[j] + dv[j];
            const uint4 hv = pack<T2>(v);  // the residual stream holds h rounded: normalise what it holds
            h[r * chunks + c] = hv;
            unpack<T2>(hv, v);
        }
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < kCols; ++j) s += v[j];
        const float mean = block_sum2(s, 0.f, red[0]).x * inv_d;
        float q = 0.f;
        if (active) {
#pragma unroll
            for (int j = 0; j < kCols; ++j) {
                v[j] -= mean;
                q += v[j] * v[j];
            }
        }
        const float rstd = rsqrtf(block_sum2(q, 0.f, red[1]).x * inv_d + eps);  // two-pass variance
        if (active) {
            float out[kCols];
#pragma unroll
            for (int j = 0; j < kCols; ++j) out[j] = v[j] * rstd * wv[j] + bv[j];
            y[r * chunks + c] = pack<T2>(out);
        }
        if (c == 0) rstd_out[r] = rstd;
    }
}

// Loads are not issued a row ahead here (unlike the forward): in registers that takes the kernel to 105
// registers (one 320-thread block per SM at d = 2560); staged through shared memory by cp.async (no
// registers) it measured 2% slower than this. Bounded at 64
// registers for d <= 4096: three 320-thread blocks per SM at d = 2560.
template <typename T2, int kMaxThreads>
__global__ void __launch_bounds__(kMaxThreads, kMaxThreads == 512 ? 2 : 1) add_layer_norm_backward_kernel(const uint4 *__restrict__ dh_in, const uint4 *__restrict__ dy,
                                               const uint4 *__restrict__ y, const float *__restrict__ w,
                                               const float *__restrict__ b, const float *__restrict__ rstd,
                                               uint4 *__restrict__ dh, float *__restrict__ partial, int64_t rows,
                                               int d) {
    __shared__ float red[2][2 * kMaxWarps];  // alternate rows' exchanges (block_sum2)
    const int c = threadIdx.x, chunks = d / kCols;
    const bool active = c < chunks;
    float wv[kCols] = {}, bv[kCols] = {}, dw[kCols] = {}, db[kCols] = {};
    if (active) load_params(w, b, c, wv, bv);
    const float inv_d = 1.f / d;
    int buf = 0;  // which of red's halves this row's exchange uses
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x, buf ^= 1) {
        float xh[kCols] = {}, dyv[kCols] = {};  // g = dy * w is rebuilt after the exchange: 8 fewer registers
        float sg = 0.f, sgx = 0.f;
        uint4 dhv = make_uint4(0, 0, 0, 0);
        const float rs = rstd[r];
        if (active) {
            float yv[kCols];
            dhv = dh_in[r * chunks + c];  // issued first: used last
            unpack<T2>(dy[r * chunks + c], dyv);
            unpack<T2>(y[r * chunks + c], yv);
#pragma unroll
            for (int j = 0; j < kCols; ++j) {
                // x_hat, from the output; the fast division (a reciprocal and a multiply, ~2 ulp): IEEE
                // division is a ~10-instruction sequence, and keeping 1 / w in registers cost 28 of them
                xh[j] = __fdividef(yv[j] - bv[j], wv[j]);
                const float g = dyv[j] * wv[j];
                sg += g;
                sgx += g * xh[j];
                dw[j] += dyv[j] * xh[j];
                db[j] += dyv[j];
            }
        }
        const float2 s = block_sum2(sg, sgx, red[buf]);
        if (active) {
            const float mg = s.x * inv_d, mgx = s.y * inv_d;
            float in[kCols], out[kCols];
            unpack<T2>(dhv, in);
#pragma unroll
            for (int j = 0; j < kCols; ++j) out[j] = in[j] + rs * (dyv[j] * wv[j] - mg - xh[j] * mgx);
            dh[r * chunks + c] = pack<T2>(out);
        }
    }
    if (active) {  // this block's partial sums of w's and b's gradients
        float *pw = partial + static_cast<int64_t>(blockIdx.x) * d + kCols * c;
        float *pb = partial + (static_cast<int64_t>(gridDim.x) + blockIdx.x) * d + kCols * c;
#pragma unroll
        for (int j = 0; j < kCols; ++j) {
            pw[j] = dw[j];
            pb[j] = db[j];
        }
    }
}

// dw[c] = sum over groups of partial[0][g][c]; db likewise from partial[1] (when db is not null).
// A block per 32 columns: its lane picks the column (128-byte rows of the partials per warp), its
// kSumWarps warps stride over the groups, then one shared-memory sum. (A thread per column looping over
// all ~400 groups left most SMs idle: d / 256 blocks.)
constexpr int kSumWarps = 16;

__global__ void __launch_bounds__(32 * kSumWarps) param_grads_kernel(const float *__restrict__ partial,
                                                                     float *__restrict__ dw, float *__restrict__ db,
                                                                     int d, int groups) {
    __shared__ float sums[2][kSumWarps][33];  // +1: no bank conflicts on the transposed read
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, col = blockIdx.x * 32 + lane;
    float sw = 0.f, sb = 0.f;
    if (col < d) {
        for (int g = warp; g < groups; g += kSumWarps) {
            sw += partial[static_cast<int64_t>(g) * d + col];
            sb += partial[static_cast<int64_t>(groups + g) * d + col];
        }
    }
    sums[0][warp][lane] = sw;
    sums[1][warp][lane] = sb;
    __syncthreads();
    if (warp < 2 && col < d) {  // warp 0 sums dw's column, warp 1 db's, in a fixed order (deterministic)
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < kSumWarps; ++i) s += sums[warp][i][lane];
        if (warp == 0) dw[col] = s;
        else if (db != nullptr) db[col] = s;
    }
}

int threads_for(int64_t d) { return static_cast<int>(((d / kCols) + 31) / 32 * 32); }

// Blocks for `rows` rows: as many as fit on the GPU at once (by the kernel's occupancy), at most one
// per row. The occupancy query costs microseconds of host
// time and a step calls these ops 128 times per micro-batch: its answers are kept per (device, kernel,
// threads).
template <typename Kernel>
int blocks_for(Kernel kernel, int64_t rows, int64_t d) {
    struct Key {
        int dev;
        const void *kernel;
        int threads;
        bool operator==(const Key &o) const {
            return dev == o.dev && kernel == o.kernel && threads == o.threads;
        }
    };
    static std::mutex lock;
    static std::vector<std::pair<Key, int>> resident;  // (key, blocks resident on the whole GPU); a few entries
    int dev = 0;
    cudaGetDevice(&dev);
    const Key key{dev, reinterpret_cast<const void *>(kernel), threads_for(d)};
    int64_t want = 0;
    {
        std::lock_guard<std::mutex> guard(lock);
        for (const auto &e : resident) {
            if (e.first == key) want = e.second;
        }
        if (want == 0) {
            int sms = 132, per_sm = 1;
            cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
            cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, key.threads, 0);
            want = static_cast<int64_t>(sms) * (per_sm < 1 ? 1 : per_sm);
            resident.emplace_back(key, static_cast<int>(want));
        }
    }
    return static_cast<int>(rows < want ? (rows < 1 ? 1 : rows) : want);
}

template <typename T2>
auto backward_kernel(int64_t d) {
    return threads_for(d) <= 512 ? add_layer_norm_backward_kernel<T2, 512> : add_layer_norm_backward_kernel<T2, 1024>;
}

template <typename T2, int kMaxThreads>
cudaError_t forward_with(const void *x, const void *delta, const float *w, const float *b, void *h, void *y,
                         float *rstd, int64_t rows, int64_t d, float eps, cudaStream_t stream) {
    auto kernel = add_layer_norm_forward_kernel<T2, kMaxThreads>;
    kernel<<<blocks_for(kernel, rows, d), threads_for(d), 0, stream>>>(
        static_cast<const uint4 *>(x), static_cast<const uint4 *>(delta), w, b, static_cast<uint4 *>(h),
        static_cast<uint4 *>(y), rstd, rows, static_cast<int>(d), eps);
    return cudaGetLastError();
}

}  // namespace

int add_layer_norm_row_groups(bool bf16, int64_t rows, int64_t d) {
    return bf16 ? blocks_for(backward_kernel<__nv_bfloat162>(d), rows, d)
                : blocks_for(backward_kernel<__half2>(d), rows, d);
}

cudaError_t add_layer_norm_forward(bool bf16, const void *x, const void *delta, const float *w, const float *b,
                                   void *h, void *y, float *rstd, int64_t rows, int64_t d, float eps,
                                   cudaStream_t stream) {
    const bool small = threads_for(d) <= 512;
    if (bf16) {
        return small ? forward_with<__nv_bfloat162, 512>(x, delta, w, b, h, y, rstd, rows, d, eps, stream)
                     : forward_with<__nv_bfloat162, 1024>(x, delta, w, b, h, y, rstd, rows, d, eps, stream);
    }
    return small ? forward_with<__half2, 512>(x, delta, w, b, h, y, rstd, rows, d, eps, stream)
                 : forward_with<__half2, 1024>(x, delta, w, b, h, y, rstd, rows, d, eps, stream);
}

cudaError_t add_layer_norm_backward(bool bf16, const void *dh_in, const void *dy, const void *y, const float *w,
                                    const float *b, const float *rstd, void *dh, float *partial, int64_t rows,
                                    int64_t d, int row_groups, cudaStream_t stream) {
    const auto kernel = bf16 ? backward_kernel<__nv_bfloat162>(d) : backward_kernel<__half2>(d);
    kernel<<<row_groups, threads_for(d), 0, stream>>>(
        static_cast<const uint4 *>(dh_in), static_cast<const uint4 *>(dy), static_cast<const uint4 *>(y), w, b, rstd,
        static_cast<uint4 *>(dh), partial, rows, static_cast<int>(d));
    return cudaGetLastError();
}

cudaError_t add_layer_norm_param_grads(const float *partial, float *dw, float *db, int64_t d, int row_groups,
                                       cudaStream_t stream) {
    param_grads_kernel<<<static_cast<unsigned>((d + 31) / 32), 32 * kSumWarps, 0, stream>>>(partial, dw, db,
                                                                                             static_cast<int>(d), row_groups);
    return cudaGetLastError();
}

}  // namespace flashgpt
