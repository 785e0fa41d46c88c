// FlashAttention-2 forward kernel (mma.sync m16n8k16 + ldmatrix + cp.async double buffering).
//
// Grid: x = batch*heads, y = query block (REVERSED: y = 0 is the last query block, which under a
// causal mask has the most key blocks, so the longest blocks are dispatched first).
// Block: kNWarps warps; warp w owns query rows [w*16*kMTiles, (w+1)*16*kMTiles) of the block.
//
// Per key block j (visited from the last one down to the first, so the masked blocks come first; under
// a local window only the blocks the band reaches, flash.h):
//   S = Q K_j^T (fp32)  -> mask -> running max m, P = exp2(S*scale_log2 - m*scale_log2)
//   l = l*exp2(m_old - m) + rowsum(P);  O = O*exp2(m_old - m) + P V_j  (P cast to 16 bits in regs)
// End: O /= l, LSE = m*scale + log(l). Rows whose keys are all masked end with l == 0: O = 0,
// LSE = +inf (so the backward's exp(S - LSE) is 0 for them, as in FlashAttention).
#pragma once
#include "flash.h"
#include "grid_order.h"
#include "kernel_traits.h"
#include <cmath>

namespace flash {

// Sequence geometry of one (batch index) entry, shared by forward and backward.
struct SeqInfo {
    int q_start, k_start;  // first row of this sequence in q / k (varlen), else 0
    int sq, sk;            // actual lengths
    __device__ SeqInfo(const Flash_fwd_params &p, int b) {
        if (p.cu_seqlens_q != nullptr) {
            q_start = p.cu_seqlens_q[b];
            sq = p.cu_seqlens_q[b + 1] - q_start;
            k_start = p.cu_seqlens_k[b];
            sk = p.cu_seqlens_k[b + 1] - k_start;
        } else {
            q_start = 0; k_start = 0;
            sq = p.seqlen_q; sk = p.seqlen_k;
        }
    }
    // Element offset of (row 0, head h) of this sequence for a tensor with these strides.
    __device__ int64_t q_off(const Flash_fwd_params &p, int64_t batch_stride, int64_t row_stride,
                             int64_t head_stride, int b, int h) const {
        return (p.cu_seqlens_q ? int64_t(q_start) * row_stride : int64_t(b) * batch_stride) +
               int64_t(h) * head_stride;
    }
    __device__ int64_t k_off(const Flash_fwd_params &p, int64_t batch_stride, int64_t row_stride,
                             int64_t head_stride, int b, int h) const {
        return (p.cu_seqlens_k ? int64_t(k_start) * row_stride : int64_t(b) * batch_stride) +
               int64_t(h) * head_stride;
    }
    // Offset of row 0 of (b, h) in the fp32 (b, h, seqlen_q) / (h, total_q) row-statistics arrays.
    __device__ int64_t lse_off(const Flash_fwd_params &p, int b, int h) const {
        return p.cu_seqlens_q ? int64_t(h) * p.total_q + q_start
                              : (int64_t(b) * p.h + h) * p.seqlen_q;
    }
};

// Local (sliding-window) attention bounds (Flash_fwd_params::window_left / window_right), an unbounded
// side as kNoWindow: query row i (in its sequence, offset = sk - sq) sees keys
// [i + offset - left, i + offset + right]. kNoWindow exceeds every row-key distance and keeps the sums
// inside int for sequences shorter than 2^30 rows.
constexpr int kNoWindow = 1 << 30;
struct Window {
    int left, right;
    __device__ Window() : left(kNoWindow), right(kNoWindow) {}
    __device__ explicit Window(const Flash_fwd_params &p)
        : left(p.window_left < 0 ? kNoWindow : p.window_left),
          right(p.window_right < 0 ? kNoWindow : p.window_right) {}
    __device__ int first_key(int row, int offset) const { return row + offset - left; }
    __device__ int last_key(int row, int offset) const { return row + offset + right; }
    __device__ bool masked(int key, int row, int offset) const {
        return key < first_key(row, offset) || key > last_key(row, offset);
    }
};

// One forward block (batch b, query head h, query block m_block of BM rows): global pointers, the
// rows it owns and the key blocks (of BN) it visits. Bottom-right causal alignment: query i may see
// key j iff j <= i + (sk - sq).
template <typename T>
struct FwdBlock {
    const T *q, *k, *v;  // q at the block's first row; k, v at the sequence's first key
    T *o;                // at the block's first row
    float *lse;          // at the block's first row
    int rows_left, causal_off, n_block_max;

