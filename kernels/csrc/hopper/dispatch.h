// When the Hopper (wgmma) kernels run instead of the FA2 ones: on an sm_90 device, in a build that
// holds sm_90a code (kernels/build.py defines FLASHGPT_HAS_SM90A when TORCH_CUDA_ARCH_LIST has
// 9.0a), unless the environment says FLASHGPT_SM90=0. The variable is read on every call, so a
// benchmark can time both paths in one process (kernels/bench.py --compare-fa2).
#pragma once
#include <cstdlib>
#include <cstring>
#include <cuda_runtime.h>
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
    const char *env = std::getenv("FLASHGPT_SM90");
    return hopper && !(env != nullptr && std::strcmp(env, "0") == 0);
#else
    return false;
#endif
}

}  // namespace sm90
}  // namespace flash
