// avx512.c: AVX-512F kernels (built with -mavx512f -mavx2 -mfma -mf16c for
// this file only; used only when the CPU has AVX-512F, see cpu.c): the GEMM
// micro-kernels, the softmax and the flash tiles' row passes, and the
// avx512 table's filler. The decode kernels are avx512_decode.c's; the
// GEMM's blocking around the micro-kernels is gemm_blocking.h's.
//
// gemm: a register-blocked 8 x 32 micro-kernel (16 zmm accumulators, B rows
// loaded 32 floats at a time, A broadcast), partial tiles by AVX-512 masks
// (columns) and smaller row counts (rows).
// gemm_packed (the projections): a 14 x 32 micro-kernel on a pre-packed B,
// see its section below.
// exp: Cephes' expf polynomial (|r| <= ln2/2, degree 5 + 1), 2^n applied by
// vscalefps, which also flushes huge negative inputs to 0.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#include <math.h>

#include "avx512_common.h"
#include "kernels.h"

// ---------------------------------------------------------------------------
// GEMM micro-kernels. The blocking around them (the loops over blocks, the
// packing loops, the edge handling, the slot functions) is gemm_blocking.h,
// shared with the AVX2 table and included below.

// The unpacked GEMM (gemm_nn, gemm_nn_acc, gemm_tn_acc): 8 x 32 tiles in
// 256 x 512 (k x columns) blocks.
#define MR 8
#define NR 32
#define KC 256
#define NC 512

// C[0:MR, 0:nr] (+)= A B[0:K, 0:nr]: 8 x 32 (16 accumulators in named
// registers: an array would be spilled), B rows loaded under the column
// masks m0, m1 (full: all 32 columns, plain loads and stores: no mask
// register in the loop). Element (r, k) of A is A[r*ars + k*aks]: (lda, 1)
// for gemm_nn_acc, (1, lda) for gemm_tn_acc (A stored transposed), the
// strides constant in each after inlining. Every C element: an FMA chain
// from 0 over k in increasing order, then added to C (add), or stored
// (the value of 0 + chain; the bits too, but for a zero whose sign only a
// chain of products that all underflow to -0 could make negative).
#define ROW_FMA(r)                                               \
    do {                                                         \
        const __m512 a = _mm512_set1_ps(A[ars * (r) + k * aks]); \
        c##r##0 = _mm512_fmadd_ps(a, b0, c##r##0);               \
        c##r##1 = _mm512_fmadd_ps(a, b1, c##r##1);               \
    } while (0)
#define ROW_STORE(r)                                                   \
    do {                                                               \
        float *c = C + ldc * (r);                                      \
        __m512 v0 = c##r##0, v1 = c##r##1;                             \
        if (add && full) {                                             \
            v0 = _mm512_add_ps(_mm512_loadu_ps(c), v0);                \
            v1 = _mm512_add_ps(_mm512_loadu_ps(c + 16), v1);           \
        } else if (add) {                                              \
            v0 = _mm512_add_ps(_mm512_maskz_loadu_ps(m0, c), v0);      \
            v1 = _mm512_add_ps(_mm512_maskz_loadu_ps(m1, c + 16), v1); \
        }                                                              \
        if (full) {                                                    \
            _mm512_storeu_ps(c, v0);                                   \
            _mm512_storeu_ps(c + 16, v1);                              \
        } else {                                                       \
            _mm512_mask_storeu_ps(c, m0, v0);                          \
            _mm512_mask_storeu_ps(c + 16, m1, v1);                     \
        }                                                              \
    } while (0)
#define LOAD_B                                                       \
    const __m512 b0 = full ? _mm512_loadu_ps(B + k * ldb)            \
                           : _mm512_maskz_loadu_ps(m0, B + k * ldb); \
    const __m512 b1 = full ? _mm512_loadu_ps(B + k * ldb + 16)       \
                           : _mm512_maskz_loadu_ps(m1, B + k * ldb + 16)

