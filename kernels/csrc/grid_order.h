// Which (batch * head, block) each thread block of a forward or backward grid works on.
//
// Block-major order runs the blocks of one (batch, head) side by side: they share its K/V (forward)
// or its Q/dO reads and dQ reduce-adds (backward) in L2. Head-major order (one block of each of ~132
// heads in a wave) makes every block re-read its head's tensors from HBM at short sequences with
// many heads (16k tokens, 512 per sequence, head dim 128: 4x the K/V traffic), so it is only the
// fallback above gridDim.z's limit.
//
// Heads in groups: CTAs start in launch order as SMs free up, so under a causal mask
// (blocks of unequal work, heaviest first) the order is a list schedule. Plain block-major launches
// one head's blocks heaviest to lightest, then the next head's: the last head's heaviest block starts
// late and runs alone at the end (greedy-schedule model, 132 SMs, causal 8k, 16 heads: 11% over the
// ideal at batch 1, 5.6% at batch 2). Launching G heads interleaved -- block 0 of heads 0..G-1, then
// block 1 of each, ... -- comes within 0.1% of the ideal from G = 2, with the blocks in flight still
// on ~G heads' tensors. With few blocks per head (short sequences, many heads) the model needs larger
// groups: G = 2 ends ~7% over the ideal at 1k-2k tokens, G = 16 ~2%. Measured: the Hopper kernels (one
// CTA per SM, the model's case) gain up to 10% at batch 1, causal 8k, with G = 2 (H100), and 0.5-4%
// more at 512-4k with G = 16 under a causal mask (H200; hopper/dispatch.h head_group, which also keeps
// a group's tensors within L2 at long sequences); for the FA2 kernels (several CTAs per SM) it is mixed
// (head dim 64 causal 1k backward -11%), so they keep G = 1. Each launch passes its G.
//
// One grid shape covers both: grid (G, blocks, batch * heads / G), launch order x fastest, so
// (batch * head) = z * G + x and block = y. Block-major is G = 1, head-major is G = batch * heads.
// G is lowered to a divisor of batch * heads.
#pragma once
#include <cuda_runtime.h>

namespace flash {

struct GridTile {
    int bh;          // batch * h + head
    int block;       // query block (forward) or key block (backward), in launch order
    int num_blocks;  // blocks per (batch, head)
};

__device__ __forceinline__ GridTile grid_tile() {
    return GridTile{int(blockIdx.z * gridDim.x + blockIdx.x), int(blockIdx.y), int(gridDim.y)};
}

// Host: the grid for `num_blocks` blocks per (batch, head), heads in groups of `group` as above.
template <typename Params>
inline dim3 tile_grid(const Params &params, int num_blocks, int group) {
    const int bh = params.b * params.h;
    group = group < bh ? group : bh;
    while (bh % group != 0) --group;               // whole groups only
    if (bh / group > 65535) group = bh;            // gridDim.z's limit: head-major
    return dim3(group, num_blocks, bh / group);
}

}  // namespace flash
