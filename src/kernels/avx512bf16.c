// avx512bf16.c: the bf16 slots (kernels.h) with AVX512-BF16's vdpbf16ps,
// on top of the avx512 table where the CPU has it (Intel Cooper Lake and
// later, AMD Zen 4 and later). gemm_bf16 gives the generic version's bits:
// one vdpbf16ps lane is two exact products added odd pair element first,
// each add rounded to nearest even with subnormals flushed, the order
// generic.c writes out.
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "kernels.h"
#include "x86_prefetch.h"

#define MR 4  // rows of C per micro-tile
#define NV 4  // 16-column vectors per micro-tile (64 columns)

static inline __attribute__((always_inline)) void micro(float *C, int64_t ldc,
                                                        const uint16_t *A, int64_t lda,
                                                        const uint16_t *B, int64_t Np,
                                                        int64_t P, int mr, int nv,
                                                        __mmask16 last, float alpha, bool acc) {
    __m512 c[MR][NV];
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < nv; v++)
            c[r][v] = acc ? _mm512_maskz_loadu_ps(v == nv - 1 ? last : 0xffff,
                                                  C + r * ldc + 16 * v)
                          : _mm512_setzero_ps();
    for (int64_t p = 0; p < P; p++) {
        __m512i b[NV];
        for (int v = 0; v < nv; v++) b[v] = _mm512_loadu_si512(B + (p * Np + 16 * v) * 2);
        for (int r = 0; r < mr; r++) {
            int32_t w;
            memcpy(&w, A + r * lda + 2 * p, sizeof w);
            const __m512bh a = (__m512bh)_mm512_set1_epi32(w);
            for (int v = 0; v < nv; v++)
                c[r][v] = _mm512_dpbf16_ps(c[r][v], (__m512bh)b[v], a);
        }
    }
    const __m512 al = _mm512_set1_ps(alpha);
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < nv; v++)
            _mm512_mask_storeu_ps(C + r * ldc + 16 * v, v == nv - 1 ? last : 0xffff,
                                  acc ? c[r][v] : _mm512_mul_ps(c[r][v], al));
}

static void gemm_bf16(float *C, int64_t ldc, const uint16_t *A, int64_t lda, const uint16_t *Bp,
                      int64_t nb, int64_t M, int64_t N, int64_t K, float alpha, bool acc) {
    const int64_t Np = (nb + 15) / 16 * 16, P = (K + 1) / 2;
    for (int64_t j0 = 0; j0 < N; j0 += 16 * NV) {
        const int64_t w = N - j0 < 16 * NV ? N - j0 : 16 * NV;
        const int nv = (int)((w + 15) / 16);
        const __mmask16 last = (__mmask16)(0xffffu >> (16 * nv - w));
        const uint16_t *B = Bp + j0 * 2;
        for (int64_t i0 = 0; i0 < M; i0 += MR) {
            const int mr = M - i0 < MR ? (int)(M - i0) : MR;
            float *c = C + i0 * ldc + j0;
            const uint16_t *a = A + i0 * lda;
#define MICRO(R, V) micro(c, ldc, a, lda, B, Np, P, R, V, last, alpha, acc)
            switch (mr * 8 + nv) {
            case 4 * 8 + 4: MICRO(4, 4); break;
            case 4 * 8 + 3: MICRO(4, 3); break;
            case 4 * 8 + 2: MICRO(4, 2); break;
            case 4 * 8 + 1: MICRO(4, 1); break;
            case 3 * 8 + 4: MICRO(3, 4); break;
            case 3 * 8 + 3: MICRO(3, 3); break;
            case 3 * 8 + 2: MICRO(3, 2); break;
            case 3 * 8 + 1: MICRO(3, 1); break;
            case 2 * 8 + 4: MICRO(2, 4); break;
            case 2 * 8 + 3: MICRO(2, 3); break;
            case 2 * 8 + 2: MICRO(2, 2); break;
            case 2 * 8 + 1: MICRO(2, 1); break;
            case 1 * 8 + 4: MICRO(1, 4); break;
            case 1 * 8 + 3: MICRO(1, 3); break;
            case 1 * 8 + 2: MICRO(1, 2); break;
            default: MICRO(1, 1); break;
            }
#undef MICRO
        }
    }
}

