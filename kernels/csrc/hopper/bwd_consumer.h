// What a warpgroup of the Hopper backward kernel (flash_bwd_sm90_ws.h) does per
// query block: 64 keys (its half of the 128-key block) x 64 queries, head dim 128. (At head dim 64 the
// kernel takes 128 queries per block, NQ below, and packs P^T and dS^T together once dP^T has landed:
// see flash_bwd_sm90_ws.h. The helpers take the query count from their array sizes.)
//   S^T  (64 keys x 64 q)  = K_wg Q^T        SS m64n64, both K-major (d contiguous), 8 k16 over d
//   dP^T (64 keys x 64 q)  = V_wg dO^T       SS m64n64, likewise (its own wgmma group)
//   P^T = exp(S^T * scale - LSE[q])          in registers while dP^T is still running
//   dV_wg (64 x 128 d)    += P^T dO          RS m64n128: P^T as A fragments, dO MN-major (tnspB 1)
//   dS^T = P^T o (dP^T - D[q])               while dV runs (P^T from its fp32 registers)
//   dK_wg (64 x 128 d)    += dS^T Q          RS m64n128: dS^T as A fragments, Q MN-major
//   dS^T -> shared memory, and once both warpgroups' halves are in:
//   dQ (64 q x 64 d cols of wg) = dS K       SS m64n64, A = dS read MN-major from dS^T (tnspA 1),
//                                            B = K columns 64wg.. MN-major (tnspB 1); 8 k16 over keys.
// Register layouts: the wgmma accumulator of wgmma.h; in S^T / dP^T element 4j + i of this thread
// is key (its warp's first key) + g + 8(i/2), query 8j + 2t + (i%2).
#pragma once
#include <type_traits>
#include "../flash.h"
#include "../utils.h"
#include "dq_tiles.h"
#include "wgmma.h"

namespace flash {
namespace sm90 {

// A fragments (mma.m16n8k16 A layout, k = the accumulator's columns) of a 64 x NQ accumulator
// (N = NQ / 2 registers), 16 columns per step: NQ / 16 k16 steps.
template <typename T, int N>
__device__ __forceinline__ void to_a_fragments(const float (&acc)[N], uint32_t (&a)[N / 8][4]) {
#pragma unroll
    for (int kc = 0; kc < N / 8; ++kc) {
        a[kc][0] = pack2<T>(acc[8 * kc + 0], acc[8 * kc + 1]);  // (row g,   cols 16kc + 2t..)
        a[kc][1] = pack2<T>(acc[8 * kc + 2], acc[8 * kc + 3]);  // (row g+8, cols 16kc + 2t..)
        a[kc][2] = pack2<T>(acc[8 * kc + 4], acc[8 * kc + 5]);  // (row g,   cols 16kc + 8 + 2t..)
        a[kc][3] = pack2<T>(acc[8 * kc + 6], acc[8 * kc + 7]);  // (row g+8, cols 16kc + 8 + 2t..)
    }
}

// S^T = K_wg Q^T, then dP^T = V_wg dO^T: two committed groups. k_rows / v_rows: this warpgroup's
// 64 rows of the swizzled 128-row K / V tiles; q_base / do_base: the swizzled NQ-row Q / dO tiles
// (NQ = 64: m64n64 products, 128: m64n128).
template <typename T, int D, int N>
__device__ __forceinline__ void issue_st_dpt(float (&s)[N], float (&dp)[N], uint32_t k_rows, uint32_t v_rows,
                                             uint32_t q_base, uint32_t do_base) {
    constexpr int BN = 128, BM = 2 * N;
    static_assert(N == 32 || N == 64, "64 or 128 queries");
    // One descriptor per operand, stepped by byte offsets (desc_at): one add per wgmma operand.
    const uint64_t dk = smem_desc_u18(opaque(k_rows), 16, 1024), dq = smem_desc_u18(opaque(q_base), 16, 1024);
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
        const uint32_t off_kv = (ks / 4) * BN * 128 + (ks % 4) * 32;  // atom column, 32 B per k16
        const uint32_t off_q = (ks / 4) * BM * 128 + (ks % 4) * 32;
        if constexpr (N == 32) wgmma_m64n64k16_ss<T, 0, 0>(s, desc_at(dk, off_kv), desc_at(dq, off_q), ks > 0);
        else wgmma_m64n128k16_ss<T, 0, 0>(s, desc_at(dk, off_kv), desc_at(dq, off_q), ks > 0);
    }
    wgmma_commit();
    const uint64_t dv = smem_desc_u18(opaque(v_rows), 16, 1024), ddo = smem_desc_u18(opaque(do_base), 16, 1024);
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
        const uint32_t off_kv = (ks / 4) * BN * 128 + (ks % 4) * 32;
        const uint32_t off_q = (ks / 4) * BM * 128 + (ks % 4) * 32;
        if constexpr (N == 32) wgmma_m64n64k16_ss<T, 0, 0>(dp, desc_at(dv, off_kv), desc_at(ddo, off_q), ks > 0);
        else wgmma_m64n128k16_ss<T, 0, 0>(dp, desc_at(dv, off_kv), desc_at(ddo, off_q), ks > 0);
    }
    wgmma_commit();
}

