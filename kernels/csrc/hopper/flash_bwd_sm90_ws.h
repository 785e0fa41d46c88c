// Hopper backward, warp-specialised: wgmma products, with the memory traffic moved off the consumer
// warpgroups -- TMA loads of K, V, Q, dO, and dQ added to the
// fp32 accumulator by bulk reduce-adds from shared memory instead of per-thread atomics.
//
// Head dims 64 and 128 (template D). Block: one key block of 128 keys of one (batch, head), BM
// queries per step (64 at head dim 128, 128 at head dim 64: BwsSmem); 3 warpgroups (384 threads).
//   Warpgroup 0, the producer (setmaxnreg 24): warp 0 lane 0 issues the TMA loads (K and V once;
//   Q and dO of each query block into a 2-slot ring); warp 1 copies each block's BM LSE (times
//   log2 e) and D entries into the ring (zero past the sequence); warp 2 adds each block's dQ from
//   shared memory to the tiled fp32 accumulator (dq_tiles.h: a block is one 32 KB tile) with two
//   16 KB cp.reduce.async.bulk instructions (in key-block order if deterministic).
//   Warpgroups 1 and 2, the consumers (setmaxnreg 240), own keys 0..63 and 64..127 and run the
//   per-query-block steps of bwd_consumer.h; they meet once per block at a named barrier (both
//   halves of dS^T are needed by each one's part of dQ: head-dim columns 64cw.. at 128, queries
//   64cw.. at 64), never at a block-wide one.
// Synchronisation (mbarriers, tma.h; parities as in flash_fwd_sm90_ws.h):
//   kv_full: K and V landed (1 arrival + bytes).  q_full[s]: Q, dO (1 arrival + bytes) and LSE, D
//   (32 arrivals, warp 1) of slot s.  q_empty[s]: 256 consumer arrivals once slot s is read.
//   dq_full[u]: 256 consumer arrivals once a block's dQ is in staging buffer u; dq_empty[u]: 1 arrival
//   from warp 2 once the bulk unit has read it. Block it is staged in buffer it % 2 and warp 2 keeps
//   two blocks' reduce-adds queued (it frees block it-1's buffer after issuing block it's).
//   dS^T is double-buffered: the named barrier of block it is passed only after both warpgroups
//   finished dQ of block it-1, so writing buffer (it+1) % 2 = (it-1) % 2 after it is safe.
// Ragged edges: TMA zero-fills rows past a tensor's end but, packed (varlen), reads the next
// sequence's rows; P^T is therefore masked to 0 for keys >= sk and queries >= sq, which zeroes their
// dS^T too (dQ/dK/dV rows past the sequence are never written).
// From 1024 queries (head dim 128 without a causal mask: 512; hopper/dispatch.h pingpong_backward) the
// consumers take turns (pingpong) and each block's dQ product runs one step late, so they never meet
// at a barrier -- see the Pingpong loop; dS^T then rotates through three buffers (ds_full /
// ds_empty mbarriers) and dQ is staged in one buffer.
// Shared memory (BwsSmem), head dim 128: K, V 32 K each; Q, dO 2 x 16 K each; dS^T 2 x 16 K; dQ 2 x
// 32 K (tile copies); LSE, D 2 x 256 each; barriers: 225 KB (pingpong: dS^T 3 x 16 K, dQ 1 x 32 K:
// 209 KB). Head dim 64: K, V 16 K each; Q, dO 2 x 16 K each; dS^T 2 x 32 K; dQ 2 x 32 K;
// LSE, D 2 x 512 each: 226 KB (pingpong: dS^T 3 x 32 K, dQ 1 x 32 K: 226 KB).
#pragma once
#include <type_traits>
#include "../flash.h"
#include "../flash_bwd_common.h"  // BwdBlockPtrs, BwdRange
#include "../grid_dependency.h"
#include "../static_switch.h"
#include "../utils.h"
#include "bwd_consumer.h"
#include "dispatch.h"  // pingpong_backward
#include "dq_tiles.h"
#include "tma.h"
#include "wgmma.h"