// 32 bf16 lanes with subnormals flushed to signed zero
static inline __m512i daz32(__m512i x) {
    const __mmask32 sub = _mm512_testn_epi16_mask(x, _mm512_set1_epi16(0x7f80));
    return _mm512_mask_blend_epi16(sub, x,
                                   _mm512_and_si512(x, _mm512_set1_epi16((short)0x8000)));
}

// r[i] <- column i of the 16 x 16 matrix of 32-bit elements whose rows
// were r[0..15] (unpacks of 32 and 64 bits, then 128-bit lane shuffles)
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i + 0], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i + 0], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 2; i++)
        for (int k = 0; k < 4; k++) {
            t[8 * i + k] = _mm512_shuffle_i32x4(r[8 * i + k], r[8 * i + 4 + k], 0x88);
            t[8 * i + 4 + k] = _mm512_shuffle_i32x4(r[8 * i + k], r[8 * i + 4 + k], 0xdd);
        }
    for (int k = 0; k < 8; k++) {
        r[k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0x88);
        r[8 + k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0xdd);
    }
}

// pack_bf16 for a table of pad kpad (the generic layout, kernels.h), with
// AVX-512: B rows along n (sn == 1, the V tiles) interleaved two rows at a
// time; B columns along k (sk == 1, the K^T tiles: a key's row holds its
// k pairs as 32-bit words) 16 x 16 transposes of those words. Other
// strides: the generic packer.
void mha__pack_bf16_avx512(uint16_t *Bp, const uint16_t *B, int64_t sk, int64_t sn, int64_t K,
                           int64_t N, int64_t kpad) {
    const int64_t Np = (N + 15) / 16 * 16, Kp = (K + kpad - 1) / kpad * kpad;
    if (sn == 1) {
        for (int64_t p = 0; p < Kp / 2; p++) {
            const uint16_t *r0 = B + 2 * p * sk, *r1 = r0 + sk;
            const bool h0 = 2 * p < K, h1 = 2 * p + 1 < K;
            for (int64_t j = 0; j < Np; j += 16) {
                const __mmask16 m = j + 16 <= N ? 0xffff
                                    : j < N     ? (__mmask16)(0xffffu >> (16 - (N - j)))
                                                : 0;
                const __m256i a = h0 ? _mm256_maskz_loadu_epi16(m, r0 + j)
                                     : _mm256_setzero_si256();
                const __m256i b = h1 ? _mm256_maskz_loadu_epi16(m, r1 + j)
                                     : _mm256_setzero_si256();
                const __m512i w = _mm512_or_si512(_mm512_cvtepu16_epi32(a),
                                                  _mm512_slli_epi32(_mm512_cvtepu16_epi32(b),
                                                                    16));
                _mm512_storeu_si512(Bp + (p * Np + j) * 2, daz32(w));
            }
        }
        return;
    }
    if (sk == 1 && K % 2 == 0) {  // rows of 16 keys x 16 pairs: 32-bit transposes
        const int64_t P = K / 2;  // pairs of a key's row
        for (int64_t j0 = 0; j0 < Np; j0 += 16)
            for (int64_t p0 = 0; p0 < Kp / 2; p0 += 16) {
                const __mmask16 m = p0 + 16 <= P ? 0xffff
                                    : p0 < P     ? (__mmask16)(0xffffu >> (16 - (P - p0)))
                                                 : 0;
                __m512i r[16];
                for (int i = 0; i < 16; i++)
                    r[i] = j0 + i < N ? _mm512_maskz_loadu_epi32(m, B + (j0 + i) * sn + 2 * p0)
                                      : _mm512_setzero_si512();
                transpose16(r);  // r[t]: pair p0 + t of the 16 keys
                for (int t = 0; t < 16 && p0 + t < Kp / 2; t++)
                    _mm512_storeu_si512(Bp + ((p0 + t) * Np + j0) * 2, daz32(r[t]));
            }
        return;
    }
    mha__pack_bf16_generic(Bp, B, sk, sn, K, N, kpad);
}

static void pack_bf16(uint16_t *Bp, const uint16_t *B, int64_t sk, int64_t sn, int64_t K,
                      int64_t N) {
    mha__pack_bf16_avx512(Bp, B, sk, sn, K, N, 2);
}


static inline __mmask16 tail_mask(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}

