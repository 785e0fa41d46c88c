// Torch binding of the weight-gradient GEMM that accumulates into fp32 (kernels/wgrad.py):
//
//   wgrad_accumulate(dy (M, N), x (M, K), main_grad (N, K) fp32):  main_grad += dy^T x
//
// dy and x are bf16 or fp16 (the micro-batch's output gradient and the layer's input, M tokens);
// main_grad is the fp32 parameter's .grad. One cuBLASLt GEMM with fp32 accumulation and beta = 1
// reads main_grad in its epilogue and writes the sum back: no 16-bit gradient is written and no
// second kernel adds it in (and the product is not rounded to 16 bits on the way).
//
// In cuBLAS's column-major terms the row-major (N, K) main_grad is the K x N matrix main_grad^T =
// x^T (K x M, stored as x) * dy (M x N, stored as dy^T: transposed).
#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>

#include "check_text.h"
#include "mlp/lt_matmul.h"
#include "mlp/lt_torch.h"

namespace {

constexpr const char *kWho = "flashgpt.wgrad_accumulate";

using flashgpt::dims;
using flashgpt::num;

// CUDA device index of t, -1 off CUDA (messages print indices: no c10::Device streaming).
int64_t gpu_of(const at::Tensor &t) { return t.is_cuda() ? t.get_device() : -1; }

void check_input(const at::Tensor &t, const char *name, const at::Tensor &like) {
    TORCH_CHECK(gpu_of(t) == gpu_of(like), kWho, ": ", name, " must be on GPU ", num(gpu_of(like)), ", got ",
                t.is_cuda() ? "GPU " + num(gpu_of(t)) : std::string("a CPU tensor"));
    TORCH_CHECK(t.dim() == 2 && t.is_contiguous(), kWho, ": ", name, " must be a contiguous matrix, got sizes ",
                dims(t.sizes()), " strides ", dims(t.strides()));
    TORCH_CHECK(t.size(1) % 8 == 0, kWho, ": ", name, "'s row length ", num(t.size(1)),
                " must be a multiple of 8 (16-byte rows for cuBLASLt)");
}

void wgrad_accumulate(const at::Tensor &dy, const at::Tensor &x, const at::Tensor &main_grad) {
    TORCH_CHECK(dy.is_cuda(), kWho, ": dy must be a CUDA tensor");
    check_input(dy, "dy", dy);
    check_input(x, "x", dy);
    TORCH_CHECK(x.scalar_type() == dy.scalar_type(), kWho, ": x is ", x.scalar_type(), " but dy ",
                dy.scalar_type());
    const int64_t M = dy.size(0), N = dy.size(1), K = x.size(1);
    TORCH_CHECK(x.size(0) == M, kWho, ": dy has ", num(M), " rows but x ", num(x.size(0)));
    TORCH_CHECK(main_grad.scalar_type() == at::kFloat, kWho, ": main_grad must be float32, got ",
                main_grad.scalar_type());
    TORCH_CHECK(gpu_of(main_grad) == gpu_of(dy), kWho, ": main_grad must be on GPU ", num(gpu_of(dy)));
    TORCH_CHECK(main_grad.is_contiguous() && main_grad.dim() == 2 && main_grad.size(0) == N &&
                    main_grad.size(1) == K,
                kWho, ": main_grad must be a contiguous (", num(N), ", ", num(K),
                ") matrix (the weight's shape), got sizes ", dims(main_grad.sizes()), " strides ",
                dims(main_grad.strides()));
    if (M == 0) return;
    c10::cuda::CUDAGuard guard(dy.device());
    flashgpt::lt::Matmul mm;
    mm.m = K; mm.n = N; mm.k = M;
    mm.trans_a = false; mm.a = x.data_ptr(); mm.lda = K;
    mm.trans_b = true; mm.b = dy.data_ptr(); mm.ldb = N;
    mm.d = main_grad.data_ptr(); mm.ldd = K;
    mm.dtype = flashgpt::lt::lt_type(dy, kWho);
    mm.accumulate_fp32 = true;
    flashgpt::lt::run_on_current_stream(mm, dy, kWho);
}

}  // namespace

void register_wgrad(pybind11::module_ &m) {
    m.def("wgrad_accumulate", &wgrad_accumulate,
          "main_grad (N, K) fp32 += dy (M, N)^T x (M, K), one cuBLASLt GEMM with beta = 1");
}
