// avx512_decode.c: the AVX-512F decode kernels (built with -mavx512f
// -mavx2 -mfma -mf16c for this file only, as avx512.c; used only when the
// CPU has AVX-512F, see cpu.c): one query, or a GQA group of them, against
// a KV cache's rows read in place, of any storage kind (kernels.h:
// dot_rows, dot_rows_q, dot_rows_qg, axpy_rows_q, axpy_rows_qg), and the
// dequantising copies cvt_*. The avx512 table's filler (avx512.c) takes
// these slots from mha__kernels_fill_avx512_decode.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#include <string.h>

#include "avx512_common.h"
#include "kernels.h"
#include "x86_prefetch.h"


// The decode kernels' look-ahead distance per kind: bf16 and f16 rows
// (kinds 1, 2) PF_BYTES_16 ahead, the others PF_BYTES. Measured on a
// Sapphire Rapids Xeon (2 threads, 12 heads d 64, 262144 tokens, two
// rounds taking turns): bf16 contiguous 47.9-50.9 ms with 12288 bytes,
// 37.3-37.6 with 1024, 40.1-41.5 with 2048; f32, int8 and int4 the same
// or slower at the shorter distances (f32 over scattered 16-token blocks
// 78-81 -> 84-86 ms: the look-ahead then falls inside the block that the
// caller's fetch has brought already). Those were prefetches into L1;
// into L2 (x86_prefetch.h's PF_HINT), bf16 contiguous 30.3 ms at 4096
// bytes, 32.5 at 2048, 31.5 at 8192 (one run each, the same machine).
#define PF_BYTES_16 4096
static inline size_t pf_dist(int kind) {
    return kind == 1 || kind == 2 ? PF_BYTES_16 : PF_BYTES;
}

// Rows j .. j + nr - 1 of a decode kernel's rows of kind (stride lda
// elements), pf_dist(kind) ahead.
static inline __attribute__((always_inline)) void prefetch_kind(const void *A, int64_t lda,
                                                                int kind, int64_t j,
                                                                int64_t nr, int64_t n) {
    prefetch_ahead_at(A, (size_t)lda * kind_size(kind), pf_dist(kind), j, nr, n);
}


// (Prefetching the rows ahead and the caller's next rows: x86_prefetch.h.)

// One key row per step: D in 16-lane pieces (masked tail), FMA, then the
// lane sum; 4 rows in flight to hide the reduction's latency.
static void dot_rows(float *s, const float *A, int64_t lda, const float *x, int64_t n,
                     int64_t D) {
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        const float *a0 = A + j * lda, *a1 = a0 + lda, *a2 = a1 + lda, *a3 = a2 + lda;
        __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
        prefetch_ahead(A, (size_t)lda * 4, j, 4, n);
        for (int64_t c = 0; c < D; c += 16) {
            const __mmask16 k = tail_mask(D - c);
            const __m512 xv = _mm512_maskz_loadu_ps(k, x + c);
            c0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, a0 + c), xv, c0);
            c1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, a1 + c), xv, c1);
            c2 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, a2 + c), xv, c2);
            c3 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, a3 + c), xv, c3);
        }
        s[j] = _mm512_reduce_add_ps(c0);
        s[j + 1] = _mm512_reduce_add_ps(c1);
        s[j + 2] = _mm512_reduce_add_ps(c2);
        s[j + 3] = _mm512_reduce_add_ps(c3);
    }
    for (; j < n; j++) {
        const float *a0 = A + j * lda;
        __m512 c0 = _mm512_setzero_ps();
        for (int64_t c = 0; c < D; c += 16) {
            const __mmask16 k = tail_mask(D - c);
            c0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, a0 + c),
                                 _mm512_maskz_loadu_ps(k, x + c), c0);
        }
        s[j] = _mm512_reduce_add_ps(c0);
    }
}

// AVX-512F only (no BW): whole blocks of 16 by 256/128-bit loads, the tail
// in scalar code.
static void cvt_bf16(float *dst, const uint16_t *src, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + i)));
        _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
    }
    for (; i < n; i++) {
        const uint32_t b = (uint32_t)src[i] << 16;
        memcpy(dst + i, &b, 4);
    }
}

static void cvt_f16(float *dst, const uint16_t *src, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i,
                         _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + i))));
    for (; i < n; i++) {
        uint16_t one[16] = {src[i]};
        float out[16];
        _mm512_storeu_ps(out, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)one)));
        dst[i] = out[0];
    }
}

static void cvt_i8(float *dst, const int8_t *src, int64_t n, float scale) {
    const __m512 s = _mm512_set1_ps(scale);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512i w = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + i)));
        _mm512_storeu_ps(dst + i, _mm512_mul_ps(s, _mm512_cvtepi32_ps(w)));
    }
    for (; i < n; i++) dst[i] = scale * (float)src[i];
}

