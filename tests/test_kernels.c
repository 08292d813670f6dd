// test_kernels.c: every ISA kernel this machine has against the generic
// (scalar) one, on random odd shapes and strides: gemm (overwrite and
// accumulate), the online-softmax update (including -inf, fully masked and
// huge inputs), scale_row and the flash backward's row passes. The packed-B GEMM (pack_b, gemm_packed and
// the threaded driver of gemm.h), every ISA and scalar: the packed layout,
// results against a double-precision loop (edges, strides, accumulate,
// bias, K = 0), bit-identity with gemm_nn + bias, and the same bits for
// any row / panel split and any number of threads. gemm_tn_acc (C += A^T B,
// A stored transposed), every ISA and scalar: edge shapes and wide strides
// against a double-precision loop, bit-identity with transpose +
// gemm_nn_acc of the same table, C outside its tile untouched. Across
// tables: every slot kernels.h promises the same bits on every table
// (cvt_i4, dot_acc_rows, dsoftmax_rows; the exact transpose and widenings;
// cvt_i8; gemm_nn / gemm_packed / gemm_packed_tn (/ gemm_packed_bh) between the tables of one
// FMA sum order), every pair of tables memcmp-equal on shapes with tails.
// Prints the ISAs covered and those this build or CPU lacks.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "util.h"
#include "gemm.h"
#include "kernels/kernels.h"
#include "kvcache.h"
#include "mha.h"


static float *falloc(size_t n) {
    float *p = malloc(sizeof(float) * (n ? n : 1));
    if (!p) abort();
    return p;
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
    const int64_t shapes[][3] = {{1, 1, 1},     {7, 5, 3},     {8, 32, 64},   {9, 33, 65},
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
                if (kind == 3) v = -INFINITY;                               // all masked
                x1[j] = x2[j] = v;
            }
            float a1 = k->softmax_update(x1, n, &m1, &l1);
            float a2 = g->softmax_update(x2, n, &m2, &l2);
            CHECKF(m1 == m2, "%s softmax n %lld kind %d: m %g vs %g", k->isa, (long long)n,
                   kind, m1, m2);
            CHECKF(fabsf(a1 - a2) <= 1e-6f * fabsf(a2) + 1e-30f, "%s softmax alpha %g vs %g",
                   k->isa, a1, a2);
            CHECKF(fabsf(l1 - l2) <= 2e-6f * fabsf(l2),
                   "%s softmax n %lld kind %d: l %g vs %g", k->isa, (long long)n, kind, l1, l2);
            double e = 0;
            for (int64_t j = 0; j < n; j++) {
                CHECK(isfinite(x1[j]));
                e = fmax(e, fabs((double)x1[j] - x2[j]) / (fabs(x2[j]) + 1e-30));
            }
            CHECKF(e < 4e-7, "%s softmax n %lld kind %d: max rel diff %g", k->isa,
                   (long long)n, kind, e);
        }
        float y1[200], y2[200];
        for (int64_t j = 0; j < n; j++) y1[j] = y2[j] = frand();
        k->scale_row(y1, n, 0.37f);
        g->scale_row(y2, n, 0.37f);
        CHECK(memcmp(y1, y2, (size_t)n * 4) == 0);
        for (int64_t j = 0; j < n; j++)
            y1[j] = y2[j] = j % 5 == 1 ? -INFINITY : 30.0f * frand();
        k->exp_shift(y1, n, 2.5f);
        g->exp_shift(y2, n, 2.5f);
        double e = 0;
        for (int64_t j = 0; j < n; j++)
            e = fmax(e, fabs((double)y1[j] - y2[j]) / (fabs(y2[j]) + 1e-30));
        CHECKF(e < 4e-7, "%s exp_shift n %lld: max rel diff %g", k->isa, (long long)n, e);
        k->exp_shift(y1, n, -INFINITY);
        for (int64_t j = 0; j < n; j++) CHECK(y1[j] == 0.0f);
    }
}

// ---------------------------------------------------------------------------
// gemm_tn_acc: C (M, N) += A^T B with A stored (K, M), row stride lda.

// Fills C with random values and its padding (columns >= N of each row,
// and `guard` floats past the last row) with NaN.
static void fill_c(float *C, int64_t M, int64_t N, int64_t ldc, int64_t guard) {
    for (int64_t r = 0; r < M; r++)
        for (int64_t j = 0; j < ldc; j++) C[r * ldc + j] = j < N ? frand() : NAN;
    for (int64_t i = 0; i < guard; i++) C[M * ldc + i] = NAN;
}

static bool c_pad_untouched(const float *C, int64_t M, int64_t N, int64_t ldc, int64_t guard) {
    bool ok = true;
    for (int64_t r = 0; r < M; r++)
        for (int64_t j = N; j < ldc; j++) ok &= isnan(C[r * ldc + j]);
    for (int64_t i = 0; i < guard; i++) ok &= isnan(C[M * ldc + i]);
    return ok;
}

// One case: against double precision (every element within (K + 2) * 2^-23
// of its sum of magnitudes) and bit-identical to the path it replaces, the
// transposed copy tr[j*K + r] = A[r*lda + j] then gemm_nn_acc on the same
// table. Padding of A and B is NaN (never to be used), C's padding must
// stay NaN. Returns false on any failure (already reported).
static bool tn_case(const mha__kernels *k, int64_t M, int64_t N, int64_t K, int64_t lda,
                    int64_t ldb, int64_t ldc) {
    const int64_t guard = 8;
    float *A = falloc((size_t)(K * lda)), *B = falloc((size_t)(K * ldb));
    float *T = falloc((size_t)(M * K));
    float *C1 = falloc((size_t)(M * ldc + guard)), *C2 = falloc((size_t)(M * ldc + guard));
    float *C0 = falloc((size_t)(M * ldc + guard));
    for (int64_t kk = 0; kk < K; kk++) {
        for (int64_t i = 0; i < lda; i++) A[kk * lda + i] = i < M ? frand() : NAN;
        for (int64_t j = 0; j < ldb; j++) B[kk * ldb + j] = j < N ? frand() : NAN;
    }
    fill_c(C0, M, N, ldc, guard);
    memcpy(C1, C0, sizeof(float) * (size_t)(M * ldc + guard));
    memcpy(C2, C0, sizeof(float) * (size_t)(M * ldc + guard));
    k->gemm_tn_acc(C1, ldc, A, lda, B, ldb, M, N, K);
    for (int64_t r = 0; r < K; r++)
        for (int64_t j = 0; j < M; j++) T[j * K + r] = A[r * lda + j];
    k->gemm_nn_acc(C2, ldc, T, K, B, ldb, M, N, K);
    double worst = 0;
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            double v = C0[i * ldc + j], mag = fabs(v);
            for (int64_t kk = 0; kk < K; kk++) {
                const double t = (double)A[kk * lda + i] * B[kk * ldb + j];
                v += t;
                mag += fabs(t);
            }
            const double e = fabs(C1[i * ldc + j] - v) / ((K + 2) * 0x1p-23 * mag + 1e-30);
            if (!(e <= worst)) worst = isnan(e) ? INFINITY : e;
        }
    const bool ok_d = worst <= 1.0;
    const bool ok_pad = c_pad_untouched(C1, M, N, ldc, guard);
    const bool ok_bits = memcmp(C1, C2, sizeof(float) * (size_t)(M * ldc + guard)) == 0;
    CHECKF(ok_d, "%s gemm_tn_acc M %lld N %lld K %lld lda %lld ldb %lld: error %g of the bound",
           k->isa, (long long)M, (long long)N, (long long)K, (long long)lda, (long long)ldb,
           worst);
    CHECKF(ok_pad, "%s gemm_tn_acc M %lld N %lld K %lld wrote outside C", k->isa, (long long)M,
           (long long)N, (long long)K);
    CHECKF(ok_bits,
           "%s gemm_tn_acc M %lld N %lld K %lld lda %lld ldb %lld: differs from "
           "transpose + gemm_nn_acc",
           k->isa, (long long)M, (long long)N, (long long)K, (long long)lda, (long long)ldb);
    free(A), free(B), free(T), free(C1), free(C2), free(C0);
    return ok_d && ok_pad && ok_bits;
}

static void test_gemm_tn(const mha__kernels *k) {
    CHECK(k->gemm_tn_acc != NULL);
    // every combination of the edge sizes, strides wider than the data
    const int64_t dims[] = {0, 1, 7, 8, 15, 16, 31, 33, 64, 65, 128, 130};
    const int nd = (int)(sizeof dims / sizeof dims[0]);
    int cases = 0, failed = 0;
    for (int im = 0; im < nd; im++)
        for (int in = 0; in < nd; in++)
            for (int ik = 0; ik < nd; ik++) {
                const int64_t M = dims[im], N = dims[in], K = dims[ik];
                const int64_t lda = M + 1 + (im + ik) % 5, ldb = N + 1 + 3 * ((in + ik) % 3);
                const int64_t ldc = N + 1 + (im + in) % 4;
                failed += !tn_case(k, M, N, K, lda, ldb, ldc);
                cases++;
            }
    // the flash backward's shapes (P^T dO, dS^T Q), K across the k chunks
    // (256) and N across the column blocks (512) of the ISA kernels
    const int64_t shapes[][6] = {{128, 64, 64, 128, 64, 64},   {128, 64, 64, 128, 768, 64},
                                 {128, 64, 64, 128, 2304, 64}, {96, 64, 64, 128, 768, 768},
                                 {128, 64, 300, 130, 64, 64},  {37, 600, 513, 40, 601, 603},
                                 {14, 33, 257, 14, 40, 33}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++, cases++)
        failed += !tn_case(k, shapes[s][0], shapes[s][1], shapes[s][2], shapes[s][3],
                           shapes[s][4], shapes[s][5]);
    CHECK(cases == nd * nd * nd + 7);
    printf("%s gemm_tn_acc: %d cases, %d failed\n", k->isa, cases, failed);
}

// ---------------------------------------------------------------------------
// Packed-B GEMM

// B(k, n) of the three layouts pack_b is given: 0 row-major (sk = ldb,
// sn = 1), 1 W^T of a row-major W (N, K) (sk = 1, sn = ldw), 2 both strides
// > 1 (a column-major B with every other element).
static void b_layout(int kind, int64_t K, int64_t N, int64_t *sk, int64_t *sn, size_t *n) {
    if (kind == 0) *sk = N + 3, *sn = 1;
    else if (kind == 1) *sk = 1, *sn = K + 5;
    else *sk = 2 * N + 2, *sn = 2;
    *n = (size_t)((K > 0 ? K - 1 : 0) * *sk + (N > 0 ? N - 1 : 0) * *sn + 1);
}

