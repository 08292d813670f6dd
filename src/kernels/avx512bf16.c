// avx512bf16.c: the bf16 slots (kernels.h) with AVX512-BF16's vdpbf16ps,
// on top of the avx512 table where the CPU has it (Intel Cooper Lake and
// later, AMD Zen 4 and later). gemm_bf16 gives the generic version's bits:
// one vdpbf16ps lane is two exact products added odd pair element first,
// each add rounded to nearest even with subnormals flushed, the order
// generic.c writes out.
#include <immintrin.h>
#include <string.h>

#include "kernels.h"

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

// pack_bf16 for a table of pad kpad (the generic layout, kernels.h), with
// AVX-512: B rows along n (sn == 1, the V tiles) interleaved two rows at a
// time; B columns along k (sk == 1, the K^T tiles) a 32-bit transpose of
// the k pairs by gathers. Other strides: the generic packer.
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
    if (sk == 1 && K % 2 == 0 && sn <= INT32_MAX / 32) {
        const __m512i lane = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8,
                                                                 7, 6, 5, 4, 3, 2, 1, 0),
                                                _mm512_set1_epi32((int)(sn * 2)));
        for (int64_t p = 0; p < Kp / 2; p++)
            for (int64_t j = 0; j < Np; j += 16) {
                const __mmask16 m = 2 * p >= K    ? 0
                                    : j + 16 <= N ? 0xffff
                                    : j < N       ? (__mmask16)(0xffffu >> (16 - (N - j)))
                                                  : 0;
                const __m512i w = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, lane,
                                                              (const void *)(B + j * sn + 2 * p),
                                                              1);
                _mm512_storeu_si512(Bp + (p * Np + j) * 2, daz32(w));
            }
        return;
    }
    mha__pack_bf16_generic(Bp, B, sk, sn, K, N, kpad);
}

static void pack_bf16(uint16_t *Bp, const uint16_t *B, int64_t sk, int64_t sn, int64_t K,
                      int64_t N) {
    mha__pack_bf16_avx512(Bp, B, sk, sn, K, N, 2);
}

void mha__kernels_fill_avx512bf16(mha__kernels *k) {
    // Intel issues one vdpbf16ps (32 products) per cycle against two
    // float32 FMAs (32 products): no faster here, and this kernel is not
    // ((1, 12, 2048, 64) on a Sapphire Rapids: 97-106 ms against 71 ms on
    // converted rows). AMD Zen 4 issues more; to be measured there before
    // the flash forward takes it.
    k->bf_fast = false;
    k->bf_exact = true;
    k->gemm_bf16 = gemm_bf16;
    k->pack_bf16 = pack_bf16;
}
