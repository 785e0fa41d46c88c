// Hopper forward, warp-specialised: wgmma products, with the loads in a producer warpgroup that
// drives the TMA, so the consumer warpgroups never wait for each other at a block-wide barrier --
// each proceeds as soon as its tiles have landed.
//
// Block: 1 + NC warpgroups (NC = 2 consumers at head dim 128: 384 threads; at head dim 64 3, 512
// threads). Under a causal mask each consumer warpgroup skips the key tiles its rows do not see,
// and at head dim 128 runs its diagonal tile's products on 64 keys where its rows see no more; at
// head dim 64, up to 2k rows, a sequence's short block comes first (block_rows).
// Warpgroup 0, the producer, gives its registers away (setmaxnreg 24) and one of its threads
// issues every TMA load: Q once per tile, then K_it and V_it for each key tile into a ring of kStages
// buffers each. Warpgroups 1..NC, the consumers (setmaxnreg 240 / 160), own query rows 64 (w - 1) ..
// 64 w - 1 of the 64 NC-row block and run the per-tile steps of fwd_consumer.h: S_it = Q K_it^T and
// O += P_{it-1} V_{it-1} issued together, the softmax of S_it overlapping the PV product; they take
// turns to issue, round robin (pingpong).
// Synchronisation, all on mbarriers (tma.h), per ring slot s:
//   k_full[s], v_full[s]: 1 arrival (the producer's expect-tx) + the tile's bytes from the TMA;
//   k_empty[s], v_empty[s]: 4 NC arrivals, lane 0 of each consumer warp once its wgmma reading the slot
//   has completed. The ring runs on from tile to tile: the CTA's k-th K/V tile uses slot k % kStages
//   in round k / kStages; a waiter on round r waits for parity r & 1 (full) or (r & 1) ^ 1 (empty:
//   round 0 passes at once on a fresh barrier).
// Persistent: one CTA per SM walks the work list (FwdTiles: the tiles in the launch
// order of a one-CTA-per-tile grid, taken from an atomic counter, so the causal list schedule stays).
// Q is double-buffered: the producer loads the next tile's Q and first K/V while the consumers finish
// the current tile, and each consumer warpgroup stages its O rows in the current Q buffer for the
// TMA store, freeing the buffer (q_empty) once the store has read it. No CTA start-up, barrier setup
// or epilogue stands between two tiles of an SM.
// Shared memory (128B-swizzled, wgmma.h): 2 x Q 64 NC x D, kStages x (K, V) BN x D (BN = 128 keys,
// 160 in the wide tiles: wide_key_tiles), the barriers, the two tiles, decoded by the producer.
#pragma once
#include <algorithm>
#include <type_traits>
#include "../flash.h"
#include "../flash_fwd_kernel.h"  // SeqInfo, FwdBlock
#include "../static_switch.h"
#include "../utils.h"
#include "dispatch.h"
#include "fwd_consumer.h"
#include "tma.h"
#include "wgmma.h"

