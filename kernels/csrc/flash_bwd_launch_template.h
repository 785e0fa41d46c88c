// Backward launch templates: main kernel grid and tile choice per head dim.
// (The pre-pass / post-pass launchers are in flash_bwd_pre_post.cu.)
#pragma once
#include <type_traits>

#include "flash.h"
#include "flash_bwd_kernel.h"
#include "flash_bwd_kernel_2d.h"
#include "hopper/dispatch.h"
#include "hopper/flash_bwd_sm90_ws.h"
#include "kernel_traits.h"
#include "launch.h"
#include "static_switch.h"
#include "tile_config.h"

// Launch a backward main kernel over its grid. kernel_for(std::bool_constant<Is_even>) returns the
// kernel instantiation for that evenness (both layouts share grid, block and shared-memory rules).
template <typename Kt, typename KernelFor>
void launch_bwd(Flash_bwd_params &params, cudaStream_t stream, KernelFor kernel_for) {
    const int num_n_blocks = flash::cdiv(params.seqlen_k, Kt::kBlockN);
    // The grid (grid_order.h) dispatches a head's low key blocks before its high ones:
    // deterministic mode waits on them.
    const dim3 grid = flash::tile_grid(params, num_n_blocks, /*group=*/1);
    // A local window runs the ragged kernels, the only ones that read it (flash_bwd_common.h).
    const bool is_even = params.cu_seqlens_q == nullptr && params.seqlen_q % Kt::kBlockM == 0 &&
                         params.seqlen_k % Kt::kBlockN == 0 && !has_window(params);
    BOOL_SWITCH(is_even, Is_even, [&] {
        launch_with_smem(kernel_for(std::bool_constant<Is_even>{}), grid, Kt::kNThreads, Kt::kSmemBytes,
                         params, stream);
    });
}

template <typename Kt, bool Is_causal>
void run_flash_bwd(Flash_bwd_params &params, cudaStream_t stream) {
    launch_bwd<Kt>(params, stream, [](auto even) { return &flash::flash_bwd_kernel<Kt, Is_causal, even()>; });
}

// The 2-D warp layout kernel (flash_bwd_kernel_2d.h); falls back to the 1-D kernel Kt1 where the
// device cannot give the 2-D kernel its shared memory (e.g. A100).
template <typename Kt, typename Kt1, bool Is_causal>
void run_flash_bwd_2d(Flash_bwd_params &params, cudaStream_t stream) {
    static const bool fits = Kt::kSmemBytes <= max_smem_optin();
    if (!fits) {
        run_flash_bwd<Kt1, Is_causal>(params, stream);
        return;
    }
    launch_bwd<Kt>(params, stream, [](auto even) { return &flash::flash_bwd_kernel_2d<Kt, Is_causal, even()>; });
}

// Tiles: (query rows per step, keys per block, warps, min blocks per SM); values in tile_config.h.

template <int D, int BM, int BN, int W, int MINB, int UNROLL, int DQM, typename T>
using BwdTraits = Flash_bwd_kernel_traits<D, BM, BN, W, T, MINB, UNROLL, DQM>;

template <typename T, bool Is_causal>
void run_mha_bwd_hdim64(Flash_bwd_params &params, cudaStream_t stream) {
    // The Hopper kernel (hopper/dispatch.h; also under a local window); the FA2 one elsewhere and where
    // a tensor breaks a TMA rule.
    if (flash::sm90::use(flash::sm90::kBwd, 64, Is_causal, params.seqlen_k) &&
        run_flash_bwd_sm90_ws<T, 64, Is_causal>(params, stream))
        return;
    run_flash_bwd<BwdTraits<64, FLASH_BWD_HD64, T>, Is_causal>(params, stream);
}
// 2-D layout tiles: (query rows per step, keys per block, warps, key warps, 16-row dQ slabs per warp).
template <int D, int BM, int BN, int W, int WK, int DQM, typename T>
using Bwd2dTraits = Flash_bwd_2d_kernel_traits<D, BM, BN, W, WK, T, DQM>;

template <typename T, bool Is_causal>
void run_mha_bwd_hdim96(Flash_bwd_params &params, cudaStream_t stream) {
    run_flash_bwd_2d<Bwd2dTraits<96, FLASH_BWD2D_HD96, T>, BwdTraits<96, FLASH_BWD_HD96, T>, Is_causal>(
        params, stream);
}
template <typename T, bool Is_causal>
void run_mha_bwd_hdim128(Flash_bwd_params &params, cudaStream_t stream) {
    // The Hopper kernel (hopper/dispatch.h; also under a local window); the FA2 one elsewhere and where
    // a tensor breaks a TMA rule.
    if (flash::sm90::use(flash::sm90::kBwd, 128, Is_causal, params.seqlen_k) &&
        run_flash_bwd_sm90_ws<T, 128, Is_causal>(params, stream))
        return;
    run_flash_bwd_2d<Bwd2dTraits<128, FLASH_BWD2D_HD128, T>, BwdTraits<128, FLASH_BWD_HD128, T>, Is_causal>(
        params, stream);
}
