// avx512bf16.c: the bf16 packed-B GEMM (kernels.h: pack_b_bf16,
// gemm_packed_bf16) on VDPBF16PS. Built with -mavx512f -mavx512bf16
// -mavx512bw -mavx512vl for this file only; used only when the CPU has
// AVX512-BF16 (cpu.c). Compiled without those flags (MHA_SCALAR_ONLY, or a
// build that does not set them) it is a stub whose filler returns false.
//
// The same structure as avx512.c's fp32 packed GEMM: B in 32-column
// panels, here as bf16 pairs (k, k+1) per column, 128 bytes per pair of k;
// A rounded to bf16 (VCVTNE2PS2BF16) and copied per (PMC rows, KC k) block
// into 14-row micro-panels (per pair of k, 14 dwords = the rows' pairs); a
// 14 x 32 micro-kernel: 28 zmm accumulators, per pair of k two B loads and
// 14 dword broadcasts (folded into VDPBF16PS as {1to16} operands) for 28
// VDPBF16PS, i.e. 56 k-steps of 16 lanes: twice the work per instruction
// of the fp32 FMA kernel. But on Sapphire/Emerald Rapids VDPBF16PS issues
// once per ~2 cycles and holds both FMA ports meanwhile (measured: 0.47 per
// cycle; 4 of them cost as much as 16 FMAs): half the FMA rate. So the
// default kernel (ukr_fma) does the same steps as float32 FMAs on the bf16
// operands (exact products: the same bits), at ~0.95x of the fp32 kernel;
// the VDPBF16PS one stays for CPUs where it is fast (MHA_BF16_DP=1).
#include "kernels.h"

#if defined(__x86_64__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && \
    (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#include "avx512_common.h"

#define PMR 14
#define PNR 32
#define PKC MHA__BF16_KC
#define PMC (PMR * 8)



// Rows of float32 (contiguous along k) to bf16 pairs, transposed:
//   dst[q*ldd + i] = (bf16(src[i*lds + 2q]), bf16(src[i*lds + 2q + 1]))  (dwords)
// for i < rows (<= 16; lanes rows..15 are 0, stored under `store` only),
// q < ceil(kn / 2); k >= kn reads as 0. 32 k (16 pairs) at a time.
// split (the A copy of the FMA kernel): instead of the pairs, per pair q
// the odd elements as float32 at dst + 2 q ldd, the even ones at
// dst + (2 q + 1) ldd.
static void pack_pairs(uint32_t *dst, int64_t ldd, __mmask16 store, const float *src,
                       int64_t lds, int64_t rows, int64_t kn, bool split) {
    __m512 r[16];
    for (int64_t k0 = 0; k0 < kn; k0 += 32) {
        const int64_t kk = kn - k0 < 32 ? kn - k0 : 32, qq = (kk + 1) / 2;
        const __mmask16 mlo = tail_mask(kk), mhi = tail_mask(kk - 16);
        for (int i = 0; i < 16; i++) {
            if (i < rows) {
                const float *s = src + i * lds + k0;
                const __m512bh h =
                    _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(mhi, s + 16), _mm512_maskz_loadu_ps(mlo, s));
                r[i] = _mm512_castsi512_ps((__m512i)h);
            } else {
                r[i] = _mm512_setzero_ps();
            }
        }
        transpose16(r);
        if (split) {
            const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
            for (int64_t q = 0; q < qq; q++) {
                const __m512i v = _mm512_castps_si512(r[q]);
                uint32_t *d = dst + (k0 / 2 + q) * 2 * ldd;
                _mm512_mask_storeu_epi32(d, store, _mm512_and_si512(v, hi));
                _mm512_mask_storeu_epi32(d + ldd, store, _mm512_slli_epi32(v, 16));
            }
        } else {
            for (int64_t q = 0; q < qq; q++)
                _mm512_mask_storeu_epi32(dst + (k0 / 2 + q) * ldd, store, _mm512_castps_si512(r[q]));
        }
    }
}