namespace flash {
namespace sm90 {


struct BwdTmaMaps {
    CUtensorMap q, k, v, dO;  // make_tile_map(): boxes of 64 columns x 64 (q, dO) / 128 (k, v) rows
    CUtensorMap dk, dv;       // boxes of 64 columns x 64 rows (one consumer warpgroup's keys)
    bool dkv_ok;              // dk's and dv's maps were made (else the epilogue stores directly)
};

constexpr int kBwsThreads = 384, kBwsBN = 128;

// Shared-memory layout at head dim D (64 or 128), byte offsets; every tile 1024-aligned (128B swizzle).
// DQS: dQ staging buffers, NDS: dS^T buffers. The pingpong loop (dQ one step behind) takes 1 and 3.
template <int D, int DQS_ = 2, int NDS_ = 2>
struct BwsSmem {
    static constexpr int DQS = DQS_, NDS = NDS_;
    static constexpr int BM = D == 64 ? 128 : 64;                // queries per block (step)
    static constexpr int KV = kBwsBN * D * 2, Q = BM * D * 2;    // one K / V tile, one Q / dO slot
    static constexpr int DS = kBwsBN * BM * 2;                   // one dS^T buffer
    // dQ staging: copies of a tile of the tiled accumulator (dq_tiles.h; 32 KB, swizzled); with two
    // the consumers stage block it + 1 while the bulk unit may still read block it.
    static constexpr int DQBuf = dq_tiles::kFloats * 4;
    static constexpr int V = KV, Qs = 2 * KV, dO = Qs + 2 * Q, dS = dO + 2 * Q, dQ = dS + NDS * DS;
    static constexpr int stats = dQ + DQS * DQBuf;  // LSE[2][BM], D[2][BM]
    // mbarriers: kv_full, q_full[2], q_empty[2], dq_full[DQS], dq_empty[DQS], ds_full[NDS], ds_empty[NDS]
    static constexpr int bars = stats + 4 * BM * 4, bytes = bars + (5 + 2 * DQS + 2 * NDS) * 8;
    static_assert(BM * D == dq_tiles::kFloats, "a query block is one tile");
    static_assert(bytes <= 227 * 1024, "over the H100's 227 KB of shared memory per block");
};

// Is_local: a local window (flash.h). The key block visits only the query blocks whose band reaches its
// keys (BwdRange::apply_window narrows [m_min, m_max), which every loop of the producer's three warps and
// of the consumers walks, so their slots and parities stay in step; an empty range runs no step and
// stores zero dK / dV), and P^T is masked where a query block crosses a band edge. A separate
// instantiation (ragged only), so the kernels of calls without a window keep their code.
// Causal_skip (causal head dim 128 in turns, below 4096 keys): the turns loop skips a warpgroup's empty
// half of the diagonal block (half_empty below); a separate instantiation for the same reason.
template <typename T, int D, bool Is_causal, bool Is_even, bool Pingpong, bool Is_local = false, bool Causal_skip = false>
__global__ void __launch_bounds__(kBwsThreads, 1)
    flash_bwd_sm90_ws_kernel(const __grid_constant__ Flash_bwd_params params, const __grid_constant__ BwdTmaMaps maps) {
#ifdef FLASHGPT_WGMMA_ENABLED
    using L = BwsSmem<D, Pingpong ? 1 : 2, Pingpong ? 3 : 2>;
    constexpr int BM = L::BM, BN = kBwsBN;
    extern __shared__ __align__(1024) uint8_t smem[];
    const uint32_t s0 = smem_u32(smem);
    const uint32_t sK = s0, sV = s0 + L::V, sQ = s0 + L::Qs, sdO = s0 + L::dO, sdQ = s0 + L::dQ;
    float *sLSE = reinterpret_cast<float *>(smem + L::stats), *sDsum = sLSE + 2 * BM;
    const uint32_t kv_full = s0 + L::bars, q_full = kv_full + 8, q_empty = q_full + 16, dq_full = q_empty + 16,
                   dq_empty = dq_full + 8 * L::DQS, ds_full = dq_empty + 8 * L::DQS,
                   ds_empty = ds_full + 8 * L::NDS;  // [s] at + 8 s
    constexpr int DQS = L::DQS;

    const GridTile tile = grid_tile();
    const int n_block = tile.block;
    const int b = tile.bh / params.h, h = tile.bh % params.h;
    // wg and warp through a shuffle: provably warp-uniform, so the compiler keeps what derives from
    // them (shared-memory addresses, wgmma descriptors) in uniform registers.
    const int tid = threadIdx.x, wg = __shfl_sync(0xffffffffu, tid / 128, 0),
              warp = __shfl_sync(0xffffffffu, (tid % 128) / 32, 0), lane = tid % 32;

    // Launched as a dependent of the pre-pass (grid_dependency.h): K, V, Q, dO and the LSE are older than
    // it; D and the zeroed dq_accum wait for it, in warps 1 and 2.
    const SeqInfo seq(params, b);
    if (n_block * BN >= seq.sk) {
        wait_prior_grid();  // every block waits once: this kernel ends after the pre-pass
        return;
    }
    static_assert(!Is_local || !Is_even, "a local window runs the ragged kernel");
    const BwdRange range = [&] {
        BwdRange r = BwdRange::make<Is_causal>(seq, n_block, BM, BN);
        if constexpr (Is_local) r.apply_window<Is_causal>(params, n_block, BM, BN);
        return r;
    }();
    const BwdBlockPtrs<T> gp(params, seq, b, h, n_block, BN, D);

    if (tid == 0) {
        mbar_init(kv_full, 1);
        for (int s = 0; s < 2; ++s) {
            mbar_init(q_full + 8 * s, 1 + 32);
            mbar_init(q_empty + 8 * s, 256);
        }
        for (int s = 0; s < DQS; ++s) {
            mbar_init(dq_full + 8 * s, 256);
            mbar_init(dq_empty + 8 * s, 1);
        }
        for (int s = 0; s < L::NDS; ++s) {  // used by the pingpong loop only
            mbar_init(ds_full + 8 * s, 256);
            mbar_init(ds_empty + 8 * s, 256);
        }
        mbar_init_fence();
    }
    __syncthreads();

    if (wg == 0) {  // ---- producer warpgroup ------------------------------------------------------
        regs_release<24>();
        if (warp == 0 && lane == 0) {  // TMA loads
            tma_prefetch_map(&maps.k);
            tma_prefetch_map(&maps.v);
            tma_prefetch_map(&maps.q);
            tma_prefetch_map(&maps.dO);
            const bool varlen = params.cu_seqlens_q != nullptr;
            const int batch = varlen ? 0 : b, h_k = h / params.h_h_k_ratio;
            const int k_row = (varlen ? seq.k_start : 0) + n_block * BN, q_row0 = varlen ? seq.q_start : 0;
            mbar_arrive_expect_tx(kv_full, 2 * L::KV);
            for (int c = 0; c < D / 64; ++c) {  // 64-column atom columns
                tma_load_4d(sK + c * BN * 128, &maps.k, kv_full, c * 64, k_row, h_k, batch);
                tma_load_4d(sV + c * BN * 128, &maps.v, kv_full, c * 64, k_row, h_k, batch);
            }
            for (int m = range.m_min, it = 0; m < range.m_max; ++m, ++it) {
                const int s = it & 1;
                mbar_wait(q_empty + 8 * s, ((it >> 1) & 1) ^ 1);
                mbar_arrive_expect_tx(q_full + 8 * s, 2 * L::Q);
                for (int c = 0; c < D / 64; ++c) {  // 64-column atom columns
                    tma_load_4d(sQ + s * L::Q + c * BM * 128, &maps.q, q_full + 8 * s, c * 64, q_row0 + m * BM, h, batch);
                    tma_load_4d(sdO + s * L::Q + c * BM * 128, &maps.dO, q_full + 8 * s, c * 64, q_row0 + m * BM, h,
                                batch);
                }
            }
        } else if (warp == 1) {  // LSE and D of each query block (zero past the sequence)
            wait_prior_grid();  // D
            for (int m = range.m_min, it = 0; m < range.m_max; ++m, ++it) {
                const int s = it & 1;
                mbar_wait(q_empty + 8 * s, ((it >> 1) & 1) ^ 1);
#pragma unroll
                for (int i = lane; i < BM; i += 32) {
                    const bool ok = m * BM + i < seq.sq;
                    sLSE[s * BM + i] = ok ? gp.lse[m * BM + i] * 1.4426950408889634f : 0.f;  // times log2 e
                    sDsum[s * BM + i] = ok ? gp.dsum[m * BM + i] : 0.f;
                }
                mbar_arrive_if(q_full + 8 * s, true);
            }
        } else if (warp == 2) {  // dQ: shared memory -> dq_accum, bulk fp32 reduce-add
            float *dq_tile = params.dq_accum_ptr + dq_tiles::tile_offset(params, params.d, b, h, seq.q_start);
            wait_prior_grid();  // dq_accum zeroed
            for (int m = range.m_min, it = 0; m < range.m_max; ++m, ++it) {
                const int st = it % DQS;  // staging buffer
                mbar_wait(dq_full + 8 * st, (it / DQS) & 1);
                int *sem = nullptr;
                if (params.deterministic) {  // add in key-block order: after blocks 0..n_block-1
                    sem = params.dq_semaphore + (int64_t(b) * params.h + h) * cdiv(params.seqlen_q, BM) + m;
                    // Under a local window only the key blocks whose range holds m add to its tile,
                    // and they are consecutive: n_first .. n_last, n_first = the block of the first
                    // key of m's first row (the ranges' bounds grow with the key block). So wait for
                    // the n_block - n_first blocks before this one among them (BwdRange::dq_order),
                    // each of which visits m and counts once: never for a block that skips m.
                    int order = n_block;
                    if constexpr (Is_local) order = range.dq_order<false>(m, n_block, BM, BN);
                    if (lane == 0) {
                        while (*reinterpret_cast<volatile int *>(sem) != order) { }
                        __threadfence();
                        fence_async_all();
                    }
                    __syncwarp();
                }
                if (lane < 2)  // the block's tile: two 16 KB sub-tiles
                    bulk_reduce_add_f32(dq_tile + int64_t(m) * dq_tiles::kFloats + lane * dq_tiles::kSubFloats,
                                        sdQ + st * L::DQBuf + lane * (L::DQBuf / 2), L::DQBuf / 2);
                bulk_commit();
                if (params.deterministic) {
                    bulk_wait_all();
                    fence_async_all();
                    __threadfence();
                    __syncwarp();
                    if (lane == 0) atomicAdd(sem, 1);
                    mbar_arrive_if(dq_empty + 8 * st, lane == 0);
                } else if constexpr (DQS == 1) {  // free the buffer once the bulk unit has read it
                    bulk_wait_read<0>();
                    __syncwarp();
                    mbar_arrive_if(dq_empty, lane == 0);
                } else {  // keep this block's reduce queued behind the previous one; free that one's buffer
                    bulk_wait_read<1>();
                    __syncwarp();
                    mbar_arrive_if(dq_empty + 8 * ((it + DQS - 1) % DQS), lane == 0 && it > 0);
                }
            }
            bulk_wait_all();
        }
        return;
    }

    // ---- consumers ---------------------------------------------------------------------------------
    regs_claim<240>();
    const int cw = wg - 1;
    const int g = lane / 4, t = lane % 4;
    const int key_row0 = cw * 64 + warp * 16;  // first key (in the block) of this warp's rows
    const uint32_t k_rows = sK + cw * 64 * 128, v_rows = sV + cw * 64 * 128;  // this warpgroup's keys
    const uint32_t k_cols = sK + cw * BN * 128;  // atom column cw: head-dim columns 64cw.. (dQ's B)
    const float scale_log2 = params.scale_softmax_log2;
    float acc_dk[D / 2], acc_dv[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) acc_dk[i] = acc_dv[i] = 0.f;

    // Whether a key of this block lies after the causal diagonal of block m's first query (a prefix of
    // the walk over m).
    auto crosses_diagonal = [&](int m) { return n_block * BN + BN - 1 > m * BM + range.causal_off; };
    // Whether block m's P^T needs a mask: the block crosses the diagonal or a window's edge, or runs past
    // the queries' or the keys' end.
    auto block_needs_mask = [&](int m) {
        if constexpr (Is_local) return range.need_mask<Is_causal, false>(m, n_block, BM, BN) || (m + 1) * BM > seq.sq;
        else return (Is_causal && crosses_diagonal(m)) || (!Is_even && ((m + 1) * BM > seq.sq || (n_block + 1) * BN > seq.sk));
    };

    // Block m (the it-th): wait for slot it % 2 (Q, dO, LSE, D), issue S^T and dP^T on it, and once S^T
    // has landed turn it into P^T in place (masked only where the block crosses the diagonal or an end);
    // then() at the end of either exp branch (exp_pt). may_mask false: the block needs no mask (known
    // where the caller's walk has constant-folded it; the masked path then vanishes); must_mask: it needs
    // one, and the unmasked path vanishes.
    auto st_dpt_exp = [&](int m, int it, auto &acc_s, auto &acc_dp, bool may_mask, bool must_mask, auto then) {
        const int s = it & 1;
        mbar_wait(q_full + 8 * s, (it >> 1) & 1);
        wgmma_fence();
        issue_st_dpt<T, D>(acc_s, acc_dp, k_rows, v_rows, sQ + s * L::Q, sdO + s * L::Q);
        // This thread's LSE pairs: at head dim 128 without a mask branch (dense non-causal, and the inner
        // blocks of the walks in parts below) read while S^T is on the tensor cores (dense +1.4 to +2.6%;
        // with the mask branch, and at head dim 64, 1-4% lost), else as the exps use them.
        const bool lse_early = D == 128 && (!may_mask || (!Is_causal && !Is_local));
        float2 lse[BM / 8];
        if (lse_early) load_lse_pairs<BM / 2>(sLSE + s * BM, t, lse);
        auto lse_pair = [&](int j) {
            if (lse_early) return lse[j];
            return *reinterpret_cast<const float2 *>(sLSE + s * BM + 8 * j + 2 * t);
        };
        wgmma_wait<1>();  // S^T has landed
        const bool need_mask = must_mask || (may_mask && block_needs_mask(m));
        if constexpr (Is_local) {  // the window's mask (causal folded in), keys past sk, queries past sq
            exp_pt(acc_s, lse_pair, scale_log2, need_mask, n_block * BN + key_row0, m * BM, g, t, [&](int key, int q) {
                return q >= seq.sq || range.masked<Is_causal, false>(key, q);
            }, then);
        } else {
            exp_pt(acc_s, lse_pair, scale_log2, need_mask, n_block * BN + key_row0, m * BM, g, t, [&](int key, int q) {
                return key >= seq.sk || q >= seq.sq || (Is_causal && key > q + range.causal_off);
            }, then);
        }
    };
    // Block it's dQ slice (this warpgroup's 64 x 64 fp32 accumulator) into sub-tile cw of staging
    // buffer it % DQS, once the bulk unit has read what that buffer held; then hand it over.
    auto stage_dq = [&](const float (&acc_dq)[32], int it) {
        const int st = it % DQS;
        mbar_wait(dq_empty + 8 * st, ((it / DQS) & 1) ^ 1);
        store_acc_subtile(smem + L::dQ + st * L::DQBuf + cw * (L::DQBuf / 2), acc_dq, tid % 128);
        fence_async_smem();  // -> visible to the bulk unit
        mbar_arrive_if(dq_full + 8 * st, true);
    };

    // Pingpong loop (both head dims). A warpgroup's turn to issue S^T and dP^T: barrier 8 + cw, passed
    // to it by the other after that one's dV; warpgroup 1 opens, and warpgroup 2's last step passes no
    // turn, so arrivals match syncs.
    auto take_turn = [&](int it) {
        if (cw == 1 || it > 0) named_barrier_sync(8 + cw, 256);
    };
    auto pass_turn = [&](int m) {
        if (cw == 0 || m + 1 < range.m_max) named_barrier_arrive(8 + (1 - cw), 256);
    };
    // Block it's dQ product (one group), once both warpgroups' halves of its dS^T are in buffer it % 3.
    // Head dim 128: head-dim columns 64cw.. (B = K's atom column cw); 64: queries 64cw.. (A = dS^T's
    // atom column cw), all of K.
    auto dq_product = [&](float (&acc_dq)[32], int it) {
        const int bd = it % 3;
        mbar_wait(ds_full + 8 * bd, (it / 3) & 1);
        wgmma_fence();
        if constexpr (D == 64) issue_dq<T>(acc_dq, s0 + L::dS + bd * L::DS + cw * BN * 128, sK);
        else issue_dq<T>(acc_dq, s0 + L::dS + bd * L::DS, k_cols);
    };
    // The end of step it (slot s), its dV / dK issued: the previous block's dQ product, then the wait
    // for all of them, the slot and the previous dS^T buffer released, and that dQ staged.
    auto finish_step = [&](int it, int s) {
        if (it > 0) {
            float acc_dq[32];
            dq_product(acc_dq, it - 1);
            wgmma_wait<0>();  // dV, dK of this block, dQ of the previous one
            mbar_arrive_if(q_empty + 8 * s, true);                  // slot s is read
            mbar_arrive_if(ds_empty + 8 * ((it - 1) % 3), true);  // dS^T of block it - 1 is read
            stage_dq(acc_dq, it - 1);  // sub-tile cw
        } else {
            wgmma_wait<0>();
            mbar_arrive_if(q_empty + 8 * s, true);
        }
    };
    auto last_dq = [&](int steps) {  // after the loop: the last block's dQ
        if (steps > 0) {
            float acc_dq[32];
            dq_product(acc_dq, steps - 1);
            wgmma_wait<0>();
            stage_dq(acc_dq, steps - 1);
        }
    };

    // Block m's S^T, dP^T and P^T (st_dpt_exp), then P^T's and dS^T's A fragments, with dV issued, for
    // dK to follow. turn(): where the pingpong loop passes the turn. Head dim 64, inside the exps'
    // branch (exp_pt's then): the turn, the wait for dP^T, and P^T and dS^T packed together from fp32;
    // dV and dK are then issued back to back (a wgmma issued inside the branch serialises, C7512).
    // ptxas moves dP^T's wait into the exps and fills their MUFU gaps with dS^T's arithmetic and packs
    // (against dV issued first and dS^T made from P^T's 16-bit fragments: backward +3.6% to +7.3% dense
    // non-causal in turns, +2% causal, +2.6% windows; after the branch it gains only without the mask
    // branch). Head dim 128 issues dV first and makes dS^T while it runs (packing together there, after
    // the branch or inside it, loses up to 5%). Both loops make the same choice, so the two schedules
    // give the same bits.
    auto block_fragments_and_dv = [&](int m, int it, auto &acc_s, auto &acc_dp, const float *sDs, uint32_t do_base,
                                      auto &a_p, auto &a_ds, bool may_mask, bool must_mask, auto turn) {
        if constexpr (D == 64) {
            st_dpt_exp(m, it, acc_s, acc_dp, may_mask, must_mask, [&] {
                turn();
                wgmma_wait<0>();  // dP^T has landed
                to_a_fragments<T>(acc_s, a_p);
                make_dst<T>(acc_s, acc_dp, sDs, t, a_ds);
            });
            wgmma_fence();
            issue_rs_over_queries<T, D>(acc_dv, a_p, do_base);
        } else {
            st_dpt_exp(m, it, acc_s, acc_dp, may_mask, must_mask, [] {});
            to_a_fragments<T>(acc_s, a_p);
            wgmma_fence();
            issue_rs_over_queries<T, D>(acc_dv, a_p, do_base);
            turn();
            wgmma_wait<1>();  // dP^T has landed (dV may still run)
            make_dst<T>(acc_s, acc_dp, sDs, t, a_ds);
            wgmma_fence();
        }
    };

    // Head dim 128 (64-query blocks against 128 keys): whether none of this warpgroup's 64 keys is
    // visible to a query of block m: all past the sequence's end, all after the window (causal: the
    // diagonal) of the block's last query, or (local) all before the window of its first query. Its
    // P^T and dS^T are then zero: the warpgroup skips S^T, dP^T, the exps, dV and dK and only stores
    // a zero half of dS^T for the dQ product, on a path of its own beside the loop's body (a branch
    // inside the body costs the unskipped blocks 1-3%). The masks slide with the query, so such
    // blocks are a prefix for the second warpgroup (the diagonal: one block per key block) and, under
    // a window, a suffix for the first (the window's far edge; at a window of 1k, 2 of every 17
    // half-blocks). The skipping warpgroup reads nothing of the block's slot and does not wait for it
    // (a later wait on the slot cannot see a stale phase: the other warpgroup waited for it before
    // passing the turn or the barrier; after a suffix there is no later wait), but it still releases
    // the slot (q_empty) and takes and passes its turn. Measured against no skip (H200, one process):
    // windows of 256 / 1k / 4k +8-9% / +5% / +1-2%, causal lock-step (below 1024 queries) +2.4%;
    // causal in turns only below 4096 keys (Causal_skip; hopper/dispatch.h causal_skip_backward has
    // the figures).
    constexpr bool kSkipPingpong = D == 128 && (Is_local || Causal_skip);
    constexpr bool kSkipLockstep = D == 128 && (Is_local || Is_causal);
    auto half_empty = [&](int m) {
        const int first_key = n_block * BN + 64 * cw, q0 = m * BM, q1 = q0 + BM - 1;
        if constexpr (Is_local)
            return first_key >= seq.sk || first_key > range.win.last_key(q1, range.causal_off) ||
                   first_key + 63 < range.win.first_key(q0, range.causal_off);
        else return first_key >= seq.sk || (Is_causal && first_key > q1 + range.causal_off);
    };
    auto zero_fragments = [](uint32_t (&a)[BM / 16][4]) {
#pragma unroll
        for (int j = 0; j < BM / 16; ++j)
#pragma unroll
            for (int r = 0; r < 4; ++r) a[j][r] = 0u;
    };

    mbar_wait(kv_full, 0);
    if constexpr (Pingpong) {
        // Both head dims: the two warpgroups take turns (pingpong) and each block's dQ product runs
        // one step late. A warpgroup issues its S^T and dP^T only once the other has issued its dV of
        // the step before (warpgroup 2: of the same step; head dim 64: finished its exps), so one's exp
        // and dS^T run under the other's products instead of both waiting on the tensor pipe together
        // (the lock-step loop below keeps the pipe 57% busy in a trace). For that they must not meet
        // once per step, as the loop below does before its dQ product (both halves of dS^T): block it's
        // dQ runs in step it + 1, after that step's dS^T is stored, and waits only for the other
        // warpgroup's half of block it's dS^T, stored about half a step earlier. dS^T rotates through
        // three buffers (block it in it % 3; full / empty mbarriers), and one dQ staging buffer makes
        // the room. Measured against lock-step on an H100: +3-4% f+b at 4k-16k (backward alone +7% at
        // causal 8k; trace: step 4540 -> 4290 clocks, warpgroups 1500 apart). In both loops dV and dK
        // take P^T and dS^T from registers (A fragments), both made from P^T's fp32 registers
        // (block_fragments_and_dv).
        const int steps = range.m_max - range.m_min;
        // Causal head dim 128, even sizes: the walk in two parts, the blocks that cross the diagonal (a
        // prefix) through the body with its mask branch, the rest through a copy without it, which also
        // reads the LSE early (st_dpt_exp), as the dense kernel does.
        // Head dim 128, ragged sizes (windows, and lengths that are not block multiples): the blocks an edge
        // crosses (the diagonal or a window's near edge; its far edge, the queries' end) are a prefix and a
        // suffix of the walk, both through the masked exps alone (a key block past the keys' end is all
        // prefix), and the blocks between through the copy without a mask that reads the LSE early:
        // windows of 1k / 4k +1.5 to +1.8% / +3.2 to +3.6%, ragged lengths +0.8% to +3.1% against one part
        // deciding per block (H200). Elsewhere (dense even sizes; head dim 64, where three parts lost 0.1-1.2%
        // under windows) one part, the body deciding per block. The parts' loop is unrolled, so each part's
        // may_mask and must_mask are constants.
        constexpr int kParts = D != 128 ? 1 : !Is_even ? 3 : Is_causal ? 2 : 1;
        int m_diag = range.m_max, m_far = range.m_max;  // the first block of part 1, of part 2
        if constexpr (kParts == 2) {
            m_diag = range.m_min;
            while (m_diag < range.m_max && crosses_diagonal(m_diag)) ++m_diag;
        }
        if constexpr (kParts == 3) {
            m_diag = range.m_min;
            while (m_diag < range.m_max && block_needs_mask(m_diag)) ++m_diag;
            m_far = m_diag;
            while (m_far < range.m_max && !block_needs_mask(m_far)) ++m_far;
        }
#pragma unroll
        for (int part = 0; part < kParts; ++part) {
            const bool may_mask = kParts == 3 ? part != 1 : part == 0, must_mask = kParts == 3 && part != 1;
            const int m_begin = part == 0 ? range.m_min : part == 1 ? m_diag : m_far;
            const int m_end = part + 1 == kParts ? range.m_max : part == 0 ? m_diag : m_far;
            // (the diagonal's part restates its bound, so its body knows every block is masked)
            for (int m = m_begin, it = m_begin - range.m_min;
                 m < m_end && (part + 1 == kParts || kParts == 3 || crosses_diagonal(m)); ++m, ++it) {
                const int s = it & 1, bd = it % 3;
                const uint32_t q_base = sQ + s * L::Q, do_base = sdO + s * L::Q;
                const float *sDs = sDsum + s * BM;

                if constexpr (kSkipPingpong) {
                    if (may_mask && half_empty(m)) {
                        take_turn(it);
                        pass_turn(m);
                        uint32_t zero[BM / 16][4];
                        zero_fragments(zero);
                        mbar_wait(ds_empty + 8 * bd, ((it / 3) & 1) ^ 1);
                        store_dst<false>(smem + L::dS + bd * L::DS, zero, key_row0, lane);
                        fence_async_smem();
                        mbar_arrive_if(ds_full + 8 * bd, true);
                        finish_step(it, s);
                        continue;
                    }
                }
                float acc_s[BM / 2], acc_dp[BM / 2];
                take_turn(it);
                uint32_t a_p[BM / 16][4], a_ds[BM / 16][4];
                block_fragments_and_dv(m, it, acc_s, acc_dp, sDs, do_base, a_p, a_ds, may_mask, must_mask,
                                       [&] { pass_turn(m); });
                issue_rs_over_queries<T, D>(acc_dk, a_ds, q_base);
                mbar_wait(ds_empty + 8 * bd, ((it / 3) & 1) ^ 1);  // both warpgroups' dQ of block it - 3 read it
                store_dst<D == 64>(smem + L::dS + bd * L::DS, a_ds, key_row0, lane);
                fence_async_smem();  // dS^T stores -> visible to wgmma
                mbar_arrive_if(ds_full + 8 * bd, true);
                finish_step(it, s);
            }
        }
        last_dq(steps);
    } else
    // Lock-step (the header has its synchronisation). Head dim 64 takes 128 queries per block: per
    // block a warpgroup's products are half as long as at head dim 128 while its elementwise work and
    // fixed costs are not, so the block is twice as wide (S^T, dP^T m64n128), and each warpgroup
    // computes dQ for its 64 of the block's 128 queries (all 128 keys). After the barrier dQ is issued
    // before dK, so its staging runs under dK (against dK issued before the barrier and dQ's staging
    // after all three: +0.6% to +1.6% at 512-768 queries, level at 256; H200, one process).
    for (int m = range.m_min, it = 0; m < range.m_max; ++m, ++it) {
        const int s = it & 1;  // Q / dO slot and dS^T buffer
        const uint32_t q_base = sQ + s * L::Q, do_base = sdO + s * L::Q;
        const float *sDs = sDsum + s * BM;
        uint8_t *sdS = smem + L::dS + s * L::DS;

        if constexpr (kSkipLockstep) {
            if (half_empty(m)) {  // a zero half of dS^T; dQ still takes the other warpgroup's half
                uint32_t zero[BM / 16][4];
                zero_fragments(zero);
                store_dst<false>(sdS, zero, key_row0, lane);
                fence_async_smem();
                named_barrier_sync(1, 256);
                float acc_dq[32];
                wgmma_fence();
                issue_dq<T>(acc_dq, smem_u32(sdS), k_cols);
                wgmma_wait<0>();
                stage_dq(acc_dq, it);
                mbar_arrive_if(q_empty + 8 * s, true);
                continue;
            }
        }
        float acc_s[BM / 2], acc_dp[BM / 2];
        uint32_t a_p[BM / 16][4], a_ds[BM / 16][4];
        block_fragments_and_dv(m, it, acc_s, acc_dp, sDs, do_base, a_p, a_ds, true, false, [] {});
        store_dst<D == 64>(sdS, a_ds, key_row0, lane);
        fence_async_smem();          // dS^T stores -> visible to wgmma
        named_barrier_sync(1, 256);  // both consumer warpgroups' halves of dS^T are in

        float acc_dq[32];
        wgmma_fence();
        if constexpr (D == 64) issue_dq<T>(acc_dq, smem_u32(sdS) + cw * BN * 128, sK);  // queries 64cw..
        else issue_dq<T>(acc_dq, smem_u32(sdS), k_cols);                         // head-dim columns 64cw..
        issue_rs_over_queries<T, D>(acc_dk, a_ds, q_base);
        wgmma_wait<1>();       // dV and dQ of this block (dK may still run)
        stage_dq(acc_dq, it);  // sub-tile cw, under dK
        wgmma_wait<0>();       // dK: slot s is read
        mbar_arrive_if(q_empty + 8 * s, true);
    }
    // Epilogue through shared memory (as the forward's): this warpgroup's dK and dV go into its own
    // rows of the K and V tiles, then TMA stores of 64 x 64 boxes. V's rows were read only by this
    // warpgroup's dP^T, but K's by both warpgroups' dQ products: both pass barrier 1 once more first.
    // A warpgroup with keys past a packed sequence's end (the next sequence's rows) stores directly.
    named_barrier_sync(1, 256);
    if (maps.dkv_ok && range.keys_left >= 64 * cw + 64) {
        stage_dk_dv<T, D>(smem + cw * 64 * 128, smem + L::V + cw * 64 * 128, BN * 128, params.scale_softmax, acc_dk,
                          acc_dv, warp, g, t);
        fence_async_smem();                // generic-proxy writes -> visible to the TMA
        named_barrier_sync(6 + cw, 128);  // the warpgroup's 64 rows of both are in
        if (warp == 0 && lane == 0) {
            const bool varlen = params.cu_seqlens_q != nullptr;
            const int k_row = (varlen ? seq.k_start : 0) + n_block * BN + cw * 64, batch = varlen ? 0 : b;
#pragma unroll
            for (int c = 0; c < D / 64; ++c) {
                tma_store_4d(&maps.dk, sK + c * BN * 128 + cw * 64 * 128, c * 64, k_row, h, batch);
                tma_store_4d(&maps.dv, sV + c * BN * 128 + cw * 64 * 128, c * 64, k_row, h, batch);
            }
            bulk_commit();
            bulk_wait_read<0>();  // shared memory stays valid until the TMA has read it
        }
    } else {
        store_dk_dv<T, D>(params, gp.dk, gp.dv, acc_dk, acc_dv, key_row0, range.keys_left, g, t);
    }
#else
    __trap();
#endif
}

}  // namespace sm90
}  // namespace flash

