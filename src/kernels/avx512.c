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
// gemm_packed (the projections): a 14 x 32 micro-kernel on a pre-packed B,
// see its section below.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#include <math.h>
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

// One row: the edge of M (fewer than MR rows left).
static inline __attribute__((always_inline)) void ukr1(int64_t K, const float *A, int64_t ars,
                                                       int64_t aks, const float *B,
                                                       int64_t ldb, float *C, int64_t ldc,
                                                       __mmask16 m0, __mmask16 m1, bool add) {
    (void)ars;
    (void)ldc;
    const bool full = false;
    __m512 c00 = _mm512_setzero_ps(), c01 = c00;
    for (int64_t k = 0; k < K; k++) {
        LOAD_B;
        ROW_FMA(0);
    }
    ROW_STORE(0);
}

// One micro-tile row block: C[0:mr, 0:nr] (+)= A B, mr <= MR.
static inline __attribute__((always_inline)) void tile_acc(int64_t kc, const float *A,
                                                           int64_t ars, int64_t aks,
                                                           const float *B, int64_t ldb,
                                                           float *C, int64_t ldc, int64_t mr,
                                                           int64_t nr, bool add) {
    const __mmask16 m0 = tail_mask(nr), m1 = tail_mask(nr - 16);
    if (mr == MR && nr >= NR && add) ukr8(kc, A, ars, aks, B, ldb, C, ldc, m0, m1, true, true);
    else if (mr == MR && nr >= NR) ukr8(kc, A, ars, aks, B, ldb, C, ldc, m0, m1, true, false);
    else if (mr == MR && add) ukr8(kc, A, ars, aks, B, ldb, C, ldc, m0, m1, false, true);
    else if (mr == MR) ukr8(kc, A, ars, aks, B, ldb, C, ldc, m0, m1, false, false);
    else
        for (int64_t r = 0; r < mr; r++)
            ukr1(kc, A + r * ars, ars, aks, B, ldb, C + r * ldc, ldc, m0, m1, add);
}

// C (M, N) += A B (overwrite: C = A B, C never read) in KC x NC blocks of
// MR x NR micro-tiles.
static inline __attribute__((always_inline)) void gemm_acc(float *C, int64_t ldc,
                                                           const float *A, int64_t ars,
                                                           int64_t aks, const float *B,
                                                           int64_t ldb, int64_t M, int64_t N,
                                                           int64_t K, bool overwrite) {
    for (int64_t j0 = 0; j0 < N; j0 += NC) {
        int64_t nc = N - j0 < NC ? N - j0 : NC;
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
            int64_t kc = K - k0 < KC ? K - k0 : KC;
            const bool add = !overwrite || k0 > 0;
            for (int64_t i0 = 0; i0 < M; i0 += MR) {
                int64_t mr = M - i0 < MR ? M - i0 : MR;
                for (int64_t j1 = 0; j1 < nc; j1 += NR)
                    tile_acc(kc, A + i0 * ars + k0 * aks, ars, aks, B + k0 * ldb + j0 + j1,
                             ldb, C + i0 * ldc + j0 + j1, ldc, mr, nc - j1, add);
            }
        }
    }
}

static void gemm_nn_acc(float *C, int64_t ldc, const float *A, int64_t lda, const float *B,
                        int64_t ldb, int64_t M, int64_t N, int64_t K) {
    gemm_acc(C, ldc, A, lda, 1, B, ldb, M, N, K, false);
}

// gemm_tn_acc (kernels.h): C += A^T B with A stored (K, M), row stride lda:
// the same blocking, micro-tiles and per-element sum order as gemm_nn_acc,
// so it is bit-identical to transposing A and calling gemm_nn_acc.
static void gemm_tn_acc(float *C, int64_t ldc, const float *A, int64_t lda, const float *B,
                        int64_t ldb, int64_t M, int64_t N, int64_t K) {
    gemm_acc(C, ldc, A, 1, lda, B, ldb, M, N, K, false);
}

// gemm_nn: the first k chunk stored, not added to zeros (the same bits).
static void gemm_nn(float *C, int64_t ldc, const float *A, int64_t lda, const float *B,
                    int64_t ldb, int64_t M, int64_t N, int64_t K) {
    if (K <= 0)
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < N; j += 16)
                _mm512_mask_storeu_ps(C + i * ldc + j, tail_mask(N - j), _mm512_setzero_ps());
    gemm_acc(C, ldc, A, lda, 1, B, ldb, M, N, K, true);
}

// ---------------------------------------------------------------------------
// Packed-B GEMM (kernels.h: pack_b, gemm_packed). B in 32-wide panels,
// contiguous along k; A copied per (PMC rows, PKC k) block into 14-row
// micro-panels (k-major, 14 floats per k); a 14 x 32 micro-kernel: 28 zmm
// accumulators, per k two aligned-stream B loads and 14 broadcasts for 28
// FMAs. Loops: rows by PMC, k by PKC (A block packed once, ~112 KiB, in
// L2), column panels (a 32 x PKC B micro-panel, 32 KiB, stays in L1 across
// the row tiles), row tiles. Edge rows: the A copy is zero-padded to 14
// rows, the tile computed whole and only the real rows stored; edge
// columns: B is zero-padded, stores masked. Each C element's sum is the
// same FMA chain whatever the tile it falls in.
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