// This thread's query columns' LSE entries (times log2 e) of a block, from shared memory: pair j holds
// queries 8j + 2t, 8j + 2t + 1, the columns of its S^T accumulator (N fp32).
template <int N>
__device__ __forceinline__ void load_lse_pairs(const float *sL, int t, float2 (&out)[N / 4]) {
#pragma unroll
    for (int j = 0; j < N / 4; ++j) out[j] = *reinterpret_cast<const float2 *>(sL + 8 * j + 2 * t);
}

// P^T = exp2(S^T * scale_log2 - LSE * log2 e) in place; masked(key, query) -> 0 where it says so
// (called only when need_mask). key0: this warp's first key (in the sequence), q0: the block's first
// query. lse_pair(j): the LSE entries (times log2 e, scaled by the producer) of load_lse_pairs' pair j,
// from registers loaded earlier or straight from shared memory. The unmasked loop is a separate branch
// so blocks away from the diagonal and the sequence end run no mask arithmetic (the select-based form
// cost ~200 instructions per warp and block). then(): called at the end of each branch, not after
// them, so ptxas can schedule what it does (the next wait, the packs, dS^T) into the exps of either.
template <int N, typename LsePair, typename Masked, typename Then>
__device__ __forceinline__ void exp_pt(float (&s)[N], LsePair lse_pair, float scale_log2, bool need_mask, int key0,
                                       int q0, int g, int t, Masked masked, Then then) {
    auto exp_all = [&](auto with_mask) {
#pragma unroll
        for (int j = 0; j < N / 4; ++j) {
            const float2 lse = lse_pair(j);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float l = (i % 2) ? lse.y : lse.x;
                float p = exp2f(fmaf(s[4 * j + i], scale_log2, -l));
                if constexpr (decltype(with_mask)::value) {
                    if (masked(key0 + g + 8 * (i / 2), q0 + 8 * j + 2 * t + (i % 2))) p = 0.f;
                }
                s[4 * j + i] = p;
            }
        }
    };
    if (need_mask) {
        exp_all(std::true_type{});
        then();
    } else {
        exp_all(std::false_type{});
        then();
    }
}

// acc (64 x D) += A (fragments, k = the 16 KC queries) * B (16 KC queries x D tile, MN-major):
// dV += P^T dO and dK += dS^T Q. Commits one group.
template <typename T, int D, int KC>
__device__ __forceinline__ void issue_rs_over_queries(float (&acc)[D / 2], const uint32_t (&a)[KC][4], uint32_t b_base) {
    const uint64_t db = smem_desc_u18(opaque(b_base), KC * 16 * 128, 1024);  // atom columns of 16 KC rows
#pragma unroll
    for (int kc = 0; kc < KC; ++kc) wgmma_rs_n<T, D, 1>(acc, a[kc], desc_at(db, kc * 16 * 128), true);
    wgmma_commit();
}