static inline __attribute__((always_inline)) void ukr8(int64_t K, const float *A, int64_t ars,
                                                       int64_t aks, const float *B, int64_t ldb,
                                                       float *C, int64_t ldc, __mmask16 m0,
                                                       __mmask16 m1, bool full, bool add) {
    __m512 c00 = _mm512_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
           c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00, c60 = c00,
           c61 = c00, c70 = c00, c71 = c00;
    for (int64_t k = 0; k < K; k++) {
        LOAD_B;
        ROW_FMA(0);
        ROW_FMA(1);
        ROW_FMA(2);
        ROW_FMA(3);
        ROW_FMA(4);
        ROW_FMA(5);
        ROW_FMA(6);
        ROW_FMA(7);
    }
    ROW_STORE(0);
    ROW_STORE(1);
    ROW_STORE(2);
    ROW_STORE(3);
    ROW_STORE(4);
    ROW_STORE(5);
    ROW_STORE(6);
    ROW_STORE(7);
}

// gemm_blocking.h's ukr_mr: ukr8 specialised on whole tiles (nr >= 32)
// and on add.
static inline __attribute__((always_inline)) void ukr_mr(int64_t K, const float *A,
                                                         int64_t ars, int64_t aks,
                                                         const float *B, int64_t ldb, float *C,
                                                         int64_t ldc, int64_t nr, bool add) {
    const __mmask16 m0 = tail_mask(nr), m1 = tail_mask(nr - 16);
    if (nr >= NR && add) ukr8(K, A, ars, aks, B, ldb, C, ldc, m0, m1, true, true);
    else if (nr >= NR) ukr8(K, A, ars, aks, B, ldb, C, ldc, m0, m1, true, false);
    else if (add) ukr8(K, A, ars, aks, B, ldb, C, ldc, m0, m1, false, true);
    else ukr8(K, A, ars, aks, B, ldb, C, ldc, m0, m1, false, false);
}

// One row: the edge of M (fewer than MR rows left).
static inline __attribute__((always_inline)) void ukr_row(int64_t K, const float *A,
                                                          int64_t ars, int64_t aks,
                                                          const float *B, int64_t ldb, float *C,
                                                          int64_t ldc, int64_t nr, bool add) {
    (void)ars;
    (void)ldc;
    const bool full = false;
    const __mmask16 m0 = tail_mask(nr), m1 = tail_mask(nr - 16);
    __m512 c00 = _mm512_setzero_ps(), c01 = c00;
    for (int64_t k = 0; k < K; k++) {
        LOAD_B;
        ROW_FMA(0);
    }
    ROW_STORE(0);
}

// The packed GEMM (kernels.h: pack_b, gemm_packed): B in 32-wide panels; A
// in 14-row micro-panels per (112 rows, 256 k) block (~112 KiB, in L2); a
// 14 x 32 micro-kernel: 28 zmm accumulators, per k two aligned-stream B
// loads and 14 broadcasts for 28 FMAs (a 32 x 256 B micro-panel, 32 KiB,
// stays in L1 across the row tiles).
#define PMR 14
#define PNR 32
#define PKC 256
#define PMC (PMR * 8)

// dst[k*ldd + i] = src[i*lds + k] for i < rows (<= 16; lanes rows..15 of
// each dst row: 0, stored under mask `store` only), k < kn: 16 k at a time.
static void transpose_rows(float *dst, int64_t ldd, __mmask16 store, const float *src,
                           int64_t lds, int64_t rows, int64_t kn) {
    __m512 r[16];
    for (int64_t k0 = 0; k0 < kn; k0 += 16) {
        const int64_t kk = kn - k0 < 16 ? kn - k0 : 16;
        const __mmask16 mk = tail_mask(kk);
        for (int i = 0; i < 16; i++)
            r[i] = i < rows ? _mm512_maskz_loadu_ps(mk, src + i * lds + k0)
                            : _mm512_setzero_ps();
        transpose16(r);
        for (int64_t k = 0; k < kk; k++)
            _mm512_mask_storeu_ps(dst + (k0 + k) * ldd, store, r[k]);
    }
}

