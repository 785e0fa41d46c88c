// Timeline of the Hopper TMA backward kernel (kernels/csrc/hopper/flash_bwd_sm90_ws.h), head dim 128:
// the SM clock at each phase point of each step of one CTA (kernel built with -DFLASHGPT_BWD_TRACE),
// averaged over the steady-state steps, per consumer warpgroup and for the dQ warp. Also the
// kernel's time (CUDA events, median of 20 after 3 warm-up runs) and TFLOP/s of the backward alone
// (2.5 x the forward's 4 b h s^2 d, halved when causal). Inputs are random; the values do not change
// the timing. Build twice to see what the tracing itself costs:
//   nvcc -std=c++17 -O3 --use_fast_math --expt-relaxed-constexpr -DFLASHGPT_HAS_SM90A -lineinfo \
//     -gencode arch=compute_90a,code=sm_90a [-DFLASHGPT_BWD_TRACE] -o /tmp/bwd_trace dev/bwd_trace.cu \
//     kernels/csrc/hopper/dispatch.cu        # (the backward's schedule consults the dispatch table)
//   /tmp/bwd_trace [causal=1] [seqlen=8192] [batch=2] [heads=16] [traced key block=0] [schedule=-1]
// schedule: the dispatch table's backward choice for this shape class: -1 the built-in rule (turns from
// 1024 queries), 2 the warpgroups in lock-step, 3 in turns.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_bf16.h>
#include "trace_harness.h"
#include "../kernels/csrc/hopper/flash_bwd_sm90_ws.h"

using T = __nv_bfloat16;

__global__ void fill_const(float *x, int64_t n, float v) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) x[i] = v;
}

