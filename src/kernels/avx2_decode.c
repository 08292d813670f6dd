// avx2_decode.c: the AVX2 + FMA decode kernels (built with -mavx2 -mfma
// -mf16c for this file only, as avx2.c; used only when the CPU has all
// three, see cpu.c): one query, or a GQA group of them, against a KV
// cache's rows read in place, of any storage kind (kernels.h: dot_rows_q,
// dot_rows_qg, axpy_rows_q, axpy_rows_qg), and the int8 / int4 integer
// scores (dot_rows_i8, dot_rows_i4: also the avx512 table's). The avx2
// table's filler (avx2.c) takes these slots from
// mha__kernels_fill_avx2_decode.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#include <string.h>

#include "avx2_common.h"
#include "kernels.h"
#include "x86_prefetch.h"


// ---- float32, bf16, f16 and int8 rows (kinds 0..3; kernels.h)
//
// (Prefetching the rows ahead and the caller's next rows: x86_prefetch.h.)

// The caller's next rows at once (a call that does not spread them).
static inline void prefetch_next(const void *pf, size_t pfb) {
    pf_spread f = pf_begin(pf, pfb, 1);
    pf_rest(&f);
}

// 8 elements c..c+7 of row j as float32 (c + 8 <= the row's length).
static inline __attribute__((always_inline)) __m256 q8(const void *A, int64_t lda, int kind,
                                                       int64_t j, int64_t c) {
    if (kind == 0) return _mm256_loadu_ps((const float *)A + j * lda + c);
    if (kind == 3)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
            _mm_loadl_epi64((const __m128i *)((const int8_t *)A + j * lda + c))));
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)A + j * lda + c));
    if (kind == 2) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// The tail c..D-1 (< 8 elements) of row j, zero-padded (no element past D
// read).
static inline __m256 q8_tail(const void *A, int64_t lda, int kind, int64_t j, int64_t c,
                             int64_t D) {
    if (kind == 0) return _mm256_maskload_ps((const float *)A + j * lda + c, tail_mask(D - c));
    uint16_t h[8] = {0};
    int8_t b[8] = {0};
    for (int64_t e = c; e < D; e++) {
        if (kind == 3) b[e - c] = ((const int8_t *)A)[j * lda + e];
        else h[e - c] = ((const uint16_t *)A)[j * lda + e];
    }
    return kind == 3 ? q8(b, 0, 3, 0, 0) : q8(h, 0, kind, 0, 0);
}

// The lane sums of four vectors, (sum a0, sum a1, sum a2, sum a3): one
// transpose-and-add tree; each sum's tree involves its own vector alone
// (a row's bits do not depend on the rows beside it).
static inline __m128 reduce4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 s01 = _mm256_add_ps(_mm256_unpacklo_ps(a0, a1), _mm256_unpackhi_ps(a0, a1));
    const __m256 s23 = _mm256_add_ps(_mm256_unpacklo_ps(a2, a3), _mm256_unpackhi_ps(a2, a3));
    const __m256 t = _mm256_add_ps(_mm256_shuffle_ps(s01, s23, 0x44),
                                   _mm256_shuffle_ps(s01, s23, 0xEE));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// Rows j .. j + nr - 1 (nr 1 or 4) against nq (1 or 2) queries: s[q*lds + j
// + r] = scale_j * (the lane sum of one 8-lane FMA chain over c in order)
// (nr, nq constants after inlining; each (query, row) the same operations
// whatever nr and nq: the same bits).
static inline __attribute__((always_inline)) void dot_qk(float *s, int64_t lds, const void *A,
                                                         int64_t lda, int kind,
                                                         const float *scales, int64_t sld,
                                                         const float *X, int64_t ldx, int nq,
                                                         int nr, int64_t j, int64_t D) {
    __m256 acc[2][4];
    for (int q = 0; q < nq; q++)
        for (int r = 0; r < nr; r++) acc[q][r] = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 8 <= D; c += 8) {
        __m256 a[4];
        for (int r = 0; r < nr; r++) a[r] = q8(A, lda, kind, j + r, c);
        for (int q = 0; q < nq; q++) {
            const __m256 xv = _mm256_loadu_ps(X + q * ldx + c);
            for (int r = 0; r < nr; r++) acc[q][r] = _mm256_fmadd_ps(a[r], xv, acc[q][r]);
        }
    }
    if (c < D) {
        __m256 a[4];
        for (int r = 0; r < nr; r++) a[r] = q8_tail(A, lda, kind, j + r, c, D);
        for (int q = 0; q < nq; q++) {
            const __m256 xv = _mm256_maskload_ps(X + q * ldx + c, tail_mask(D - c));
            for (int r = 0; r < nr; r++) acc[q][r] = _mm256_fmadd_ps(a[r], xv, acc[q][r]);
        }
    }
    const __m256 z = _mm256_setzero_ps();
    for (int q = 0; q < nq; q++) {
        if (nr == 4) {
            __m128 t = reduce4(acc[q][0], acc[q][1], acc[q][2], acc[q][3]);
            if (kind == 3) t = _mm_mul_ps(t, scales4(scales, j, sld));
            _mm_storeu_ps(s + q * lds + j, t);
        } else {
            __m128 t = reduce4(acc[q][0], z, z, z);
            if (kind == 3) t = _mm_mul_ss(t, _mm_load_ss(scales + j * sld));
            s[q * lds + j] = _mm_cvtss_f32(t);
        }
    }
}