// 16 elements c..c+15 of row j as float32 (c + 16 <= row length).
static inline __attribute__((always_inline)) __m512 q16(const void *A, int64_t lda, int kind,
                                                        int64_t j, int64_t c) {
    if (kind == 0) return _mm512_loadu_ps((const float *)A + j * lda + c);
    if (kind == 3)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128((const __m128i *)((const int8_t *)A + j * lda + c))));
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)A + j * lda + c));
    if (kind == 2) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// the tail c..D-1 (< 16 elements) of row j, zero-padded
static inline __m512 q16_tail(const void *A, int64_t lda, int kind, int64_t j, int64_t c,
                              int64_t D) {
    if (kind == 0)
        return _mm512_maskz_loadu_ps(tail_mask(D - c), (const float *)A + j * lda + c);
    uint16_t h[16] = {0};
    int8_t b[16] = {0};
    for (int64_t e = c; e < D; e++) {
        if (kind == 3) b[e - c] = ((const int8_t *)A)[j * lda + e];
        else h[e - c] = ((const uint16_t *)A)[j * lda + e];
    }
    return kind == 3 ? q16(b, 0, 3, 0, 0) : q16(h, 0, kind, 0, 0);
}

// The lane sums of four vectors, (sum a0, sum a1, sum a2, sum a3): one
// transpose-and-add tree for the four (a third of four separate
// reductions' instructions).
static inline __m128 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    // per 128-bit lane: (a0, a1, a2, a3) partial sums
    const __m512 t = _mm512_add_ps(_mm512_shuffle_ps(s01, s23, 0x44),
                                   _mm512_shuffle_ps(s01, s23, 0xEE));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(t),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(t),
                                                                           1)));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// One row's dot with x (the contract's order: 16-lane partial sums over c
// in order, then the lane reduction).
static inline __attribute__((always_inline)) float dot_q1(const void *A, int64_t lda, int kind,
                                                          int64_t j, const float *x, int64_t D) {
    __m512 acc = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + 16 <= D; c += 16)
        acc = _mm512_fmadd_ps(q16(A, lda, kind, j, c), _mm512_loadu_ps(x + c), acc);
    if (c < D)
        acc = _mm512_fmadd_ps(q16_tail(A, lda, kind, j, c, D),
                              _mm512_maskz_loadu_ps(tail_mask(D - c), x + c), acc);
    // (the four-row tree of reduce4 for one row: a row's bits do not depend
    // on whether it falls in a group of four or not)
    const __m512 z = _mm512_setzero_ps();
    return _mm_cvtss_f32(reduce4(acc, z, z, z));
}


// ---- int4 rows (kind 4; kernels.h): groups of 32 elements, 16 bytes, one
// scale each. A group's bytes widen to 16 lanes (byte i in lane i); the
// low nibbles (elements 2i) and, shifted down, the high ones (2i + 1)
// index a 16-entry table of the group's dequantised values s * q
// (vpermps reads a lane's low 4 bits only): one table multiply per group,
// two permutes, and the FMAs on the even and odd elements apart. The
// query (dot) is split into its even and odd elements once per group for
// the rows in flight; the outputs (axpy) stay split across the rows and
// are interleaved back at the end. Per (row, query): acc = fma(e, x_even,
// acc), acc = fma(o, x_odd, acc) over the groups in order, then reduce4
// (dot); o_c = fma(p_j, A(j, c), o_c) over the rows in order (axpy): the
// same operations whatever the rows or queries around it.
static const float I4_LUT[16] = {0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1};

// Group g of the int4 row at p, w (1..32) of its elements, as 16 lanes of
// bytes (past w: 0; no byte past the row's ceil(w / 2) read).
static inline __attribute__((always_inline)) __m512i i4_group(const uint8_t *p, int64_t g,
                                                              int64_t w) {
    if (w >= 32) return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 16 * g)));
    uint8_t b[16] = {0};
    memcpy(b, p + 16 * g, (size_t)(w + 1) / 2);
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
}

// The group's even (*e) and odd (*o) elements, dequantised by scale s.
static inline __attribute__((always_inline)) void i4_deq(__m512i d, float s, __m512 *e,
                                                         __m512 *o) {
    const __m512 t = _mm512_mul_ps(_mm512_loadu_ps(I4_LUT), _mm512_set1_ps(s));
    *e = _mm512_permutexvar_ps(d, t);
    *o = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), t);
}

// 32 floats at v (w of them, 1..32; past w: 0) split into even (*e) and
// odd (*o) elements.
static inline __attribute__((always_inline)) void split32(const float *v, int64_t w, __m512 *e,
                                                          __m512 *o) {
    const __m512i ie = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28,
                                         30),
                  io = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29,
                                         31);
    const __m512 lo = _mm512_maskz_loadu_ps(tail_mask(w), v),
                 hi = _mm512_maskz_loadu_ps(tail_mask(w - 16), v + 16);
    *e = _mm512_permutex2var_ps(lo, ie, hi);
    *o = _mm512_permutex2var_ps(lo, io, hi);
}