// dS^T = P^T o (dP^T - D) straight into A fragments. sDs: the block's D entries. P^T from its fp32
// registers s (they fit without spills as the loops do not hoist addresses; reading P^T back from its
// 16-bit fragments instead costs 32 unpacks per block and one more rounding).
template <typename T, int N>
__device__ __forceinline__ void make_dst(const float (&s)[N], const float (&dp)[N], const float *sDs, int t,
                                         uint32_t (&a_ds)[N / 8][4]) {
#pragma unroll
    for (int kc = 0; kc < N / 8; ++kc)
#pragma unroll
        for (int e = 0; e < 4; ++e) {  // fragment e: n8 tile j = 2kc + e/2, rows +8*(e%2)
            const int j = 2 * kc + e / 2, i0 = 4 * j + 2 * (e % 2);
            const float2 dsum = *reinterpret_cast<const float2 *>(sDs + 8 * j + 2 * t);
            a_ds[kc][e] = pack2<T>(s[i0] * (dp[i0] - dsum.x), s[i0 + 1] * (dp[i0 + 1] - dsum.y));
        }
}

// This warp's 16 key rows of dS^T (fragments) into the swizzled 128-key x NQ-query tile sdS (NQ = 16 KC;
// queries 64.. in the second atom column). The address arithmetic is made opaque per call: otherwise
// the compiler hoists the 4 KC loop-invariant offsets out of the block loop and, at KC = 8, spills them.
// kStmatrix: one stmatrix per 16 queries (a quarter of the instructions: +0 to +1.8% at head dim 64, -1%
// at 128). Fragment e of a_ds[kc] is the 8 x 8 matrix at rows 8 (e % 2), columns 16 kc + 8 (e / 2);
// lane l addresses row l % 8 of matrix e = l / 8, the 16-byte chunk 2 (kc % 4) + e / 2 of that row,
// stored at chunk ^ (row % 8) (128B swizzle; row % 8 = l % 8 as key_row0 is a multiple of 16).
// Otherwise one 32-bit store per pair.
template <bool kStmatrix, int KC>
__device__ __forceinline__ void store_dst(uint8_t *sdS, const uint32_t (&a_ds)[KC][4], int key_row0, int lane) {
    if constexpr (kStmatrix) {
        const int e = lane / 8, r = lane % 8;
        const uint32_t row = smem_u32(sdS) + (key_row0 + 8 * (e % 2) + r) * 128;
        const uint32_t hr = opaque(uint32_t((e / 2) ^ r));  // chunk ^ r = 2 (kc % 4) ^ (e / 2) ^ r
#pragma unroll
        for (int kc = 0; kc < KC; ++kc) stmatrix_x4(row + (kc / 4) * 128 * 128 + ((uint32_t(2 * (kc % 4)) ^ hr) * 16), a_ds[kc]);
    } else {
        const int g = lane / 4, t = lane % 4;
        const int gg = int(opaque(uint32_t(g)));
        uint8_t *row = sdS + (key_row0 + gg) * 128 + 4 * t;  // rows r = key_row0 + g (+8); r % 8 == g
#pragma unroll
        for (int kc = 0; kc < KC; ++kc)
#pragma unroll
            for (int e = 0; e < 4; ++e) {  // swizzled_offset<128>(r, 16kc + 8(e/2) + 2t)
                const int chunk = 2 * (kc % 4) + e / 2;
                *reinterpret_cast<uint32_t *>(row + (kc / 4) * 128 * 128 + 8 * (e % 2) * 128 + ((chunk ^ gg) * 16)) = a_ds[kc][e];
            }
    }
}

