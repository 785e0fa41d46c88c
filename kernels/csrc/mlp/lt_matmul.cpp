// cuBLASLt matmul with an epilogue: descriptors per call (microseconds), the heuristic's algorithm
// cached per problem (the heuristic itself costs tens of microseconds).
#include "mlp/lt_matmul.h"

#include <cstring>
#include <map>
#include <mutex>
#include <tuple>

namespace flashgpt {
namespace lt {
namespace {

#define LT_TRY(call)                                                                            \
    do {                                                                                        \
        cublasStatus_t status_ = (call);                                                        \
        if (status_ != CUBLAS_STATUS_SUCCESS)                                                   \
            return std::string(#call) + " failed: cuBLAS status " + std::to_string((int)status_); \
    } while (0)

// Owns the descriptors of one call.
struct Descriptors {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
    cublasLtMatmulPreference_t pref = nullptr;
    ~Descriptors() {
        if (pref) cublasLtMatmulPreferenceDestroy(pref);
        if (d) cublasLtMatrixLayoutDestroy(d);
        if (b) cublasLtMatrixLayoutDestroy(b);
        if (a) cublasLtMatrixLayoutDestroy(a);
        if (op) cublasLtMatmulDescDestroy(op);
    }
};

// The largest power of two (up to 256 bytes) dividing every pointer: the heuristic's kernels
// depend on it, so it is part of the cache key.
int alignment(const Matmul &mm) {
    uintptr_t bits = 256;
    for (const void *p : {mm.a, (const void *)mm.b, (const void *)mm.d, (const void *)mm.bias,
                          (const void *)mm.aux}) {
        if (p) bits |= reinterpret_cast<uintptr_t>(p);
    }
    return static_cast<int>(bits & (~bits + 1));
}

using Key = std::tuple<int64_t, int64_t, int64_t, bool, bool, int64_t, int64_t, int64_t, int, int, int64_t,
                       bool, int, size_t, int, bool>;

Key key_of(const Matmul &mm, size_t workspace_bytes) {
    int device = 0;
    cudaGetDevice(&device);
    return Key(mm.m, mm.n, mm.k, mm.trans_a, mm.trans_b, mm.lda, mm.ldb, mm.ldd, (int)mm.dtype,
               (int)mm.epilogue, mm.ld_aux, mm.bias != nullptr, alignment(mm), workspace_bytes, device,
               mm.accumulate_fp32);
}

std::mutex g_mutex;
std::map<Key, cublasLtMatmulAlgo_t> g_algos;

}  // namespace

std::string run(cublasLtHandle_t handle, const Matmul &mm, void *workspace, size_t workspace_bytes,
                cudaStream_t stream) {
    Descriptors desc;
    LT_TRY(cublasLtMatmulDescCreate(&desc.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t ta = mm.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t tb = mm.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    LT_TRY(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
    LT_TRY(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
    LT_TRY(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &mm.epilogue,
                                          sizeof(mm.epilogue)));
    if (mm.bias) {
        LT_TRY(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &mm.bias,
                                              sizeof(mm.bias)));
    }
    if (mm.aux) {
        LT_TRY(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &mm.aux,
                                              sizeof(mm.aux)));
        LT_TRY(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &mm.ld_aux,
                                              sizeof(mm.ld_aux)));
    }
    LT_TRY(cublasLtMatrixLayoutCreate(&desc.a, mm.dtype, mm.trans_a ? mm.k : mm.m, mm.trans_a ? mm.m : mm.k,
                                      mm.lda));
    LT_TRY(cublasLtMatrixLayoutCreate(&desc.b, mm.dtype, mm.trans_b ? mm.n : mm.k, mm.trans_b ? mm.k : mm.n,
                                      mm.ldb));
    LT_TRY(cublasLtMatrixLayoutCreate(&desc.d, mm.accumulate_fp32 ? CUDA_R_32F : mm.dtype, mm.m, mm.n,
                                      mm.ldd));

    const Key key = key_of(mm, workspace_bytes);
    cublasLtMatmulAlgo_t algo;
    bool cached = false;
    {
        std::lock_guard<std::mutex> lock(g_mutex);
        auto it = g_algos.find(key);
        if (it != g_algos.end()) {
            algo = it->second;
            cached = true;
        }
    }
    const float alpha = 1.0f, beta = mm.accumulate_fp32 ? 1.0f : 0.0f;
    if (!cached) {
        LT_TRY(cublasLtMatmulPreferenceCreate(&desc.pref));
        LT_TRY(cublasLtMatmulPreferenceSetAttribute(desc.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                    &workspace_bytes, sizeof(workspace_bytes)));
        // The heuristic assumes 256-byte aligned pointers unless told: tell it what these are.
        const uint32_t align = static_cast<uint32_t>(alignment(mm));
        for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
            LT_TRY(cublasLtMatmulPreferenceSetAttribute(desc.pref, attr, &align, sizeof(align)));
        }
        cublasLtMatmulHeuristicResult_t result;
        std::memset(&result, 0, sizeof(result));
        int found = 0;
        LT_TRY(cublasLtMatmulAlgoGetHeuristic(handle, desc.op, desc.a, desc.b, desc.d, desc.d, desc.pref, 1,
                                              &result, &found));
        if (found == 0) {
            return "cuBLASLt has no algorithm for this matmul (m " + std::to_string(mm.m) + ", n " +
                   std::to_string(mm.n) + ", k " + std::to_string(mm.k) + ", epilogue " +
                   std::to_string((int)mm.epilogue) + ")";
        }
        algo = result.algo;
        std::lock_guard<std::mutex> lock(g_mutex);
        g_algos.emplace(key, algo);
    }
    LT_TRY(cublasLtMatmul(handle, desc.op, &alpha, mm.a, desc.a, mm.b, desc.b, &beta, mm.d, desc.d, mm.d,
                          desc.d, &algo, workspace, workspace_bytes, stream));
    return "";
}

}  // namespace lt
}  // namespace flashgpt