// The inverse: even e and odd o elements interleaved into the 32 floats at
// v (w of them stored).
static inline __attribute__((always_inline)) void merge32(float *v, int64_t w, __m512 e,
                                                          __m512 o) {
    const __m512i il = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23),
                  ih = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30,
                                         15, 31);
    _mm512_mask_storeu_ps(v, tail_mask(w), _mm512_permutex2var_ps(e, il, o));
    _mm512_mask_storeu_ps(v + 16, tail_mask(w - 16), _mm512_permutex2var_ps(e, ih, o));
}

static void cvt_i4(float *dst, const uint8_t *src, int64_t n, const float *scales) {
    for (int64_t g = 0; g * 32 < n; g++) {
        const int64_t w = n - 32 * g < 32 ? n - 32 * g : 32;
        __m512 e, o;
        i4_deq(i4_group(src, g, w), scales[g], &e, &o);
        merge32(dst + 32 * g, w, e, o);
    }
}

// The scales of rows j .. j + nr - 1 (sld floats apart), ahead as
// prefetch_ahead takes the rows (rb bytes each), unless they lie in the
// rows.
static inline __attribute__((always_inline)) void i4_prefetch(const void *A, size_t rb,
                                                              const float *scales, int64_t sld,
                                                              int64_t j, int64_t nr, int64_t n) {
    prefetch_ahead(A, rb, j, nr, n);
    const int64_t ahead = pf_rows(rb);
    if (j + ahead + nr > n) return;
    if (scales_in_rows(A, rb, scales)) return;
    const char *p = (const char *)(scales + (j + ahead) * sld);
    // (a line holds the scales of several rows: the first of each line)
    const size_t sb = (size_t)(nr * sld) * sizeof(float);
    for (size_t b = 0; b < sb; b += 64) _mm_prefetch(p + b, PF_HINT);
}

// Group g (w of its elements, 1..32: a constant for whole groups) of rows
// j .. j + nr - 1 into the accumulators acc[q][r].
static inline __attribute__((always_inline)) void dot_i4_group(
    __m512 acc[4][4], const uint8_t *A, int64_t lda, const float *scales, int64_t sld,
    const float *X, int64_t ldx, bool pre, int nq, int nr, int64_t j, int64_t g, int64_t w) {
    __m512 xe[4], xo[4];
    for (int q = 0; q < nq; q++) {
        if (pre) {
            xe[q] = _mm512_loadu_ps(X + q * ldx + 32 * g);
            xo[q] = _mm512_loadu_ps(X + q * ldx + 32 * g + 16);
        } else {
            split32(X + q * ldx + 32 * g, w, &xe[q], &xo[q]);
        }
    }
    for (int r = 0; r < nr; r++) {
        __m512 e, o;
        i4_deq(i4_group(A + (j + r) * (lda / 2), g, w), scales[(j + r) * sld + g], &e, &o);
        for (int q = 0; q < nq; q++) {
            acc[q][r] = _mm512_fmadd_ps(e, xe[q], acc[q][r]);
            acc[q][r] = _mm512_fmadd_ps(o, xo[q], acc[q][r]);
        }
    }
}

// Scores of rows j .. j + nr - 1 (nr 1 or 4) for nq (1..4) queries:
// s[q*lds + j + r] (both constants after inlining). The queries X (row
// stride ldx) as given (pre false: split here, group by group), or split
// already (pre: group g's even elements at X + q*ldx + 32g, its odd ones
// 16 after; past D, 0): the same floats either way, so the same bits.
static inline __attribute__((always_inline)) void dot_i4(float *s, int64_t lds,
                                                         const uint8_t *A, int64_t lda,
                                                         const float *scales, int64_t sld,
                                                         const float *X, int64_t ldx, bool pre,
                                                         int nq, int nr, int64_t j, int64_t D) {
    __m512 acc[4][4];
    for (int q = 0; q < nq; q++)
        for (int r = 0; r < nr; r++) acc[q][r] = _mm512_setzero_ps();
    // (the whole groups with a constant width: no tail in their loop)
    int64_t g = 0;
    for (; 32 * g + 32 <= D; g++)
        dot_i4_group(acc, A, lda, scales, sld, X, ldx, pre, nq, nr, j, g, 32);
    if (32 * g < D)
        dot_i4_group(acc, A, lda, scales, sld, X, ldx, pre, nq, nr, j, g, D - 32 * g);
    const __m512 z = _mm512_setzero_ps();
    for (int q = 0; q < nq; q++) {
        if (nr == 4)
            _mm_storeu_ps(s + q * lds + j, reduce4(acc[q][0], acc[q][1], acc[q][2], acc[q][3]));
        else s[q * lds + j] = _mm_cvtss_f32(reduce4(acc[q][0], z, z, z));
    }
}

