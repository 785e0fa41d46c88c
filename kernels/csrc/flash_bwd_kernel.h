// FlashAttention-2 backward main kernel.
//
// Grid: x = batch*heads (query heads), y = key block (the SLOW axis: blocks of low key index, which
// under a causal mask have the most work and, in deterministic mode, must add to dQ first, are
// dispatched first). Block: kNWarps warps, each owning kMTiles 16-key slabs of the key block.
//
// For key block j (K_j, V_j in shared memory for the whole loop; dK_j, dV_j in fp32 registers),
// for each query block i (causal: from the first that can see key block j):
//   S^T  = K_j Q_i^T                 P^T = exp2(S^T*scale_log2 - LSE_i*log2e)   (recomputed)
//   dP^T = V_j dO_i^T                dS^T = P^T o (dP^T - D_i)
//   dV_j += P^T dO_i                 dK_j += dS^T Q_i         (A operands straight from registers)
//   dQ_i += dS_i K_j  (dS^T through shared memory; fp32 atomics into dq_accum)
// Working with S^T (keys as rows) instead of S lets P^T and dS^T feed the dV/dK products from
// registers; only dQ needs the transpose, read back with ldmatrix.trans.
// dK is multiplied by the softmax scale at the end; dQ in the post-pass.
//
// Ragged edges: out-of-range Q/dO/K/V rows and LSE/D entries are zero-filled. A zero query row
// contributes nothing (its dO and D are zero too); keys past the sequence's end are masked like
// future keys (P^T = 0: BwdRange::need_mask says why exp(S - LSE) cannot be left to the zeros).
#pragma once
#include "flash_bwd_common.h"
#include "kernel_traits.h"