// transpose (kernels.h): 16 rows of src at a time through transpose_rows.
static void transpose(float *dst, int64_t ldd, const float *src, int64_t lds, int64_t rows,
                      int64_t cols) {
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        const int64_t n = rows - r0 < 16 ? rows - r0 : 16;
        transpose_rows(dst + r0, ldd, tail_mask(n), src + r0 * lds, lds, n, cols);
    }
}

// A panel P (K, 32) <- columns [0, nr) of B, zero past nr.
static inline void pack_b_panel(float *P, const float *B, int64_t sk, int64_t sn, int64_t K,
                                int64_t nr) {
    if (sn == 1) {
        const __mmask16 m0 = tail_mask(nr), m1 = tail_mask(nr - 16);
        for (int64_t k = 0; k < K; k++) {
            const float *b = B + k * sk;
            _mm512_storeu_ps(P + k * PNR, _mm512_maskz_loadu_ps(m0, b));
            _mm512_storeu_ps(P + k * PNR + 16, _mm512_maskz_loadu_ps(m1, b + 16));
        }
    } else if (sk == 1) {  // columns of B contiguous (B = W^T): transpose
        for (int64_t h = 0; h < 2; h++) {
            const int64_t rows = nr - 16 * h;
            transpose_rows(P + 16 * h, PNR, 0xffff, B + 16 * h * sn, sn, rows > 0 ? rows : 0, K);
        }
    } else {
        for (int64_t k = 0; k < K; k++)
            for (int64_t j = 0; j < PNR; j++)
                P[k * PNR + j] = j < nr ? B[k * sk + j * sn] : 0.0f;
    }
}

// A micro-panel Ap (kc, 14) <- A (rows, kc), rows past `rows` zero.
static inline void pack_a_tile(float *Ap, const float *A, int64_t lda, int64_t rows,
                               int64_t kc) {
    transpose_rows(Ap, PMR, (__mmask16)((1u << PMR) - 1u), A, lda, rows, kc);
}

// Ap[0:14] <- A[0:rows], zero past rows.
static inline void pack_a_t_k(float *Ap, const float *A, int64_t rows) {
    const __mmask16 st = (__mmask16)((1u << PMR) - 1u);
    _mm512_mask_storeu_ps(Ap, st, _mm512_maskz_loadu_ps(st & tail_mask(rows), A));
}

#define PK_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13)
#define PK_DECL(r) __m512 c##r##a = _mm512_setzero_ps(), c##r##b = _mm512_setzero_ps();
#define PK_FMA(r)                                  \
    {                                              \
        const __m512 a = _mm512_set1_ps(Ap[r]);    \
        c##r##a = _mm512_fmadd_ps(a, b0, c##r##a); \
        c##r##b = _mm512_fmadd_ps(a, b1, c##r##b); \
    }
#define PK_STORE(r)                                                    \
    if ((r) < mr) {                                                    \
        float *c = C + ldc * (r);                                      \
        __m512 v0 = c##r##a, v1 = c##r##b;                             \
        if (add) {                                                     \
            v0 = _mm512_add_ps(_mm512_maskz_loadu_ps(m0, c), v0);      \
            v1 = _mm512_add_ps(_mm512_maskz_loadu_ps(m1, c + 16), v1); \
        }                                                              \
        if (bias) {                                                    \
            v0 = _mm512_add_ps(v0, bb0);                               \
            v1 = _mm512_add_ps(v1, bb1);                               \
        }                                                              \
        _mm512_mask_storeu_ps(c, m0, v0);                              \
        _mm512_mask_storeu_ps(c + 16, m1, v1);                         \
    }

// the C tile's lines, wanted by the stores at the end
#define PK_PF(r)                                                       \
    if ((r) < mr) {                                                    \
        _mm_prefetch((const char *)(C + ldc * (r)), _MM_HINT_T0);      \
        _mm_prefetch((const char *)(C + ldc * (r) + 31), _MM_HINT_T0); \
    }