// dot_rows_qg for kinds 0..3 (dot_rows_q: ng = 1): 4 rows at a time, the
// queries 2 at a time (each row converted once per pair); the last n % 4
// rows one by one. kind a constant after inlining.
static inline __attribute__((always_inline)) void dot_rows_qgk(
    float *s, int64_t lds, const void *A, int64_t lda, int kind, const float *scales,
    int64_t sld, const float *X, int64_t ldx, int64_t ng, int64_t n, int64_t D, const void *pf,
    size_t pfb) {
    const size_t rb = (size_t)lda * kind_size(kind);
    pf_spread pfs = pf_begin(pf, pfb, n / 4);
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        prefetch_ahead(A, rb, j, 4, n);
        pf_step(&pfs);
        int64_t g = 0;
        for (; g + 2 <= ng; g += 2)
            dot_qk(s + g * lds, lds, A, lda, kind, scales, sld, X + g * ldx, ldx, 2, 4, j, D);
        if (g < ng)
            dot_qk(s + g * lds, lds, A, lda, kind, scales, sld, X + g * ldx, ldx, 1, 4, j, D);
    }
    pf_rest(&pfs);
    for (; j < n; j++)
        for (int64_t g = 0; g < ng; g++)
            dot_qk(s + g * lds, lds, A, lda, kind, scales, sld, X + g * ldx, ldx, 1, 1, j, D);
}

// ---- int4 rows (kind 4; kernels.h): a group of 32 elements is 16 bytes
// and one scale. Each 8 elements' 4 bytes are broadcast to 8 lanes; lane k
// shifted left by 28 - 4k and arithmetically right by 28 holds nibble k's
// signed value q, converted to float exactly. The group's scale s then
// weighs partial sums over the group's elements (dot: s * sum q x) or the
// row's weight (axpy: fl(p s) q): no multiply per element (the values are
// s q; the rounding differs from the portable fl(s q) per element by the
// usual float32 dot product's). The queries (dot) are copied once per
// call, zero past D; the outputs (axpy) are copied over a block of rows
// and back after it (exact). Whole chunks of 64 elements go faster below
// (i4c_*); this is for a head's tail (D % 64) and D > 4096.

// Group g of the row at p, w (1..32) of its elements (no byte past the
// row's ceil(w / 2) read; past w, the high nibble of an odd w's last byte
// is read and its query element or output is 0 / not kept): the signed
// values of elements 8u .. 8u + 7 in v[u].
static inline __attribute__((always_inline)) void i4_q(const uint8_t *p, int64_t g, int64_t w,
                                                       __m256 v[4]) {
    uint8_t t[16] = {0};
    const uint8_t *b = p + 16 * g;
    if (w < 32) {
        memcpy(t, b, (size_t)(w + 1) / 2);
        b = t;
    }
    const __m256i sh = _mm256_setr_epi32(28, 24, 20, 16, 12, 8, 4, 0);
    for (int u = 0; u < 4; u++) {
        int32_t word;
        memcpy(&word, b + 4 * u, 4);
        const __m256i q = _mm256_sllv_epi32(_mm256_set1_epi32(word), sh);
        v[u] = _mm256_cvtepi32_ps(_mm256_srai_epi32(q, 28));
    }
}

// 32 floats of a row (w of them; past w, 0) copied, and back.
static inline void i4_split(float *d, const float *x, int64_t w) {
    for (int64_t k = 0; k < 32; k++) d[k] = k < w ? x[k] : 0.0f;
}
static inline void i4_merge(float *x, const float *d, int64_t w) {
    for (int64_t k = 0; k < w; k++) x[k] = d[k];
}

// A group's 32 values against 32 query elements: sum_u v[u] x[8u..], one
// 8-lane chain (a multiply, then three FMAs).
static inline __attribute__((always_inline)) __m256 i4_dot32(const __m256 v[4], const float *x) {
    __m256 a = _mm256_mul_ps(v[0], _mm256_loadu_ps(x));
    for (int u = 1; u < 4; u++) a = _mm256_fmadd_ps(v[u], _mm256_loadu_ps(x + 8 * u), a);
    return a;
}

// ---- Whole chunks of 64 elements (two groups, 32 bytes): one load, and
// no broadcast. Dword i of the chunk holds elements 8i .. 8i + 7, so every
// lane shifted left by 28 - 4k and arithmetically right by 28 holds
// element 8i + k: lanes 0-3 are in group 2c, lanes 4-7 in group 2c + 1,
// and the two scales weigh the lanes ([s0 s0 s0 s0 s1 s1 s1 s1]). The
// queries (dot) are copied transposed to match (vector k of chunk c: lane
// i = x[64c + 8i + k]), the outputs (axpy) transposed so and back. A
// head's tail (D % 64 elements) goes group by group as above.

