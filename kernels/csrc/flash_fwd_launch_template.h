// Forward launch templates: grid, shared-memory opt-in, and the tile choice per head dim.
#pragma once
#include "flash.h"
#include "flash_fwd_kernel.h"
#include "kernel_traits.h"
#include "static_switch.h"

template <typename Kt, bool Is_causal>
void run_flash_fwd(Flash_fwd_params &params, cudaStream_t stream) {
    const int num_m_blocks = flash::cdiv(params.seqlen_q, Kt::kBlockM);
    // x = batch*heads (fast), y = query block (slow, reversed inside the kernel: longest first).
    dim3 grid(params.b * params.h, num_m_blocks);
    const bool is_even = params.cu_seqlens_q == nullptr && params.seqlen_q % Kt::kBlockM == 0 &&
                         params.seqlen_k % Kt::kBlockN == 0;
    BOOL_SWITCH(is_even, Is_even, [&] {
        auto kernel = &flash::flash_fwd_kernel<Kt, Is_causal, Is_even>;
        constexpr int smem = Kt::kSmemBytes;
        if (smem > 48 * 1024) {
            FLASH_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        }
        kernel<<<grid, Kt::kNThreads, smem, stream>>>(params);
        FLASH_KERNEL_LAUNCH_CHECK();
    });
}

// Tiles (query rows x keys, warps). Starting points from the FA2 paper, retuned on H100
// (see kernels/NOTES.md for what was measured).
template <typename T, bool Is_causal>
void run_mha_fwd_hdim64(Flash_fwd_params &params, cudaStream_t stream) {
    run_flash_fwd<Flash_fwd_kernel_traits<64, 128, 128, 8, T>, Is_causal>(params, stream);
}
template <typename T, bool Is_causal>
void run_mha_fwd_hdim96(Flash_fwd_params &params, cudaStream_t stream) {
    run_flash_fwd<Flash_fwd_kernel_traits<96, 128, 64, 8, T>, Is_causal>(params, stream);
}
template <typename T, bool Is_causal>
void run_mha_fwd_hdim128(Flash_fwd_params &params, cudaStream_t stream) {
    run_flash_fwd<Flash_fwd_kernel_traits<128, 128, 64, 8, T>, Is_causal>(params, stream);
}
