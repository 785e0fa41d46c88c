// wgmma throughput per SM by shape and operand source, with 1, 2 and 3 warpgroups issuing per CTA
// (one CTA per SM, 132 CTAs). Each warpgroup chains 2 x 8 k16 products into one accumulator per loop
// step, two commit groups in flight; A per warpgroup, B shared (as Q in the attention backward).
// Reports TFLOP/s (CUDA events), FLOP per clock per SM (clock64) against the dense bf16 peak of 4096,
// and clocks per instruction per warpgroup. Values are arbitrary: the rate does not depend on them.
// Build and run on a Hopper GPU (kernels/NOTES.md, session 6, has the H100 figures):
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -o /tmp/wgmma_rate bench/wgmma_rate.cu && /tmp/wgmma_rate
#include <cstdio>
#include <cuda_bf16.h>
#include "../kernels/csrc/utils.h"
#include "../kernels/csrc/hopper/wgmma.h"
using namespace flash::sm90;
using T = __nv_bfloat16;
constexpr int ITER = 2048;

template <int MODE>
__device__ __forceinline__ void step(float (&acc)[64], uint32_t sa, uint32_t sb, const uint32_t (&a)[4]) {
    float (&acc32)[32] = *reinterpret_cast<float (*)[32]>(&acc[0]);
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) {
        const uint32_t off = (ks / 4) * 64 * 128 + (ks % 4) * 32;
        if constexpr (MODE == 0) wgmma_m64n64k16_ss<T, 0, 0>(acc32, smem_desc(sa + off, 16, 1024), smem_desc(sb + off, 16, 1024), true);
        if constexpr (MODE == 1) wgmma_m64n64k16_ss<T, 1, 1>(acc32, smem_desc(sa + ks * 16 * 128, 128 * 128, 1024), smem_desc(sb + ks * 16 * 128, 128 * 128, 1024), true);
        if constexpr (MODE == 2) wgmma_m64n128k16_rs<T, 1>(acc, a, smem_desc(sb + ks * 16 * 128, 64 * 128, 1024), true);
        if constexpr (MODE == 3) wgmma_m64n128k16_ss<T, 0, 0>(acc, smem_desc(sa + off, 16, 1024), smem_desc(sb + (ks / 4) * 128 * 128 + (ks % 4) * 32, 16, 1024), true);
        if constexpr (MODE == 4) wgmma_m64n64k16_rs<T, 0>(acc32, a, smem_desc(sb + off, 16, 1024), true);
    }
}

template <int MODE>
__global__ void __launch_bounds__(384, 1) rate_kernel(int nwg, float *out, long long *cyc) {
    extern __shared__ __align__(1024) uint8_t smem[];
    const int wg = threadIdx.x / 128;
    for (int i = threadIdx.x; i < 160 * 1024 / 4; i += blockDim.x) reinterpret_cast<uint32_t *>(smem)[i] = 0x3c003c00u ^ (i * 2654435761u & 0x00ff00ffu);
    fence_async_smem();
    __syncthreads();
    if (wg >= nwg) return;
    const uint32_t s0 = flash::smem_u32(smem);
    const uint32_t sa = s0 + wg * 16 * 1024, sb = s0 + 96 * 1024;  // A per warpgroup, B shared (as Q in the backward)
    uint32_t a[4] = {0x3c003c00u, 0x3c003c00u ^ threadIdx.x, 0x3c003c00u, 0x3c003c00u};
    float acc0[64];
    for (int i = 0; i < 64; ++i) acc0[i] = 0.f;
    long long t0 = clock64();
    for (int it = 0; it < ITER; ++it) {
        wgmma_fence();
        step<MODE>(acc0, sa, sb, a);
        wgmma_commit();
        wgmma_wait<1>();
        wgmma_fence();
        step<MODE>(acc0, sa, sb, a);
        wgmma_commit();
        wgmma_wait<1>();
    }
    wgmma_wait<0>();
    long long t1 = clock64();
    float s = 0;
    for (int i = 0; i < 64; ++i) s += acc0[i];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
    if (threadIdx.x % 128 == 0) cyc[blockIdx.x * 3 + wg] = t1 - t0;
}

template <int MODE>
void run(const char *name, int n) {
    auto k = &rate_kernel<MODE>;
    cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 160 * 1024);
    float *out; long long *cyc;
    cudaMalloc(&out, 132 * 384 * 4); cudaMalloc(&cyc, 132 * 3 * 8);
    for (int nwg = 1; nwg <= 3; ++nwg) {
        cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
        k<<<132, 384, 160 * 1024>>>(nwg, out, cyc);
        cudaEventRecord(e0);
        k<<<132, 384, 160 * 1024>>>(nwg, out, cyc);
        cudaEventRecord(e1); cudaEventSynchronize(e1);
        float ms; cudaEventElapsedTime(&ms, e0, e1);
        long long c; cudaMemcpy(&c, cyc, 8, cudaMemcpyDeviceToHost);
        const double flop = 132.0 * nwg * ITER * 2 * 8 * 2.0 * 64 * n * 16;
        const double per_clk = double(nwg) * ITER * 2 * 8 * 2.0 * 64 * n * 16 / c;  // FLOP per clock per SM
        printf("%-28s wgs %d: %7.1f TFLOP/s  %6.0f FLOP/clk/SM (%.0f%% of 4096)  clk/instr/wg %.1f  err %s\n", name, nwg,
               flop / ms / 1e9, per_clk, 100 * per_clk / 4096, double(c) / (ITER * 16), cudaGetErrorString(cudaGetLastError()));
    }
}

int main() {
    run<0>("m64n64k16 SS (K-major)", 64);
    run<1>("m64n64k16 SS (MN-major)", 64);
    run<4>("m64n64k16 RS", 64);
    run<2>("m64n128k16 RS (B MN-major)", 128);
    run<3>("m64n128k16 SS (K-major)", 128);
    return 0;
}
