// Hopper (sm_90a) building blocks for the wgmma kernels: warpgroup MMA (wgmma) on bf16/fp16 with
// fp32 accumulators, shared-memory matrix descriptors, and the 128-byte swizzle they read.
// Used by hopper/flash_fwd_sm90_ws.h and hopper/flash_bwd_sm90_ws.h.
//
// Shared-memory tiles ("128B-swizzled atoms"): a tile of R rows x 64 16-bit elements (128 bytes per
// row) is stored row after row; within each 1024-byte group of 8 rows, the 16-byte chunk c of row r
// sits at chunk position c ^ (r % 8). Wider tiles are stored as consecutive such column blocks
// ("atom columns"): element (r, c) of an R x C tile lives in atom column c / 64 at
//   (c / 64) * R * 128 + r * 128 + (((c % 64) / 8) ^ (r % 8)) * 16 + (c % 8) * 2   bytes.
// Tiles must start 1024-byte aligned (the descriptor's base-offset field is left 0).
//
// Operand layouts used (PTX ISA, "Asynchronous Warpgroup Level Matrix Shared Memory Layout"):
//   K-major (A = Q rows x d, B = K keys x d: the reduction dim contiguous): descriptor with
//     SBO = 1024 B (next group of 8 rows), LBO unused (1); a k16 step advances the start address by
//     32 B inside an atom column, and by R * 128 B to the next atom column every 4 steps.
//   MN-major (B = V keys x d used as K = keys, N = d, d contiguous; wgmma's tnspB = 1):
//     SBO = 1024 B (next 8 keys), LBO = R * 128 B (next 64 columns of N, i.e. the next atom column);
//     a k16 step advances the start address by 16 rows = 2048 B.
// Accumulator layout, m64nNk16 f32: warp w of the warpgroup owns rows 16w..16w+15; register
// d[4j + i] is (row 16w + g + 8*(i/2), column 8j + 2t + (i%2)), g = lane/4, t = lane%4 -- the
// mma.m16n8 C fragment, repeated over N/8 column tiles. A from registers (RS form) uses the
// mma.m16n8k16 A fragment of rows 16w..16w+15, so an S accumulator converts to P in registers.
#pragma once
#include <cstdint>
#include <type_traits>
#include "../utils.h"

namespace flash {
namespace sm90 {

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FLASHGPT_WGMMA_ENABLED 1
#endif

// Byte offset of element (r, c) in a swizzled R-row tile (see the header comment).
template <int R>
__host__ __device__ constexpr int swizzled_offset(int r, int c) {
    return (c / 64) * R * 128 + r * 128 + ((((c % 64) / 8) ^ (r % 8)) * 16) + (c % 8) * 2;
}

// 64-bit shared-memory matrix descriptor: start address, leading / stride byte offsets (all >> 4),
// swizzle mode 1 = 128 B (bits 62-63). smem_desc_u18 leaves out the start field's 14-bit mask, a
// no-op for addresses below 2^18 (all of shared memory): two uniform instructions fewer per
// descriptor in the kernels' inner loops.
__device__ __forceinline__ uint64_t smem_desc_u18(uint32_t smem_addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
    return uint64_t(smem_addr >> 4) | (uint64_t((lbo_bytes >> 4) & 0x3FFF) << 16) |
           (uint64_t((sbo_bytes >> 4) & 0x3FFF) << 32) | (uint64_t(1) << 62);
}
__device__ __forceinline__ uint64_t smem_desc(uint32_t smem_addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
    return smem_desc_u18(smem_addr & (0x3FFFu << 4), lbo_bytes, sbo_bytes);
}

// desc advanced by off_bytes (a multiple of 16): the start address field is the low 14 bits, in
// 16-byte units, and shared-memory addresses stay below 2^18 bytes, so the add never carries out.
__device__ __forceinline__ uint64_t desc_at(uint64_t desc, uint32_t off_bytes) { return desc + (off_bytes >> 4); }

// Byte offset of columns 8j + 2t and 8j + 2t + 1 (16-bit elements; a wgmma accumulator thread's
// pair) of row r in a 128B-swizzled tile of 64-column atoms: atom j / 8 at atom_bytes * (j / 8), row r
// at r * 128, 16-byte chunk k of a row at (k ^ r % 8) * 16 -- the layout TMA loads and stores. The
// eight rows g = 0..7 of an accumulator store hit eight different chunks: no bank conflicts.
__device__ __forceinline__ int swizzled_pair_offset(int r, int j, int t, int atom_bytes) {
    return (j / 8) * atom_bytes + r * 128 + (((j % 8) ^ (r % 8)) * 16) + t * 4;
}

// x, hidden from the optimiser: what derives from it is computed where it is used. Keeps the block
// loops from hoisting loop-invariant descriptors / addresses into registers (which it then spills).
__device__ __forceinline__ uint32_t opaque(uint32_t x) {
    asm volatile("" : "+r"(x));
    return x;
}

__device__ __forceinline__ void wgmma_fence() {
#ifdef FLASHGPT_WGMMA_ENABLED
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#ifdef FLASHGPT_WGMMA_ENABLED
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#ifdef FLASHGPT_WGMMA_ENABLED
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
// Generic-proxy writes to shared memory (st.shared, cp.async) become visible to wgmma's async proxy.
__device__ __forceinline__ void fence_async_smem() {
#ifdef FLASHGPT_WGMMA_ENABLED
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// Four 8 x 8 matrices of 16-bit values from registers into shared memory (stmatrix). Lane l gives the
// address of row l % 8 of matrix l / 8 (16 contiguous bytes); r[i] holds this lane's pair of matrix i,
// row l / 4, columns 2 (l % 4) and + 1 (the mma / wgmma A-fragment layout).
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, const uint32_t (&r)[4]) {
#ifdef FLASHGPT_WGMMA_ENABLED
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]),
                 "r"(r[1]), "r"(r[2]), "r"(r[3])
                 : "memory");
#endif
}

