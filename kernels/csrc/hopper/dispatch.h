// When the Hopper (wgmma) kernels run instead of the FA2 ones: on an sm_90 device, in a build that
// holds sm_90a code (kernels/build.py defines FLASHGPT_HAS_SM90A when TORCH_CUDA_ARCH_LIST has
// 9.0a), unless the environment says FLASHGPT_SM90=0 (read on every call, so a benchmark can time
// both paths in one process: bench/kernel_sweep.py --compare-fa2); then per shape class, as the tuning
// cache says (kernels/tune_cache.py -> set_sm90_choice) or else by the built-in default, the faster family
// measured on an H100 (kernels/NOTES.md): Hopper for head dims 64 and 128, forward and backward.
#pragma once
#include <cuda_runtime.h>
#include "../flash.h"
#include "../grid_order.h"  // env_is
#include "../utils.h"

namespace flash {
namespace sm90 {

inline bool enabled() {
#ifdef FLASHGPT_HAS_SM90A
    static const bool hopper = [] {
        int dev = 0, major = 0;
        FLASH_CHECK_CUDA(cudaGetDevice(&dev));
        FLASH_CHECK_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
        return major == 9;
    }();
    return hopper && !env_is("FLASHGPT_SM90", "0");
#else
    return false;
#endif
}

// The warp-specialised TMA kernels (flash_fwd_sm90_ws.h, flash_bwd_sm90_ws.h) rather than the
// cp.async ones (flash_fwd_sm90.h, flash_bwd_sm90.h), unless FLASHGPT_SM90_WS=0 (read on every call:
// the tests and bench/kernel_sweep.py --compare-cpasync run both).
inline bool ws_kernels() {
    return !env_is("FLASHGPT_SM90_WS", "0");
}

// The two consumer warpgroups of the TMA forward take turns on the tensor cores (pingpong), unless
// FLASHGPT_SM90_PINGPONG=0 (read on every call; bench/kernel_sweep.py --compare-nopingpong).
inline bool pingpong_forward() {
    return !env_is("FLASHGPT_SM90_PINGPONG", "0");
}

// The TMA kernels write O (forward) and dK / dV (backward) through shared memory and TMA stores,
// unless FLASHGPT_SM90_TMA_STORE=0: direct stores from registers (read on every call;
// bench/kernel_sweep.py --compare-directstore).
inline bool tma_store_epilogue() {
    return !env_is("FLASHGPT_SM90_TMA_STORE", "0");
}

// The TMA forward as a persistent kernel (one CTA per SM taking tiles from a counter, the next tile's
// Q loading during the current one) unless FLASHGPT_SM90_PERSISTENT=0: one CTA per tile (read on
// every call; bench/kernel_sweep.py --compare-nopersist).
inline bool persistent_forward() {
    return !env_is("FLASHGPT_SM90_PERSISTENT", "0");
}

// The persistent TMA forward without a tile counter -- CTA i takes tiles i, i + CTAs, ... -- where
// all tiles are equal: head dim 128 with no causal mask and no packed sequences. No atomic between
// tiles: +0.5% at 512 keys (H100, bench/RESULTS.md). Not at head dim 64, whose last block of a
// sequence is cheaper than the others (the counter's list schedule balances it; strided: -5%), nor
// under a causal mask. FLASHGPT_SM90_FWD_COUNTER=1 keeps the counter (read on every call;
// bench/kernel_sweep.py --compare-counter).
inline bool strided_forward(int head_dim, bool causal, bool varlen) {
    return head_dim == 128 && !causal && !varlen && persistent_forward() && !env_is("FLASHGPT_SM90_FWD_COUNTER", "1");
}

// Consumer warpgroups of the head-dim-64 TMA forward: 3 (192-row query blocks) or 2 (128 rows).
// Default: 3, ahead at every size (H100 harness: +2.5% causal 512 / 1k, +5% 2k / 4k against 2);
// under a causal mask each warpgroup skips the key tiles its own rows do not see, so the larger
// block's padding costs little. FLASHGPT_SM90_FWD_WARPGROUPS=2 or 3 forces one (read on every call;
// bench/kernel_sweep.py --compare-fwd2wg).
inline int fwd_warpgroups_hd64() {
    if (env_is("FLASHGPT_SM90_FWD_WARPGROUPS", "2")) return 2;
    return 3;
}

// Streaming multiprocessors of the current device (read once per process and device ordinal).
inline int sm_count() {
    static int cached[64] = {0};
    int dev = 0;
    FLASH_CHECK_CUDA(cudaGetDevice(&dev));
    int &n = cached[dev & 63];
    if (n == 0) FLASH_CHECK_CUDA(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    return n;
}

enum Pass { kFwd = 0, kBwd = 1 };

// FLASHGPT_SM90_ALWAYS=1: the Hopper kernel wherever one exists, whatever the defaults and the tuning
// cache say (read on every call; the tests' "hopper" path runs every shape through it).
inline bool always_hopper() {
    return env_is("FLASHGPT_SM90_ALWAYS", "1");
}

// The FA2 backward with the Hopper forward when FLASHGPT_SM90_BWD=0 (read on every call; bench/kernel_sweep.py
// --compare-fa2bwd times the backward families under one forward).
inline bool hopper_backward() {
    return !env_is("FLASHGPT_SM90_BWD", "0");
}

// The Hopper kernel for this launch? (Head dims 64 and 128, forward and backward.)
inline bool use(Pass pass, int head_dim, bool causal, int seqlen_k) {
    if (!enabled() || (head_dim != 64 && head_dim != 128) || (pass == kBwd && !hopper_backward())) return false;
    if (always_hopper()) return true;
    // The tuning cache's choice, else (-1) the measured default: the Hopper family everywhere (with
    // its tiled dQ accumulator the TMA backward leads the FA2 one also at head dim 64 below 2k keys,
    // H100: +2-30% f+b).
    return sm90_choice(pass, head_dim, causal, seqlen_bucket(seqlen_k)) != 0;
}

// The TMA backward's two consumer warpgroups take turns on the tensor pipe, each block's dQ product
// one step late (head dims 64 and 128; flash_bwd_sm90_ws.h), from 1024 queries (max per sequence
// when packed); below, the late dQ's ramp and the turns cost more than they hide (H100: head dim 64
// non-causal 512 -4%, head dim 128 512 -0.6% / 0%; from 1k on 0 to +7%). Otherwise the warpgroups
// walk in lock-step and meet before each dQ product.
// Above 1k keys bench/tune_kernels.py times both per shape class and its cache can set either (choice 2 / 3
// of the backward); the <= 1k bucket holds both sides of the threshold, so there it stays.
// FLASHGPT_SM90_BWD_PINGPONG=0: lock-step everywhere, =1: turns at every size, over the cache too
// (read on every call; bench/kernel_sweep.py --compare-bwdlockstep, the tests' "bwdpingpong" path).
inline bool pingpong_backward(int head_dim, bool causal, int seqlen_q, int seqlen_k) {
    if (env_is("FLASHGPT_SM90_BWD_PINGPONG", "0")) return false;
    if (env_is("FLASHGPT_SM90_BWD_PINGPONG", "1")) return true;
    const int tuned = sm90_choice(kBwd, head_dim, causal, seqlen_bucket(seqlen_k));  // 2 / 3 above 1k only
    if (tuned == 2 || tuned == 3) return tuned == 3;
    return seqlen_q >= 1024;
}

}  // namespace sm90
}  // namespace flash