// The rows with the queries split once for the call (pre) or group by
// group.
static inline __attribute__((always_inline)) void dot_rows_i4k(
    float *s, int64_t lds, const uint8_t *A, int64_t lda, const float *scales, int64_t sld,
    const float *X, int64_t ldx, bool pre, int64_t ng, int64_t n, int64_t D, const void *pf,
    size_t pfb) {
    const size_t rb = (size_t)(lda / 2);
    pf_spread pfs = pf_begin(pf, pfb, n / 4);
    int64_t j = 0;
#define DOT_I4(NQ, NR) \
    dot_i4(s + g * lds, lds, A, lda, scales, sld, X + g * ldx, ldx, pre, NQ, NR, j, D)
    for (; j + 4 <= n; j += 4) {
        i4_prefetch(A, rb, scales, sld, j, 4, n);
        pf_step(&pfs);
        int64_t g = 0;
        for (; g + 4 <= ng; g += 4) DOT_I4(4, 4);
        if (ng - g == 3) DOT_I4(3, 4);
        if (ng - g == 2) DOT_I4(2, 4);
        if (ng - g == 1) DOT_I4(1, 4);
    }
    pf_rest(&pfs);
    for (; j < n; j++)
        for (int64_t g = 0; g < ng; g++) DOT_I4(1, 1);
#undef DOT_I4
}

// dot_rows_qg for int4 (dot_rows_q: ng = 1): 4 rows at a time, the queries
// 4 at a time; the last n % 4 rows one by one. The queries are split into
// their even and odd elements once for the call when they fit in
// XS_FLOATS on the stack (else group by group for the four rows in
// flight): the same bits either way.
#define XS_FLOATS 4096
static void dot_rows_i4(float *s, int64_t lds, const void *Av, int64_t lda,
                        const float *scales, int64_t sld, const float *X, int64_t ldx,
                        int64_t ng, int64_t n, int64_t D, const void *pf, size_t pfb) {
    const uint8_t *A = Av;
    const int64_t dp = (D + 31) / 32 * 32;  // a query split, zero-padded
    if (ng * dp > XS_FLOATS || n < 4) {
        dot_rows_i4k(s, lds, A, lda, scales, sld, X, ldx, false, ng, n, D, pf, pfb);
        return;
    }
    float xs[XS_FLOATS];
    for (int64_t q = 0; q < ng; q++)
        for (int64_t g = 0; g * 32 < D; g++) {
            __m512 e, o;
            split32(X + q * ldx + 32 * g, D - 32 * g, &e, &o);
            _mm512_storeu_ps(xs + q * dp + 32 * g, e);
            _mm512_storeu_ps(xs + q * dp + 32 * g + 16, o);
        }
    dot_rows_i4k(s, lds, A, lda, scales, sld, xs, dp, true, ng, n, D, pf, pfb);
}

// O[q*ldo + c] += sum_j P[q*ldp + j] A(j, c) for the columns [c0, c0 + w)
// (w 1..64: one or two groups, c0 a multiple of 32), rows jb .. je - 1 in
// order, nq (1..4) queries (a constant after inlining); pf: the caller's
// spread prefetch (NULL: another call of the block asks for the rows).
static inline __attribute__((always_inline)) void axpy_i4(float *O, int64_t ldo, const float *P,
                                                          int64_t ldp, const uint8_t *A,
                                                          int64_t lda, const float *scales,
                                                          int64_t sld, int nq, int64_t jb,
                                                          int64_t je, int64_t c0, int64_t w,
                                                          int64_t n, pf_spread *pf) {
    const int64_t g0 = c0 / 32, w1 = w - 32;
    const size_t rb = (size_t)(lda / 2);
    __m512 acc[4][4];  // per query: group 0 even, odd, group 1 even, odd
    for (int q = 0; q < nq; q++) {
        split32(O + q * ldo + c0, w, &acc[q][0], &acc[q][1]);
        if (w1 > 0) split32(O + q * ldo + c0 + 32, w1, &acc[q][2], &acc[q][3]);
        else acc[q][2] = acc[q][3] = _mm512_setzero_ps();
    }
    for (int64_t j = jb; j < je; j++) {
        if (pf) i4_prefetch(A, rb, scales, sld, j, 1, n), pf_step(pf);
        const uint8_t *row = A + j * (lda / 2);
        __m512 e0, o0, e1 = _mm512_setzero_ps(), o1 = e1;
        i4_deq(i4_group(row, g0, w), scales[j * sld + g0], &e0, &o0);
        if (w1 > 0) i4_deq(i4_group(row, g0 + 1, w1), scales[j * sld + g0 + 1], &e1, &o1);
        for (int q = 0; q < nq; q++) {
            const __m512 f = _mm512_set1_ps(P[q * ldp + j]);
            acc[q][0] = _mm512_fmadd_ps(f, e0, acc[q][0]);
            acc[q][1] = _mm512_fmadd_ps(f, o0, acc[q][1]);
            if (w1 > 0) {
                acc[q][2] = _mm512_fmadd_ps(f, e1, acc[q][2]);
                acc[q][3] = _mm512_fmadd_ps(f, o1, acc[q][3]);
            }
        }
    }
    for (int q = 0; q < nq; q++) {
        merge32(O + q * ldo + c0, w, acc[q][0], acc[q][1]);
        if (w1 > 0) merge32(O + q * ldo + c0 + 32, w1, acc[q][2], acc[q][3]);
    }
}