static void pack_b_bf16(uint16_t *Bp, const float *B, int64_t sk, int64_t sn, int64_t K,
                        int64_t N) {
    const int64_t Kp = (K + 1) / 2;
    for (int64_t j0 = 0; j0 < N; j0 += PNR) {
        const int64_t nr = N - j0 < PNR ? N - j0 : PNR;
        uint16_t *P = Bp + j0 * 2 * Kp;  // panel j0 / PNR
        if (sk == 1) {  // columns of B contiguous (B = W^T): pairs, transposed
            for (int64_t h = 0; h < 2; h++) {
                const int64_t rows = nr - 16 * h;
                pack_pairs((uint32_t *)P + 16 * h, PNR, 0xffff, B + (j0 + 16 * h) * sn, sn,
                           rows > 0 ? rows : 0, K, false);
            }
        } else if (sn == 1) {  // rows of B contiguous: two rows, interleaved
            for (int64_t q = 0; q < Kp; q++) {
                const float *b0 = B + 2 * q * sk + j0, *b1 = b0 + sk;
                const bool odd = 2 * q + 1 < K;
                for (int64_t h = 0; h < 2; h++) {
                    const __mmask16 m = tail_mask(nr - 16 * h);
                    const __m512 x0 = _mm512_maskz_loadu_ps(m, b0 + 16 * h);
                    const __m512 x1 = odd ? _mm512_maskz_loadu_ps(m, b1 + 16 * h) : _mm512_setzero_ps();
                    const __m512i v = (__m512i)_mm512_cvtne2ps_pbh(x1, x0);  // x0 low, x1 high
                    const __m512i lo = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(v));
                    const __m512i hi = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1));
                    _mm512_storeu_si512(P + (q * PNR + 16 * h) * 2,
                                        _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
                }
            }
        } else {
            for (int64_t q = 0; q < Kp; q++)
                for (int64_t j = 0; j < PNR; j++)
                    for (int64_t e = 0; e < 2; e++) {
                        const int64_t kk = 2 * q + e;
                        P[(q * PNR + j) * 2 + e] =
                            j < nr && kk < K ? mha__f32_to_bf16(B[kk * sk + (j0 + j) * sn]) : 0;
                    }
        }
    }
}

// Ap (tiles of 14 rows; per pair of k, 14 dwords) <- bf16(A (mc, kc)), rows
// past mc and k past kc zero.
// split: the FMA kernel's copy (per pair, 14 odd then 14 even float32;
// twice the size).
static void pack_a(uint32_t *Ap, const float *A, int64_t lda, int64_t mc, int64_t kc,
                   bool split) {
    const int64_t kp = (kc + 1) / 2, w = split ? 2 : 1;
    for (int64_t i0 = 0; i0 < mc; i0 += PMR) {
        const int64_t rows = mc - i0 < PMR ? mc - i0 : PMR;
        pack_pairs(Ap + i0 * kp * w, PMR, (__mmask16)((1u << PMR) - 1u), A + i0 * lda, lda,
                   rows, kc, split);
    }
}

#define PK_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13)
#define PK_DECL(r) __m512 c##r##a = _mm512_setzero_ps(), c##r##b = _mm512_setzero_ps();
// the A pair broadcast is VDPBF16PS's memory operand ({1to16}); a pair is
// a*b + a*b in either operand order, so A may be the second source
#define PK_DP(r)                                                              \
    {                                                                         \
        const __m512bh a = (__m512bh)_mm512_set1_epi32((int)Ap[r]);           \
        c##r##a = _mm512_dpbf16_ps(c##r##a, b0, a);                           \
        c##r##b = _mm512_dpbf16_ps(c##r##b, b1, a);                           \
    }
