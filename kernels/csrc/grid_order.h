// Which (batch * head, block) each thread block of a forward or backward grid works on.
//
// Block-major order (the default) runs the blocks of one (batch, head) side by side: they share its
// K/V (forward) or its Q/dO reads and dQ reduce-adds (backward) in L2. Head-major order puts one
// block of each of ~132 heads in a wave: at short sequences with many heads every block re-reads its
// head's tensors from HBM (16k tokens, 512 per sequence, head dim 128: 4x the K/V traffic;
// kernels/NOTES.md). FLASHGPT_GRID_ORDER=head selects it (read on every launch: bench/kernel_sweep.py
// --compare-headmajor).
//
// Heads in groups: CTAs start in launch order as SMs free up, so under a causal mask
// (blocks of unequal work, heaviest first) the order is a list schedule. Plain block-major launches
// one head's blocks heaviest to lightest, then the next head's: the last head's heaviest block starts
// late and runs alone at the end (greedy-schedule model, 132 SMs, causal 8k, 16 heads: 11% over the
// ideal at batch 1, 5.6% at batch 2). Launching G heads interleaved -- block 0 of heads 0..G-1, then
// block 1 of each, ... -- comes within 0.1% of the ideal from G = 2, with the blocks in flight still
// on ~G heads' tensors. Measured (H100, bench/RESULTS.md): the Hopper kernels (one CTA per SM, the
// model's case) gain up to 10% at batch 1, causal 8k; for the FA2 kernels (several CTAs per SM) it is
// mixed (head dim 64 causal 1k backward -11%), so they keep G = 1. The launch code passes its default G;
// FLASHGPT_GRID_GROUP=G overrides it for every kernel (read per launch; 1 = plain block-major).
//
// One grid shape covers all three: grid (G, blocks, batch * heads / G), launch order x fastest, so
// (batch * head) = z * G + x and block = y. Block-major is G = 1, head-major is G = batch * heads
// (also the fallback above gridDim.z's limit of 65535). G is lowered to a divisor of batch * heads.
#pragma once
#include <cstdlib>
#include <cstring>
#include <cuda_runtime.h>

namespace flash {

// The environment switch `name` is set to `value` (read on every call, so benchmarks and tests can
// time or check several kernel paths in one process).
inline bool env_is(const char *name, const char *value) {
    const char *env = std::getenv(name);
    return env != nullptr && std::strcmp(env, value) == 0;
}

struct GridTile {
    int bh;          // batch * h + head
    int block;       // query block (forward) or key block (backward), in launch order
    int num_blocks;  // blocks per (batch, head)
};

__device__ __forceinline__ GridTile grid_tile() {
    return GridTile{int(blockIdx.z * gridDim.x + blockIdx.x), int(blockIdx.y), int(gridDim.y)};
}

// Host: the grid for `num_blocks` blocks per (batch, head), heads grouped by `default_group` (or the
// environment's G) as above.
template <typename Params>
inline dim3 tile_grid(const Params &params, int num_blocks, int default_group) {
    const int bh = params.b * params.h;
    const char *env = std::getenv("FLASHGPT_GRID_GROUP");
    int group = env != nullptr && std::atoi(env) >= 1 ? std::atoi(env) : default_group;
    if (env_is("FLASHGPT_GRID_ORDER", "head")) group = bh;
    group = group < bh ? group : bh;
    while (bh % group != 0) --group;               // whole groups only
    if (bh / group > 65535) group = bh;            // gridDim.z's limit: head-major
    return dim3(group, num_blocks, bh / group);
}

}  // namespace flash
