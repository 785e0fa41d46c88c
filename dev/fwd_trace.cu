// Timeline of the Hopper TMA forward kernel (kernels/csrc/hopper/flash_fwd_sm90_ws.h), head dim 128,
// built with -DFLASHGPT_FWD_TRACE: (1) where the time of the whole grid goes -- each CTA's prologue
// (entry to Q and K_0 landed), main loop and epilogue (O stores), the idle time between CTAs on an
// SM, and the tail (SMs idle while the last CTAs run); (2) the SM clock at each phase of each key
// tile of one CTA, averaged over its steady tiles, per consumer warpgroup. Also the kernel's time
// (CUDA events, median of 20 groups of launches after 3 warm-up runs) and TFLOP/s (4 b h s^2 d, halved when causal).
// Inputs are random; the values do not change the timing. Build twice to see what tracing costs:
//   nvcc -std=c++17 -O3 --use_fast_math --expt-relaxed-constexpr -DFLASHGPT_HAS_SM90A \
//     -gencode arch=compute_90a,code=sm_90a [-DFLASHGPT_FWD_TRACE] -o /tmp/fwd_trace dev/fwd_trace.cu
//   /tmp/fwd_trace [causal=1] [seqlen=8192] [batch=2] [heads=16] [traced query block=seqlen/128-1]
//                  [persistent=0] [head dim=128 (or 64)] [launches per timed group=1 (10: GPU time)]
// persistent=1 launches the kernel as the extension does (one CTA per SM on a tile counter); the
// trace build then prints (0) instead: per tile of the first CTA, where each consumer warpgroup's
// time goes between one O store and the next (any head dim). Head dim 64 (192-row query blocks, three
// consumer warpgroups) is otherwise timed only.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <vector>
#include <cuda_bf16.h>
#include "trace_harness.h"
#include "../kernels/csrc/hopper/flash_fwd_sm90_ws.h"

using T = __nv_bfloat16;



