// Device helpers: thin wrappers over the PTX we use (ldmatrix, mma.sync m16n8k16, cp.async),
// fragment packing, and host-side error checking. Torch-free.
//
// mma.sync.m16n8k16 fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k16"),
// with g = lane / 4 ("group") and t = lane % 4 ("thread in group"):
//   A (16x16, row-major), 4 x b32 regs, each 2 elements along k:
//     a0: (row g,   k 2t..2t+1)   a1: (row g+8, k 2t..2t+1)
//     a2: (row g,   k 2t+8..+9)   a3: (row g+8, k 2t+8..+9)
//   B (16x8, "col"), 2 x b32 regs:  b0: (k 2t..2t+1, col g)   b1: (k 2t+8..+9, col g)
//   C/D (16x8 fp32), 4 floats:      c0,c1: (row g, col 2t..2t+1)   c2,c3: (row g+8, same cols)
// ldmatrix.x4: lanes 8i..8i+7 give the 8 row addresses (16 bytes each) of matrix i; register i of
//   a lane receives matrix i's (row lane/4, cols 2*(lane%4)..+1); with .trans, (rows 2*(lane%4)..+1,
//   col lane/4) of the stored matrix, i.e. the transpose.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>

#define FLASH_CHECK_CUDA(call)                                                              \
    do {                                                                                    \
        cudaError_t err_ = (call);                                                          \
        if (err_ != cudaSuccess) {                                                          \
            throw std::runtime_error(std::string("flashgpt kernel: CUDA error '") +         \
                                     cudaGetErrorString(err_) + "' at " __FILE__ ":" +      \
                                     std::to_string(__LINE__));                             \
        }                                                                                   \
    } while (0)

// After every launch: catches bad launch configs (e.g. too much shared memory) at once.
#define FLASH_KERNEL_LAUNCH_CHECK() FLASH_CHECK_CUDA(cudaGetLastError())

namespace flash {

__host__ __device__ constexpr int cdiv(int a, int b) { return (a + b - 1) / b; }

__device__ __forceinline__ uint32_t smem_u32(const void *p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- ldmatrix -------------------------------------------------------------------------------
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// ---- mma.sync m16n8k16, fp32 accumulate (HMMA.16816.F32 in SASS) -----------------------------
template <typename T> struct Mma;
template <> struct Mma<__nv_bfloat16> {
    static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                               uint32_t b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};
template <> struct Mma<__half> {
    static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                               uint32_t b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
            "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};
template <typename T>
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    Mma<T>::run(d, a, b0, b1);
}

// ---- two fp32 -> one b32 register of two 16-bit values (lo in the low half) -------------------
template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}
template <> __device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}
template <typename T> __device__ __forceinline__ float2 unpack2(uint32_t v);
// bf16 is the high half of an fp32: a shift and a mask, cheaper than the intrinsic's PRMT sequence.
template <> __device__ __forceinline__ float2 unpack2<__nv_bfloat16>(uint32_t v) {
    return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));
}
template <> __device__ __forceinline__ float2 unpack2<__half>(uint32_t v) {
    return __half22float2(*reinterpret_cast<__half2 *>(&v));
}

// ---- cp.async (global -> shared, 16 bytes, bypassing L1) -------------------------------------
// pred == false: zero-fills the 16 bytes and reads nothing (src must still be a valid address).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void *src, bool pred) {
    const int n = pred ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
// 4-byte variant (row statistics); pred == false zero-fills.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void *src, bool pred) {
    const int n = pred ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Copy a (ROWS x D) tile of 16-bit elements from global (row stride in elements, last dim
// contiguous) to shared memory (row stride S elements). Rows >= rows_left are zero-filled:
// zeros keep the out-of-range rows harmless in every product (0 * anything finite = 0).
// When the threads cover whole rows (NTHREADS % chunks-per-row == 0), each thread walks down a
// fixed column with one base offset and a constant row step: few live registers for addresses
// (the compiler hoists per-chunk addresses out of the main loop otherwise).
template <int ROWS, int D, int S, int NTHREADS, bool Is_even, typename T>
__device__ __forceinline__ void load_tile_async(T *smem, const T *gmem, int64_t row_stride,
                                                int rows_left, int tid) {
    constexpr int kChunksPerRow = D / 8;  // 8 x 16-bit = 16 bytes
    constexpr int kChunks = ROWS * kChunksPerRow;
    if constexpr (NTHREADS % kChunksPerRow == 0 && kChunks % NTHREADS == 0) {
        constexpr int kRowStep = NTHREADS / kChunksPerRow;
        const int r0 = tid / kChunksPerRow, c = (tid % kChunksPerRow) * 8;
        const T *src0 = gmem + r0 * row_stride + c;
        const uint32_t dst0 = smem_u32(smem + r0 * S + c);
#pragma unroll
        for (int i = 0; i < kChunks / NTHREADS; ++i) {
            const bool pred = Is_even || r0 + i * kRowStep < rows_left;
            const T *src = pred ? src0 + i * kRowStep * row_stride : gmem;
            cp_async_16(dst0 + i * kRowStep * S * int(sizeof(T)), src, pred);
        }
    } else {
#pragma unroll
        for (int i = 0; i < cdiv(kChunks, NTHREADS); ++i) {
            const int idx = tid + i * NTHREADS;
            if (kChunks % NTHREADS == 0 || idx < kChunks) {
                const int r = idx / kChunksPerRow, c = idx % kChunksPerRow;
                const bool pred = Is_even || r < rows_left;
                const T *src = pred ? gmem + r * row_stride + c * 8 : gmem;
                cp_async_16(smem_u32(smem + r * S + c * 8), src, pred);
            }
        }
    }
}

// Copy a (ROWS x D) tile from shared (row stride S) to global with 16-byte stores, rows < rows_left.
template <int ROWS, int D, int S, int NTHREADS, typename T>
__device__ __forceinline__ void store_tile(T *gmem, const T *smem, int64_t row_stride,
                                           int rows_left, int tid) {
    constexpr int kChunksPerRow = D / 8;
    constexpr int kChunks = ROWS * kChunksPerRow;
#pragma unroll
    for (int i = 0; i < cdiv(kChunks, NTHREADS); ++i) {
        const int idx = tid + i * NTHREADS;
        if (kChunks % NTHREADS == 0 || idx < kChunks) {
            const int r = idx / kChunksPerRow, c = idx % kChunksPerRow;
            if (r < rows_left) {
                *reinterpret_cast<uint4 *>(gmem + r * row_stride + c * 8) =
                    *reinterpret_cast<const uint4 *>(smem + r * S + c * 8);
            }
        }
    }
}

// Reductions over the 4 threads of a quad (the threads that share a row of a C fragment).
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffff, x, 1);
    return x + __shfl_xor_sync(0xffffffff, x, 2);
}

}  // namespace flash