// wgmma's accumulator operands: "+f" constraints on d[0 .. N - 1] and the matching "{%0, ..., %N-1}" lists.
#define FLASHGPT_D8(d, b)                                                                                  \
    "+f"(d[(b) + 0]), "+f"(d[(b) + 1]), "+f"(d[(b) + 2]), "+f"(d[(b) + 3]), "+f"(d[(b) + 4]), "+f"(d[(b) + 5]), \
    "+f"(d[(b) + 6]), "+f"(d[(b) + 7])
#define FLASHGPT_D32(d) FLASHGPT_D8(d, 0), FLASHGPT_D8(d, 8), FLASHGPT_D8(d, 16), FLASHGPT_D8(d, 24)
#define FLASHGPT_D64(d) \
    FLASHGPT_D32(d), FLASHGPT_D8(d, 32), FLASHGPT_D8(d, 40), FLASHGPT_D8(d, 48), FLASHGPT_D8(d, 56)
#define FLASHGPT_D80(d) FLASHGPT_D64(d), FLASHGPT_D8(d, 64), FLASHGPT_D8(d, 72)
#define FLASHGPT_R0_31 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define FLASHGPT_R32_63 \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define FLASHGPT_REGS32 "{" FLASHGPT_R0_31 "}"
#define FLASHGPT_REGS64 "{" FLASHGPT_R0_31 ", " FLASHGPT_R32_63 "}"
#define FLASHGPT_REGS80                                      \
    "{" FLASHGPT_R0_31 ", " FLASHGPT_R32_63 ", "             \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79}"

template <typename T> struct WgmmaType;
template <> struct WgmmaType<__nv_bfloat16> { static constexpr const char *name = "bf16"; };
template <> struct WgmmaType<__half> { static constexpr const char *name = "f16"; };

// D (64 x 128, fp32) (+)= A (64 x 16, smem; tnspA = 0: K-major (M rows x K), 1: MN-major (K rows x
// M)) * B (16 x 128, smem; tnspB = 0: K-major (N rows x K), 1: MN-major (K rows x N)).
// accumulate == false overwrites D.
template <typename T, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n128k16_ss(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                                    bool accumulate) {
#ifdef FLASHGPT_WGMMA_ENABLED
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " FLASHGPT_REGS64
            ", %64, %65, p, 1, 1, %67, %68;\n}\n"
            : FLASHGPT_D64(d)
            : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)), "n"(kTransA), "n"(kTransB));
    } else {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " FLASHGPT_REGS64
            ", %64, %65, p, 1, 1, %67, %68;\n}\n"
            : FLASHGPT_D64(d)
            : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)), "n"(kTransA), "n"(kTransB));
    }