#define PK_STORE(r)                                                           \
    if ((r) < mr) {                                                           \
        float *c = C + (r) * ldc;                                             \
        __m512 v0 = c##r##a, v1 = c##r##b;                                    \
        if (add) {                                                            \
            v0 = _mm512_add_ps(_mm512_maskz_loadu_ps(m0, c), v0);             \
            v1 = _mm512_add_ps(_mm512_maskz_loadu_ps(m1, c + 16), v1);        \
        }                                                                     \
        if (bias) {                                                           \
            v0 = _mm512_add_ps(v0, bb0);                                      \
            v1 = _mm512_add_ps(v1, bb1);                                      \
        }                                                                     \
        _mm512_mask_storeu_ps(c, m0, v0);                                     \
        _mm512_mask_storeu_ps(c + 16, m1, v1);                                \
    }
#define PK_PF(r)                                                              \
    if ((r) < mr) {                                                           \
        _mm_prefetch((const char *)(C + (r) * ldc), _MM_HINT_T0);             \
        _mm_prefetch((const char *)(C + (r) * ldc + 31), _MM_HINT_T0);        \
    }

// C[0:mr, 0:32 under m0, m1] = [C +] Ap (14, 2 kp) Bp (2 kp, 32) [+ bias];
// pf: kp lines to prefetch into L2, one per pair (part of the next panel).
static void ukr_bf16(int64_t kp, const uint32_t *Ap, const uint16_t *Bp, float *C,
                     int64_t ldc, int64_t mr, __mmask16 m0, __mmask16 m1, bool add,
                     const float *bias, const uint16_t *pf) {
    PK_ROWS(PK_DECL)
    PK_ROWS(PK_PF)
#pragma GCC unroll 4
    for (int64_t q = 0; q < kp; q++) {
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(Bp),
                       b1 = (__m512bh)_mm512_loadu_si512(Bp + 32);
        _mm_prefetch((const char *)(pf + 32 * q), _MM_HINT_T1);
        PK_ROWS(PK_DP)
        Ap += PMR;
        Bp += 2 * PNR;
    }
    __m512 bb0 = _mm512_setzero_ps(), bb1 = bb0;
    if (bias) {
        bb0 = _mm512_maskz_loadu_ps(m0, bias);
        bb1 = _mm512_maskz_loadu_ps(m1, bias + 16);
    }
    PK_ROWS(PK_STORE)
}

// The same tile by float32 FMAs: B pairs split into odd (the high halves:
// and) and even (shifted up) float32 columns, then per row an FMA with
// the odd A element and one with the even: a bf16 product is exact in
// float32, so fma(a, b, S) = S + a b rounded once, VDPBF16PS's step (same
// bits, subnormal sums aside). Ap: per pair 14 odd then 14 even floats.
#define EM_FMA(r)                                                             \
    {                                                                         \
        const __m512 a = _mm512_set1_ps(Af[r]);                               \
        c##r##a = _mm512_fmadd_ps(a, b0, c##r##a);                            \
        c##r##b = _mm512_fmadd_ps(a, b1, c##r##b);                            \
    }
static void ukr_fma(int64_t kp, const uint32_t *Ap, const uint16_t *Bp, float *C,
                    int64_t ldc, int64_t mr, __mmask16 m0, __mmask16 m1, bool add,
                    const float *bias, const uint16_t *pf) {
    PK_ROWS(PK_DECL)
    PK_ROWS(PK_PF)
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    const float *Af = (const float *)Ap;
#pragma GCC unroll 2
    for (int64_t q = 0; q < kp; q++) {
        _mm_prefetch((const char *)(pf + 32 * q), _MM_HINT_T1);
        {
            const __m512 b0 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(Bp), hi)),
                         b1 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(Bp + 32), hi));
            PK_ROWS(EM_FMA)
        }
        Af += PMR;
        {
            const __m512 b0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(Bp), 16)),
                         b1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(Bp + 32), 16));
            PK_ROWS(EM_FMA)
        }
        Af += PMR;
        Bp += 2 * PNR;
    }
    __m512 bb0 = _mm512_setzero_ps(), bb1 = bb0;
    if (bias) {
        bb0 = _mm512_maskz_loadu_ps(m0, bias);
        bb1 = _mm512_maskz_loadu_ps(m1, bias + 16);
    }
    PK_ROWS(PK_STORE)
}

