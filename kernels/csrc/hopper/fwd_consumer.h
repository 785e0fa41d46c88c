// What a warpgroup of the Hopper forward kernel (flash_fwd_sm90_ws.h) does per key tile: the two
// products on wgmma, and per warp the masking of one 64 x BN S tile (BN = 128 or 160 keys), the online
// softmax, O's rescale, P's conversion to wgmma A fragments, and the epilogue. Register layout: the m64nNk16 accumulator of wgmma.h -- this thread
// holds rows g and g + 8 of its warp's 16 rows (hr = 0, 1), columns 8j + 2t + {0, 1}.
// Conventions are those of the FA2 forward: exp2 with log2(e) folded into the scale, un-normalised
// O divided once at the end, LSE = max * scale + log(sum) in natural log, +inf for a row with no key.
#pragma once
#include <cmath>
#include "../flash.h"
#include "../flash_fwd_kernel.h"  // Window
#include "../utils.h"
#include "wgmma.h"

namespace flash {
namespace sm90 {

// S (64 x BN) = Q K^T: SS wgmma, both K-major; q_base: this warpgroup's 64 rows of the swizzled Q
// tile (R = 128 rows per atom column), k_base: the swizzled BN x D K tile (BN = 128, or 160 in the
// wide tiles: dispatch.h wide_key_tiles). Commits one group.
// kKeys = 64: only the tile's first 64 keys, for a causal diagonal tile whose second half no
// row of the warpgroup sees. The m64nNk16 accumulator keeps columns 8j + 2t + {0, 1} in s[4j .. 4j + 3],
// so columns 0..63 are s[0..31] at N = 64 as at N = 128; s[32..63] keep stale values, which the
// causal mask then sets to -inf (every one of those keys lies past every row's diagonal).
template <typename T, int D, int kKeys = 128, int BN = 128>
__device__ __forceinline__ void issue_qk(float (&s)[BN / 2], uint32_t q_base, uint32_t k_base) {
    static_assert(BN == 128 || BN == 160, "128- or 160-key tiles");
    static_assert(kKeys == BN || (BN == 128 && kKeys == 64), "a full K tile, or the first half of a 128-key one");
    // One descriptor per operand, stepped by offsets; the bases opaque so they are not hoisted.
    const uint64_t dq = smem_desc_u18(opaque(q_base), 16, 1024), dk = smem_desc_u18(opaque(k_base), 16, 1024);
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
        const uint32_t off = (ks / 4) * 128 * 128 + (ks % 4) * 32;  // atom column, 32 B per k16
        if constexpr (BN == 160) {
            const uint32_t offk = (ks / 4) * BN * 128 + (ks % 4) * 32;  // K's atom columns are BN rows
            wgmma_m64n160k16_ss<T>(s, desc_at(dq, off), desc_at(dk, offk), ks > 0);
        } else if constexpr (kKeys == 128) {
            wgmma_m64n128k16_ss<T, 0, 0>(s, desc_at(dq, off), desc_at(dk, off), ks > 0);
        } else {
            wgmma_m64n64k16_ss<T, 0, 0>(*reinterpret_cast<float(*)[32]>(&s[0]), desc_at(dq, off), desc_at(dk, off),
                                        ks > 0);
        }
    }
    wgmma_commit();
}

// O (64 x D) += P V: P from registers (BN / 16 k-steps of 16 keys), V (BN keys x D) MN-major (tnspB = 1).
// kKeys = 64: the first 4 k-steps only (P is exactly 0 on the other 64 keys: see issue_qk).
// Commits one group.
template <typename T, int D, int kKeys = 128, int BN = 128>
__device__ __forceinline__ void issue_pv(float (&o)[D / 2], const uint32_t (&p)[BN / 16][4], uint32_t v_base) {
    static_assert(kKeys == BN || (BN == 128 && kKeys == 64), "a full V tile, or the first half of a 128-key one");
    const uint64_t dv = smem_desc_u18(opaque(v_base), BN * 128, 1024);
#pragma unroll
    for (int kc = 0; kc < kKeys / 16; ++kc) wgmma_rs_n<T, D, 1>(o, p[kc], desc_at(dv, kc * 16 * 128), true);
    wgmma_commit();
}

template <typename T, int D, int kBN = 128>
struct FwdRowState {
    static constexpr int BN = kBN;      // keys per S tile: 128, or 160 (issue_qk)
    static constexpr int NJ = BN / 8;   // 8-column groups of a row's S held by each thread
    float acc_o[D / 2];                 // O (64 x D per warpgroup), un-normalised
    float row_max[2], row_sum[2];       // rows g, g + 8 (raw scores; row_sum per thread, quad-reduced at the end)
    float corr[2];                      // exp2 of (old max - new max) * scale_log2, applied to O by rescale
    float max_scaled[2];                // the current maxima times scale_log2 (0 for a row with none)

