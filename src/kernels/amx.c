// amx.c: gemm_bf16 on AMX tiles (Intel Sapphire Rapids and later), on top
// of the avx512 + AVX512-BF16 table, where the CPU has AMX-BF16 and Linux
// grants this process the tile state (cpu.c asks once:
// arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)). A tile product
// (16 rows x 32 k) x (32 k x 16 columns) sums in the unit's own order, so
// the slot promises a bound, not the generic bits (kernels.h); the same
// shapes give the same bits every time. Each call loads its tile
// configuration and releases the tiles: other code in the thread (oneDNN
// under PyTorch) may use the tiles between calls.
#include <immintrin.h>
#include <string.h>

#include "kernels.h"

typedef struct tile_config {
    uint8_t palette, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

// Tiles: tmm0 C (16 x 16 float32), tmm1 A (16 rows x 32 bf16), tmm2 B (16
// pair rows x 16 columns x 2), all 16 rows x 64 bytes. (Measured here:
// alternating tiles between chunks or blocks, or 2 x 2 blocks, gained
// nothing; storing whole blocks straight into C and scaling them after
// did: 2.9 -> 1.5 us for a 64 x 128 x 64 product.)
static void configure(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 3; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

static void pack_bf16(uint16_t *Bp, const uint16_t *B, int64_t sk, int64_t sn, int64_t K,
                      int64_t N) {
    mha__pack_bf16_avx512(Bp, B, sk, sn, K, N, 32);
}

static void gemm_bf16(float *C, int64_t ldc, const uint16_t *A, int64_t lda, const uint16_t *Bp,
                      int64_t nb, int64_t M, int64_t N, int64_t K, float alpha, bool acc) {
    const int64_t Np = (nb + 15) / 16 * 16, Kp = (K + 31) / 32 * 32;
    float tmp[16 * 16] __attribute__((aligned(64)));
    configure();
    for (int64_t i0 = 0; i0 < M; i0 += 16) {
        const int64_t mr = M - i0 < 16 ? M - i0 : 16;
        for (int64_t j0 = 0; j0 < N; j0 += 16) {
            const int64_t nr = N - j0 < 16 ? N - j0 : 16;
            const __mmask16 km = (__mmask16)(0xffffu >> (16 - nr));
            float *c = C + i0 * ldc + j0;
            // a whole block's tile goes to C itself, a partial one's to tmp
            const bool whole = mr == 16 && nr == 16;
            float *dst = whole ? c : tmp;
            const int64_t ld = whole ? ldc * 4 : 64;
            if (!whole && acc)
                for (int64_t r = 0; r < 16; r++)
                    _mm512_store_ps(tmp + r * 16, r < mr
                                                      ? _mm512_maskz_loadu_ps(km, c + r * ldc)
                                                      : _mm512_setzero_ps());
            if (acc) _tile_loadd(0, dst, ld);
            else _tile_zero(0);
            for (int64_t kc = 0; kc < Kp; kc += 32) {
                _tile_loadd(1, A + i0 * lda + kc, lda * 2);
                _tile_loadd(2, Bp + ((kc / 2) * Np + j0) * 2, Np * 4);
                _tile_dpbf16ps(0, 1, 2);
            }
            _tile_stored(0, dst, ld);
            if (whole) continue;
            const __m512 al = _mm512_set1_ps(acc ? 1.0f : alpha);
            for (int64_t r = 0; r < mr; r++) {
                const __m512 x = _mm512_load_ps(tmp + r * 16);
                _mm512_mask_storeu_ps(c + r * ldc, km, acc ? x : _mm512_mul_ps(x, al));
            }
        }
    }
    _tile_release();
    // the whole blocks of an overwrite, scaled once all are stored
    if (!acc && alpha != 1.0f) {
        const __m512 al = _mm512_set1_ps(alpha);
        for (int64_t r = 0; r < M / 16 * 16; r++)
            for (int64_t j = 0; j < N / 16 * 16; j += 16)
                _mm512_storeu_ps(C + r * ldc + j,
                                 _mm512_mul_ps(al, _mm512_loadu_ps(C + r * ldc + j)));
    }
}

void mha__kernels_fill_amx(mha__kernels *k) {
    k->isa = "amx";
    k->bf_kpad = 32;
    k->bf_mpad = 16;
    k->bf_exact = false;
    k->bf_fast = true;
    k->pack_bf16 = pack_bf16;
    k->gemm_bf16 = gemm_bf16;
}
