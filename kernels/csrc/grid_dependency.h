// Programmatic dependent launch (sm_90+): the backward's Hopper main kernel is launched as a dependent
// of the pre-pass ahead of it on the stream. A kernel launched by launch_dependent() may start before
// the kernel ahead of it has finished: once every block of that kernel has called allow_dependents()
// (or exited), the dependent's blocks take the SMs as they free up and run what does not read the
// earlier kernel's results (barrier set-up, TMA loads of inputs older than it) while its tail drains.
// wait_prior_grid() returns once the kernel ahead has finished and its writes are visible. Without
// the launch attribute, or below sm_90, both device calls do nothing and the stream orders the
// kernels as usual.
//
// Rule for a kernel launched this way: read nothing the kernel ahead writes, and write nothing it
// reads or writes, before wait_prior_grid() -- in each thread that does so, or after an
// ordering (mbarrier, named barrier) from a thread that has waited. Every kernel before the one
// ahead has finished (that one was launched without the attribute, or itself waited).
#pragma once
#include <cuda_runtime.h>
#include <utility>
#include "utils.h"

namespace flash {

__device__ __forceinline__ void wait_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// kernel<<<grid, threads, smem, stream>>>(args...) with programmatic stream serialization allowed.
template <typename... Params, typename... Args>
void launch_dependent(void (*kernel)(Params...), dim3 grid, int threads, int smem, cudaStream_t stream,
                      Args &&...args) {
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config = {};
    config.gridDim = grid;
    config.blockDim = dim3(threads);
    config.dynamicSmemBytes = size_t(smem);
    config.stream = stream;
    config.attrs = attr;
    config.numAttrs = 1;
    FLASH_CHECK_CUDA(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace flash
