// One CUTLASS 3 (Hopper, TMA + wgmma, warp-specialized) GEMM with the GELU backward and the bias
// gradient in its epilogue: the template behind dgelu_gemm.h's variants (one .cu per variant, so the
// build compiles them in parallel).
//
// The product is run as its transpose, so that every row-major torch matrix is a column-major CUTLASS
// operand and b1's gradient is a per-row sum of the output (CUTLASS's LinCombDeEltActDePerRowBias):
//   D^T (h x M) = A (h x d) * B (d x M),  A = w2^T  (w2 (d, h) row-major = A column-major, ld h)
//                                        B = dy^T  (dy (M, d) row-major = B with K contiguous, ld d)
//   D^T column-major (ld h) = dpre (M, h) row-major; the aux input pre likewise.
//   epilogue per element: dpre = dGELU(acc, pre) = acc * gelu_tanh'(pre) (fp32), stored bf16;
//   db1[row] = sum over the row of the fp32 values (partial sums per tile in the workspace, the last
//   tile of a row block adds them up in order: deterministic, no atomics).
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/operations.hpp>
#include <cutlass/epilogue/thread/activation.h>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/kernel_hardware_info.h>

#include "mlp/dgelu_gemm_variants.h"

namespace flashgpt::dgelu {

using Bf16 = cutlass::bfloat16_t;
using ColMajor = cutlass::layout::ColumnMajor;

// TileShape: (rows of h, tokens, k) per CTA; Cluster: CTAs sharing operand loads (multicast).
// Bias: b1's gradient summed in the epilogue (else the caller sums dpre's columns).
template <class TileShape, class ClusterShape, class MainloopSchedule, class EpilogueSchedule, bool Bias>
struct Gemm {
    using WithBias = cutlass::epilogue::fusion::LinCombDeEltActDePerRowBias<
        ColMajor,                            // aux (pre) layout, as D's
        cutlass::epilogue::thread::dGELU,    // tanh-approximation GELU's derivative times the product
        Bf16,                                // D (dpre)
        float,                               // compute
        Bf16,                                // aux (pre)
        float,                               // bias gradient (fp32)
        void>;                               // no C operand (beta = 0)
    using NoBias = cutlass::epilogue::fusion::LinCombDeEltAct<ColMajor, cutlass::epilogue::thread::dGELU, Bf16,
                                                              float, Bf16, void>;
    using Fusion = std::conditional_t<Bias, WithBias, NoBias>;

    using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
        cutlass::epilogue::collective::EpilogueTileAuto, float, float,
        void, ColMajor, 8,                   // C: none
        Bf16, ColMajor, 8,                   // D
        EpilogueSchedule, Fusion>::CollectiveOp;

    using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
        Bf16, ColMajor, 8,                   // A = w2^T, h contiguous
        Bf16, ColMajor, 8,                   // B = dy^T, d (K) contiguous
        float, TileShape, ClusterShape,
        cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
        MainloopSchedule>::CollectiveOp;

    using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>;
    using Device = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

    static typename Device::Arguments arguments(const void *dy, const void *w2, const void *pre, void *dpre,
                                                float *db1, int64_t m, int64_t d, int64_t h) {
        const int M = static_cast<int>(h), N = static_cast<int>(m), K = static_cast<int>(d);
        using StrideA = typename Kernel::StrideA;
        using StrideB = typename Kernel::StrideB;
        using StrideD = typename Kernel::StrideD;
        StrideA stride_a = cute::make_stride(cute::Int<1>{}, h, int64_t(0));      // A(i, k) at i + k h
        StrideB stride_b = cute::make_stride(d, cute::Int<1>{}, int64_t(0));      // B(n, k) at n d + k
        StrideD stride_d = cute::make_stride(cute::Int<1>{}, h, int64_t(0));      // D(i, n) at i + n h

        cutlass::KernelHardwareInfo hw;
        cudaGetDevice(&hw.device_id);
        hw.sm_count = sm_count(hw.device_id);

        typename Device::Arguments args{
            cutlass::gemm::GemmUniversalMode::kGemm,
            {M, N, K, 1},
            {static_cast<const Bf16 *>(w2), stride_a, static_cast<const Bf16 *>(dy), stride_b},
            {{}, nullptr, stride_d, static_cast<Bf16 *>(dpre), stride_d},
            hw};
        auto &fusion = args.epilogue.thread;
        fusion.alpha = 1.0f;
        fusion.beta = 0.0f;
        fusion.aux_ptr = static_cast<const Bf16 *>(pre);
        fusion.dAux = stride_d;
        if constexpr (Bias) fusion.dbias_ptr = db1;
        return args;
    }

    static int sm_count(int device) {
        static int counts[64] = {0};  // per device; the query costs microseconds, not worth repeating
        if (device < 0 || device >= 64) return cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);
        if (counts[device] == 0) counts[device] = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);
        return counts[device];
    }

    static size_t workspace_bytes(int64_t m, int64_t d, int64_t h) {
        return Device::get_workspace_size(arguments(nullptr, nullptr, nullptr, nullptr, nullptr, m, d, h));
    }

    static cudaError_t run(const void *dy, const void *w2, const void *pre, void *dpre, float *db1, int64_t m,
                           int64_t d, int64_t h, void *workspace, cudaStream_t stream) {
        auto args = arguments(dy, w2, pre, dpre, db1, m, d, h);
        Device gemm;
        if (gemm.can_implement(args) != cutlass::Status::kSuccess) return cudaErrorNotSupported;
        if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess) return cudaErrorUnknown;
        if (gemm.run(stream) != cutlass::Status::kSuccess) {
            const cudaError_t err = cudaGetLastError();
            return err == cudaSuccess ? cudaErrorLaunchFailure : err;
        }
        return cudaGetLastError();
    }
};

// One variant's entry points (dgelu_gemm_variants.h), defined in its own .cu.
template <class G>
Variant make_variant(const char *name, bool bias) {
    return Variant{name, bias, &G::workspace_bytes, &G::run};
}

}  // namespace flashgpt::dgelu
