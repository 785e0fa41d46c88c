// Which cuBLASLt algorithm is fastest for the training step's GEMMs *at the board's power limit*?
//
// A training step holds an H100 at its 700 W limit, where the SM clock falls to ~1.5 GHz and a GEMM's
// speed follows its energy per FLOP (bench/RESULTS.md, sessions 10 and 21). cuBLASLt's heuristic ranks
// its candidates for full clock, and kernels/csrc/mlp/lt_matmul.cpp times them cold. This program
// times every candidate of each step GEMM held under load: for each problem it first heats the board
// (4 s of the heuristic's pick), then runs each candidate for a window of `kWindowS` seconds, back to
// back, twice (candidates in order, then reversed, so none always follows a hotter or cooler one), and
// reports the median window's TFLOP/s, board power (NVML energy counter difference / wall time), SM
// clock and joules per PFLOP. cuBLAS's own cublasGemmEx (what torch's mm calls) is one candidate.
//
// What it found and what that was worth (bench/RESULTS.md, session 22): on an H100 at 2.7B shapes the
// heuristic's pick (320x128 tiles) held 661-705 TFLOP/s and another candidate 1-6.5% more for four of the
// twelve problems (FLOP-weighted +1.7%). Taken into the step (every product through cuBLASLt, its
// candidates timed *inside* the step and the best median kept) that was worth nothing: 659 / 661 vs 669 /
// 660 TFLOP/s with the algorithms picked cold, in both orders, and the same energy per token (25.3-25.4 mJ).
// A kernel's time in its own slot is not the step's objective at the power limit: energy per FLOP is,
// and the windows' power readings (NVML's energy counter over 0.25 s) are too coarse to rank by it.
//
// Problems are in cuBLAS's column-major terms (m, n, k, op(A), op(B)); the comment names the torch
// product: forward y = x w^T, input gradient dx = dy w, weight gradient dw += dy^T x (fp32 .grad,
// beta = 1, as kernels/wgrad.py). Operands are random normal bf16 (power depends on the bits toggled:
// zeros would flatter every candidate).
//
// Build and run on the GPU machine (cuBLASLt from the CUDA wheel torch ships with):
//   NV=$(python3 -c "import nvidia;print(nvidia.__path__[0])")/cu13
//   nvcc -std=c++17 -O3 -arch=sm_90 -I$NV/include -L$NV/lib -o /tmp/gemm_sustained bench/gemm_sustained.cu \
//        -l:libcublasLt.so.13 -l:libcublas.so.13 -ldl && \
//   LD_LIBRARY_PATH=$NV/lib /tmp/gemm_sustained [2.7b|1.3b] [window_s] [max_candidates] [tokens]
// tokens: rows per micro-batch (default: 2.7b 16384 = micro-batch 2, 1.3b 24576 = micro-batch 3, the
// shipped configs). The forward products carry the step's epilogues (bias; the MLP's first projection
// GELU_AUX_BIAS, as kernels/gelu_mlp.py runs it).
//
// At micro-batch 2 (session 25) the best candidates were worth 1.004x what the step runs, FLOP-weighted
// (1.017x at micro-batch 1, session 22): at the step's larger shapes cuBLAS's own picks are within
// ~2% of the best for every problem, and the GELU epilogue's product runs ~14% below a plain bias
// GEMM of its shape (bench/gelu_gemm_sustained.py).
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#define CK(x)                                                                        \
    do {                                                                             \
        auto e_ = (x);                                                               \
        if ((int)e_ != 0) {                                                          \
            std::fprintf(stderr, "%s failed (%d) at line %d\n", #x, (int)e_, __LINE__); \
            std::exit(1);                                                            \
        }                                                                            \
    } while (0)

// --- NVML through dlopen (the driver ships it; no header needed) ---
struct Nvml {
    void *lib = nullptr, *dev = nullptr;
    int (*energy)(void *, unsigned long long *) = nullptr;  // millijoules since driver load
    int (*clock)(void *, int, unsigned *) = nullptr;        // MHz; type 1 = SM
    bool open() {
        lib = dlopen("libnvidia-ml.so.1", RTLD_NOW);
        if (!lib) return false;
        auto init = (int (*)())dlsym(lib, "nvmlInit_v2");
        auto handle = (int (*)(unsigned, void **))dlsym(lib, "nvmlDeviceGetHandleByIndex_v2");
        energy = (int (*)(void *, unsigned long long *))dlsym(lib, "nvmlDeviceGetTotalEnergyConsumption");
        clock = (int (*)(void *, int, unsigned *))dlsym(lib, "nvmlDeviceGetClockInfo");
        return init && handle && energy && clock && init() == 0 && handle(0, &dev) == 0;
    }
    double joules() {
        unsigned long long mj = 0;
        energy(dev, &mj);
        return mj * 1e-3;
    }
    unsigned sm_mhz() {
        unsigned v = 0;
        clock(dev, 1, &v);
        return v;
    }
};

struct Problem {
    const char *name;
    int64_t m, n, k;
    bool ta, tb, accumulate;  // accumulate: D fp32, beta = 1
    cublasLtEpilogue_t epilogue;  // as the trainer runs it (kernels/lt_gemm.py, kernels/gelu_mlp.py)
    bool on_lt;                   // the step runs it through cuBLASLt (no cublasGemmEx candidate)
};

__global__ void fill_normal(__nv_bfloat16 *p, size_t n, uint32_t seed, float scale) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        // two hashes -> Box-Muller
        uint32_t h1 = (uint32_t)i * 2654435761u ^ seed, h2 = (uint32_t)(i >> 32) * 40503u + (uint32_t)i * 2246822519u + seed;
        h1 ^= h1 >> 15; h1 *= 2246822519u; h1 ^= h1 >> 13; h1 *= 3266489917u; h1 ^= h1 >> 16;
        h2 ^= h2 >> 15; h2 *= 2654435761u; h2 ^= h2 >> 13; h2 *= 2246822519u; h2 ^= h2 >> 16;
        float u1 = (h1 + 1.0f) * 2.3283064e-10f, u2 = h2 * 2.3283064e-10f;
        p[i] = __float2bfloat16(scale * sqrtf(-2.f * logf(u1)) * cosf(6.2831853f * u2));
    }
}