// Vector k (0..7, a constant after inlining) of a chunk's bytes.
static inline __attribute__((always_inline)) __m256 i4c_v(__m256i w, int k) {
    const __m256i t = k == 7 ? w : _mm256_slli_epi32(w, 28 - 4 * k);
    return _mm256_cvtepi32_ps(_mm256_srai_epi32(t, 28));
}

// The chunk's lane scales from its two groups' (at sp).
static inline __m256 i4c_scale(const float *sp) {
    const __m128 t = _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)sp));
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(t),
                                    _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

// 64 floats at x to d transposed (d[8k + i] = x[8i + k]), and back.
static inline void i4c_split(float *d, const float *x) {
    for (int i = 0; i < 8; i++)
        for (int k = 0; k < 8; k++) d[8 * k + i] = x[8 * i + k];
}
static inline void i4c_merge(float *x, const float *d) {
    for (int i = 0; i < 8; i++)
        for (int k = 0; k < 8; k++) x[8 * i + k] = d[8 * k + i];
}

// A query's split copy (dp floats): the whole chunks transposed, then the
// tail's groups (w each, zero past w).
static inline void i4_split_query(float *xs, const float *x, int64_t D) {
    int64_t c = 0;
    for (; 64 * c + 64 <= D; c++) i4c_split(xs + 64 * c, x + 64 * c);
    for (int64_t g = 2 * c; 32 * g < D; g++)
        i4_split(xs + 32 * g, x + 32 * g, D - 32 * g < 32 ? D - 32 * g : 32);
}

// The rows ahead (about PF_BYTES) and their scales (sld floats apart;
// unless they lie in the rows), for rows j .. j + nr - 1.
static inline __attribute__((always_inline)) void i4_prefetch(const void *A, size_t rb,
                                                              const float *scales, int64_t sld,
                                                              int64_t j, int64_t nr, int64_t n) {
    const int64_t ahead = pf_rows(rb);
    if (j + ahead + nr > n) return;
    prefetch_ahead(A, rb, j, nr, n);
    if (scales_in_rows(A, rb, scales)) return;
    const char *sp = (const char *)(scales + (j + ahead) * sld);
    for (size_t b = 0; b < (size_t)(nr * sld) * sizeof(float); b += 64)
        _mm_prefetch(sp + b, PF_HINT);
}

// Scores of rows j .. j + nr - 1 (nr 1 or 4) for nq (1 or 2) split queries
// (xs, dp floats apart): per (query, row) one 8-lane FMA chain over the
// groups in order (e0, e1, o0, o1 against the split query), then its lane
// sum (reduce4: the same tree whatever nr and nq, so the same bits).
static inline __attribute__((always_inline)) void dot_i4(float *s, int64_t lds,
                                                         const uint8_t *A, int64_t lda,
                                                         const float *scales, int64_t sld,
                                                         const float *xs, int64_t dp, int nq,
                                                         int nr, int64_t j, int64_t D) {
    const size_t rb = (size_t)(lda / 2);
    __m256 acc[2][4];
    for (int q = 0; q < nq; q++)
        for (int r = 0; r < nr; r++) acc[q][r] = _mm256_setzero_ps();
    const int64_t nc = D / 64;
    for (int64_t c = 0; c < nc; c++) {
        // rows side by side, RB at a time (their chains interleaved; 4 for
        // one query, 2 for two: the registers)
        const int RB = nq == 1 ? 4 : 2;
        for (int r0 = 0; r0 < nr; r0 += RB) {
            const int m = nr < RB ? nr : RB;  // (nr 1 or 4: a constant)
            __m256i w[4];
            __m256 t[2][4];
            for (int r = 0; r < m; r++)
                w[r] = _mm256_loadu_si256((const __m256i *)(A + (size_t)(j + r0 + r) * rb +
                                                            32 * c));
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) {
                __m256 x[2];
                for (int q = 0; q < nq; q++)
                    x[q] = _mm256_loadu_ps(xs + q * dp + 64 * c + 8 * k);
                for (int r = 0; r < m; r++) {
                    const __m256 v = i4c_v(w[r], k);
                    for (int q = 0; q < nq; q++)
                        t[q][r] = k == 0 ? _mm256_mul_ps(v, x[q])
                                         : _mm256_fmadd_ps(v, x[q], t[q][r]);
                }
            }
            for (int r = 0; r < m; r++) {
                const __m256 sv = i4c_scale(scales + (j + r0 + r) * sld + 2 * c);
                for (int q = 0; q < nq; q++)
                    acc[q][r0 + r] = _mm256_fmadd_ps(t[q][r], sv, acc[q][r0 + r]);
            }
        }
    }
    for (int64_t g = 2 * nc; 32 * g < D; g++) {
        const int64_t w = D - 32 * g < 32 ? D - 32 * g : 32;
        for (int r = 0; r < nr; r++) {
            __m256 v[4];
            i4_q(A + (size_t)(j + r) * rb, g, w, v);
            const __m256 sv = _mm256_set1_ps(scales[(j + r) * sld + g]);
            for (int q = 0; q < nq; q++)
                acc[q][r] = _mm256_fmadd_ps(sv, i4_dot32(v, xs + q * dp + 32 * g), acc[q][r]);
        }
    }
    const __m256 z = _mm256_setzero_ps();
    for (int q = 0; q < nq; q++) {
        if (nr == 4)
            _mm_storeu_ps(s + q * lds + j, reduce4(acc[q][0], acc[q][1], acc[q][2], acc[q][3]));
        else s[q * lds + j] = _mm_cvtss_f32(reduce4(acc[q][0], z, z, z));
    }
}