int main(int argc, char **argv) {
    const bool causal = argc > 1 ? atoi(argv[1]) != 0 : true;
    const int s = argc > 2 ? atoi(argv[2]) : 8192, b = argc > 3 ? atoi(argv[3]) : 2, h = argc > 4 ? atoi(argv[4]) : 16;
    const int traced = argc > 5 ? atoi(argv[5]) : s / 128 - 1;
    const bool persistent = argc > 6 && atoi(argv[6]) != 0;
    const int d = argc > 7 && atoi(argv[7]) == 64 ? 64 : 128;
    const int per_group = argc > 8 ? std::max(1, atoi(argv[8])) : 1;  // launches per timed group
    const int64_t n = int64_t(b) * s * h * d, nrow = int64_t(b) * h * s;
    T *q, *k, *v, *o;
    float *lse;
    for (T **p : {&q, &k, &v, &o}) CK(cudaMalloc(p, n * sizeof(T)));
    CK(cudaMalloc(&lse, nrow * 4));
    fill_random<<<1024, 256>>>(q, n, 1); fill_random<<<1024, 256>>>(k, n, 2); fill_random<<<1024, 256>>>(v, n, 3);

    Flash_fwd_params p{};
    p.q_ptr = q; p.k_ptr = k; p.v_ptr = v; p.o_ptr = o; p.lse_ptr = lse;
    set_dense_params(p, b, s, h, d, causal);
    if (persistent) {  // zero once: every launch leaves it zero
        CK(cudaMalloc(&p.tile_counter, 2 * sizeof(int)));
        CK(cudaMemset(p.tile_counter, 0, 2 * sizeof(int)));
    }
#ifdef FLASHGPT_FWD_TRACE
    CK(cudaMemcpyToSymbol(flash::sm90::g_fwd_trace_block, &traced, sizeof(int)));
#endif

    auto run = [&] {
        bool ok = d == 64 ? (causal ? run_flash_fwd_sm90_ws<T, 64, true>(p, 0) : run_flash_fwd_sm90_ws<T, 64, false>(p, 0))
                          : (causal ? run_flash_fwd_sm90_ws<T, 128, true>(p, 0) : run_flash_fwd_sm90_ws<T, 128, false>(p, 0));
        if (!ok) { printf("the TMA forward declined\n"); exit(1); }
    };
    const float med = median_ms(run, per_group);
    const double flop = 4.0 * b * h * double(s) * s * d * (causal ? 0.5 : 1.0);
    printf("forward b=%d h=%d s=%d d=%d causal=%d persistent=%d: %.3f ms median, %.1f TFLOP/s\n", b, h, s, d,
           causal, int(persistent), med, flop / med * 1e-9);
    {  // checksum of O (compare builds: a schedule change must not change it)
        std::vector<uint16_t> ho(n);
        CK(cudaMemcpy(ho.data(), o, n * 2, cudaMemcpyDeviceToHost));
        double sum = 0;
        for (int64_t i = 0; i < n; ++i) {
            uint32_t bits = uint32_t(ho[i]) << 16;
            float f;
            memcpy(&f, &bits, 4);
            sum += f * double((i % 13) - 6);
        }
        printf("O checksum: weighted sum %.6e\n", sum);
    }
#ifdef FLASHGPT_FWD_TRACE
    if (persistent) {  // (0) the tiles of the first persistent CTA, one more run with a clean record
        static long long tc[256][3][8];
        memset(tc, 0, sizeof(tc));
        CK(cudaMemcpyToSymbol(flash::sm90::g_fwd_tile_clk, tc, sizeof(tc)));
        run();
        CK(cudaDeviceSynchronize());
        CK(cudaMemcpyFromSymbol(tc, flash::sm90::g_fwd_tile_clk, sizeof(tc)));
        const int nc = d == 64 ? flash::sm90::fwd_warpgroups_hd64() : 2;  // as the launcher chose
        int nt = 0;
        while (nt < 256 && tc[nt][0][0] != 0 && tc[nt][0][6] != 0) ++nt;
        const char *what[] = {"since the previous O store", "first key tile", "turn, first QK^T issued",
                              "first S, softmax", "steady steps", "last PV (turn, product)", "O staged, stored"};
        printf("CTA 0: %d tiles; mean SM clocks per tile (tiles 1..%d), per consumer warpgroup:\n", nt, nt - 1);
        for (int w = 0; w < nc; ++w) {
            double ph[7] = {0}, steps = 0, total = 0;
            for (int t = 1; t < nt; ++t) {
                ph[0] += tc[t][w][0] - tc[t - 1][w][6];
                for (int k = 1; k < 7; ++k) ph[k] += tc[t][w][k] - tc[t][w][k - 1];
                steps += (tc[t][w][7] >> 16) - (tc[t][w][7] & 0xffff);  // this warpgroup's key tiles
                total += tc[t][w][6] - tc[t - 1][w][6];
            }
            const double m = std::max(1, nt - 1);
            printf("warpgroup %d (%.2f key tiles per tile):", w + 1, steps / m);
            for (int k = 0; k < 7; ++k) printf(" %s %.0f;", what[k], ph[k] / m);
            printf(" tile %.0f; per steady step %.0f\n", total / m, steps > m ? ph[4] / (steps - m) : 0.0);
        }
        printf("tensor bound per key tile (CTA, %d x 64 rows, 4096 FLOP/clock): %.0f clocks\n", nc,
               nc * 2.0 * 2 * 64 * 128 * d / 4096);
        return 0;
    }
    if (d != 128) return 0;  // the timeline below assumes 128-row query blocks
    // (1) the grid: the last run's per-CTA records.
    const int nblk = (s + 127) / 128, ncta = std::min(65536, nblk * b * h);
    static long long clk[65536][8];
    static unsigned long long ns[65536][2];
    static int sm[65536];
    CK(cudaMemcpyFromSymbol(clk, flash::sm90::g_fwd_cta_clk, sizeof(clk)));
    CK(cudaMemcpyFromSymbol(ns, flash::sm90::g_fwd_cta_ns, sizeof(ns)));
    CK(cudaMemcpyFromSymbol(sm, flash::sm90::g_fwd_cta_sm, sizeof(sm)));
    double pro = 0, loop = 0, epi = 0, life = 0;
    std::map<int, std::vector<int>> by_sm;
    unsigned long long t0 = ~0ull, t1 = 0;
    for (int c = 0; c < ncta; ++c) {
        const long long end = std::max(clk[c][3], clk[c][5]), loop_end = std::max(clk[c][2], clk[c][4]);
        pro += clk[c][1] - clk[c][0];
        loop += loop_end - clk[c][1];
        epi += end - loop_end;
        life += end - clk[c][0];
        by_sm[sm[c]].push_back(c);
        t0 = std::min(t0, ns[c][0]);
        t1 = std::max(t1, ns[c][1]);
    }
    double gaps = 0, first_idle = 1e30;
    int ngaps = 0;
    for (auto &[id, cs] : by_sm) {
        std::sort(cs.begin(), cs.end(), [&](int a, int c) { return clk[a][0] < clk[c][0]; });
        for (size_t i = 1; i < cs.size(); ++i) {
            gaps += clk[cs[i]][0] - std::max(clk[cs[i - 1]][3], clk[cs[i - 1]][5]);
            ++ngaps;
        }
        first_idle = std::min(first_idle, double(ns[cs.back()][1] - t0));
    }
    const double clk_per_ns = life / 1.0 / [&] {
        double tot = 0;
        for (int c = 0; c < ncta; ++c) tot += double(ns[c][1] - ns[c][0]);
        return tot;
    }();
    printf("grid: %d CTAs on %zu SMs, span %.1f us (traced run), SM clock ~%.2f GHz\n", ncta, by_sm.size(),
           (t1 - t0) * 1e-3, clk_per_ns);
    printf("  per CTA (mean clocks): prologue %.0f, loop %.0f, epilogue %.0f; gap between CTAs on an SM %.0f\n",
           pro / ncta, loop / ncta, epi / ncta, ngaps ? gaps / ngaps : 0.0);
    printf("  shares of CTA time: prologue %.1f%%, loop %.1f%%, epilogue %.1f%%; gaps %.1f%% of SM time\n",
           100 * pro / life, 100 * loop / life, 100 * epi / life, 100 * gaps / (life + gaps));
    printf("  tail: the first SM goes idle at %.1f us of %.1f us\n", first_idle * 1e-3, (t1 - t0) * 1e-3);
    const double tile_flop = 2.0 * 2 * 128 * 128 * d;  // the CTA's QK^T and PV per key tile
    double tiles = 0;
    for (int m = 0; m < nblk; ++m) tiles += causal ? m + 1 : nblk;
    tiles *= b * h;
    printf("  loop clocks per key tile %.0f (tensor bound %.0f at 4096 FLOP/clock)\n", loop / tiles,
           tile_flop / 4096);

    // (2) one CTA's steps.
    static uint32_t tr[2][1024][8];
    CK(cudaMemcpyFromSymbol(tr, flash::sm90::g_fwd_trace, sizeof(tr)));
    const int steps = std::min(1024, causal ? traced + 1 : nblk);
    const char *what[] = {"wait K_it / V_it-1", "wait turn", "issue QK, PV", "wait S", "softmax", "wait PV",
                          "rescale O, pack P"};
    const int lo = 4, hi = steps - 2;
    if (hi > lo) {
        printf("traced CTA: query block %d, %d key tiles; averages over tiles %d..%d (SM clocks)\n", traced, steps,
               lo, hi - 1);
        for (int w = 0; w < 2; ++w) {
            printf("warpgroup %d:\n", w + 1);
            for (int ph = 0; ph < 7; ++ph) {
                double acc = 0;
                for (int it = lo; it < hi; ++it) acc += double(tr[w][it][ph + 1] - tr[w][it][ph]);
                printf("  %-24s %7.0f\n", what[ph], acc / (hi - lo));
            }
            double step = 0;
            for (int it = lo; it < hi; ++it) step += double(tr[w][it + 1][0] - tr[w][it][0]);
            step /= (hi - lo);
            printf("  %-24s %7.0f (tensor pipe busy %.0f%%)\n", "tile (start to next)", step,
                   100.0 * tile_flop / 4096 / step);
        }
    }
#endif
    return 0;
}
