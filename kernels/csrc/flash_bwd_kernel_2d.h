// FlashAttention-2 backward main kernel, 2-D warp layout (used for large head dims).
//
// Same grid, algorithm and ragged-edge handling as flash_bwd_kernel.h (read its header first); only
// the split of each product over the warps differs (Flash_bwd_2d_kernel_traits):
//   phase 1  S^T = K Q^T, dP^T = V dO^T   warp (wk, wq): keys wk*16*MT.., queries wq*kQCols..
//   phase 2  P^T, dS^T elementwise in registers, then stored (16-bit) to sP / sdS in shared memory
//   phase 3  dV += P^T dO, dK += dS^T Q    warp (wk, wd): the same keys, head-dim columns wd*kDCols..;
//            A operands from sP / sdS (all BM queries), B operands dO / Q via ldmatrix.trans
//   phase 4  dQ += dS K                     (flash_bwd_common.h)
// Each warp reads a quarter of Q/dO per product instead of all of it, at the price of writing
// P^T/dS^T to shared memory once: fewer shared-memory bytes per HMMA (kernels/NOTES.md).
#pragma once
#include "flash_bwd_common.h"
#include "kernel_traits.h"

namespace flash {

template <typename Kt, bool Is_causal, bool Is_even>
__global__ void __launch_bounds__(Kt::kNThreads, 1)
flash_bwd_kernel_2d(const Flash_bwd_params params) {
    using T = typename Kt::T;
    constexpr int BM = Kt::kBlockM, BN = Kt::kBlockN, D = Kt::kHeadDim;
    constexpr int NT = Kt::kNThreads, MT = Kt::kMTiles, S = Kt::kSmemStride;
    constexpr int SP = Kt::kSmemPStride;
    constexpr int SN = Kt::kQCols / 8;  // n8 tiles of S^T (queries) per warp
    constexpr int ON = Kt::kDCols / 8;  // n8 tiles of dK / dV (head dim) per warp
    constexpr float kLog2e = 1.4426950408889634f;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    T *sK = reinterpret_cast<T *>(smem_raw);          // (BN, S)
    T *sV = sK + Kt::kSmemKVElems;                    // (BN, S)
    T *sQ = sV + Kt::kSmemKVElems;                    // 2 x (BM, S)
    T *sdO = sQ + 2 * Kt::kSmemQElems;                // 2 x (BM, S)
    T *sP = sdO + 2 * Kt::kSmemQElems;                // (BN, SP): P^T, keys x queries
    T *sdS = sP + Kt::kSmemPElems;                    // (BN, SP): dS^T
    float *sLSE = reinterpret_cast<float *>(sdS + Kt::kSmemPElems);  // 2 x BM
    float *sDsum = sLSE + 2 * BM;                                      // 2 x BM

    const GridTile tile = grid_tile();
    const int n_block = tile.block;
    const int b = tile.bh / params.h, h = tile.bh % params.h;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;
    const int wk = warp % Kt::kWarpsK, wq = warp / Kt::kWarpsK;  // wq doubles as wd in phase 3
    const int key0 = wk * MT * 16;       // first key (in the block) of this warp
    const int qcol0 = wq * Kt::kQCols;   // first query (in the step) of this warp, phases 1-2
    const int dcol0 = wq * Kt::kDCols;   // first head-dim column of this warp, phase 3

    const SeqInfo seq(params, b);
    if (n_block * BN >= seq.sk) return;
    BwdRange range = BwdRange::make<Is_causal>(seq, n_block, BM, BN);
    if constexpr (!Is_even) range.apply_window<Is_causal>(params, n_block, BM, BN);
    const int keys_left = range.keys_left;
    const BwdBlockPtrs<T> gp(params, seq, b, h, n_block, BN, D);
    auto load_q_block = [&](int m, int buf) {
        flash::load_q_block<BM, D, S, NT, Is_even>(params, gp, seq.sq, m, sQ + buf * Kt::kSmemQElems,
                                                   sdO + buf * Kt::kSmemQElems, sLSE + buf * BM,
                                                   sDsum + buf * BM, tid);
    };

    // ---- prologue: K_j, V_j and the first query block -----------------------------------------
    load_kv_and_first_q<Kt, Is_even>(params, gp, seq, range, sK, sV, sQ, sdO, sLSE, sDsum, tid);

    float acc_dk[MT][ON][4], acc_dv[MT][ON][4];
    zero_fill(acc_dk);
    zero_fill(acc_dv);

    const float scale_log2 = params.scale_softmax_log2;

    for (int m = range.m_min, it = 0; m < range.m_max; ++m, ++it) {
        const int buf = it & 1;
        // Block m has landed, and every warp is done with iteration it-1 (its reads of buffer
        // buf^1 and of sP / sdS): only now may the prefetch of block m+1 overwrite buf^1.
        cp_async_wait<0>();
        __syncthreads();
        if (m + 1 < range.m_max) load_q_block(m + 1, buf ^ 1);
        cp_async_commit();
        const T *sQb = sQ + buf * Kt::kSmemQElems;
        const T *sdOb = sdO + buf * Kt::kSmemQElems;
        const float *sLSEb = sLSE + buf * BM;
        const float *sDb = sDsum + buf * BM;

        // ---- phase 1: S^T = K Q^T and dP^T = V dO^T, (16*MT keys x kQCols queries) per warp ------
        float acc_s[MT][SN][4], acc_dp[MT][SN][4];
        st_dpt_product<T, MT, SN, D, S, 1>(acc_s, acc_dp, sK, sV, sQb, sdOb, key0, qcol0, lane);

        // ---- phase 2: P^T (recomputed from LSE), dS^T = P^T o (dP^T - D), both to shared memory ---
        const bool need_mask = range.need_mask<Is_causal, Is_even>(m, n_block, BM, BN);
#pragma unroll
        for (int j = 0; j < SN; ++j) {
            const int qc = qcol0 + j * 8 + 2 * t;  // query column (in the step) of elements 0 / 2
            const float2 lse = *reinterpret_cast<const float2 *>(sLSEb + qc);
            const float2 dsum = *reinterpret_cast<const float2 *>(sDb + qc);
            const float lse_l2[2] = {lse.x * kLog2e, lse.y * kLog2e};
            const float ds[2] = {dsum.x, dsum.y};
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
                for (int hr = 0; hr < 2; ++hr) {
                    const int kr = key0 + mt * 16 + g + hr * 8;  // key row (in the block)
                    float p2[2], ds2[2];
#pragma unroll
                    for (int e1 = 0; e1 < 2; ++e1) {
                        const int e = 2 * hr + e1;
                        float pv = exp2f(acc_s[mt][j][e] * scale_log2 - lse_l2[e1]);
                        if (need_mask && range.masked<Is_causal, Is_even>(n_block * BN + kr, m * BM + qc + e1)) pv = 0.f;
                        p2[e1] = pv;
                        ds2[e1] = pv * (acc_dp[mt][j][e] - ds[e1]);
                    }
                    *reinterpret_cast<uint32_t *>(sP + kr * SP + qc) = pack2<T>(p2[0], p2[1]);
                    *reinterpret_cast<uint32_t *>(sdS + kr * SP + qc) = pack2<T>(ds2[0], ds2[1]);
                }
            }
        }
        __syncthreads();  // P^T and dS^T complete in shared memory

        // ---- phase 3: dV += P^T dO and dK += dS^T Q over all BM queries (k = queries) -------------
#pragma unroll
        for (int kc = 0; kc < BM / 16; ++kc) {
            uint32_t ap[MT][4], ads[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const int r = key0 + mt * 16 + (lane % 16);
                const int c = kc * 16 + (lane / 16) * 8;
                ldmatrix_x4(ap[mt], smem_u32(sP + r * SP + c));
                ldmatrix_x4(ads[mt], smem_u32(sdS + r * SP + c));
            }
            dv_dk_step<T, MT, ON, S>(acc_dv, acc_dk, ap, ads, sdOb, sQb, kc, dcol0, lane);
        }

        // ---- phase 4: dQ_i += dS K (atomics into dq_accum; ordered in deterministic mode) --------
        dq_accumulate<Kt>(params, sdS, SP, sK, gp.dq, gp.dq_row_stride, seq.sq, b, h, m,
                          range.template dq_order<Is_even>(m, n_block, BM, BN), warp,
                          lane, tid);
        // The next iteration's first barrier orders these reads of sP / sdS / buffer buf before
        // anything overwrites them.
    }

    // ---- epilogue: dK (times the softmax scale) and dV via shared memory (sK, sV reused) ---------
    store_dk_dv<Kt, MT, ON>(params, acc_dk, acc_dv, sK, sV, gp.dk, gp.dv, key0, dcol0, keys_left, lane, tid);
}

}  // namespace flash
