// When the Hopper (wgmma, TMA, warp-specialised) kernels run instead of the FA2 ones, and how they
// are scheduled. Inputs: the device (sm_90, in a build that holds sm_90a code: kernels/build.py
// defines FLASHGPT_HAS_SM90A when TORCH_CUDA_ARCH_LIST has 9.0a), the shape, and the per-shape-class
// table that kernels/tune_cache.py fills from a tuning cache (set_sm90_choice; -1 = the built-in
// default below). docs/kernels.md has the measurements behind each default.
#pragma once
#include <cuda_runtime.h>
#include "../flash.h"
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
    return hopper;
#else
    return false;
#endif
}

// The head-dim-128 forward's key tiles without a causal mask, window or packed sequences: 160 keys
// from 2048 keys, 128 below (flash_fwd_sm90_ws.h Wide; a K / V ring of 2 x 2 x 40 KB beside the two
// 32 KB Q buffers). A step over 160 keys spreads its fixed work (the turn, the maxima's shuffles, O's
// rescale, the ring's barriers) over 25% more keys; below 2048 keys the last tile's padding costs more
// than that saves (1k -6%, 512 -15%). Figures: docs/kernels.md, "160-key tiles".
inline bool wide_key_tiles(int seqlen_k) { return seqlen_k >= 2048; }

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

// Heads interleaved per group in the Hopper kernels' tile order (grid_order.h).
// - Causal: causal blocks are unequal, so the order is a list schedule whose tail is the last group's
//   heaviest blocks. With few blocks per head (short sequences) groups of 2 end ~7% over the ideal in a
//   greedy model of 132 SMs, groups of 16 within ~2%: against 2, causal forward +1% to +4% and backward
//   +0.5% to +3.4% at 512-4k (H200, one process); 8 gains less and 32 loses at 4k-8k.
// - Long causal sequences: the group's streamed tensors are kept within 32 MiB of the 50 MiB L2, the
//   group halved from 16 down to 2 until they fit: the forward streams K and V (4 * s_k * d bytes a
//   head), the backward Q, dO and the fp32 dQ accumulator (8 * s_q * d bytes a head). At head dim 128
//   that is 16 / 8 / 4 heads at 4k / 8k / 16k keys forward, 8 / 4 / 2 backward. Beyond L2 the blocks
//   in flight re-read their heads' tensors from HBM: in bursts at full clock that costs nothing
//   (within 0.7% of 16), but at the power cap, where a training step runs, the energy lowers the
//   clock. Against 16, calls back to back at the cap (H200, one process, dev/ab_builds.py --at-cap):
//   forward +2.5% / +3.6% at 8k / 16k (head dim 128), +3.7% at 16k (64); backward +2.5% / +3.6% /
//   +5.1% at 4k / 8k / 16k (128), +0.9% / +4.4% at 8k / 16k (64), 2-5% fewer joules a call. Of the
//   rules tried (16 or 32 MiB of K and V in both passes, 2 heads from 8k keys) these were each pass's best.
//   Grouped-query heads share K and V, so the forward's count is conservative there.
// - Causal windows: 16 (a window bounds the tensors a block reads; against 2 mostly +1% to +2%).
// - No mask: all blocks are equal and more heads in flight only spread them over more tensors in L2
//   (16: -1% to -3% against 2). Forward 1 (block-major): against 2 +1.1% to +1.4% at the power cap at
//   head dim 128, 4k-16k, and level in bursts (H200); backward 2 (1: level at the cap, -1.3% in
//   bursts at head dim 64, 1k).
inline int head_group(const Flash_fwd_params &p, Pass pass) {
    if (!p.is_causal) return pass == kFwd ? 1 : 2;
    if (has_window(p)) return 16;
    const long long bytes_per_head = pass == kFwd ? 4LL * p.seqlen_k * p.d : 8LL * p.seqlen_q * p.d;
    int group = 16;
    while (group > 2 && group * bytes_per_head > (32LL << 20)) group /= 2;
    return group;
}

// The Hopper kernel for this launch? (Head dims 64 and 128, forward and backward.) The table's
// choice (0: FA2), else (-1) the measured default: the Hopper family everywhere (with its tiled dQ
// accumulator the TMA backward leads the FA2 one also at head dim 64 below 2k keys, H100: +2-30% f+b).
inline bool use(Pass pass, int head_dim, bool causal, int seqlen_k) {
    if (!enabled() || (head_dim != 64 && head_dim != 128)) return false;
    return sm90_choice(pass, head_dim, causal, seqlen_bucket(seqlen_k)) != 0;
}

// The TMA backward's two consumer warpgroups take turns on the tensor pipe, each block's dQ product
// one step late (flash_bwd_sm90_ws.h), from 1024 queries (max per sequence when packed), and at head
// dim 128 without a causal mask from 512; below, the late dQ's ramp and the turns cost more than they
// hide. Turns against lock-step, f+b (H200, one process): head dim 128 non-causal -1.8% at 256, level
// at 384, +2.0% at 512, +3.3% to +4.0% at 640-1k; at 512 / 768 head dim 128 causal -0.8% / -0.9%, head
// dim 64 non-causal -1.8% / -1.0%, causal -1.0% / -1.1%. Otherwise the warpgroups walk in lock-step
// and meet before each dQ product. The table's backward choice 2 (lock-step) or 3 (turns) overrides the
// threshold; bench/tune_kernels.py times both above 1k keys.
inline int pingpong_min_queries(int head_dim, bool causal) { return head_dim == 128 && !causal ? 512 : 1024; }

inline bool pingpong_backward(int head_dim, bool causal, int seqlen_q, int seqlen_k) {
    const int choice = sm90_choice(kBwd, head_dim, causal, seqlen_bucket(seqlen_k));
    if (choice == 2 || choice == 3) return choice == 3;
    return seqlen_q >= pingpong_min_queries(head_dim, causal);
}

// The causal head-dim-128 backward in turns skips a warpgroup's empty half of the diagonal block
// (flash_bwd_sm90_ws.h half_empty) below 4096 keys: one such half per key block gains there (+1.2% to
// +1.4% at 1k, +0.6% to +0.7% at 1.5k-2k; H200, one process) and is level at 4k and costs from 8k
// (-0.5% / -0.9% at 8k / 16k), where the diagonal is a small part of each key block's work.
inline bool causal_skip_backward(int seqlen_k) { return seqlen_k < 4096; }

}  // namespace sm90
}  // namespace flash
