// Hopper forward: the FA2 forward of flash_fwd_kernel.h with both products on wgmma and
// the softmax of one key tile overlapping the PV product of the previous one. Head dims 64 and 128 on
// sm_90 where the warp-specialised TMA forward (flash_fwd_sm90_ws.h) cannot run or is switched off
// (hopper/dispatch.h ws_kernels).
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
#include "fwd_consumer.h"
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

    const GridTile tile = grid_tile();
    const int m_block = tile.num_blocks - 1 - tile.block;  // heaviest (causal) first
    const int b = tile.bh / params.h, h = tile.bh % params.h;
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

    FwdRowState<T, D> st;  // O, row max / sum (fwd_consumer.h)
    st.init();
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
    auto issue_s = [&](int it) { issue_qk<T, D>(acc_s, q_base, smem_u32(sK + (it & 1) * kFwdTileBytes)); };
    auto issue_pv = [&](int it) { flash::sm90::issue_pv<T, D>(st.acc_o, p, smem_u32(sV + (it & 1) * kFwdTileBytes)); };
    auto softmax = [&](int it) {
        st.template softmax<Is_causal, Is_even>(acc_s, key_block(it), m_block * BM + row0, seq.sk, causal_off,
                                                scale_log2, g, t);
    };

    // The loop is peeled so that every path through the steady state has the same wgmma groups in
    // flight (ptxas serialises wgmmas when it cannot tell).
    sync_and_load(0);
    wgmma_fence();
    issue_s(0);
    wgmma_wait<0>();
    softmax(0);
    st.rescale_o_and_pack_p(acc_s, p);
    for (int it = 1; it < n_tiles; ++it) {
        sync_and_load(it);
        wgmma_fence();
        issue_s(it);
        issue_pv(it - 1);
        wgmma_wait<1>();  // S_it has landed; PV_{it-1} may still run while the softmax does
        softmax(it);
        wgmma_wait<0>();
        st.rescale_o_and_pack_p(acc_s, p);
    }
    sync_and_load(n_tiles);
    wgmma_fence();
    issue_pv(n_tiles - 1);
    wgmma_wait<0>();

    st.store(o_ptr, params.o_row_stride, lse_ptr, params.scale_softmax, row0, rows_left, g, t);
#else
    __trap();
#endif
}

}  // namespace sm90
}  // namespace flash

template <typename T, int D, bool Is_causal>
void run_flash_fwd_sm90(Flash_fwd_params &params, cudaStream_t stream) {
    const dim3 grid = flash::tile_grid(params, flash::cdiv(params.seqlen_q, flash::sm90::kFwdBM), /*default_group=*/2);
    const bool is_even = params.cu_seqlens_q == nullptr && params.seqlen_q % flash::sm90::kFwdBM == 0 &&
                         params.seqlen_k % flash::sm90::kFwdBN == 0;
    BOOL_SWITCH(is_even, Is_even, [&] {
        launch_with_smem(&flash::sm90::flash_fwd_sm90_kernel<T, D, Is_causal, Is_even>, grid, flash::sm90::kFwdThreads,
                         flash::sm90::kFwdSmemBytes<D>, params, stream);
    });
}
