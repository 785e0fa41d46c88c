// Forward launch templates: grid, shared-memory opt-in, and the tile choice per head dim.
#pragma once
#include "flash.h"
#include "flash_fwd_kernel.h"
#include "kernel_traits.h"
#include "launch.h"
#include "static_switch.h"
#include "tile_config.h"
#include "hopper/dispatch.h"
#include "hopper/flash_fwd_sm90_ws.h"

template <typename Kt, bool Is_causal>
void run_flash_fwd(Flash_fwd_params &params, cudaStream_t stream) {
    const int num_m_blocks = flash::cdiv(params.seqlen_q, Kt::kBlockM);
    // Query blocks reversed inside the kernel: longest (causal) first. Grid order: grid_order.h.
    const dim3 grid = flash::tile_grid(params, num_m_blocks, /*group=*/1);
    // A local window runs the ragged kernel, the only one that reads it (flash_fwd_kernel.h).
    const bool is_even = params.cu_seqlens_q == nullptr && params.seqlen_q % Kt::kBlockM == 0 &&
                         params.seqlen_k % Kt::kBlockN == 0 && !has_window(params);
    BOOL_SWITCH(is_even, Is_even, [&] {
        launch_with_smem(&flash::flash_fwd_kernel<Kt, Is_causal, Is_even>, grid, Kt::kNThreads,
                         Kt::kSmemBytes, params, stream);
    });
}

// Tiles: (query rows, keys per step, warps, min blocks per SM). Starting points from the FA2
// paper, retuned on H100 (kernels/NOTES.md has the measurements). Values in tile_config.h.

template <int D, int BM, int BN, int W, int MINB, typename T>
using FwdTraits = Flash_fwd_kernel_traits<D, BM, BN, W, T, MINB>;

template <typename T, bool Is_causal>
void run_mha_fwd_hdim64(Flash_fwd_params &params, cudaStream_t stream) {
    // The Hopper kernel (hopper/dispatch.h; also under a local window); the FA2 one elsewhere and where
    // a tensor breaks a TMA rule.
    if (flash::sm90::use(flash::sm90::kFwd, 64, Is_causal, params.seqlen_k) &&
        run_flash_fwd_sm90_ws<T, 64, Is_causal>(params, stream))
        return;
    run_flash_fwd<FwdTraits<64, FLASH_FWD_HD64, T>, Is_causal>(params, stream);
}
template <typename T, bool Is_causal>
void run_mha_fwd_hdim96(Flash_fwd_params &params, cudaStream_t stream) {
    run_flash_fwd<FwdTraits<96, FLASH_FWD_HD96, T>, Is_causal>(params, stream);
}
template <typename T, bool Is_causal>
void run_mha_fwd_hdim128(Flash_fwd_params &params, cudaStream_t stream) {
    // The Hopper kernel (hopper/dispatch.h; also under a local window); the FA2 one elsewhere and where
    // a tensor breaks a TMA rule.
    if (flash::sm90::use(flash::sm90::kFwd, 128, Is_causal, params.seqlen_k) &&
        run_flash_fwd_sm90_ws<T, 128, Is_causal>(params, stream))
        return;
    run_flash_fwd<FwdTraits<128, FLASH_FWD_HD128, T>, Is_causal>(params, stream);
}