static inline __attribute__((always_inline)) void gemm_bf16(
    float *C, int64_t ldc, const float *A, int64_t lda, const uint16_t *Bp, const float *bias,
    int64_t M, int64_t N, int64_t K, bool accumulate, uint16_t *apack, bool fma) {
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
    uint32_t *ap = (uint32_t *)apack;
    const int64_t Kp = (K + 1) / 2;
    // row blocks of at most PMC rows, as even as whole tiles allow
    const int64_t tiles = (M + PMR - 1) / PMR, nblk = (tiles + PMC / PMR - 1) / (PMC / PMR);
    for (int64_t ib = 0; ib < nblk; ib++) {
        const int64_t i0 = ib * tiles / nblk * PMR, i1 = (ib + 1) * tiles / nblk * PMR;
        const int64_t mc = (i1 < M ? i1 : M) - i0;
        for (int64_t k0 = 0; k0 < K; k0 += PKC) {
            const int64_t kc = K - k0 < PKC ? K - k0 : PKC, kp = (kc + 1) / 2;
            const bool add = accumulate || k0 > 0, last = k0 + kc == K;
            pack_a(ap, A + i0 * lda + k0, lda, mc, kc, fma);
            for (int64_t j0 = 0; j0 < N; j0 += PNR) {
                const int64_t nr = N - j0;
                const __mmask16 m0 = tail_mask(nr), m1 = tail_mask(nr - 16);
                const uint16_t *Bb = Bp + j0 * 2 * Kp + k0 * PNR;  // pair k0 / 2
                const float *bj = last && bias ? bias + j0 : NULL;
                // the next panel's micro-panel (2 kp lines), prefetched by
                // the first two tiles; the others re-touch their own A
                const uint16_t *nb = j0 + PNR < N ? Bb + PNR * 2 * Kp : Bb;
                const int64_t w = fma ? 2 : 1;  // A copy: dwords per row and pair
                for (int64_t t = 0, ti = 0; t < mc; t += PMR, ti++) {
                    const uint32_t *at = ap + t * kp * w;
                    const uint16_t *pf = ti < 2 ? nb + ti * 32 * kp : (const uint16_t *)at;
                    if (fma)
                        ukr_fma(kp, at, Bb, C + (i0 + t) * ldc + j0, ldc, mc - t, m0, m1, add,
                                bj, pf);
                    else
                        ukr_bf16(kp, at, Bb, C + (i0 + t) * ldc + j0, ldc, mc - t, m0, m1, add,
                                 bj, pf);
                }
            }
        }
    }
}

static void gemm_packed_bf16_dp(float *C, int64_t ldc, const float *A, int64_t lda,
                                const uint16_t *Bp, const float *bias, int64_t M, int64_t N,
                                int64_t K, bool accumulate, uint16_t *apack) {
    gemm_bf16(C, ldc, A, lda, Bp, bias, M, N, K, accumulate, apack, false);
}

static void gemm_packed_bf16_fma(float *C, int64_t ldc, const float *A, int64_t lda,
                                 const uint16_t *Bp, const float *bias, int64_t M, int64_t N,
                                 int64_t K, bool accumulate, uint16_t *apack) {
    gemm_bf16(C, ldc, A, lda, Bp, bias, M, N, K, accumulate, apack, true);
}

bool mha__kernels_fill_avx512bf16(mha__kernels *k, bool dp) {
    k->bf16_isa = dp ? "avx512bf16" : "avx512bf16-fma";
    k->pk16_native = true;
    k->pk16_nr = PNR;
    k->pk16_mr = PMR;
    k->pk16_kc = PKC;
    k->pk16_apack = 2 * PMC * PKC;  // the FMA kernel's split copy; the dp one uses half
    k->pack_b_bf16 = pack_b_bf16;
    k->gemm_packed_bf16 = dp ? gemm_packed_bf16_dp : gemm_packed_bf16_fma;
    return true;
}

#else

bool mha__kernels_fill_avx512bf16(mha__kernels *k, bool dp) {
    (void)k;
    (void)dp;
    return false;
}

#endif
