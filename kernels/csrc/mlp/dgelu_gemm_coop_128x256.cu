// dgelu_gemm variant coop_128x256: as coop_128x256_bias, b1's gradient summed by the caller (dgelu_gemm_kernel.cuh).
#ifndef NDEBUG
#define NDEBUG  // CUTLASS's asserts in the mainloop are calls that serialize wgmma (ptxas C7510)
#endif
#include "mlp/dgelu_gemm_variants.h"

#if defined(FLASHGPT_HAS_CUTLASS) && defined(FLASHGPT_HAS_SM90A)
#include "mlp/dgelu_gemm_kernel.cuh"

namespace flashgpt::dgelu {

Variant coop_128x256() {
    using G = Gemm<cute::Shape<cute::_128, cute::_256, cute::_64>, cute::Shape<cute::_2, cute::_1, cute::_1>, cutlass::gemm::KernelTmaWarpSpecializedCooperative, cutlass::epilogue::TmaWarpSpecializedCooperative, false>;
    return make_variant<G>("coop_128x256", false);
}

}  // namespace flashgpt::dgelu
#endif