// dot_rows_qg for int4: the queries split on the stack, XS_FLOATS at a time
// (a query too long for it: its elements in order, group by group, through
// a split of one group at a time), 4 rows by 2 queries at a time.
#define XS_FLOATS 4096
static void dot_rows_i4(float *s, int64_t lds, const uint8_t *A, int64_t lda,
                        const float *scales, int64_t sld, const float *X, int64_t ldx,
                        int64_t ng, int64_t n, int64_t D, const void *pf, size_t pfb) {
    const size_t rb = (size_t)(lda / 2);
    const int64_t dp = (D + 31) / 32 * 32;
    float xs[XS_FLOATS];
    if (dp > XS_FLOATS) {  // (D > 4096: rare; row by row, one query at a time)
        prefetch_next(pf, pfb);
        for (int64_t q = 0; q < ng; q++)
            for (int64_t j = 0; j < n; j++) {
                __m256 acc = _mm256_setzero_ps();
                for (int64_t g = 0; 32 * g < D; g++) {
                    const int64_t w = D - 32 * g < 32 ? D - 32 * g : 32;
                    __m256 v[4];
                    i4_split(xs, X + q * ldx + 32 * g, w);
                    i4_q(A + (size_t)j * rb, g, w, v);
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(scales[j * sld + g]), i4_dot32(v, xs),
                                          acc);
                }
                const __m256 z = _mm256_setzero_ps();
                s[q * lds + j] = _mm_cvtss_f32(reduce4(acc, z, z, z));
            }
        return;
    }
    const int64_t per = XS_FLOATS / dp;  // queries a split holds
    for (int64_t q0 = 0; q0 < ng; q0 += per) {
        const int64_t nq = ng - q0 < per ? ng - q0 : per;
        for (int64_t q = 0; q < nq; q++) i4_split_query(xs + q * dp, X + (q0 + q) * ldx, D);
        float *so = s + q0 * lds;
        pf_spread pfs = pf_begin(q0 == 0 ? pf : NULL, pfb, n / 4);
        int64_t j = 0;
        for (; j + 4 <= n; j += 4) {
            i4_prefetch(A, rb, scales, sld, j, 4, n);
            pf_step(&pfs);
            int64_t q = 0;
            for (; q + 2 <= nq; q += 2)
                dot_i4(so + q * lds, lds, A, lda, scales, sld, xs + q * dp, dp, 2, 4, j, D);
            if (q < nq)
                dot_i4(so + q * lds, lds, A, lda, scales, sld, xs + q * dp, dp, 1, 4, j, D);
        }
        pf_rest(&pfs);
        for (; j < n; j++)
            for (int64_t q = 0; q < nq; q++)
                dot_i4(so + q * lds, lds, A, lda, scales, sld, xs + q * dp, dp, 1, 1, j, D);
    }
}

// O[q*ldo + c] += sum_j P[q*ldp + j] A(j, c) over group g's columns (w of
// 32), rows jb .. je - 1 in order, nq (1 or 2) queries: per column one FMA
// chain over the rows (the split accumulators stored between blocks:
// exact); pf: the call's prefetch (NULL: another pass asked for the rows).
static inline __attribute__((always_inline)) void axpy_i4(float *O, int64_t ldo, const float *P,
                                                          int64_t ldp, const uint8_t *A,
                                                          int64_t lda, const float *scales,
                                                          int64_t sld, int nq, int64_t jb,
                                                          int64_t je, int64_t g, int64_t w,
                                                          int64_t n, pf_spread *pf) {
    const size_t rb = (size_t)(lda / 2);
    float t[2][32];
    __m256 acc[2][4];
    for (int q = 0; q < nq; q++) {
        i4_split(t[q], O + q * ldo + 32 * g, w);
        for (int u = 0; u < 4; u++) acc[q][u] = _mm256_loadu_ps(t[q] + 8 * u);
    }
    for (int64_t j = jb; j < je; j++) {
        if (pf) i4_prefetch(A, rb, scales, sld, j, 1, n), pf_step(pf);
        __m256 v[4];
        i4_q(A + (size_t)j * rb, g, w, v);
        const float sg = scales[j * sld + g];
        for (int q = 0; q < nq; q++) {
            const __m256 f = _mm256_set1_ps(P[q * ldp + j] * sg);
            for (int u = 0; u < 4; u++) acc[q][u] = _mm256_fmadd_ps(f, v[u], acc[q][u]);
        }
    }
    for (int q = 0; q < nq; q++) {
        for (int u = 0; u < 4; u++) _mm256_storeu_ps(t[q] + 8 * u, acc[q][u]);
        i4_merge(O + q * ldo + 32 * g, t[q], w);
    }
}

