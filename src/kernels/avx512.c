// avx512.c: AVX-512F kernels (built with -mavx512f -mavx2 -mfma for this
// file only; used only when the CPU has AVX-512F, see cpu.c).
//
// gemm: a register-blocked 8 x 32 micro-kernel (16 zmm accumulators, B rows
// loaded 32 floats at a time, A broadcast), partial tiles by AVX-512 masks
// (columns) and smaller row counts (rows), cache blocking KC x NC around
// it. Every C element accumulates over k in increasing order, in KC-sized
// chunks: fixed by the shape alone.
// exp: Cephes' expf polynomial (|r| <= ln2/2, degree 5 + 1), 2^n applied by
// vscalefps, which also flushes huge negative inputs to 0.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#include <math.h>

#include "kernels.h"

#define MR 8
#define NR 32
#define KC 256
#define NC 512

static inline __mmask16 tail_mask(int64_t n) {  // lanes [0, n) of 16
    return n >= 16 ? (__mmask16)0xffff : n <= 0 ? 0 : (__mmask16)((1u << n) - 1u);
}

// C[0:8, 0:nr] += A[0:8, 0:K] B[0:K, 0:nr], nr <= 32: 16 accumulators in
// named registers (an array would be spilled), B rows loaded under the
// column masks m0, m1.
#define ROW_FMA(r)                                                            \
    do {                                                                      \
        const __m512 a = _mm512_set1_ps(A[(r) * lda + k]);                    \
        c##r##0 = _mm512_fmadd_ps(a, b0, c##r##0);                            \
        c##r##1 = _mm512_fmadd_ps(a, b1, c##r##1);                            \
    } while (0)
#define ROW_STORE(r)                                                          \
    do {                                                                      \
        float *c = C + (r) * ldc;                                             \
        _mm512_mask_storeu_ps(c, m0, _mm512_add_ps(_mm512_maskz_loadu_ps(m0, c), c##r##0)); \
        _mm512_mask_storeu_ps(c + 16, m1,                                     \
                              _mm512_add_ps(_mm512_maskz_loadu_ps(m1, c + 16), c##r##1)); \
    } while (0)

static void ukr8(int64_t K, const float *A, int64_t lda, const float *B, int64_t ldb,
                 float *C, int64_t ldc, __mmask16 m0, __mmask16 m1) {
    __m512 c00 = _mm512_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
           c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00, c60 = c00,
           c61 = c00, c70 = c00, c71 = c00;
    for (int64_t k = 0; k < K; k++) {
        const __m512 b0 = _mm512_maskz_loadu_ps(m0, B + k * ldb);
        const __m512 b1 = _mm512_maskz_loadu_ps(m1, B + k * ldb + 16);
        ROW_FMA(0); ROW_FMA(1); ROW_FMA(2); ROW_FMA(3);
        ROW_FMA(4); ROW_FMA(5); ROW_FMA(6); ROW_FMA(7);
    }
    ROW_STORE(0); ROW_STORE(1); ROW_STORE(2); ROW_STORE(3);
    ROW_STORE(4); ROW_STORE(5); ROW_STORE(6); ROW_STORE(7);
}

// One row: the edge of M (fewer than 8 rows left).
static void ukr1(int64_t K, const float *A, int64_t lda, const float *B, int64_t ldb,
                 float *C, int64_t ldc, __mmask16 m0, __mmask16 m1) {
    (void)lda;
    (void)ldc;
    __m512 c00 = _mm512_setzero_ps(), c01 = c00;
    for (int64_t k = 0; k < K; k++) {
        const __m512 b0 = _mm512_maskz_loadu_ps(m0, B + k * ldb);
        const __m512 b1 = _mm512_maskz_loadu_ps(m1, B + k * ldb + 16);
        ROW_FMA(0);
    }
    ROW_STORE(0);
}

static void gemm_nn_acc(float *C, int64_t ldc, const float *A, int64_t lda,
                        const float *B, int64_t ldb, int64_t M, int64_t N,
                        int64_t K) {
    for (int64_t j0 = 0; j0 < N; j0 += NC) {
        int64_t nc = N - j0 < NC ? N - j0 : NC;
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
            int64_t kc = K - k0 < KC ? K - k0 : KC;
            for (int64_t i0 = 0; i0 < M; i0 += MR) {
                int64_t mr = M - i0 < MR ? M - i0 : MR;
                for (int64_t j1 = 0; j1 < nc; j1 += NR) {
                    int64_t nr = nc - j1;
                    const float *Ab = A + i0 * lda + k0, *Bb = B + k0 * ldb + j0 + j1;
                    float *Cb = C + i0 * ldc + j0 + j1;
                    if (mr == MR)
                        ukr8(kc, Ab, lda, Bb, ldb, Cb, ldc, tail_mask(nr), tail_mask(nr - 16));
                    else
                        for (int64_t r = 0; r < mr; r++)
                            ukr1(kc, Ab + r * lda, lda, Bb, ldb, Cb + r * ldc, ldc,
                                 tail_mask(nr), tail_mask(nr - 16));
                }
            }
        }
    }
}

static void gemm_nn(float *C, int64_t ldc, const float *A, int64_t lda,
                    const float *B, int64_t ldb, int64_t M, int64_t N,
                    int64_t K) {
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j += 16)
            _mm512_mask_storeu_ps(C + i * ldc + j, tail_mask(N - j), _mm512_setzero_ps());
    gemm_nn_acc(C, ldc, A, lda, B, ldb, M, N, K);
}

// exp(x) for 16 lanes: Cephes expf. NaN propagates; x <= -104 gives 0.
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x);  // NaN x is kept (2nd operand)
    x = _mm512_min_ps(_mm512_set1_ps(89.0f), x);
    const __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    const __m512 r2 = _mm512_mul_ps(r, r);
    p = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, fx);
}

static float softmax_update(float *x, int64_t n, float *m, float *l) {
    __m512 vmax = _mm512_set1_ps(*m);
    for (int64_t j = 0; j < n; j += 16)
        vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(vmax, tail_mask(n - j), x + j));
    const float mx = _mm512_reduce_max_ps(vmax);
    if (mx == -INFINITY) {
        for (int64_t j = 0; j < n; j += 16)
            _mm512_mask_storeu_ps(x + j, tail_mask(n - j), _mm512_setzero_ps());
        return 1.0f;
    }
    const __m512 vm = _mm512_set1_ps(mx);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 k = tail_mask(n - j);
        const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + j), vm));
        _mm512_mask_storeu_ps(x + j, k, e);
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(k, e));
    }
    float alpha = _mm512_cvtss_f32(exp512(_mm512_set1_ps(*m - mx)));
    *l = *l * alpha + _mm512_reduce_add_ps(sum);
    *m = mx;
    return alpha;
}

static void scale_row(float *y, int64_t n, float a) {
    const __m512 va = _mm512_set1_ps(a);
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 k = tail_mask(n - j);
        _mm512_mask_storeu_ps(y + j, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, y + j), va));
    }
}

static void exp_shift(float *x, int64_t n, float c) {
    const __m512 vc = _mm512_set1_ps(c);
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 k = tail_mask(n - j);
        __m512 e = c == -INFINITY ? _mm512_setzero_ps()
                                  : exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + j), vc));
        _mm512_mask_storeu_ps(x + j, k, e);
    }
}

void mha__kernels_fill_avx512(mha__kernels *k) {
    k->isa = "avx512";
    k->gemm_nn = gemm_nn;
    k->gemm_nn_acc = gemm_nn_acc;
    k->softmax_update = softmax_update;
    k->scale_row = scale_row;
    k->exp_shift = exp_shift;
}
#endif
