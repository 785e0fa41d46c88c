// Hopper backward (issue 8): the FA2 backward (parallel over key blocks, dQ accumulated with atomics)
// with all five products on wgmma. Head dim 128 on sm_90a; dispatch: hopper/dispatch.h.
//
// Block: 128 keys (n_block), 2 warpgroups (256 threads); warpgroup wg owns keys 64wg..64wg+63, warp w
// of it keys 16w..16w+15 of those (the wgmma accumulator rows). Query blocks of BM = 64 rows are
// visited in order; per query block, per warpgroup (shapes rows x columns):
//   S^T  (64 keys x 64 q)   = K_wg Q^T        SS m64n64, both K-major (d contiguous), 8 k16 over d
//   dP^T (64 keys x 64 q)   = V_wg dO^T       SS m64n64, likewise (its own wgmma group)
//   P^T = exp(S^T * scale - LSE[q])           in registers while dP^T is still running
//   dV_wg (64 x 128 d)     += P^T dO          RS m64n128: P^T as A fragments, dO MN-major (tnspB 1)
//   dS^T = P^T o (dP^T - D[q])                while dV runs (P^T read back from its 16-bit fragments)
//   dK_wg (64 x 128 d)     += dS^T Q          RS m64n128: dS^T as A fragments, Q MN-major
//   dS^T -> shared memory (16-bit), then both warpgroups together:
//   dQ (64 q x 64 d cols of wg) = dS K    SS m64n64, A = dS read MN-major from dS^T (tnspA 1),
//                                          B = K columns 64wg.. MN-major (tnspB 1); 8 k16 over keys;
//   added to the fp32 dq_accum with atomics (in key-block order if deterministic), as the FA2 kernels.
// Shared memory, 128B-swizzled (wgmma.h): K, V 128 x 128 (32 KB each), Q and dO 64 x 128 double-
// buffered (4 x 16 KB), dS^T 128 x 64 (16 KB), LSE and D 2 x 64 floats each: 145 KB.
// Ragged edges as the FA2 backward: Q/dO rows past the sequence are zero (so are their LSE / D),
// K/V rows past it are zero and their dK/dV rows are not written.
#pragma once
#include "../flash.h"
#include "../flash_bwd_common.h"  // BwdBlockPtrs, BwdRange, load_row_stats
#include "../launch.h"
#include "../static_switch.h"
#include "tile_io.h"
#include "wgmma.h"