// The packed layout, exactly: Bp[(p*K + k)*nr + j] = B(k, p*nr + j), 0 past N.
static void test_pack_layout(const mha__kernels *k) {
    const int64_t shapes[][2] = {{1, 1},   {7, 33}, {65, 31}, {17, 100},
                                 {300, 7}, {0, 5},  {5, 0}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (int kind = 0; kind < 3; kind++) {
            const int64_t K = shapes[s][0], N = shapes[s][1], nr = k->pk_nr;
            int64_t sk, sn;
            size_t nb;
            b_layout(kind, K, N, &sk, &sn, &nb);
            float *B = falloc(nb);
            for (size_t i = 0; i < nb; i++) B[i] = frand();
            const size_t np = mha__gemm_packed_b_floats(k, K, N);
            CHECK(np == (size_t)(K > 0 && N > 0 ? ((N + nr - 1) / nr) * nr * K : 0));
            float *Bp = falloc(np + 16);
            for (size_t i = 0; i < np + 16; i++) Bp[i] = NAN;
            for (int nt = 1; nt <= 3; nt += 2) {
                mha__gemm_pack_b(k, Bp, B, sk, sn, K, N, nt);
                bool ok = true;
                for (int64_t p = 0; p * nr < N; p++)
                    for (int64_t kk = 0; kk < K; kk++)
                        for (int64_t j = 0; j < nr; j++) {
                            const int64_t n = p * nr + j;
                            const float want = n < N ? B[kk * sk + n * sn] : 0.0f;
                            ok &= memcmp(&Bp[(p * K + kk) * nr + j], &want, 4) == 0;
                        }
                for (size_t i = np; i < np + 16; i++) ok &= isnan(Bp[i]);
                CHECKF(ok, "%s pack_b K %lld N %lld layout %d nt %d", k->isa, (long long)K,
                       (long long)N, kind, nt);
            }
            free(B);
            free(Bp);
        }
}

// C (M, N) [+]= A B + bias against double precision, every element within
// (K + 2) * 2^-23 of the sum of magnitudes; padding of C never written;
// C never read when overwriting (NaN in it).
static void test_packed_vs_double(const mha__kernels *k) {
    const int64_t dims[] = {0, 1, 7, 31, 33, 65, 300};
    const int nd = (int)(sizeof dims / sizeof dims[0]);
    int cases = 0;
    for (int im = 0; im < nd; im++)
        for (int in = 0; in < nd; in++)
            for (int ik = 0; ik < nd; ik++) {
                const int64_t M = dims[im], N = dims[in], K = dims[ik];
                if (M * N * K > 300 * 65 * 65 && (im + in + ik) % 3)
                    continue;  // keep it quick
                const int kind = (im + 2 * in + ik) % 3;
                const bool acc = (im + in + ik) % 2, use_bias = (im + ik) % 2 == 0 || K == 0;
                const int64_t lda = K + 1 + im, ldc = N + 2 + ik;
                int64_t sk, sn;
                size_t nb;
                b_layout(kind, K, N, &sk, &sn, &nb);
                float *A = falloc((size_t)(M * lda)), *B = falloc(nb),
                      *bias = falloc((size_t)N);
                float *C = falloc((size_t)(M * ldc)), *C0 = falloc((size_t)(M * ldc));
                float *Bp = falloc(mha__gemm_packed_b_floats(k, K, N));
                float *ap = falloc((size_t)k->pk_apack);
                for (int64_t i = 0; i < M * lda; i++) A[i] = frand();
                for (size_t i = 0; i < nb; i++) B[i] = frand();
                for (int64_t i = 0; i < N; i++) bias[i] = frand();
                for (int64_t i = 0; i < M * ldc; i++) C[i] = C0[i] = acc ? frand() : NAN;
                for (int64_t r = 0; r < M; r++)  // padding: NaN, must stay so
                    for (int64_t j = N; j < ldc; j++) C[r * ldc + j] = NAN;
                k->pack_b(Bp, B, sk, sn, K, N);
                k->gemm_packed(C, ldc, A, lda, Bp, use_bias ? bias : NULL, M, N, K, acc, ap);
                double worst = 0;
                bool pad = true;
                for (int64_t i = 0; i < M; i++) {
                    for (int64_t j = 0; j < N; j++) {
                        double s = acc ? C0[i * ldc + j] : 0.0, mag = fabs(s);
                        for (int64_t kk = 0; kk < K; kk++) {
                            const double t = (double)A[i * lda + kk] * B[kk * sk + j * sn];
                            s += t;
                            mag += fabs(t);
                        }
                        if (use_bias) s += bias[j], mag += fabs(bias[j]);
                        const double e = fabs(C[i * ldc + j] - s) /
                                         ((K + 2) * 0x1p-23 * mag + 1e-30);
                        if (!(e <= worst)) worst = isnan(e) ? INFINITY : e;
                    }
                    for (int64_t j = N; j < ldc; j++) pad &= isnan(C[i * ldc + j]);
                }
                CHECKF(worst <= 1.0,
                       "%s gemm_packed M %lld N %lld K %lld layout %d acc %d bias %d: "
                       "error %g of the bound",
                       k->isa, (long long)M, (long long)N, (long long)K, kind, acc, use_bias,
                       worst);
                CHECKF(pad, "%s gemm_packed M %lld N %lld K %lld wrote outside C", k->isa,
                       (long long)M, (long long)N, (long long)K);
                cases++;
                free(A), free(B), free(bias), free(C), free(C0), free(Bp), free(ap);
            }
    CHECK(cases > 100);
}

// Overwrite + bias is bit-identical to gemm_nn then C += bias (the path it
// replaces), for the ISA kernels and scalar alike.
static void test_packed_vs_gemm_nn(const mha__kernels *k) {
    const int64_t shapes[][3] = {{33, 70, 300}, {64, 768, 768}, {17, 2304, 65}, {5, 33, 513}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const int64_t M = shapes[s][0], N = shapes[s][1], K = shapes[s][2];
        float *A = falloc((size_t)(M * K)), *W = falloc((size_t)(N * K)),
              *WT = falloc((size_t)(N * K));
        float *b = falloc((size_t)N), *C1 = falloc((size_t)(M * N)),
              *C2 = falloc((size_t)(M * N));
        float *Bp = falloc(mha__gemm_packed_b_floats(k, K, N)),
              *ap = falloc((size_t)k->pk_apack);
        for (int64_t i = 0; i < M * K; i++) A[i] = frand();
        for (int64_t i = 0; i < N * K; i++) W[i] = frand();
        for (int64_t i = 0; i < N; i++) b[i] = frand();
        for (int64_t o = 0; o < N; o++)
            for (int64_t i = 0; i < K; i++) WT[i * N + o] = W[o * K + i];
        k->gemm_nn(C1, N, A, K, WT, N, M, N, K);
        for (int64_t r = 0; r < M; r++)
            for (int64_t j = 0; j < N; j++) C1[r * N + j] += b[j];
        mha__gemm_pack_wt(k, Bp, W, N, K, 1);
        k->gemm_packed(C2, N, A, K, Bp, b, M, N, K, false, ap);
        CHECKF(memcmp(C1, C2, sizeof(float) * (size_t)(M * N)) == 0,
               "%s gemm_packed + bias differs from gemm_nn + bias, M %lld N %lld K %lld",
               k->isa, (long long)M, (long long)N, (long long)K);
        free(A), free(W), free(WT), free(b), free(C1), free(C2), free(Bp), free(ap);
    }
}

// The same bits for every row split, panel split and number of threads.
static void test_packed_splits(const mha__kernels *k) {
    const int64_t shapes[][3] = {
        {300, 100, 65}, {1000, 70, 300}, {5, 2304, 33}, {129, 768, 768}, {1, 40, 7}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const int64_t R = shapes[s][0], N = shapes[s][1], K = shapes[s][2];
        const int64_t ldx = K + 3, ldc = N + 1;
        float *X = falloc((size_t)(R * ldx)), *B = falloc((size_t)(K * N)),
              *b = falloc((size_t)N);
        float *Bp = falloc(mha__gemm_packed_b_floats(k, K, N));
        float *sc = falloc(mha__gemm_scratch_floats(k, 8));
        float *Cr = falloc((size_t)(R * ldc)), *C = falloc((size_t)(R * ldc));
        float *Cacc0 = falloc((size_t)(R * ldc)), *Cacc = falloc((size_t)(R * ldc));
        for (int64_t i = 0; i < R * ldx; i++) X[i] = frand();
        for (int64_t i = 0; i < K * N; i++) B[i] = frand();
        for (int64_t i = 0; i < N; i++) b[i] = frand();
        for (int64_t i = 0; i < R * ldc; i++) Cacc0[i] = frand();
        mha__gemm_pack_rows(k, Bp, B, N, K, N, 2);
        // reference: one call, one thread
        for (int64_t i = 0; i < R * ldc; i++) Cr[i] = 0.0f;
        mha__gemm_rows_packed(k, Cr, ldc, X, ldx, Bp, b, R, K, N, false, 1, sc);
        const int nts[] = {2, 3, 8};
        for (int t = 0; t < 3; t++) {
            for (int64_t i = 0; i < R * ldc; i++) C[i] = 0.0f;
            mha__gemm_rows_packed(k, C, ldc, X, ldx, Bp, b, R, K, N, false, nts[t], sc);
            CHECKF(memcmp(C, Cr, sizeof(float) * (size_t)(R * ldc)) == 0,
                   "%s gemm_rows_packed R %lld N %lld K %lld: nt %d differs from nt 1", k->isa,
                   (long long)R, (long long)N, (long long)K, nts[t]);
        }
        // accumulate mode: nt 1 against nt 3
        memcpy(Cacc, Cacc0, sizeof(float) * (size_t)(R * ldc));
        mha__gemm_rows_packed(k, Cacc, ldc, X, ldx, Bp, NULL, R, K, N, true, 1, sc);
        memcpy(C, Cacc0, sizeof(float) * (size_t)(R * ldc));
        mha__gemm_rows_packed(k, C, ldc, X, ldx, Bp, NULL, R, K, N, true, 3, sc);
        CHECKF(memcmp(C, Cacc, sizeof(float) * (size_t)(R * ldc)) == 0,
               "%s gemm_rows_packed accumulate R %lld: nt 3 differs from nt 1", k->isa,
               (long long)R);
        // odd row splits (not multiples of pk_mr) and panel splits, by hand
        for (int trial = 0; trial < 4; trial++) {
            for (int64_t i = 0; i < R * ldc; i++) C[i] = 0.0f;
            const int64_t np = (N + k->pk_nr - 1) / k->pk_nr;
            const int64_t pcut = np > 1 ? 1 + (trial % (np - 1)) : np;
            for (int64_t r0 = 0; r0 < R;) {
                int64_t h = 1 + (int64_t)((frand() + 1.0f) * 0.5f * (float)(trial * 23 + 5));
                const int64_t r1 = r0 + h < R ? r0 + h : R;
                const int64_t cuts[3] = {0, pcut * k->pk_nr < N ? pcut * k->pk_nr : N, N};
                for (int c = 0; c < 2; c++) {
                    const int64_t j0 = cuts[c], j1 = cuts[c + 1];
                    if (j1 > j0)
                        k->gemm_packed(C + r0 * ldc + j0, ldc, X + r0 * ldx, ldx, Bp + j0 * K,
                                       b + j0, r1 - r0, j1 - j0, K, false, sc);
                }
                r0 = r1;
            }
            CHECKF(memcmp(C, Cr, sizeof(float) * (size_t)(R * ldc)) == 0,
                   "%s gemm_packed R %lld N %lld K %lld: split %d differs", k->isa,
                   (long long)R, (long long)N, (long long)K, trial);
        }
        // and against double precision
        double worst = 0;
        for (int64_t i = 0; i < R; i++)
            for (int64_t j = 0; j < N; j++) {
                double v = b[j], mag = fabs(b[j]);
                for (int64_t kk = 0; kk < K; kk++) {
                    v += (double)X[i * ldx + kk] * B[kk * N + j];
                    mag += fabs((double)X[i * ldx + kk] * B[kk * N + j]);
                }
                worst = fmax(worst,
                             fabs(Cr[i * ldc + j] - v) / ((K + 2) * 0x1p-23 * mag + 1e-30));
            }
        CHECKF(worst <= 1.0, "%s gemm_rows_packed R %lld N %lld K %lld: error %g of the bound",
               k->isa, (long long)R, (long long)N, (long long)K, worst);
        free(X), free(B), free(b), free(Bp), free(sc), free(Cr), free(C), free(Cacc0),
            free(Cacc);
    }
}

// gemm_packed_tn (A stored transposed) is bit for bit gemm_packed on the
// transposed copy, overwrite and accumulate, with and without bias, odd
// shapes and strides; and mha__gemm_rows_packed_tn the same for 1, 2 and
// 3 threads.
static void test_packed_tn(const mha__kernels *k) {
    const int64_t shapes[][3] = {{1, 1, 1},     {13, 33, 7},    {14, 32, 256}, {29, 70, 257},
                                 {300, 65, 31}, {768, 40, 600}, {5, 17, 0}};
    int bad = 0;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (int mode = 0; mode < 4; mode++) {
            const int64_t M = shapes[s][0], N = shapes[s][1], K = shapes[s][2];
            const int64_t lda = M + 3, ldc = N + 2;
            const bool acc = mode & 1, use_bias = mode & 2;
            float *A = falloc((size_t)(K * lda + 1)), *T = falloc((size_t)(M * K + 1));
            float *B = falloc((size_t)(K * N + 1)), *b = falloc((size_t)N);
            float *C1 = falloc((size_t)(M * ldc)), *C2 = falloc((size_t)(M * ldc));
            float *Bp = falloc(mha__gemm_packed_b_floats(k, K, N) + 1);
            float *sc = falloc(mha__gemm_scratch_floats(k, 3));
            for (int64_t i = 0; i < K * lda; i++) A[i] = frand();
            for (int64_t i = 0; i < M; i++)
                for (int64_t kk = 0; kk < K; kk++) T[i * K + kk] = A[kk * lda + i];
            for (int64_t i = 0; i < K * N; i++) B[i] = frand();
            for (int64_t i = 0; i < N; i++) b[i] = frand();
            for (int64_t i = 0; i < M * ldc; i++) C1[i] = frand();
            mha__gemm_pack_rows(k, Bp, B, N, K, N, 1);
            const float *bias = use_bias ? b : NULL;
            memcpy(C2, C1, sizeof(float) * (size_t)(M * ldc));
            k->gemm_packed(C1, ldc, T, K, Bp, bias, M, N, K, acc, sc);
            k->gemm_packed_tn(C2, ldc, A, lda, Bp, bias, M, N, K, acc, sc);
            bad += memcmp(C1, C2, sizeof(float) * (size_t)(M * ldc)) != 0;
            for (int nt = 1; nt <= 3; nt++) {
                for (int64_t i = 0; i < M * ldc; i++) C2[i] = frand();
                memcpy(C1, C2, sizeof(float) * (size_t)(M * ldc));
                mha__gemm_rows_packed(k, C1, ldc, T, K, Bp, bias, M, K, N, acc, 1, sc);
                mha__gemm_rows_packed_tn(k, C2, ldc, A, lda, Bp, bias, M, K, N, acc, nt, sc);
                bad += memcmp(C1, C2, sizeof(float) * (size_t)(M * ldc)) != 0;
            }
            CHECKF(bad == 0, "%s gemm_packed_tn M %lld N %lld K %lld acc %d bias %d differs",
                   k->isa, (long long)M, (long long)N, (long long)K, acc, use_bias);
            free(A), free(T), free(B), free(b), free(C1), free(C2), free(Bp), free(sc);
        }
}

// transpose: an exact copy, every shape around the 16 x 16 blocks, strides
// wider than the rows; nothing outside the destination written.
static void test_transpose(const mha__kernels *k) {
    const int64_t dims[] = {1, 5, 16, 17, 64, 130};
    int bad = 0;
    for (int a = 0; a < 6; a++)
        for (int b = 0; b < 6; b++) {
            const int64_t rows = dims[a], cols = dims[b], lds = cols + 3, ldd = rows + 2;
            float *src = falloc((size_t)(rows * lds)), *dst = falloc((size_t)(cols * ldd));
            for (int64_t i = 0; i < rows * lds; i++) src[i] = frand();
            for (int64_t i = 0; i < cols * ldd; i++) dst[i] = NAN;
            k->transpose(dst, ldd, src, lds, rows, cols);
            for (int64_t c = 0; c < cols; c++)
                for (int64_t r = 0; r < ldd; r++)
                    bad += r < rows ? memcmp(&dst[c * ldd + r], &src[r * lds + c], 4) != 0
                                    : !isnan(dst[c * ldd + r]);
            free(src), free(dst);
        }
    CHECKF(bad == 0, "%s transpose: %d elements wrong", k->isa, bad);
}

// gemm_packed_bh: mha__gemm_pack_wt_bh's Bp holds, element for element,
// mha__gemm_pack_wt_half's float32 Bp narrowed back (exact), and the bh
// GEMM gives gemm_packed's bits on that float32 Bp: bf16 and f16 weights,
// odd shapes, overwrite and accumulate, with and without bias, and
// mha__gemm_rows_packed_bh with 1 and 3 threads.
static void test_packed_bh(const mha__kernels *k) {
    const int64_t shapes[][3] = {{1, 1, 1},     {13, 33, 7},   {14, 32, 256},
                                 {29, 70, 257}, {300, 65, 31}, {3, 2304, 768}};
    int bad = 0;
    for (int kind = 1; kind <= 2; kind++)
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
            for (int mode = 0; mode < 4; mode++) {
                const int64_t M = shapes[s][0], O = shapes[s][1], I = shapes[s][2];
                const int64_t lda = I + 3, ldc = O + 2;
                const bool acc = mode & 1, use_bias = mode & 2;
                float *A = falloc((size_t)(M * lda)), *b = falloc((size_t)O);
                float *C1 = falloc((size_t)(M * ldc)), *C2 = falloc((size_t)(M * ldc));
                uint16_t *W = malloc(sizeof(uint16_t) * (size_t)(O * I));
                const size_t np = mha__gemm_packed_b_floats(k, I, O);
                float *Bp = falloc(np), *tmp = falloc(mha__gemm_pack_half_tmp_floats(k, I, 3));
                uint16_t *Bh = malloc(sizeof(uint16_t) * np);
                float *sc = falloc(mha__gemm_scratch_floats(k, 3));
                for (int64_t i = 0; i < M * lda; i++) A[i] = frand();
                for (int64_t i = 0; i < O; i++) b[i] = frand();
                for (int64_t i = 0; i < O * I; i++)
                    W[i] = kind == 1 ? mha_f32_to_bf16(frand()) : mha_f32_to_f16(frand());
                mha__gemm_pack_wt_half(k, Bp, W, kind, O, I, 1, tmp);
                mha__gemm_pack_wt_bh(k, Bh, W, O, I, 3);
                for (size_t e = 0; e < np; e++) {
                    const float w = kind == 1 ? mha_bf16_to_f32(Bh[e]) : mha_f16_to_f32(Bh[e]);
                    bad += memcmp(&w, &Bp[e], 4) != 0;
                }
                const float *bias = use_bias ? b : NULL;
                for (int64_t i = 0; i < M * ldc; i++) C1[i] = frand();
                memcpy(C2, C1, sizeof(float) * (size_t)(M * ldc));
                k->gemm_packed(C1, ldc, A, lda, Bp, bias, M, O, I, acc, sc);
                k->gemm_packed_bh(C2, ldc, A, lda, Bh, kind, bias, M, O, I, acc, sc);
                bad += memcmp(C1, C2, sizeof(float) * (size_t)(M * ldc)) != 0;
                for (int nt = 1; nt <= 3; nt += 2) {
                    memcpy(C2, C1, sizeof(float) * (size_t)(M * ldc));
                    mha__gemm_rows_packed(k, C1, ldc, A, lda, Bp, bias, M, I, O, acc, 1, sc);
                    mha__gemm_rows_packed_bh(k, C2, ldc, A, lda, Bh, kind, bias, M, I, O, acc,
                                             nt, sc);
                    bad += memcmp(C1, C2, sizeof(float) * (size_t)(M * ldc)) != 0;
                }
                CHECKF(bad == 0,
                       "%s gemm_packed_bh kind %d M %lld O %lld I %lld acc %d bias %d", k->isa,
                       kind, (long long)M, (long long)O, (long long)I, acc, use_bias);
                free(A), free(b), free(C1), free(C2), free(W), free(Bp), free(tmp), free(Bh);
                free(sc);
            }
}

static void test_packed(const mha__kernels *k) {
    CHECK(k->pk_nr > 0 && k->pk_mr > 0 && k->pk_apack >= 0 && k->pack_b && k->gemm_packed &&
          k->gemm_packed_tn && k->gemm_packed_bh);
    test_packed_bh(k);
    test_pack_layout(k);
    test_packed_vs_double(k);
    test_packed_vs_gemm_nn(k);
    test_packed_splits(k);
    test_packed_tn(k);
}

// softmax_rows: bit for bit softmax_update row by row, with rows whose
// max is -inf (alone or among others), running stats from a previous tile,
// partial vectors and row strides wider than n.
static void test_softmax_rows(const mha__kernels *k) {
    const int64_t Rs[] = {1, 3, 4, 5, 8, 13, 64}, ns[] = {1, 7, 16, 33, 128};
    uint64_t rng = 99;
    for (size_t a = 0; a < sizeof Rs / sizeof Rs[0]; a++)
        for (size_t b = 0; b < sizeof ns / sizeof ns[0]; b++) {
            const int64_t R = Rs[a], n = ns[b], ld = n + 3;
            float *x1 = falloc(R * ld), *x2 = falloc(R * ld), m1[64], l1[64], m2[64], l2[64],
                  al1[64], al2[64];
            for (int64_t r = 0; r < R; r++) {
                for (int64_t j = 0; j < ld; j++) {
                    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
                    float v = (float)((double)(rng >> 11) * 0x1p-53 * 40.0 - 20.0);
                    if (r % 5 == 2) v = -INFINITY;                // nothing visible
                    else if ((rng >> 7) % 9 == 0) v = -INFINITY;  // masked entries
                    x1[r * ld + j] = x2[r * ld + j] = v;
                }
                m1[r] = m2[r] = r % 3 == 0 ? -INFINITY : (float)(r % 7) - 3.0f;
                l1[r] = l2[r] = r % 3 == 0 ? 0.0f : 1.5f;
            }
            k->softmax_rows(x1, ld, R, n, m1, l1, al1);
            for (int64_t r = 0; r < R; r++)
                al2[r] = k->softmax_update(x2 + r * ld, n, &m2[r], &l2[r]);
            int bad = 0;
            for (int64_t r = 0; r < R; r++) {
                bad += memcmp(&m1[r], &m2[r], 4) != 0 || memcmp(&l1[r], &l2[r], 4) != 0 ||
                       memcmp(&al1[r], &al2[r], 4) != 0;
                bad += memcmp(x1 + r * ld, x2 + r * ld, sizeof(float) * (size_t)ld) != 0;
            }
            CHECKF(bad == 0,
                   "%s softmax_rows R %lld n %lld: %d rows differ from softmax_update", k->isa,
                   (long long)R, (long long)n, bad);
            free(x1);
            free(x2);
        }
}

// The flash backward's row passes: exp_scale_rows bit for bit exp_shift +
// scale_row of the same table (and close to the generic one), dot_acc_rows
// and dsoftmax_rows bit for bit the generic ones (their order is the
// contract's), on tails, row strides wider than n, fully masked rows
// (m = -inf), -inf scores and values of every size.
static void test_bwd_rows(const mha__kernels *k, const mha__kernels *g) {
    const int64_t Rs[] = {1, 3, 64}, ns[] = {1, 7, 15, 16, 17, 33, 128, 130};
    for (size_t a = 0; a < sizeof Rs / sizeof Rs[0]; a++)
        for (size_t b = 0; b < sizeof ns / sizeof ns[0]; b++) {
            const int64_t R = Rs[a], n = ns[b], ld = n + 5, sz = R * ld;
            float *x1 = falloc(sz), *x2 = falloc(sz), *x3 = falloc(sz), *y1 = falloc(sz),
                  *y2 = falloc(sz), st[128], s1[64], s2[64];
            for (int64_t r = 0; r < R; r++) {
                st[2 * r] = r % 4 == 1 ? -INFINITY : 3.0f * frand();
                st[2 * r + 1] = r % 4 == 1 ? 0.0f : 0.01f + frand() * frand();
                s1[r] = s2[r] = frand();
                for (int64_t j = 0; j < ld; j++) {
                    float v = 20.0f * frand() - 10.0f;
                    if (j % 7 == 3) v = -INFINITY;
                    x1[r * ld + j] = x2[r * ld + j] = x3[r * ld + j] = v;
                    y1[r * ld + j] = y2[r * ld + j] = (j % 5 == 0 ? 1e4f : 1.0f) * frand();
                }
            }
            k->exp_scale_rows(x1, ld, R, n, st);
            g->exp_scale_rows(x3, ld, R, n, st);
            int bad = 0;
            double e = 0;
            for (int64_t r = 0; r < R; r++) {
                k->exp_shift(x2 + r * ld, n, st[2 * r]);
                k->scale_row(x2 + r * ld, n, st[2 * r + 1]);
                bad += memcmp(x1 + r * ld, x2 + r * ld, sizeof(float) * (size_t)ld) != 0;
                for (int64_t j = 0; j < n; j++)
                    e = fmax(e, fabs((double)x1[r * ld + j] - x3[r * ld + j]) /
                                    (fabs(x3[r * ld + j]) + 1e-30));
            }
            CHECKF(bad == 0,
                   "%s exp_scale_rows R %lld n %lld: %d rows differ from exp_shift + scale_row",
                   k->isa, (long long)R, (long long)n, bad);
            CHECKF(e < 6e-7, "%s exp_scale_rows R %lld n %lld: max rel diff %g from scalar",
                   k->isa, (long long)R, (long long)n, e);
            // P (x3, the generic's, so both tables see the same input) and dP (y)
            k->dot_acc_rows(s1, x3, y1, ld, R, n);
            g->dot_acc_rows(s2, x3, y2, ld, R, n);
            CHECKF(memcmp(s1, s2, sizeof(float) * (size_t)R) == 0,
                   "%s dot_acc_rows R %lld n %lld: not the scalar bits", k->isa, (long long)R,
                   (long long)n);
            k->dsoftmax_rows(y1, x3, ld, R, n, s1);
            g->dsoftmax_rows(y2, x3, ld, R, n, s2);
            CHECKF(memcmp(y1, y2, sizeof(float) * (size_t)sz) == 0,
                   "%s dsoftmax_rows R %lld n %lld: not the scalar bits", k->isa, (long long)R,
                   (long long)n);
            free(x1);
            free(x2);
            free(x3);
            free(y1);
            free(y2);
        }
}

// The int4 row format (mha.h, mha_kv_dtype) as mha__kv_store_row writes
// it: a hand-made row's exact bytes (element 2i in the low nibble of byte
// i) and scales; then random rows of lengths across the groups of 32:
// scale max|group| / 7 (1 for a zero group), |q| <= 7, every element within
// the documented s / 2 (times 1 + 2^-20: float32's x / s) of its input, an
// odd row's unused nibble 0, nothing written past ceil(n / 2) bytes or
// ceil(n / 32) scales; a NaN element stores 0, a group holding an infinity
// has scale inf and stores 0s. And every table's cvt_i4 reads them back as
// fl(s q).
static void test_int4_store(void) {
    enum { NMAX = 100 };
    float row[NMAX], x[NMAX], sc[8], deq[NMAX + 1];
    uint8_t d[NMAX / 2 + 8];
    // hand-made: 1, -1, 7, -7, 3, 0 (scale 1), then a second group all 0
    for (int e = 0; e < 40; e++) x[e] = 0.0f;
    x[0] = 1, x[1] = -1, x[2] = 7, x[3] = -7, x[4] = 3;
    memset(d, 0xAA, sizeof d);
    mha__kv_store_row(MHA_KV_INT4, d, sc, x, MHA_F32, 1, 40, row);
    CHECKF(d[0] == 0xF1 && d[1] == 0x97 && d[2] == 0x03 && d[3] == 0 && d[19] == 0 &&
               d[20] == 0xAA,
           "int4 hand-made row: bytes %02x %02x %02x %02x .. %02x %02x", d[0], d[1], d[2],
           d[3], d[19], d[20]);
    CHECKF(sc[0] == 1.0f && sc[1] == 1.0f, "int4 hand-made row: scales %g %g", sc[0], sc[1]);
    const int64_t lens[] = {1, 2, 7, 31, 32, 33, 64, 65, 77, 96, 100};
    const char *isas[] = {"scalar", "avx2", "avx512"};
    for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++)
        for (int rep = 0; rep < 20; rep++) {
            const int64_t n = lens[li], ng = (n + 31) / 32, nb = (n + 1) / 2;
            for (int64_t e = 0; e < n; e++) {  // groups of different magnitudes
                const float mag = powf(10.0f, (float)((e / 32 + rep) % 7 - 3));
                x[e] = mag * frand();
            }
            if (rep == 1)
                for (int64_t e = 0; e < n && e < 32; e++) x[e] = 0.0f;  // a zero group
            if (rep == 2) x[n / 2] = NAN;
            if (rep == 3) x[n - 1] = -INFINITY;
            memset(d, 0xAA, sizeof d);
            for (int g = 0; g < 8; g++) sc[g] = -5.0f;
            mha__kv_store_row(MHA_KV_INT4, d, sc, x, MHA_F32, 1, n, row);
            int bad = 0;
            for (int64_t b = nb; b < (int64_t)sizeof d; b++) bad += d[b] != 0xAA;
            for (int64_t g = ng; g < 8; g++) bad += sc[g] != -5.0f;
            CHECKF(bad == 0, "int4 store n %lld: wrote past its bytes or scales", (long long)n);
            if (n % 2)
                CHECKF((d[nb - 1] >> 4) == 0, "int4 n %lld: the unused nibble not 0",
                       (long long)n);
            const int64_t ginf = rep == 3 ? (n - 1) / 32 : -1;
            for (int64_t g = 0; g < ng; g++) {
                float mx = 0.0f;
                for (int64_t e = g * 32; e < n && e < g * 32 + 32; e++)
                    if (!isnan(x[e])) mx = fmaxf(mx, fabsf(x[e]));
                const float want = g == ginf ? INFINITY : mx > 0.0f ? mx / 7.0f : 1.0f;
                CHECKF(sc[g] == want, "int4 n %lld group %lld: scale %g, expected %g",
                       (long long)n, (long long)g, sc[g], want);
            }
            double worst = 0.0;
            for (int64_t e = 0; e < n; e++) {
                const int u = e % 2 ? d[e / 2] >> 4 : d[e / 2] & 15, q = u >= 8 ? u - 16 : u;
                const double s = sc[e / 32];
                bad += q < -7 || q > 7;
                if (isnan(x[e]) || e / 32 == ginf) {
                    bad += q != 0;
                    continue;
                }
                worst = fmax(worst, fabs((double)x[e] - s * q) / s);
            }
            CHECKF(bad == 0 && worst <= 0.5 + 0x1p-20,
                   "int4 n %lld: %d bad nibbles, worst |x - s q| = %.9g s (bound s / 2)",
                   (long long)n, bad, worst);
            for (int t = 0; t < 3; t++) {
                const mha__kernels *k = mha__kernels_for(isas[t]);
                if (!k) continue;
                deq[n] = 9.0f;
                k->cvt_i4(deq, d, n, sc);
                int off = deq[n] != 9.0f;
                for (int64_t e = 0; e < n; e++) {
                    const int u = e % 2 ? d[e / 2] >> 4 : d[e / 2] & 15,
                              q = u >= 8 ? u - 16 : u;
                    const float want = sc[e / 32] * (float)q;
                    off += !(isnan(want) && isnan(deq[e])) && memcmp(&want, deq + e, 4) != 0;
                }
                CHECKF(off == 0, "%s cvt_i4 n %lld: %d values not s q", isas[t], (long long)n,
                       off);
            }
        }
}

