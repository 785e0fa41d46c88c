// Dispatch of the fused dgelu GEMM's variants (dgelu_gemm.h); without CUTLASS or sm_90a code in the
// build there are none and the caller keeps the separate GEMM + gelu_backward_bias.
#include "mlp/dgelu_gemm.h"
#include "mlp/dgelu_gemm_variants.h"

namespace flashgpt {
namespace {

// The built variants, in index order (nullptr past the end).
const dgelu::Variant *variant_at(int i) {
#if defined(FLASHGPT_HAS_CUTLASS) && defined(FLASHGPT_HAS_SM90A)
    static const dgelu::Variant table[] = {dgelu::coop_128x256_bias(), dgelu::coop_128x256(), dgelu::pingpong_128x128()};
    constexpr int n = sizeof(table) / sizeof(table[0]);
    return i >= 0 && i < n ? &table[i] : nullptr;
#else
    (void)i;
    return nullptr;
#endif
}

}  // namespace

int dgelu_gemm_variants() {
    int n = 0;
    while (variant_at(n)) ++n;
    return n;
}

const char *dgelu_gemm_variant_name(int variant) {
    const auto *v = variant_at(variant);
    return v ? v->name : "";
}

bool dgelu_gemm_bias_in_epilogue(int variant) {
    const auto *v = variant_at(variant);
    return v && v->bias_in_epilogue;
}

size_t dgelu_gemm_workspace_bytes(int variant, int64_t m, int64_t d, int64_t h) {
    const auto *v = variant_at(variant);
    return v ? v->workspace(m, d, h) : 0;
}

cudaError_t dgelu_gemm(int variant, const void *dy, const void *w2, const void *pre, void *dpre, float *db1,
                       int64_t m, int64_t d, int64_t h, void *workspace, cudaStream_t stream) {
    const auto *v = variant_at(variant);
    if (!v) return cudaErrorInvalidValue;
    if (m > INT32_MAX || d > INT32_MAX || h > INT32_MAX) return cudaErrorNotSupported;
    return v->run(dy, w2, pre, dpre, db1, m, d, h, workspace, stream);
}

}  // namespace flashgpt