    template <bool Is_causal>
    __device__ static FwdBlock make(const Flash_fwd_params &p, const SeqInfo &seq, int b, int h, int m_block,
                                    int block_m, int block_n) {
        FwdBlock f;
        const int h_k = h / p.h_h_k_ratio;
        f.rows_left = seq.sq - m_block * block_m;
        f.q = reinterpret_cast<const T *>(p.q_ptr) + seq.q_off(p, p.q_batch_stride, p.q_row_stride, p.q_head_stride, b, h) +
              int64_t(m_block) * block_m * p.q_row_stride;
        f.k = reinterpret_cast<const T *>(p.k_ptr) + seq.k_off(p, p.k_batch_stride, p.k_row_stride, p.k_head_stride, b, h_k);
        f.v = reinterpret_cast<const T *>(p.v_ptr) + seq.k_off(p, p.v_batch_stride, p.v_row_stride, p.v_head_stride, b, h_k);
        f.o = reinterpret_cast<T *>(p.o_ptr) + seq.q_off(p, p.o_batch_stride, p.o_row_stride, p.o_head_stride, b, h) +
              int64_t(m_block) * block_m * p.o_row_stride;
        f.lse = p.lse_ptr + seq.lse_off(p, b, h) + m_block * block_m;
        f.causal_off = seq.sk - seq.sq;
        f.n_block_max = cdiv(seq.sk, block_n);
        if (Is_causal) {
            const int last_key = min(seq.sq, (m_block + 1) * block_m) - 1 + f.causal_off;  // of the last row
            f.n_block_max = last_key < 0 ? 0 : min(f.n_block_max, last_key / block_n + 1);
        }
        return f;
    }

    // The block of `rows` query rows from row_start (>= 0, < seq.sq); rows_left = the rows of the block
    // inside the sequence (<= rows). For blocks not laid out at multiples of one size (the Hopper
    // forward's short-first layout, flash_fwd_sm90_ws.h). make's arithmetic with a free first row; make
    // is not rewritten on top of it because that changed the SASS of every kernel that uses make.
    template <bool Is_causal>
    __device__ static FwdBlock make_rows(const Flash_fwd_params &p, const SeqInfo &seq, int b, int h, int row_start,
                                         int rows, int block_n) {
        FwdBlock f;
        const int h_k = h / p.h_h_k_ratio;
        f.rows_left = min(seq.sq - row_start, rows);
        f.q = reinterpret_cast<const T *>(p.q_ptr) + seq.q_off(p, p.q_batch_stride, p.q_row_stride, p.q_head_stride, b, h) +
              int64_t(row_start) * p.q_row_stride;
        f.k = reinterpret_cast<const T *>(p.k_ptr) + seq.k_off(p, p.k_batch_stride, p.k_row_stride, p.k_head_stride, b, h_k);
        f.v = reinterpret_cast<const T *>(p.v_ptr) + seq.k_off(p, p.v_batch_stride, p.v_row_stride, p.v_head_stride, b, h_k);
        f.o = reinterpret_cast<T *>(p.o_ptr) + seq.q_off(p, p.o_batch_stride, p.o_row_stride, p.o_head_stride, b, h) +
              int64_t(row_start) * p.o_row_stride;
        f.lse = p.lse_ptr + seq.lse_off(p, b, h) + row_start;
        f.causal_off = seq.sk - seq.sq;
        f.n_block_max = cdiv(seq.sk, block_n);
        if (Is_causal) {
            const int last_key = row_start + f.rows_left - 1 + f.causal_off;  // of the block's last row
            f.n_block_max = last_key < 0 ? 0 : min(f.n_block_max, last_key / block_n + 1);
        }
        return f;
    }