// cvt_bf16 / cvt_f16 / cvt_i8: bit for bit the scalar conversions (every
// finite f16 and a spread of bf16 patterns, lengths with tails).
static void test_cvt(const mha__kernels *k, const mha__kernels *g) {
    enum { N = 65536 };
    static uint16_t h[N];
    static int8_t i8[N];
    static uint8_t u4[N / 2];
    static float a[N], b[N], s4[N / 32];
    for (int i = 0; i < N; i++) {
        h[i] = (uint16_t)i;
        i8[i] = (int8_t)(i * 37);
        if (i < N / 2) u4[i] = (uint8_t)(i * 37 + (i >> 8));  // every nibble pair
        if (i < N / 32) s4[i] = 0.01f * (float)(i % 97) - 0.3f;
    }
    const int64_t lens[] = {0, 1, 15, 17, 1000, N};
    for (size_t l = 0; l < sizeof lens / sizeof lens[0]; l++) {
        const int64_t n = lens[l];
        int bad = 0;
        k->cvt_bf16(a, h, n);
        g->cvt_bf16(b, h, n);
        for (int64_t i = 0; i < n; i++) bad += memcmp(a + i, b + i, 4) != 0;
        k->cvt_f16(a, h, n);
        g->cvt_f16(b, h, n);
        for (int64_t i = 0; i < n; i++)  // NaN payloads may differ; not bits
            bad += !(isnan(a[i]) && isnan(b[i])) && memcmp(a + i, b + i, 4) != 0;
        k->cvt_i8(a, i8, n, 0.37f);
        g->cvt_i8(b, i8, n, 0.37f);
        for (int64_t i = 0; i < n; i++) bad += memcmp(a + i, b + i, 4) != 0;
        if (n < N) a[n] = b[n] = 7.0f;  // (past n: untouched)
        k->cvt_i4(a, u4, n, s4);
        g->cvt_i4(b, u4, n, s4);
        for (int64_t i = 0; i < n; i++) bad += memcmp(a + i, b + i, 4) != 0;
        bad += n < N && (a[n] != 7.0f || b[n] != 7.0f);
        CHECKF(bad == 0, "%s cvt n %lld: %d values differ from scalar", k->isa, (long long)n,
               bad);
    }
}