// fexp (kernels.h softmax_rows_bf16) for 16 lanes: the generic operations
// lane by lane (vroundscale is rint, vscalef q 2^k exact: the results are
// normal).
static inline __m512 fexp512(__m512 z) {
    const __mmask16 keep = _mm512_cmp_ps_mask(z, _mm512_set1_ps(-87.0f), _CMP_NLT_UQ);
    const __m512 t = _mm512_mul_ps(z, _mm512_set1_ps(1.44269504088896341f));
    const __m512 k = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, k);
    __m512 q = _mm512_fmadd_ps(_mm512_set1_ps(0x1.5bba14p-10f), f,
                               _mm512_set1_ps(0x1.3cea88p-7f));
    q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(0x1.c6b752p-5f));
    q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(0x1.ebf9bcp-3f));
    q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(0x1.62e42ap-1f));
    q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(1.0f));
    // NaN z: NaN t, k, f, q; kept by the unordered compare
    return _mm512_maskz_scalef_ps(keep, q, k);
}

// The lanes' sum as kernels.h orders it: u + (u + 8), then + 4, + 2, + 1.
static inline float sum16(__m512 v) {
    const __m256 a =
        _mm256_add_ps(_mm512_castps512_ps256(v),
                      _mm256_castsi256_ps(_mm512_extracti64x4_epi64(_mm512_castps_si512(v), 1)));
    const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
}

// softmax_rows_bf16 (kernels.h): four rows interleaved; the max over the
// raw scores times scale (= the max of the products for scale > 0: the
// rounding is monotonic); P by vcvtneps2bf16, which is round_bf16's rule
// on fexp's results (0, normal, NaN: nearest even, NaN quieted the same).
static void softmax_rows_bf16(const float *x, int64_t ldx, int64_t R, int64_t n, float scale,
                              float *m, float *l, float *alpha, uint16_t *p, int64_t ldp) {
    if (!(scale > 0.0f)) {
        mha__softmax_rows_bf16_generic(x, ldx, R, n, scale, m, l, alpha, p, ldp);
        return;
    }
    const __m512 sc = _mm512_set1_ps(scale);
    int64_t r = 0;
    for (; r + 4 <= R; r += 4) {
        const float *x0 = x + r * ldx;
        __m512 v[4];
        for (int i = 0; i < 4; i++) v[i] = _mm512_set1_ps(-INFINITY);
        for (int64_t j = 0; j < n; j += 16) {
            const __mmask16 k = tail_mask(n - j);
            for (int i = 0; i < 4; i++)  // (max(x, v): a NaN x leaves v)
                v[i] = _mm512_mask_max_ps(v[i], k, _mm512_maskz_loadu_ps(k, x0 + i * ldx + j),
                                          v[i]);
        }
        float mx[4];
        bool empty = false;
        for (int i = 0; i < 4; i++) {
            const float y = scale * _mm512_reduce_max_ps(v[i]);
            mx[i] = y > m[r + i] || m[r + i] != m[r + i] ? (m[r + i] != m[r + i] ? m[r + i] : y)
                                                         : m[r + i];
            empty |= mx[i] == -INFINITY;
        }
        if (empty) {  // (rare: rows with nothing visible yet, NaN)
            mha__softmax_rows_bf16_generic(x0, ldx, 4, n, scale, m + r, l + r, alpha + r,
                                           p + r * ldp, ldp);
            continue;
        }
        __m512 s[4], nm[4];
        for (int i = 0; i < 4; i++) s[i] = _mm512_setzero_ps(), nm[i] = _mm512_set1_ps(-mx[i]);
        for (int64_t j = 0; j < n; j += 16) {
            const __mmask16 k = tail_mask(n - j);
            for (int i = 0; i < 4; i++) {
                // y - M with y the rounded product, as M's (not an fma)
                const __m512 e = fexp512(_mm512_add_ps(
                    _mm512_mul_ps(sc, _mm512_maskz_loadu_ps(k, x0 + i * ldx + j)), nm[i]));
                _mm256_mask_storeu_epi16(p + (r + i) * ldp + j, k,
                                         (__m256i)_mm512_cvtneps_pbh(e));
                s[i] = _mm512_add_ps(s[i], _mm512_maskz_mov_ps(k, e));
            }
        }
        float a[16];
        _mm512_storeu_ps(a, fexp512(_mm512_setr_ps(m[r] - mx[0], m[r + 1] - mx[1],
                                                   m[r + 2] - mx[2], m[r + 3] - mx[3], 0, 0, 0,
                                                   0, 0, 0, 0, 0, 0, 0, 0, 0)));
        for (int i = 0; i < 4; i++) {
            l[r + i] = l[r + i] * a[i] + sum16(s[i]);
            m[r + i] = mx[i];
            alpha[r + i] = a[i];
        }
    }
    if (r < R)
        mha__softmax_rows_bf16_generic(x + r * ldx, ldx, R - r, n, scale, m + r, l + r,
                                       alpha + r, p + r * ldp, ldp);
}