namespace flash {
namespace sm90 {


struct FwdTmaMaps {
    CUtensorMap q, k, v;  // make_tile_map(): {d, rows, heads, batch}, boxes of 64 columns x 128 (k, v: BN) rows
    CUtensorMap o;        // boxes of 64 columns x 64 rows (one consumer warpgroup's rows)
    bool o_ok;            // o's map was made (else the epilogue stores O directly)
};

// The work list: tile L (0 <= L < num_tiles) is (batch * head, query block) in the launch order of
// grid_order.h's grid (group, num_blocks, bh / group), x fastest. CTA i starts with tile i; with a
// counter (persistent launch, one CTA per SM) each CTA then takes tile gridDim.x + atomicAdd(counter, 1)
// until the list is done (exactly num_tiles fetches per launch: each CTA's last one fails) -- the same list schedule as a launch of num_tiles CTAs, without a CTA's
// start-up and epilogue between tiles. Without one (counter == nullptr) every CTA runs one tile.
struct FwdTiles {
    int group, num_blocks, num_tiles;
    // [0] the next tile - gridDim.x, [1] CTAs past the list; both zero at launch, and the last CTA past
    // the list sets them back to zero, so one pair serves every launch on a stream.
    // nullptr: one tile per CTA.
    int *counter;
};

__device__ __forceinline__ GridTile fwd_tile_at(const FwdTiles &tiles, int linear) {
    const int x = linear % tiles.group, y = (linear / tiles.group) % tiles.num_blocks,
              z = linear / (tiles.group * tiles.num_blocks);
    return GridTile{z * tiles.group + x, y, tiles.num_blocks};
}

// Where query block m of a sequence of sq rows starts, and its rows (.x, .y). Short_first (head
// dim 64 under a causal mask, 192-row blocks, launched where the longest sequence has at most
// kShortFirstMaxRows rows): block 0 holds the remainder r = sq - 192 (nb - 1) (1..192 rows), blocks
// 1.. are full and the last ends at sq. With blocks at multiples of 192 the remainder is the last
// block -- the heaviest under a causal mask, 4 or 8 key tiles at 512 / 1k -- where its idle
// warpgroups still take a turn per key tile and the rows that are there wait for all of them; at the
// front it is the lightest block. Per head the warpgroup steps are as many; the key tiles on the
// blocks' critical paths fall from 9 to 8 at 512, 32 to 27 at 1k. H100 harness, three calls:
// +1.3 to +2.2% at 512, +2.9 to +3.5% at 1k; 2k and 4k within the harness's spread (-2.5 to +1.8%);
// 8k / 16k -1.2 / -1.7% in the first two calls (tensor bound there: the critical path counts for
// little). So a separate instantiation, launched up to 2k rows; longer sequences use the
// multiple-of-192 layout.
constexpr int kShortFirstMaxRows = 2048;
template <int BM, bool Short_first>
__device__ __forceinline__ int2 block_rows(int m_block, int sq) {
    if constexpr (Short_first) {
        const int r = sq - BM * (cdiv(sq, BM) - 1);
        return m_block == 0 ? make_int2(0, r) : make_int2(r + (m_block - 1) * BM, BM);
    } else {
        return make_int2(m_block * BM, BM);
    }
}

// The key tiles (of BN keys) a block of query rows sees under a local window (Flash_fwd_params::
// window_left / window_right, flash.h; a causal mask folded in as the right bound 0): tiles
// [n_min, n_min + n_tiles), n_tiles = 0 when no row of the block sees a key. row_start: the block's first
// row in the sequence; rows: its rows inside the sequence (>= 1). The producer (which loads exactly these
// tiles, from the last down) and the consumers (which run exactly n_tiles steps) both call this, so their
// ring slots and parities stay in step. Key tiles outside [n_min, n_max) hold no key any row sees.
struct KeyRange {
    int n_min, n_tiles;
};
template <bool Is_causal, int BN>
__device__ __forceinline__ KeyRange local_key_range(const Flash_fwd_params &p, int row_start, int rows, int sq,
                                                    int sk) {
    Window win(p);
    if (Is_causal) win.right = min(win.right, 0);
    const int off = sk - sq;
    const int last_key = win.last_key(row_start + rows - 1, off);  // of the block's last row
    const int n_max = last_key < 0 ? 0 : min(cdiv(sk, BN), last_key / BN + 1);
    const int n_min = max(0, win.first_key(row_start, off)) / BN;  // of the block's first row
    return KeyRange{n_min, max(0, n_max - n_min)};
}

// NC consumer warpgroups, each owning 64 query rows of the block: two at head dim 128; at head dim 64
// three (run_flash_fwd_sm90_ws), where a key tile's products take half as long as at 128 for the same softmax work, so two warpgroups'
// products are needed to cover one warpgroup's softmax (FlashAttention-3's choice).
template <int NC> constexpr int kWsThreads = 128 * (1 + NC);
template <int NC> constexpr int kWsBM = 64 * NC;  // query rows per tile
constexpr int kWsBN = 128;                        // keys per K/V tile
constexpr int kWsBNWide = 160;                    // wide tiles (dispatch.h wide_key_tiles)
constexpr int ws_keys(bool wide) { return wide ? kWsBNWide : kWsBN; }
// setmaxnreg moves registers within the CTA's pool as allocated at launch (threads x the launch bound's
// per-thread count), not the SM's 64K: 128 x 24 + 256 x 240 = 384 x 168; 128 x 24 + 384 x 160 <= 512 x 128.
constexpr int kWsProducerRegs = 24;
template <int NC> constexpr int kWsConsumerRegs = NC == 3 ? 160 : 240;
constexpr int kWsQBufs = 2;                                  // Q of the next tile loads during this one
template <int D> constexpr int kWsStages = D == 64 ? 4 : 2;    // 2 x 64 KB of K/V at D = 128
template <int D, int BN = kWsBN> constexpr int kWsTileBytes = BN * D * 2;     // a K or V tile
template <int D, int NC> constexpr int kWsQTileBytes = kWsBM<NC> * D * 2;
template <int D, int NC, int BN = kWsBN>
constexpr int kWsBarrierOffset = kWsQBufs * kWsQTileBytes<D, NC> + 2 * kWsStages<D> * kWsTileBytes<D, BN>;
// barriers: q_full[2], q_empty[2], k_full[S], v_full[S], k_empty[S], v_empty[S]; then the tiles of the
// two Q buffers, decoded (4 ints each: m_block, b, h, key tiles)
template <int D, int NC, int BN = kWsBN>
constexpr int kWsSmemBytes = kWsBarrierOffset<D, NC, BN> + (2 * kWsQBufs + 4 * kWsStages<D>) * 8 + kWsQBufs * 16;

// Is_local: a local window (flash.h) -- each block loads and runs only the key tiles its band reaches
// (local_key_range), and the softmax masks the tiles across the band's edges (FwdRowState::mask_window).
// A separate instantiation, so the kernels of calls without a window keep their code.
// Wide: 160-key K/V tiles (kWsBNWide), head dim 128 without a mask or window (dispatch.h wide_key_tiles).
template <typename T, int D, int NC, bool Is_causal, bool Is_even, bool Short_first = false, bool Is_local = false,
          bool Wide = false>
__global__ void __launch_bounds__(kWsThreads<NC>, 1)
    flash_fwd_sm90_ws_kernel(const __grid_constant__ Flash_fwd_params params, const __grid_constant__ FwdTmaMaps maps,
                             const FwdTiles tiles) {
#ifdef FLASHGPT_WGMMA_ENABLED
    constexpr int BM = kWsBM<NC>, BN = ws_keys(Wide), S = kWsStages<D>;
    constexpr bool kShortFirst = Short_first;  // block layout: block_rows
    static_assert(!Short_first || (NC == 3 && Is_causal), "the short-first layout is for 192-row causal blocks");
    static_assert(!Wide || (D == 128 && !Is_causal && !Is_local), "wide key tiles without a mask or window only");
    static_assert(kWsSmemBytes<D, NC, BN> <= 227 * 1024, "shared memory per block");
    static_assert(!Is_local || (!Short_first && !Is_even),
                  "a local window runs the ragged layout with blocks at multiples of BM and the list schedule");
    constexpr int kTile = kWsTileBytes<D, BN>, kQTile = kWsQTileBytes<D, NC>;
    constexpr int kAtomCols = D / 64;  // TMA boxes per tile (64 columns each)
    extern __shared__ __align__(1024) uint8_t smem[];
    const uint32_t sQ = smem_u32(smem), sK = sQ + kWsQBufs * kQTile, sV = sK + S * kTile;
    const uint32_t bar = sQ + kWsBarrierOffset<D, NC, BN>;
    const uint32_t q_full = bar, q_empty = bar + 8 * kWsQBufs, k_full = q_empty + 8 * kWsQBufs,
                   v_full = k_full + 8 * S, k_empty = v_full + 8 * S, v_empty = k_empty + 8 * S;
    // Per Q buffer, the tile it holds, decoded by the producer: m_block (-1: no more tiles), b, h,
    // and its key tiles (-1: a block past a packed sequence's end). Decoding in the consumers would put
    // ~8 integer divisions, a dependent chain of ~1200 clocks, between two tiles while the other
    // warpgroup waits at the same boundary (measured with an SM-clock timeline per tile).
    volatile int *tile_info = reinterpret_cast<volatile int *>(smem + kWsBarrierOffset<D, NC, BN> + (2 * kWsQBufs + 4 * S) * 8);

    // wg and warp through a shuffle: provably warp-uniform, so what derives from them (shared-memory
    // addresses, wgmma descriptors) stays in uniform registers.
    const int tid = threadIdx.x, wg = __shfl_sync(0xffffffffu, tid / 128, 0),
              warp = __shfl_sync(0xffffffffu, (tid % 128) / 32, 0), lane = tid % 32;
    const bool varlen = params.cu_seqlens_q != nullptr;

    if (tid == 0) {
        for (int i = 0; i < kWsQBufs; ++i) {
            mbar_init(q_full + 8 * i, 1);
            mbar_init(q_empty + 8 * i, NC);  // one arrival per consumer warpgroup
        }
        for (int s = 0; s < S; ++s) {
            mbar_init(k_full + 8 * s, 1);
            mbar_init(v_full + 8 * s, 1);
            mbar_init(k_empty + 8 * s, 4 * NC);  // one arrival per consumer warp
            mbar_init(v_empty + 8 * s, 4 * NC);
        }
        mbar_init_fence();
    }
    __syncthreads();

    // Tile n of this CTA goes through Q buffer n % 2: the producer writes it, decoded, into
    // tile_info[n % 2] (m_block -1: no more tiles) and arrives on q_full (with Q's bytes when the tile
    // has work); each consumer warpgroup arrives on q_empty once its O rows, staged in that buffer,
    // have been read by the TMA.
    if (wg == 0) {  // ---- producer ----------------------------------------------------------------
        regs_release<kWsProducerRegs>();
        if (tid == 0) {
            tma_prefetch_map(&maps.q);
            tma_prefetch_map(&maps.k);
            tma_prefetch_map(&maps.v);
            int s = 0;                  // K/V ring slot of the next load
            uint32_t empty_parity = 1;  // and the parity its empty barriers complete next (1: a fresh barrier)
            int linear = blockIdx.x;
            for (int n = 0;; ++n) {
                const int qb = n % kWsQBufs;
                mbar_wait(q_empty + 8 * qb, ((n / kWsQBufs) & 1) ^ 1);
                if (linear >= tiles.num_tiles) {
                    tile_info[4 * qb] = -1;
                    mbar_arrive_if(q_full + 8 * qb, true);
                    // The last CTA past the list puts the counter back to zero for the next launch
                    // on this stream (no memset before each launch). This CTA's last fetch is done (its
                    // value was read above); every other CTA's too once the count of CTAs past the
                    // list reaches gridDim.x.
                    if (tiles.counter != nullptr) {
                        __threadfence();
                        if (atomicAdd(tiles.counter + 1, 1) == int(gridDim.x) - 1) {
                            atomicExch(tiles.counter, 0);
                            atomicExch(tiles.counter + 1, 0);
                        }
                    }
                    break;
                }
                const GridTile tile = fwd_tile_at(tiles, linear);
                const int m_block = tile.num_blocks - 1 - tile.block;  // heaviest (causal) first
                const int b = tile.bh / params.h, h = tile.bh % params.h;
                const SeqInfo seq(params, b);
                const int2 rows = block_rows<BM, kShortFirst>(m_block, seq.sq);
                int n_tiles, n_first = 0;  // key tiles [n_first, n_first + n_tiles), loaded from the last down
                if constexpr (Is_local) {
                    if (m_block * BM >= seq.sq) {
                        n_tiles = -1;
                    } else {
                        const KeyRange kr = local_key_range<Is_causal, BN>(params, rows.x, min(seq.sq - rows.x, BM),
                                                                           seq.sq, seq.sk);
                        n_first = kr.n_min;
                        n_tiles = kr.n_tiles;
                    }
                } else if constexpr (kShortFirst) {
                    n_tiles = m_block * BM >= seq.sq ? -1
                        : FwdBlock<T>::template make_rows<Is_causal>(params, seq, b, h, rows.x, rows.y, BN).n_block_max;
                } else {
                    n_tiles = m_block * BM >= seq.sq ? -1
                        : FwdBlock<T>::template make<Is_causal>(params, seq, b, h, m_block, BM, BN).n_block_max;
                }
                tile_info[4 * qb] = m_block;
                tile_info[4 * qb + 1] = b;
                tile_info[4 * qb + 2] = h;
                tile_info[4 * qb + 3] = n_tiles;
                if (n_tiles <= 0) {
                    mbar_arrive_if(q_full + 8 * qb, true);  // nothing to load: the consumers skip or write empty rows
                } else {
                    const int batch = varlen ? 0 : b, h_k = h / params.h_h_k_ratio;
                    const int q_row = (varlen ? seq.q_start : 0) + rows.x, k_row = varlen ? seq.k_start : 0;
                    mbar_arrive_expect_tx(q_full + 8 * qb, kQTile);
#pragma unroll
                    for (int c = 0; c < kAtomCols; ++c)
                        tma_load_4d(sQ + qb * kQTile + c * BM * 128, &maps.q, q_full + 8 * qb, c * 64, q_row, h, batch);
                    for (int row = k_row + (n_first + n_tiles - 1) * BN; row >= k_row + n_first * BN;
                         row -= BN) {  // from the causal diagonal down
                        mbar_wait(k_empty + 8 * s, empty_parity);
                        mbar_arrive_expect_tx(k_full + 8 * s, kTile);
#pragma unroll
                        for (int c = 0; c < kAtomCols; ++c)
                            tma_load_4d(sK + s * kTile + c * BN * 128, &maps.k, k_full + 8 * s, c * 64, row, h_k, batch);
                        mbar_wait(v_empty + 8 * s, empty_parity);
                        mbar_arrive_expect_tx(v_full + 8 * s, kTile);
#pragma unroll
                        for (int c = 0; c < kAtomCols; ++c)
                            tma_load_4d(sV + s * kTile + c * BN * 128, &maps.v, v_full + 8 * s, c * 64, row, h_k, batch);
                        if (++s == S) {
                            s = 0;
                            empty_parity ^= 1;
                        }
                    }
                }
                linear = tiles.counter != nullptr ? int(gridDim.x) + atomicAdd(tiles.counter, 1) : tiles.num_tiles;
            }
        }
        return;
    }

    // ---- consumers ---------------------------------------------------------------------------------
    regs_claim<kWsConsumerRegs<NC>>();
    const int cw = wg - 1;                  // consumer warpgroup: rows 64 cw .. 64 cw + 63
    const int g = lane / 4, t = lane % 4;
    const int row0 = cw * 64 + warp * 16;  // first query row (in the block) of this warp
    const bool release = lane == 0;        // one arrival per consumer warp on the empty barriers
    const bool leader = warp == 0 && lane == 0;  // issues this warpgroup's TMA stores, frees its Q buffer

    // Pingpong: the consumer warpgroups take turns, round robin, to issue their
    // products -- named barrier 2 + cw is "warpgroup cw's turn", passed on by the previous warpgroup's
    // arrival -- so one's softmax runs while the others' products keep the tensor cores busy.
    // Warpgroup 0 starts; turns carry on from tile to tile (all take the same number per tile), and
    // the last turn passed by warpgroup NC - 1 is consumed by warpgroup 0 after the last tile, so the
    // barriers end balanced.
    auto take_turn = [&] {
        named_barrier_sync(2 + cw, 256);
    };
    auto pass_turn = [&] {
        named_barrier_arrive(2 + (cw + 1) % NC, 256);
    };
    if (cw == NC - 1) named_barrier_arrive(2, 256);

    // Q buffer whose O rows this warpgroup staged for a TMA store not yet known to be read (-1: none).
    // Freed lazily -- after the next tile's first products are issued -- so the wait for the TMA's
    // reads never holds up the warpgroup.
    int staged_qb = -1;
    auto free_staged_q = [&] {
        if (staged_qb >= 0) {
            if (leader) {
                bulk_wait_read<0>();
                mbar_arrive_if(q_empty + 8 * staged_qb, true);
            }
            staged_qb = -1;
        }
    };
    auto free_q_now = [&](int qb) {  // a tile with nothing staged: its buffer (and any staged one) frees at once
        free_staged_q();
        staged_qb = qb;
        free_staged_q();
    };
    int kv = 0;  // K/V tiles consumed so far, as in the producer
    for (int n = 0;; ++n) {
        const int qb = n % kWsQBufs;
        mbar_wait(q_full + 8 * qb, (n / kWsQBufs) & 1);
        const int m_block = tile_info[4 * qb];
        if (m_block < 0) break;
        const int b = tile_info[4 * qb + 1], h = tile_info[4 * qb + 2];
        const SeqInfo seq(params, b);
        if (tile_info[4 * qb + 3] < 0) {  // varlen: this sequence is shorter than the grid
            free_q_now(qb);
            continue;
        }
        const int2 rows = block_rows<BM, kShortFirst>(m_block, seq.sq);
        const int row_start = rows.x;  // the block's first row
        FwdBlock<T> fb;
        if constexpr (kShortFirst) {
            fb = FwdBlock<T>::template make_rows<Is_causal>(params, seq, b, h, row_start, rows.y, BN);
        } else {
            fb = FwdBlock<T>::template make<Is_causal>(params, seq, b, h, m_block, BM, BN);
        }
        int n_tiles = fb.n_block_max, n_first = 0;  // key tiles [n_first, n_first + n_tiles), as the producer's
        if constexpr (Is_local) {
            const KeyRange kr = local_key_range<Is_causal, BN>(params, row_start, min(fb.rows_left, BM), seq.sq, seq.sk);
            n_first = kr.n_min;
            n_tiles = kr.n_tiles;
        }
        if (n_tiles <= 0) {
            fb.write_empty(params, BM, D, tid - 128, 128 * NC);
            free_q_now(qb);
            continue;
        }
        auto slot = [&](int it) { return (kv + it) % S; };
        auto full_parity = [&](int it) { return uint32_t(((kv + it) / S) & 1); };
        // Tile `it` passed through without products: its turn taken and passed (the round robin stays
        // in step), its K / V slots released once filled (a release never counts toward a later round).
        auto pass_tile = [&](int it) {
            mbar_wait(k_full + 8 * slot(it), full_parity(it));
            mbar_arrive_if(k_empty + 8 * slot(it), release);
            mbar_wait(v_full + 8 * slot(it), full_parity(it));
            mbar_arrive_if(v_empty + 8 * slot(it), release);
            take_turn();
            pass_turn();
        };
        auto key_block = [&](int it) { return n_first + n_tiles - 1 - it; };  // from the causal diagonal down
        if constexpr (NC == 3 && !Is_causal) {
            if (fb.rows_left <= 64 * cw) {
                // None of this warpgroup's rows is in the sequence (the last block of a sequence
                // that is not a multiple of 192 rows, e.g. 512 = 2 x 192 + 128). Rather than run the
                // block's key tiles' products for nothing (4 of the last block's 12 warpgroup steps at
                // 512), it only takes the n_tiles + 1 turns the products' path takes (one per key tile,
                // one for the last PV): +2% at 512, +6% at 1k (head dim 64, non-causal, H100). Compiled
                // only here: under a causal mask such a warpgroup runs one tile's products (the skip
                // below), this path measured 0 to -2.5% (causal 512-2k), and the branch alone cost the
                // head-dim-128 kernels ~1% at 512 (code layout).
                for (int it = 0; it < n_tiles; ++it) pass_tile(it);
                take_turn();
                pass_turn();
                kv += n_tiles;
                free_q_now(qb);
                continue;
            }
        }
        const uint32_t q_base = sQ + qb * kQTile + cw * 64 * 128;
        FwdRowState<T, D, BN> st;
        st.init();
        float acc_s[BN / 2];
        uint32_t p[BN / 16][4];  // P_{it-1} as A fragments

        auto mask = [&](int it) {
            if constexpr (Is_local) {  // the window's mask (causal folded in, keys past sk), then no other
                st.template mask_window<Is_causal>(acc_s, key_block(it), row_start + row0, seq.sk, fb.causal_off,
                                                   params, g, t);
            } else {
                st.template mask<Is_causal, Is_even>(acc_s, key_block(it), row_start + row0, seq.sk, fb.causal_off,
                                                     g, t);
            }
        };
        auto softmax = [&](int it) {  // both rows, one after the other
            if constexpr (Is_local) {
                mask(it);  // then no other mask
                st.template softmax<false, true>(acc_s, key_block(it), row_start + row0, seq.sk, fb.causal_off,
                                                 params.scale_softmax_log2, g, t);
            } else {
                st.template softmax<Is_causal, Is_even>(acc_s, key_block(it), row_start + row0, seq.sk,
                                                        fb.causal_off, params.scale_softmax_log2, g, t);
            }
        };

        // This warpgroup's first key tile. Under a causal mask the rows of one warpgroup may
        // see fewer key tiles than the block's last rows: with three warpgroups (192-row blocks, 128-key
        // tiles) the first 64 rows of a block skip its diagonal-most tile or two. A skipped tile still
        // takes its turn (the round robin stays in step) and releases its ring slots -- after they
        // have filled, so a release never runs ahead into a later round. At least one tile stays, so
        // the products below run on every path (rows with no key come out as empty rows, as without
        // the skip; a warpgroup with no row in the sequence took the path above).
        // Under a local window every warpgroup runs all the block's tiles (the mask covers the rows that
        // see fewer).
        int it0 = 0;
        bool half0 = false;  // this warpgroup's first key tile: only its first 64 keys are seen
        if constexpr (Is_causal && !Is_local) {
            const int row_end = kShortFirst ? row_start + fb.rows_left : seq.sq;  // past the block's last row
            const int row_first = row_start + cw * 64, last_key = min(row_first + 63, row_end - 1) + fb.causal_off;
            const int n_mine = row_first >= row_end || last_key < 0 ? 0 : last_key / BN + 1;
            it0 = max(0, n_tiles - max(1, n_mine));
            // On the causal diagonal a warpgroup's 64 rows often end before the key tile's 65th key
            // (with 128-row blocks: the block's first warpgroup on every diagonal); its QK^T then runs
            // at N = 64 and, when this is also its last tile, its PV on 64 keys: half the products of
            // the step that opens each tile (diagonal first). Head dim 128 only: at 64 (every other
            // warpgroup of the 192-row blocks) the half products save less than the boundary's second
            // code path costs (H100 harness: causal 1k -2 to -3%, 2k / 8k -1%).
            if constexpr (D == 128) half0 = last_key < key_block(it0) * BN + 64;
        }
        for (int it = 0; it < it0; ++it) pass_tile(it);
        mbar_wait(k_full + 8 * slot(it0), full_parity(it0));
        take_turn();
        if (BN == 128 && half0) {
            wgmma_fence();
            if constexpr (BN == 128) issue_qk<T, D, 64>(acc_s, q_base, sK + slot(it0) * kTile);
            pass_turn();
            free_staged_q();
            wgmma_wait<0>();
        } else {
            wgmma_fence();
            issue_qk<T, D, BN, BN>(acc_s, q_base, sK + slot(it0) * kTile);
            pass_turn();
            free_staged_q();  // the previous tile's O store has long been read; its Q buffer can refill
            wgmma_wait<0>();
        }
        mbar_arrive_if(k_empty + 8 * slot(it0), release);
        softmax(it0);
        st.rescale_o_and_pack_p(acc_s, p);
        for (int it = it0 + 1; it < n_tiles; ++it) {  // peeled: the same wgmma groups in flight on every path
            const int s = slot(it), sp = slot(it - 1);
            mbar_wait(k_full + 8 * s, full_parity(it));
            mbar_wait(v_full + 8 * sp, full_parity(it - 1));
            take_turn();
            wgmma_fence();
            issue_qk<T, D, BN, BN>(acc_s, q_base, sK + s * kTile);
            issue_pv<T, D, BN, BN>(st.acc_o, p, sV + sp * kTile);
            pass_turn();
            wgmma_wait<1>();  // S_it has landed: K slot s is free; PV_{it-1} still runs during the softmax
            if constexpr (Is_causal && !Is_local && D == 128) {
                // ptxas places the wait for PV_{it-1} before the exps, and the warp idles there while
                // they could run. K's release after the softmax, its predicate depending on the row
                // sums (always true: they are >= 0 or NaN), pins the wait after them: +0.9 to +1.9% from
                // 4k (-0.9% at 1k) for this kernel; head dim 64 and the non-causal kernels lose 1-7%.
                softmax(it);
                mbar_arrive_if(k_empty + 8 * s, release && !(st.row_sum[0] + st.row_sum[1] < 0.f));
            } else if constexpr ((D == 128 && !Is_causal && !Is_local) || (D == 64 && Is_causal)) {
                // The same for the maxima: ptxas places the PV wait after the first row's maximum. K's
                // release after both rows' maxima, its predicate depending on their correction factors
                // (always true: exp2 >= 0 or NaN), pins it after them and the first exps: +0.8 to +3.0%
                // non-causal at head dim 128, +1.7 to +4.1% causal at 64 (H200); non-causal 64 loses 0.5%.
                mask(it);
                st.update_max(acc_s, 0, params.scale_softmax_log2);
                st.update_max(acc_s, 1, params.scale_softmax_log2);
                mbar_arrive_if(k_empty + 8 * s, release && !(st.corr[0] + st.corr[1] < 0.f));
                st.exponentiate(acc_s, 0, params.scale_softmax_log2);
                st.exponentiate(acc_s, 1, params.scale_softmax_log2);
            } else {
                mbar_arrive_if(k_empty + 8 * s, release);
                softmax(it);
            }
            wgmma_wait<0>();
            mbar_arrive_if(v_empty + 8 * sp, release);
            st.rescale_o_and_pack_p(acc_s, p);
        }
        const int sl = slot(n_tiles - 1);
        mbar_wait(v_full + 8 * sl, full_parity(n_tiles - 1));
        take_turn();
        if (BN == 128 && half0 && it0 == n_tiles - 1) {  // the diagonal tile was this warpgroup's only one
            wgmma_fence();
            if constexpr (BN == 128) issue_pv<T, D, 64>(st.acc_o, p, sV + sl * kTile);
            pass_turn();
            wgmma_wait<0>();
        } else {
            wgmma_fence();
            issue_pv<T, D, BN, BN>(st.acc_o, p, sV + sl * kTile);
            pass_turn();
            wgmma_wait<0>();
        }
        mbar_arrive_if(v_empty + 8 * sl, release);
        kv += n_tiles;
        if (maps.o_ok && fb.rows_left >= 64 * cw + 64) {
            // Epilogue through shared memory: this warpgroup's 64 rows of O go into its own rows of the
            // tile's Q buffer (only it read them, and its last QK^T has completed), then two (head dim
            // 64: one) TMA stores of 64 x 64 -- 16-byte bursts instead of 64 scattered 4-byte stores
            // per thread. Rows past a packed sequence's end belong to the next sequence: a warpgroup
            // with any such row stores directly instead.
            st.stage_o(smem + qb * kQTile + cw * 64 * 128, BM * 128, fb.lse, params.scale_softmax, row0, warp * 16,
                       fb.rows_left, g, t);
            fence_async_smem();                // generic-proxy writes -> visible to the TMA
            named_barrier_sync(2 + NC + cw, 128);  // the warpgroup's 64 rows are in (barriers after the turns')
            if (leader) {
                const int q_row = (varlen ? seq.q_start : 0) + row_start + cw * 64;
#pragma unroll
                for (int c = 0; c < kAtomCols; ++c)
                    tma_store_4d(&maps.o, sQ + qb * kQTile + c * BM * 128 + cw * 64 * 128, c * 64, q_row, h,
                                 varlen ? 0 : b);
                bulk_commit();
            }
        } else {
            st.store(fb.o, params.o_row_stride, fb.lse, params.scale_softmax, row0, fb.rows_left, g, t);
        }
        staged_qb = qb;
    }
    free_staged_q();  // the last O store has read shared memory before the CTA exits
    if (cw == 0) named_barrier_sync(2, 256);
#else
    __trap();
#endif
}

}  // namespace sm90
}  // namespace flash

