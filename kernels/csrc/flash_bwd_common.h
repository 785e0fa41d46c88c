// Pieces shared by the two backward kernels (1-D warp layout: flash_bwd_kernel.h; 2-D warp layout:
// flash_bwd_kernel_2d.h): per-block global pointers, the Q/dO/LSE/D block loader, dQ = dS K with
// its atomic (optionally ordered) accumulation, and the dK/dV epilogue.
#pragma once
#include "flash.h"
#include "grid_order.h"
#include "flash_fwd_kernel.h"  // SeqInfo
#include "utils.h"

namespace flash {

// Global pointers of one backward thread block: (batch b, query head h, key block n_block).
template <typename T>
struct BwdBlockPtrs {
    const T *q, *dO, *k, *v;     // q/dO at row 0 of the sequence; k/v at the block's first key
    T *dk, *dv;                  // at the block's first key (per query head)
    float *dq;                   // fp32 dq_accum at row 0, row stride dq_row_stride
    const float *lse, *dsum;     // row statistics at row 0
    int64_t dq_row_stride;

    __device__ BwdBlockPtrs(const Flash_bwd_params &p, const SeqInfo &seq, int b, int h, int n_block,
                            int block_n, int head_dim) {
        const int h_k = h / p.h_h_k_ratio;
        q = reinterpret_cast<const T *>(p.q_ptr) +
            seq.q_off(p, p.q_batch_stride, p.q_row_stride, p.q_head_stride, b, h);
        dO = reinterpret_cast<const T *>(p.do_ptr) +
             seq.q_off(p, p.do_batch_stride, p.do_row_stride, p.do_head_stride, b, h);
        const int64_t key0 = int64_t(n_block) * block_n;
        k = reinterpret_cast<const T *>(p.k_ptr) +
            seq.k_off(p, p.k_batch_stride, p.k_row_stride, p.k_head_stride, b, h_k) + key0 * p.k_row_stride;
        v = reinterpret_cast<const T *>(p.v_ptr) +
            seq.k_off(p, p.v_batch_stride, p.v_row_stride, p.v_head_stride, b, h_k) + key0 * p.v_row_stride;
        dk = reinterpret_cast<T *>(p.dk_ptr) +
             seq.k_off(p, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride, b, h) + key0 * p.dk_row_stride;
        dv = reinterpret_cast<T *>(p.dv_ptr) +
             seq.k_off(p, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride, b, h) + key0 * p.dv_row_stride;
        // dq_accum: contiguous (b, seqlen_q, h, D) or (total_q, h, D) fp32.
        dq_row_stride = int64_t(p.h) * head_dim;
        dq = p.dq_accum_ptr + seq.q_off(p, int64_t(p.seqlen_q) * dq_row_stride, dq_row_stride, head_dim, b, h);
        lse = p.lse_ptr + seq.lse_off(p, b, h);
        dsum = p.dsoftmax_sum_ptr + seq.lse_off(p, b, h);
    }
};

// cp.async of query block m's LSE and D entries (BM each; zero past the `rows` left in the sequence)
// by threads 0..BM-1. Shared by both FA2 backward kernels and the Hopper one.
template <int BM, typename T>
__device__ __forceinline__ void load_row_stats(const BwdBlockPtrs<T> &g, int rows, int m, float *sLSE,
                                               float *sDsum, int tid) {
    if (tid < BM) {
        const bool ok = tid < rows;
        const int i = ok ? m * BM + tid : 0;
        cp_async_4(smem_u32(sLSE + tid), g.lse + i, ok);
        cp_async_4(smem_u32(sDsum + tid), g.dsum + i, ok);
    }
}

// cp.async of query block m: Q and dO tiles (BM x D, rows past the sequence zero-filled) and the
// LSE / D entries (zero past the end) into buffer `buf` of the double-buffered shared arrays.
template <int BM, int D, int S, int NT, bool Is_even, typename T>
__device__ __forceinline__ void load_q_block(const Flash_bwd_params &p, const BwdBlockPtrs<T> &g,
                                             int sq, int m, T *sQ, T *sdO, float *sLSE, float *sDsum,
                                             int tid) {
    const int rows = sq - m * BM;
    load_tile_async<BM, D, S, NT, Is_even>(sQ, g.q + int64_t(m) * BM * p.q_row_stride, p.q_row_stride,
                                           rows, tid);
    load_tile_async<BM, D, S, NT, Is_even>(sdO, g.dO + int64_t(m) * BM * p.do_row_stride,
                                           p.do_row_stride, rows, tid);
    load_row_stats<BM>(g, rows, m, sLSE, sDsum, tid);
}

// Query blocks a key block visits, and its keys: causal (bottom-right aligned) starts at the first
// query block that can see the block's first key; a local window (apply_window: the FA2 kernels with
// Is_even = false and the Hopper backward's Is_local instantiations, which every windowed call runs, so
// the other kernels carry no window code) narrows the range to the query blocks whose band reaches the
// block's keys.
struct BwdRange {
    int keys_left, causal_off, m_min, m_max, sk;
    Window win;  // unbounded unless apply_window
    template <bool Is_causal>
    __device__ static BwdRange make(const SeqInfo &seq, int n_block, int block_m, int block_n) {
        BwdRange r;
        r.keys_left = seq.sk - n_block * block_n;
        r.causal_off = seq.sk - seq.sq;
        r.m_min = Is_causal ? max(0, n_block * block_n - r.causal_off) / block_m : 0;
        r.m_max = cdiv(seq.sq, block_m);
        r.sk = seq.sk;
        return r;
    }
    // Query i sees key j iff j - off - right <= i <= j - off + left (flash.h): the block's first key
    // bounds the first query, its last key the last one. A causal mask is the right bound 0, folded in
    // (the windowed masks below then test it once).
    template <bool Is_causal>
    __device__ void apply_window(const Flash_fwd_params &p, int n_block, int block_m, int block_n) {
        win = Window(p);
        if (Is_causal) win.right = min(win.right, 0);
        const int first_q = n_block * block_n - causal_off - win.right;
        const int last_q = n_block * block_n + min(keys_left, block_n) - 1 - causal_off + win.left;
        m_min = max(m_min, max(0, first_q) / block_m);
        m_max = last_q < 0 ? 0 : min(m_max, last_q / block_m + 1);
    }
    // Whether P^T of query block m needs the mask below: the block crosses the causal diagonal or an
    // edge of the window, or the key block runs past the sequence's last key. Those keys' K rows are
    // zero-filled (or, packed, the next sequence's), so exp(S - LSE) = exp(-LSE) for them, which
    // overflows (16-bit P^T from exp(11), fp32 from exp(88)) when a query's LSE is very negative -- few
    // keys, large logits; the infinite dS^T then meets the zero K rows in dQ = dS K as inf * 0 = NaN.
    template <bool Is_causal, bool Is_even>
    __device__ bool need_mask(int m, int n_block, int block_m, int block_n) const {
        if constexpr (Is_even) return Is_causal && n_block * block_n + block_n - 1 > m * block_m + causal_off;
        return keys_left < block_n || n_block * block_n < win.first_key(m * block_m + block_m - 1, causal_off) ||
               n_block * block_n + block_n - 1 > win.last_key(m * block_m, causal_off);
    }
    // P^T is 0 at (key, query), both indices in the sequence: a key past its end, a future key, or a
    // key outside the query's window.
    template <bool Is_causal, bool Is_even>
    __device__ bool masked(int key, int q) const {
        if constexpr (Is_even) return key >= sk || (Is_causal && key > q + causal_off);
        return key >= sk || win.masked(key, q, causal_off);
    }
    // The deterministic dQ order of key block n_block among the key blocks that visit query block m
    // (0 for the first): those are n_first .. n_block, n_first the first whose last key reaches the
    // window of m's first row.
    template <bool Is_even>
    __device__ int dq_order(int m, int n_block, int block_m, int block_n) const {
        if constexpr (Is_even) return n_block;
        return n_block - max(0, win.first_key(m * block_m, causal_off)) / block_n;
    }
};

// Prologue of both backward kernels: K_j and V_j, and the first query block into buffer 0, as one
// cp.async group.
template <typename Kt, bool Is_even>
__device__ __forceinline__ void load_kv_and_first_q(const Flash_bwd_params &p, const BwdBlockPtrs<typename Kt::T> &g,
                                                    const SeqInfo &seq, const BwdRange &r, typename Kt::T *sK,
                                                    typename Kt::T *sV, typename Kt::T *sQ, typename Kt::T *sdO,
                                                    float *sLSE, float *sDsum, int tid) {
    constexpr int BN = Kt::kBlockN, D = Kt::kHeadDim, S = Kt::kSmemStride, NT = Kt::kNThreads;
    load_tile_async<BN, D, S, NT, Is_even>(sK, g.k, p.k_row_stride, r.keys_left, tid);
    load_tile_async<BN, D, S, NT, Is_even>(sV, g.v, p.v_row_stride, r.keys_left, tid);
    if (r.m_min < r.m_max) {
        load_q_block<Kt::kBlockM, D, S, NT, Is_even>(p, g, seq.sq, r.m_min, sQ, sdO, sLSE, sDsum, tid);
    }
    cp_async_commit();
}

// Zero a fragment array of any shape.
template <typename A>
__device__ __forceinline__ void zero_fill(A &a) {
    float *p = reinterpret_cast<float *>(&a);
#pragma unroll
    for (int i = 0; i < int(sizeof(A) / sizeof(float)); ++i) p[i] = 0.f;
}

// S^T = K Q^T and dP^T = V dO^T for one warp: MT 16-key slabs from key row key0 (of sK / sV) x SN n8
// tiles of queries from row qcol0 (of sQ / sdO), reduced over the head dim D (row strides S).
template <typename T, int MT, int SN, int D, int S, int kUnroll>
__device__ __forceinline__ void st_dpt_product(float (&acc_s)[MT][SN][4], float (&acc_dp)[MT][SN][4],
                                               const T *sK, const T *sV, const T *sQ, const T *sdO,
                                               int key0, int qcol0, int lane) {
    zero_fill(acc_s);
    zero_fill(acc_dp);
#pragma unroll(kUnroll)  // ks indexes no register array: may stay rolled
    for (int ks = 0; ks < D / 16; ++ks) {
        uint32_t ak[MT][4], av[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            const int r = key0 + mt * 16 + (lane % 16);
            const int c = ks * 16 + (lane / 16) * 8;
            ldmatrix_x4(ak[mt], smem_u32(sK + r * S + c));
            ldmatrix_x4(av[mt], smem_u32(sV + r * S + c));
        }
#pragma unroll
        for (int np = 0; np < SN / 2; ++np) {
            uint32_t bq[4], bdo[4];
            const int r = qcol0 + np * 16 + (lane / 16) * 8 + (lane % 8);
            const int c = ks * 16 + ((lane / 8) % 2) * 8;
            ldmatrix_x4(bq, smem_u32(sQ + r * S + c));
            ldmatrix_x4(bdo, smem_u32(sdO + r * S + c));
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma<T>(acc_s[mt][2 * np], ak[mt], bq[0], bq[1]);
                mma<T>(acc_s[mt][2 * np + 1], ak[mt], bq[2], bq[3]);
                mma<T>(acc_dp[mt][2 * np], av[mt], bdo[0], bdo[1]);
                mma<T>(acc_dp[mt][2 * np + 1], av[mt], bdo[2], bdo[3]);
            }
        }
    }
}

