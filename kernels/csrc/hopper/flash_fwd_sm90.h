// Hopper forward, v0 (issue 8): the FA2 forward of flash_fwd_kernel.h with both products on wgmma.
// NOT in the default build and not yet run on a GPU: compiled in only with
//   FLASHGPT_NVCC_EXTRA=-DFLASHGPT_SM90_FWD python -m kernels.build
// and then used for head dim 128 on sm_90 devices (flash_fwd_launch_template.h). Next step after it
// passes tests/kernels: warp specialisation (producer warp + TMA), softmax/GEMM overlap.
//
// Block: 128 query rows, 2 warpgroups (256 threads); warpgroup wg owns rows 64wg..64wg+63, warp w of
// it rows 16w..16w+15 of those (the wgmma accumulator layout, wgmma.h). Keys in steps of BN = 128.
// Shared memory (128B-swizzled, wgmma.h): Q 128 x 128, K and V double-buffered 128 x 128: 160 KB.
//   S (64 x 128 per warpgroup) = Q K^T     SS wgmma, both K-major, 8 k16 steps over d
//   O (64 x 128 per warpgroup) += P V      RS wgmma, P from the S registers, V MN-major (tnspB = 1)
// Masking, online softmax, the epilogue and the LSE convention are those of the FA2 forward.
#pragma once
#include <cmath>
#include "../flash.h"
#include "../flash_fwd_kernel.h"  // SeqInfo
#include "../launch.h"
#include "../static_switch.h"
#include "wgmma.h"

namespace flash {
namespace sm90 {

constexpr int kFwdBM = 128, kFwdBN = 128, kFwdD = 128, kFwdThreads = 256;
constexpr int kFwdTileBytes = 128 * 128 * 2;           // one swizzled 128 x 128 tile
constexpr int kFwdSmemBytes = 5 * kFwdTileBytes;       // Q + 2 K + 2 V = 160 KB

// cp.async a (128 x 128) tile into swizzled shared memory; rows >= rows_left are zero-filled.
template <bool Is_even, typename T>
__device__ __forceinline__ void load_tile_swizzled(uint8_t *smem, const T *gmem, int64_t row_stride,
                                                   int rows_left, int tid) {
    // 128 rows x 16 chunks = 2048 chunks, 8 per thread; thread tid keeps chunk column tid % 16.
    const int c = (tid % 16) * 8;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int r = tid / 16 + i * 16;
        const bool pred = Is_even || r < rows_left;
        const T *src = pred ? gmem + r * row_stride + c : gmem;
        cp_async_16(smem_u32(smem + swizzled_offset<128>(r, c)), src, pred);
    }
}

template <typename T, bool Is_causal, bool Is_even>
__global__ void __launch_bounds__(kFwdThreads, 1) flash_fwd_sm90_kernel(const Flash_fwd_params params) {
#ifdef FLASHGPT_WGMMA_ENABLED
    constexpr int BM = kFwdBM, BN = kFwdBN, D = kFwdD;
    extern __shared__ __align__(1024) uint8_t smem[];
    uint8_t *sQ = smem;
    uint8_t *sK = smem + kFwdTileBytes;       // 2 buffers
    uint8_t *sV = smem + 3 * kFwdTileBytes;   // 2 buffers

    const int m_block = gridDim.y - 1 - blockIdx.y;
    const int b = blockIdx.x / params.h, h = blockIdx.x % params.h;
    const int tid = threadIdx.x, wg = tid / 128, warp = (tid % 128) / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;

    const SeqInfo seq(params, b);
    if (m_block * BM >= seq.sq) return;
    const FwdBlock<T> fb = FwdBlock<T>::template make<Is_causal>(params, seq, b, h, m_block, BM, BN);
    const int rows_left = fb.rows_left, causal_off = fb.causal_off, n_block_max = fb.n_block_max;
    const T *q_ptr = fb.q, *k_ptr = fb.k, *v_ptr = fb.v;
    T *o_ptr = fb.o;
    float *lse_ptr = fb.lse;
    if (n_block_max <= 0) {
        fb.write_empty(params, BM, D, tid, kFwdThreads);
        return;
    }

    int n_block = n_block_max - 1;
    load_tile_swizzled<Is_even>(sQ, q_ptr, params.q_row_stride, rows_left, tid);
    load_tile_swizzled<Is_even>(sK, k_ptr + int64_t(n_block) * BN * params.k_row_stride, params.k_row_stride,
                                seq.sk - n_block * BN, tid);
    load_tile_swizzled<Is_even>(sV, v_ptr + int64_t(n_block) * BN * params.v_row_stride, params.v_row_stride,
                                seq.sk - n_block * BN, tid);
    cp_async_commit();

    float acc_o[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc_o[i] = 0.f;
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};  // rows g and g+8 of the warp
    const float scale_log2 = params.scale_softmax_log2;
    const int row0 = wg * 64 + warp * 16;  // first query row (in the block) of this warp

    for (int it = 0; n_block >= 0; --n_block, ++it) {
        const int buf = it & 1;
        if (n_block > 0) {
            const int nb = n_block - 1;
            load_tile_swizzled<Is_even>(sK + (buf ^ 1) * kFwdTileBytes, k_ptr + int64_t(nb) * BN * params.k_row_stride,
                                        params.k_row_stride, seq.sk - nb * BN, tid);
            load_tile_swizzled<Is_even>(sV + (buf ^ 1) * kFwdTileBytes, v_ptr + int64_t(nb) * BN * params.v_row_stride,
                                        params.v_row_stride, seq.sk - nb * BN, tid);
        }
        cp_async_commit();
        cp_async_wait<1>();
        fence_async_smem();  // cp.async writes -> visible to wgmma
        __syncthreads();
        const uint32_t q_base = smem_u32(sQ) + wg * 64 * 128;  // this warpgroup's 64 rows
        const uint32_t k_base = smem_u32(sK + buf * kFwdTileBytes);
        const uint32_t v_base = smem_u32(sV + buf * kFwdTileBytes);

        // ---- S = Q K^T (64 x 128 per warpgroup) ------------------------------------------------
        float acc_s[64];
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
            const uint32_t off = (ks / 4) * 128 * 128 + (ks % 4) * 32;  // atom column, 32 B per k16
            wgmma_m64n128k16_ss<T, 0>(acc_s, smem_desc(q_base + off, 16, 1024), smem_desc(k_base + off, 16, 1024),
                                      ks > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();

        // ---- mask: ragged last tile and, if causal, future keys -----------------------------------
        const bool need_mask = (!Is_even && (n_block + 1) * BN > seq.sk) ||
                               (Is_causal && (n_block + 1) * BN - 1 > m_block * BM + causal_off);
        if (need_mask) {
#pragma unroll
            for (int j = 0; j < 16; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = n_block * BN + j * 8 + 2 * t + (e & 1);
                    const int qrow = m_block * BM + row0 + g + (e >= 2 ? 8 : 0);
                    if (key >= seq.sk || (Is_causal && key > qrow + causal_off)) acc_s[4 * j + e] = -INFINITY;
                }
        }

        // ---- online softmax ---------------------------------------------------------------------
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            float mx = row_max[hr];
#pragma unroll
            for (int j = 0; j < 16; ++j) mx = fmaxf(mx, fmaxf(acc_s[4 * j + 2 * hr], acc_s[4 * j + 2 * hr + 1]));
            mx = quad_max(mx);
            const float mx_scaled = (mx == -INFINITY) ? 0.f : mx * scale_log2;
            const float corr = exp2f(row_max[hr] * scale_log2 - mx_scaled);
            row_max[hr] = mx;
            float sum = 0.f;
#pragma unroll
            for (int j = 0; j < 16; ++j)
#pragma unroll
                for (int e = 2 * hr; e < 2 * hr + 2; ++e) {
                    const float p = exp2f(acc_s[4 * j + e] * scale_log2 - mx_scaled);
                    acc_s[4 * j + e] = p;
                    sum += p;
                }
            row_sum[hr] = row_sum[hr] * corr + sum;
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                acc_o[4 * j + 2 * hr] *= corr;
                acc_o[4 * j + 2 * hr + 1] *= corr;
            }
        }

        // ---- O += P V: P as register A fragments (built before the fence), V MN-major -----------
        uint32_t p[8][4];
#pragma unroll
        for (int kc = 0; kc < 8; ++kc) {
            p[kc][0] = pack2<T>(acc_s[8 * kc + 0], acc_s[8 * kc + 1]);
            p[kc][1] = pack2<T>(acc_s[8 * kc + 2], acc_s[8 * kc + 3]);
            p[kc][2] = pack2<T>(acc_s[8 * kc + 4], acc_s[8 * kc + 5]);
            p[kc][3] = pack2<T>(acc_s[8 * kc + 6], acc_s[8 * kc + 7]);
        }
        wgmma_fence();
#pragma unroll
        for (int kc = 0; kc < BN / 16; ++kc) {
            wgmma_m64n128k16_rs<T, 1>(acc_o, p[kc], smem_desc(v_base + kc * 16 * 128, 128 * 128, 1024), true);
        }
        wgmma_commit();
        wgmma_wait<0>();
        __syncthreads();  // everyone is done with buffer `buf` before it is refilled
    }