    __device__ __forceinline__ void init() {
#pragma unroll
        for (int i = 0; i < D / 2; ++i) acc_o[i] = 0.f;
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            row_max[hr] = -INFINITY;
            row_sum[hr] = 0.f;
            corr[hr] = 1.f;
        }
    }

    // Mask S (keys >= sk; causal: key > query row + causal_off), update the row statistics and turn
    // S into un-normalised P in place, one row after the other. qrow0: the first query row (in the
    // sequence) of this warp.
    template <bool Is_causal, bool Is_even>
    __device__ __forceinline__ void softmax(float (&s)[BN / 2], int n_block, int qrow0, int sk, int causal_off,
                                            float scale_log2, int g, int t) {
        mask<Is_causal, Is_even>(s, n_block, qrow0, sk, causal_off, g, t);
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            update_max(s, hr, scale_log2);
            exponentiate(s, hr, scale_log2);
        }
    }

    template <bool Is_causal, bool Is_even>
    __device__ __forceinline__ void mask(float (&s)[BN / 2], int n_block, int qrow0, int sk, int causal_off, int g,
                                         int t) {
        const bool need_mask = (!Is_even && (n_block + 1) * BN > sk) ||
                               (Is_causal && (n_block + 1) * BN - 1 > qrow0 + causal_off);
        if (need_mask) {
#pragma unroll
            for (int j = 0; j < NJ; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = n_block * BN + j * 8 + 2 * t + (e & 1);
                    const int qrow = qrow0 + g + (e >= 2 ? 8 : 0);
                    if (key >= sk || (Is_causal && key > qrow + causal_off)) s[4 * j + e] = -INFINITY;
                }
        }
    }

    // Row hr's new maximum (row_max, max_scaled) and O's correction factor corr[hr].
    __device__ __forceinline__ void update_max(const float (&s)[BN / 2], int hr, float scale_log2) {
        float mx = row_max[hr];
#pragma unroll
        for (int j = 0; j < NJ; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * hr], s[4 * j + 2 * hr + 1]));
        mx = quad_max(mx);
        max_scaled[hr] = (mx == -INFINITY) ? 0.f : mx * scale_log2;
        corr[hr] = exp2f(row_max[hr] * scale_log2 - max_scaled[hr]);
        row_max[hr] = mx;
    }

    // Row hr of S -> exp2(S * scale_log2 - max * scale_log2) in place, and its row sum.
    __device__ __forceinline__ void exponentiate(float (&s)[BN / 2], int hr, float scale_log2) {
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
            for (int e = 2 * hr; e < 2 * hr + 2; ++e) {
                const float pe = exp2f(s[4 * j + e] * scale_log2 - max_scaled[hr]);
                s[4 * j + e] = pe;
                sum += pe;
            }
        row_sum[hr] = row_sum[hr] * corr[hr] + sum;
    }

    // Under a local window (Flash_fwd_params::window_left / window_right; Is_causal: the right bound at
    // most 0): S of key tile n_block set to -inf where a key lies outside its row's band or past sk. Only
    // tiles that cross a band edge of one of this warp's 16 rows (or the keys' end) are touched; the
    // softmax that follows then runs unmasked (softmax<false, true>). qrow0: the warp's first row in the
    // sequence; causal_off = sk - sq.
    template <bool Is_causal>
    __device__ __forceinline__ void mask_window(float (&s)[BN / 2], int n_block, int qrow0, int sk, int causal_off,
                                                const Flash_fwd_params &p, int g, int t) const {
        Window win(p);
        if (Is_causal) win.right = min(win.right, 0);
        const int key0 = n_block * BN, key_end = key0 + BN;  // the tile's keys [key0, key_end)
        const bool inside = key_end <= sk && key0 >= win.first_key(qrow0 + 15, causal_off) &&
                            key_end - 1 <= win.last_key(qrow0, causal_off);
        if (!inside) {
#pragma unroll
            for (int j = 0; j < NJ; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = key0 + j * 8 + 2 * t + (e & 1);
                    const int qrow = qrow0 + g + (e >= 2 ? 8 : 0);
                    if (key >= sk || win.masked(key, qrow, causal_off)) s[4 * j + e] = -INFINITY;
                }
        }
    }

    // Once the previous PV product has landed: O *= corr; P (in s) -> the A fragments of the next
    // PV product (BN / 16 k-steps of 16 keys).
    __device__ __forceinline__ void rescale_o_and_pack_p(const float (&s)[BN / 2], uint32_t (&p)[BN / 16][4]) {
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            acc_o[4 * j + 0] *= corr[0];
            acc_o[4 * j + 1] *= corr[0];
            acc_o[4 * j + 2] *= corr[1];
            acc_o[4 * j + 3] *= corr[1];
        }