// The same over chunk c's vectors k0 .. k0 + KH - 1 (KH 8 for one query,
// 4 for two: the accumulators in registers), into the transposed outputs
// t (64 floats a query): per column the same chain as axpy_i4, so the
// same bits.
static inline __attribute__((always_inline)) void axpy_i4c(float *t, const float *P,
                                                           int64_t ldp, const uint8_t *A,
                                                           int64_t lda, const float *scales,
                                                           int64_t sld, int nq, int64_t jb,
                                                           int64_t je, int64_t c, int k0,
                                                           int KH, int64_t n, pf_spread *pf) {
    const size_t rb = (size_t)(lda / 2);
    __m256 acc[2][8];
    for (int q = 0; q < nq; q++)
        for (int u = 0; u < KH; u++) acc[q][u] = _mm256_loadu_ps(t + 64 * q + 8 * (k0 + u));
    for (int64_t j = jb; j < je; j++) {
        if (pf) i4_prefetch(A, rb, scales, sld, j, 1, n), pf_step(pf);
        const __m256i w = _mm256_loadu_si256((const __m256i *)(A + (size_t)j * rb + 32 * c));
        const __m256 sv = i4c_scale(scales + j * sld + 2 * c);
        __m256 f[2];
        for (int q = 0; q < nq; q++) f[q] = _mm256_mul_ps(_mm256_set1_ps(P[q * ldp + j]), sv);
#pragma GCC unroll 8
        for (int u = 0; u < KH; u++) {
            const __m256 v = i4c_v(w, k0 + u);
            for (int q = 0; q < nq; q++) acc[q][u] = _mm256_fmadd_ps(f[q], v, acc[q][u]);
        }
    }
    for (int q = 0; q < nq; q++)
        for (int u = 0; u < KH; u++) _mm256_storeu_ps(t + 64 * q + 8 * (k0 + u), acc[q][u]);
}

// axpy_rows_qg for int4: blocks of AXB4 rows (in L1 once read); for each
// block, group by group, 2 queries at a time.
#define AXB4 128
static void axpy_rows_i4(float *O, int64_t ldo, const float *P, int64_t ldp, const uint8_t *A,
                         int64_t lda, const float *scales, int64_t sld, int64_t ng, int64_t n,
                         int64_t Dv, const void *pf, size_t pfb) {
    pf_spread pfs = pf_begin(pf, pfb, n);
    const int64_t nc = Dv / 64;
    for (int64_t jb = 0; jb < n; jb += AXB4) {
        const int64_t je = n - jb < AXB4 ? n : jb + AXB4;
        for (int64_t c = 0; c < nc; c++) {
            float t[2 * 64];
            int64_t q = 0;
            for (; q + 2 <= ng; q += 2) {
                pf_spread *f = c == 0 && q == 0 ? &pfs : NULL;
                i4c_split(t, O + q * ldo + 64 * c);
                i4c_split(t + 64, O + (q + 1) * ldo + 64 * c);
                axpy_i4c(t, P + q * ldp, ldp, A, lda, scales, sld, 2, jb, je, c, 0, 4, n, f);
                axpy_i4c(t, P + q * ldp, ldp, A, lda, scales, sld, 2, jb, je, c, 4, 4, n, NULL);
                i4c_merge(O + q * ldo + 64 * c, t);
                i4c_merge(O + (q + 1) * ldo + 64 * c, t + 64);
            }
            if (q < ng) {
                i4c_split(t, O + q * ldo + 64 * c);
                axpy_i4c(t, P + q * ldp, ldp, A, lda, scales, sld, 1, jb, je, c, 0, 8, n,
                         c == 0 && q == 0 ? &pfs : NULL);
                i4c_merge(O + q * ldo + 64 * c, t);
            }
        }
        for (int64_t g = 2 * nc; 32 * g < Dv; g++) {
            const int64_t w = Dv - 32 * g < 32 ? Dv - 32 * g : 32;
            int64_t q = 0;
            for (; q + 2 <= ng; q += 2)
                axpy_i4(O + q * ldo, ldo, P + q * ldp, ldp, A, lda, scales, sld, 2, jb, je, g,
                        w, n, g == 0 && q == 0 ? &pfs : NULL);
            if (q < ng)
                axpy_i4(O + q * ldo, ldo, P + q * ldp, ldp, A, lda, scales, sld, 1, jb, je, g,
                        w, n, g == 0 && q == 0 ? &pfs : NULL);
        }
    }
    pf_rest(&pfs);
}