// dV += P^T dO and dK += dS^T Q for one 16-query step kc: A fragments ap / ads (MT key slabs),
// B = dO / Q rows kc*16.. via ldmatrix.trans, ON n8 tiles of head-dim columns from dcol0.
template <typename T, int MT, int ON, int S>
__device__ __forceinline__ void dv_dk_step(float (&acc_dv)[MT][ON][4], float (&acc_dk)[MT][ON][4],
                                           const uint32_t (&ap)[MT][4], const uint32_t (&ads)[MT][4],
                                           const T *sdO, const T *sQ, int kc, int dcol0, int lane) {
#pragma unroll
    for (int dp = 0; dp < ON / 2; ++dp) {
        uint32_t bdo[4], bq[4];
        const int r = kc * 16 + ((lane / 8) % 2) * 8 + (lane % 8);
        const int c = dcol0 + dp * 16 + (lane / 16) * 8;
        ldmatrix_x4_trans(bdo, smem_u32(sdO + r * S + c));
        ldmatrix_x4_trans(bq, smem_u32(sQ + r * S + c));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            mma<T>(acc_dv[mt][2 * dp], ap[mt], bdo[0], bdo[1]);
            mma<T>(acc_dv[mt][2 * dp + 1], ap[mt], bdo[2], bdo[3]);
            mma<T>(acc_dk[mt][2 * dp], ads[mt], bq[0], bq[1]);
            mma<T>(acc_dk[mt][2 * dp + 1], ads[mt], bq[2], bq[3]);
        }
    }
}

