// The torch side of a cuBLASLt call (mlp/lt_matmul.h): dtype mapping, workspace, stream, errors.
// Shared by the GELU MLP's binding (gelu_mlp_api.cpp) and the weight-gradient accumulation
// (wgrad_api.cpp); `who` names the caller in error messages.
#pragma once

#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

#include "mlp/lt_matmul.h"

namespace flashgpt {
namespace lt {

inline cudaDataType_t lt_type(const at::Tensor &t, const char *who) {
    TORCH_CHECK(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf, who,
                ": tensors must be bfloat16 or float16, got ", t.scalar_type(),
                " (run under bf16 autocast, or cast the model)");
    return t.scalar_type() == at::kBFloat16 ? CUDA_R_16BF : CUDA_R_16F;
}

// cuBLASLt's workspace: 32 MiB (what NVIDIA recommends on Hopper), from torch's caching allocator,
// so it is freed stream-ordered once the call is queued.
constexpr int64_t kWorkspaceBytes = 32 << 20;

// Runs `mm` on torch's current stream and cuBLASLt handle.
inline void run_on_current_stream(const Matmul &mm, const at::Tensor &like, const char *who) {
    cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
    auto workspace = at::empty({kWorkspaceBytes}, like.options().dtype(at::kByte));
    cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
    const std::string err = run(handle, mm, workspace.data_ptr(), kWorkspaceBytes, stream);
    TORCH_CHECK(err.empty(), who, ": ", err);
}

}  // namespace lt
}  // namespace flashgpt
