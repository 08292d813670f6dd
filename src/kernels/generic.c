// generic.c: the portable C version of every kernel slot (kernels.h). Plain
// loops in an order the compiler can vectorise without reassociating any
// sum: C[i][j] accumulates over k in increasing k, whatever the ISA.
#include <math.h>

#include "kernels.h"

static void gemm_nn_acc(float *C, int64_t ldc, const float *A, int64_t lda,
                        const float *B, int64_t ldb, int64_t M, int64_t N,
                        int64_t K) {
    for (int64_t i = 0; i < M; i++) {
        float *c = C + i * ldc;
        for (int64_t k = 0; k < K; k++) {
            const float a = A[i * lda + k];
            const float *b = B + k * ldb;
            for (int64_t j = 0; j < N; j++) c[j] += a * b[j];
        }
    }
}

static void gemm_nn(float *C, int64_t ldc, const float *A, int64_t lda,
                    const float *B, int64_t ldb, int64_t M, int64_t N,
                    int64_t K) {
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) C[i * ldc + j] = 0.0f;
    gemm_nn_acc(C, ldc, A, lda, B, ldb, M, N, K);
}

static float softmax_update(float *x, int64_t n, float *m, float *l) {
    float mx = *m;
    for (int64_t j = 0; j < n; j++) mx = x[j] > mx ? x[j] : mx;
    if (mx == -INFINITY) {  // nothing visible yet: all weights 0
        for (int64_t j = 0; j < n; j++) x[j] = 0.0f;
        return 1.0f;
    }
    float sum = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        x[j] = expf(x[j] - mx);
        sum += x[j];
    }
    float alpha = expf(*m - mx);  // exp(-inf) = 0 on the first block
    *l = *l * alpha + sum;
    *m = mx;
    return alpha;
}

static void scale_row(float *y, int64_t n, float a) {
    for (int64_t j = 0; j < n; j++) y[j] *= a;
}

static void exp_shift(float *x, int64_t n, float c) {
    if (c == -INFINITY) {
        for (int64_t j = 0; j < n; j++) x[j] = 0.0f;
        return;
    }
    for (int64_t j = 0; j < n; j++) x[j] = expf(x[j] - c);
}

void mha__kernels_fill_generic(mha__kernels *k) {
    k->isa = "scalar";
    k->gemm_nn = gemm_nn;
    k->gemm_nn_acc = gemm_nn_acc;
    k->softmax_update = softmax_update;
    k->scale_row = scale_row;
    k->exp_shift = exp_shift;
}