// dQ_i += dS K for query block m. dS^T (BN keys x BM queries, row stride SDS) and K (BN x D, row
// stride S) are in shared memory and complete. Warp (wm, wn) of a kDQWarpsM x kDQWarpsN grid
// computes rows (wm*DQM .. +DQM)*16 and columns wn*kDQCols .. +kDQCols, then adds them to the fp32
// accumulator with atomics; in deterministic mode the key block waits until the `order` key blocks
// before it that visit query block m (BwdRange::dq_order) have added theirs (a fixed summation order).
template <typename Kt>
__device__ __forceinline__ void dq_accumulate(const Flash_bwd_params &p, const typename Kt::T *sdS, int SDS,
                                              const typename Kt::T *sK, float *dq, int64_t dq_row_stride,
                                              int sq, int b, int h, int m, int order, int warp,
                                              int lane, int tid) {
    using T = typename Kt::T;
    constexpr int BN = Kt::kBlockN, BM = Kt::kBlockM, S = Kt::kSmemStride;
    constexpr int DQM = Kt::kDQMTiles, QN = Kt::kDQCols / 8;
    const int g = lane / 4, t = lane % 4;
    const int dq_wm = warp % Kt::kDQWarpsM, dq_wn = warp / Kt::kDQWarpsM;
    float acc_dq[DQM][QN][4];
#pragma unroll
    for (int mt = 0; mt < DQM; ++mt)
#pragma unroll
        for (int j = 0; j < QN; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_dq[mt][j][e] = 0.f;
#pragma unroll
    for (int kc = 0; kc < BN / 16; ++kc) {
        // A = dS (queries x keys) read transposed from dS^T:
        // matrices (keys 0-7, q 0-7), (keys 0-7, q 8-15), (keys 8-15, q 0-7), (keys 8-15, q 8-15)
        uint32_t a[DQM][4];
#pragma unroll
        for (int mt = 0; mt < DQM; ++mt) {
            const int r = kc * 16 + (lane / 16) * 8 + (lane % 8);
            const int c = (dq_wm * DQM + mt) * 16 + ((lane / 8) % 2) * 8;
            ldmatrix_x4_trans(a[mt], smem_u32(sdS + r * SDS + c));
        }
#pragma unroll
        for (int dp = 0; dp < QN / 2; ++dp) {
            uint32_t bk[4];
            const int r = kc * 16 + ((lane / 8) % 2) * 8 + (lane % 8);
            const int c = dq_wn * Kt::kDQCols + dp * 16 + (lane / 16) * 8;
            ldmatrix_x4_trans(bk, smem_u32(sK + r * S + c));
#pragma unroll
            for (int mt = 0; mt < DQM; ++mt) {
                mma<T>(acc_dq[mt][2 * dp], a[mt], bk[0], bk[1]);
                mma<T>(acc_dq[mt][2 * dp + 1], a[mt], bk[2], bk[3]);
            }
        }
    }

    int *sem = nullptr;
    if (p.deterministic) {
        const int num_m_blocks_grid = cdiv(p.seqlen_q, BM);
        sem = p.dq_semaphore + (int64_t(b) * p.h + h) * num_m_blocks_grid + m;
        if (tid == 0) {
            while (*reinterpret_cast<volatile int *>(sem) != order) { }
            __threadfence();
        }
        __syncthreads();
    }
#pragma unroll
    for (int mt = 0; mt < DQM; ++mt) {
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            const int q = m * BM + (dq_wm * DQM + mt) * 16 + g + hr * 8;
            if (q < sq) {
                float *row = dq + int64_t(q) * dq_row_stride + dq_wn * Kt::kDQCols + 2 * t;
#pragma unroll
                for (int j = 0; j < QN; ++j) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
                    atomicAdd(reinterpret_cast<float2 *>(row + j * 8),
                              make_float2(acc_dq[mt][j][2 * hr], acc_dq[mt][j][2 * hr + 1]));
#else
                    atomicAdd(row + j * 8, acc_dq[mt][j][2 * hr]);
                    atomicAdd(row + j * 8 + 1, acc_dq[mt][j][2 * hr + 1]);
#endif
                }
            }
        }
    }
    if (p.deterministic) {
        __threadfence();
        __syncthreads();
        if (tid == 0) atomicAdd(sem, 1);
    }
}