    // Every row of the block sees no key (causal with sq > sk, or sk == 0): O = 0, LSE = +inf.
    __device__ void write_empty(const Flash_fwd_params &p, int block_m, int head_dim, int tid, int nthreads) const {
        uint16_t *o16 = reinterpret_cast<uint16_t *>(o);  // +0.0 is all-zero bits in bf16/fp16
        for (int i = tid; i < min(rows_left, block_m) * head_dim; i += nthreads) {
            o16[(i / head_dim) * p.o_row_stride + i % head_dim] = 0;
        }
        for (int i = tid; i < min(rows_left, block_m); i += nthreads) lse[i] = INFINITY;
    }
};

template <typename Kt, bool Is_causal, bool Is_even>
__global__ void __launch_bounds__(Kt::kNThreads, Kt::kMinBlocks)
flash_fwd_kernel(const Flash_fwd_params params) {
    using T = typename Kt::T;
    constexpr int BM = Kt::kBlockM, BN = Kt::kBlockN, D = Kt::kHeadDim;
    constexpr int NT = Kt::kNThreads, MT = Kt::kMTiles, S = Kt::kSmemStride;
    constexpr int SN = BN / 8;  // n8 tiles of S per 16-row slab
    constexpr int ON = D / 8;   // n8 tiles of O per 16-row slab

    extern __shared__ __align__(16) unsigned char smem_raw[];
    T *sQ = reinterpret_cast<T *>(smem_raw);   // (BM, S)
    T *sK = sQ + Kt::kSmemQElems;               // 2 x (BN, S)
    T *sV = sK + 2 * Kt::kSmemKVElems;          // 2 x (BN, S)

    const GridTile tile = grid_tile();
    const int m_block = tile.num_blocks - 1 - tile.block;  // heaviest (causal) first
    const int b = tile.bh / params.h, h = tile.bh % params.h;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;

    const SeqInfo seq(params, b);
    if (m_block * BM >= seq.sq) return;  // varlen: this sequence is shorter than the grid
    const FwdBlock<T> fb = FwdBlock<T>::template make<Is_causal>(params, seq, b, h, m_block, BM, BN);
    const int rows_left = fb.rows_left, causal_off = fb.causal_off;
    const T *q_ptr = fb.q, *k_ptr = fb.k, *v_ptr = fb.v;
    T *o_ptr = fb.o;
    float *lse_ptr = fb.lse;
    // Key blocks [n_block_min, n_block_max): those some row of the block sees; under a local window
    // [n_inside_min, n_inside_max) lie inside every row's band, the others are masked. Windowed calls
    // run the ragged kernels only (run_flash_fwd), so the even ones carry no window code. A causal mask
    // is the window's right bound 0, folded in (the mask below then tests it once).
    int n_block_min = 0, n_block_max = fb.n_block_max, n_inside_min = 0, n_inside_max = 0;
    Window win;
    if constexpr (!Is_even) {
        win = Window(params);
        if (Is_causal) win.right = min(win.right, 0);
        const int last_key = win.last_key(m_block * BM + min(rows_left, BM) - 1, causal_off);
        n_block_max = last_key < 0 ? 0 : min(n_block_max, last_key / BN + 1);
        n_block_min = max(0, win.first_key(m_block * BM, causal_off)) / BN;
        const int first_key_of_last_row = win.first_key(m_block * BM + BM - 1, causal_off);
        const int last_key_of_first_row = win.last_key(m_block * BM, causal_off);
        n_inside_min = first_key_of_last_row <= 0 ? 0 : cdiv(first_key_of_last_row, BN);
        n_inside_max = last_key_of_first_row < 0 ? 0 : (last_key_of_first_row + 1) / BN;
    }
    if (n_block_max <= n_block_min) {
        fb.write_empty(params, BM, D, tid, NT);
        return;
    }

    // ---- prologue: Q and the first (= last-index) K/V tile --------------------------------------
    int n_block = n_block_max - 1;
    load_tile_async<BM, D, S, NT, Is_even>(sQ, q_ptr, params.q_row_stride, rows_left, tid);
    load_tile_async<BN, D, S, NT, Is_even>(sK, k_ptr + int64_t(n_block) * BN * params.k_row_stride,
                                           params.k_row_stride, seq.sk - n_block * BN, tid);
    load_tile_async<BN, D, S, NT, Is_even>(sV, v_ptr + int64_t(n_block) * BN * params.v_row_stride,
                                           params.v_row_stride, seq.sk - n_block * BN, tid);
    cp_async_commit();

    float acc_o[MT][ON][4];
    float row_max[MT][2], row_sum[MT][2];  // per thread: rows g and g+8 of each slab
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int j = 0; j < ON; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_o[mt][j][e] = 0.f;
        row_max[mt][0] = row_max[mt][1] = -INFINITY;
        row_sum[mt][0] = row_sum[mt][1] = 0.f;
    }
    const float scale_log2 = params.scale_softmax_log2;
    const int warp_row0 = warp * MT * 16;  // first query row (in the block) owned by this warp