namespace flash {
namespace sm90 {

constexpr int kBwdBM = 64, kBwdBN = 128, kBwdThreads = 256;
constexpr int kBwdDSBytes = kBwdBN * kBwdBM * 2;  // 16 KB: dS^T
template <int D> constexpr int kBwdKVBytes = kBwdBN * D * 2;  // K or V (32 KB at D = 128)
template <int D> constexpr int kBwdQBytes = kBwdBM * D * 2;   // one Q or dO buffer (16 KB at D = 128)
template <int D>
constexpr int kBwdSmemBytes = 2 * kBwdKVBytes<D> + 4 * kBwdQBytes<D> + kBwdDSBytes + 4 * kBwdBM * 4;

// A fragments (mma.m16n8k16 A layout, k = the accumulator's columns) of a 64 x 64 accumulator,
// 16 columns per step: four k16 steps.
template <typename T>
__device__ __forceinline__ void to_a_fragments(const float (&acc)[32], uint32_t (&a)[4][4]) {
#pragma unroll
    for (int kc = 0; kc < 4; ++kc) {
        a[kc][0] = pack2<T>(acc[8 * kc + 0], acc[8 * kc + 1]);  // (row g,   cols 16kc + 2t..)
        a[kc][1] = pack2<T>(acc[8 * kc + 2], acc[8 * kc + 3]);  // (row g+8, cols 16kc + 2t..)
        a[kc][2] = pack2<T>(acc[8 * kc + 4], acc[8 * kc + 5]);  // (row g,   cols 16kc + 8 + 2t..)
        a[kc][3] = pack2<T>(acc[8 * kc + 6], acc[8 * kc + 7]);  // (row g+8, cols 16kc + 8 + 2t..)
    }
}

template <typename T, int D, bool Is_causal, bool Is_even>
__global__ void __launch_bounds__(kBwdThreads, 1) flash_bwd_sm90_kernel(const Flash_bwd_params params) {
#ifdef FLASHGPT_WGMMA_ENABLED
    constexpr int BM = kBwdBM, BN = kBwdBN, NT = kBwdThreads;
    // D = 64 (dQ as per-warpgroup partial sums) passed the GPU tests in commit "Hopper kernels for
    // head dim 64 too" but ran at 0.8x the FA2 backward, so it was taken out (kernels/NOTES.md).
    static_assert(D == 128, "the Hopper backward is built for head dim 128");
    constexpr int kBwdKVBytes = flash::sm90::kBwdKVBytes<D>, kBwdQBytes = flash::sm90::kBwdQBytes<D>;
    constexpr float kLog2e = 1.4426950408889634f;
    extern __shared__ __align__(1024) uint8_t smem[];
    uint8_t *sK = smem;
    uint8_t *sV = sK + kBwdKVBytes;
    uint8_t *sQ = sV + kBwdKVBytes;      // 2 buffers
    uint8_t *sdO = sQ + 2 * kBwdQBytes;  // 2 buffers
    uint8_t *sdS = sdO + 2 * kBwdQBytes;
    float *sLSE = reinterpret_cast<float *>(sdS + kBwdDSBytes);  // 2 x BM
    float *sDsum = sLSE + 2 * BM;                                 // 2 x BM

    const int n_block = blockIdx.y;
    const int b = blockIdx.x / params.h, h = blockIdx.x % params.h;
    const int tid = threadIdx.x, wg = tid / 128, warp = (tid % 128) / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;
    const int key_row0 = wg * 64 + warp * 16;  // first key (in the block) of this warp's rows

    const SeqInfo seq(params, b);
    if (n_block * BN >= seq.sk) return;
    const BwdRange range = BwdRange::make<Is_causal>(seq, n_block, BM, BN);
    const BwdBlockPtrs<T> gp(params, seq, b, h, n_block, BN, D);

    // Query block m (Q, dO, LSE, D) into buffer buf; rows past the sequence zero.
    auto load_q_block = [&](int m, int buf) {
        const int rows = seq.sq - m * BM;
        load_tile_swizzled<BM, D, NT, Is_even>(sQ + buf * kBwdQBytes, gp.q + int64_t(m) * BM * params.q_row_stride,
                                            params.q_row_stride, rows, tid);
        load_tile_swizzled<BM, D, NT, Is_even>(sdO + buf * kBwdQBytes, gp.dO + int64_t(m) * BM * params.do_row_stride,
                                            params.do_row_stride, rows, tid);
        load_row_stats<BM>(gp, rows, m, sLSE + buf * BM, sDsum + buf * BM, tid);
    };

    load_tile_swizzled<BN, D, NT, Is_even>(sK, gp.k, params.k_row_stride, range.keys_left, tid);
    load_tile_swizzled<BN, D, NT, Is_even>(sV, gp.v, params.v_row_stride, range.keys_left, tid);
    if (range.m_min < range.m_max) load_q_block(range.m_min, 0);
    cp_async_commit();

    float acc_dk[D / 2], acc_dv[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) acc_dk[i] = acc_dv[i] = 0.f;
    const float scale_log2 = params.scale_softmax_log2;
    const uint32_t k_rows = smem_u32(sK) + wg * 64 * 128;  // this warpgroup's 64 key rows (A operands)
    const uint32_t v_rows = smem_u32(sV) + wg * 64 * 128;
    const uint32_t k_cols = smem_u32(sK) + wg * BN * 128;  // atom column wg: head-dim cols 64wg.. (dQ's B)
    const uint32_t ds_base = smem_u32(sdS);

    for (int m = range.m_min, it = 0; m < range.m_max; ++m, ++it) {
        const int buf = it & 1;
        // Block m has landed and is visible to wgmma; both warpgroups are done with iteration it-1
        // (its reads of buffer buf^1 and of sdS): only now may block m+1 overwrite buf^1.
        cp_async_wait<0>();
        fence_async_smem();
        __syncthreads();
        if (m + 1 < range.m_max) load_q_block(m + 1, buf ^ 1);
        cp_async_commit();
        const uint32_t q_base = smem_u32(sQ + buf * kBwdQBytes), do_base = smem_u32(sdO + buf * kBwdQBytes);
        const float *sL = sLSE + buf * BM, *sDs = sDsum + buf * BM;

        // ---- S^T = K_wg Q^T and dP^T = V_wg dO^T (64 keys x 64 queries), two wgmma groups ---------
        // Then: P^T while dP^T is still on the tensor cores; dV += P^T dO issued before dS^T is
        // computed, so the dS^T arithmetic overlaps it.
        float acc_s[32], acc_dp[32];
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
            const uint32_t off_kv = (ks / 4) * BN * 128 + (ks % 4) * 32;  // atom column, 32 B per k16
            const uint32_t off_q = (ks / 4) * BM * 128 + (ks % 4) * 32;
            wgmma_m64n64k16_ss<T, 0, 0>(acc_s, smem_desc(k_rows + off_kv, 16, 1024),
                                        smem_desc(q_base + off_q, 16, 1024), ks > 0);
        }
        wgmma_commit();
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
            const uint32_t off_kv = (ks / 4) * BN * 128 + (ks % 4) * 32;
            const uint32_t off_q = (ks / 4) * BM * 128 + (ks % 4) * 32;
            wgmma_m64n64k16_ss<T, 0, 0>(acc_dp, smem_desc(v_rows + off_kv, 16, 1024),
                                        smem_desc(do_base + off_q, 16, 1024), ks > 0);
        }
        wgmma_commit();
        wgmma_wait<1>();  // S^T has landed

