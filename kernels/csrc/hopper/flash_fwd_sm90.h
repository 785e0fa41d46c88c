// Hopper forward (issue 8): the FA2 forward of flash_fwd_kernel.h with both products on wgmma and
// the softmax of one key tile overlapping the PV product of the previous one. The default for head
// dims 64 and 128 on sm_90 (hopper/dispatch.h). Next: warp specialisation (producer warp + TMA).
//
// Block: 128 query rows, 2 warpgroups (256 threads); warpgroup wg owns rows 64wg..64wg+63, warp w of
// it rows 16w..16w+15 of those (the wgmma accumulator layout, wgmma.h). Keys in steps of BN = 128.
// Shared memory (128B-swizzled, wgmma.h): Q 128 x D, K and V double-buffered 128 x D: 160 KB at D =
// 128, 80 KB at D = 64.
//   S (64 x 128 per warpgroup) = Q K^T     SS wgmma, both K-major, D/16 k16 steps
//   O (64 x D per warpgroup) += P V        RS wgmma, P from the S registers, V MN-major (tnspB = 1)
// Masking, online softmax, the epilogue and the LSE convention are those of the FA2 forward.
#pragma once
#include <cmath>
#include "../flash.h"
#include "../flash_fwd_kernel.h"  // SeqInfo
#include "../launch.h"
#include "../static_switch.h"
#include "tile_io.h"
#include "wgmma.h"

namespace flash {
namespace sm90 {

constexpr int kFwdBM = 128, kFwdBN = 128, kFwdThreads = 256;
template <int D> constexpr int kFwdTileBytes = 128 * D * 2;               // one swizzled 128 x D tile
template <int D> constexpr int kFwdSmemBytes = 5 * kFwdTileBytes<D>;      // Q + 2 K + 2 V

template <typename T, int D, bool Is_causal, bool Is_even>
__global__ void __launch_bounds__(kFwdThreads, 1) flash_fwd_sm90_kernel(const Flash_fwd_params params) {
#ifdef FLASHGPT_WGMMA_ENABLED
    constexpr int BM = kFwdBM, BN = kFwdBN;
    constexpr int kFwdTileBytes = flash::sm90::kFwdTileBytes<D>;
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

    // Key tiles are visited from the last (the causal diagonal) down: tile it = key block
    // n_block_max - 1 - it, in K buffer it % 2 and V buffer it % 2. Iteration it issues S_it = Q K_it^T
    // and O += P_{it-1} V_{it-1} together, and runs the softmax of S_it while the PV product is still
    // on the tensor cores (FA3's intra-warpgroup overlap); O is rescaled once PV has landed.
    // Loads: the group issued at the top of iteration it holds K_{it+1} and V_it, waited for at the
    // top of iteration it+1; the buffers they overwrite were last read in iteration it-1.
    const int n_tiles = n_block_max;
    auto key_block = [&](int it) { return n_block_max - 1 - it; };
    load_tile_swizzled<BM, D, kFwdThreads, Is_even>(sQ, q_ptr, params.q_row_stride, rows_left, tid);
    load_tile_swizzled<BN, D, kFwdThreads, Is_even>(sK, k_ptr + int64_t(key_block(0)) * BN * params.k_row_stride,
                                                 params.k_row_stride, seq.sk - key_block(0) * BN, tid);
    cp_async_commit();

    float acc_o[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) acc_o[i] = 0.f;
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};  // rows g and g+8 of the warp
    float corr[2] = {1.f, 1.f};
    const float scale_log2 = params.scale_softmax_log2;
    const int row0 = wg * 64 + warp * 16;  // first query row (in the block) of this warp
    const uint32_t q_base = smem_u32(sQ) + wg * 64 * 128;  // this warpgroup's 64 rows
    float acc_s[64];
    uint32_t p[8][4];  // P_{it-1} as A fragments (k = keys, 8 steps of 16)

