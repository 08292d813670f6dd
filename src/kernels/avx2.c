// avx2.c: AVX2 + FMA kernels (built with -mavx2 -mfma for this file only;
// used only when the CPU has both, see cpu.c).
//
// gemm: a register-blocked 6 x 16 micro-kernel (12 ymm accumulators),
// partial column tiles by maskload/maskstore, cache blocking KC x NC. Every
// C element accumulates over k in increasing order, in KC-sized chunks.
// exp: Cephes' expf polynomial; 2^n built in the exponent bits, inputs
// below -87.3 flushed to 0.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#include <math.h>

#include "kernels.h"

#define MR 6
#define NR 16
#define KC 256
#define NC 512

static inline __m256i tail_mask(int64_t n) {  // lanes [0, n) of 8
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    int32_t c = n >= 8 ? 8 : n <= 0 ? 0 : (int32_t)n;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(c), idx);
}

// C[0:6, 0:nr] += A[0:6, 0:K] B[0:K, 0:nr], nr <= 16: 12 accumulators in
// named registers (an array would be spilled).
#define ROW_FMA(r)                                                            \
    do {                                                                      \
        const __m256 a = _mm256_broadcast_ss(A + (r) * lda + k);              \
        c##r##0 = _mm256_fmadd_ps(a, b0, c##r##0);                            \
        c##r##1 = _mm256_fmadd_ps(a, b1, c##r##1);                            \
    } while (0)
#define ROW_STORE(r)                                                          \
    do {                                                                      \
        float *c = C + (r) * ldc;                                             \
        _mm256_maskstore_ps(c, m0, _mm256_add_ps(_mm256_maskload_ps(c, m0), c##r##0)); \
        _mm256_maskstore_ps(c + 8, m1, _mm256_add_ps(_mm256_maskload_ps(c + 8, m1), c##r##1)); \
    } while (0)

static void ukr6(int64_t K, const float *A, int64_t lda, const float *B, int64_t ldb,
                 float *C, int64_t ldc, __m256i m0, __m256i m1) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
           c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    for (int64_t k = 0; k < K; k++) {
        const __m256 b0 = _mm256_maskload_ps(B + k * ldb, m0);
        const __m256 b1 = _mm256_maskload_ps(B + k * ldb + 8, m1);
        ROW_FMA(0); ROW_FMA(1); ROW_FMA(2); ROW_FMA(3); ROW_FMA(4); ROW_FMA(5);
    }
    ROW_STORE(0); ROW_STORE(1); ROW_STORE(2); ROW_STORE(3); ROW_STORE(4); ROW_STORE(5);
}

// One row: the edge of M (fewer than 6 rows left).
static void ukr1(int64_t K, const float *A, int64_t lda, const float *B, int64_t ldb,
                 float *C, int64_t ldc, __m256i m0, __m256i m1) {
    (void)ldc;
    __m256 c00 = _mm256_setzero_ps(), c01 = c00;
    for (int64_t k = 0; k < K; k++) {
        const __m256 b0 = _mm256_maskload_ps(B + k * ldb, m0);
        const __m256 b1 = _mm256_maskload_ps(B + k * ldb + 8, m1);
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
                        ukr6(kc, Ab, lda, Bb, ldb, Cb, ldc, tail_mask(nr), tail_mask(nr - 8));
                    else
                        for (int64_t r = 0; r < mr; r++)
                            ukr1(kc, Ab + r * lda, lda, Bb, ldb, Cb + r * ldc, ldc,
                                 tail_mask(nr), tail_mask(nr - 8));
                }
            }
        }
    }
}

static void gemm_nn(float *C, int64_t ldc, const float *A, int64_t lda,
                    const float *B, int64_t ldb, int64_t M, int64_t N,
                    int64_t K) {
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j += 8)
            _mm256_maskstore_ps(C + i * ldc + j, tail_mask(N - j), _mm256_setzero_ps());
    gemm_nn_acc(C, ldc, A, lda, B, ldb, M, N, K);
}

// exp(x) for 8 lanes: Cephes expf. NaN propagates; x < -87.3 gives 0.
static inline __m256 exp256(__m256 x) {
    const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_LT_OQ);
    x = _mm256_max_ps(_mm256_set1_ps(-87.3f), x);  // NaN x is kept
    x = _mm256_min_ps(_mm256_set1_ps(88.3f), x);
    const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    // 2^fx: fx in [-126, 128] here; build the exponent bits
    __m256i n = _mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127));
    n = _mm256_max_epi32(n, _mm256_setzero_si256());
    const __m256 pow2 = _mm256_castsi256_ps(_mm256_slli_epi32(n, 23));
    return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, pow2));
}

static float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static float hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static float softmax_update(float *x, int64_t n, float *m, float *l) {
    __m256 vmax = _mm256_set1_ps(*m);
    for (int64_t j = 0; j < n; j += 8) {
        const __m256i k = tail_mask(n - j);
        const __m256 v = _mm256_blendv_ps(vmax, _mm256_maskload_ps(x + j, k),
                                          _mm256_castsi256_ps(k));
        vmax = _mm256_max_ps(vmax, v);
    }
    const float mx = hmax(vmax);
    if (mx == -INFINITY) {
        for (int64_t j = 0; j < n; j += 8)
            _mm256_maskstore_ps(x + j, tail_mask(n - j), _mm256_setzero_ps());
        return 1.0f;
    }
    const __m256 vm = _mm256_set1_ps(mx);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j += 8) {
        const __m256i k = tail_mask(n - j);
        const __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(_mm256_maskload_ps(x + j, k), vm)),
                                       _mm256_castsi256_ps(k));
        _mm256_maskstore_ps(x + j, k, e);
        sum = _mm256_add_ps(sum, e);
    }
    float alpha = _mm_cvtss_f32(_mm256_castps256_ps128(exp256(_mm256_set1_ps(*m - mx))));
    *l = *l * alpha + hsum(sum);
    *m = mx;
    return alpha;
}

static void scale_row(float *y, int64_t n, float a) {
    const __m256 va = _mm256_set1_ps(a);
    for (int64_t j = 0; j < n; j += 8) {
        const __m256i k = tail_mask(n - j);
        _mm256_maskstore_ps(y + j, k, _mm256_mul_ps(_mm256_maskload_ps(y + j, k), va));
    }
}

static void exp_shift(float *x, int64_t n, float c) {
    const __m256 vc = _mm256_set1_ps(c);
    for (int64_t j = 0; j < n; j += 8) {
        const __m256i k = tail_mask(n - j);
        __m256 e = c == -INFINITY ? _mm256_setzero_ps()
                                  : exp256(_mm256_sub_ps(_mm256_maskload_ps(x + j, k), vc));
        _mm256_maskstore_ps(x + j, k, e);
    }
}

void mha__kernels_fill_avx2(mha__kernels *k) {
    k->isa = "avx2";
    k->gemm_nn = gemm_nn;
    k->gemm_nn_acc = gemm_nn_acc;
    k->softmax_update = softmax_update;
    k->scale_row = scale_row;
    k->exp_shift = exp_shift;
}
#endif