static void pack_b(float *Bp, const float *B, int64_t sk, int64_t sn, int64_t K, int64_t N) {
    for (int64_t j0 = 0; j0 < N; j0 += PNR) {
        const int64_t nr = N - j0 < PNR ? N - j0 : PNR;
        float *P = Bp + j0 * K;  // panel j0 / PNR
        if (sn == 1) {
            const __mmask16 m0 = tail_mask(nr), m1 = tail_mask(nr - 16);
            for (int64_t k = 0; k < K; k++) {
                const float *b = B + k * sk + j0;
                _mm512_storeu_ps(P + k * PNR, _mm512_maskz_loadu_ps(m0, b));
                _mm512_storeu_ps(P + k * PNR + 16, _mm512_maskz_loadu_ps(m1, b + 16));
            }
        } else if (sk == 1) {  // columns of B contiguous (B = W^T): transpose
            for (int64_t h = 0; h < 2; h++) {
                const int64_t rows = nr - 16 * h;
                transpose_rows(P + 16 * h, PNR, 0xffff, B + (j0 + 16 * h) * sn, sn,
                               rows > 0 ? rows : 0, K);
            }
        } else {
            for (int64_t k = 0; k < K; k++)
                for (int64_t j = 0; j < PNR; j++)
                    P[k * PNR + j] = j < nr ? B[k * sk + (j0 + j) * sn] : 0.0f;
        }
    }
}