// Launches the warp-specialised backward (head dim D = 64 or 128); false (nothing launched) when a
// tensor breaks a TMA rule (tma.h make_tile_map) or the dQ accumulator has no room for the tiled
// layout (dq_tiles.h) -- the caller then runs another kernel.
template <typename T, int D, bool Is_causal>
bool run_flash_bwd_sm90_ws(Flash_bwd_params &params, cudaStream_t stream) {
    using namespace flash::sm90;
    static_assert(D == 64 || D == 128, "the TMA backward is built for head dims 64 and 128");
    const bool varlen = params.cu_seqlens_q != nullptr, bf16 = std::is_same_v<T, __nv_bfloat16>;
    const int64_t batch = varlen ? 1 : params.b;
    const int64_t q_rows = varlen ? params.total_q : params.seqlen_q, k_rows = varlen ? params.total_k : params.seqlen_k;
    if (params.dq_accum_floats < flash::dq_tiles::floats_needed(params)) return false;
    BwdTmaMaps maps;
    if (!make_tile_map(&maps.q, params.q_ptr, bf16, D, q_rows, params.h, batch, params.q_row_stride,
                       params.q_head_stride, params.q_batch_stride, BwsSmem<D>::BM) ||
        !make_tile_map(&maps.dO, params.do_ptr, bf16, D, q_rows, params.h, batch, params.do_row_stride,
                       params.do_head_stride, params.do_batch_stride, BwsSmem<D>::BM) ||
        !make_tile_map(&maps.k, params.k_ptr, bf16, D, k_rows, params.h_k, batch, params.k_row_stride,
                       params.k_head_stride, params.k_batch_stride, kBwsBN) ||
        !make_tile_map(&maps.v, params.v_ptr, bf16, D, k_rows, params.h_k, batch, params.v_row_stride,
                       params.v_head_stride, params.v_batch_stride, kBwsBN))
        return false;
    // dK / dV per query head (the binding sums them over a key/value head's group when h > h_k).
    maps.dkv_ok = make_tile_map(&maps.dk, params.dk_ptr, bf16, D, k_rows, params.h, batch, params.dk_row_stride,
                                params.dk_head_stride, params.dk_batch_stride, 64) &&
                  make_tile_map(&maps.dv, params.dv_ptr, bf16, D, k_rows, params.h, batch, params.dv_row_stride,
                                params.dv_head_stride, params.dv_batch_stride, 64);
    const dim3 grid = flash::tile_grid(params, flash::cdiv(params.seqlen_k, kBwsBN), head_group(params, kBwd));
    const bool is_even = !varlen && params.seqlen_q % BwsSmem<D>::BM == 0 && params.seqlen_k % kBwsBN == 0;
    const bool pingpong = pingpong_backward(D, params.is_causal, params.seqlen_q, params.seqlen_k);
    auto launch = [&](auto kernel, int smem) {
        FLASH_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        flash::launch_dependent(kernel, grid, kBwsThreads, smem, stream, params, maps);  // after the pre-pass
    };
    if (has_window(params)) {  // the Is_local instantiations: ragged, either schedule
        if (pingpong) launch(&flash_bwd_sm90_ws_kernel<T, D, Is_causal, false, true, true>, BwsSmem<D, 1, 3>::bytes);
        else launch(&flash_bwd_sm90_ws_kernel<T, D, Is_causal, false, false, true>, BwsSmem<D>::bytes);
        params.dq_accum_tiled = true;  // for the post-pass
        return true;
    }
    BOOL_SWITCH(is_even, Is_even, [&] {
        if (pingpong) {
            if constexpr (Is_causal && D == 128) {
                if (causal_skip_backward(params.seqlen_k))
                    return launch(&flash_bwd_sm90_ws_kernel<T, D, true, Is_even, true, false, true>, BwsSmem<D, 1, 3>::bytes);
            }
            return launch(&flash_bwd_sm90_ws_kernel<T, D, Is_causal, Is_even, true>, BwsSmem<D, 1, 3>::bytes);
        }
        launch(&flash_bwd_sm90_ws_kernel<T, D, Is_causal, Is_even, false>, BwsSmem<D>::bytes);
    });
    params.dq_accum_tiled = true;  // for the post-pass
    return true;
}