// axpy_rows_qg for int4 (axpy_rows_q: ng = 1): blocks of AXB rows (in L1
// once read), for each 64 columns of up to 4 queries at a time (the
// accumulators stored and reloaded between blocks: exact).
#define AXB4 32
static void axpy_rows_i4(float *O, int64_t ldo, const float *P, int64_t ldp, const void *Av,
                         int64_t lda, const float *scales, int64_t sld, int64_t ng, int64_t n,
                         int64_t Dv, const void *pf, size_t pfb) {
    const uint8_t *A = Av;
    pf_spread pfs = pf_begin(pf, pfb, n);
    for (int64_t jb = 0; jb < n; jb += AXB4) {
        const int64_t je = n - jb < AXB4 ? n : jb + AXB4;
        for (int64_t c0 = 0; c0 < Dv; c0 += 64) {
            const int64_t w = Dv - c0 < 64 ? Dv - c0 : 64;
            // (64 columns: a constant width, the masks and the second
            // group's tests folded away)
#define AXPY_I4(NQ)                                                                          \
    do {                                                                                     \
        pf_spread *f = c0 == 0 && g == 0 ? &pfs : NULL;                                      \
        if (w == 64)                                                                         \
            axpy_i4(O + g * ldo, ldo, P + g * ldp, ldp, A, lda, scales, sld, NQ, jb, je, c0, \
                    64, n, f);                                                               \
        else                                                                                 \
            axpy_i4(O + g * ldo, ldo, P + g * ldp, ldp, A, lda, scales, sld, NQ, jb, je, c0, \
                    w, n, f);                                                                \
    } while (0)
            int64_t g = 0;
            for (; g + 4 <= ng; g += 4) AXPY_I4(4);
            if (ng - g == 3) AXPY_I4(3);
            if (ng - g == 2) AXPY_I4(2);
            if (ng - g == 1) AXPY_I4(1);
#undef AXPY_I4
        }
    }
    pf_rest(&pfs);
}


// Four rows at once (independent chains hide the FMA latency, one
// reduction tree for the four); kind a constant after inlining.
static inline __attribute__((always_inline)) void dot_rows_qk(
    float *s, const void *A, int64_t lda, int kind, const float *scales, int64_t sld,
    const float *x, int64_t n, int64_t D, const void *pf, size_t pfb) {
    int64_t j = 0;
    const int64_t Dv = D & ~(int64_t)15;
    pf_spread pfs = pf_begin(pf, pfb, n / 4);
    for (; j + 4 <= n && Dv == D; j += 4) {
        prefetch_kind(A, lda, kind, j, 4, n);
        pf_step(&pfs);
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t c = 0; c < D; c += 16) {
            const __m512 xv = _mm512_loadu_ps(x + c);
            a0 = _mm512_fmadd_ps(q16(A, lda, kind, j, c), xv, a0);
            a1 = _mm512_fmadd_ps(q16(A, lda, kind, j + 1, c), xv, a1);
            a2 = _mm512_fmadd_ps(q16(A, lda, kind, j + 2, c), xv, a2);
            a3 = _mm512_fmadd_ps(q16(A, lda, kind, j + 3, c), xv, a3);
        }
        __m128 r = reduce4(a0, a1, a2, a3);
        if (kind == 3) r = _mm_mul_ps(r, scales4(scales, j, sld));
        _mm_storeu_ps(s + j, r);
    }
    pf_rest(&pfs);
    for (; j < n; j++)
        s[j] = (kind == 3 ? scales[j * sld] : 1.0f) * dot_q1(A, lda, kind, j, x, D);
}

static void dot_rows_q(float *s, const void *A, int64_t lda, int kind, const float *scales,
                       int64_t sld, const float *x, int64_t n, int64_t D, const void *pf,
                       size_t pfb) {
    if (kind == 4) dot_rows_i4(s, 0, A, lda, scales, sld, x, 0, 1, n, D, pf, pfb);
    else if (kind == 0) dot_rows_qk(s, A, lda, 0, scales, sld, x, n, D, pf, pfb);
    else if (kind == 1) dot_rows_qk(s, A, lda, 1, scales, sld, x, n, D, pf, pfb);
    else if (kind == 2) dot_rows_qk(s, A, lda, 2, scales, sld, x, n, D, pf, pfb);
    else dot_rows_qk(s, A, lda, 3, scales, sld, x, n, D, pf, pfb);
}

