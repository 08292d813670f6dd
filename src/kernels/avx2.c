// avx2.c: AVX2 + FMA kernels (built with -mavx2 -mfma -mf16c for this file
// only; used only when the CPU has all three, see cpu.c): the GEMM
// micro-kernels, the softmax and the flash tiles' row passes, and the avx2
// table's filler. The decode kernels are avx2_decode.c's; the GEMM's
// blocking around the micro-kernels is gemm_blocking.h's.
//
// gemm: a register-blocked 6 x 16 micro-kernel (12 ymm accumulators),
// partial column tiles by maskload/maskstore.
// gemm_packed (the projections): a 6 x 16 micro-kernel on a pre-packed B,
// see its section below.
// exp: Cephes' expf polynomial; 2^n built in the exponent bits, inputs
// below -87.3 flushed to 0.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#include <math.h>

#include "avx2_common.h"
#include "kernels.h"

// ---------------------------------------------------------------------------
// GEMM micro-kernels. The blocking around them (the loops over blocks, the
// packing loops, the edge handling, the slot functions) is gemm_blocking.h,
// shared with the AVX-512 table and included below.

// The unpacked GEMM (gemm_nn, gemm_nn_acc, gemm_tn_acc): 6 x 16 tiles in
// 256 x 512 (k x columns) blocks.
#define MR 6
#define NR 16
#define KC 256
#define NC 512

// C[0:MR, 0:nr] (+)= A B[0:K, 0:nr]: 6 x 16 (12 accumulators in named
// registers: an array would be spilled), B rows loaded under the column
// masks m0, m1. Element (r, k) of A is A[r*ars + k*aks]: (lda, 1) for
// gemm_nn_acc, (1, lda) for gemm_tn_acc (A stored transposed), the strides
// constant in each after inlining. Every C element: an FMA chain from 0 over
// k in increasing order, then added to C (add) or stored.
#define ROW_FMA(r)                                                     \
    do {                                                               \
        const __m256 a = _mm256_broadcast_ss(A + ars * (r) + k * aks); \
        c##r##0 = _mm256_fmadd_ps(a, b0, c##r##0);                     \
        c##r##1 = _mm256_fmadd_ps(a, b1, c##r##1);                     \
    } while (0)
#define ROW_STORE(r)                                               \
    do {                                                           \
        float *c = C + ldc * (r);                                  \
        __m256 v0 = c##r##0, v1 = c##r##1;                         \
        if (add) {                                                 \
            v0 = _mm256_add_ps(_mm256_maskload_ps(c, m0), v0);     \
            v1 = _mm256_add_ps(_mm256_maskload_ps(c + 8, m1), v1); \
        }                                                          \
        _mm256_maskstore_ps(c, m0, v0);                            \
        _mm256_maskstore_ps(c + 8, m1, v1);                        \
    } while (0)
#define LOAD_B                                             \
    const __m256 b0 = _mm256_maskload_ps(B + k * ldb, m0); \
    const __m256 b1 = _mm256_maskload_ps(B + k * ldb + 8, m1)

// gemm_blocking.h's ukr_mr.
static inline __attribute__((always_inline)) void ukr_mr(int64_t K, const float *A,
                                                         int64_t ars, int64_t aks,
                                                         const float *B, int64_t ldb, float *C,
                                                         int64_t ldc, int64_t nr, bool add) {
    const __m256i m0 = tail_mask(nr), m1 = tail_mask(nr - 8);
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
           c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    for (int64_t k = 0; k < K; k++) {
        LOAD_B;
        ROW_FMA(0);
        ROW_FMA(1);
        ROW_FMA(2);
        ROW_FMA(3);
        ROW_FMA(4);
        ROW_FMA(5);
    }
    ROW_STORE(0);
    ROW_STORE(1);
    ROW_STORE(2);
    ROW_STORE(3);
    ROW_STORE(4);
    ROW_STORE(5);
}

// One row: the edge of M (fewer than MR rows left).
static inline __attribute__((always_inline)) void ukr_row(int64_t K, const float *A,
                                                          int64_t ars, int64_t aks,
                                                          const float *B, int64_t ldb, float *C,
                                                          int64_t ldc, int64_t nr, bool add) {
    (void)ars;
    (void)ldc;
    const __m256i m0 = tail_mask(nr), m1 = tail_mask(nr - 8);
    __m256 c00 = _mm256_setzero_ps(), c01 = c00;
    for (int64_t k = 0; k < K; k++) {
        LOAD_B;
        ROW_FMA(0);
    }
    ROW_STORE(0);
}

// The packed GEMM (kernels.h: pack_b, gemm_packed): B in 16-wide panels; A
// in 6-row micro-panels per (96 rows, 256 k) block; a 6 x 16 micro-kernel
// (12 ymm accumulators).
#define PMR 6
#define PNR 16
#define PKC 256
#define PMC (PMR * 16)

