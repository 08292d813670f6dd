// test_kernels.c: every ISA kernel this machine has against the generic
// (scalar) one, on random odd shapes and strides: gemm (overwrite and
// accumulate), the online-softmax update (including -inf, fully masked and
// huge inputs) and scale_row.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "kernels/kernels.h"
#include "mha.h"

static uint64_t g_rng = 7;
static float frand(void) {
    g_rng = g_rng * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(g_rng >> 11) * 0x1p-53 * 2.0 - 1.0);
}

static double rel_diff(const float *a, const float *b, int64_t n, int64_t ld, int64_t rows) {
    double num = 0, den = 0;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < n; j++) {
            double d = (double)a[r * ld + j] - b[r * ld + j];
            num += d * d;
            den += (double)b[r * ld + j] * b[r * ld + j];
        }
    return sqrt(num / (den > 0 ? den : 1));
}

static void test_gemm(const mha__kernels *k, const mha__kernels *g) {
    const int64_t shapes[][3] = {{1, 1, 1},   {7, 5, 3},    {8, 32, 64},  {9, 33, 65},
                                 {64, 128, 64}, {13, 47, 300}, {70, 520, 17}, {6, 16, 0}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int64_t M = shapes[s][0], N = shapes[s][1], K = shapes[s][2];
        int64_t lda = K + 3, ldb = N + 5, ldc = N + 7;
        float *A = malloc(sizeof(float) * (size_t)(M * lda + 1));
        float *B = malloc(sizeof(float) * (size_t)(K * ldb + 1));
        float *C1 = malloc(sizeof(float) * (size_t)(M * ldc));
        float *C2 = malloc(sizeof(float) * (size_t)(M * ldc));
        for (int64_t i = 0; i < M * lda; i++) A[i] = frand();
        for (int64_t i = 0; i < K * ldb; i++) B[i] = frand();
        for (int64_t i = 0; i < M * ldc; i++) C1[i] = C2[i] = NAN;  // never read
        k->gemm_nn(C1, ldc, A, lda, B, ldb, M, N, K);
        g->gemm_nn(C2, ldc, A, lda, B, ldb, M, N, K);
        double e = rel_diff(C1, C2, N, ldc, M);
        CHECKF(e < 1e-6, "%s gemm_nn M %lld N %lld K %lld: rel diff %g", k->isa, (long long)M,
               (long long)N, (long long)K, e);
        // padding between rows untouched (still NaN)
        bool pad = true;
        for (int64_t r = 0; r < M; r++)
            for (int64_t j = N; j < ldc; j++) pad &= isnan(C1[r * ldc + j]);
        CHECKF(pad, "%s gemm_nn wrote outside the tile", k->isa);
        k->gemm_nn_acc(C1, ldc, A, lda, B, ldb, M, N, K);
        g->gemm_nn_acc(C2, ldc, A, lda, B, ldb, M, N, K);
        e = rel_diff(C1, C2, N, ldc, M);
        CHECKF(e < 1e-6, "%s gemm_nn_acc M %lld N %lld K %lld: rel diff %g", k->isa,
               (long long)M, (long long)N, (long long)K, e);
        free(A);
        free(B);
        free(C1);
        free(C2);
    }
}

static void test_softmax(const mha__kernels *k, const mha__kernels *g) {
    const int64_t ns[] = {1, 5, 16, 17, 33, 128, 200};
    for (size_t s = 0; s < sizeof ns / sizeof ns[0]; s++) {
        int64_t n = ns[s];
        float x1[200], x2[200];
        for (int kind = 0; kind < 4; kind++) {
            float m1 = kind == 1 ? 3.0f : -INFINITY, l1 = kind == 1 ? 2.0f : 0.0f;
            float m2 = m1, l2 = l1;
            for (int64_t j = 0; j < n; j++) {
                float v = 5.0f * frand();
                if (kind == 2) v = (j % 3 == 0) ? -INFINITY : v * 2000.0f;  // huge, masked
                if (kind == 3) v = -INFINITY;                              // all masked
                x1[j] = x2[j] = v;
            }
            float a1 = k->softmax_update(x1, n, &m1, &l1);
            float a2 = g->softmax_update(x2, n, &m2, &l2);
            CHECKF(m1 == m2, "%s softmax n %lld kind %d: m %g vs %g", k->isa, (long long)n, kind, m1, m2);
            CHECKF(fabsf(a1 - a2) <= 1e-6f * fabsf(a2) + 1e-30f, "%s softmax alpha %g vs %g", k->isa, a1, a2);
            CHECKF(fabsf(l1 - l2) <= 2e-6f * fabsf(l2), "%s softmax n %lld kind %d: l %g vs %g",
                   k->isa, (long long)n, kind, l1, l2);
            double e = 0;
            for (int64_t j = 0; j < n; j++) {
                CHECK(isfinite(x1[j]));
                e = fmax(e, fabs((double)x1[j] - x2[j]) / (fabs(x2[j]) + 1e-30));
            }
            CHECKF(e < 4e-7, "%s softmax n %lld kind %d: max rel diff %g", k->isa, (long long)n, kind, e);
        }
        float y1[200], y2[200];
        for (int64_t j = 0; j < n; j++) y1[j] = y2[j] = frand();
        k->scale_row(y1, n, 0.37f);
        g->scale_row(y2, n, 0.37f);
        CHECK(memcmp(y1, y2, (size_t)n * 4) == 0);
        for (int64_t j = 0; j < n; j++) y1[j] = y2[j] = j % 5 == 1 ? -INFINITY : 30.0f * frand();
        k->exp_shift(y1, n, 2.5f);
        g->exp_shift(y2, n, 2.5f);
        double e = 0;
        for (int64_t j = 0; j < n; j++) e = fmax(e, fabs((double)y1[j] - y2[j]) / (fabs(y2[j]) + 1e-30));
        CHECKF(e < 4e-7, "%s exp_shift n %lld: max rel diff %g", k->isa, (long long)n, e);
        k->exp_shift(y1, n, -INFINITY);
        for (int64_t j = 0; j < n; j++) CHECK(y1[j] == 0.0f);
    }
}

int main(void) {
    const mha__kernels *g = mha__kernels_for("scalar");
    CHECK(g != NULL);
    const char *isas[] = {"avx2", "avx512"};
    int tested = 0;
    for (int i = 0; i < 2; i++) {
        const mha__kernels *k = mha__kernels_for(isas[i]);
        if (!k) {
            printf("%s: not available on this machine or build, skipped\n", isas[i]);
            continue;
        }
        test_gemm(k, g);
        test_softmax(k, g);
        tested++;
    }
    test_gemm(g, g);  // the generic kernels against themselves: the harness
    printf("ISAs compared with scalar: %d; chosen for this process: %s\n", tested, mha_isa());
    return check_summary("test_kernels");
}