// 16 elements of a packed B from element e: float32 (kind 0), or bf16 (1)
// / f16 (2) widened (exact)
static inline __attribute__((always_inline)) __m512 ldb(const void *B, int64_t e, int kind) {
    if (kind == 0) return _mm512_loadu_ps((const float *)B + e);
    const __m256i h = _mm256_loadu_si256((const __m256i *)(const void *)((const uint16_t *)B +
                                                                         e));
    if (kind == 1) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

// C[0:mr, 0:32 under the masks of nr] = [C +] Ap (14, kc) Bp (kc, 32)
// [+ bias] (kind: B's elements). pf: one 64-byte line per k, prefetched
// into L2 (a part of the next panel: B streams from L3 when it outgrows
// L2). Without this and the C prefetch, the N = 2304 projection ran ~8%
// slower.
static inline __attribute__((always_inline)) void ukr_packed_any(
    int64_t kc, const float *Ap, const void *Bp, int kind, float *C, int64_t ldc, int64_t mr,
    int64_t nr, bool add, const float *bias, const char *pf) {
    const __mmask16 m0 = tail_mask(nr), m1 = tail_mask(nr - 16);
    PK_ROWS(PK_DECL)
    PK_ROWS(PK_PF)
#pragma GCC unroll 4
    for (int64_t k = 0; k < kc; k++) {
        const __m512 b0 = ldb(Bp, k * PNR, kind), b1 = ldb(Bp, k * PNR + 16, kind);
        _mm_prefetch(pf + 64 * k, _MM_HINT_T1);
        PK_ROWS(PK_FMA)
        Ap += PMR;
    }
    __m512 bb0 = _mm512_setzero_ps(), bb1 = bb0;
    if (bias) {
        bb0 = _mm512_maskz_loadu_ps(m0, bias);
        bb1 = _mm512_maskz_loadu_ps(m1, bias + 16);
    }
    PK_ROWS(PK_STORE)
}

#include "gemm_blocking.h"

// gemm_nn: the first k chunk stored, not added to zeros (the same bits).
static void gemm_nn(float *C, int64_t ldc, const float *A, int64_t lda, const float *B,
                    int64_t ldb, int64_t M, int64_t N, int64_t K) {
    if (K <= 0)
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < N; j += 16)
                _mm512_mask_storeu_ps(C + i * ldc + j, tail_mask(N - j), _mm512_setzero_ps());
    gemm_acc(C, ldc, A, lda, 1, B, ldb, M, N, K, true);
}

// exp(x) for 16 lanes: Cephes expf. NaN propagates; x < -87.3 (where
// exp(x) < FLT_MIN) gives 0: no denormal results, whose microcode assists
// cost hundreds of cycles each (masked scores, the first tile's alpha).
static inline __m512 exp512(__m512 x) {
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_LT_OQ);
    x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);  // NaN x is kept (2nd operand)
    x = _mm512_min_ps(_mm512_set1_ps(89.0f), x);
    const __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x,
                                                         _mm512_set1_ps(1.44269504088896341f)),
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
    return _mm512_mask_mov_ps(_mm512_scalef_ps(p, fx), tiny, _mm512_setzero_ps());
}

