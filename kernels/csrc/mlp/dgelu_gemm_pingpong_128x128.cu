// dgelu_gemm variant pingpong_128x128: ping-pong schedule (the two consumer warpgroups take turns on 128 x 128 tiles), clusters of 2 CTAs along h, b1's gradient summed by the caller (dgelu_gemm_kernel.cuh).
#ifndef NDEBUG
#define NDEBUG  // CUTLASS's asserts in the mainloop are calls that serialize wgmma (ptxas C7510)
#endif
#include "mlp/dgelu_gemm_variants.h"

#if defined(FLASHGPT_HAS_CUTLASS) && defined(FLASHGPT_HAS_SM90A)
#include "mlp/dgelu_gemm_kernel.cuh"

namespace flashgpt::dgelu {

Variant pingpong_128x128() {
    using G = Gemm<cute::Shape<cute::_128, cute::_128, cute::_64>, cute::Shape<cute::_2, cute::_1, cute::_1>, cutlass::gemm::KernelTmaWarpSpecializedPingpong, cutlass::epilogue::TmaWarpSpecialized, false>;
    return make_variant<G>("pingpong_128x128", false);
}

}  // namespace flashgpt::dgelu
#endif