// dot_rows_i8 (kernels.h) with AVX512-VNNI's vpdpbusd (every CPU with
// AVX512-BF16 has it; cpu.c checks both): it multiplies unsigned bytes by
// signed ones, four products to an int32 lane, so a row's bytes go in
// biased (a ^ 0x80 = a + 128, unsigned) and the query's as they are:
// sum (a + 128) x = t + 128 sum x, the bias taken off once per (row,
// query). All exact int32, so the generic version's bits. 4 rows x up to 4
// queries in flight, 64 bytes a step (the row's last ones under a mask: a
// masked byte reads 0, biased 128, against the query's zero padding).
static inline __m128i reduce4i(__m512i a0, __m512i a1, __m512i a2, __m512i a3) {
    const __m512i t01 = _mm512_add_epi32(_mm512_unpacklo_epi32(a0, a1),
                                         _mm512_unpackhi_epi32(a0, a1)),
                  t23 = _mm512_add_epi32(_mm512_unpacklo_epi32(a2, a3),
                                         _mm512_unpackhi_epi32(a2, a3));
    const __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(t01, t23),
                                       _mm512_unpackhi_epi64(t01, t23));
    const __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(u),
                                       _mm512_extracti64x4_epi64(u, 1));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

static inline __attribute__((always_inline)) void i8_block(
    float *s, int64_t lds, const int8_t *A, int64_t lda, const float *scales, int64_t sld,
    const int8_t *Xq, int64_t ldx, const float *xs, int64_t ldxs, const int32_t *bias, int nq,
    int nr, int64_t j, int64_t D) {
    __m512i acc[4][4];
    for (int q = 0; q < nq; q++)
        for (int r = 0; r < nr; r++) acc[q][r] = _mm512_setzero_si512();
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int64_t c = 0; c < D; c += 64) {
        const __mmask64 m = D - c >= 64 ? ~(__mmask64)0 : ((__mmask64)1 << (D - c)) - 1;
        __m512i a[4];
        for (int r = 0; r < nr; r++)
            a[r] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, A + (j + r) * lda + c), flip);
        for (int q = 0; q < nq; q++) {
            const __m512i x = _mm512_loadu_si512(Xq + q * ldx + c);
            for (int r = 0; r < nr; r++) acc[q][r] = _mm512_dpbusd_epi32(acc[q][r], a[r], x);
        }
    }
    if (nr == 4) {
        const __m128 sk = _mm_set_ps(scales[(j + 3) * sld], scales[(j + 2) * sld],
                                     scales[(j + 1) * sld], scales[j * sld]);
        for (int q = 0; q < nq; q++) {
            const __m128i t = _mm_sub_epi32(reduce4i(acc[q][0], acc[q][1], acc[q][2], acc[q][3]),
                                            _mm_set1_epi32(bias[q]));
            const __m128 f = _mm_mul_ps(sk, _mm_set1_ps(xs[q * ldxs]));
            _mm_storeu_ps(s + q * lds + j, _mm_mul_ps(f, _mm_cvtepi32_ps(t)));
        }
        return;
    }
    for (int q = 0; q < nq; q++) {
        const int32_t t = _mm512_reduce_add_epi32(acc[q][0]) - bias[q];
        const float f = scales[j * sld] * xs[q * ldxs];
        s[q * lds + j] = f * (float)t;
    }
}