int main(int argc, char **argv) {
    const bool causal = argc > 1 ? atoi(argv[1]) != 0 : true;
    const int s = argc > 2 ? atoi(argv[2]) : 8192, b = argc > 3 ? atoi(argv[3]) : 2, h = argc > 4 ? atoi(argv[4]) : 16;
    const int traced = argc > 5 ? atoi(argv[5]) : 0, d = 128;
    const int schedule = argc > 6 ? atoi(argv[6]) : -1;
    set_sm90_choice(1, d, causal, seqlen_bucket(s), schedule);  // hopper/dispatch.h pingpong_backward reads it
    if (s % 64 != 0) { printf("seqlen must be a multiple of 64 (the accumulator is sized as dense rows)\n"); return 1; }
    const int64_t n = int64_t(b) * s * h * d, nrow = int64_t(b) * h * s;
    T *q, *k, *v, *dO, *dk, *dv;
    float *lse, *dsum, *dq;
    for (T **p : {&q, &k, &v, &dO, &dk, &dv}) CK(cudaMalloc(p, n * sizeof(T)));
    CK(cudaMalloc(&lse, nrow * 4)); CK(cudaMalloc(&dsum, nrow * 4)); CK(cudaMalloc(&dq, n * 4));
    fill_random<<<1024, 256>>>(q, n, 1); fill_random<<<1024, 256>>>(k, n, 2);
    fill_random<<<1024, 256>>>(v, n, 3); fill_random<<<1024, 256>>>(dO, n, 4);
    fill_const<<<1024, 256>>>(lse, nrow, 6.f); fill_const<<<1024, 256>>>(dsum, nrow, 0.01f);
    CK(cudaMemset(dq, 0, n * 4));

    Flash_bwd_params p{};
    p.q_ptr = q; p.k_ptr = k; p.v_ptr = v; p.do_ptr = dO; p.dk_ptr = dk; p.dv_ptr = dv;
    p.lse_ptr = lse; p.dsoftmax_sum_ptr = dsum; p.dq_accum_ptr = dq;
    p.dq_accum_floats = n;  // = the tiled size when s % 64 == 0 (dq_tiles.h)
    set_dense_params(p, b, s, h, d, causal);
    const int64_t rs = int64_t(h) * d, bs = int64_t(s) * rs;
    p.do_batch_stride = p.dk_batch_stride = p.dv_batch_stride = bs;
    p.do_row_stride = p.dk_row_stride = p.dv_row_stride = rs;
    p.do_head_stride = p.dk_head_stride = p.dv_head_stride = d;
    p.deterministic = false;
#ifdef FLASHGPT_BWD_TRACE
    CK(cudaMemcpyToSymbol(flash::sm90::g_bwd_trace_block, &traced, sizeof(int)));
#endif

    auto run = [&] {
        bool ok = causal ? run_flash_bwd_sm90_ws<T, 128, true>(p, 0) : run_flash_bwd_sm90_ws<T, 128, false>(p, 0);
        if (!ok) { printf("the TMA backward declined (TMA rule or accumulator size)\n"); exit(1); }
    };
    const float med = median_ms(run);
    const double flop = 2.5 * 4.0 * b * h * double(s) * s * d * (causal ? 0.5 : 1.0);
    printf("backward b=%d h=%d s=%d d=%d causal=%d: %.3f ms median, %.1f TFLOP/s\n", b, h, s, d, causal, med,
           flop / med * 1e-9);
    {  // checksum of one run's dQ accumulator (compare builds: the dQ path must not change it)
        CK(cudaMemset(dq, 0, n * 4));
        run();
        std::vector<float> hq(n);
        CK(cudaMemcpy(hq.data(), dq, n * 4, cudaMemcpyDeviceToHost));
        double sum = 0, sabs = 0;
        for (int64_t i = 0; i < n; ++i) { sum += hq[i] * double((i % 13) - 6); sabs += fabs(hq[i]); }
        printf("dq_accum checksum: weighted sum %.6e, sum |.| %.6e\n", sum, sabs);
    }
#ifdef FLASHGPT_BWD_TRACE
    static uint32_t tr[3][512][12];
    CK(cudaMemcpyFromSymbol(tr, flash::sm90::g_bwd_trace, sizeof(tr)));
    const int steps = causal ? std::min(512, (s - traced * 128) / 64) : std::min(512, s / 64);
    // Phase order of a consumer step and what each interval is.
    const int order[] = {0, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8};
    const char *what[] = {"wait Q/dO/LSE/D", "S^T latency (issue S^T, dP^T; wait S^T)", "exp -> P^T",
                          "pack P^T, issue dV", "wait dP^T", "dS^T, issue dK", "store dS^T + fence",
                          "named barrier (pingpong: other's dS^T in)", "issue dQ, wait dV/dK/dQ", "stage dQ (wait dq_empty)"};
    const int lo = 4, hi = steps - 2;
    printf("traced CTA: key block %d, %d steps; averages over steps %d..%d (SM clocks)\n", traced, steps, lo, hi - 1);
    const double step_flop = 5.0 * 2 * 128 * 64 * 128;  // the CTA's 5 products per step
    for (int w = 0; w < 2; ++w) {
        printf("warpgroup %d:\n", w + 1);
        double total = 0;
        for (int ph = 0; ph < 10; ++ph) {
            double acc = 0;
            for (int it = lo; it < hi; ++it) acc += double(tr[w][it][order[ph + 1]] - tr[w][it][order[ph]]);
            acc /= (hi - lo);
            total += acc;
            printf("  %-44s %7.0f\n", what[ph], acc);
        }
        double loop = 0;
        for (int it = lo; it < hi; ++it) loop += double(tr[w][it + 1][0] - tr[w][it][8]);
        loop /= (hi - lo);
        double step = 0;
        for (int it = lo; it < hi; ++it) step += double(tr[w][it + 1][0] - tr[w][it][0]);
        step /= (hi - lo);
        printf("  %-44s %7.0f\n  %-44s %7.0f (tensor pipe busy %.0f%% at 4096 FLOP/clock)\n", "loop back", loop,
               "step (start to next start)", step, 100.0 * step_flop / 4096 / step);
    }
    double skew = 0;
    for (int it = lo; it < hi; ++it) skew += double(int32_t(tr[1][it][10] - tr[0][it][10]));
    printf("S^T landed, warpgroup 2 minus 1: %.0f clocks\n", skew / (hi - lo));
    double qwait = 0, rd = 0;
    for (int it = lo; it < hi; ++it) {
        qwait += double(tr[2][it][1] - tr[2][it][0]);
        rd += double(tr[2][it][2] - tr[2][it][1]);
    }
    printf("dQ warp: waits %.0f for the staged dQ, bulk read %.0f clocks per step\n", qwait / (hi - lo), rd / (hi - lo));
    double total_cyc = double(tr[0][steps - 1][8] - tr[0][0][0]);
    printf("traced CTA: %.0f clocks over %d steps (%.0f per step incl. ramp)\n", total_cyc, steps, total_cyc / steps);
#endif
    return 0;
}
