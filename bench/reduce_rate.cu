// fp32 reduce-add throughput into L2 from all SMs (one CTA per SM), the backward's dQ path
// (kernels/csrc/hopper/flash_bwd_sm90_ws.h): each CTA adds a 32 KB tile (64 rows x 512 bytes) per
// step into dq-like rows (row stride 8 KB: 16 heads of 128 fp32), two steps in flight, by
//   bulk512: cp.reduce.async.bulk, one 512-byte row per instruction (the kernel's form), 32 lanes
//   bulk16k: the same tile as two 16 KB contiguous instructions (a tile-contiguous accumulator)
//   redv4:   red.global.add.v4.f32 from 256 threads (8 per thread and step)
//   red:     red.global.add.f32 from 256 threads (32 per thread and step)
//   redv2acc: red.global.add.v2.f32 from 256 threads in the wgmma accumulator's pattern (each warp 16
//            rows, lanes g = lane / 4 on rows, t = lane % 4 on column pairs; warpgroup w on columns
//            64w..), straight from registers (16 per thread and step)
//   bulkrows: 64 bulk 512-byte rows into a contiguous 32 KB tile (a head-major accumulator)
// and where the tiles go: "shared" (every CTA walks the same 128 tiles in the same order, as the
// CTAs of one head do) or "own" (each CTA its own tiles). Prints TB/s of added bytes and clocks
// per 32 KB step per SM. Build and run on the GPU:
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -o /tmp/reduce_rate bench/reduce_rate.cu && /tmp/reduce_rate
#include <algorithm>
#include <cstdio>
#include <vector>
#include "../kernels/csrc/utils.h"
#include "../kernels/csrc/hopper/wgmma.h"  // first: defines FLASHGPT_WGMMA_ENABLED
#include "../kernels/csrc/hopper/tma.h"
using namespace flash::sm90;

constexpr int STEPS = 512, TILES = 128, ROWS = 64, ROWB = 512, STRIDE = 8192;

template <int MODE>
__global__ void __launch_bounds__(256, 1) reduce_kernel(float *dst, bool shared, long long *cyc) {
    extern __shared__ __align__(1024) uint8_t smem[];
    for (int i = threadIdx.x; i < 2 * ROWS * ROWB / 4; i += blockDim.x) reinterpret_cast<float *>(smem)[i] = 1e-3f * (i % 7);
    fence_async_smem();
    __syncthreads();
    const uint32_t s0 = flash::smem_u32(smem);
    const int lane = threadIdx.x % 32;
    const long long t0 = clock64();
    for (int it = 0; it < STEPS; ++it) {
        const int tile = shared ? it % TILES : (blockIdx.x * 7 + it) % TILES + (blockIdx.x % 4) * TILES;
        // tile t: rows t*64 .. t*64+63 of a (rows, 8 KB) array, 512 bytes used per row; buffer it % 2
        float *base = dst + (int64_t(tile) * ROWS * STRIDE) / 4;
        const uint32_t src = s0 + (it % 2) * ROWS * ROWB;
        if constexpr (MODE == 0 || MODE == 1 || MODE == 5) {
            if (threadIdx.x < 32) {
                if constexpr (MODE == 5) {
                    for (int r = lane; r < ROWS; r += 32)
                        bulk_reduce_add_f32(dst + (int64_t(tile) * ROWS * ROWB) / 4 + r * (ROWB / 4), src + r * ROWB, ROWB);
                } else if constexpr (MODE == 0) {
                    for (int r = lane; r < ROWS; r += 32) bulk_reduce_add_f32(base + r * (STRIDE / 4), src + r * ROWB, ROWB);
                } else if (lane < 2) {  // contiguous destination: rows packed (a tile-ordered accumulator)
                    bulk_reduce_add_f32(dst + (int64_t(tile) * ROWS * ROWB) / 4 + lane * 4096, src + lane * 16384, 16384);
                }
                bulk_commit();
                bulk_wait_read<1>();
            }
        } else if constexpr (MODE == 4) {
            const int w = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, g = lane / 4, t = lane % 4;
            const float v = 1e-3f * it;
#pragma unroll
            for (int hr = 0; hr < 2; ++hr)
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    float *d = base + (warp * 16 + g + 8 * hr) * (STRIDE / 4) + w * 64 + 8 * j + 2 * t;
                    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(d), "f"(v), "f"(v) : "memory");
                }
        } else {
            const float *s = reinterpret_cast<const float *>(smem + (it % 2) * ROWS * ROWB);
            for (int k = 0; k < (MODE == 2 ? 8 : 32); ++k) {
                if constexpr (MODE == 2) {
                    const int e = (k * 256 + threadIdx.x) * 4, r = e / 128, c = e % 128;  // 4 floats
                    float *d = base + r * (STRIDE / 4) + c;
                    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(d), "f"(s[e]), "f"(s[e + 1]),
                                 "f"(s[e + 2]), "f"(s[e + 3])
                                 : "memory");
                } else {
                    const int e = k * 256 + threadIdx.x, r = e / 128, c = e % 128;
                    atomicAdd(base + r * (STRIDE / 4) + c, s[e]);
                }
            }
        }
    }
    if (threadIdx.x < 32) bulk_wait_all();
    __syncthreads();
    if (threadIdx.x == 0) cyc[blockIdx.x] = clock64() - t0;
}

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e_)); return 1; } } while (0)

template <int MODE>
int measure(const char *name, float *dst, long long *cyc, int sms) {
    auto k = &reduce_kernel<MODE>;
    const int smem = 2 * ROWS * ROWB;
    CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    for (int shared = 1; shared >= 0; --shared) {
        std::vector<float> ms;
        cudaEvent_t e0, e1;
        CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
        for (int rep = 0; rep < 7; ++rep) {
            CK(cudaEventRecord(e0));
            k<<<sms, 256, smem>>>(dst, shared, cyc);
            CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
            float t; CK(cudaEventElapsedTime(&t, e0, e1)); ms.push_back(t);
        }
        std::sort(ms.begin(), ms.end());
        std::vector<long long> c(sms);
        CK(cudaMemcpy(c.data(), cyc, sms * 8, cudaMemcpyDeviceToHost));
        std::sort(c.begin(), c.end());
        const double bytes = double(sms) * STEPS * ROWS * ROWB;
        printf("%-8s %-6s %7.3f ms  %6.2f TB/s  %6.0f clocks per 32 KB step (median SM)\n", name, shared ? "shared" : "own",
               ms[3], bytes / ms[3] * 1e-9, double(c[sms / 2]) / STEPS);
    }
    return 0;
}

int main() {
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    float *dst; long long *cyc;
    const size_t bytes = size_t(4) * TILES * ROWS * STRIDE + 64;
    CK(cudaMalloc(&dst, bytes)); CK(cudaMemset(dst, 0, bytes)); CK(cudaMalloc(&cyc, sms * 8));
    if (measure<0>("bulk512", dst, cyc, sms) || measure<1>("bulk16k", dst, cyc, sms) ||
        measure<2>("redv4", dst, cyc, sms) || measure<3>("red", dst, cyc, sms) ||
        measure<4>("redv2acc", dst, cyc, sms) || measure<5>("bulkrows", dst, cyc, sms))
        return 1;
    return 0;
}