    // Top of iteration it: tile it's K and tile it-1's V have landed (everyone's copies, visible to
    // wgmma), and every thread is done with iteration it-1; then the loads for the next iteration.
    auto sync_and_load = [&](int it) {
        cp_async_wait<0>();
        fence_async_smem();
        __syncthreads();
        if (it < n_tiles) {
            if (it + 1 < n_tiles) {
                const int nb = key_block(it + 1);
                load_tile_swizzled<BN, D, kFwdThreads, Is_even>(sK + ((it + 1) & 1) * kFwdTileBytes,
                                                             k_ptr + int64_t(nb) * BN * params.k_row_stride,
                                                             params.k_row_stride, seq.sk - nb * BN, tid);
            }
            const int nb = key_block(it);
            load_tile_swizzled<BN, D, kFwdThreads, Is_even>(sV + (it & 1) * kFwdTileBytes,
                                                         v_ptr + int64_t(nb) * BN * params.v_row_stride,
                                                         params.v_row_stride, seq.sk - nb * BN, tid);
            cp_async_commit();
        }
    };
    auto issue_s = [&](int it) {  // S_it = Q K_it^T (64 x 128 per warpgroup), SS, both K-major
        const uint32_t k_base = smem_u32(sK + (it & 1) * kFwdTileBytes);
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
            const uint32_t off = (ks / 4) * 128 * 128 + (ks % 4) * 32;  // atom column, 32 B per k16
            wgmma_m64n128k16_ss<T, 0>(acc_s, smem_desc(q_base + off, 16, 1024), smem_desc(k_base + off, 16, 1024),
                                      ks > 0);
        }
        wgmma_commit();
    };
    auto issue_pv = [&](int it) {  // O += P_it V_it: P from registers, V MN-major (tnspB = 1)
        const uint32_t v_base = smem_u32(sV + (it & 1) * kFwdTileBytes);
#pragma unroll
        for (int kc = 0; kc < BN / 16; ++kc)
            wgmma_rs_n<T, D, 1>(acc_o, p[kc], smem_desc(v_base + kc * 16 * 128, 128 * 128, 1024), true);
        wgmma_commit();
    };
    auto softmax = [&](int it) {  // mask S_it, update the row statistics, P_it into acc_s
        const int n_block = key_block(it);
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
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            float mx = row_max[hr];
#pragma unroll
            for (int j = 0; j < 16; ++j) mx = fmaxf(mx, fmaxf(acc_s[4 * j + 2 * hr], acc_s[4 * j + 2 * hr + 1]));
            mx = quad_max(mx);
            const float mx_scaled = (mx == -INFINITY) ? 0.f : mx * scale_log2;
            corr[hr] = exp2f(row_max[hr] * scale_log2 - mx_scaled);
            row_max[hr] = mx;
            float sum = 0.f;
#pragma unroll
            for (int j = 0; j < 16; ++j)
#pragma unroll
                for (int e = 2 * hr; e < 2 * hr + 2; ++e) {
                    const float pe = exp2f(acc_s[4 * j + e] * scale_log2 - mx_scaled);
                    acc_s[4 * j + e] = pe;
                    sum += pe;
                }
            row_sum[hr] = row_sum[hr] * corr[hr] + sum;
        }
    };
    auto rescale_o_and_pack_p = [&] {  // after PV_{it-1} has landed: O *= corr, P_it -> fragments
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            acc_o[4 * j + 0] *= corr[0];
            acc_o[4 * j + 1] *= corr[0];
            acc_o[4 * j + 2] *= corr[1];
            acc_o[4 * j + 3] *= corr[1];
        }
#pragma unroll
        for (int kc = 0; kc < 8; ++kc) {
            p[kc][0] = pack2<T>(acc_s[8 * kc + 0], acc_s[8 * kc + 1]);
            p[kc][1] = pack2<T>(acc_s[8 * kc + 2], acc_s[8 * kc + 3]);
            p[kc][2] = pack2<T>(acc_s[8 * kc + 4], acc_s[8 * kc + 5]);
            p[kc][3] = pack2<T>(acc_s[8 * kc + 6], acc_s[8 * kc + 7]);
        }
    };

    // The loop is peeled so that every path through the steady state has the same wgmma groups in
    // flight (ptxas serialises wgmmas when it cannot tell).
    sync_and_load(0);
    wgmma_fence();
    issue_s(0);
    wgmma_wait<0>();
    softmax(0);
    rescale_o_and_pack_p();
    for (int it = 1; it < n_tiles; ++it) {
        sync_and_load(it);
        wgmma_fence();
        issue_s(it);
        issue_pv(it - 1);
        wgmma_wait<1>();  // S_it has landed; PV_{it-1} may still run while the softmax does
        softmax(it);
        wgmma_wait<0>();
        rescale_o_and_pack_p();
    }
    sync_and_load(n_tiles);
    wgmma_fence();
    issue_pv(n_tiles - 1);
    wgmma_wait<0>();

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
            for (int j = 0; j < D / 8; ++j) {
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

template <typename T, int D, bool Is_causal>
void run_flash_fwd_sm90(Flash_fwd_params &params, cudaStream_t stream) {
    dim3 grid(params.b * params.h, flash::cdiv(params.seqlen_q, flash::sm90::kFwdBM));
    const bool is_even = params.cu_seqlens_q == nullptr && params.seqlen_q % flash::sm90::kFwdBM == 0 &&
                         params.seqlen_k % flash::sm90::kFwdBN == 0;
    BOOL_SWITCH(is_even, Is_even, [&] {
        launch_with_smem(&flash::sm90::flash_fwd_sm90_kernel<T, D, Is_causal, Is_even>, grid, flash::sm90::kFwdThreads,
                         flash::sm90::kFwdSmemBytes<D>, params, stream);
    });
}