    for (int it = 0; n_block >= n_block_min; --n_block, ++it) {
        const int buf = it & 1;
        // Prefetch the next K/V tile into the other buffer (last read two iterations ago; the
        // barrier at the end of the previous iteration makes it free).
        if (n_block > n_block_min) {
            const int nb = n_block - 1;
            load_tile_async<BN, D, S, NT, Is_even>(sK + (buf ^ 1) * Kt::kSmemKVElems,
                                                   k_ptr + int64_t(nb) * BN * params.k_row_stride,
                                                   params.k_row_stride, seq.sk - nb * BN, tid);
            load_tile_async<BN, D, S, NT, Is_even>(sV + (buf ^ 1) * Kt::kSmemKVElems,
                                                   v_ptr + int64_t(nb) * BN * params.v_row_stride,
                                                   params.v_row_stride, seq.sk - nb * BN, tid);
        }
        cp_async_commit();   // possibly empty group: keeps "all but the newest group" meaning fixed
        cp_async_wait<1>();  // this iteration's tile (and Q) have landed
        __syncthreads();

        const T *sKb = sK + buf * Kt::kSmemKVElems;
        const T *sVb = sV + buf * Kt::kSmemKVElems;

        // ---- S = Q K^T : (16*MT x BN) per warp, fp32 ----------------------------------------------
        float acc_s[MT][SN][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int j = 0; j < SN; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc_s[mt][j][e] = 0.f;
        // (ks indexes no register array: a rolled loop keeps register pressure down.)
#pragma unroll 1
        for (int ks = 0; ks < D / 16; ++ks) {
            uint32_t a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const int r = warp_row0 + mt * 16 + (lane % 16);
                const int c = ks * 16 + (lane / 16) * 8;
                ldmatrix_x4(a[mt], smem_u32(sQ + r * S + c));
            }
#pragma unroll
            for (int np = 0; np < SN / 2; ++np) {
                // matrices: (keys 0-7, d 0-7), (keys 0-7, d 8-15), (keys 8-15, d 0-7), (keys 8-15, d 8-15)
                uint32_t bk[4];
                const int r = np * 16 + (lane / 16) * 8 + (lane % 8);
                const int c = ks * 16 + ((lane / 8) % 2) * 8;
                ldmatrix_x4(bk, smem_u32(sKb + r * S + c));
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma<T>(acc_s[mt][2 * np], a[mt], bk[0], bk[1]);
                    mma<T>(acc_s[mt][2 * np + 1], a[mt], bk[2], bk[3]);
                }
            }
        }

        // ---- mask: keys past the end (ragged last tile), if causal future keys, and keys outside
        // the window (tiles across either edge of the band) ----------------------------------------
        const bool need_mask =
            Is_even ? Is_causal && (n_block + 1) * BN - 1 > m_block * BM + causal_off
                    : (n_block + 1) * BN > seq.sk || n_block < n_inside_min || n_block >= n_inside_max;
        if (need_mask) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int j = 0; j < SN; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int key = n_block * BN + j * 8 + 2 * t + (e & 1);
                        const int qrow = m_block * BM + warp_row0 + mt * 16 + g + (e >= 2 ? 8 : 0);
                        if (key >= seq.sk || (Is_even ? Is_causal && key > qrow + causal_off
                                                      : win.masked(key, qrow, causal_off)))
                            acc_s[mt][j][e] = -INFINITY;
                    }
        }

        // ---- online softmax (rows stay inside a quad: two shuffles per reduction) ----------------
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
                float mx = row_max[mt][hr];
