// gemm_bench.c: the projection GEMM, old path against new, on this machine.
//   old: transpose(WT, W) then gemm_rows (fused.c's loop: 64-row blocks over
//        threads, kt->gemm_nn, then C += b)
//   new: mha__gemm_pack_wt then mha__gemm_rows_packed (gemm.h)
// C (R, N) = X (R, K) W^T + b, W (N, K), for R in {2048, 4096}, K = 768,
// N in {768, 2304}, and the backward's dW-style product (R 768, K 4096,
// N 768, B row-major), 1 and 2 threads; median of --repeat runs (default
// 9); "old ms"/"new ms" include the transpose / pack, oldgemm%/newgemm%
// exclude it. GFLOP/s = 2RKN / time; % of the fp32 FMA peak measured here,
// on the same threads, just before (best of 5 runs of independent FMA
// chains). "bits": whether old and new outputs are bit-identical.
// Not part of the library. Build (after `make`), from the repository root:
//   cc -O2 -fopenmp -Isrc -Iinclude bench/gemm_bench.c build/libmha.a -lcjson -lm -o build/gemm_bench
// Run: build/gemm_bench [--isa avx512|avx2|scalar] [--repeat N] [--threads 1|2]
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "gemm.h"
#include "kernels/kernels.h"

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

// ---- peak: 12 independent FMA chains per thread (as tools/bench.c)
static volatile float g_sink;
#define FMA12(F) a0 = F(a0, m, c); a1 = F(a1, m, c); a2 = F(a2, m, c); a3 = F(a3, m, c); \
    a4 = F(a4, m, c); a5 = F(a5, m, c); a6 = F(a6, m, c); a7 = F(a7, m, c);              \
    a8 = F(a8, m, c); a9 = F(a9, m, c); a10 = F(a10, m, c); a11 = F(a11, m, c)
__attribute__((target("avx512f"))) static double fma512(long iters) {
    __m512 a0 = _mm512_set1_ps(.1f), a1 = _mm512_set1_ps(.2f), a2 = _mm512_set1_ps(.3f),
           a3 = _mm512_set1_ps(.4f), a4 = _mm512_set1_ps(.5f), a5 = _mm512_set1_ps(.6f),
           a6 = _mm512_set1_ps(.7f), a7 = _mm512_set1_ps(.8f), a8 = _mm512_set1_ps(.9f),
           a9 = _mm512_set1_ps(1.1f), a10 = _mm512_set1_ps(1.2f), a11 = _mm512_set1_ps(1.3f);
    const __m512 m = _mm512_set1_ps(0.9999f), c = _mm512_set1_ps(1e-4f);
    for (long i = 0; i < iters; i++) { FMA12(_mm512_fmadd_ps); }
    __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                             _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)));
    s = _mm512_add_ps(s, _mm512_add_ps(_mm512_add_ps(a8, a9), _mm512_add_ps(a10, a11)));
    g_sink = _mm512_reduce_add_ps(s);
    return (double)iters * 12 * 16 * 2;
}
__attribute__((target("avx2,fma"))) static double fma256(long iters) {
    __m256 a0 = _mm256_set1_ps(.1f), a1 = _mm256_set1_ps(.2f), a2 = _mm256_set1_ps(.3f),
           a3 = _mm256_set1_ps(.4f), a4 = _mm256_set1_ps(.5f), a5 = _mm256_set1_ps(.6f),
           a6 = _mm256_set1_ps(.7f), a7 = _mm256_set1_ps(.8f), a8 = _mm256_set1_ps(.9f),
           a9 = _mm256_set1_ps(1.1f), a10 = _mm256_set1_ps(1.2f), a11 = _mm256_set1_ps(1.3f);
    const __m256 m = _mm256_set1_ps(0.9999f), c = _mm256_set1_ps(1e-4f);
    for (long i = 0; i < iters; i++) { FMA12(_mm256_fmadd_ps); }
    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                             _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
    s = _mm256_add_ps(s, _mm256_add_ps(_mm256_add_ps(a8, a9), _mm256_add_ps(a10, a11)));
    float t[8];
    _mm256_storeu_ps(t, s);
    g_sink = t[0] + t[7];
    return (double)iters * 12 * 8 * 2;
}

// best of 5 parallel runs of ~50 ms per thread
static double peak(int nt, bool avx512) {
    double best = 0;
    for (int rep = 0; rep < 5; rep++) {
        double flops = 0, t0 = now();
#pragma omp parallel num_threads(nt) reduction(+ : flops)
        flops += avx512 ? fma512(5000000) : fma256(10000000);
        double g = flops / (now() - t0) * 1e-9;
        if (g > best) best = g;
    }
    return best;
}

// ---- old path, as in fused.c
static void gemm_rows(const mha__kernels *kt, float *C, int64_t ldc, const float *X,
                      int64_t ldx, const float *WT, int64_t ldw, const float *b, int64_t R,
                      int64_t F, int64_t E, int nt) {
    const int64_t blk = 64, nblk = (R + blk - 1) / blk;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (int64_t ib = 0; ib < nblk; ib++) {
        int64_t r0 = ib * blk, r1 = r0 + blk < R ? r0 + blk : R;
        kt->gemm_nn(C + r0 * ldc, ldc, X + r0 * ldx, ldx, WT, ldw, r1 - r0, E, F);
        if (b)
            for (int64_t r = r0; r < r1; r++)
                for (int64_t e = 0; e < E; e++) C[r * ldc + e] += b[e];
    }
}
static void transpose(float *WT, const float *W, int64_t O, int64_t I) {
    for (int64_t o = 0; o < O; o++)
        for (int64_t i = 0; i < I; i++) WT[i * O + o] = W[o * I + i];
}

