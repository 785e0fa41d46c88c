// Hopper tile loads by the tensor-memory accelerator (TMA) and the mbarriers they complete on, for
// the warp-specialised kernels (flash_fwd_sm90_ws.h).
//
// Host: make_tile_map() describes a (b, rows, heads, d) tensor of 16-bit elements to the TMA as a
// rank-4 tensor {d, rows, heads, b} (innermost first) whose box is 64 columns x box_rows rows, written
// into shared memory with the 128-byte swizzle -- exactly one "atom column" of the layout wgmma reads
// (wgmma.h): element (r, c) of the box lands at r * 128 + (((c / 8) ^ (r % 8)) * 16) + (c % 8) * 2.
// Rows past the tensor's end are zero-filled by the hardware. It returns false (the caller then runs
// the FA2 kernel, or stores directly) when the tensor breaks a TMA rule: base address or a stride not a multiple of
// 16 bytes.
// Device: mbarrier init / arrive / expect-tx / parity wait, the 4-d TMA load, the bulk fp32 reduce-add
// (dQ of the backward), named barriers, register reallocation.
#pragma once
#include <cstdint>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include "../utils.h"

namespace flash {
namespace sm90 {

// ---- host ----------------------------------------------------------------------------------------
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
    static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
        void *p = nullptr;
        cudaDriverEntryPointQueryResult found;
        const cudaError_t err =
            cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &found);
        return (err == cudaSuccess && found == cudaDriverEntryPointSuccess)
                   ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p)
                   : nullptr;
    }();
    return fn;
}

// base: element (0, 0, 0, 0); strides in elements (the d stride is 1). box: 64 (or d, if d < 64)
// columns x box_rows rows of one head of one batch entry.
inline bool make_tile_map(CUtensorMap *map, const void *base, bool is_bf16, int d, int64_t rows, int64_t heads,
                          int64_t batch, int64_t row_stride, int64_t head_stride, int64_t batch_stride,
                          int box_rows) {
    const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
    if (encode == nullptr || reinterpret_cast<uintptr_t>(base) % 16 != 0 || rows <= 0) return false;
    // A dimension of extent 1 is never stepped along; give it a stride the TMA accepts.
    const int64_t row_bytes = row_stride * 2;
    const int64_t head_bytes = heads > 1 ? head_stride * 2 : row_bytes * rows;
    const int64_t batch_bytes = batch > 1 ? batch_stride * 2 : row_bytes * rows;
    for (int64_t s : {row_bytes, head_bytes, batch_bytes})
        if (s <= 0 || s % 16 != 0 || s >= (int64_t(1) << 40)) return false;
    const cuuint64_t dims[4] = {cuuint64_t(d), cuuint64_t(rows), cuuint64_t(heads), cuuint64_t(batch)};
    const cuuint64_t strides[3] = {cuuint64_t(row_bytes), cuuint64_t(head_bytes), cuuint64_t(batch_bytes)};
    const cuuint32_t box[4] = {cuuint32_t(d < 64 ? d : 64), cuuint32_t(box_rows), 1, 1};
    const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
    const CUresult r = encode(map, is_bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
                              const_cast<void *>(base), dims, strides, box, elem_strides,
                              CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS;
}

// ---- device --------------------------------------------------------------------------------------
// All take shared-memory addresses (smem_u32). An mbarrier is 8 bytes, 8-byte aligned.
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
#ifdef FLASHGPT_WGMMA_ENABLED
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
#endif
}
// Make the initialised barriers visible to the async proxy (the TMA unit) before first use.
__device__ __forceinline__ void mbar_init_fence() {
#ifdef FLASHGPT_WGMMA_ENABLED
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}
// One arrival that also announces `bytes` of TMA traffic this phase must see before it completes.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
#ifdef FLASHGPT_WGMMA_ENABLED
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
#endif
}
// One arrival, made only where `pred` holds (a predicate, not a branch: keeps wgmma pipelines intact).
__device__ __forceinline__ void mbar_arrive_if(uint32_t bar, bool pred) {
#ifdef FLASHGPT_WGMMA_ENABLED
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %1, 0;\n@p mbarrier.arrive.shared::cta.b64 _, [%0];\n}\n" ::"r"(bar),
        "r"(int(pred))
        : "memory");
#endif
}
// Wait until the phase of parity `parity` has completed (a fresh barrier is in phase 0, so waiting
// for parity 1 returns at once: the "previous" phase counts as complete).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
#ifdef FLASHGPT_WGMMA_ENABLED
    asm volatile(
        "{\n.reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
#endif
}

// One box of a rank-4 tensor map into shared memory; completes `bytes` on `bar` (announced before).
// Coordinates innermost first: column, row, head, batch.
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap *map, uint32_t bar, int c0, int c1, int c2,
                                            int c3) {
#ifdef FLASHGPT_WGMMA_ENABLED
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], "
        "[%2];\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
        : "memory");
#endif
}
// One box of shared memory (the layout tma_load_4d writes) to a rank-4 tensor map's global tensor,
// in this thread's current bulk group (bulk_commit, then bulk_wait_read before the source is reused).
__device__ __forceinline__ void tma_store_4d(const CUtensorMap *map, uint32_t src, int c0, int c1, int c2, int c3) {
#ifdef FLASHGPT_WGMMA_ENABLED
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
                     reinterpret_cast<uint64_t>(map)),
                 "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
                 : "memory");
#endif
}
__device__ __forceinline__ void tma_prefetch_map(const CUtensorMap *map) {
#ifdef FLASHGPT_WGMMA_ENABLED
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
#endif
}

// dst[0 .. bytes) += src[0 .. bytes) elementwise in fp32, global <- shared, by the bulk-copy unit
// (addresses 16-byte aligned, bytes a multiple of 16); one bulk group per commit.
__device__ __forceinline__ void bulk_reduce_add_f32(float *dst, uint32_t src, uint32_t bytes) {
#ifdef FLASHGPT_WGMMA_ENABLED
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst), "r"(src),
                 "r"(bytes)
                 : "memory");
#endif
}
__device__ __forceinline__ void bulk_commit() {
#ifdef FLASHGPT_WGMMA_ENABLED
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}
// All but this thread's newest `kPending` bulk groups have finished reading shared memory (what
// they read may be overwritten).
template <int kPending = 0>
__device__ __forceinline__ void bulk_wait_read() {
#ifdef FLASHGPT_WGMMA_ENABLED
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
#endif
}
// This thread's bulk groups have completed (their global writes are performed).
__device__ __forceinline__ void bulk_wait_all() {
#ifdef FLASHGPT_WGMMA_ENABLED
    asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
#endif
}
// Order this thread's async-proxy (bulk, TMA) accesses against its generic ones, all state spaces.
__device__ __forceinline__ void fence_async_all() {
#ifdef FLASHGPT_WGMMA_ENABLED
    asm volatile("fence.proxy.async;\n" ::: "memory");
#endif
}
// Named barrier `id` (1..15; 0 is __syncthreads) over `threads` threads (a multiple of 32).
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Arrive at named barrier `id` without waiting (the other side calls named_barrier_sync).
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Register reallocation between the warpgroups of a block (all warps of a warpgroup execute it).
template <int kRegs>
__device__ __forceinline__ void regs_release() {
#ifdef FLASHGPT_WGMMA_ENABLED
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
#endif
}
template <int kRegs>
__device__ __forceinline__ void regs_claim() {
#ifdef FLASHGPT_WGMMA_ENABLED
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
#endif
}

}  // namespace sm90
}  // namespace flash