static float softmax_update(float *x, int64_t n, float *m, float *l) {
    __m512 vmax = _mm512_set1_ps(*m);
    for (int64_t j = 0; j < n; j += 16)
        vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(vmax, tail_mask(n - j), x + j));
    float mx = _mm512_reduce_max_ps(vmax);
    if (mx == -INFINITY) {
        if (!mha__row_has_nan(x, n)) {
            for (int64_t j = 0; j < n; j += 16)
                _mm512_mask_storeu_ps(x + j, tail_mask(n - j), _mm512_setzero_ps());
            return 1.0f;
        }
        mx = NAN;  // a NaN score: the row becomes NaN
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

// Four rows at a time: the same operations per row as softmax_update,
// interleaved so the max/sum reductions and the scalar alpha of one row
// overlap with the others'. A row with nothing visible yet (max -inf)
// sends its group through softmax_update.
static void softmax_rows(float *x, int64_t ldx, int64_t R, int64_t n, float *m, float *l,
                         float *alpha) {
    int64_t r = 0;
    for (; r + 4 <= R; r += 4) {
        float *x0 = x + r * ldx, *x1 = x0 + ldx, *x2 = x1 + ldx, *x3 = x2 + ldx;
        __m512 v0 = _mm512_set1_ps(m[r]), v1 = _mm512_set1_ps(m[r + 1]),
               v2 = _mm512_set1_ps(m[r + 2]), v3 = _mm512_set1_ps(m[r + 3]);
        for (int64_t j = 0; j < n; j += 16) {
            const __mmask16 k = tail_mask(n - j);
            v0 = _mm512_max_ps(v0, _mm512_mask_loadu_ps(v0, k, x0 + j));
            v1 = _mm512_max_ps(v1, _mm512_mask_loadu_ps(v1, k, x1 + j));
            v2 = _mm512_max_ps(v2, _mm512_mask_loadu_ps(v2, k, x2 + j));
            v3 = _mm512_max_ps(v3, _mm512_mask_loadu_ps(v3, k, x3 + j));
        }
        const float mx0 = _mm512_reduce_max_ps(v0), mx1 = _mm512_reduce_max_ps(v1),
                    mx2 = _mm512_reduce_max_ps(v2), mx3 = _mm512_reduce_max_ps(v3);
        if (mx0 == -INFINITY || mx1 == -INFINITY || mx2 == -INFINITY || mx3 == -INFINITY) {
            for (int64_t i = r; i < r + 4; i++)
                alpha[i] = softmax_update(x + i * ldx, n, &m[i], &l[i]);
            continue;
        }
        const __m512 w0 = _mm512_set1_ps(mx0), w1 = _mm512_set1_ps(mx1),
                     w2 = _mm512_set1_ps(mx2), w3 = _mm512_set1_ps(mx3);
        __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        for (int64_t j = 0; j < n; j += 16) {
            const __mmask16 k = tail_mask(n - j);
            const __m512 e0 = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x0 + j), w0));
            const __m512 e1 = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x1 + j), w1));
            const __m512 e2 = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x2 + j), w2));
            const __m512 e3 = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x3 + j), w3));
            _mm512_mask_storeu_ps(x0 + j, k, e0);
            _mm512_mask_storeu_ps(x1 + j, k, e1);
            _mm512_mask_storeu_ps(x2 + j, k, e2);
            _mm512_mask_storeu_ps(x3 + j, k, e3);
            s0 = _mm512_add_ps(s0, _mm512_maskz_mov_ps(k, e0));
            s1 = _mm512_add_ps(s1, _mm512_maskz_mov_ps(k, e1));
            s2 = _mm512_add_ps(s2, _mm512_maskz_mov_ps(k, e2));
            s3 = _mm512_add_ps(s3, _mm512_maskz_mov_ps(k, e3));
        }
        // alpha per row, lane by lane as softmax_update's exp512(set1(.))
        float a[16];
        _mm512_storeu_ps(a, exp512(_mm512_setr_ps(m[r] - mx0, m[r + 1] - mx1, m[r + 2] - mx2,
                                                  m[r + 3] - mx3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                  0, 0)));
        const float sum[4] = {_mm512_reduce_add_ps(s0), _mm512_reduce_add_ps(s1),
                              _mm512_reduce_add_ps(s2), _mm512_reduce_add_ps(s3)};
        const float mx[4] = {mx0, mx1, mx2, mx3};
        for (int i = 0; i < 4; i++) {
            l[r + i] = l[r + i] * a[i] + sum[i];
            m[r + i] = mx[i];
            alpha[r + i] = a[i];
        }
    }
    for (; r < R; r++) alpha[r] = softmax_update(x + r * ldx, n, &m[r], &l[r]);
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