// A panel P (K, 16) <- columns [0, nr) of B, zero past nr.
static inline void pack_b_panel(float *P, const float *B, int64_t sk, int64_t sn, int64_t K,
                                int64_t nr) {
    if (sn == 1) {
        const __m256i m0 = tail_mask(nr), m1 = tail_mask(nr - 8);
        for (int64_t k = 0; k < K; k++) {
            const float *b = B + k * sk;
            _mm256_storeu_ps(P + k * PNR, _mm256_maskload_ps(b, m0));
            _mm256_storeu_ps(P + k * PNR + 8, _mm256_maskload_ps(b + 8, m1));
        }
    } else {  // B = W^T and other strides: nr streams along k, rows of P written whole
        for (int64_t k = 0; k < K; k++) {
            const float *b = B + k * sk;
            float *pk = P + k * PNR;
            for (int64_t j = 0; j < PNR; j++) pk[j] = j < nr ? b[j * sn] : 0.0f;
        }
    }
}

// A micro-panel Ap (kc, 6) <- A (rows, kc), rows past `rows` zero.
static inline void pack_a_tile(float *Ap, const float *A, int64_t lda, int64_t rows,
                               int64_t kc) {
    for (int64_t r = 0; r < PMR; r++) {
        const float *a = A + r * lda;
        if (r < rows)
            for (int64_t k = 0; k < kc; k++) Ap[k * PMR + r] = a[k];
        else
            for (int64_t k = 0; k < kc; k++) Ap[k * PMR + r] = 0.0f;
    }
}

// Ap[0:6] <- A[0:rows], zero past rows (no element of A past rows read;
// 4 + 2 floats stored: no masked store, slow on some CPUs).
static inline void pack_a_t_k(float *Ap, const float *A, int64_t rows) {
    const __m256 v = _mm256_maskload_ps(A, tail_mask(rows));
    _mm_storeu_ps(Ap, _mm256_castps256_ps128(v));
    _mm_storel_pi((__m64 *)(void *)(Ap + 4), _mm256_extractf128_ps(v, 1));
}

#define PK_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
#define PK_DECL(r) __m256 c##r##a = _mm256_setzero_ps(), c##r##b = _mm256_setzero_ps();
#define PK_FMA(r)                                       \
    {                                                   \
        const __m256 a = _mm256_broadcast_ss(Ap + (r)); \
        c##r##a = _mm256_fmadd_ps(a, b0, c##r##a);      \
        c##r##b = _mm256_fmadd_ps(a, b1, c##r##b);      \
    }
#define PK_STORE(r)                                                \
    if ((r) < mr) {                                                \
        float *c = C + ldc * (r);                                  \
        __m256 v0 = c##r##a, v1 = c##r##b;                         \
        if (add) {                                                 \
            v0 = _mm256_add_ps(_mm256_maskload_ps(c, m0), v0);     \
            v1 = _mm256_add_ps(_mm256_maskload_ps(c + 8, m1), v1); \
        }                                                          \
        if (bias) {                                                \
            v0 = _mm256_add_ps(v0, bb0);                           \
            v1 = _mm256_add_ps(v1, bb1);                           \
        }                                                          \
        _mm256_maskstore_ps(c, m0, v0);                            \
        _mm256_maskstore_ps(c + 8, m1, v1);                        \
    }

#define PK_PF(r) \
    if ((r) < mr) _mm_prefetch((const char *)(C + ldc * (r)), _MM_HINT_T0);
