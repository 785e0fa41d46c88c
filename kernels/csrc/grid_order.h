// Which (batch * head, block) each thread block of a forward or backward grid works on.
//
// Block-major grids (x = query or key block, y = batch * head) run the blocks of one (batch, head)
// side by side: they share its K/V (forward) or its Q/dO reads and dQ reduce-adds (backward) in L2.
// Head-major grids (x = batch * head, y = block), the order of sessions 1-4, put one block of each
// of ~132 heads in a wave: at short sequences with many heads every block re-read its head's tensors
// from HBM (16k tokens, 512 per sequence, head dim 128: 4x the K/V traffic; kernels/NOTES.md,
// session 5). Block-major is the default; FLASHGPT_GRID_ORDER=head restores head-major (read on
// every launch: kernels/bench.py --compare-headmajor), as does batch * heads above gridDim.y's limit.
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

__device__ __forceinline__ GridTile grid_tile(bool block_major) {
    return block_major ? GridTile{int(blockIdx.y), int(blockIdx.x), int(gridDim.x)}
                       : GridTile{int(blockIdx.x), int(blockIdx.y), int(gridDim.y)};
}

// Host: the grid for `num_blocks` blocks per (batch, head); records the order in params.block_major.
template <typename Params>
inline dim3 tile_grid(Params &params, int num_blocks) {
    const int bh = params.b * params.h;
    params.block_major = bh <= 65535 && !env_is("FLASHGPT_GRID_ORDER", "head");
    return params.block_major ? dim3(num_blocks, bh) : dim3(bh, num_blocks);
}

}  // namespace flash