#endif
}

// D (64 x 160, fp32) (+)= A (64 x 16, smem) * B (16 x 160, smem), both K-major: S = Q K^T over a
// 160-key tile (the forward's wide tiles, dispatch.h wide_key_tiles).
template <typename T>
__device__ __forceinline__ void wgmma_m64n160k16_ss(float (&d)[80], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
#ifdef FLASHGPT_WGMMA_ENABLED
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %82, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n160k16.f32.bf16.bf16 " FLASHGPT_REGS80
            ", %80, %81, p, 1, 1, 0, 0;\n}\n"
            : FLASHGPT_D80(d)
            : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)));
    } else {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %82, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n160k16.f32.f16.f16 " FLASHGPT_REGS80
            ", %80, %81, p, 1, 1, 0, 0;\n}\n"
            : FLASHGPT_D80(d)
            : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)));
    }
#endif
}

// D (64 x 128, fp32) (+)= A (64 x 16, registers: this warp's mma.m16n8k16 A fragment) * B (smem).
template <typename T, int kTransB>
__device__ __forceinline__ void wgmma_m64n128k16_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b,
                                                    bool accumulate) {
#ifdef FLASHGPT_WGMMA_ENABLED
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " FLASHGPT_REGS64
            ", {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
            : FLASHGPT_D64(d)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(int(accumulate)), "n"(kTransB));
    } else {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " FLASHGPT_REGS64
            ", {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
            : FLASHGPT_D64(d)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(int(accumulate)), "n"(kTransB));
    }
#endif
}

// D (64 x 64, fp32) (+)= A (64 x 16, smem) * B (16 x 64, smem). kTransA = 0: A K-major (M rows x K),
// 1: MN-major (K rows x M, M contiguous); kTransB likewise for B (0: N rows x K, 1: K rows x N).
// Used by the backward: S^T = K Q^T and dP^T = V dO^T (0, 0); dQ = dS K with dS read from dS^T (1, 1).
template <typename T, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], uint64_t desc_a, uint64_t desc_b,
                                                   bool accumulate) {
#ifdef FLASHGPT_WGMMA_ENABLED
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " FLASHGPT_REGS32
            ", %32, %33, p, 1, 1, %35, %36;\n}\n"
            : FLASHGPT_D32(d)
            : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)), "n"(kTransA), "n"(kTransB));
    } else {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " FLASHGPT_REGS32
            ", %32, %33, p, 1, 1, %35, %36;\n}\n"
            : FLASHGPT_D32(d)
            : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)), "n"(kTransA), "n"(kTransB));
    }
#endif
}

// D (64 x 64, fp32) (+)= A (64 x 16, registers) * B (smem), as wgmma_m64n128k16_rs with N = 64.
template <typename T, int kTransB>
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b,
                                                   bool accumulate) {
#ifdef FLASHGPT_WGMMA_ENABLED
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " FLASHGPT_REGS32
            ", {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
            : FLASHGPT_D32(d)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(int(accumulate)), "n"(kTransB));
    } else {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " FLASHGPT_REGS32
            ", {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
            : FLASHGPT_D32(d)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(int(accumulate)), "n"(kTransB));
    }
#endif
}

// O (64 x N) (+)= A (registers) * B (smem, MN-major when kTransB): N = the head dim, 64 or 128.
template <typename T, int N, int kTransB>
__device__ __forceinline__ void wgmma_rs_n(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b, bool accumulate) {
    static_assert(N == 64 || N == 128, "head dims 64 and 128");
    if constexpr (N == 128) {
        wgmma_m64n128k16_rs<T, kTransB>(d, a, desc_b, accumulate);
    } else {
        wgmma_m64n64k16_rs<T, kTransB>(d, a, desc_b, accumulate);
    }
}

}  // namespace sm90
}  // namespace flash
