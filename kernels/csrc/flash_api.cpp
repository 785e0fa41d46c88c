// Torch binding (the only file that includes torch): checks, output allocation, params filling,
// and the static switch from runtime (dtype, head dim, causal) to the generated instantiations. The
// local window (window_left, window_right; -1 = unbounded) stays a runtime parameter (flash.h).
// Inputs arrive already validated and padded by kernels/flash_attn.py; the checks here are a
// second line of defence for direct callers.
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <utility>

#include "check_text.h"
#include "flash.h"
#include "hopper/dq_tiles.h"
#include "static_switch.h"

namespace {

// cp.async moves 16-byte chunks: the last dim must be contiguous, the other strides multiples
// of 8 elements and the base 16-byte aligned. Anything else is copied to a contiguous tensor.
// The persistent Hopper forward's work counter pair for one (device, stream): zeroed once here, on the
// stream, and left zero by every launch (the kernel's last CTA resets it) -- no memset per call.
// One pair per stream because launches on one stream never overlap; never freed (8 bytes a stream).
int *stream_tile_counter(int device, cudaStream_t stream) {
    static std::mutex mutex;
    static auto *pairs = new std::map<std::pair<int, cudaStream_t>, int *>();  // leaked: no teardown order
    std::lock_guard<std::mutex> lock(mutex);
    auto it = pairs->find({device, stream});
    if (it != pairs->end()) return it->second;
    int *pair = nullptr;
    C10_CUDA_CHECK(cudaMalloc(&pair, 2 * sizeof(int)));
    C10_CUDA_CHECK(cudaMemsetAsync(pair, 0, 2 * sizeof(int), stream));
    pairs->emplace(std::make_pair(device, stream), pair);
    return pair;
}

at::Tensor aligned(const at::Tensor &t) {
    bool ok = t.stride(-1) == 1 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
    for (int i = 0; i < t.dim() - 1; ++i) ok = ok && (t.stride(i) % 8 == 0 || t.size(i) == 1);
    return ok ? t : t.contiguous();
}

void check_inputs(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, bool varlen) {
    TORCH_CHECK(q.is_cuda() && k.is_cuda() && v.is_cuda(), "flashgpt: q, k, v must be CUDA tensors");
    TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
                "flashgpt: dtype must be bfloat16 or float16");
    TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
                "flashgpt: q, k, v must share a dtype");
    TORCH_CHECK(q.dim() == (varlen ? 3 : 4), "flashgpt: q has the wrong number of dims");
    TORCH_CHECK(k.sizes() == v.sizes(), "flashgpt: k and v must have the same shape");
    const int64_t d = q.size(-1);
    TORCH_CHECK(d == 64 || d == 96 || d == 128, "flashgpt: head dim must be 64, 96 or 128 here");
    TORCH_CHECK(k.size(-1) == d, "flashgpt: q and k head dims differ");
    TORCH_CHECK(q.size(-2) % k.size(-2) == 0, "flashgpt: q heads must be a multiple of k heads");
}

void fill_fwd_params(Flash_fwd_params &p, const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
                     const at::Tensor &out, const at::Tensor &lse,
                     const c10::optional<at::Tensor> &cu_q, const c10::optional<at::Tensor> &cu_k,
                     int64_t max_seqlen_q, int64_t max_seqlen_k, double scale, bool causal,
                     int64_t window_left, int64_t window_right) {
    std::memset(&p, 0, sizeof(p));
    const bool varlen = cu_q.has_value();
    p.q_ptr = q.data_ptr(); p.k_ptr = k.data_ptr(); p.v_ptr = v.data_ptr(); p.o_ptr = out.data_ptr();
    p.lse_ptr = lse.data_ptr<float>();
    p.q_batch_stride = varlen ? 0 : q.stride(0);
    p.k_batch_stride = varlen ? 0 : k.stride(0);
    p.v_batch_stride = varlen ? 0 : v.stride(0);
    p.o_batch_stride = varlen ? 0 : out.stride(0);
    p.q_row_stride = q.stride(-3); p.q_head_stride = q.stride(-2);
    p.k_row_stride = k.stride(-3); p.k_head_stride = k.stride(-2);
    p.v_row_stride = v.stride(-3); p.v_head_stride = v.stride(-2);
    p.o_row_stride = out.stride(-3); p.o_head_stride = out.stride(-2);
    p.b = varlen ? int(cu_q->numel() - 1) : int(q.size(0));
    p.h = int(q.size(-2)); p.h_k = int(k.size(-2)); p.h_h_k_ratio = p.h / p.h_k;
    p.d = int(q.size(-1));
    p.seqlen_q = varlen ? int(max_seqlen_q) : int(q.size(1));
    p.seqlen_k = varlen ? int(max_seqlen_k) : int(k.size(1));
    p.total_q = varlen ? int(q.size(0)) : p.b * p.seqlen_q;
    p.total_k = varlen ? int(k.size(0)) : p.b * p.seqlen_k;
    p.cu_seqlens_q = varlen ? cu_q->data_ptr<int>() : nullptr;
    p.cu_seqlens_k = varlen ? cu_k->data_ptr<int>() : nullptr;
    p.scale_softmax = float(scale);
    p.scale_softmax_log2 = float(scale * M_LOG2E);
    p.is_causal = causal;
    // A side at least as long as the sequences bounds nothing: -1, so that such a call keeps the
    // unwindowed dispatch (flash.h). Every sequence's sk <= max_seqlen_k and sq <= max_seqlen_q.
    p.window_left = window_left >= p.seqlen_k ? -1 : int(window_left);
    p.window_right = window_right >= p.seqlen_q ? -1 : int(window_right);
    if (causal && p.window_right >= 0) p.window_right = -1;  // the causal mask bounds it already
}

