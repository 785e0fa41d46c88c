// A one-tile probe of the wgmma building blocks (wgmma.h), the two products of attention:
//   C1 = A B^T       A: 64 x 128 (rows x d), B: 128 x 128 (keys x d), both K-major in shared memory
//   C2 = bf16(C1) V  V: 128 x 128 (keys x d) MN-major (tnspB = 1); bf16(C1) from registers (RS form)
// One warpgroup (128 threads), fp32 out, row-major. tests/kernels/test_wgmma_probe_gpu.py compares
// both with torch. It checks the descriptors, the swizzle, the accumulator and register-A layouts
// before the Hopper attention kernels rely on them.
#include <type_traits>
#include "../flash.h"
#include "wgmma.h"

namespace flash {
namespace sm90 {

template <int R, int C, typename T>
__device__ void load_swizzled(uint8_t *smem, const T *gmem, int tid, int nthreads) {
    // 16-byte chunks: (R rows x C/8 chunks), plain loads (the probe is about layouts, not speed).
    for (int idx = tid; idx < R * C / 8; idx += nthreads) {
        const int r = idx / (C / 8), c = (idx % (C / 8)) * 8;
        *reinterpret_cast<uint4 *>(smem + swizzled_offset<R>(r, c)) =
            *reinterpret_cast<const uint4 *>(gmem + r * C + c);
    }
}

template <typename T>
__global__ void __launch_bounds__(128) wgmma_probe_kernel(const T *a, const T *b, const T *v, float *c1,
                                                          float *c2) {
#ifdef FLASHGPT_WGMMA_ENABLED
    extern __shared__ __align__(1024) uint8_t smem[];
    uint8_t *sA = smem;                  // 64 x 128:  16 KB
    uint8_t *sB = sA + 64 * 128 * 2;     // 128 x 128: 32 KB
    uint8_t *sV = sB + 128 * 128 * 2;    // 128 x 128: 32 KB
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    load_swizzled<64, 128>(sA, a, tid, 128);
    load_swizzled<128, 128>(sB, b, tid, 128);
    load_swizzled<128, 128>(sV, v, tid, 128);
    fence_async_smem();
    __syncthreads();

    float d1[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) d1[i] = 0.f;
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) {  // k = d in steps of 16; 4 steps per 64-column atom
        const uint32_t a_addr = smem_u32(sA) + (ks / 4) * 64 * 128 + (ks % 4) * 32;
        const uint32_t b_addr = smem_u32(sB) + (ks / 4) * 128 * 128 + (ks % 4) * 32;
        wgmma_m64n128k16_ss<T, 0, 0>(d1, smem_desc(a_addr, 16, 1024), smem_desc(b_addr, 16, 1024), ks > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();

    // P = bf16(C1) as A fragments, all built before the fence (registers a wgmma reads must not
    // change between the fence and the wgmma: ptxas otherwise inserts extra fences).
    uint32_t p[8][4];
#pragma unroll
    for (int kc = 0; kc < 8; ++kc) {  // k = keys in steps of 16: C1 columns 16kc..16kc+15
        p[kc][0] = pack2<T>(d1[8 * kc + 0], d1[8 * kc + 1]);  // (row g,   k 2t..)    n8 tile 2kc
        p[kc][1] = pack2<T>(d1[8 * kc + 2], d1[8 * kc + 3]);  // (row g+8, k 2t..)
        p[kc][2] = pack2<T>(d1[8 * kc + 4], d1[8 * kc + 5]);  // (row g,   k 8+2t..)  n8 tile 2kc+1
        p[kc][3] = pack2<T>(d1[8 * kc + 6], d1[8 * kc + 7]);  // (row g+8, k 8+2t..)
    }
    float d2[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) d2[i] = 0.f;
    wgmma_fence();
#pragma unroll
    for (int kc = 0; kc < 8; ++kc) {
        const uint32_t v_addr = smem_u32(sV) + kc * 16 * 128;  // 16 keys down, atom column 0
        wgmma_m64n128k16_rs<T, 1>(d2, p[kc], smem_desc(v_addr, 128 * 128, 1024), kc > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();

#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int r = 16 * warp + g + 8 * (i / 2), c = 8 * j + 2 * t + (i % 2);
            c1[r * 128 + c] = d1[4 * j + i];
            c2[r * 128 + c] = d2[4 * j + i];
        }
#else
    __trap();  // built without sm_90a: the host side refuses before launching
#endif
}

}  // namespace sm90
}  // namespace flash

template <typename T>
void run_wgmma_probe(const void *a, const void *b, const void *v, float *c1, float *c2, cudaStream_t stream) {
    constexpr int smem = (64 * 128 + 2 * 128 * 128) * 2;  // 80 KB
    auto kernel = &flash::sm90::wgmma_probe_kernel<T>;
    FLASH_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    kernel<<<1, 128, smem, stream>>>(static_cast<const T *>(a), static_cast<const T *>(b),
                                     static_cast<const T *>(v), c1, c2);
    FLASH_KERNEL_LAUNCH_CHECK();
}
template void run_wgmma_probe<__nv_bfloat16>(const void *, const void *, const void *, float *, float *, cudaStream_t);
template void run_wgmma_probe<__half>(const void *, const void *, const void *, float *, float *, cudaStream_t);
