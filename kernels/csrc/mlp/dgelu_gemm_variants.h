// The fused dgelu GEMM's variants (tile shape, schedule, where b1's gradient is summed), one .cu each
// (built only with CUTLASS and sm_90a code); dgelu_gemm.cu dispatches by index.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace flashgpt::dgelu {

struct Variant {
    const char *name;
    bool bias_in_epilogue;  // false: the caller sums dpre's columns for b1's gradient
    size_t (*workspace)(int64_t m, int64_t d, int64_t h);
    cudaError_t (*run)(const void *dy, const void *w2, const void *pre, void *dpre, float *db1, int64_t m, int64_t d,
                       int64_t h, void *workspace, cudaStream_t stream);
};

// Defined in dgelu_gemm_<name>.cu, in dgelu_gemm.cu's order.
Variant coop_128x256_bias();
Variant coop_128x256();
Variant pingpong_128x128();

}  // namespace flashgpt::dgelu
