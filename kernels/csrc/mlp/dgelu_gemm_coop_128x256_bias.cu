// dgelu_gemm variant coop_128x256_bias: cooperative schedule (both consumer warpgroups on one 128 x 256 tile of h x tokens), clusters of 2 CTAs along h sharing dy's tiles, b1's gradient in the epilogue (dgelu_gemm_kernel.cuh).
#ifndef NDEBUG
#define NDEBUG  // CUTLASS's asserts in the mainloop are calls that serialize wgmma (ptxas C7510)
#endif
#include "mlp/dgelu_gemm_variants.h"

#if defined(FLASHGPT_HAS_CUTLASS) && defined(FLASHGPT_HAS_SM90A)
#include "mlp/dgelu_gemm_kernel.cuh"

namespace flashgpt::dgelu {

Variant coop_128x256_bias() {
    using G = Gemm<cute::Shape<cute::_128, cute::_256, cute::_64>, cute::Shape<cute::_2, cute::_1, cute::_1>, cutlass::gemm::KernelTmaWarpSpecializedCooperative, cutlass::epilogue::TmaWarpSpecializedCooperative, true>;
    return make_variant<G>("coop_128x256_bias", true);
}

}  // namespace flashgpt::dgelu
#endif