struct Candidate {
    std::string name;
    bool gemm_ex = false;  // cublasGemmEx (torch's mm) instead of a cuBLASLt algorithm
    cublasLtMatmulAlgo_t algo{};
    std::vector<double> tflops, watts, mhz, j_per_pflop;
};

std::string describe(const cublasLtMatmulAlgo_t &algo, int rank) {
    int id = 0, tile = 0, stages = 0, cluster = 0, splitk = 0, swizzle = 0, custom = 0;
    size_t w = 0;
    cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof(id), &w);
    cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile), &w);
    cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof(stages), &w);
    cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster, sizeof(cluster), &w);
    cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof(splitk), &w);
    cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &swizzle, sizeof(swizzle), &w);
    cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, &custom, sizeof(custom), &w);
    char buf[160];
    std::snprintf(buf, sizeof(buf), "h%d id%d tile%d st%d cl%d sk%d sw%d c%d", rank, id, tile, stages, cluster,
                  splitk, swizzle, custom);
    return buf;
}

int main(int argc, char **argv) {
    const std::string model = argc > 1 ? argv[1] : "2.7b";
    const double window_s = argc > 2 ? std::atof(argv[2]) : 0.3;
    const int max_candidates = argc > 3 ? std::atoi(argv[3]) : 12;
    int64_t T, d, f;  // tokens per micro-batch, width, MLP width
    if (model == "1.3b") {
        T = 3 * 8192, d = 2048, f = 8192;
    } else {
        T = 2 * 8192, d = 2560, f = 10240;
    }
    if (argc > 4 && std::atoll(argv[4]) > 0) T = std::atoll(argv[4]);
    const auto B = CUBLASLT_EPILOGUE_BIAS, G = CUBLASLT_EPILOGUE_GELU_AUX_BIAS, N = CUBLASLT_EPILOGUE_DEFAULT;
    const std::vector<Problem> problems = {
        {"fwd qkv   y=x w^T+b", 3 * d, T, d, true, false, false, B, false},
        {"fwd out   y=x w^T+b", d, T, d, true, false, false, B, false},
        {"fwd fc1   g=gelu(x w^T+b)", f, T, d, true, false, false, G, true},
        {"fwd fc2   y=x w^T+b", d, T, f, true, false, false, B, false},
        {"dx  qkv   dx=dy w", d, T, 3 * d, false, false, false, N, false},
        {"dx  out   dx=dy w", d, T, d, false, false, false, N, false},
        {"dx  fc1   dx=dy w", d, T, f, false, false, false, N, false},
        {"dx  fc2   dx=dy w", f, T, d, false, false, false, N, false},
        {"dw  qkv   dw+=dy^T x", d, 3 * d, T, false, true, true, N, true},
        {"dw  out   dw+=dy^T x", d, d, T, false, true, true, N, true},
        {"dw  fc1   dw+=dy^T x", d, f, T, false, true, true, N, true},
        {"dw  fc2   dw+=dy^T x", f, d, T, false, true, true, N, true},
    };

    Nvml nvml;
    if (!nvml.open()) {
        std::fprintf(stderr, "NVML not available: power and energy need the NVIDIA driver\n");
        return 1;
    }
    cublasLtHandle_t lt;
    cublasHandle_t blas;
    CK(cublasLtCreate(&lt));
    CK(cublasCreate(&blas));
    cudaStream_t stream;
    CK(cudaStreamCreate(&stream));
    CK(cublasSetStream(blas, stream));
    const size_t ws_bytes = 32 << 20;
    void *ws;
    CK(cudaMalloc(&ws, ws_bytes));
    CK(cublasSetWorkspace(blas, ws, ws_bytes));

    size_t max_ab = 0, max_d = 0;
    for (auto &p : problems) {
        max_ab = std::max<size_t>(max_ab, std::max(p.m * p.k, p.k * p.n));
        max_d = std::max<size_t>(max_d, p.m * p.n);
    }
    __nv_bfloat16 *A, *Bm, *bias, *aux;
    void *D;
    CK(cudaMalloc(&A, max_ab * 2));
    CK(cudaMalloc(&Bm, max_ab * 2));
    CK(cudaMalloc(&D, max_d * 4));
    CK(cudaMalloc(&aux, max_d * 2));
    CK(cudaMalloc(&bias, 4 * f * 2));
    fill_normal<<<1024, 256>>>(A, max_ab, 1234u, 1.0f);
    fill_normal<<<1024, 256>>>(Bm, max_ab, 98765u, 1.0f);
    fill_normal<<<64, 256>>>(bias, 4 * f, 555u, 1.0f);
    CK(cudaMemset(D, 0, max_d * 4));
    CK(cudaDeviceSynchronize());

    std::printf("model %s, window %.2f s, up to %d cuBLASLt candidates + cublasGemmEx per problem\n",
                model.c_str(), window_s, max_candidates);
    double total_flop = 0, flop_weighted_gain = 0, flop_weighted_best_vs_ex = 0;
    for (const Problem &p : problems) {
        const cudaDataType_t dt = p.accumulate ? CUDA_R_32F : CUDA_R_16BF;
        const float alpha = 1.f, beta = p.accumulate ? 1.f : 0.f;
        const cublasOperation_t ta = p.ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb = p.tb ? CUBLAS_OP_T : CUBLAS_OP_N;
        const int64_t lda = p.ta ? p.k : p.m, ldb = p.tb ? p.n : p.k, ldd = p.m;
        cublasLtMatmulDesc_t op;
        cublasLtMatrixLayout_t la, lb, ld;
        CK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        CK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
        CK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
        CK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &p.epilogue, sizeof(p.epilogue)));
        if (p.epilogue != N) {
            CK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
        }
        if (p.epilogue == G) {
            const int64_t ld_aux = p.m;
            CK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof(aux)));
            CK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld_aux, sizeof(ld_aux)));
        }
        CK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, p.ta ? p.k : p.m, p.ta ? p.m : p.k, lda));
        CK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, p.tb ? p.n : p.k, p.tb ? p.k : p.n, ldb));
        CK(cublasLtMatrixLayoutCreate(&ld, dt, p.m, p.n, ldd));
        cublasLtMatmulPreference_t pref;
        CK(cublasLtMatmulPreferenceCreate(&pref));
        CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                                sizeof(ws_bytes)));
        std::vector<cublasLtMatmulHeuristicResult_t> res(max_candidates);
        int found = 0;
        CK(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, ld, ld, pref, max_candidates, res.data(), &found));
        std::vector<Candidate> cands;
        for (int i = 0; i < found; ++i) {
            Candidate c;
            c.algo = res[i].algo;
            c.name = describe(res[i].algo, i);
            cands.push_back(c);
        }
        if (!p.on_lt) {  // torch's mm: cublasGemmEx with the default algorithm (no epilogue: bias not added)
            Candidate c;
            c.gemm_ex = true;
            c.name = "cublasGemmEx (torch mm)";
            cands.push_back(c);
        }
        auto launch = [&](const Candidate &c) {
            if (c.gemm_ex) {
                CK(cublasGemmEx(blas, ta, tb, p.m, p.n, p.k, &alpha, A, CUDA_R_16BF, lda, Bm, CUDA_R_16BF, ldb,
                                &beta, D, dt, ldd, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
            } else {
                CK(cublasLtMatmul(lt, op, &alpha, A, la, Bm, lb, &beta, D, ld, D, ld, &c.algo, ws, ws_bytes, stream));
            }
        };
        const double flop = 2.0 * p.m * p.n * p.k;
        // Calls per sync batch: about 20 ms at ~600 TFLOP/s.
        const int batch = std::max(1, (int)(0.02 * 600e12 / flop));
        auto run_window = [&](Candidate &c, double seconds, bool record) {
            cudaEvent_t e0, e1;
            CK(cudaEventCreate(&e0));
            CK(cudaEventCreate(&e1));
            for (int i = 0; i < batch; ++i) launch(c);  // ramp into this candidate, not timed
            CK(cudaStreamSynchronize(stream));
            const double j0 = nvml.joules();
            const auto t0 = std::chrono::steady_clock::now();
            CK(cudaEventRecord(e0, stream));
            long calls = 0;
            double mhz_sum = 0;
            int mhz_n = 0;
            while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < seconds) {
                for (int i = 0; i < batch; ++i) launch(c);
                calls += batch;
                mhz_sum += nvml.sm_mhz();
                ++mhz_n;
                CK(cudaStreamSynchronize(stream));
            }
            CK(cudaEventRecord(e1, stream));
            CK(cudaEventSynchronize(e1));
            const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            const double j1 = nvml.joules();
            float ms = 0;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            if (record) {
                c.tflops.push_back(flop * calls / (ms * 1e-3) / 1e12);
                c.watts.push_back((j1 - j0) / wall);
                c.mhz.push_back(mhz_sum / std::max(1, mhz_n));
                c.j_per_pflop.push_back((j1 - j0) / (flop * calls / 1e15));
            }
            cudaEventDestroy(e0);
            cudaEventDestroy(e1);
        };
        for (auto &c : cands) run_window(c, 0.05, false);  // every candidate runs once (lazy loading)
        run_window(cands[0], 4.0, false);                    // heat the board to its power limit
        for (int round = 0; round < 4; ++round) {
            if (round % 2 == 0)
                for (size_t i = 0; i < cands.size(); ++i) run_window(cands[i], window_s, true);
            else
                for (size_t i = cands.size(); i-- > 0;) run_window(cands[i], window_s, true);
        }
        auto median = [](std::vector<double> v) {
            std::sort(v.begin(), v.end());
            return v.empty() ? 0.0 : v[v.size() / 2];
        };
        std::printf("\n%s  (cuBLAS m %ld n %ld k %ld, %s%s)\n", p.name, (long)p.m, (long)p.n, (long)p.k,
                    p.ta ? "T" : "N", p.tb ? "T" : "N");
        std::printf("  %-44s %8s %7s %6s %8s\n", "candidate", "TFLOP/s", "W", "MHz", "J/PFLOP");
        size_t best = 0, ex = cands.size();
        for (size_t i = 0; i < cands.size(); ++i) {
            Candidate &c = cands[i];
            std::printf("  %-44s %8.1f %7.0f %6.0f %8.1f\n", c.name.c_str(), median(c.tflops), median(c.watts),
                        median(c.mhz), median(c.j_per_pflop));
            if (median(c.tflops) > median(cands[best].tflops)) best = i;
            if (c.gemm_ex) ex = i;
        }
        const double h0 = median(cands[0].tflops), b = median(cands[best].tflops);
        // What the step runs: torch's mm (cublasGemmEx, or for a biased product cuBLASLt's
        // heuristic #0, which torch's addmm uses: the better of the two, to be safe) or, for the products our
        // kernels run through cuBLASLt, the heuristic's first pick (#0).
        const double base = ex < cands.size() ? std::max(median(cands[ex].tflops), h0) : h0;
        std::printf("  best %s: %.1f = %.3fx heuristic #0, %.3fx %s\n", cands[best].name.c_str(), b, b / h0,
                    b / base, ex < cands.size() ? "max(cublasGemmEx, #0)" : "heuristic #0");
        total_flop += flop;
        flop_weighted_gain += flop * (b / h0);
        flop_weighted_best_vs_ex += flop * (b / base);
        cublasLtMatmulPreferenceDestroy(pref);
        cublasLtMatrixLayoutDestroy(la);
        cublasLtMatrixLayoutDestroy(lb);
        cublasLtMatrixLayoutDestroy(ld);
        cublasLtMatmulDescDestroy(op);
    }
    std::printf("\nFLOP-weighted best / heuristic #0: %.3fx; best / what the step runs now (GemmEx or #0): %.3fx\n",
                flop_weighted_gain / total_flop, flop_weighted_best_vs_ex / total_flop);
    return 0;
}