#pragma unroll
        for (int kc = 0; kc < BN / 16; ++kc) {
            p[kc][0] = pack2<T>(s[8 * kc + 0], s[8 * kc + 1]);
            p[kc][1] = pack2<T>(s[8 * kc + 2], s[8 * kc + 3]);
            p[kc][2] = pack2<T>(s[8 * kc + 4], s[8 * kc + 5]);
            p[kc][3] = pack2<T>(s[8 * kc + 6], s[8 * kc + 7]);
        }
    }

    // O /= l into shared memory for a TMA store, and LSE (direct). tile: this warpgroup's first row of
    // a 128B-swizzled tile of 64-column atoms (atom a at a * atom_bytes; row r at r * 128 bytes;
    // 16-byte chunk k of a row at (k ^ r % 8) * 16: the layout the TMA reads), 64 rows; wr0: this
    // warp's first row in it (16 rows per warp). LSE as in store (rows >= rows_left not written).
    __device__ __forceinline__ void stage_o(uint8_t *tile, int atom_bytes, float *lse_ptr, float scale, int row0,
                                            int wr0, int rows_left, int g, int t) const {
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            const float l = quad_sum(row_sum[hr]);
            const bool empty = (l == 0.f) || (l != l);
            const float inv = empty ? 0.f : 1.f / l;
            const int r = row0 + g + hr * 8, rt = wr0 + g + hr * 8;
            if (t == 0 && r < rows_left) lse_ptr[r] = empty ? INFINITY : row_max[hr] * scale + logf(l);
#pragma unroll
            for (int j = 0; j < D / 8; ++j) {  // columns 8j + 2t, 8j + 2t + 1: atom j / 8, chunk j % 8
                *reinterpret_cast<uint32_t *>(tile + swizzled_pair_offset(rt, j, t, atom_bytes)) =
                    pack2<T>(acc_o[4 * j + 2 * hr] * inv, acc_o[4 * j + 2 * hr + 1] * inv);
            }
        }
    }

    // O /= l and LSE, direct 4-byte stores. o_ptr / lse_ptr at the block's first row; row0: this
    // warp's first row in the block; rows >= rows_left are not written.
    __device__ __forceinline__ void store(T *o_ptr, int64_t o_row_stride, float *lse_ptr, float scale, int row0,
                                          int rows_left, int g, int t) const {
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            const float l = quad_sum(row_sum[hr]);
            const bool empty = (l == 0.f) || (l != l);
            const float inv = empty ? 0.f : 1.f / l;
            const int r = row0 + g + hr * 8;
            if (r < rows_left) {
                if (t == 0) lse_ptr[r] = empty ? INFINITY : row_max[hr] * scale + logf(l);
                T *orow = o_ptr + int64_t(r) * o_row_stride;
#pragma unroll
                for (int j = 0; j < D / 8; ++j) {
                    *reinterpret_cast<uint32_t *>(orow + j * 8 + 2 * t) =
                        pack2<T>(acc_o[4 * j + 2 * hr] * inv, acc_o[4 * j + 2 * hr + 1] * inv);
                }
            }
        }
    }
};

}  // namespace sm90
}  // namespace flash