// dot_rows_q / axpy_rows_q (float32, bf16, f16, int8, int4 rows: random
// bytes, so every nibble, -8 included, with per-group scales; head dims
// across the 32-element groups) against the scalar ones:
// bf16/f16 dot products bit for bit where the order matches is not
// required; a relative bound is.
static void test_rows_q(const mha__kernels *k, const mha__kernels *g) {
    enum { N = 70, W = 160 };
    static uint16_t h[N * W];
    static int8_t b8[N * W];
    static uint8_t b4[N * W / 2];
    static float f32[N * W], sc4[N * ((W + 31) / 32)];
    float x[W], sc1[N], p[N], s1[N], s2[N], o1[W], o2[W];
    for (int i = 0; i < N * W; i++) {
        h[i] = (uint16_t)(0x3c00 + (i * 7919) % 0x0800);  // f16/bf16 values of moderate size
        b8[i] = (int8_t)((i * 31) % 255 - 127);
        f32[i] = (float)((i * 7919) % 2001 - 1000) * 1e-3f;
        if (i < N * W / 2) b4[i] = (uint8_t)(next() & 255);  // every nibble, -8 included
    }
    for (int i = 0; i < W; i++) x[i] = (float)((i % 13) - 6) * 0.25f;
    for (int i = 0; i < N; i++) sc1[i] = 0.01f * (float)(i + 1), p[i] = 1.0f / (float)(i + 1);
    for (int i = 0; i < N * ((W + 31) / 32); i++) sc4[i] = 0.01f * (float)(i % 37 + 1);
    // (int4 on AVX2: whole chunks of 64, then a tail group by group)
    const int64_t dims[] = {1, 15, 16, 17, 31, 33, 64, 80, 96, 128, 150, 160};
    for (int kind = 0; kind <= 4; kind++)
        for (size_t di = 0; di < sizeof dims / sizeof dims[0]; di++) {
            const int64_t D = dims[di];
            const void *A = kind == 0   ? (const void *)f32
                            : kind == 3 ? (const void *)b8
                            : kind == 4 ? (const void *)b4
                                        : (const void *)h;
            const float *sc = kind == 4 ? sc4 : sc1;
            const int64_t sl = kind == 4 ? (W + 31) / 32 : 1;  // (floats a row's scales apart)
            k->dot_rows_q(s1, A, W, kind, sc, sl, x, N, D, NULL, 0);
            g->dot_rows_q(s2, A, W, kind, sc, sl, x, N, D, NULL, 0);
            double e = 0, m = 0;
            for (int j = 0; j < N; j++)
                e = fmax(e, fabs((double)s1[j] - s2[j])), m = fmax(m, fabs(s2[j]));
            CHECKF(e <= 1e-5 * (1 + m), "%s dot_rows_q kind %d D %lld: err %g", k->isa, kind,
                   (long long)D, e);
            for (int c = 0; c < W; c++) o1[c] = o2[c] = 0.5f;
            k->axpy_rows_q(o1, p, A, W, kind, sc, sl, N, D, NULL, 0);
            g->axpy_rows_q(o2, p, A, W, kind, sc, sl, N, D, NULL, 0);
            e = m = 0;
            for (int c = 0; c < W; c++)
                e = fmax(e, fabs((double)o1[c] - o2[c])), m = fmax(m, fabs(o2[c]));
            CHECKF(e <= 1e-5 * (1 + m), "%s axpy_rows_q kind %d Dv %lld: err %g", k->isa, kind,
                   (long long)D, e);
            CHECKF(o1[W - 1] == 0.5f || D == W, "%s axpy_rows_q wrote past Dv", k->isa);
        }
}

// The integer score kernels' check: s1 (the table's) against s2 (the
// generic's) and want (the formula's), bit for bit, for queries q < ng and
// rows j < n of G rows of lds; the rest of s1 still its fill, -7.
static void int_rows_match(const char *what, const char *isa, const float *s1, const float *s2,
                           const float *want, int64_t G, int64_t lds, int64_t ng, int64_t n,
                           int64_t D, int64_t sld) {
    int bad = 0, badf = 0, pad = 0;
    for (int64_t q = 0; q < G; q++)
        for (int64_t j = 0; j < lds; j++) {
            const float v = s1[q * lds + j];
            if (q >= ng || j >= n) {
                pad += v != -7.0f;
                continue;
            }
            bad += memcmp(&v, &s2[q * lds + j], sizeof v) != 0;
            badf += memcmp(&v, &want[q * lds + j], sizeof v) != 0;
        }
    CHECKF(bad == 0 && badf == 0 && pad == 0,
           "%s %s D %lld sld %lld ng %lld n %lld: %d differ from the generic bits, %d from the "
           "formula, %d outside written",
           isa, what, (long long)D, (long long)sld, (long long)ng, (long long)n, bad, badf,
           pad);
}