// exp_shift then scale_row, row by row, each vector in one go (the same
// operations, so the same bits).
static void exp_scale_rows(float *x, int64_t ld, int64_t R, int64_t n, const float *st) {
    for (int64_t r = 0; r < R; r++) {
        float *xr = x + r * ld;
        const float c = st[2 * r];
        const __m512 vc = _mm512_set1_ps(c), va = _mm512_set1_ps(st[2 * r + 1]);
        for (int64_t j = 0; j < n; j += 16) {
            const __mmask16 k = tail_mask(n - j);
            __m512 e = c == -INFINITY
                           ? _mm512_setzero_ps()
                           : exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, xr + j), vc));
            _mm512_mask_storeu_ps(xr + j, k, _mm512_mul_ps(e, va));
        }
    }
}

// 16 lanes = the contract's 16 partial sums (masked tail lanes add 0 * 0);
// the lanes then summed in order, as the contract says.
static void dot_acc_rows(float *sum, const float *a, const float *b, int64_t ld, int64_t R,
                         int64_t n) {
    for (int64_t r = 0; r < R; r++) {
        const float *ar = a + r * ld, *br = b + r * ld;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; j += 16) {
            const __mmask16 k = tail_mask(n - j);
            acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, ar + j),
                                                   _mm512_maskz_loadu_ps(k, br + j)));
        }
        float p[16], t = 0.0f;
        _mm512_storeu_ps(p, acc);
        for (int u = 0; u < 16; u++) t += p[u];
        sum[r] += t;
    }
}

static void dsoftmax_rows(float *d, const float *p, int64_t ld, int64_t R, int64_t n,
                          const float *ds) {
    for (int64_t r = 0; r < R; r++) {
        float *dr = d + r * ld;
        const float *pr = p + r * ld;
        const __m512 c = _mm512_set1_ps(ds[r]);
        for (int64_t j = 0; j < n; j += 16) {
            const __mmask16 k = tail_mask(n - j);
            const __m512 v = _mm512_sub_ps(_mm512_maskz_loadu_ps(k, dr + j), c);
            _mm512_mask_storeu_ps(dr + j, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, pr + j), v));
        }
    }
}

// 16 floats -> 16 bf16 (generic.c's rule), lanes of mask k
static inline void round16(uint16_t *dst, __m512 x, __mmask16 k) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i abs = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(abs, _mm512_set1_epi32(0x7f800000));
    const __mmask16 sub = _mm512_testn_epi32_mask(u, _mm512_set1_epi32(0x7f800000));
    const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                          _mm512_and_si512(_mm512_srli_epi32(u, 16),
                                                           _mm512_set1_epi32(1)));
    __m512i r = _mm512_add_epi32(u, bias);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
    r = _mm512_mask_mov_epi32(r, sub, _mm512_and_si512(u, _mm512_set1_epi32((int)0x80000000u)));
    _mm512_mask_cvtepi32_storeu_epi16(dst, k, _mm512_srli_epi32(r, 16));
}

static void round_bf16(uint16_t *dst, const float *src, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) round16(dst + i, _mm512_loadu_ps(src + i), 0xffff);
    if (i < n)
        round16(dst + i, _mm512_maskz_loadu_ps((__mmask16)((1u << (n - i)) - 1), src + i),
                (__mmask16)((1u << (n - i)) - 1));
}


void mha__kernels_fill_avx512(mha__kernels *k) {
    k->isa = "avx512";
    k->bf_fast = false;  // bf16 rows are converted and computed in float32
    k->gemm_nn = gemm_nn;
    k->gemm_nn_acc = gemm_nn_acc;
    k->gemm_tn_acc = gemm_tn_acc;
    k->softmax_update = softmax_update;
    k->softmax_rows = softmax_rows;
    k->round_bf16 = round_bf16;
    mha__kernels_fill_avx512_decode(k);  // avx512_decode.c
    k->scale_row = scale_row;
    k->exp_shift = exp_shift;
    k->exp_scale_rows = exp_scale_rows;
    k->dot_acc_rows = dot_acc_rows;
    k->dsoftmax_rows = dsoftmax_rows;
    k->transpose = transpose;
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