        // ---- P^T in registers; element 4j+i: key key_row0+g+8(i/2), query 8j+2t+(i%2) -------------
        const bool need_mask = Is_causal && (n_block * BN + BN - 1 > m * BM + range.causal_off);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const float2 lse = *reinterpret_cast<const float2 *>(sL + 8 * j + 2 * t);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float l = (i % 2) ? lse.y : lse.x;
                float p = exp2f(acc_s[4 * j + i] * scale_log2 - l * kLog2e);
                if (need_mask) {
                    const int key = n_block * BN + key_row0 + g + 8 * (i / 2);
                    const int q = m * BM + 8 * j + 2 * t + (i % 2);
                    if (key > q + range.causal_off) p = 0.f;
                }
                acc_s[4 * j + i] = p;
            }
        }
        uint32_t a_p[4][4], a_ds[4][4];  // k = queries, 4 steps of 16
        to_a_fragments<T>(acc_s, a_p);

        // ---- dV += P^T dO (k = the 64 queries; dO MN-major: LBO = next 64 head-dim columns) -------
        wgmma_fence();
#pragma unroll
        for (int kc = 0; kc < BM / 16; ++kc)
            wgmma_rs_n<T, D, 1>(acc_dv, a_p[kc], smem_desc(do_base + kc * 16 * 128, BM * 128, 1024), true);
        wgmma_commit();
        wgmma_wait<1>();  // dP^T has landed (dV may still run)

        // ---- dS^T = P^T o (dP^T - D), straight into A fragments; P^T read back from its 16-bit
        //      fragments (the fp32 copy is dead by now: 32 registers fewer at the peak) ------------
#pragma unroll
        for (int kc = 0; kc < 4; ++kc)
#pragma unroll
            for (int e = 0; e < 4; ++e) {  // fragment e: n8 tile j = 2kc + e/2, rows +8*(e%2)
                const int j = 2 * kc + e / 2, i0 = 4 * j + 2 * (e % 2);
                const float2 dsum = *reinterpret_cast<const float2 *>(sDs + 8 * j + 2 * t);
#ifdef FLASHGPT_BWD_FP32_P  // fallback: P^T from its fp32 registers (spills ~16-24 B at 255 registers)
                const float2 pp = make_float2(acc_s[i0], acc_s[i0 + 1]);
#else
                const float2 pp = unpack2<T>(a_p[kc][e]);
#endif
                a_ds[kc][e] = pack2<T>(pp.x * (acc_dp[i0] - dsum.x), pp.y * (acc_dp[i0 + 1] - dsum.y));
            }

        // ---- dK += dS^T Q (Q MN-major), and dS^T (keys x queries) to shared memory for dQ ----------
        wgmma_fence();
