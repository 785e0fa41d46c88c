// The GELU backward with its bias gradient's partial sums, one memory pass (gelu_backward.cu).
// No torch here.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace flashgpt {

// How many row groups (partial-sum rows) gelu_backward_bias uses for a rows x cols problem:
// min(rows, ceil(1024 / ceil(cols / 1024))), at least 1 (kernels/gelu_mlp.py's _row_groups).
int gelu_backward_row_groups(int64_t rows, int64_t cols);

// dpre = dg * gelu_tanh'(pre) (rows x cols, bf16 if `bf16` else fp16, row-major, cols % 8 == 0,
// 16-byte aligned) and partial (row_groups x cols, fp32) = dpre's column sums per row group; when
// `gelu` is not null, also gelu_tanh(pre) into it (the forward's GELU output, rebuilt).
cudaError_t gelu_backward_bias(bool bf16, const void *dg, const void *pre, void *dpre, void *gelu, float *partial,
                               int64_t rows, int64_t cols, int row_groups, cudaStream_t stream);

}  // namespace flashgpt