static float *fl(size_t n) {
    float *p = aligned_alloc(64, (n * sizeof(float) + 63) & ~(size_t)63);
    if (!p) abort();
    return p;
}

int main(int argc, char **argv) {
    const char *isa = NULL;
    int repeat = 9, only_nt = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--isa") && i + 1 < argc) isa = argv[++i];
        else if (!strcmp(argv[i], "--repeat") && i + 1 < argc) repeat = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) only_nt = atoi(argv[++i]);
    }
    if (repeat < 1 || repeat > 1000) repeat = 9;
    const mha__kernels *kt = isa ? mha__kernels_for(isa) : mha__kernels_get();
    if (!kt) { fprintf(stderr, "ISA %s unavailable\n", isa); return 1; }
    __builtin_cpu_init();
    const bool has512 = __builtin_cpu_supports("avx512f");
    const bool k512 = !strncmp(kt->isa, "avx512", 6) || !strcmp(kt->isa, "amx");
    printf("kernels %s; peak = independent %s FMA chains\n", kt->isa, has512 && k512 ? "zmm" : "ymm");
    // {R, K, N, kind}: kind 0 = projection X W^T + b (old: transpose + gemm_rows;
    // new: pack_wt + gemm_rows_packed); kind 1 = the backward's dW = dT X
    // product (B = X row-major (K, N); old: gemm_rows on X in place; new:
    // pack_rows + gemm_rows_packed), no bias
    const int64_t cases[][4] = {{2048, 768, 768, 0}, {2048, 768, 2304, 0}, {4096, 768, 768, 0},
                                {4096, 768, 2304, 0}, {768, 4096, 768, 1}};
    printf("%5s %5s %5s %2s | %8s %8s %6s | %8s %8s %6s | %8s %8s | %s\n", "R", "K", "N", "nt",
           "old ms", "GFLOP/s", "%peak", "new ms", "GFLOP/s", "%peak", "oldgemm%", "newgemm%", "bits");
    for (int nt = 1; nt <= 2; nt++) {
        if (only_nt && nt != only_nt) continue;
        const double pk = peak(nt, has512 && k512);
        for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
                const int64_t R = cases[ci][0], K = cases[ci][1], N = cases[ci][2];
                const bool proj = cases[ci][3] == 0;
                float *X = fl((size_t)(R * K)), *W = fl((size_t)(N * K)), *b = proj ? fl((size_t)N) : NULL;
                float *WT = fl((size_t)(N * K)), *C1 = fl((size_t)(R * N)), *C2 = fl((size_t)(R * N));
                float *Bp = fl(mha__gemm_packed_b_floats(kt, K, N));
                float *sc = fl(mha__gemm_scratch_floats(kt, nt) + 1);
                unsigned s = 1;
                for (int64_t i = 0; i < R * K; i++) X[i] = (float)((s = s * 1103515245u + 12345u) >> 8) * 0x1p-23f - 1.0f;
                for (int64_t i = 0; i < N * K; i++) W[i] = (float)((s = s * 1103515245u + 12345u) >> 8) * 0x1p-26f - 0.125f;
                for (int64_t i = 0; proj && i < N; i++) b[i] = 0.01f * (float)(i % 7);
                double to[1000], tn[1000], tog[1000], tng[1000];
                for (int rep = -1; rep < repeat; rep++) {  // rep -1: warm-up
                    double t0 = now();
                    if (proj) transpose(WT, W, N, K);  // kind 1: W is B (K, N) itself
                    double t1 = now();
                    gemm_rows(kt, C1, N, X, K, proj ? WT : W, N, b, R, K, N, nt);
                    double t2 = now();
                    if (proj) mha__gemm_pack_wt(kt, Bp, W, N, K, nt);
                    else mha__gemm_pack_rows(kt, Bp, W, N, K, N, nt);
                    double t3 = now();
                    mha__gemm_rows_packed(kt, C2, N, X, K, Bp, b, R, K, N, false, nt, sc);
                    double t4 = now();
                    if (rep >= 0) {
                        to[rep] = t2 - t0; tog[rep] = t2 - t1;
                        tn[rep] = t4 - t2; tng[rep] = t4 - t3;
                    }
                }
                qsort(to, (size_t)repeat, sizeof(double), cmp_d);
                qsort(tn, (size_t)repeat, sizeof(double), cmp_d);
                qsort(tog, (size_t)repeat, sizeof(double), cmp_d);
                qsort(tng, (size_t)repeat, sizeof(double), cmp_d);
                const double fl2 = 2.0 * (double)R * (double)K * (double)N * 1e-9;
                const double go = fl2 / to[repeat / 2], gn = fl2 / tn[repeat / 2];
                const bool same = memcmp(C1, C2, sizeof(float) * (size_t)(R * N)) == 0;
                printf("%5lld %5lld %5lld %2d | %8.2f %8.1f %5.1f%% | %8.2f %8.1f %5.1f%% | %7.1f%% %7.1f%% | %s%s\n",
                       (long long)R, (long long)K, (long long)N, nt, 1e3 * to[repeat / 2], go,
                       100 * go / pk, 1e3 * tn[repeat / 2], gn, 100 * gn / pk,
                       100 * fl2 / tog[repeat / 2] / pk, 100 * fl2 / tng[repeat / 2] / pk,
                       same ? "identical" : "DIFFER", proj ? "" : " (dW-style, B row-major)");
                fflush(stdout);
                free(X); free(W); free(b); free(WT); free(C1); free(C2); free(Bp); free(sc);
            }
        printf("peak %d thread(s): %.1f GFLOP/s\n", nt, pk);
    }
    return 0;
}