// The group version: 4 rows x up to 4 queries at a time, 16 accumulators
// (each row's vector converted once for the queries; independent chains
// hide the FMA latency), the same operations per (query, row) as
// dot_rows_qk: the same bits. nq (1..4) a constant after inlining.
static inline __attribute__((always_inline)) void dot4_q(float *s, int64_t lds, const void *A,
                                                         int64_t lda, int kind,
                                                         const float *scales, int64_t sld,
                                                         const float *X, int64_t ldx, int nq,
                                                         int64_t j, int64_t D) {
    __m512 acc[4][4];
    for (int g = 0; g < nq; g++)
        for (int r = 0; r < 4; r++) acc[g][r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < D; c += 16) {
        const __m512 a0 = q16(A, lda, kind, j, c), a1 = q16(A, lda, kind, j + 1, c),
                     a2 = q16(A, lda, kind, j + 2, c), a3 = q16(A, lda, kind, j + 3, c);
        for (int g = 0; g < nq; g++) {
            const __m512 xv = _mm512_loadu_ps(X + g * ldx + c);
            acc[g][0] = _mm512_fmadd_ps(a0, xv, acc[g][0]);
            acc[g][1] = _mm512_fmadd_ps(a1, xv, acc[g][1]);
            acc[g][2] = _mm512_fmadd_ps(a2, xv, acc[g][2]);
            acc[g][3] = _mm512_fmadd_ps(a3, xv, acc[g][3]);
        }
    }
    for (int g = 0; g < nq; g++) {
        __m128 r = reduce4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
        if (kind == 3) r = _mm_mul_ps(r, scales4(scales, j, sld));
        _mm_storeu_ps(s + g * lds + j, r);
    }
}

static inline __attribute__((always_inline)) void dot_rows_qgk(
    float *s, int64_t lds, const void *A, int64_t lda, int kind, const float *scales,
    int64_t sld, const float *X, int64_t ldx, int64_t ng, int64_t n, int64_t D, const void *pf,
    size_t pfb) {
    int64_t j = 0;
    const int64_t Dv = D & ~(int64_t)15;
    pf_spread pfs = pf_begin(pf, pfb, n / 4);
    for (; j + 4 <= n && Dv == D; j += 4) {
        prefetch_kind(A, lda, kind, j, 4, n);
        pf_step(&pfs);
        int64_t g = 0;
        for (; g + 4 <= ng; g += 4)
            dot4_q(s + g * lds, lds, A, lda, kind, scales, sld, X + g * ldx, ldx, 4, j, D);
        if (ng - g == 3)
            dot4_q(s + g * lds, lds, A, lda, kind, scales, sld, X + g * ldx, ldx, 3, j, D);
        if (ng - g == 2)
            dot4_q(s + g * lds, lds, A, lda, kind, scales, sld, X + g * ldx, ldx, 2, j, D);
        if (ng - g == 1)
            dot4_q(s + g * lds, lds, A, lda, kind, scales, sld, X + g * ldx, ldx, 1, j, D);
    }
    pf_rest(&pfs);
    for (; j < n; j++)
        for (int64_t g = 0; g < ng; g++)
            s[g * lds + j] = (kind == 3 ? scales[j * sld] : 1.0f) *
                             dot_q1(A, lda, kind, j, X + g * ldx, D);
}

static void dot_rows_qg(float *s, int64_t lds, const void *A, int64_t lda, int kind,
                        const float *scales, int64_t sld, const float *X, int64_t ldx,
                        int64_t ng, int64_t n, int64_t D, const void *pf, size_t pfb) {
    if (kind == 4) dot_rows_i4(s, lds, A, lda, scales, sld, X, ldx, ng, n, D, pf, pfb);
    else if (kind == 0)
        dot_rows_qgk(s, lds, A, lda, 0, scales, sld, X, ldx, ng, n, D, pf, pfb);
    else if (kind == 1)
        dot_rows_qgk(s, lds, A, lda, 1, scales, sld, X, ldx, ng, n, D, pf, pfb);
    else if (kind == 2)
        dot_rows_qgk(s, lds, A, lda, 2, scales, sld, X, ldx, ng, n, D, pf, pfb);
    else dot_rows_qgk(s, lds, A, lda, 3, scales, sld, X, ldx, ng, n, D, pf, pfb);
}