// 8 elements of a packed B from element e: float32 (kind 0), or bf16 (1) /
// f16 (2) widened (exact)
static inline __attribute__((always_inline)) __m256 ldb(const void *B, int64_t e, int kind) {
    if (kind == 0) return _mm256_loadu_ps((const float *)B + e);
    const __m128i h = _mm_loadu_si128((const __m128i *)(const void *)((const uint16_t *)B + e));
    if (kind == 1) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

// C[0:mr, 0:16 under the masks of nr] = [C +] Ap (6, kc) Bp (kc, 16)
// [+ bias] (kind: B's elements). pf: one 64-byte line every other k,
// prefetched into L2 (a part of the next panel).
static inline __attribute__((always_inline)) void ukr_packed_any(
    int64_t kc, const float *Ap, const void *Bp, int kind, float *C, int64_t ldc, int64_t mr,
    int64_t nr, bool add, const float *bias, const char *pf) {
    const __m256i m0 = tail_mask(nr), m1 = tail_mask(nr - 8);
    PK_ROWS(PK_DECL)
    PK_ROWS(PK_PF)
#pragma GCC unroll 4
    for (int64_t k = 0; k < kc; k++) {
        const __m256 b0 = ldb(Bp, k * PNR, kind), b1 = ldb(Bp, k * PNR + 8, kind);
        if (k % 2 == 0) _mm_prefetch(pf + 32 * k, _MM_HINT_T1);
        PK_ROWS(PK_FMA)
        Ap += PMR;
    }
    __m256 bb0 = _mm256_setzero_ps(), bb1 = bb0;
    if (bias) {
        bb0 = _mm256_maskload_ps(bias, m0);
        bb1 = _mm256_maskload_ps(bias + 8, m1);
    }
    PK_ROWS(PK_STORE)
}

#include "gemm_blocking.h"

// gemm_nn: C zeroed, then gemm_nn_acc (0 + the first chunk's sum).
static void gemm_nn(float *C, int64_t ldc, const float *A, int64_t lda, const float *B,
                    int64_t ldb, int64_t M, int64_t N, int64_t K) {
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
    float mx = hmax(vmax);
    if (mx == -INFINITY) {
        if (!mha__row_has_nan(x, n)) {
            for (int64_t j = 0; j < n; j += 8)
                _mm256_maskstore_ps(x + j, tail_mask(n - j), _mm256_setzero_ps());
            return 1.0f;
        }
        mx = NAN;  // a NaN score: the row becomes NaN
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

static void softmax_rows(float *x, int64_t ldx, int64_t R, int64_t n, float *m, float *l,
                         float *alpha) {
    for (int64_t r = 0; r < R; r++) alpha[r] = softmax_update(x + r * ldx, n, &m[r], &l[r]);
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

// exp_shift then scale_row, row by row, each vector in one go (the same
// operations, so the same bits).
static void exp_scale_rows(float *x, int64_t ld, int64_t R, int64_t n, const float *st) {
    for (int64_t r = 0; r < R; r++) {
        float *xr = x + r * ld;
        const float c = st[2 * r];
        const __m256 vc = _mm256_set1_ps(c), va = _mm256_set1_ps(st[2 * r + 1]);
        for (int64_t j = 0; j < n; j += 8) {
            const __m256i k = tail_mask(n - j);
            __m256 e = c == -INFINITY
                           ? _mm256_setzero_ps()
                           : exp256(_mm256_sub_ps(_mm256_maskload_ps(xr + j, k), vc));
            _mm256_maskstore_ps(xr + j, k, _mm256_mul_ps(e, va));
        }
    }
}

// Two 8-lane accumulators = the contract's 16 partial sums (lanes 0-7 and
// 8-15; masked tail lanes add 0 * 0), then summed in order.
static void dot_acc_rows(float *sum, const float *a, const float *b, int64_t ld, int64_t R,
                         int64_t n) {
    for (int64_t r = 0; r < R; r++) {
        const float *ar = a + r * ld, *br = b + r * ld;
        __m256 lo = _mm256_setzero_ps(), hi = lo;
        for (int64_t j = 0; j < n; j += 16) {
            const __m256i k0 = tail_mask(n - j), k1 = tail_mask(n - j - 8);
            lo = _mm256_add_ps(lo, _mm256_mul_ps(_mm256_maskload_ps(ar + j, k0),
                                                 _mm256_maskload_ps(br + j, k0)));
            hi = _mm256_add_ps(hi, _mm256_mul_ps(_mm256_maskload_ps(ar + j + 8, k1),
                                                 _mm256_maskload_ps(br + j + 8, k1)));
        }
        float p[16], t = 0.0f;
        _mm256_storeu_ps(p, lo);
        _mm256_storeu_ps(p + 8, hi);
        for (int u = 0; u < 16; u++) t += p[u];
        sum[r] += t;
    }
}

static void dsoftmax_rows(float *d, const float *p, int64_t ld, int64_t R, int64_t n,
                          const float *ds) {
    for (int64_t r = 0; r < R; r++) {
        float *dr = d + r * ld;
        const float *pr = p + r * ld;
        const __m256 c = _mm256_set1_ps(ds[r]);
        for (int64_t j = 0; j < n; j += 8) {
            const __m256i k = tail_mask(n - j);
            const __m256 v = _mm256_sub_ps(_mm256_maskload_ps(dr + j, k), c);
            _mm256_maskstore_ps(dr + j, k, _mm256_mul_ps(_mm256_maskload_ps(pr + j, k), v));
        }
    }
}

void mha__kernels_fill_avx2(mha__kernels *k) {
    k->isa = "avx2";
    k->bf_fast = false;  // bf16 rows are converted and computed in float32
    k->gemm_nn = gemm_nn;
    k->gemm_nn_acc = gemm_nn_acc;
    k->gemm_tn_acc = gemm_tn_acc;
    k->softmax_update = softmax_update;
    k->softmax_rows = softmax_rows;
    k->scale_row = scale_row;
    k->exp_shift = exp_shift;
    k->exp_scale_rows = exp_scale_rows;
    k->dot_acc_rows = dot_acc_rows;
    k->dsoftmax_rows = dsoftmax_rows;
    mha__kernels_fill_avx2_decode(k);  // avx2_decode.c
    k->pk_nr = PNR;
    k->pk_mr = PMR;
    k->pk_kc = PKC;
    k->pk_apack = PMC * PKC;
    k->pack_b = pack_b;
    k->gemm_packed = gemm_packed;
    k->gemm_packed_tn = gemm_packed_tn;
    k->gemm_packed_bh = gemm_packed_bh;
}
#endif