#define I8_QB 64
static void dot_rows_i8(float *s, int64_t lds, const int8_t *A, int64_t lda,
                        const float *scales, int64_t sld, const int8_t *Xq, int64_t ldx,
                        const float *xs, int64_t ldxs, int64_t ng, int64_t n, int64_t D,
                        const void *pf, size_t pfb) {
    int32_t bias[I8_QB];
    const __m512i ones = _mm512_set1_epi8(1);
    for (int64_t g0 = 0; g0 < ng; g0 += I8_QB) {
        const int64_t gn = ng - g0 < I8_QB ? ng - g0 : I8_QB;
        for (int64_t q = 0; q < gn; q++) {
            __m512i t = _mm512_setzero_si512();
            for (int64_t c = 0; c < D; c += 64)
                t = _mm512_dpbusd_epi32(t, ones, _mm512_loadu_si512(Xq + (g0 + q) * ldx + c));
            bias[q] = 128 * _mm512_reduce_add_epi32(t);
        }
        pf_spread pfs = pf_begin(g0 == 0 ? pf : NULL, pfb, n / 4);
        int64_t j = 0;
#define I8_BLOCK(NQ, NR)                                                             \
    i8_block(s + (g0 + g) * lds, lds, A, lda, scales, sld, Xq + (g0 + g) * ldx, ldx, \
             xs + (g0 + g) * ldxs, ldxs, bias + g, NQ, NR, j, D)
        for (; j + 4 <= n; j += 4) {
            prefetch_ahead(A, (size_t)lda, j, 4, n);
            pf_step(&pfs);
            int64_t g = 0;
            for (; g + 4 <= gn; g += 4) I8_BLOCK(4, 4);
            if (gn - g == 3) I8_BLOCK(3, 4);
            if (gn - g == 2) I8_BLOCK(2, 4);
            if (gn - g == 1) I8_BLOCK(1, 4);
        }
        pf_rest(&pfs);
        for (; j < n; j++)
            for (int64_t g = 0; g < gn; g++) I8_BLOCK(1, 1);
#undef I8_BLOCK
    }
}

// dot_rows_i4 (kernels.h) with vpdpbusd: a row's 64 bytes per 128
// elements split into their low and high nibbles, biased (n ^ 8 = q + 8,
// unsigned 0..15), against the query's even and odd elements; each group
// of 32 is one 128-bit lane of the products' int32 lanes, so four rows'
// sums (reduce4 within the lanes) give a vector of (group, row) sums, less
// the bias 8 sum_{c in group} x_c; then the scales (transposed to the same
// lanes) and the sum over the groups in order, four rows at once. Tail
// rows through the generic's (mha__dot_row_i4).
#define I4_QB 16  // queries a pass (their biases on the stack)
static inline __m512i reduce_lanes4(__m512i a0, __m512i a1, __m512i a2, __m512i a3) {
    const __m512i t01 = _mm512_add_epi32(_mm512_unpacklo_epi32(a0, a1),
                                         _mm512_unpackhi_epi32(a0, a1)),
                  t23 = _mm512_add_epi32(_mm512_unpacklo_epi32(a2, a3),
                                         _mm512_unpackhi_epi32(a2, a3));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(t01, t23), _mm512_unpackhi_epi64(t01, t23));
}

static inline __attribute__((always_inline)) void i4q_block(
    float *s, int64_t lds, const uint8_t *A, int64_t rb, const float *scales, int64_t sld,
    const int8_t *Xq, int64_t ldx, const float *xs, int64_t ldxs, const int32_t *bias,
    int64_t nsl, int nq, int64_t j, int64_t D) {
    __m128 u[4];
    for (int q = 0; q < nq; q++) u[q] = _mm_setzero_ps();
    const __m512i m4 = _mm512_set1_epi8(0x0f), flip = _mm512_set1_epi8((char)0x88);
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    for (int64_t sl = 0; 128 * sl < D; sl++) {
        __m512i lo[4], hi[4];
        for (int r = 0; r < 4; r++) {
            const __m512i b = _mm512_xor_si512(_mm512_loadu_si512(A + (j + r) * rb + 64 * sl),
                                               flip);
            lo[r] = _mm512_and_si512(b, m4);
            hi[r] = _mm512_and_si512(_mm512_srli_epi16(b, 4), m4);
        }
        // the scales of (row r, group g) in lane 4 g + r
        __m128 c0 = _mm_loadu_ps(scales + j * sld + 4 * sl),
               c1 = _mm_loadu_ps(scales + (j + 1) * sld + 4 * sl),
               c2 = _mm_loadu_ps(scales + (j + 2) * sld + 4 * sl),
               c3 = _mm_loadu_ps(scales + (j + 3) * sld + 4 * sl);
        _MM_TRANSPOSE4_PS(c0, c1, c2, c3);
        const __m512 sc = _mm512_insertf32x4(
            _mm512_insertf32x4(_mm512_insertf32x4(_mm512_castps128_ps512(c0), c1, 1), c2, 2),
            c3, 3);
        for (int q = 0; q < nq; q++) {
            const __m512i xe = _mm512_loadu_si512(Xq + q * ldx + 128 * sl),
                          xo = _mm512_loadu_si512(Xq + q * ldx + 128 * sl + 64);
            __m512i a[4];
            for (int r = 0; r < 4; r++)
                a[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[r],
                                                               xe),
                                           hi[r], xo);
            const __m512i bv = _mm512_permutexvar_epi32(
                spread, _mm512_castsi128_si512(_mm_loadu_si128(
                            (const __m128i *)(const void *)(bias + (q * nsl + sl) * 4))));
            const __m512i t = _mm512_sub_epi32(reduce_lanes4(a[0], a[1], a[2], a[3]), bv);
            const __m512 f = _mm512_mul_ps(sc, _mm512_cvtepi32_ps(t));
            u[q] = _mm_add_ps(u[q], _mm512_castps512_ps128(f));
            u[q] = _mm_add_ps(u[q], _mm512_extractf32x4_ps(f, 1));
            u[q] = _mm_add_ps(u[q], _mm512_extractf32x4_ps(f, 2));
            u[q] = _mm_add_ps(u[q], _mm512_extractf32x4_ps(f, 3));
        }
    }
    for (int q = 0; q < nq; q++)
        _mm_storeu_ps(s + q * lds + j, _mm_mul_ps(_mm_set1_ps(xs[q * ldxs]), u[q]));
}