// o[c] += p[j] scale_j A(j, c), j in order for every c (the contract's
// order); up to 64 columns' accumulators live across the j loop.
static inline __attribute__((always_inline)) void axpy_rows_qk(
    float *o, const float *p, const void *A, int64_t lda, int kind, const float *scales,
    int64_t sld, int64_t n, int64_t Dv, const void *pf, size_t pfb) {
    pf_spread pfs = pf_begin(pf, pfb, Dv >= 64 ? n : 1);
    if (Dv < 64) pf_rest(&pfs);
    for (int64_t c0 = 0; c0 < Dv; c0 += 64) {
        const int64_t w = Dv - c0 < 64 ? Dv - c0 : 64;
        if (w == 64) {
            __m512 a0 = _mm512_loadu_ps(o + c0), a1 = _mm512_loadu_ps(o + c0 + 16),
                   a2 = _mm512_loadu_ps(o + c0 + 32), a3 = _mm512_loadu_ps(o + c0 + 48);
            for (int64_t j = 0; j < n; j++) {
                if (c0 == 0) prefetch_kind(A, lda, kind, j, 1, n), pf_step(&pfs);
                const __m512 f = _mm512_set1_ps(p[j] * (kind == 3 ? scales[j * sld] : 1.0f));
                a0 = _mm512_fmadd_ps(f, q16(A, lda, kind, j, c0), a0);
                a1 = _mm512_fmadd_ps(f, q16(A, lda, kind, j, c0 + 16), a1);
                a2 = _mm512_fmadd_ps(f, q16(A, lda, kind, j, c0 + 32), a2);
                a3 = _mm512_fmadd_ps(f, q16(A, lda, kind, j, c0 + 48), a3);
            }
            _mm512_storeu_ps(o + c0, a0);
            _mm512_storeu_ps(o + c0 + 16, a1);
            _mm512_storeu_ps(o + c0 + 32, a2);
            _mm512_storeu_ps(o + c0 + 48, a3);
            pf_rest(&pfs);
            continue;
        }
        for (int64_t c = c0; c < c0 + w; c += 16) {
            const __mmask16 m = tail_mask(Dv - c);
            __m512 acc = _mm512_maskz_loadu_ps(m, o + c);
            for (int64_t j = 0; j < n; j++) {
                const __m512 f = _mm512_set1_ps(p[j] * (kind == 3 ? scales[j * sld] : 1.0f));
                const __m512 v = c + 16 <= Dv ? q16(A, lda, kind, j, c)
                                              : q16_tail(A, lda, kind, j, c, Dv);
                acc = _mm512_fmadd_ps(f, v, acc);
            }
            _mm512_mask_storeu_ps(o + c, m, acc);
        }
    }
}

static void axpy_rows_q(float *o, const float *p, const void *A, int64_t lda, int kind,
                        const float *scales, int64_t sld, int64_t n, int64_t Dv,
                        const void *pf, size_t pfb) {
    if (kind == 4) axpy_rows_i4(o, 0, p, 0, A, lda, scales, sld, 1, n, Dv, pf, pfb);
    else if (kind == 0) axpy_rows_qk(o, p, A, lda, 0, scales, sld, n, Dv, pf, pfb);
    else if (kind == 1) axpy_rows_qk(o, p, A, lda, 1, scales, sld, n, Dv, pf, pfb);
    else if (kind == 2) axpy_rows_qk(o, p, A, lda, 2, scales, sld, n, Dv, pf, pfb);
    else axpy_rows_qk(o, p, A, lda, 3, scales, sld, n, Dv, pf, pfb);
}

// The group version: blocks of AXB rows (in L1 once read); for each block,
// 64 columns of up to 4 queries at a time, 16 accumulators (each row's
// vectors converted once for the queries): per (query, column) the same
// chain over the rows in order as axpy_rows_qk (the accumulators stored
// and reloaded between blocks: exact). nq (1..4) a constant after inlining.
#define AXB 32
static inline __attribute__((always_inline)) void axpy64_q(
    float *O, int64_t ldo, const float *P, int64_t ldp, const void *A, int64_t lda, int kind,
    const float *scales, int64_t sld, int nq, int64_t jb, int64_t je, int64_t c0, int64_t n,
    pf_spread *pf) {
    __m512 acc[4][4];
    for (int g = 0; g < nq; g++)
        for (int u = 0; u < 4; u++) acc[g][u] = _mm512_loadu_ps(O + g * ldo + c0 + 16 * u);
    for (int64_t j = jb; j < je; j++) {
        if (pf) prefetch_kind(A, lda, kind, j, 1, n), pf_step(pf);
        const __m512 a0 = q16(A, lda, kind, j, c0), a1 = q16(A, lda, kind, j, c0 + 16),
                     a2 = q16(A, lda, kind, j, c0 + 32), a3 = q16(A, lda, kind, j, c0 + 48);
        for (int g = 0; g < nq; g++) {
            const __m512 f = _mm512_set1_ps(P[g * ldp + j] *
                                            (kind == 3 ? scales[j * sld] : 1.0f));
            acc[g][0] = _mm512_fmadd_ps(f, a0, acc[g][0]);
            acc[g][1] = _mm512_fmadd_ps(f, a1, acc[g][1]);
            acc[g][2] = _mm512_fmadd_ps(f, a2, acc[g][2]);
            acc[g][3] = _mm512_fmadd_ps(f, a3, acc[g][3]);
        }
    }
    for (int g = 0; g < nq; g++)
        for (int u = 0; u < 4; u++) _mm512_storeu_ps(O + g * ldo + c0 + 16 * u, acc[g][u]);
}

