// Host-side launch helpers shared by the forward and backward launch templates.
#pragma once
#include <cuda_runtime.h>
#include "utils.h"

// Opt into more than 48 KB of dynamic shared memory where needed, launch, check the launch.
template <typename Kernel, typename Params>
void launch_with_smem(Kernel kernel, dim3 grid, int threads, int smem, const Params &params,
                      cudaStream_t stream) {
    if (smem > 48 * 1024) {
        FLASH_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    }
    kernel<<<grid, threads, smem, stream>>>(params);
    FLASH_KERNEL_LAUNCH_CHECK();
}

// Largest dynamic shared memory a block of the current device may opt into (227 KB on H100,
// 163 KB on A100).
inline int max_smem_optin() {
    int dev = 0, bytes = 0;
    FLASH_CHECK_CUDA(cudaGetDevice(&dev));
    FLASH_CHECK_CUDA(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    return bytes;
}

