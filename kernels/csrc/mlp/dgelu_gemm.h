// The GELU MLP's backward product with the GELU backward and b1's gradient in its epilogue
// (CUTLASS 3 on Hopper, dgelu_gemm.cu). No torch here.
//
//   dpre (M, h) = (dy (M, d) w2 (d, h)) * gelu_tanh'(pre (M, h)),   db1 (h) = sum over M of dpre (fp32)
//
// All matrices bf16, row-major, contiguous; h and d multiples of 8 (16-byte rows for TMA).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace flashgpt {

// Number of kernel variants (tile / schedule choices) built; 0 when the build has no CUTLASS or no
// sm_90a code (the caller then runs the GEMM and gelu_backward_bias separately).
int dgelu_gemm_variants();

// The variant's name ("" if not built) and whether it sums b1's gradient in its epilogue (else
// dgelu_gemm leaves db1 alone and the caller sums dpre's columns).
const char *dgelu_gemm_variant_name(int variant);
bool dgelu_gemm_bias_in_epilogue(int variant);

// Bytes of scratch the variant needs for this problem (the bias reduction's partial sums and counters).
size_t dgelu_gemm_workspace_bytes(int variant, int64_t m, int64_t d, int64_t h);

// Runs the fused product on `stream`. `workspace` holds dgelu_gemm_workspace_bytes(...) bytes, 16-byte
// aligned. Returns cudaErrorNotSupported for a shape the variant cannot run (alignment, sizes) and
// cudaErrorInvalidValue for an unknown variant; the launch's own error otherwise.
cudaError_t dgelu_gemm(int variant, const void *dy, const void *w2, const void *pre, void *dpre, float *db1,
                       int64_t m, int64_t d, int64_t h, void *workspace, cudaStream_t stream);

}  // namespace flashgpt
