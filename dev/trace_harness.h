// What dev/fwd_trace.cu and dev/bwd_trace.cu share: the CUDA error check, random bf16 inputs,
// the params of dense (batch, seqlen, heads, head dim) tensors, and the median CUDA-event time of a
// launch (3 warm-up runs, then 20 timed groups of launches).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include "../kernels/csrc/flash.h"

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e_)); exit(1); } } while (0)

// x[i] uniform in [-1, 1), a hash of (i, seed): fresh, non-zero inputs without a host copy.
__global__ void fill_random(__nv_bfloat16 *x, int64_t n, uint32_t seed) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
        uint32_t h = uint32_t(i) * 2654435761u ^ seed;
        h ^= h >> 15; h *= 2246822519u; h ^= h >> 13;
        x[i] = __float2bfloat16((float(h & 0xffff) / 65536.f - 0.5f) * 2.f);
    }
}

// Sizes, strides (elements; q, k, v, o all (b, s, h, d) contiguous) and softmax scale 1 / sqrt(d).
inline void set_dense_params(Flash_fwd_params &p, int b, int s, int h, int d, bool causal) {
    const int64_t rs = int64_t(h) * d, bs = int64_t(s) * rs;
    p.q_batch_stride = p.k_batch_stride = p.v_batch_stride = p.o_batch_stride = bs;
    p.q_row_stride = p.k_row_stride = p.v_row_stride = p.o_row_stride = rs;
    p.q_head_stride = p.k_head_stride = p.v_head_stride = p.o_head_stride = d;
    p.b = b; p.h = p.h_k = h; p.h_h_k_ratio = 1; p.d = d;
    p.seqlen_q = p.seqlen_k = s; p.total_q = p.total_k = b * s;
    p.scale_softmax = 1.f / sqrtf(float(d)); p.scale_softmax_log2 = p.scale_softmax * 1.4426950408889634f;
    p.is_causal = causal;
}

// Median milliseconds of run() (a launch on the default stream), over 20 timed groups of `per_group`
// back-to-back launches after 3 warm-up runs. per_group > 1 gives GPU time for short kernels: the
// host queues the next launch while one runs, so its launch cost is off the clock.
template <typename F>
float median_ms(F run, int per_group = 1) {
    for (int i = 0; i < 3; ++i) run();
    CK(cudaDeviceSynchronize());
    std::vector<float> ms;
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    for (int i = 0; i < 20; ++i) {
        CK(cudaEventRecord(e0));
        for (int j = 0; j < per_group; ++j) run();
        CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
        float t; CK(cudaEventElapsedTime(&t, e0, e1)); ms.push_back(t / per_group);
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
}