// Epilogue: a warp's dK (times the softmax scale) and dV accumulators, MT 16-key slabs from key row0
// x ON n8 tiles from column col0, are staged as 16-bit values in sK / sV (free by now), then the
// block writes the (BN x D) tiles to global memory. Rows past keys_left are not written.
template <typename Kt, int MT, int ON>
__device__ __forceinline__ void store_dk_dv(const Flash_bwd_params &p, const float (&acc_dk)[MT][ON][4],
                                            const float (&acc_dv)[MT][ON][4], typename Kt::T *sK,
                                            typename Kt::T *sV, typename Kt::T *dk, typename Kt::T *dv,
                                            int row0, int col0, int keys_left, int lane, int tid) {
    using T = typename Kt::T;
    constexpr int S = Kt::kSmemStride;
    const int g = lane / 4, t = lane % 4;
    cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            const int r = row0 + mt * 16 + g + hr * 8;
#pragma unroll
            for (int j = 0; j < ON; ++j) {
                const int c = col0 + j * 8 + 2 * t;
                *reinterpret_cast<uint32_t *>(sK + r * S + c) =
                    pack2<T>(acc_dk[mt][j][2 * hr] * p.scale_softmax, acc_dk[mt][j][2 * hr + 1] * p.scale_softmax);
                *reinterpret_cast<uint32_t *>(sV + r * S + c) = pack2<T>(acc_dv[mt][j][2 * hr], acc_dv[mt][j][2 * hr + 1]);
            }
        }
    __syncthreads();
    store_tile<Kt::kBlockN, Kt::kHeadDim, S, Kt::kNThreads>(dk, sK, p.dk_row_stride, keys_left, tid);
    store_tile<Kt::kBlockN, Kt::kHeadDim, S, Kt::kNThreads>(dv, sV, p.dv_row_stride, keys_left, tid);
}

}  // namespace flash