#pragma unroll
        for (int kc = 0; kc < BM / 16; ++kc)
            wgmma_rs_n<T, D, 1>(acc_dk, a_ds[kc], smem_desc(q_base + kc * 16 * 128, BM * 128, 1024), true);
        wgmma_commit();
#pragma unroll
        for (int kc = 0; kc < 4; ++kc)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = key_row0 + g + 8 * (e % 2), c = 16 * kc + 8 * (e / 2) + 2 * t;
                *reinterpret_cast<uint32_t *>(sdS + swizzled_offset<BN>(r, c)) = a_ds[kc][e];
            }

        fence_async_smem();  // dS^T stores -> visible to wgmma
        __syncthreads();     // both warpgroups' halves of dS^T are in

        // ---- dQ (64 queries x head-dim cols 64wg..64wg+63) = dS K, k = the 128 keys -----------------
        float acc_dq[32];
        wgmma_fence();
#pragma unroll
        for (int kc = 0; kc < BN / 16; ++kc) {
            wgmma_m64n64k16_ss<T, 1, 1>(acc_dq, smem_desc(ds_base + kc * 16 * 128, BN * 128, 1024),
                                        smem_desc(k_cols + kc * 16 * 128, BN * 128, 1024), kc > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();  // dQ, and dV / dK of this step

        int *sem = nullptr;
        if (params.deterministic) {  // add in key-block order: wait for blocks 0..n_block-1
            sem = params.dq_semaphore + (int64_t(b) * params.h + h) * cdiv(params.seqlen_q, BM) + m;
            if (tid == 0) {
                while (*reinterpret_cast<volatile int *>(sem) != n_block) { }
                __threadfence();
            }
            __syncthreads();
        }
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            const int q = m * BM + warp * 16 + g + 8 * hr;
            if (q < seq.sq) {
                float *row = gp.dq + int64_t(q) * gp.dq_row_stride + wg * 64 + 2 * t;
#pragma unroll
                for (int j = 0; j < 8; ++j)
                    atomicAdd(reinterpret_cast<float2 *>(row + 8 * j),
                              make_float2(acc_dq[4 * j + 2 * hr], acc_dq[4 * j + 2 * hr + 1]));
            }
        }
        if (params.deterministic) {
            __threadfence();
            __syncthreads();
            if (tid == 0) atomicAdd(sem, 1);
        }
    }
    cp_async_wait<0>();

    // ---- epilogue: dK (times the softmax scale) and dV, direct 4-byte stores (v0) -----------------
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        const int r = key_row0 + g + 8 * hr;
        if (r < range.keys_left) {
            T *dk_row = gp.dk + int64_t(r) * params.dk_row_stride + 2 * t;
            T *dv_row = gp.dv + int64_t(r) * params.dv_row_stride + 2 * t;
#pragma unroll
            for (int j = 0; j < D / 8; ++j) {
                *reinterpret_cast<uint32_t *>(dk_row + 8 * j) = pack2<T>(
                    acc_dk[4 * j + 2 * hr] * params.scale_softmax, acc_dk[4 * j + 2 * hr + 1] * params.scale_softmax);
                *reinterpret_cast<uint32_t *>(dv_row + 8 * j) =
                    pack2<T>(acc_dv[4 * j + 2 * hr], acc_dv[4 * j + 2 * hr + 1]);
            }
        }
    }
#else
    __trap();  // no sm_90a code in this build: hopper/dispatch.h never launches it
#endif
}

}  // namespace sm90
}  // namespace flash

template <typename T, int D, bool Is_causal>
void run_flash_bwd_sm90(Flash_bwd_params &params, cudaStream_t stream) {
    using namespace flash::sm90;
    dim3 grid(params.b * params.h, flash::cdiv(params.seqlen_k, kBwdBN));  // y = key block (slow axis)
    const bool is_even = params.cu_seqlens_q == nullptr && params.seqlen_q % kBwdBM == 0 &&
                         params.seqlen_k % kBwdBN == 0;
    BOOL_SWITCH(is_even, Is_even, [&] {
        launch_with_smem(&flash_bwd_sm90_kernel<T, D, Is_causal, Is_even>, grid, kBwdThreads, kBwdSmemBytes<D>,
                         params, stream);
    });
}