static void dot_rows_qg(float *s, int64_t lds, const void *A, int64_t lda, int kind,
                        const float *scales, int64_t sld, const float *X, int64_t ldx,
                        int64_t ng, int64_t n, int64_t D, const void *pf, size_t pfb) {
    if (kind == 4) {
        dot_rows_i4(s, lds, A, lda, scales, sld, X, ldx, ng, n, D, pf, pfb);
    } else if (kind == 0) {
        dot_rows_qgk(s, lds, A, lda, 0, scales, sld, X, ldx, ng, n, D, pf, pfb);
    } else if (kind == 1) {
        dot_rows_qgk(s, lds, A, lda, 1, scales, sld, X, ldx, ng, n, D, pf, pfb);
    } else if (kind == 2) {
        dot_rows_qgk(s, lds, A, lda, 2, scales, sld, X, ldx, ng, n, D, pf, pfb);
    } else {
        dot_rows_qgk(s, lds, A, lda, 3, scales, sld, X, ldx, ng, n, D, pf, pfb);
    }
}

static void dot_rows_q(float *s, const void *A, int64_t lda, int kind, const float *scales,
                       int64_t sld, const float *x, int64_t n, int64_t D, const void *pf,
                       size_t pfb) {
    dot_rows_qg(s, 0, A, lda, kind, scales, sld, x, 0, 1, n, D, pf, pfb);
}

// O[q*ldo + c] += P[q*ldp + j] scale_j A(j, c) for the columns [c0, c0 + w)
// (w 1..32, a constant 32 after inlining where whole), rows jb .. je - 1
// in order: per column one FMA chain over the rows (the accumulators
// stored and reloaded between calls: exact); pf: the call's prefetch
// (NULL: another pass over the block asked for the rows).
static inline __attribute__((always_inline)) void axpy_qk(float *o, const float *p,
                                                          const void *A, int64_t lda, int kind,
                                                          const float *scales, int64_t sld,
                                                          int64_t jb, int64_t je, int64_t c0,
                                                          int64_t w, int64_t n, pf_spread *pf) {
    __m256i m[4];
    __m256 acc[4];
    for (int u = 0; u < 4; u++) {
        m[u] = tail_mask(w - 8 * u);
        acc[u] = _mm256_maskload_ps(o + c0 + 8 * u, m[u]);
    }
    for (int64_t j = jb; j < je; j++) {
        if (pf) prefetch_ahead(A, (size_t)lda * kind_size(kind), j, 1, n), pf_step(pf);
        const __m256 f = _mm256_set1_ps(p[j] * (kind == 3 ? scales[j * sld] : 1.0f));
        for (int u = 0; u < 4; u++) {
            const int64_t c = c0 + 8 * u;
            if (w >= 8 * u + 8) acc[u] = _mm256_fmadd_ps(f, q8(A, lda, kind, j, c), acc[u]);
            else if (w > 8 * u)
                acc[u] = _mm256_fmadd_ps(f, q8_tail(A, lda, kind, j, c, c0 + w), acc[u]);
        }
    }
    for (int u = 0; u < 4; u++) _mm256_maskstore_ps(o + c0 + 8 * u, m[u], acc[u]);
}

// axpy_rows_qg for kinds 0..3 (axpy_rows_q: ng = 1): blocks of AXB rows (in
// L1 once read); for each block, query by query, 32 columns at a time.
#define AXB 32
static inline __attribute__((always_inline)) void axpy_rows_qgk(
    float *O, int64_t ldo, const float *P, int64_t ldp, const void *A, int64_t lda, int kind,
    const float *scales, int64_t sld, int64_t ng, int64_t n, int64_t Dv, const void *pf,
    size_t pfb) {
    pf_spread pfs = pf_begin(pf, pfb, n);
    for (int64_t jb = 0; jb < n; jb += AXB) {
        const int64_t je = n - jb < AXB ? n : jb + AXB;
        for (int64_t g = 0; g < ng; g++)
            for (int64_t c0 = 0; c0 < Dv; c0 += 32) {
                pf_spread *f = g == 0 && c0 == 0 ? &pfs : NULL;
                if (Dv - c0 >= 32)
                    axpy_qk(O + g * ldo, P + g * ldp, A, lda, kind, scales, sld, jb, je, c0,
                            32, n, f);
                else
                    axpy_qk(O + g * ldo, P + g * ldp, A, lda, kind, scales, sld, jb, je, c0,
                            Dv - c0, n, f);
            }
    }
    pf_rest(&pfs);
}

