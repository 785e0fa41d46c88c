// Torch binding of the residual add + LayerNorm kernels (add_layer_norm.h; kernels/add_layer_norm.py):
//
//   add_layer_norm_fwd(x (M, d), delta (M, d), w (d) fp32, b (d) fp32?, eps) -> [h, y (M, d), rstd (M) fp32]
//   add_layer_norm_bwd(dh_in (M, d), dy (M, d), y (M, d), w, b?, rstd) -> [dh (M, d), dw (d) fp32, db (d) fp32?]
//
// x, delta, y, dh_in, dy: bf16 or fp16, one dtype, contiguous, d % 8 == 0, d <= 8192.
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <optional>

#include "check_text.h"
#include "norm/add_layer_norm.h"

namespace {

constexpr const char *kWho = "flashgpt.add_layer_norm";

using flashgpt::dims;
using flashgpt::num;

void check_rows(const at::Tensor &t, const char *name, const at::Tensor &like) {
    TORCH_CHECK(t.is_cuda() && t.get_device() == like.get_device(), kWho, ": ", name, " must be on like's GPU");
    TORCH_CHECK(t.scalar_type() == like.scalar_type(), kWho, ": ", name, " is ", t.scalar_type(), ", expected ",
                like.scalar_type());
    TORCH_CHECK(t.dim() == 2 && t.is_contiguous() && t.sizes() == like.sizes(), kWho, ": ", name,
                " must be a contiguous ", dims(like.sizes()), " matrix, got sizes ", dims(t.sizes()));
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, kWho, ": ", name, " must be 16-byte aligned");
}

void check_params(const at::Tensor &x, const at::Tensor &w, const std::optional<at::Tensor> &b) {
    TORCH_CHECK(x.is_cuda(), kWho, ": x must be a CUDA tensor");
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf, kWho,
                ": x must be bfloat16 or float16, got ", x.scalar_type());
    const int64_t d = x.size(-1);
    TORCH_CHECK(d % 8 == 0 && d <= 8192, kWho, ": the normalised size ", num(d), " must be a multiple of 8, at most 8192");
    for (const at::Tensor *p : {&w, b.has_value() ? &*b : nullptr}) {
        if (p == nullptr) continue;
        TORCH_CHECK(p->is_cuda() && p->get_device() == x.get_device() && p->scalar_type() == at::kFloat &&
                        p->dim() == 1 && p->size(0) == d && p->is_contiguous(),
                    kWho, ": the LayerNorm's weight and bias must be contiguous float32 vectors of ", num(d),
                    " on x's GPU, got sizes ", dims(p->sizes()));
    }
}

std::vector<at::Tensor> add_layer_norm_fwd(const at::Tensor &x, const at::Tensor &delta, const at::Tensor &w,
                                           const std::optional<at::Tensor> &b, double eps) {
    check_params(x, w, b);
    check_rows(x, "x", x);
    check_rows(delta, "delta", x);
    c10::cuda::CUDAGuard guard(x.device());
    const int64_t rows = x.size(0), d = x.size(1);
    auto h = at::empty_like(x), y = at::empty_like(x);
    auto rstd = at::empty({rows}, x.options().dtype(at::kFloat));
    if (rows > 0) {
        const cudaError_t err = flashgpt::add_layer_norm_forward(
            x.scalar_type() == at::kBFloat16, x.data_ptr(), delta.data_ptr(), w.data_ptr<float>(),
            b.has_value() ? b->data_ptr<float>() : nullptr, h.data_ptr(), y.data_ptr(), rstd.data_ptr<float>(), rows, d,
            static_cast<float>(eps), at::cuda::getCurrentCUDAStream().stream());
        TORCH_CHECK(err == cudaSuccess, kWho, ": forward launch failed: ", cudaGetErrorString(err));
    }
    return {h, y, rstd};
}

std::vector<at::Tensor> add_layer_norm_bwd(const at::Tensor &dh_in, const at::Tensor &dy, const at::Tensor &y,
                                           const at::Tensor &w, const std::optional<at::Tensor> &b,
                                           const at::Tensor &rstd) {
    check_params(y, w, b);
    check_rows(y, "y", y);
    check_rows(dy, "dy", y);
    check_rows(dh_in, "dh_in", y);
    const int64_t rows = y.size(0), d = y.size(1);
    TORCH_CHECK(rstd.is_cuda() && rstd.scalar_type() == at::kFloat && rstd.numel() == rows && rstd.is_contiguous(), kWho,
                ": rstd must be a contiguous float32 vector of ", num(rows), " (the forward's)");
    c10::cuda::CUDAGuard guard(y.device());
    const bool bf16 = y.scalar_type() == at::kBFloat16;
    auto dh = at::empty_like(y);
    std::vector<at::Tensor> out{dh, at::empty({d}, w.options())};  // dw, db: written whole by the column sum
    if (b.has_value()) out.push_back(at::empty({d}, w.options()));
    if (rows == 0) {
        for (size_t i = 1; i < out.size(); ++i) out[i].zero_();
        return out;
    }
    const int groups = flashgpt::add_layer_norm_row_groups(bf16, rows, d);
    auto partial = at::empty({2, groups, d}, w.options());
    auto stream = at::cuda::getCurrentCUDAStream().stream();
    cudaError_t err = flashgpt::add_layer_norm_backward(bf16, dh_in.data_ptr(), dy.data_ptr(), y.data_ptr(),
                                                        w.data_ptr<float>(), b.has_value() ? b->data_ptr<float>() : nullptr,
                                                        rstd.data_ptr<float>(), dh.data_ptr(), partial.data_ptr<float>(),
                                                        rows, d, groups, stream);
    TORCH_CHECK(err == cudaSuccess, kWho, ": backward launch failed: ", cudaGetErrorString(err));
    err = flashgpt::add_layer_norm_param_grads(partial.data_ptr<float>(), out[1].data_ptr<float>(),
                                               b.has_value() ? out[2].data_ptr<float>() : nullptr, d, groups, stream);
    TORCH_CHECK(err == cudaSuccess, kWho, ": weight-gradient launch failed: ", cudaGetErrorString(err));
    return out;
}

}  // namespace

void register_add_layer_norm(pybind11::module_ &m) {
    m.def("add_layer_norm_fwd", &add_layer_norm_fwd, "[h = x + delta, y = LayerNorm(h), rstd] in one pass");
    m.def("add_layer_norm_bwd", &add_layer_norm_bwd,
          "[dh = dh_in + LayerNorm backward from y, dw, db?] in one pass and a column sum");
}
