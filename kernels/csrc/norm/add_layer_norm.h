// The residual add and the LayerNorm after it, one pass each way (add_layer_norm.cu). No torch here.
//
//   forward   h = x + delta (16-bit, the residual stream), y = (h - mean) * rstd * w + b (16-bit),
//             rstd = 1 / sqrt(var(h) + eps) (fp32, one per row)
//   backward  from y (what the forward returned) and rstd: x_hat = (y - b) / w, g = dy * w,
//             dh = dh_in + rstd * (g - mean(g) - x_hat * mean(g * x_hat))   (16-bit; dh_in: the
//             gradient of h from its other use, the next residual add), and per-row-group partial
//             sums of dy * x_hat and dy (fp32), whose column sums are w's and b's gradients.
// rows x d, row-major, d % 8 == 0 and d <= 8192; 16-byte aligned; w and b fp32 (b may be null).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace flashgpt {

// Row groups (blocks) the backward uses for `rows` rows of d (as many as are resident at once): its
// partial sums have this many rows.
int add_layer_norm_row_groups(bool bf16, int64_t rows, int64_t d);

cudaError_t add_layer_norm_forward(bool bf16, const void *x, const void *delta, const float *w, const float *b,
                                   void *h, void *y, float *rstd, int64_t rows, int64_t d, float eps,
                                   cudaStream_t stream);

// partial: 2 x row_groups x d fp32 ([0]: dy * x_hat, [1]: dy); then add_layer_norm_param_grads sums
// them into dw and db (db may be null).
cudaError_t add_layer_norm_backward(bool bf16, const void *dh_in, const void *dy, const void *y, const float *w,
                                    const float *b, const float *rstd, void *dh, float *partial, int64_t rows,
                                    int64_t d, int row_groups, cudaStream_t stream);

cudaError_t add_layer_norm_param_grads(const float *partial, float *dw, float *db, int64_t d, int row_groups,
                                       cudaStream_t stream);

}  // namespace flashgpt