static void axpy_rows_qg(float *O, int64_t ldo, const float *P, int64_t ldp, const void *A,
                         int64_t lda, int kind, const float *scales, int64_t sld, int64_t ng,
                         int64_t n, int64_t Dv, const void *pf, size_t pfb) {
    if (kind == 4) {
        axpy_rows_i4(O, ldo, P, ldp, A, lda, scales, sld, ng, n, Dv, pf, pfb);
    } else if (kind == 0) {
        axpy_rows_qgk(O, ldo, P, ldp, A, lda, 0, scales, sld, ng, n, Dv, pf, pfb);
    } else if (kind == 1) {
        axpy_rows_qgk(O, ldo, P, ldp, A, lda, 1, scales, sld, ng, n, Dv, pf, pfb);
    } else if (kind == 2) {
        axpy_rows_qgk(O, ldo, P, ldp, A, lda, 2, scales, sld, ng, n, Dv, pf, pfb);
    } else {
        axpy_rows_qgk(O, ldo, P, ldp, A, lda, 3, scales, sld, ng, n, Dv, pf, pfb);
    }
}

static void axpy_rows_q(float *o, const float *p, const void *A, int64_t lda, int kind,
                        const float *scales, int64_t sld, int64_t n, int64_t Dv,
                        const void *pf, size_t pfb) {
    axpy_rows_qg(o, 0, p, 0, A, lda, kind, scales, sld, 1, n, Dv, pf, pfb);
}

// dot_rows_i8 (kernels.h) with AVX2 (also the avx512 table's, which lacks
// the byte instructions): 16 bytes at a time widened to int16 (vpmovsxbw)
// and multiplied in pairs into int32 lanes (vpmaddwd: exact), 4 rows a
// pass, query by query; exact integer sums, so the generic version's bits.
static inline __m256i i8w(const int8_t *p, int64_t w) {
    if (w >= 16)
        return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(const void *)p));
    int8_t t[16] = {0};
    memcpy(t, p, (size_t)w);
    return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(const void *)t));
}

void mha__dot_rows_i8_avx2(float *s, int64_t lds, const int8_t *A, int64_t lda,
                           const float *scales, int64_t sld, const int8_t *Xq, int64_t ldx,
                           const float *xs, int64_t ldxs, int64_t ng, int64_t n, int64_t D,
                           const void *pf, size_t pfb) {
    pf_spread pfs = pf_begin(pf, pfb, n / 4);
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        prefetch_ahead(A, (size_t)lda, j, 4, n);
        pf_step(&pfs);
        const __m128 sk = _mm_set_ps(scales[(j + 3) * sld], scales[(j + 2) * sld],
                                     scales[(j + 1) * sld], scales[j * sld]);
        for (int64_t g = 0; g < ng; g++) {
            const int8_t *x = Xq + g * ldx;
            __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t c = 0; c < D; c += 16) {
                const __m256i xv = i8w(x + c, 16);
                a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(i8w(A + j * lda + c, D - c), xv));
                a1 = _mm256_add_epi32(a1,
                                      _mm256_madd_epi16(i8w(A + (j + 1) * lda + c, D - c), xv));
                a2 = _mm256_add_epi32(a2,
                                      _mm256_madd_epi16(i8w(A + (j + 2) * lda + c, D - c), xv));
                a3 = _mm256_add_epi32(a3,
                                      _mm256_madd_epi16(i8w(A + (j + 3) * lda + c, D - c), xv));
            }
            const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(a0, a1),
                                                _mm256_hadd_epi32(a2, a3));
            const __m128i t = _mm_add_epi32(_mm256_castsi256_si128(h),
                                            _mm256_extracti128_si256(h, 1));
            const __m128 f = _mm_mul_ps(sk, _mm_set1_ps(xs[g * ldxs]));
            _mm_storeu_ps(s + g * lds + j, _mm_mul_ps(f, _mm_cvtepi32_ps(t)));
        }
    }
    pf_rest(&pfs);
    for (; j < n; j++)
        for (int64_t g = 0; g < ng; g++) {
            const int8_t *x = Xq + g * ldx;
            __m256i a = _mm256_setzero_si256();
            for (int64_t c = 0; c < D; c += 16)
                a = _mm256_add_epi32(a, _mm256_madd_epi16(i8w(A + j * lda + c, D - c),
                                                          i8w(x + c, 16)));
            const __m128i h = _mm_add_epi32(_mm256_castsi256_si128(a),
                                            _mm256_extracti128_si256(a, 1));
            const __m128i h2 = _mm_hadd_epi32(_mm_hadd_epi32(h, h), h);
            const float f = scales[j * sld] * xs[g * ldxs];
            s[g * lds + j] = f * (float)_mm_cvtsi128_si32(h2);
        }
}