#pragma unroll
                for (int j = 0; j < SN; ++j)
                    mx = fmaxf(mx, fmaxf(acc_s[mt][j][2 * hr], acc_s[mt][j][2 * hr + 1]));
                mx = quad_max(mx);
                // A row with every key masked so far keeps mx = -inf: subtract 0, not -inf (no NaN).
                const float mx_scaled = (mx == -INFINITY) ? 0.f : mx * scale_log2;
                const float corr = exp2f(row_max[mt][hr] * scale_log2 - mx_scaled);
                row_max[mt][hr] = mx;
                float sum = 0.f;
#pragma unroll
                for (int j = 0; j < SN; ++j) {
#pragma unroll
                    for (int e = 2 * hr; e < 2 * hr + 2; ++e) {
                        const float p = exp2f(acc_s[mt][j][e] * scale_log2 - mx_scaled);
                        acc_s[mt][j][e] = p;
                        sum += p;
                    }
                }
                // Partial (per-thread) row sum; the quad reduction happens once, at the end.
                row_sum[mt][hr] = row_sum[mt][hr] * corr + sum;
#pragma unroll
                for (int j = 0; j < ON; ++j) {
                    acc_o[mt][j][2 * hr] *= corr;
                    acc_o[mt][j][2 * hr + 1] *= corr;
                }
            }
        }

        // ---- O += P V : P from registers (C fragment -> A fragment), V via ldmatrix.trans --------
#pragma unroll
        for (int kc = 0; kc < BN / 16; ++kc) {
            uint32_t a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                a[mt][0] = pack2<T>(acc_s[mt][2 * kc][0], acc_s[mt][2 * kc][1]);
                a[mt][1] = pack2<T>(acc_s[mt][2 * kc][2], acc_s[mt][2 * kc][3]);
                a[mt][2] = pack2<T>(acc_s[mt][2 * kc + 1][0], acc_s[mt][2 * kc + 1][1]);
                a[mt][3] = pack2<T>(acc_s[mt][2 * kc + 1][2], acc_s[mt][2 * kc + 1][3]);
            }
#pragma unroll
            for (int dp = 0; dp < ON / 2; ++dp) {
                // matrices: (keys 0-7, d 0-7), (keys 8-15, d 0-7), (keys 0-7, d 8-15), (keys 8-15, d 8-15)
                uint32_t bv[4];
                const int r = kc * 16 + ((lane / 8) % 2) * 8 + (lane % 8);
                const int c = dp * 16 + (lane / 16) * 8;
                ldmatrix_x4_trans(bv, smem_u32(sVb + r * S + c));
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma<T>(acc_o[mt][2 * dp], a[mt], bv[0], bv[1]);
                    mma<T>(acc_o[mt][2 * dp + 1], a[mt], bv[2], bv[3]);
                }
            }
        }
        __syncthreads();  // everyone is done with buffer `buf` before it is refilled
    }

    // ---- epilogue: O /= l, LSE; O goes through shared memory (sQ) for 16-byte global stores -----
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            const float l = quad_sum(row_sum[mt][hr]);
            const bool empty = (l == 0.f) || (l != l);
            const float inv = empty ? 0.f : 1.f / l;
            const int r = warp_row0 + mt * 16 + g + hr * 8;
            if (t == 0 && r < rows_left) {
                lse_ptr[r] = empty ? INFINITY : row_max[mt][hr] * params.scale_softmax + logf(l);
            }
#pragma unroll
            for (int j = 0; j < ON; ++j) {
                // Each warp writes only its own rows of sQ, which only it has read: no barrier needed.
                *reinterpret_cast<uint32_t *>(sQ + r * S + j * 8 + 2 * t) =
                    pack2<T>(acc_o[mt][j][2 * hr] * inv, acc_o[mt][j][2 * hr + 1] * inv);
            }
        }
    }
    __syncthreads();
    store_tile<BM, D, S, NT>(o_ptr, sQ, params.o_row_stride, rows_left, tid);
}

}  // namespace flash