static void dot_rows_i4(float *s, int64_t lds, const uint8_t *A, int64_t rb,
                        const float *scales, int64_t sld, const int8_t *Xq, int64_t ldx,
                        const float *xs, int64_t ldxs, int64_t ng, int64_t n, int64_t D,
                        const void *pf, size_t pfb) {
    const int64_t nsl = D / 128;
    int32_t bias[I4_QB * 4 * (MHA__I8_DMAX / 128)];
    const __m512i ones = _mm512_set1_epi8(1);
    for (int64_t g0 = 0; g0 < ng; g0 += I4_QB) {
        const int64_t gn = ng - g0 < I4_QB ? ng - g0 : I4_QB;
        for (int64_t q = 0; q < gn; q++)  // 8 sum_{c in group} x_c, per slab and group
            for (int64_t sl = 0; sl < nsl; sl++) {
                const int8_t *x = Xq + (g0 + q) * ldx + 128 * sl;
                const __m512i t = _mm512_dpbusd_epi32(
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, _mm512_loadu_si512(x)),
                    ones, _mm512_loadu_si512(x + 64));
                const __m512i z = _mm512_setzero_si512();
                const __m512i r = reduce_lanes4(t, z, z, z);  // lane 4 g: group g's sum
                int32_t v[16];
                _mm512_storeu_si512(v, r);
                for (int b = 0; b < 4; b++) bias[(q * nsl + sl) * 4 + b] = 8 * v[4 * b];
            }
        pf_spread pfs = pf_begin(g0 == 0 ? pf : NULL, pfb, n / 4);
        int64_t j = 0;
#define I4Q(NQ)                                                                      \
    i4q_block(s + (g0 + g) * lds, lds, A, rb, scales, sld, Xq + (g0 + g) * ldx, ldx, \
              xs + (g0 + g) * ldxs, ldxs, bias + g * nsl * 4, nsl, NQ, j, D)
        for (; j + 4 <= n; j += 4) {
            prefetch_ahead(A, (size_t)rb, j, 4, n);
            pf_step(&pfs);
            int64_t g = 0;
            for (; g + 4 <= gn; g += 4) I4Q(4);
            if (gn - g == 3) I4Q(3);
            if (gn - g == 2) I4Q(2);
            if (gn - g == 1) I4Q(1);
        }
#undef I4Q
        pf_rest(&pfs);
        for (; j < n; j++)
            for (int64_t g = g0; g < g0 + gn; g++)
                s[g * lds + j] = mha__dot_row_i4(A + j * rb, scales + j * sld, Xq + g * ldx, D,
                                                 xs[g * ldxs]);
    }
}

void mha__kernels_fill_avx512bf16(mha__kernels *k) {
    // bf_fast stays false here: the avx512 table (Intel's cores issue one
    // vdpbf16ps, 32 products, per cycle against two float32 FMAs, also 32);
    // cpu.c's "avx512bf16" table sets it (AMD Zen 4: twice the FMA rate).
    k->bf_fast = false;
    k->bf_exact = true;
    k->gemm_bf16 = gemm_bf16;
    k->pack_bf16 = pack_bf16;
    k->softmax_rows_bf16 = softmax_rows_bf16;
    k->dot_rows_i8 = dot_rows_i8;
    k->dot_rows_i4 = dot_rows_i4;
}