// Ap (tiles of 14 rows, k-major) <- A (mc, kc), rows past mc zero.
static void pack_a(float *Ap, const float *A, int64_t lda, int64_t mc, int64_t kc) {
    for (int64_t i0 = 0; i0 < mc; i0 += PMR) {
        const int64_t rows = mc - i0 < PMR ? mc - i0 : PMR;
        transpose_rows(Ap + i0 * kc, PMR, (__mmask16)((1u << PMR) - 1u), A + i0 * lda, lda,
                       rows, kc);
    }
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

// C[0:mr, 0:32 under m0, m1] = [C +] Ap (14, kc) Bp (kc, 32) [+ bias]
// the C tile's lines, wanted by the stores at the end
#define PK_PF(r)                                                       \
    if ((r) < mr) {                                                    \
        _mm_prefetch((const char *)(C + ldc * (r)), _MM_HINT_T0);      \
        _mm_prefetch((const char *)(C + ldc * (r) + 31), _MM_HINT_T0); \
    }
// pf: kc lines to prefetch into L2, one per k (a part of the next panel:
// B streams from L3 when it outgrows L2). Without this and the C
// prefetch, the N = 2304 projection ran ~8% slower.
// 16 elements of a packed B from element e: float32 (kind 0), or bf16 (1)
// / f16 (2) widened (exact)
static inline __attribute__((always_inline)) __m512 ldb(const void *B, int64_t e, int kind) {
    if (kind == 0) return _mm512_loadu_ps((const float *)B + e);
    const __m256i h = _mm256_loadu_si256((const __m256i *)(const void *)((const uint16_t *)B +
                                                                         e));
    if (kind == 1) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

// (kind: B's elements, ldb; pf: bytes, one 64-byte line per k)
static inline __attribute__((always_inline)) void ukr_any(int64_t kc, const float *Ap,
                                                          const void *Bp, int kind, float *C,
                                                          int64_t ldc, int64_t mr,
                                                          __mmask16 m0, __mmask16 m1, bool add,
                                                          const float *bias, const char *pf) {
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

static void ukr_packed(int64_t kc, const float *Ap, const void *Bp, int kind, float *C,
                       int64_t ldc, int64_t mr, __mmask16 m0, __mmask16 m1, bool add,
                       const float *bias, const char *pf) {
    ukr_any(kc, Ap, Bp, 0, C, ldc, mr, m0, m1, add, bias, pf);
    (void)kind;
}
static void ukr_packed_bf(int64_t kc, const float *Ap, const void *Bp, int kind, float *C,
                          int64_t ldc, int64_t mr, __mmask16 m0, __mmask16 m1, bool add,
                          const float *bias, const char *pf) {
    ukr_any(kc, Ap, Bp, 1, C, ldc, mr, m0, m1, add, bias, pf);
    (void)kind;
}
static void ukr_packed_hf(int64_t kc, const float *Ap, const void *Bp, int kind, float *C,
                          int64_t ldc, int64_t mr, __mmask16 m0, __mmask16 m1, bool add,
                          const float *bias, const char *pf) {
    ukr_any(kc, Ap, Bp, 2, C, ldc, mr, m0, m1, add, bias, pf);
    (void)kind;
}

// Ap (tiles of 14 rows, k-major) <- the (mc, kc) block of a transposed A
// (element (i, k) at A[k*lda + i]): 14 contiguous floats per tile and k,
// rows past mc zero; each row of A read once, left to right. The same Ap
// as pack_a of the transposed copy.
static void pack_a_t(float *Ap, const float *A, int64_t lda, int64_t mc, int64_t kc) {
    const __mmask16 st = (__mmask16)((1u << PMR) - 1u);
    for (int64_t k = 0; k < kc; k++)
        for (int64_t i0 = 0; i0 < mc; i0 += PMR)
            _mm512_mask_storeu_ps(Ap + i0 * kc + k * PMR, st,
                                  _mm512_maskz_loadu_ps(st & tail_mask(mc - i0),
                                                        A + k * lda + i0));
}

// gemm_packed and gemm_packed_tn: A row-major (at false) or stored
// transposed (at true); only the A copy differs.
static inline __attribute__((always_inline)) void gemm_packed_any(
    float *C, int64_t ldc, const float *A, int64_t lda, bool at, const void *Bp, int kind,
    const float *bias, int64_t M, int64_t N, int64_t K, bool accumulate, float *apack) {
    void (*ukr)(int64_t, const float *, const void *, int, float *, int64_t, int64_t, __mmask16,
                __mmask16, bool, const float *, const char *) = kind == 0   ? ukr_packed
                                                                : kind == 1 ? ukr_packed_bf
                                                                            : ukr_packed_hf;
    const int64_t es = kind == 0 ? 4 : 2;  // bytes of B's elements
    if (M <= 0 || N <= 0) return;
    if (K <= 0) {
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < N; j += 16) {
                const __mmask16 m = tail_mask(N - j);
                __m512 v = accumulate ? _mm512_maskz_loadu_ps(m, C + i * ldc + j)
                                      : _mm512_setzero_ps();
                if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, bias + j));
                _mm512_mask_storeu_ps(C + i * ldc + j, m, v);
            }
        return;
    }
    // row blocks of at most PMC rows, as even as whole tiles allow (each
    // block streams all of B once: no small last block)
    const int64_t tiles = (M + PMR - 1) / PMR, nblk = (tiles + PMC / PMR - 1) / (PMC / PMR);
    for (int64_t ib = 0; ib < nblk; ib++) {
        const int64_t i0 = ib * tiles / nblk * PMR, i1 = (ib + 1) * tiles / nblk * PMR;
        const int64_t mc = (i1 < M ? i1 : M) - i0;
        for (int64_t k0 = 0; k0 < K; k0 += PKC) {
            const int64_t kc = K - k0 < PKC ? K - k0 : PKC;
            const bool add = accumulate || k0 > 0, last = k0 + kc == K;
            if (at) pack_a_t(apack, A + k0 * lda + i0, lda, mc, kc);
            else pack_a(apack, A + i0 * lda + k0, lda, mc, kc);
            for (int64_t j0 = 0; j0 < N; j0 += PNR) {
                const int64_t nr = N - j0;
                const __mmask16 m0 = tail_mask(nr), m1 = tail_mask(nr - 16);
                const char *Bb = (const char *)Bp + (j0 * K + k0 * PNR) * es;
                const float *bj = last && bias ? bias + j0 : NULL;
                // the next panel's micro-panel (kc lines of 32 elements),
                // prefetched by the first tiles; the others re-touch their
                // own A
                const char *nb = j0 + PNR < N ? Bb + PNR * K * es : Bb;
                for (int64_t t = 0, ti = 0; t < mc; t += PMR, ti++)
                    ukr(kc, apack + t * kc, Bb, kind, C + (i0 + t) * ldc + j0, ldc, mc - t, m0,
                        m1, add, bj,
                        ti < es / 2 ? nb + ti * 64 * kc : (const char *)(apack + t * kc));
            }
        }
    }
}

static void gemm_packed(float *C, int64_t ldc, const float *A, int64_t lda, const float *Bp,
                        const float *bias, int64_t M, int64_t N, int64_t K, bool accumulate,
                        float *apack) {
    gemm_packed_any(C, ldc, A, lda, false, Bp, 0, bias, M, N, K, accumulate, apack);
}

static void gemm_packed_bh(float *C, int64_t ldc, const float *A, int64_t lda,
                           const uint16_t *Bp, int kind, const float *bias, int64_t M,
                           int64_t N, int64_t K, bool accumulate, float *apack) {
    gemm_packed_any(C, ldc, A, lda, false, Bp, kind, bias, M, N, K, accumulate, apack);
}

static void gemm_packed_tn(float *C, int64_t ldc, const float *A, int64_t lda, const float *Bp,
                           const float *bias, int64_t M, int64_t N, int64_t K, bool accumulate,
                           float *apack) {
    gemm_packed_any(C, ldc, A, lda, true, Bp, 0, bias, M, N, K, accumulate, apack);
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