// dQ (64 queries x head-dim columns of k_cols' atom column) = dS K over the 128 keys. Commits.
template <typename T>
__device__ __forceinline__ void issue_dq(float (&dq)[32], uint32_t ds_base, uint32_t k_cols) {
    const uint64_t da = smem_desc_u18(opaque(ds_base), 128 * 128, 1024), db = smem_desc_u18(opaque(k_cols), 128 * 128, 1024);
#pragma unroll
    for (int kc = 0; kc < 8; ++kc) wgmma_m64n64k16_ss<T, 1, 1>(dq, desc_at(da, kc * 16 * 128), desc_at(db, kc * 16 * 128), kc > 0);
    wgmma_commit();
}

// The warpgroup's 64 x 64 fp32 dQ slice into its 16 KB sub-tile of a dq_tiles.h tile (staging copy), in
// register order: thread x's registers 4q .. 4q + 3 at float4 q * 128 + x (dq_tiles::staged_float4).
__device__ __forceinline__ void store_acc_subtile(uint8_t *half, const float (&acc)[32], int x) {
#pragma unroll
    for (int q = 0; q < 8; ++q)
        *reinterpret_cast<float4 *>(half + dq_tiles::staged_float4(q, x) * 16) =
            make_float4(acc[4 * q], acc[4 * q + 1], acc[4 * q + 2], acc[4 * q + 3]);
}

// Epilogue through shared memory: this warp's rows of dK (times the softmax scale) and dV into
// k_rows / v_rows, the warpgroup's first rows of 128B-swizzled tiles of 64-column atoms atom_bytes
// apart (the K and V tiles as loaded), for TMA stores.
template <typename T, int D>
__device__ __forceinline__ void stage_dk_dv(uint8_t *k_rows, uint8_t *v_rows, int atom_bytes, float scale,
                                            const float (&acc_dk)[D / 2], const float (&acc_dv)[D / 2], int warp,
                                            int g, int t) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        const int r = warp * 16 + g + 8 * hr;
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            const int off = swizzled_pair_offset(r, j, t, atom_bytes);
            *reinterpret_cast<uint32_t *>(k_rows + off) =
                pack2<T>(acc_dk[4 * j + 2 * hr] * scale, acc_dk[4 * j + 2 * hr + 1] * scale);
            *reinterpret_cast<uint32_t *>(v_rows + off) = pack2<T>(acc_dv[4 * j + 2 * hr], acc_dv[4 * j + 2 * hr + 1]);
        }
    }
}

// Epilogue: this warp's rows of dK (times the softmax scale) and dV, direct 4-byte stores; rows >=
// keys_left are not written. dk / dv at the block's first key.
template <typename T, int D>
__device__ __forceinline__ void store_dk_dv(const Flash_bwd_params &p, T *dk, T *dv, const float (&acc_dk)[D / 2],
                                            const float (&acc_dv)[D / 2], int key_row0, int keys_left, int g, int t) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        const int r = key_row0 + g + 8 * hr;
        if (r < keys_left) {
            T *dk_row = dk + int64_t(r) * p.dk_row_stride + 2 * t;
            T *dv_row = dv + int64_t(r) * p.dv_row_stride + 2 * t;
#pragma unroll
            for (int j = 0; j < D / 8; ++j) {
                *reinterpret_cast<uint32_t *>(dk_row + 8 * j) =
                    pack2<T>(acc_dk[4 * j + 2 * hr] * p.scale_softmax, acc_dk[4 * j + 2 * hr + 1] * p.scale_softmax);
                *reinterpret_cast<uint32_t *>(dv_row + 8 * j) = pack2<T>(acc_dv[4 * j + 2 * hr], acc_dv[4 * j + 2 * hr + 1]);
            }
        }
    }
}

}  // namespace sm90
}  // namespace flash