static inline __attribute__((always_inline)) void axpy_rows_qgk(
    float *O, int64_t ldo, const float *P, int64_t ldp, const void *A, int64_t lda, int kind,
    const float *scales, int64_t sld, int64_t ng, int64_t n, int64_t Dv, const void *pf,
    size_t pfb) {
    pf_spread pfs = pf_begin(pf, pfb, Dv >= 64 ? n : 1);
    if (Dv < 64) pf_rest(&pfs);
    for (int64_t jb = 0; jb < n; jb += AXB) {
        const int64_t je = n - jb < AXB ? n : jb + AXB;
        if (Dv < 64)  // (else the first 64 columns' first queries ask for them)
            for (int64_t j = jb; j < je; j++) prefetch_kind(A, lda, kind, j, 1, n);
        for (int64_t c0 = 0; c0 < Dv; c0 += 64) {
            if (Dv - c0 >= 64) {
                int64_t g = 0;
                for (; g + 4 <= ng; g += 4)
                    axpy64_q(O + g * ldo, ldo, P + g * ldp, ldp, A, lda, kind, scales, sld, 4,
                             jb, je, c0, n, c0 == 0 && g == 0 ? &pfs : NULL);
                if (ng - g == 3)
                    axpy64_q(O + g * ldo, ldo, P + g * ldp, ldp, A, lda, kind, scales, sld, 3,
                             jb, je, c0, n, c0 == 0 && g == 0 ? &pfs : NULL);
                if (ng - g == 2)
                    axpy64_q(O + g * ldo, ldo, P + g * ldp, ldp, A, lda, kind, scales, sld, 2,
                             jb, je, c0, n, c0 == 0 && g == 0 ? &pfs : NULL);
                if (ng - g == 1)
                    axpy64_q(O + g * ldo, ldo, P + g * ldp, ldp, A, lda, kind, scales, sld, 1,
                             jb, je, c0, n, c0 == 0 && g == 0 ? &pfs : NULL);
                continue;
            }
            for (int64_t g = 0; g < ng; g++) {  // the last < 64 columns, query by query
                float *o = O + g * ldo;
                const float *p = P + g * ldp;
                for (int64_t c = c0; c < Dv; c += 16) {
                    const __mmask16 m = tail_mask(Dv - c);
                    __m512 acc = _mm512_maskz_loadu_ps(m, o + c);
                    for (int64_t j = jb; j < je; j++) {
                        const __m512 f = _mm512_set1_ps(p[j] *
                                                        (kind == 3 ? scales[j * sld] : 1.0f));
                        const __m512 v = c + 16 <= Dv ? q16(A, lda, kind, j, c)
                                                      : q16_tail(A, lda, kind, j, c, Dv);
                        acc = _mm512_fmadd_ps(f, v, acc);
                    }
                    _mm512_mask_storeu_ps(o + c, m, acc);
                }
            }
        }
    }
}

static void axpy_rows_qg(float *O, int64_t ldo, const float *P, int64_t ldp, const void *A,
                         int64_t lda, int kind, const float *scales, int64_t sld, int64_t ng,
                         int64_t n, int64_t Dv, const void *pf, size_t pfb) {
    if (kind == 4) axpy_rows_i4(O, ldo, P, ldp, A, lda, scales, sld, ng, n, Dv, pf, pfb);
    else if (kind == 0)
        axpy_rows_qgk(O, ldo, P, ldp, A, lda, 0, scales, sld, ng, n, Dv, pf, pfb);
    else if (kind == 1)
        axpy_rows_qgk(O, ldo, P, ldp, A, lda, 1, scales, sld, ng, n, Dv, pf, pfb);
    else if (kind == 2)
        axpy_rows_qgk(O, ldo, P, ldp, A, lda, 2, scales, sld, ng, n, Dv, pf, pfb);
    else axpy_rows_qgk(O, ldo, P, ldp, A, lda, 3, scales, sld, ng, n, Dv, pf, pfb);
}

// The decode slots of the avx512 table (mha__kernels_fill_avx512 calls it);
// int8 and int4 scores are avx2.c's (vpmaddubsw), unless avx512bf16.c's
// VNNI ones replace them.
void mha__kernels_fill_avx512_decode(mha__kernels *k) {
    k->dot_rows = dot_rows;
    k->cvt_bf16 = cvt_bf16;
    k->cvt_f16 = cvt_f16;
    k->cvt_i8 = cvt_i8;
    k->cvt_i4 = cvt_i4;
    k->dot_rows_q = dot_rows_q;
    k->axpy_rows_q = axpy_rows_q;
    k->dot_rows_qg = dot_rows_qg;
    k->axpy_rows_qg = axpy_rows_qg;
    k->dot_rows_i8 = mha__dot_rows_i8_avx2;
    k->dot_rows_i4 = mha__dot_rows_i4_avx2;
}
#endif
