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

// C[0:mr, 0:nr] += A[0:mr, 0:K] B[0:K, 0:nr], nr <= 32.
static inline __attribute__((always_inline)) void ukr(int mr, int64_t K,
                                                      const float *A, int64_t lda,
                                                      const float *B, int64_t ldb,
                                                      float *C, int64_t ldc,
                                                      __mmask16 m0, __mmask16 m1) {
    __m512 c0[MR], c1[MR];
    for (int r = 0; r < MR; r++) c0[r] = c1[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const __m512 b0 = _mm512_maskz_loadu_ps(m0, B + k * ldb);
        const __m512 b1 = _mm512_maskz_loadu_ps(m1, B + k * ldb + 16);
        for (int r = 0; r < MR; r++) {
            if (r < mr) {
                const __m512 a = _mm512_set1_ps(A[r * lda + k]);
                c0[r] = _mm512_fmadd_ps(a, b0, c0[r]);
                c1[r] = _mm512_fmadd_ps(a, b1, c1[r]);
            }
        }
    }
    for (int r = 0; r < MR; r++) {
        if (r < mr) {
            float *c = C + r * ldc;
            _mm512_mask_storeu_ps(c, m0, _mm512_add_ps(_mm512_maskz_loadu_ps(m0, c), c0[r]));
            _mm512_mask_storeu_ps(c + 16, m1,
                                  _mm512_add_ps(_mm512_maskz_loadu_ps(m1, c + 16), c1[r]));
        }
    }
}

// One specialised micro-kernel per row count.
#define UKR(n)                                                                   \
    static void ukr##n(int64_t K, const float *A, int64_t lda, const float *B,   \
                       int64_t ldb, float *C, int64_t ldc, __mmask16 m0,         \
                       __mmask16 m1) {                                           \
        ukr(n, K, A, lda, B, ldb, C, ldc, m0, m1);                               \
    }
UKR(1) UKR(2) UKR(3) UKR(4) UKR(5) UKR(6) UKR(7) UKR(8)
typedef void (*ukr_fn)(int64_t, const float *, int64_t, const float *, int64_t,
                       float *, int64_t, __mmask16, __mmask16);
static const ukr_fn ukrs[MR + 1] = {NULL, ukr1, ukr2, ukr3, ukr4,
                                    ukr5, ukr6, ukr7, ukr8};

static void gemm_nn_acc(float *C, int64_t ldc, const float *A, int64_t lda,
                        const float *B, int64_t ldb, int64_t M, int64_t N,
                        int64_t K) {
    for (int64_t j0 = 0; j0 < N; j0 += NC) {
        int64_t nc = N - j0 < NC ? N - j0 : NC;
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
            int64_t kc = K - k0 < KC ? K - k0 : KC;
            for (int64_t i0 = 0; i0 < M; i0 += MR) {
                int mr = (int)(M - i0 < MR ? M - i0 : MR);
                for (int64_t j1 = 0; j1 < nc; j1 += NR) {
                    int64_t nr = nc - j1;
                    ukrs[mr](kc, A + i0 * lda + k0, lda, B + k0 * ldb + j0 + j1, ldb,
                             C + i0 * ldc + j0 + j1, ldc, tail_mask(nr), tail_mask(nr - 16));
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