// dot_rows_i8: the generic version's bits on every table (exact integer
// sums, then the same two roundings) and those equal to the contract's
// formula evaluated here; every byte value (-128 included in the rows;
// the queries' range is [-127, 127]), head dims across the 16-, 64-byte
// steps and their tails, ng 1..9 (the 4-query blocks and remainders), n
// 70 and 3 (the 4-row groups and their tail), scales spaced sld 1 and 3;
// a row's bytes past D set to 0x7f and never counted; outputs outside
// [0, n) of each query's row untouched.
static void test_rows_i8(const mha__kernels *k, const mha__kernels *g) {
    enum { N = 70, W = 200, G = 9, LDX = 256, LDS = 80 };
    static int8_t A[N * W], Xq[G * LDX];
    static float sc[3 * N], xs[2 * G], s1[G * LDS], s2[G * LDS], want[G * LDS];
    for (int i = 0; i < N * 3; i++) sc[i] = 0.001f * (float)(i % 41 + 1);
    for (int i = 0; i < 2 * G; i++) xs[i] = 0.0137f * (float)(i + 1);
    const int64_t dims[] = {1, 15, 16, 17, 40, 63, 64, 65, 128, 130, 200};
    for (size_t di = 0; di < sizeof dims / sizeof dims[0]; di++)
        for (int sl = 1; sl <= 3; sl += 2) {
            const int64_t D = dims[di];
            for (int i = 0; i < N * W; i++)
                A[i] = i % W < D ? (int8_t)(next() & 255) : (int8_t)0x7f;
            for (int q = 0; q < G; q++)
                for (int c = 0; c < LDX; c++)
                    Xq[q * LDX + c] = c < D ? (int8_t)((int)(next() % 255) - 127) : 0;
            for (int64_t ng = 1; ng <= G; ng += (ng < 5 ? 1 : 4))
                for (int64_t n = 3; n <= N; n += N - 3) {
                    for (int i = 0; i < G * LDS; i++) s1[i] = s2[i] = -7.0f;
                    k->dot_rows_i8(s1, LDS, A, W, sc, sl, Xq, LDX, xs, 2, ng, n, D, NULL, 0);
                    g->dot_rows_i8(s2, LDS, A, W, sc, sl, Xq, LDX, xs, 2, ng, n, D, NULL, 0);
                    for (int64_t q = 0; q < ng; q++)
                        for (int64_t j = 0; j < n; j++) {
                            int32_t t = 0;
                            for (int64_t c = 0; c < D; c++)
                                t += (int32_t)A[j * W + c] * Xq[q * LDX + c];
                            const float f = sc[j * sl] * xs[2 * q];
                            want[q * LDS + j] = f * (float)t;
                        }
                    int_rows_match("dot_rows_i8", k->isa, s1, s2, want, G, LDS, ng, n, D, sl);
                }
        }
}

// dot_rows_i4: the generic version's bits on every table and those equal
// to the contract's formula evaluated here: every nibble (-8 included),
// head dims 128, 256 and 384 (one to three 128-element slabs), ng 1..20
// (the 4-query blocks, remainders, and more than a pass's 16), n 70 and 3
// (the 4-row groups and their tail), scales spaced one row's groups and
// more apart; outputs outside [0, n) of each query's row untouched.
static void test_rows_i4(const mha__kernels *k, const mha__kernels *g) {
    enum { N = 70, RB = 200, G = 20, LDX = 400, LDS = 80, SLD = 13 };
    static uint8_t A[N * RB];
    static int8_t Xq[G * LDX];
    static float sc[N * SLD], xs[2 * G], s1[G * LDS], s2[G * LDS], want[G * LDS];
    for (int i = 0; i < N * RB; i++) A[i] = (uint8_t)(next() & 255);
    for (int i = 0; i < G * LDX; i++) Xq[i] = (int8_t)((int)(next() % 255) - 127);
    for (int i = 0; i < N * SLD; i++) sc[i] = 0.001f * (float)(i % 43 + 1);
    for (int i = 0; i < 2 * G; i++) xs[i] = 0.0173f * (float)(i + 1);
    for (int64_t D = 128; D <= 384; D += 128)
        for (int64_t sl = D / 32; sl <= SLD; sl += SLD - D / 32)
            for (int64_t ng = 1; ng <= G; ng += (ng < 5 ? 1 : ng < 17 ? 12 : 3))
                for (int64_t n = 3; n <= N; n += N - 3) {
                    for (int i = 0; i < G * LDS; i++) s1[i] = s2[i] = -7.0f;
                    k->dot_rows_i4(s1, LDS, A, RB, sc, sl, Xq, LDX, xs, 2, ng, n, D, NULL, 0);
                    g->dot_rows_i4(s2, LDS, A, RB, sc, sl, Xq, LDX, xs, 2, ng, n, D, NULL, 0);
                    for (int64_t q = 0; q < ng; q++)
                        for (int64_t j = 0; j < n; j++) {
                            float u = 0.0f;
                            for (int64_t b = 0; 32 * b < D; b++) {
                                int32_t t = 0;
                                for (int64_t c = 32 * b; c < 32 * b + 32; c++) {
                                    const int nb = c % 2 ? A[j * RB + c / 2] >> 4
                                                         : A[j * RB + c / 2] & 15;
                                    const int64_t e = c % 128,
                                                  xi = c - e + (e % 2 ? 64 : 0) + e / 2;
                                    t += (nb < 8 ? nb : nb - 16) * Xq[q * LDX + xi];
                                }
                                const float p = sc[j * sl + b] * (float)t;
                                u = u + p;
                            }
                            want[q * LDS + j] = xs[2 * q] * u;
                        }
                    int_rows_match("dot_rows_i4", k->isa, s1, s2, want, G, LDS, ng, n, D, sl);
                }
}

// dot_rows_qg / axpy_rows_qg: the same bits as ng calls of the table's
// dot_rows_q / axpy_rows_q, query by query, and those the bits of the same
// rows in two calls split anywhere (ng 1..9: the 4-query blocks
// and every remainder; n 70 and 3: the 4-row groups and their tail; head
// dims with and without a 16-lane tail, int4 groups of 32 whole and cut,
// and past 64 columns), the outputs' padding untouched.
static void test_rows_qg(const mha__kernels *k) {
    enum { N = 70, W = 150, G = 9, LD = 160, NS = (W + 31) / 32 };
    static uint16_t h[N * W];
    static int8_t b8[N * W];
    static uint8_t b4[N * W / 2];
    static float f32[N * W], X[G * LD], P[G * LD], s1[G * LD], s2[G * LD], o1[G * LD],
        o2[G * LD], sc4[N * NS];
    float sc1[N];
    for (int i = 0; i < N * W; i++) {
        h[i] = (uint16_t)(0x3c00 + (i * 7919) % 0x0800);
        b8[i] = (int8_t)((i * 31) % 255 - 127);
        f32[i] = (float)((i * 7919) % 2001 - 1000) * 1e-3f;
        if (i < N * W / 2) b4[i] = (uint8_t)(next() & 255);
    }
    for (int i = 0; i < G * LD; i++) X[i] = frand(), P[i] = frand();
    for (int i = 0; i < N; i++) sc1[i] = 0.01f * (float)(i + 1);
    for (int i = 0; i < N * NS; i++) sc4[i] = 0.01f * (float)(i % 37 + 1);
    const int64_t dims[] = {1, 16, 33, 40, 64, 95, 128, 150}, rows[] = {N, 3};
    for (int kind = 0; kind <= 4; kind++)
        for (size_t di = 0; di < sizeof dims / sizeof dims[0]; di++)
            for (int ri = 0; ri < 2; ri++)
                for (int64_t ng = 1; ng <= G; ng++) {
                    const int64_t D = dims[di], n = rows[ri];
                    const void *A = kind == 0   ? (const void *)f32
                                    : kind == 3 ? (const void *)b8
                                    : kind == 4 ? (const void *)b4
                                                : (const void *)h;
                    const float *sc = kind == 4 ? sc4 : sc1;
                    const int64_t sl = kind == 4 ? NS : 1;
                    for (int i = 0; i < G * LD; i++) s1[i] = s2[i] = o1[i] = o2[i] = 0.5f;
                    // (the group calls fetch other rows while they run, of
                    // any length: pf changes no result)
                    const size_t pfb = (size_t)(next() % sizeof f32);
                    k->dot_rows_qg(s1, LD, A, W, kind, sc, sl, X, LD, ng, n, D, f32, pfb);
                    k->axpy_rows_qg(o1, LD, P, LD, A, W, kind, sc, sl, ng, n, D, h, pfb / 2);
                    for (int64_t g = 0; g < ng; g++) {
                        k->dot_rows_q(s2 + g * LD, A, W, kind, sc, sl, X + g * LD, n, D, NULL,
                                      0);
                        k->axpy_rows_q(o2 + g * LD, P + g * LD, A, W, kind, sc, sl, n, D, NULL,
                                       0);
                    }
                    // a range in pieces: the bits of one call (any split point)
                    if (ng == 1) {
                        const int64_t cut = 1 + (int64_t)(next() % (uint64_t)n);
                        float p1[N], p2[LD];
                        for (int c = 0; c < LD; c++) p2[c] = 0.5f;
                        // (row bytes; int4: half a byte an element, NS
                        // scales a row)
                        const size_t rb = kind == 0   ? 4 * W
                                          : kind == 3 ? W
                                          : kind == 4 ? W / 2
                                                      : 2 * W;
                        const int64_t ns = kind == 4 ? NS : 1;
                        const char *Ac = (const char *)A + (size_t)cut * rb;
                        const size_t rest = (size_t)(n - cut) * rb;
                        // (the first piece fetching the second, as decode asks)
                        k->dot_rows_q(p1, A, W, kind, sc, sl, X, cut, D, cut < n ? Ac : NULL,
                                      rest);
                        k->axpy_rows_q(p2, P, A, W, kind, sc, sl, cut, D, cut < n ? Ac : NULL,
                                       rest);
                        if (cut < n) {
                            k->dot_rows_q(p1 + cut, Ac, W, kind, sc + cut * ns, sl, X, n - cut,
                                          D, NULL, 0);
                            k->axpy_rows_q(p2, P + cut, Ac, W, kind, sc + cut * ns, sl,
                                           n - cut, D, NULL, 0);
                        }
                        CHECKF(memcmp(p1, s2, sizeof(float) * (size_t)n) == 0 &&
                                   memcmp(p2, o2, sizeof(float) * (size_t)LD) == 0,
                               "%s kind %d D %lld n %lld: rows split at %lld, not one call's bits",
                               k->isa, kind, (long long)D, (long long)n, (long long)cut);
                    }
                    const int d1 = memcmp(s1, s2, sizeof s1) != 0,
                              d2 = memcmp(o1, o2, sizeof o1) != 0;
                    CHECKF(!d1 && !d2,
                           "%s %s kind %d D %lld n %lld ng %lld: not the per-query bits",
                           k->isa, d1 ? "dot_rows_qg" : "axpy_rows_qg", kind, (long long)D,
                           (long long)n, (long long)ng);
                }
}