namespace flash {
namespace sm90 {

// Launches the warp-specialised forward with NC consumer warpgroups; false (nothing launched) when a
// tensor breaks a TMA rule (tma.h make_tile_map).
template <typename T, int D, int NC, bool Is_causal>
bool launch_fwd_ws(Flash_fwd_params &params, cudaStream_t stream) {
    const bool varlen = params.cu_seqlens_q != nullptr, bf16 = std::is_same_v<T, __nv_bfloat16>;
    const int64_t batch = varlen ? 1 : params.b;
    const int64_t q_rows = varlen ? params.total_q : params.seqlen_q, k_rows = varlen ? params.total_k : params.seqlen_k;
    FwdTmaMaps maps;
    const bool local = has_window(params);
    const bool wide = D == 128 && !Is_causal && !local && !varlen && wide_key_tiles(params.seqlen_k);
    const int bn = ws_keys(wide);
    if (!make_tile_map(&maps.q, params.q_ptr, bf16, D, q_rows, params.h, batch, params.q_row_stride,
                       params.q_head_stride, params.q_batch_stride, kWsBM<NC>) ||
        !make_tile_map(&maps.k, params.k_ptr, bf16, D, k_rows, params.h_k, batch, params.k_row_stride,
                       params.k_head_stride, params.k_batch_stride, bn) ||
        !make_tile_map(&maps.v, params.v_ptr, bf16, D, k_rows, params.h_k, batch, params.v_row_stride,
                       params.v_head_stride, params.v_batch_stride, bn))
        return false;
    maps.o_ok = make_tile_map(&maps.o, params.o_ptr, bf16, D, q_rows, params.h, batch, params.o_row_stride,
                              params.o_head_stride, params.o_batch_stride, 64);
    const dim3 order = flash::tile_grid(params, flash::cdiv(params.seqlen_q, kWsBM<NC>), head_group(params, kFwd));
    FwdTiles tiles{int(order.x), int(order.y), int(order.x * order.y * order.z), nullptr};
    int ctas = tiles.num_tiles;
    // The list schedule where the binding gave a tile counter (fwd_needs_tile_counter), else one CTA
    // per tile.
    if (params.tile_counter != nullptr) {  // one CTA per SM walks the list
        ctas = std::min(ctas, sm_count());
        tiles.counter = params.tile_counter;  // zero, as every launch leaves it
    }
    // Is_even: no key tile runs past the keys (only the softmax's key mask reads it; rows past seqlen_q
    // are zero-filled by the TMA and never stored, so seqlen_q need not be a multiple of BM).
    const bool is_even = !varlen && params.seqlen_k % bn == 0;
    if (local) {  // one instantiation: ragged, blocks at multiples of BM (Is_local's static_assert)
        auto kernel = &flash_fwd_sm90_ws_kernel<T, D, NC, Is_causal, false, false, true>;
        FLASH_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              kWsSmemBytes<D, NC>));
        kernel<<<ctas, kWsThreads<NC>, kWsSmemBytes<D, NC>, stream>>>(params, maps, tiles);
        FLASH_KERNEL_LAUNCH_CHECK();
        return true;
    }
    BOOL_SWITCH(is_even, Is_even, [&] {
        auto launch = [&](auto short_first, auto wide_tag) {
            constexpr bool kWide = decltype(wide_tag)::value;
            auto kernel = &flash_fwd_sm90_ws_kernel<T, D, NC, Is_causal, Is_even, decltype(short_first)::value,
                                                    false, kWide>;
            constexpr int smem = kWsSmemBytes<D, NC, ws_keys(kWide)>;
            FLASH_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
            kernel<<<ctas, kWsThreads<NC>, smem, stream>>>(params, maps, tiles);
            FLASH_KERNEL_LAUNCH_CHECK();
        };
        // The short-first block layout (block_rows) where every sequence has at most
        // kShortFirstMaxRows rows (varlen: seqlen_q is the longest); otherwise blocks at multiples of BM.
        if constexpr (NC == 3 && Is_causal) {
            if (params.seqlen_q <= kShortFirstMaxRows) {
                launch(std::true_type{}, std::false_type{});
                return;
            }
        }
        if constexpr (D == 128 && !Is_causal) {
            if (wide) {
                launch(std::false_type{}, std::true_type{});
                return;
            }
        }
        launch(std::false_type{}, std::false_type{});
    });
    return true;
}

}  // namespace sm90
}  // namespace flash

// Launches the warp-specialised forward; false (nothing launched) when a tensor breaks a TMA rule --
// the caller then runs the FA2 kernel. Consumer warpgroups: 2 at head dim 128 (128-row query blocks),
// 3 at head dim 64 (192 rows; ahead of 2 at every size on an H100: +2.5% causal 512 / 1k, +5% 2k / 4k;
// under a causal mask each warpgroup skips the key tiles its own rows do not see, so the larger
// block's padding costs little).
template <typename T, int D, bool Is_causal>
bool run_flash_fwd_sm90_ws(Flash_fwd_params &params, cudaStream_t stream) {
    return flash::sm90::launch_fwd_ws<T, D, D == 64 ? 3 : 2, Is_causal>(params, stream);
}
