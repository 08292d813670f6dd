// generic.c: the portable C version of every kernel slot (kernels.h). Plain
// loops in an order the compiler can vectorise without reassociating any
// sum: C[i][j] accumulates over k in increasing k, whatever the ISA.
#include <math.h>

#include <string.h>

#include "kernels.h"
#include "mha.h"

// C (M, N) += A B with element (i, k) of A at A[i*ars + k*aks]: (lda, 1)
// for gemm_nn_acc, (1, lda) for gemm_tn_acc (A stored (K, M)); the same
// loops and expression either way.
static void gemm_acc(float *C, int64_t ldc, const float *A, int64_t ars, int64_t aks,
                     const float *B, int64_t ldb, int64_t M, int64_t N, int64_t K) {
    for (int64_t i = 0; i < M; i++) {
        float *c = C + i * ldc;
        for (int64_t k = 0; k < K; k++) {
            const float a = A[i * ars + k * aks];
            const float *b = B + k * ldb;
            for (int64_t j = 0; j < N; j++) c[j] += a * b[j];
        }
    }
}

static void gemm_nn_acc(float *C, int64_t ldc, const float *A, int64_t lda, const float *B,
                        int64_t ldb, int64_t M, int64_t N, int64_t K) {
    gemm_acc(C, ldc, A, lda, 1, B, ldb, M, N, K);
}

static void gemm_tn_acc(float *C, int64_t ldc, const float *A, int64_t lda, const float *B,
                        int64_t ldb, int64_t M, int64_t N, int64_t K) {
    gemm_acc(C, ldc, A, 1, lda, B, ldb, M, N, K);
}

static void gemm_nn(float *C, int64_t ldc, const float *A, int64_t lda, const float *B,
                    int64_t ldb, int64_t M, int64_t N, int64_t K) {
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) C[i * ldc + j] = 0.0f;
    gemm_nn_acc(C, ldc, A, lda, B, ldb, M, N, K);
}