    // ---- epilogue: O /= l, LSE; direct 4-byte stores (v0) --------------------------------------
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        const float l = quad_sum(row_sum[hr]);
        const bool empty = (l == 0.f) || (l != l);
        const float inv = empty ? 0.f : 1.f / l;
        const int r = row0 + g + hr * 8;
        if (r < rows_left) {
            if (t == 0) lse_ptr[r] = empty ? INFINITY : row_max[hr] * params.scale_softmax + logf(l);
            T *orow = o_ptr + int64_t(r) * params.o_row_stride;
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                *reinterpret_cast<uint32_t *>(orow + j * 8 + 2 * t) =
                    pack2<T>(acc_o[4 * j + 2 * hr] * inv, acc_o[4 * j + 2 * hr + 1] * inv);
            }
        }
    }
#else
    __trap();
#endif
}

}  // namespace sm90
}  // namespace flash

template <typename T, bool Is_causal>
void run_flash_fwd_sm90(Flash_fwd_params &params, cudaStream_t stream) {
    dim3 grid(params.b * params.h, flash::cdiv(params.seqlen_q, flash::sm90::kFwdBM));
    const bool is_even = params.cu_seqlens_q == nullptr && params.seqlen_q % flash::sm90::kFwdBM == 0 &&
                         params.seqlen_k % flash::sm90::kFwdBN == 0;
    BOOL_SWITCH(is_even, Is_even, [&] {
        launch_with_smem(&flash::sm90::flash_fwd_sm90_kernel<T, Is_causal, Is_even>, grid, flash::sm90::kFwdThreads,
                         flash::sm90::kFwdSmemBytes, params, stream);
    });
}