// int8 and int4 scales kept in the rows (each row's after its elements,
// rounded up to 4 bytes: the paged cache's layout, sld floats from row to
// row) against the same rows and scales in arrays of their own: the same
// bits from every call (one query, a group of 1..5, the rows split in two
// pieces), and nothing read past a row's bytes into the next's scales
// changes a result (the scales are finite numbers the int8 / int4 reads
// would otherwise pick up).
static void test_rows_in_rows(const mha__kernels *k) {
    enum { N = 37, DMAX = 150, G = 5, LD = 160 };
    static uint8_t sep[N * DMAX], in[N * (DMAX + 4 + 4 * 5)];
    static float sc[N * 5], X[G * LD], P[G * LD], s1[G * LD], s2[G * LD], o1[G * LD],
        o2[G * LD];
    for (int i = 0; i < G * LD; i++) X[i] = frand(), P[i] = frand();
    const int64_t dims[] = {1, 16, 33, 64, 150};
    for (int kind = 3; kind <= 4; kind++)
        for (size_t di = 0; di < sizeof dims / sizeof dims[0]; di++) {
            const int64_t D = dims[di], ns = kind == 4 ? (D + 31) / 32 : 1;
            const int64_t lda = kind == 4 ? D + (D & 1) : D;  // the separate rows' stride
            const size_t rb = kind == 4 ? (size_t)lda / 2 : (size_t)D;
            const size_t so = (rb + 3) & ~(size_t)3, rbi = so + 4 * (size_t)ns;
            const int64_t ldai = kind == 4 ? 2 * (int64_t)rbi : (int64_t)rbi,
                          sld = (int64_t)(rbi / 4);
            for (int64_t j = 0; j < N; j++) {
                for (size_t b = 0; b < rb; b++) sep[j * rb + b] = (uint8_t)(next() & 255);
                memcpy(in + j * rbi, sep + j * rb, rb);
                memset(in + j * rbi + rb, 0, so - rb);
                for (int64_t g = 0; g < ns; g++)
                    sc[j * ns + g] = 0.01f * (float)((j + g) % 37 + 1);
                memcpy(in + j * rbi + so, sc + j * ns, 4 * (size_t)ns);
            }
            const float *sci = (const float *)(in + so);
            for (int64_t ng = 1; ng <= G; ng++) {
                for (int i = 0; i < G * LD; i++) s1[i] = s2[i] = o1[i] = o2[i] = 0.5f;
                k->dot_rows_qg(s1, LD, sep, lda, kind, sc, ns, X, LD, ng, N, D, NULL, 0);
                k->dot_rows_qg(s2, LD, in, ldai, kind, sci, sld, X, LD, ng, N, D, in, 64);
                k->axpy_rows_qg(o1, LD, P, LD, sep, lda, kind, sc, ns, ng, N, D, NULL, 0);
                k->axpy_rows_qg(o2, LD, P, LD, in, ldai, kind, sci, sld, ng, N, D, in, 64);
                CHECKF(memcmp(s1, s2, sizeof s1) == 0 && memcmp(o1, o2, sizeof o1) == 0,
                       "%s kind %d D %lld ng %lld: scales in the rows, other bits", k->isa,
                       kind, (long long)D, (long long)ng);
            }
            // one query, the rows in two pieces (as decode calls a paged
            // cache's blocks)
            const int64_t cut = 1 + (int64_t)(next() % (N - 1));
            for (int i = 0; i < LD; i++) o1[i] = o2[i] = 0.5f;
            k->dot_rows_q(s1, sep, lda, kind, sc, ns, X, N, D, NULL, 0);
            k->axpy_rows_q(o1, P, sep, lda, kind, sc, ns, N, D, NULL, 0);
            const uint8_t *ic = in + (size_t)cut * rbi;
            k->dot_rows_q(s2, in, ldai, kind, sci, sld, X, cut, D, ic, (N - cut) * rbi);
            k->dot_rows_q(s2 + cut, ic, ldai, kind, sci + cut * sld, sld, X, N - cut, D, NULL,
                          0);
            k->axpy_rows_q(o2, P, in, ldai, kind, sci, sld, cut, D, ic, (N - cut) * rbi);
            k->axpy_rows_q(o2, P + cut, ic, ldai, kind, sci + cut * sld, sld, N - cut, D, NULL,
                           0);
            CHECKF(memcmp(s1, s2, sizeof(float) * N) == 0 &&
                       memcmp(o1, o2, sizeof(float) * LD) == 0,
                   "%s kind %d D %lld: scales in the rows, split at %lld, other bits", k->isa,
                   kind, (long long)D, (long long)cut);
        }
}


// int4 with many queries (30 x 160 floats: past what the AVX-512 kernel
// splits once on its stack, so split group by group): the bits of one
// dot_rows_q call per query (which split once), every head dim's groups.
static void test_rows_qg_many(const mha__kernels *k) {
    enum { N = 70, W = 150, NQ = 30, LD = 160, NS = (W + 31) / 32 };
    static uint8_t b4[N * W / 2];
    static float X[NQ * LD], s1[NQ * N], s2[NQ * N], sc4[N * NS];
    for (int i = 0; i < N * W / 2; i++) b4[i] = (uint8_t)(next() & 255);
    for (int i = 0; i < NQ * LD; i++) X[i] = frand();
    for (int i = 0; i < N * NS; i++) sc4[i] = 0.01f * (float)(i % 37 + 1);
    const int64_t dims[] = {129, 150};
    for (int di = 0; di < 2; di++) {
        k->dot_rows_qg(s1, N, b4, W, 4, sc4, (W + 31) / 32, X, LD, NQ, N, dims[di], NULL, 0);
        for (int q = 0; q < NQ; q++)
            k->dot_rows_q(s2 + q * N, b4, W, 4, sc4, (W + 31) / 32, X + q * LD, N, dims[di],
                          NULL, 0);
        CHECKF(memcmp(s1, s2, sizeof s1) == 0,
               "%s int4 dot_rows_qg, %d queries, D %lld: not the per-query bits", k->isa, NQ,
               (long long)dims[di]);
    }
}


// ---- bf16 compute slots (kernels.h) ----

static uint16_t bf16_of(float x) {  // nearest even, subnormals flushed (the contract's rule)
    uint16_t h;
    mha__kernels_for("scalar")->round_bf16(&h, &x, 1);
    return h;
}

static double bf16_to_double(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// A bf16 value of magnitude 2^e with e in [lo, hi], some zeros (no
// subnormals: the rule flushes them).
static uint16_t rbf16(int lo, int hi) {
    if (irand(0, 19) == 0) return irand(0, 1) ? 0x8000 : 0;
    return bf16_of(ldexpf(frand(), (int)irand(lo, hi)));
}

// round_bf16: every table the generic bits, on random bit patterns (NaN,
// subnormals, infinities), ties (the low half exactly 0x8000) and lengths
// with tails.
static void test_round_bf16(const mha__kernels *k, const mha__kernels *g) {
    enum { N = 4099 };
    static float x[N];
    static uint16_t a[N + 1], b[N + 1];
    for (int i = 0; i < N; i++) {
        uint32_t u = (uint32_t)next();
        if (i % 4 == 1) u = (u & 0xffff0000u) | 0x8000u;  // a tie
        if (i % 8 == 2) u &= 0x807fffffu;                 // subnormal (or zero)
        memcpy(&x[i], &u, 4);
    }
    const int64_t lens[] = {0, 1, 15, 16, 17, 100, N};
    for (size_t l = 0; l < sizeof lens / sizeof lens[0]; l++) {
        const int64_t n = lens[l];
        a[n] = b[n] = 0x1234;
        k->round_bf16(a, x, n);
        g->round_bf16(b, x, n);
        int64_t bad = -1;
        for (int64_t i = 0; i < n && bad < 0; i++)
            if (a[i] != b[i]) bad = i;
        CHECKF(bad < 0 && a[n] == 0x1234,
               "%s round_bf16 n %lld: index %lld: 0x%04x vs scalar 0x%04x (of %a)", k->isa,
               (long long)n, (long long)bad, bad < 0 ? 0 : a[bad], bad < 0 ? 0 : b[bad],
               bad < 0 ? 0.0 : (double)x[bad]);
    }
    // the rule itself, on the generic table: ties to even, subnormals to
    // signed zero, NaN quiet, overflow to infinity
    const struct {
        uint32_t in;
        uint16_t out;
    } rule[] = {
        {0x3f808000u, 0x3f80}, {0x3f818000u, 0x3f82}, {0x3f808001u, 0x3f81},
        {0x00400000u, 0x0000}, {0x80000001u, 0x8000}, {0x00800000u, 0x0080},
        {0x7f800001u, 0x7fc0}, {0xff800000u, 0xff80}, {0x7f7fffffu, 0x7f80},
    };
    for (size_t i = 0; i < sizeof rule / sizeof rule[0]; i++) {
        float f;
        memcpy(&f, &rule[i].in, 4);
        uint16_t h;
        g->round_bf16(&h, &f, 1);
        CHECKF(h == rule[i].out, "round_bf16(0x%08x) = 0x%04x, not 0x%04x", rule[i].in, h,
               rule[i].out);
    }
}

// softmax_rows_bf16: every table the generic bits (P, m, l, alpha), over
// row counts and widths with tails, running (m, l) from earlier tiles, rows
// with nothing visible yet (-inf), some masked entries, a NaN score, scales
// 1, 0.125 and 1/sqrt(32), scores spanning exp's range (fexp's cut at -87)
// and huge ones (1e25: the product's rounding above the max); x
// untouched. And the generic against double: M exact; fexp(z) within
// 2 |z| 2^-24 + 2^-22 relative (z = y - M and t = z log2 e rounded, the
// polynomial's 1.6e-7) or, cut below -87, 2^-125 absolute; P within one bf16 rounding
// more; l within its terms' errors plus n 2^-24 of summing.
static void test_softmax_rows_bf16(const mha__kernels *k, const mha__kernels *g) {
    enum { LD = 140, RMAX = 11 };
    static float x[RMAX * LD], x0[RMAX * LD];
    static uint16_t p[RMAX * LD], q[RMAX * LD];
    int cases = 0;
    double worst = 0;  // generic's P error / its bound
    for (int trial = 0; trial < 300; trial++) {
        const int64_t R = irand(1, RMAX), n = irand(1, 130);
        // huge scores with a scale whose products round (trial % 5 == 4):
        // fma(scale, x, -M) of the largest exceeds 0 by up to half an ulp of
        // M, ~1e18 here; the kernel clamps it (the fuzzer's case)
        const bool huge = trial % 5 == 4;
        const float scale = huge ? 0.17677669f : trial % 2 ? 0.125f : 1.0f;
        const float spread = huge             ? 1e25f
                             : trial % 3 == 0 ? 120.0f
                                              : 8.0f;  // (spans the cut at -87)
        float m0[RMAX], l0[RMAX], m1[RMAX], l1[RMAX], a0[RMAX], a1[RMAX], mi[RMAX], li[RMAX];
        for (int64_t r = 0; r < R; r++) {
            const int kind = (int)irand(0, 5);
            for (int64_t j = 0; j < n; j++) {
                float v = spread * frand();
                if (kind == 1 || (kind == 2 && j % 3)) v = -INFINITY;  // all / some masked
                if (kind == 3 && j == n / 2 && trial % 7 == 0) v = NAN;
                x[r * LD + j] = v;
            }
            mi[r] = m0[r] = m1[r] = kind == 4 ? 3.0f * frand() : -INFINITY;
            li[r] = l0[r] = l1[r] = kind == 4 ? 1.0f + frand() : 0.0f;
        }
        memcpy(x0, x, sizeof x);
        memset(p, 0x55, sizeof p), memset(q, 0x55, sizeof q);
        k->softmax_rows_bf16(x, LD, R, n, scale, m0, l0, a0, p, LD);
        g->softmax_rows_bf16(x, LD, R, n, scale, m1, l1, a1, q, LD);
        bool same = memcmp(p, q, sizeof p) == 0 && memcmp(x, x0, sizeof x) == 0;
        for (int64_t r = 0; r < R; r++)
            same &= (memcmp(&m0[r], &m1[r], 4) == 0 || (isnan(m0[r]) && isnan(m1[r]))) &&
                    (memcmp(&l0[r], &l1[r], 4) == 0 || (isnan(l0[r]) && isnan(l1[r]))) &&
                    (memcmp(&a0[r], &a1[r], 4) == 0 || (isnan(a0[r]) && isnan(a1[r])));
        CHECKF(same, "%s softmax_rows_bf16 R %lld n %lld scale %g: not the generic bits",
               k->isa, (long long)R, (long long)n, (double)scale);
        for (int64_t r = 0; r < R && k == g; r++) {  // the generic against double
            double M = mi[r], sum = 0;
            bool nan = false;
            for (int64_t j = 0; j < n; j++) {
                const double y = (double)(scale * x[r * LD + j]);
                nan |= y != y;
                if (y > M) M = y;
            }
            if (nan || M == -INFINITY) continue;  // (the rules, checked above by bits)
            bool ok = m1[r] == (float)M;
            double lb = 0;  // l's bound
            for (int64_t j = 0; j < n; j++) {
                const double z = (double)(scale * x[r * LD + j]) - M, e = exp(z);
                const double fe =  // fexp's (masked: 0 exactly)
                    z == -INFINITY ? 0.0 : (2 * fabs(z) * 0x1p-24 + 0x1p-22) * e + 0x1p-125;
                sum += e, lb += fe;
                const double got = bf16_to_double(q[r * LD + j]);
                const double bnd = 0x1p-8 * e + fe;
                worst = fmax(worst, fabs(got - e) / bnd);
                ok &= fabs(got - e) <= bnd;
            }
            const double za = (double)mi[r] - M, al = exp(za), lw = li[r] * al + sum;
            const double ab =  // (nothing before: alpha 0 exactly)
                mi[r] == -INFINITY ? 0.0 : (2 * fabs(za) * 0x1p-24 + 0x1p-22) * al + 0x1p-125;
            lb += li[r] * ab + (double)(n + 2) * 0x1p-24 * lw;
            ok &= fabs(a1[r] - al) <= ab && fabs(l1[r] - lw) <= lb;
            CHECKF(ok,
                   "generic softmax_rows_bf16 R %lld n %lld row %lld: off exp in double "
                   "(M %g vs %g, l %g vs %g, alpha %g vs %g)",
                   (long long)R, (long long)n, (long long)r, (double)m1[r], M, (double)l1[r],
                   lw, (double)a1[r], al);
        }
        cases++;
    }
    if (k == g)
        printf("scalar softmax_rows_bf16: P within a bf16 rounding of exp in double on %d cases "
               "(worst error / bound %.3g)\n",
               cases, worst);
    else printf("%s softmax_rows_bf16: the generic bits on %d cases\n", k->isa, cases);
}

// pack_bf16 against the contract's layout (and the generic packer with the
// table's pad), gemm_bf16 against the generic bits (exact tables) or
// against the exact sum by the contract's bound (AMX), over shapes with
// tails, strides wider than the rows, overwrite with alpha and accumulate,
// and magnitudes whose products and sums underflow (the flush to zero).
static void test_gemm_bf16(const mha__kernels *k, const mha__kernels *g) {
    int shapes = 0;
    double worst = 0;  // (AMX) error / bound
    for (int trial = 0; trial < 60; trial++) {
        const int64_t M = irand(1, 70), N = irand(1, 140), K = irand(1, 140);
        const int64_t nb = N + (trial % 3 == 0 ? irand(0, 20) : 0);
        const int64_t kp = k->bf_kpad, Kp = (K + kp - 1) / kp * kp;
        const int64_t lda = Kp + irand(0, 3) * 2, ldc = N + irand(0, 5);
        const int64_t Mr = (M + k->bf_mpad - 1) / k->bf_mpad * k->bf_mpad;
        const int64_t sk = trial % 2 ? 1 : nb + 3, sn = trial % 2 ? K + 2 : 1;  // two B layouts
        const bool acc = trial % 4 == 3, tiny = trial % 5 == 4;
        const int lo = tiny ? -80 : -8, hi = tiny ? -55 : 4;
        const float alpha = trial % 3 == 1 ? 0.125f : 0.3f;
        uint16_t *A = calloc((size_t)(Mr * lda), 2), *B = calloc((size_t)(K * sk + nb * sn), 2);
        const size_t pe = (size_t)mha__bf16_packed_elems(K, nb, kp);
        uint16_t *Bp = malloc(pe * 2), *Bq = malloc(pe * 2);
        float *C = falloc((size_t)(M * ldc)), *Cg = falloc((size_t)(M * ldc)),
              *C0 = falloc((size_t)(M * ldc));
        for (int64_t i = 0; i < M; i++)
            for (int64_t c = 0; c < K; c++) A[i * lda + c] = rbf16(lo, hi);
        for (int64_t i = M; i < Mr; i++)  // rows past M: anything (NaN even)
            for (int64_t c = 0; c < lda; c++) A[i * lda + c] = 0x7fc1;
        for (int64_t c = 0; c < K; c++)
            for (int64_t j = 0; j < nb; j++) B[c * sk + j * sn] = rbf16(lo, hi);
        uint16_t *Bs = malloc((size_t)(K * sk + nb * sn) * 2);  // with subnormals: the packer
        memcpy(Bs, B, (size_t)(K * sk + nb * sn) * 2);          // flushes them
        for (int64_t c = 0; c < K; c++)
            for (int64_t j = 0; j < nb; j++)
                if (irand(0, 9) == 0)
                    Bs[c * sk + j * sn] = (uint16_t)(irand(0, 1) << 15 | irand(1, 127));
        uint16_t *Bz = malloc(pe * 2);
        k->pack_bf16(Bz, Bs, sk, sn, K, nb);
        for (int64_t i = 0; i < M * ldc; i++) C0[i] = ldexpf(frand(), tiny ? -120 : 0);
        k->pack_bf16(Bp, B, sk, sn, K, nb);
        mha__pack_bf16_generic(Bq, B, sk, sn, K, nb, kp);
        CHECKF(memcmp(Bp, Bq, pe * 2) == 0, "%s pack_bf16 K %lld N %lld: not the layout",
               k->isa, (long long)K, (long long)nb);
        const int64_t Np = (nb + 15) / 16 * 16;
        bool layout = true;  // the contract's formula, element by element
        for (int64_t c = 0; c < Kp && layout; c++)
            for (int64_t j = 0; j < Np && layout; j++)
                layout = Bp[((c / 2) * Np + j) * 2 + c % 2] ==
                         (c < K && j < nb ? B[c * sk + j * sn] : 0);
        CHECKF(layout, "%s pack_bf16 K %lld N %lld: not the contract's layout", k->isa,
               (long long)K, (long long)nb);
        bool flushed = true;  // subnormals became signed zeros, the rest as they were
        for (int64_t c = 0; c < K && flushed; c++)
            for (int64_t j = 0; j < nb && flushed; j++) {
                const uint16_t x = Bs[c * sk + j * sn];
                flushed = Bz[((c / 2) * Np + j) * 2 + c % 2] ==
                          ((x & 0x7f80) ? x : (uint16_t)(x & 0x8000));
            }
        CHECKF(flushed, "%s pack_bf16 K %lld N %lld: subnormals not flushed to signed zero",
               k->isa, (long long)K, (long long)nb);
        free(Bs), free(Bz);
        memcpy(C, C0, sizeof(float) * (size_t)(M * ldc));
        memcpy(Cg, C0, sizeof(float) * (size_t)(M * ldc));
        k->gemm_bf16(C, ldc, A, lda, Bp, nb, M, N, K, alpha, acc);
        g->gemm_bf16(Cg, ldc, A, lda, Bp, nb, M, N, K, alpha, acc);
        int64_t bad = -1, outside = 0;
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < ldc; j++) {
                const int64_t e = i * ldc + j;
                if (j >= N) {  // past N: untouched
                    outside += memcmp(&C[e], &C0[e], 4) != 0;
                    continue;
                }
                if (k->bf_exact && !tiny) {  // (tiny: products below 2^-126)
                    if (bad < 0 && memcmp(&C[e], &Cg[e], 4) != 0) bad = e;
                    continue;
                }
                double sum = acc ? C0[e] : 0, mag = acc ? fabs(C0[e]) : 0;
                for (int64_t c = 0; c < K; c++) {
                    const double t = bf16_to_double(A[i * lda + c]) *
                                     bf16_to_double(B[c * sk + j * sn]);
                    sum += t, mag += fabs(t);
                }
                const double want = acc ? sum : alpha * sum;
                const double bnd = ((double)Kp * 0x1p-23 * mag + (double)Kp * 0x1p-126) *
                                       (acc ? 1 : alpha) +
                                   0x1p-24 * fabs(want) + 0x1p-126;
                const double err = fabs((double)C[e] - want);
                worst = fmax(worst, err / bnd);
                if (bad < 0 && !(err <= bnd)) bad = e;
            }
        CHECKF(bad < 0 && outside == 0,
               "%s gemm_bf16 M %lld N %lld K %lld nb %lld %s%s: element %lld: %a vs generic %a "
               "(%lld touched past N)",
               k->isa, (long long)M, (long long)N, (long long)K, (long long)nb,
               acc ? "acc" : "overwrite", tiny ? " tiny" : "", (long long)bad,
               bad < 0 ? 0.0 : (double)C[bad], bad < 0 ? 0.0 : (double)Cg[bad],
               (long long)outside);
        shapes++;
        free(A), free(B), free(Bp), free(Bq), free(C), free(Cg), free(C0);
    }
    printf("%s gemm_bf16: %s on %d shapes (worst error / bound %.3g)\n", k->isa,
           k->bf_exact ? "the generic bits (products above 2^-126), the bound below"
                       : "within the bound",
           shapes, worst);
}