namespace flash {

template <typename Kt, bool Is_causal, bool Is_even>
__global__ void __launch_bounds__(Kt::kNThreads, Kt::kMinBlocks)
flash_bwd_kernel(const Flash_bwd_params params) {
    using T = typename Kt::T;
    constexpr int BM = Kt::kBlockM, BN = Kt::kBlockN, D = Kt::kHeadDim;
    constexpr int NT = Kt::kNThreads, MT = Kt::kMTiles, S = Kt::kSmemStride;
    constexpr int SDS = Kt::kSmemDSStride;
    constexpr int SN = BM / 8;  // n8 tiles of S^T (columns = queries) per 16-key slab
    constexpr int ON = D / 8;   // n8 tiles of dK / dV per slab
    constexpr float kLog2e = 1.4426950408889634f;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    T *sK = reinterpret_cast<T *>(smem_raw);          // (BN, S)
    T *sV = sK + Kt::kSmemKVElems;                    // (BN, S)
    T *sQ = sV + Kt::kSmemKVElems;                    // 2 x (BM, S)
    T *sdO = sQ + 2 * Kt::kSmemQElems;                // 2 x (BM, S)
    T *sdS = sdO + 2 * Kt::kSmemQElems;               // (BN, SDS): dS^T, keys x queries
    float *sLSE = reinterpret_cast<float *>(sdS + Kt::kSmemDSElems);  // 2 x BM
    float *sDsum = sLSE + 2 * BM;                                       // 2 x BM

    const GridTile tile = grid_tile();
    const int n_block = tile.block;
    const int b = tile.bh / params.h, h = tile.bh % params.h;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;

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
    const int warp_row0 = warp * MT * 16;  // first key (in the block) owned by this warp

    for (int m = range.m_min, it = 0; m < range.m_max; ++m, ++it) {
        const int buf = it & 1;
        if (m + 1 < range.m_max) load_q_block(m + 1, buf ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const T *sQb = sQ + buf * Kt::kSmemQElems;
        const T *sdOb = sdO + buf * Kt::kSmemQElems;
        const float *sLSEb = sLSE + buf * BM;
        const float *sDb = sDsum + buf * BM;

        // ---- S^T = K Q^T and dP^T = V dO^T : (16*MT x BM) per warp -------------------------------
        float acc_s[MT][SN][4], acc_dp[MT][SN][4];
        st_dpt_product<T, MT, SN, D, S, Kt::kKsUnroll>(acc_s, acc_dp, sK, sV, sQb, sdOb, warp_row0, 0, lane);

        // ---- P^T (recomputed from LSE) and dS^T = P^T o (dP^T - D) -------------------------------
        const bool need_mask = range.need_mask<Is_causal, Is_even>(m, n_block, BM, BN);
#pragma unroll
        for (int j = 0; j < SN; ++j) {
#pragma unroll
            for (int e1 = 0; e1 < 2; ++e1) {
                const int qc = j * 8 + 2 * t + e1;  // query column in the block
                const float lse_l2 = sLSEb[qc] * kLog2e;
                const float dsum = sDb[qc];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
                    for (int hr = 0; hr < 2; ++hr) {
                        const int e = 2 * hr + e1;
                        float p = exp2f(acc_s[mt][j][e] * scale_log2 - lse_l2);
                        if (need_mask) {
                            const int key = n_block * BN + warp_row0 + mt * 16 + g + hr * 8;
                            if (range.masked<Is_causal, Is_even>(key, m * BM + qc)) p = 0.f;
                        }
                        acc_s[mt][j][e] = p;
                        acc_dp[mt][j][e] = p * (acc_dp[mt][j][e] - dsum);
                    }
                }
            }
        }

        // ---- dV += P^T dO and dK += dS^T Q (k = queries; B via ldmatrix.trans) -------------------
#pragma unroll
        for (int kc = 0; kc < BM / 16; ++kc) {
            uint32_t ap[MT][4], ads[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                ap[mt][0] = pack2<T>(acc_s[mt][2 * kc][0], acc_s[mt][2 * kc][1]);
                ap[mt][1] = pack2<T>(acc_s[mt][2 * kc][2], acc_s[mt][2 * kc][3]);
                ap[mt][2] = pack2<T>(acc_s[mt][2 * kc + 1][0], acc_s[mt][2 * kc + 1][1]);
                ap[mt][3] = pack2<T>(acc_s[mt][2 * kc + 1][2], acc_s[mt][2 * kc + 1][3]);
                ads[mt][0] = pack2<T>(acc_dp[mt][2 * kc][0], acc_dp[mt][2 * kc][1]);
                ads[mt][1] = pack2<T>(acc_dp[mt][2 * kc][2], acc_dp[mt][2 * kc][3]);
                ads[mt][2] = pack2<T>(acc_dp[mt][2 * kc + 1][0], acc_dp[mt][2 * kc + 1][1]);
                ads[mt][3] = pack2<T>(acc_dp[mt][2 * kc + 1][2], acc_dp[mt][2 * kc + 1][3]);
                // dS^T (16-bit) to shared memory for the dQ product; each warp writes its own rows.
#pragma unroll
                for (int hr = 0; hr < 2; ++hr) {
                    const int r = warp_row0 + mt * 16 + g + hr * 8;
                    *reinterpret_cast<uint32_t *>(sdS + r * SDS + kc * 16 + 2 * t) = ads[mt][hr];
                    *reinterpret_cast<uint32_t *>(sdS + r * SDS + kc * 16 + 8 + 2 * t) = ads[mt][2 + hr];
                }
            }
            dv_dk_step<T, MT, ON, S>(acc_dv, acc_dk, ap, ads, sdOb, sQb, kc, 0, lane);
        }
        __syncthreads();  // dS^T complete in shared memory

        // ---- dQ_i += dS K (atomics into dq_accum; ordered in deterministic mode) ----------------
        dq_accumulate<Kt>(params, sdS, SDS, sK, gp.dq, gp.dq_row_stride, seq.sq, b, h, m,
                          range.template dq_order<Is_even>(m, n_block, BM, BN), warp,
                          lane, tid);
        // No trailing barrier needed: the next writes to sdS / this buffer come after the next
        // iteration's first __syncthreads, which every thread reaches only after finishing here.
    }

    // ---- epilogue: dK (times the softmax scale) and dV via shared memory (sK, sV reused) ---------
    store_dk_dv<Kt, MT, ON>(params, acc_dk, acc_dv, sK, sV, gp.dk, gp.dv, warp_row0, 0, keys_left, lane, tid);
}

}  // namespace flash