void check_window(int64_t window_left, int64_t window_right) {
    TORCH_CHECK(window_left >= -1 && window_right >= -1, "flashgpt: window_size must be two ints >= -1 "
                "(-1 = unbounded on that side), got (", window_left, ", ", window_right, ")");
}

void check_cu(const c10::optional<at::Tensor> &cu_q, const c10::optional<at::Tensor> &cu_k) {
    TORCH_CHECK(cu_q.has_value() == cu_k.has_value(), "flashgpt: give both cu_seqlens or neither");
    if (cu_q.has_value()) {
        TORCH_CHECK(cu_q->is_cuda() && cu_k->is_cuda(), "flashgpt: cu_seqlens must be CUDA tensors");
        TORCH_CHECK(cu_q->scalar_type() == at::kInt && cu_k->scalar_type() == at::kInt,
                    "flashgpt: cu_seqlens must be int32");
        TORCH_CHECK(cu_q->is_contiguous() && cu_k->is_contiguous(), "flashgpt: cu_seqlens must be contiguous");
        TORCH_CHECK(cu_q->numel() == cu_k->numel() && cu_q->numel() >= 2,
                    "flashgpt: cu_seqlens_q and cu_seqlens_k must have the same length >= 2");
    }
}

std::vector<at::Tensor> mha_fwd(at::Tensor q, at::Tensor k, at::Tensor v,
                                c10::optional<at::Tensor> cu_seqlens_q,
                                c10::optional<at::Tensor> cu_seqlens_k, int64_t max_seqlen_q,
                                int64_t max_seqlen_k, double softmax_scale, bool causal,
                                int64_t window_left, int64_t window_right) {
    const bool varlen = cu_seqlens_q.has_value();
    check_cu(cu_seqlens_q, cu_seqlens_k);
    check_window(window_left, window_right);
    check_inputs(q, k, v, varlen);
    q = aligned(q); k = aligned(k); v = aligned(v);
    c10::cuda::CUDAGuard guard(q.device());

    at::Tensor out = at::empty(q.sizes(), q.options());
    const int64_t h = q.size(-2);
    at::Tensor lse = varlen ? at::empty({h, q.size(0)}, q.options().dtype(at::kFloat))
                            : at::empty({q.size(0), h, q.size(1)}, q.options().dtype(at::kFloat));

    Flash_fwd_params params;
    fill_fwd_params(params, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    softmax_scale, causal, window_left, window_right);
    cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
    at::Tensor captured_counter;  // while a CUDA graph is captured: a zeroed pair per call, in the graph
    if (fwd_needs_tile_counter(params.d, causal, params.seqlen_k)) {
        cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
        C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
        if (capture == cudaStreamCaptureStatusNone) {
            params.tile_counter = stream_tile_counter(q.get_device(), stream);  // the persistent forward's
        } else {
            captured_counter = at::zeros({2}, q.options().dtype(at::kInt));
            params.tile_counter = captured_counter.data_ptr<int>();
        }
    }
    FP16_SWITCH(q.scalar_type() == at::kBFloat16, [&] {
        HEADDIM_SWITCH(params.d, [&] {
            BOOL_SWITCH(causal, Is_causal, [&] { run_mha_fwd_<elem_type, kHeadDim, Is_causal>(params, stream); });
        });
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return {out, lse};
}

// An output gradient the caller provides (a view into a packed dqkv): same shape and dtype as its
// input, last dim contiguous, rows 16-byte aligned, and heads contiguous within a row (the dQ
// post-pass writes rows of h * d elements).
void check_grad_out(const at::Tensor &g, const at::Tensor &like, const char *name) {
    TORCH_CHECK(g.sizes() == like.sizes() && g.scalar_type() == like.scalar_type() && g.device() == like.device(),
                "flashgpt: ", name, " must match its input's shape, dtype and device");
    TORCH_CHECK(g.stride(-1) == 1 && g.stride(-2) == g.size(-1) && g.stride(-3) % 8 == 0 &&
                    reinterpret_cast<uintptr_t>(g.data_ptr()) % 16 == 0,
                "flashgpt: ", name, " needs contiguous heads in rows of a multiple of 8 elements, 16-byte aligned");
    TORCH_CHECK(g.dim() == 3 || g.size(0) == 1 || g.stride(0) == g.size(1) * g.stride(1),
                "flashgpt: ", name, "'s batches must be evenly strided rows");
}

// The backward; dq_out / dk_out / dv_out, when given, receive the gradients (views of one packed
// dqkv tensor: no concatenation afterwards) and are returned.
std::vector<at::Tensor> mha_bwd_into(at::Tensor dout, at::Tensor q, at::Tensor k, at::Tensor v,
                                     at::Tensor out, at::Tensor lse,
                                     c10::optional<at::Tensor> cu_seqlens_q,
                                     c10::optional<at::Tensor> cu_seqlens_k, int64_t max_seqlen_q,
                                     int64_t max_seqlen_k, double softmax_scale, bool causal,
                                     int64_t window_left, int64_t window_right,
                                     bool deterministic, c10::optional<at::Tensor> dq_out,
                                     c10::optional<at::Tensor> dk_out, c10::optional<at::Tensor> dv_out) {
    const bool varlen = cu_seqlens_q.has_value();
    check_cu(cu_seqlens_q, cu_seqlens_k);
    check_window(window_left, window_right);
    check_inputs(q, k, v, varlen);
    TORCH_CHECK(dout.sizes() == q.sizes() && out.sizes() == q.sizes(), "flashgpt: dout/out shape");
    TORCH_CHECK(dout.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
                "flashgpt: dout/out dtype");
    TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous(), "flashgpt: lse must be contiguous fp32");
    q = aligned(q); k = aligned(k); v = aligned(v); out = aligned(out); dout = aligned(dout);
    c10::cuda::CUDAGuard guard(q.device());

    const int64_t h = q.size(-2), h_k = k.size(-2), d = q.size(-1);
    TORCH_CHECK(dq_out.has_value() == dk_out.has_value() && dq_out.has_value() == dv_out.has_value(),
                "flashgpt: give all of dq_out, dk_out, dv_out or none");
    const bool into = dq_out.has_value();
    if (into) {
        check_grad_out(*dq_out, q, "dq_out");
        check_grad_out(*dk_out, k, "dk_out");
        check_grad_out(*dv_out, v, "dv_out");
    }
    at::Tensor dq = into ? *dq_out : at::empty(q.sizes(), q.options());
    // dK/dV per query head; summed over each group below when h_k < h (GQA/MQA).
    std::vector<int64_t> dk_shape(k.sizes().begin(), k.sizes().end());
    dk_shape[dk_shape.size() - 2] = h;
    const bool direct_kv = into && h_k == h;  // the kernels write dK / dV straight into the caller's views
    at::Tensor dk_exp = direct_kv ? *dk_out : at::empty(dk_shape, k.options());
    at::Tensor dv_exp = direct_kv ? *dv_out : at::empty(dk_shape, k.options());
    at::Tensor dsum = at::empty_like(lse);
    Flash_bwd_params params;
    fill_fwd_params(params, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    softmax_scale, causal, window_left, window_right);
    // fp32 dQ accumulator, zeroed by the pre-pass: row-major like q, or (the Hopper TMA backward)
    // whole query-block tiles (hopper/dq_tiles.h), which round each sequence up to a block.
    const int64_t row_floats = q.numel();
    const int64_t tiled_floats = flash::dq_tiles::supported(int(d)) ? flash::dq_tiles::floats_needed(params) : 0;
    // At most twice the row-major size (packed batches of many very short sequences: see dq_tiles.h).
    params.dq_accum_floats = tiled_floats <= 2 * row_floats ? std::max(row_floats, tiled_floats) : row_floats;
    params.dq_accum_tiled = false;
    at::Tensor dq_accum = at::empty({params.dq_accum_floats}, q.options().dtype(at::kFloat));
    const int b = params.b;
    at::Tensor sem;
    if (deterministic) {
        // One counter per (batch, head, query block); sized for the smallest query block (16 rows).
        sem = at::zeros({int64_t(b) * h * ((params.seqlen_q + 15) / 16)}, q.options().dtype(at::kInt));
    }
    params.do_ptr = dout.data_ptr();
    params.do_batch_stride = varlen ? 0 : dout.stride(0);
    params.do_row_stride = dout.stride(-3); params.do_head_stride = dout.stride(-2);
    params.dk_ptr = dk_exp.data_ptr(); params.dv_ptr = dv_exp.data_ptr();
    params.dk_batch_stride = varlen ? 0 : dk_exp.stride(0);
    params.dk_row_stride = dk_exp.stride(-3); params.dk_head_stride = dk_exp.stride(-2);
    params.dv_batch_stride = varlen ? 0 : dv_exp.stride(0);
    params.dv_row_stride = dv_exp.stride(-3); params.dv_head_stride = dv_exp.stride(-2);
    params.dq_ptr = dq.data_ptr();
    params.dq_out_row_stride = dq.stride(-3);
    params.dq_accum_ptr = dq_accum.data_ptr<float>();
    params.dsoftmax_sum_ptr = dsum.data_ptr<float>();
    params.dq_semaphore = deterministic ? sem.data_ptr<int>() : nullptr;
    params.deterministic = deterministic;

    cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
    FP16_SWITCH(q.scalar_type() == at::kBFloat16, [&] {
        run_bwd_preprocess<elem_type>(params, stream);
        HEADDIM_SWITCH(params.d, [&] {
            BOOL_SWITCH(causal, Is_causal, [&] { run_mha_bwd_<elem_type, kHeadDim, Is_causal>(params, stream); });
        });
        run_bwd_convert_dq<elem_type>(params, stream);
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();

    at::Tensor dk = dk_exp, dv = dv_exp;
    if (h_k != h) {
        // Sum the group's per-head gradients in fp32, then round once.
        auto grouped = dk_shape;
        grouped[grouped.size() - 2] = h_k;
        grouped.insert(grouped.end() - 1, h / h_k);
        dk = dk_exp.view(grouped).sum(-2, /*keepdim=*/false, at::kFloat).to(k.scalar_type());
        dv = dv_exp.view(grouped).sum(-2, false, at::kFloat).to(k.scalar_type());
        if (into) {
            dk = dk_out->copy_(dk);
            dv = dv_out->copy_(dv);
        }
    }
    (void)d;
    return {dq, dk, dv};
}

std::vector<at::Tensor> mha_bwd(at::Tensor dout, at::Tensor q, at::Tensor k, at::Tensor v,
                                at::Tensor out, at::Tensor lse,
                                c10::optional<at::Tensor> cu_seqlens_q,
                                c10::optional<at::Tensor> cu_seqlens_k, int64_t max_seqlen_q,
                                int64_t max_seqlen_k, double softmax_scale, bool causal,
                                int64_t window_left, int64_t window_right, bool deterministic) {
    return mha_bwd_into(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        softmax_scale, causal, window_left, window_right, deterministic, c10::nullopt,
                        c10::nullopt, c10::nullopt);
}

}  // namespace

void register_gelu_mlp(pybind11::module_ &m);  // mlp/gelu_mlp_api.cpp: the cuBLASLt GELU-epilogue GEMMs
void register_wgrad(pybind11::module_ &m);     // mlp/wgrad_api.cpp: weight gradients into fp32 (beta = 1)
void register_add_layer_norm(pybind11::module_ &m);  // norm/add_layer_norm_api.cpp: residual add + LayerNorm

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "flashgpt FlashAttention-2 kernels (forward, backward)";
    m.def("fwd", &mha_fwd, "FlashAttention-2 forward: returns [out, lse]");
    m.def("bwd", &mha_bwd, "FlashAttention-2 backward: returns [dq, dk, dv]");
    m.def("bwd_into", &mha_bwd_into, "the backward into given dq, dk, dv (views of a packed dqkv)");
    m.def("set_sm90_choice", &set_sm90_choice, "Hopper dispatch per shape class (kernels/tune_cache.py): "
          "pass 0/1, head dim 64/128, causal, seqlen bucket 0-3, choice -1 default / 0 FA2 / 1 Hopper "
          "(backward: 2 Hopper in lock-step / 3 Hopper in turns)");
    m.def("sm90_choice", &sm90_choice, "the Hopper dispatch choice of a shape class (-1 = default)");
    m.def("seqlen_bucket", &seqlen_bucket, "seqlen_k -> the dispatch bucket 0-3");
    register_gelu_mlp(m);
    register_wgrad(m);
    register_add_layer_norm(m);
}
