// Torch binding of the GELU MLP's forward GEMM (cuBLASLt, GELU in its epilogue) and backward kernel
// (kernels/gelu_mlp.py):
//
//   linear_gelu(x (M, K), w1 (N, K), b1 (N)?) -> [g, pre], both (M, N):
//       pre = x w1^T + b1, g = gelu_tanh(pre)   (one GEMM; the GELU and the bias in its epilogue)
//   gelu_backward_bias(dg (M, N), pre (M, N), with_gelu) -> [dpre (M, N), partial (R, N) fp32, g?]:
//       dpre = dg * gelu_tanh'(pre); partial's column sums are b1's gradient (not cuBLASLt: its
//       GELU-backward / bias-gradient epilogues ran as separate, slower kernels on an H100, docs/kernels.md);
//       with_gelu: also g = gelu_tanh(pre) (M, N), the forward's output rebuilt in the same pass
//
// Row-major torch matrices are cuBLAS's column-major transposes, so each product is run as its
// transpose: pre^T (N x M) = w1 (N x K as w1^T stored K x N, transposed) * x^T (K x M);
// the bias vector then runs along the output's rows (length N), as cuBLASLt's bias epilogue expects.
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "check_text.h"
#include "mlp/gelu_backward.h"
#include "mlp/lt_matmul.h"
#include "mlp/lt_torch.h"

namespace {

using flashgpt::dims;
using flashgpt::num;

void check_matrix(const at::Tensor &t, const char *name, const at::Tensor &like) {
    TORCH_CHECK(t.is_cuda(), "flashgpt.gelu_mlp: ", name, " must be a CUDA tensor");
    TORCH_CHECK(t.dim() == 2 && t.is_contiguous(), "flashgpt.gelu_mlp: ", name, " must be a contiguous matrix");
    TORCH_CHECK(t.scalar_type() == like.scalar_type(), "flashgpt.gelu_mlp: ", name, " has dtype ",
                t.scalar_type(), ", expected ", like.scalar_type());
    TORCH_CHECK(t.size(1) % 8 == 0, "flashgpt.gelu_mlp: ", name, "'s row length ", num(t.size(1)),
                " must be a multiple of 8 (16-byte rows for cuBLASLt)");
}

void run(const flashgpt::lt::Matmul &mm, const at::Tensor &like) {
    flashgpt::lt::run_on_current_stream(mm, like, "flashgpt.gelu_mlp");
}

std::vector<at::Tensor> linear_gelu(const at::Tensor &x, const at::Tensor &w1, const c10::optional<at::Tensor> &b1) {
    check_matrix(x, "x", x);
    check_matrix(w1, "w1", x);
    const int64_t M = x.size(0), K = x.size(1), N = w1.size(0);
    TORCH_CHECK(w1.size(1) == K, "flashgpt.gelu_mlp: x has ", num(K), " features but w1 is ", dims(w1.sizes()));
    TORCH_CHECK(N % 8 == 0, "flashgpt.gelu_mlp: the hidden size ", num(N), " must be a multiple of 8");
    if (b1.has_value()) {
        TORCH_CHECK(b1->dim() == 1 && b1->size(0) == N && b1->is_contiguous() &&
                        b1->scalar_type() == x.scalar_type() && b1->is_cuda(),
                    "flashgpt.gelu_mlp: b1 must be a contiguous CUDA vector of ", num(N), " ", x.scalar_type());
    }
    c10::cuda::CUDAGuard guard(x.device());
    auto g = at::empty({M, N}, x.options());
    auto pre = at::empty({M, N}, x.options());
    if (M == 0) return {g, pre};
    flashgpt::lt::Matmul mm;
    mm.m = N; mm.n = M; mm.k = K;
    mm.trans_a = true; mm.a = w1.data_ptr(); mm.lda = K;
    mm.trans_b = false; mm.b = x.data_ptr(); mm.ldb = K;
    mm.d = g.data_ptr(); mm.ldd = N;
    mm.dtype = flashgpt::lt::lt_type(x, "flashgpt.gelu_mlp");
    mm.epilogue = b1.has_value() ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
    mm.bias = b1.has_value() ? b1->data_ptr() : nullptr;
    mm.aux = pre.data_ptr(); mm.ld_aux = N;
    run(mm, x);
    return {g, pre};
}

// dpre = dg * gelu_tanh'(pre) and the row-group partial sums of dpre's columns (fp32; the caller
// sums them: b1's gradient), in one memory pass (gelu_backward.cu); with_gelu: gelu_tanh(pre) too.
std::vector<at::Tensor> gelu_backward_bias(const at::Tensor &dg, const at::Tensor &pre, bool with_gelu) {
    check_matrix(dg, "dg", dg);
    check_matrix(pre, "pre", dg);
    TORCH_CHECK(dg.sizes() == pre.sizes(), "flashgpt.gelu_mlp: dg is ", dims(dg.sizes()), " but pre ", dims(pre.sizes()));
    TORCH_CHECK(reinterpret_cast<uintptr_t>(dg.data_ptr()) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(pre.data_ptr()) % 16 == 0,
                "flashgpt.gelu_mlp: dg and pre must be 16-byte aligned");
    c10::cuda::CUDAGuard guard(dg.device());
    const int64_t rows = dg.size(0), cols = dg.size(1);
    auto dpre = at::empty_like(dg);
    const int groups = flashgpt::gelu_backward_row_groups(rows, cols);
    auto partial = at::empty({groups, cols}, dg.options().dtype(at::kFloat));
    std::vector<at::Tensor> out{dpre, partial};
    if (with_gelu) out.push_back(at::empty_like(pre));
    if (rows == 0) {
        partial.zero_();
        return out;
    }
    const cudaError_t err = flashgpt::gelu_backward_bias(
        dg.scalar_type() == at::kBFloat16, dg.data_ptr(), pre.data_ptr(), dpre.data_ptr(),
        with_gelu ? out[2].data_ptr() : nullptr, partial.data_ptr<float>(), rows, cols, groups,
        at::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(err == cudaSuccess, "flashgpt.gelu_mlp: gelu_backward_bias launch failed: ", cudaGetErrorString(err));
    return out;
}

}  // namespace

void register_gelu_mlp(pybind11::module_ &m) {
    m.def("linear_gelu", &linear_gelu, "[gelu_tanh(x w1^T + b1), x w1^T + b1] in one cuBLASLt GEMM");
    m.def("gelu_backward_bias", &gelu_backward_bias,
          "[dg * gelu_tanh'(pre), row-group partial column sums of it (fp32), gelu_tanh(pre) if with_gelu] in one pass",
          pybind11::arg("dg"), pybind11::arg("pre"), pybind11::arg("with_gelu") = false);
}
