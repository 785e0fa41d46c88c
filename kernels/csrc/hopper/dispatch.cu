// Storage of the per-shape-class Hopper dispatch choices (declared in flash.h, read by
// hopper/dispatch.h, written through the binding by kernels/tune_cache.py), and the dispatch questions the
// binding (a .cpp, which cannot include the CUDA headers) asks. One definition for the whole
// extension; host code only.
#include <stdexcept>
#include "../flash.h"
#include "dispatch.h"

namespace {
constexpr int kPasses = 2, kDims = 2, kCausal = 2, kBuckets = 4;
// -1 everywhere: the built-in defaults until a tuning cache says otherwise.
signed char g_choice[kPasses][kDims][kCausal][kBuckets] = {
    {{{-1, -1, -1, -1}, {-1, -1, -1, -1}}, {{-1, -1, -1, -1}, {-1, -1, -1, -1}}},
    {{{-1, -1, -1, -1}, {-1, -1, -1, -1}}, {{-1, -1, -1, -1}, {-1, -1, -1, -1}}}};

signed char &slot(int pass, int head_dim, bool causal, int bucket) {
    if (pass < 0 || pass >= kPasses || (head_dim != 64 && head_dim != 128) || bucket < 0 || bucket >= kBuckets) {
        throw std::invalid_argument("flashgpt: Hopper dispatch entry out of range (pass 0/1, head dim 64/128, "
                                    "bucket 0-3)");
    }
    return g_choice[pass][head_dim == 128][causal ? 1 : 0][bucket];
}
}  // namespace

int seqlen_bucket(int seqlen_k) {
    return seqlen_k <= 1024 ? 0 : seqlen_k <= 2048 ? 1 : seqlen_k <= 4096 ? 2 : 3;
}

void set_sm90_choice(int pass, int head_dim, bool causal, int bucket, int choice) {
    if (choice < -1 || choice > (pass == 1 ? 3 : 1)) {
        throw std::invalid_argument("flashgpt: Hopper dispatch choice must be -1 (default), 0 (FA2) or 1 (Hopper); "
                                    "the backward also 2 or 3 (Hopper, warpgroups in lock-step or taking turns)");
    }
    slot(pass, head_dim, causal, bucket) = static_cast<signed char>(choice);
}

int sm90_choice(int pass, int head_dim, bool causal, int bucket) { return slot(pass, head_dim, causal, bucket); }

bool fwd_needs_tile_counter(int head_dim, bool causal, int seqlen_k) {
    return flash::sm90::use(flash::sm90::kFwd, head_dim, causal, seqlen_k);
}