// ---- Cross-ISA bit identity ----
// kernels.h promises some slots the same bits on every table: cvt_i4,
// dot_acc_rows, dsoftmax_rows ("bit-identical on every table"), transpose,
// cvt_bf16, cvt_f16 (exact: a copy, a widening) and cvt_i8 (one product
// each). And gemm_packed's sum order is fixed by K and pk_kc alone (an fma
// chain per k chunk): the AVX2 and AVX-512 tables share pk_kc = 256, so
// their gemm_packed, gemm_packed_tn (gemm_packed on the transposed copy)
// and gemm_nn (gemm_packed without bias, their contract says) give the same
// bits; scalar (unfused, kc = K) is not expected to. Each slot runs on every
// table this build and CPU have, on the same random inputs (shapes with
// tails, strides wider than the rows, unaligned pointers), and every pair of
// outputs (padding included) must be memcmp-equal.
enum { NTAB = 3 };
static const char *const xisa_names[NTAB] = {"scalar", "avx2", "avx512"};
static int xisa_shapes[2];  // shapes compared: [0] every table, [1] the FMA tables

// Uniform bits, as a float (any pattern: NaN payloads, denormals, -0).
static float rbits(void) {
    uint32_t u = (uint32_t)next();
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// Finite values across magnitudes (2^-30 .. 2^30), some 0 and -0.
static float rmag(void) {
    const int64_t c = irand(0, 15);
    if (c == 0) return 0.0f;
    if (c == 1) return -0.0f;
    return ldexpf(frand(), (int)irand(-30, 30));
}

// out[t] (n floats each, t < NTAB; NULL where tab[t] is) compared pairwise,
// bit for bit; a difference names the slot, the pair, the shape and the
// first differing index with both values.
static void same_bits(const char *slot, const char *shape, const mha__kernels *const *tab,
                      float *const *out, size_t n) {
    for (int i = 0; i < NTAB; i++)
        for (int j = i + 1; j < NTAB; j++) {
            if (!tab[i] || !tab[j]) continue;
            size_t at = n;
            if (memcmp(out[i], out[j], sizeof(float) * n) != 0)
                for (at = 0; at < n && memcmp(out[i] + at, out[j] + at, 4) == 0; at++) {}
            uint32_t u = 0, v = 0;
            if (at < n) memcpy(&u, out[i] + at, 4), memcpy(&v, out[j] + at, 4);
            CHECKF(at == n,
                   "%s: %s and %s differ, %s: first at index %zu: %a (0x%08x) vs %a "
                   "(0x%08x)",
                   slot, tab[i]->isa, tab[j]->isa, shape, at,
                   (double)(at < n ? out[i][at] : 0), u, (double)(at < n ? out[j][at] : 0), v);
        }
}

static void xisa_free(float **out) {
    for (int t = 0; t < NTAB; t++) free(out[t]), out[t] = NULL;
}

// cvt_i4 (every nibble; scale groups of many magnitudes, negative, 0 and inf
// ones), cvt_bf16 and cvt_f16 (every 16-bit pattern but the f16 NaNs: the
// AVX-512 widening quiets a signalling one, 0x7c01 gives 0x7fc02000 there
// and 0x7f802000 on scalar and AVX2; test_cvt requires NaN of them), cvt_i8.
static void xisa_cvt(const mha__kernels *const *tab) {
    const int64_t lens[] = {0,  1,  2,  7,  15,  16,  17,   31,  32,
                            33, 63, 64, 65, 100, 129, 1000, 4097};
    enum { NMAX = 65536 + 1 };
    static uint16_t h[NMAX];
    static int8_t i8[NMAX];
    static uint8_t u4[NMAX / 2 + 1];
    static float sc[NMAX / 32 + 2];
    float *out[NTAB] = {0};
    char shape[96];
    for (size_t l = 0; l < sizeof lens / sizeof lens[0]; l++)
        for (int off = 0; off < 2; off++) {
            const int64_t n = lens[l], pad = 3;
            for (int64_t i = 0; i < (n + 1) / 2 + 1; i++) u4[i] = (uint8_t)next();
            for (int64_t g = 0; g < n / 32 + 2; g++) {
                const int64_t c = irand(0, 9);
                sc[g] = c == 0 ? 0.0f : c == 1 ? INFINITY : rmag();
            }
            for (int64_t i = 0; i < n + 1; i++) i8[i] = (int8_t)next();
            for (int t = 0; t < NTAB; t++) {
                if (!tab[t]) continue;
                out[t] = falloc((size_t)(n + off + pad));
                for (int64_t i = 0; i < n + off + pad; i++) out[t][i] = -3.0f;
                tab[t]->cvt_i4(out[t] + off, u4 + off, n, sc + off);
            }
            snprintf(shape, sizeof shape, "n %lld, offset %d", (long long)n, off);
            same_bits("cvt_i4", shape, tab, out, (size_t)(n + off + pad));
            for (int t = 0; t < NTAB; t++)
                if (tab[t]) tab[t]->cvt_i8(out[t] + off, i8 + off, n, 0.37f);
            same_bits("cvt_i8", shape, tab, out, (size_t)(n + off + pad));
            xisa_free(out);
            xisa_shapes[0]++;
        }
    // the widenings: every pattern, in pieces with tails and offsets
    static float big[NTAB][NMAX + 4];
    for (int i = 0; i < 65536; i++) h[i] = (uint16_t)i;
    const int64_t cuts[] = {65536, 1, 17, 33, 1000, 4097};
    for (size_t c = 0; c < sizeof cuts / sizeof cuts[0]; c++)
        for (int kind = 0; kind < 2; kind++) {
            const int64_t piece = cuts[c];
            for (int t = 0; t < NTAB; t++) {
                out[t] = tab[t] ? big[t] : NULL;
                if (!tab[t]) continue;
                for (int64_t s = 0; s < 65536; s += piece) {
                    const int64_t m = 65536 - s < piece ? 65536 - s : piece;
                    float *dst = big[t] + s + (s / piece) % 2;  // every other piece unaligned
                    (kind ? tab[t]->cvt_f16 : tab[t]->cvt_bf16)(dst, h + s, m);
                    if ((s / piece) % 2) memmove(big[t] + s, dst, sizeof(float) * (size_t)m);
                }
                if (kind)  // f16 NaN (exponent 31, mantissa != 0): not compared here
                    for (int i = 0; i < 65536; i++)
                        if ((h[i] & 0x7c00) == 0x7c00 && (h[i] & 0x3ff)) big[t][i] = 0.0f;
            }
            snprintf(shape, sizeof shape, "every pattern, pieces of %lld", (long long)piece);
            same_bits(kind ? "cvt_f16" : "cvt_bf16", shape, tab, out, 65536);
            xisa_shapes[0]++;
        }
}

// transpose: random bit patterns (NaN payloads included) copied exactly.
static void xisa_transpose(const mha__kernels *const *tab) {
    const int64_t dims[] = {0, 1, 3, 8, 15, 16, 17, 33, 64, 130};
    const int nd = (int)(sizeof dims / sizeof dims[0]);
    float *out[NTAB] = {0};
    char shape[96];
    for (int a = 0; a < nd; a++)
        for (int b = 0; b < nd; b++) {
            const int64_t rows = dims[a], cols = dims[b], off = (a + b) % 2;
            const int64_t lds = cols + 1 + b % 3, ldd = rows + a % 4;
            const int64_t ns = rows * lds + off + 1, nd_ = cols * ldd + off + 1;
            float *src = falloc((size_t)ns);
            for (int64_t i = 0; i < ns; i++) src[i] = rbits();
            for (int t = 0; t < NTAB; t++) {
                if (!tab[t]) continue;
                out[t] = falloc((size_t)nd_);
                for (int64_t i = 0; i < nd_; i++) out[t][i] = -5.0f;
                tab[t]->transpose(out[t] + off, ldd, src + off, lds, rows, cols);
            }
            snprintf(shape, sizeof shape, "%lld x %lld, lds %lld, ldd %lld, offset %lld",
                     (long long)rows, (long long)cols, (long long)lds, (long long)ldd,
                     (long long)off);
            same_bits("transpose", shape, tab, out, (size_t)nd_);
            xisa_free(out);
            free(src);
            xisa_shapes[0]++;
        }
}

// dot_acc_rows and dsoftmax_rows: P in [0, 1] (some 0), dP across
// magnitudes with a few infinities, running sums and Dsum random.
static void xisa_bwd_rows(const mha__kernels *const *tab) {
    const int64_t Rs[] = {1, 2, 5, 64},
                  ns[] = {0, 1, 7, 15, 16, 17, 31, 32, 33, 100, 128, 130};
    float *out[NTAB] = {0};
    char shape[96];
    for (size_t a = 0; a < sizeof Rs / sizeof Rs[0]; a++)
        for (size_t b = 0; b < sizeof ns / sizeof ns[0]; b++) {
            const int64_t R = Rs[a], n = ns[b], ld = n + (int64_t)(a + b) % 4, off = b % 2;
            const int64_t sz = R * ld + off + 1;
            float *p = falloc((size_t)sz), *dp = falloc((size_t)sz), *s0 = falloc((size_t)R),
                  *ds = falloc((size_t)R);
            for (int64_t i = 0; i < sz; i++) {
                p[i] = irand(0, 7) == 0 ? 0.0f
                                        : fabsf(frand()) * ldexpf(1.0f, -(int)irand(0, 20));
                dp[i] = irand(0, 50) == 0 ? (irand(0, 1) ? INFINITY : -INFINITY) : rmag();
            }
            for (int64_t r = 0; r < R; r++) s0[r] = rmag(), ds[r] = rmag();
            snprintf(shape, sizeof shape, "R %lld, n %lld, ld %lld, offset %lld", (long long)R,
                     (long long)n, (long long)ld, (long long)off);
            for (int t = 0; t < NTAB; t++) {
                if (!tab[t]) continue;
                out[t] = falloc((size_t)R);
                memcpy(out[t], s0, sizeof(float) * (size_t)R);
                tab[t]->dot_acc_rows(out[t], p + off, dp + off, ld, R, n);
            }
            same_bits("dot_acc_rows", shape, tab, out, (size_t)R);
            xisa_free(out);
            for (int t = 0; t < NTAB; t++) {
                if (!tab[t]) continue;
                out[t] = falloc((size_t)sz);
                memcpy(out[t], dp, sizeof(float) * (size_t)sz);
                tab[t]->dsoftmax_rows(out[t] + off, p + off, ld, R, n, ds);
            }
            same_bits("dsoftmax_rows", shape, tab, out, (size_t)sz);
            xisa_free(out);
            free(p), free(dp), free(s0), free(ds);
            xisa_shapes[0]++;
        }
}

// gemm_nn, gemm_packed and gemm_packed_tn on the FMA tables (K across the
// 256 chunk; bias, accumulate; tails in M and N).
static void xisa_gemm(const mha__kernels *const *tab) {
    const int64_t Ms[] = {1, 5, 17}, Ns[] = {1, 15, 33, 70},
                  Ks[] = {0, 1, 31, 255, 256, 257, 600};
    float *out[NTAB] = {0};
    char shape[128];
    for (size_t a = 0; a < sizeof Ms / sizeof Ms[0]; a++)
        for (size_t b = 0; b < sizeof Ns / sizeof Ns[0]; b++)
            for (size_t c = 0; c < sizeof Ks / sizeof Ks[0]; c++) {
                const int64_t M = Ms[a], N = Ns[b], K = Ks[c], lda = K + 1, ldb = N + 2,
                              ldc = N + 3, ldt = M + 1, nc = M * ldc;
                float *A = falloc((size_t)(M * lda)), *At = falloc((size_t)(K * ldt)),
                      *B = falloc((size_t)(K * ldb)), *C0 = falloc((size_t)nc),
                      *bias = falloc((size_t)N);
                for (int64_t i = 0; i < M * lda; i++) A[i] = frand();
                for (int64_t k = 0; k < K; k++)
                    for (int64_t i = 0; i < ldt; i++)
                        At[k * ldt + i] = i < M ? A[i * lda + k] : NAN;
                for (int64_t i = 0; i < K * ldb; i++) B[i] = frand();
                for (int64_t i = 0; i < nc; i++) C0[i] = frand();
                for (int64_t j = 0; j < N; j++) bias[j] = frand();
                for (int mode = 0; mode < 5; mode++) {
                    // 0 gemm_nn; 1, 2 gemm_packed (overwrite + bias, accumulate);
                    // 3, 4 gemm_packed_tn (the same)
                    static const char *const slot[5] = {"gemm_nn", "gemm_packed", "gemm_packed",
                                                        "gemm_packed_tn", "gemm_packed_tn"};
                    for (int t = 1; t < NTAB; t++) {
                        if (!tab[t]) continue;
                        const mha__kernels *k = tab[t];
                        out[t] = falloc((size_t)nc);
                        memcpy(out[t], C0, sizeof(float) * (size_t)nc);
                        if (mode == 0) {
                            k->gemm_nn(out[t], ldc, A, lda, B, ldb, M, N, K);
                            continue;
                        }
                        float *Bp = falloc((size_t)mha__gemm_packed_b_floats(k, K, N)),
                              *ap = falloc((size_t)k->pk_apack);
                        k->pack_b(Bp, B, ldb, 1, K, N);
                        const bool acc = mode % 2 == 0;
                        if (mode <= 2)
                            k->gemm_packed(out[t], ldc, A, lda, Bp, acc ? NULL : bias, M, N, K,
                                           acc, ap);
                        else
                            k->gemm_packed_tn(out[t], ldc, At, ldt, Bp, acc ? NULL : bias, M,
                                              N, K, acc, ap);
                        free(Bp), free(ap);
                    }
                    snprintf(shape, sizeof shape, "M %lld, N %lld, K %lld, %s", (long long)M,
                             (long long)N, (long long)K,
                             mode == 0  ? "overwrite"
                             : mode % 2 ? "overwrite + bias"
                                        : "accumulate");
                    const mha__kernels *ft[NTAB] = {NULL, tab[1], tab[2]};
                    same_bits(slot[mode], shape, ft, out, (size_t)nc);
                    xisa_free(out);
                }
                free(A), free(At), free(B), free(C0), free(bias);
                xisa_shapes[1]++;
            }
}

static void test_cross_isa(void) {
    const mha__kernels *tab[NTAB];
    for (int t = 0; t < NTAB; t++) tab[t] = mha__kernels_for(xisa_names[t]);
    xisa_cvt(tab);
    xisa_transpose(tab);
    xisa_bwd_rows(tab);
    if (tab[1] && tab[2]) {
        CHECKF(tab[1]->pk_kc == tab[2]->pk_kc,
               "avx2 pk_kc %lld, avx512 pk_kc %lld: the "
               "gemm sum orders differ",
               (long long)tab[1]->pk_kc, (long long)tab[2]->pk_kc);
        xisa_gemm(tab);
    }
    char have[64] = "";
    for (int t = 0; t < NTAB; t++)
        if (tab[t]) strcat(strcat(have, " "), xisa_names[t]);
    printf("cross-ISA bits (memcmp, every pair of%s): cvt_i4 cvt_i8 cvt_bf16 cvt_f16 transpose "
           "dot_acc_rows dsoftmax_rows on %d shapes; gemm_nn gemm_packed gemm_packed_tn, "
           "avx2 = avx512, on %d shapes%s\n",
           have, xisa_shapes[0], xisa_shapes[1],
           tab[1] && tab[2] ? "" : " (needs both: skipped)");
}

// One line: the tables this run covered and those this build or CPU lacks
// (which the tests above skipped, an AVX2 machine's AVX-512 say), and why.
static void isa_coverage(void) {
    char have[64] = "", lack[192] = "";
    for (int t = 0; t < NTAB; t++) {
        if (mha__kernels_for(xisa_names[t])) {
            strcat(strcat(have, " "), xisa_names[t]);
            continue;
        }
        const char *why = "not in this build or CPU";
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
        __builtin_cpu_init();
        const bool cpu = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         (t < 2 || __builtin_cpu_supports("avx512f"));
        why = cpu ? "not in this build" : "this CPU lacks it";
#endif
        snprintf(lack + strlen(lack), sizeof lack - strlen(lack), "%s%s (%s)",
                 lack[0] ? ", " : " ", xisa_names[t], why);
    }
    printf("test_kernels: ISAs covered:%s; lacking:%s\n", have, lack[0] ? lack : " none");
}

int main(void) {
    seed_rng(7);
    const mha__kernels *g = mha__kernels_for("scalar");
    CHECK(g != NULL);
    const char *isas[] = {"avx2", "avx512", "avx512bf16", "amx"};
    int tested = 0;
    for (int i = 0; i < 4; i++) {
        const mha__kernels *k = mha__kernels_for(isas[i]);
        if (!k) {
            printf("%s: not available on this machine or build, skipped\n", isas[i]);
            continue;
        }
        test_gemm(k, g);
        test_softmax(k, g);
        test_softmax_rows(k);
        test_bwd_rows(k, g);
        test_cvt(k, g);
        test_rows_q(k, g);
        test_rows_i8(k, g);
        test_rows_i4(k, g);
        test_rows_qg(k);
        test_rows_qg_many(k);
        test_rows_in_rows(k);
        test_gemm_tn(k);
        test_packed(k);
        test_transpose(k);
        test_round_bf16(k, g);
        test_gemm_bf16(k, g);
        test_softmax_rows_bf16(k, g);
        tested++;
    }
    test_gemm(g, g);  // the generic kernels against themselves: the harness
    test_rows_qg(g);
    test_rows_i8(g, g);
    test_rows_i4(g, g);
    test_rows_in_rows(g);
    test_int4_store();
    test_gemm_tn(g);
    test_softmax_rows(g);
    test_bwd_rows(g, g);
    test_packed(g);
    test_transpose(g);
    test_round_bf16(g, g);
    test_gemm_bf16(g, g);
    test_softmax_rows_bf16(g, g);
    test_cross_isa();
    printf("ISAs compared with scalar: %d; chosen for this process: %s\n", tested, mha_isa());
    isa_coverage();
    return check_summary("test_kernels");
}
