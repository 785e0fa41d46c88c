// One cuBLASLt matmul with an epilogue, in cuBLAS's column-major terms (no torch here).
//
//   D (m x n, leading dim ldd) = op(A) (m x k) * op(B) (k x n), then the epilogue;
//   fp32 accumulation, A, B and D of one 16-bit type, beta = 0 (D is written, never read);
//   or, with accumulate_fp32, D (fp32) += op(A) * op(B) (beta = 1: a weight gradient added straight
//   into an fp32 .grad, kernels/wgrad.py).
//
// Epilogues used by the GELU MLP (kernels/gelu_mlp.py), on its first projection:
//   GELU_AUX_BIAS  D = gelu(AB + bias), aux = AB + bias
//   GELU_AUX       D = gelu(AB),        aux = AB               (without a bias)
// gelu is the tanh approximation. `bias` is a length-m vector; aux is m x n with leading dim ld_aux
// (a multiple of 8). A row-major torch matrix R (r x c) is the column-major matrix R^T, so callers
// pass torch tensors transposed (see gelu_mlp_api.cpp).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

namespace flashgpt {
namespace lt {

struct Matmul {
    int64_t m = 0, n = 0, k = 0;
    bool trans_a = false, trans_b = false;
    const void *a = nullptr;
    int64_t lda = 0;  // A is stored (trans_a ? k x m : m x k), column-major
    const void *b = nullptr;
    int64_t ldb = 0;  // B is stored (trans_b ? n x k : k x n), column-major
    void *d = nullptr;
    int64_t ldd = 0;
    cudaDataType_t dtype = CUDA_R_16BF;  // A, B, D, bias and aux
    cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
    void *bias = nullptr;  // read (BIAS epilogues) or written (BGRAD epilogues)
    void *aux = nullptr;   // written by the GELU_AUX* epilogues
    int64_t ld_aux = 0;
    bool accumulate_fp32 = false;  // D is fp32 and read: D += op(A) op(B) (A and B stay `dtype`)
};

// Runs `mm` on `stream` with the given workspace. On a problem's first call (shape, layout, epilogue,
// pointer alignment) the heuristic's first pick is cached for it and reused by later calls (held at
// the power limit, timing its other candidates gained nothing: docs/history). Returns "" on success,
// else what failed.
std::string run(cublasLtHandle_t handle, const Matmul &mm, void *workspace, size_t workspace_bytes,
                cudaStream_t stream);

}  // namespace lt
}  // namespace flashgpt