// dot_rows_i4 (kernels.h) with AVX2 (also the avx512 table's): per 128
// elements a row's 64 bytes split into biased nibbles (n ^ 8 = q + 8,
// 0..15) against the query's even and odd elements (vpmaddubsw: pairs of
// at most 15 * 127, no saturation; then vpmaddwd by 1: int32), the four
// groups' sums by horizontal adds, less 8 sum_{c in group} x_c; then the
// scales and the sum over the groups in order for four rows at once (their
// products transposed to (group, row)); the tail rows by mha__dot_row_i4.
#define I4_QB 16
// The four groups' biased sums of one row's 64 bytes a against query x's
// 128 split elements: [g0, g1, g2, g3].
static inline __m128i i4q_groups(const uint8_t *a, const int8_t *x) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), flip = _mm256_set1_epi8((char)0x88),
                  one = _mm256_set1_epi16(1);
    __m256i p[2];
    for (int h = 0; h < 2; h++) {
        const __m256i b = _mm256_xor_si256(
            _mm256_loadu_si256((const __m256i *)(const void *)(a + 32 * h)), flip);
        const __m256i lo = _mm256_and_si256(b, m4),
                      hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), m4);
        const __m256i xe = _mm256_loadu_si256((const __m256i *)(const void *)(x + 32 * h)),
                      xo = _mm256_loadu_si256((const __m256i *)(const void *)(x + 64 + 32 * h));
        p[h] = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(lo, xe), one),
                                _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xo), one));
    }
    // (lane 0: groups 0 and 2, lane 1: 1 and 3)
    const __m256i h1 = _mm256_hadd_epi32(p[0], p[1]), h2 = _mm256_hadd_epi32(h1, h1);
    return _mm_unpacklo_epi32(_mm256_castsi256_si128(h2), _mm256_extracti128_si256(h2, 1));
}

void mha__dot_rows_i4_avx2(float *s, int64_t lds, const uint8_t *A, int64_t rb,
                           const float *scales, int64_t sld, const int8_t *Xq, int64_t ldx,
                           const float *xs, int64_t ldxs, int64_t ng, int64_t n, int64_t D,
                           const void *pf, size_t pfb) {
    const int64_t nsl = D / 128;
    int32_t bias[I4_QB * 4 * (MHA__I8_DMAX / 128)];
    pf_spread pfs = pf_begin(pf, pfb, n / 4);
    for (int64_t g0 = 0; g0 < ng; g0 += I4_QB) {
        const int64_t gn = ng - g0 < I4_QB ? ng - g0 : I4_QB;
        for (int64_t q = 0; q < gn; q++)
            for (int64_t sl = 0; sl < nsl; sl++)
                for (int b = 0; b < 4; b++) {
                    const int8_t *x = Xq + (g0 + q) * ldx + 128 * sl + 16 * b;
                    int32_t t = 0;
                    for (int i = 0; i < 16; i++) t += x[i] + x[64 + i];
                    bias[(q * nsl + sl) * 4 + b] = 8 * t;
                }
        int64_t j = 0;
        // four rows at once: their groups' products transposed to (group,
        // row), summed over the groups in order by vertical adds
        for (; j + 4 <= n; j += 4) {
            if (g0 == 0) prefetch_ahead(A, (size_t)rb, j, 4, n), pf_step(&pfs);
            for (int64_t q = 0; q < gn; q++) {
                __m128 u = _mm_setzero_ps();
                for (int64_t sl = 0; sl < nsl; sl++) {
                    const __m128i bv = _mm_loadu_si128(
                        (const __m128i *)(const void *)(bias + (q * nsl + sl) * 4));
                    __m128 f[4];
                    for (int r = 0; r < 4; r++)
                        f[r] = _mm_mul_ps(_mm_loadu_ps(scales + (j + r) * sld + 4 * sl),
                                          _mm_cvtepi32_ps(_mm_sub_epi32(
                                              i4q_groups(A + (j + r) * rb + 64 * sl,
                                                         Xq + (g0 + q) * ldx + 128 * sl),
                                              bv)));
                    _MM_TRANSPOSE4_PS(f[0], f[1], f[2], f[3]);
                    u = _mm_add_ps(u, f[0]);
                    u = _mm_add_ps(u, f[1]);
                    u = _mm_add_ps(u, f[2]);
                    u = _mm_add_ps(u, f[3]);
                }
                _mm_storeu_ps(s + (g0 + q) * lds + j,
                              _mm_mul_ps(_mm_set1_ps(xs[(g0 + q) * ldxs]), u));
            }
        }
        for (; j < n; j++)  // (the tail rows: the generic's arithmetic)
            for (int64_t q = 0; q < gn; q++)
                s[(g0 + q) * lds + j] = mha__dot_row_i4(A + j * rb, scales + j * sld,
                                                        Xq + (g0 + q) * ldx, D,
                                                        xs[(g0 + q) * ldxs]);
    }
    pf_rest(&pfs);
}

// The decode slots of the avx2 table (mha__kernels_fill_avx2 calls it).
void mha__kernels_fill_avx2_decode(mha__kernels *k) {
    k->dot_rows_q = dot_rows_q;
    k->dot_rows_qg = dot_rows_qg;
    k->axpy_rows_q = axpy_rows_q;
    k->axpy_rows_qg = axpy_rows_qg;
    k->dot_rows_i8 = mha__dot_rows_i8_avx2;
    k->dot_rows_i4 = mha__dot_rows_i4_avx2;
}
#endif