static float softmax_update(float *x, int64_t n, float *m, float *l) {
    float mx = *m;
    for (int64_t j = 0; j < n; j++) mx = x[j] > mx ? x[j] : mx;
    if (mx == -INFINITY) {  // nothing visible yet: all weights 0
        if (!mha__row_has_nan(x, n)) {
            for (int64_t j = 0; j < n; j++) x[j] = 0.0f;
            return 1.0f;
        }
        mx = NAN;  // a NaN score: the row becomes NaN
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

static void softmax_rows(float *x, int64_t ldx, int64_t R, int64_t n, float *m, float *l,
                         float *alpha) {
    for (int64_t r = 0; r < R; r++) alpha[r] = softmax_update(x + r * ldx, n, &m[r], &l[r]);
}

static void dot_rows(float *s, const float *A, int64_t lda, const float *x, int64_t n,
                     int64_t D) {
    for (int64_t j = 0; j < n; j++) {  // 16 partial sums (vectorisable), then their sum
        const float *a = A + j * lda;
        float acc[16] = {0};
        int64_t c = 0;
        for (; c + 16 <= D; c += 16)
            for (int u = 0; u < 16; u++) acc[u] += a[c + u] * x[c + u];
        for (int u = 0; c < D; c++, u++) acc[u] += a[c] * x[c];
        float t = 0.0f;
        for (int u = 0; u < 16; u++) t += acc[u];
        s[j] = t;
    }
}

static void cvt_bf16(float *dst, const uint16_t *src, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const uint32_t b = (uint32_t)src[i] << 16;
        memcpy(dst + i, &b, 4);
    }
}

static void cvt_f16(float *dst, const uint16_t *src, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = mha_f16_to_f32(src[i]);
}

static void cvt_i8(float *dst, const int8_t *src, int64_t n, float scale) {
    for (int64_t i = 0; i < n; i++) dst[i] = scale * (float)src[i];
}

// 4-bit two's complement nibble c of the bytes at p (element 2i low in
// byte i, 2i + 1 high)
static inline int i4_at(const uint8_t *p, int64_t c) {
    const int u = c & 1 ? p[c / 2] >> 4 : p[c / 2] & 15;
    return u >= 8 ? u - 16 : u;
}

static void cvt_i4(float *dst, const uint8_t *src, int64_t n, const float *scales) {
    for (int64_t c = 0; c < n; c++) dst[c] = scales[c / 32] * (float)i4_at(src, c);
}

// element c of row j of a float32 (0), bf16 (1), f16 (2), int8 (3) or int4
// (4: with its group's scale; kernels.h) matrix
static inline float q_at(const void *A, int64_t lda, int kind, const float *scales,
                         int64_t sld, int64_t j, int64_t c) {
    if (kind == 0) return ((const float *)A)[j * lda + c];
    if (kind == 4)
        return scales[j * sld + c / 32] * (float)i4_at((const uint8_t *)A + j * (lda / 2), c);
    if (kind == 3) return (float)((const int8_t *)A)[j * lda + c];
    const uint16_t h = ((const uint16_t *)A)[j * lda + c];
    if (kind == 2) return mha_f16_to_f32(h);
    const uint32_t b = (uint32_t)h << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

// The caller's next rows (pf): asked for at once, where the compiler can
// (a hint; the portable versions do no look-ahead of their own).
static void prefetch_next(const void *pf, size_t pfb) {
#if defined(__GNUC__) || defined(__clang__)
    for (size_t b = 0; pf && b < pfb; b += 64) __builtin_prefetch((const char *)pf + b);
#else
    (void)pf, (void)pfb;
#endif
}

void mha__dot_rows_q_generic(float *s, const void *A, int64_t lda, int kind,
                             const float *scales, int64_t sld, const float *x, int64_t n,
                             int64_t D, const void *pf, size_t pfb) {
    prefetch_next(pf, pfb);
    for (int64_t j = 0; j < n; j++) {
        float acc = 0.0f;
        for (int64_t c = 0; c < D; c++) acc += q_at(A, lda, kind, scales, sld, j, c) * x[c];
        s[j] = (kind == 3 ? scales[j * sld] : 1.0f) * acc;
    }
}

void mha__axpy_rows_q_generic(float *o, const float *p, const void *A, int64_t lda, int kind,
                              const float *scales, int64_t sld, int64_t n, int64_t Dv,
                              const void *pf, size_t pfb) {
    prefetch_next(pf, pfb);
    for (int64_t j = 0; j < n; j++) {
        const float w = p[j] * (kind == 3 ? scales[j * sld] : 1.0f);
        for (int64_t c = 0; c < Dv; c++) o[c] += w * q_at(A, lda, kind, scales, sld, j, c);
    }
}

// dot_rows_i8 (kernels.h): the exact integer sums, then the two roundings.
static void dot_rows_i8(float *s, int64_t lds, const int8_t *A, int64_t lda,
                        const float *scales, int64_t sld, const int8_t *Xq, int64_t ldx,
                        const float *xs, int64_t ldxs, int64_t ng, int64_t n, int64_t D,
                        const void *pf, size_t pfb) {
    prefetch_next(pf, pfb);
    for (int64_t j = 0; j < n; j++) {
        const int8_t *a = A + j * lda;
        for (int64_t g = 0; g < ng; g++) {
            const int8_t *x = Xq + g * ldx;
            int32_t t = 0;
            for (int64_t c = 0; c < D; c++) t += (int32_t)a[c] * (int32_t)x[c];
            const float f = scales[j * sld] * xs[g * ldxs];
            s[g * lds + j] = f * (float)t;
        }
    }
}

// dot_rows_i4 (kernels.h): mha__dot_row_i4 per row and query.
static void dot_rows_i4(float *s, int64_t lds, const uint8_t *A, int64_t rb,
                        const float *scales, int64_t sld, const int8_t *Xq, int64_t ldx,
                        const float *xs, int64_t ldxs, int64_t ng, int64_t n, int64_t D,
                        const void *pf, size_t pfb) {
    prefetch_next(pf, pfb);
    for (int64_t j = 0; j < n; j++)
        for (int64_t g = 0; g < ng; g++)
            s[g * lds + j] = mha__dot_row_i4(A + j * rb, scales + j * sld, Xq + g * ldx, D,
                                             xs[g * ldxs]);
}

// The group versions: query by query (the rows read once per query).
static void dot_rows_qg(float *s, int64_t lds, const void *A, int64_t lda, int kind,
                        const float *scales, int64_t sld, const float *X, int64_t ldx,
                        int64_t ng, int64_t n, int64_t D, const void *pf, size_t pfb) {
    for (int64_t g = 0; g < ng; g++)
        mha__dot_rows_q_generic(s + g * lds, A, lda, kind, scales, sld, X + g * ldx, n, D,
                                g ? NULL : pf, pfb);
}

static void axpy_rows_qg(float *O, int64_t ldo, const float *P, int64_t ldp, const void *A,
                         int64_t lda, int kind, const float *scales, int64_t sld, int64_t ng,
                         int64_t n, int64_t Dv, const void *pf, size_t pfb) {
    for (int64_t g = 0; g < ng; g++)
        mha__axpy_rows_q_generic(O + g * ldo, P + g * ldp, A, lda, kind, scales, sld, n, Dv,
                                 g ? NULL : pf, pfb);
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

static void exp_scale_rows(float *x, int64_t ld, int64_t R, int64_t n, const float *st) {
    for (int64_t r = 0; r < R; r++) {
        exp_shift(x + r * ld, n, st[2 * r]);
        scale_row(x + r * ld, n, st[2 * r + 1]);
    }
}

static void dot_acc_rows(float *sum, const float *a, const float *b, int64_t ld, int64_t R,
                         int64_t n) {
    for (int64_t r = 0; r < R; r++) {
        const float *ar = a + r * ld, *br = b + r * ld;
        float acc[16] = {0};
        int64_t j = 0;
        for (; j + 16 <= n; j += 16)
            for (int u = 0; u < 16; u++) {
                const float t = ar[j + u] * br[j + u];
                acc[u] = acc[u] + t;
            }
        for (int u = 0; j < n; j++, u++) {
            const float t = ar[j] * br[j];
            acc[u] = acc[u] + t;
        }
        float t = 0.0f;
        for (int u = 0; u < 16; u++) t += acc[u];
        sum[r] += t;
    }
}

static void dsoftmax_rows(float *d, const float *p, int64_t ld, int64_t R, int64_t n,
                          const float *ds) {
    for (int64_t r = 0; r < R; r++) {
        float *dr = d + r * ld;
        const float *pr = p + r * ld, c = ds[r];
        for (int64_t j = 0; j < n; j++) dr[j] = pr[j] * (dr[j] - c);
    }
}

// In 16 x 16 blocks: each block's reads and writes stay in a few lines.
static void transpose(float *dst, int64_t ldd, const float *src, int64_t lds, int64_t rows,
                      int64_t cols) {
    for (int64_t r0 = 0; r0 < rows; r0 += 16)
        for (int64_t c0 = 0; c0 < cols; c0 += 16) {
            const int64_t r1 = r0 + 16 < rows ? r0 + 16 : rows,
                          c1 = c0 + 16 < cols ? c0 + 16 : cols;
            for (int64_t c = c0; c < c1; c++)
                for (int64_t r = r0; r < r1; r++) dst[c * ldd + r] = src[r * lds + c];
        }
}

// Packed-B GEMM (kernels.h): 16-wide panels, no A copy (apack unused), one
// chunk over the whole K (pk_kc = 0), each C element's sum 0 + a*b + a*b
// ... in increasing k as gemm_nn computes it (then C + sum, then + bias).
#define GNR 16
#define GMR 4

static void pack_b(float *Bp, const float *B, int64_t sk, int64_t sn, int64_t K, int64_t N) {
    for (int64_t j0 = 0; j0 < N; j0 += GNR) {
        const int64_t nr = N - j0 < GNR ? N - j0 : GNR;
        float *P = Bp + j0 * K;
        for (int64_t k = 0; k < K; k++)
            for (int64_t j = 0; j < GNR; j++)
                P[k * GNR + j] = j < nr ? B[k * sk + (j0 + j) * sn] : 0.0f;
    }
}

static void store_packed(float *c, const float *acc, const float *bias, int64_t nr, bool add) {
    for (int64_t j = 0; j < nr; j++) {
        float v = add ? c[j] + acc[j] : acc[j];
        c[j] = bias ? v + bias[j] : v;
    }
}

// Element e of a packed B: float32 (kind 0), bf16 (1) or f16 (2), as float.
static inline float bp_at(const void *Bp, int kind, int64_t e) {
    if (kind == 0) return ((const float *)Bp)[e];
    const uint16_t h = ((const uint16_t *)Bp)[e];
    if (kind == 2) return mha_f16_to_f32(h);
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

// Element (i, k) of A at A[i*ars + k*aks]: (lda, 1) for gemm_packed,
// (1, lda) for gemm_packed_tn (A stored transposed); the same sums. B's
// elements of kind (bp_at).
static inline void gemm_packed_any(float *C, int64_t ldc, const float *A, int64_t ars,
                                   int64_t aks, const void *Bp, int kind, const float *bias,
                                   int64_t M, int64_t N, int64_t K, bool accumulate) {
    for (int64_t j0 = 0; j0 < N; j0 += GNR) {
        const int64_t nr = N - j0 < GNR ? N - j0 : GNR;
        const float *bj = bias ? bias + j0 : NULL;
        const int64_t P = j0 * K;  // the panel's first element
        int64_t i = 0;
        for (; i + GMR <= M; i += GMR) {
            float acc[GMR][GNR] = {{0}};
            for (int64_t k = 0; k < K; k++) {
                float b[GNR];
                for (int j = 0; j < GNR; j++) b[j] = bp_at(Bp, kind, P + k * GNR + j);
                for (int r = 0; r < GMR; r++) {
                    const float a = A[(i + r) * ars + k * aks];
                    for (int j = 0; j < GNR; j++) acc[r][j] = acc[r][j] + a * b[j];
                }
            }
            for (int r = 0; r < GMR; r++)
                store_packed(C + (i + r) * ldc + j0, acc[r], bj, nr, accumulate);
        }
        for (; i < M; i++) {
            float acc[GNR] = {0};
            for (int64_t k = 0; k < K; k++) {
                const float a = A[i * ars + k * aks];
                for (int j = 0; j < GNR; j++)
                    acc[j] = acc[j] + a * bp_at(Bp, kind, P + k * GNR + j);
            }
            store_packed(C + i * ldc + j0, acc, bj, nr, accumulate);
        }
    }
}

static void gemm_packed(float *C, int64_t ldc, const float *A, int64_t lda, const float *Bp,
                        const float *bias, int64_t M, int64_t N, int64_t K, bool accumulate,
                        float *apack) {
    (void)apack;
    gemm_packed_any(C, ldc, A, lda, 1, Bp, 0, bias, M, N, K, accumulate);
}

static void gemm_packed_tn(float *C, int64_t ldc, const float *A, int64_t lda, const float *Bp,
                           const float *bias, int64_t M, int64_t N, int64_t K, bool accumulate,
                           float *apack) {
    (void)apack;
    gemm_packed_any(C, ldc, A, 1, lda, Bp, 0, bias, M, N, K, accumulate);
}

static void gemm_packed_bh(float *C, int64_t ldc, const float *A, int64_t lda,
                           const uint16_t *Bp, int kind, const float *bias, int64_t M,
                           int64_t N, int64_t K, bool accumulate, float *apack) {
    (void)apack;
    gemm_packed_any(C, ldc, A, lda, 1, Bp, kind, bias, M, N, K, accumulate);
}


// ---- bf16 compute ----

static float bf16_value(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

// h with a subnormal flushed to signed zero (what vdpbf16ps and AMX read)
static uint16_t bf16_daz(uint16_t h) { return (h & 0x7f80) == 0 ? (uint16_t)(h & 0x8000) : h; }

void mha__round_bf16_generic(uint16_t *dst, const float *src, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &src[i], sizeof u);
        if ((u & 0x7fffffffu) > 0x7f800000u) dst[i] = (uint16_t)(u >> 16 | 0x40);  // NaN
        else if ((u & 0x7f800000u) == 0) dst[i] = (uint16_t)(u >> 16 & 0x8000);    // subnormal
        else dst[i] = (uint16_t)((u + 0x7fffu + (u >> 16 & 1)) >> 16);
    }
}

void mha__pack_bf16_generic(uint16_t *Bp, const uint16_t *B, int64_t sk, int64_t sn, int64_t K,
                            int64_t N, int64_t kpad) {
    const int64_t Np = (N + 15) / 16 * 16, Kp = (K + kpad - 1) / kpad * kpad;
    for (int64_t k = 0; k < Kp; k++)
        for (int64_t j = 0; j < Np; j++)
            Bp[((k / 2) * Np + j) * 2 + k % 2] = k < K && j < N ? bf16_daz(B[k * sk + j * sn])
                                                                : (uint16_t)0;
}

static void pack_bf16(uint16_t *Bp, const uint16_t *B, int64_t sk, int64_t sn, int64_t K,
                      int64_t N) {
    mha__pack_bf16_generic(Bp, B, sk, sn, K, N, 2);
}

// fexp (kernels.h softmax_rows_bf16): exp by 2^(z log2 e), a degree-5
// polynomial for 2^f on [-1/2, 1/2] with q(0) = 1.
#define FEXP_C5 0x1.5bba14p-10f
#define FEXP_C4 0x1.3cea88p-7f
#define FEXP_C3 0x1.c6b752p-5f
#define FEXP_C2 0x1.ebf9bcp-3f
#define FEXP_C1 0x1.62e42ap-1f
static float fexp(float z) {
    if (z != z) return z;
    if (z < -87.0f) return 0.0f;
    const float t = z * 1.44269504088896341f, k = nearbyintf(t), f = t - k;
    float q = fmaf(FEXP_C5, f, FEXP_C4);
    q = fmaf(q, f, FEXP_C3);
    q = fmaf(q, f, FEXP_C2);
    q = fmaf(q, f, FEXP_C1);
    q = fmaf(q, f, 1.0f);
    return ldexpf(q, (int)k);
}

void mha__softmax_rows_bf16_generic(const float *x, int64_t ldx, int64_t R, int64_t n,
                                    float scale, float *m, float *l, float *alpha, uint16_t *p,
                                    int64_t ldp) {
    for (int64_t r = 0; r < R; r++) {
        const float *xr = x + r * ldx;
        uint16_t *pr = p + r * ldp;
        float M = m[r];
        bool nan = false;
        for (int64_t j = 0; j < n; j++) {
            const float y = scale * xr[j];
            if (y > M) M = y;
            nan |= y != y;
        }
        if (M == -INFINITY) {
            if (!nan) {
                for (int64_t j = 0; j < n; j++) pr[j] = 0;
                alpha[r] = 1.0f;
                continue;
            }
            M = NAN;
        }
        float acc[16] = {0};
        for (int64_t j = 0; j < n; j++) {
            const float e = fexp(scale * xr[j] - M);  // (y - M: 0 for the largest)
            mha__round_bf16_generic(pr + j, &e, 1);
            acc[j % 16] += e;
        }
        for (int w = 8; w >= 1; w /= 2)
            for (int u = 0; u < w; u++) acc[u] += acc[u + w];
        alpha[r] = fexp(m[r] - M);
        l[r] = l[r] * alpha[r] + acc[0];
        m[r] = M;
    }
}

// s + a b rounded once, a subnormal result flushed to signed zero (FTZ)
static float fma_ftz(float a, float b, float s) {
    const float r = fmaf(a, b, s);
    return fabsf(r) < 0x1p-126f ? copysignf(0.0f, r) : r;
}

static void gemm_bf16(float *C, int64_t ldc, const uint16_t *A, int64_t lda, const uint16_t *Bp,
                      int64_t nb, int64_t M, int64_t N, int64_t K, float alpha, bool acc) {
    const int64_t Np = (nb + 15) / 16 * 16, P = (K + 1) / 2;
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            float s = acc ? C[i * ldc + j] : 0.0f;
            for (int64_t p = 0; p < P; p++) {
                const uint16_t *b = Bp + (p * Np + j) * 2;
                s = fma_ftz(bf16_value(A[i * lda + 2 * p + 1]), bf16_value(b[1]), s);
                s = fma_ftz(bf16_value(A[i * lda + 2 * p]), bf16_value(b[0]), s);
            }
            C[i * ldc + j] = acc ? s : alpha * s;
        }
}

void mha__kernels_fill_generic(mha__kernels *k) {
    k->isa = "scalar";
    k->gemm_nn = gemm_nn;
    k->gemm_nn_acc = gemm_nn_acc;
    k->gemm_tn_acc = gemm_tn_acc;
    k->softmax_update = softmax_update;
    k->softmax_rows = softmax_rows;
    k->dot_rows = dot_rows;
    k->cvt_bf16 = cvt_bf16;
    k->cvt_f16 = cvt_f16;
    k->cvt_i8 = cvt_i8;
    k->cvt_i4 = cvt_i4;
    k->dot_rows_q = mha__dot_rows_q_generic;
    k->axpy_rows_q = mha__axpy_rows_q_generic;
    k->dot_rows_qg = dot_rows_qg;
    k->dot_rows_i8 = dot_rows_i8;
    k->dot_rows_i4 = dot_rows_i4;
    k->axpy_rows_qg = axpy_rows_qg;
    k->scale_row = scale_row;
    k->exp_shift = exp_shift;
    k->exp_scale_rows = exp_scale_rows;
    k->dot_acc_rows = dot_acc_rows;
    k->dsoftmax_rows = dsoftmax_rows;
    k->transpose = transpose;
    k->pk_nr = GNR;
    k->pk_mr = GMR;
    k->pk_kc = 0;  // the whole K
    k->pk_apack = 0;
    k->pack_b = pack_b;
    k->gemm_packed = gemm_packed;
    k->gemm_packed_tn = gemm_packed_tn;
    k->gemm_packed_bh = gemm_packed_bh;
    k->bf_kpad = 2;
    k->bf_mpad = 1;
    // plain C's fmaf is slower than the float32 path (scalar table, (1, 12,
    // 512, 64): 924 ms against 61 ms)
    k->bf_fast = false;
    k->bf_exact = true;
    k->round_bf16 = mha__round_bf16_generic;
    k->softmax_rows_bf16 = mha__softmax_rows_bf16_generic;
    k->pack_bf16 = pack_bf16;
    k->gemm_bf16 = gemm_bf16;
}
