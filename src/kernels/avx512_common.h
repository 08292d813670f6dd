// avx512_common.h: small AVX-512F helpers of the AVX-512 kernels
// (avx512.c, avx512_decode.c); include after <immintrin.h>, from files
// built with -mavx512f only.
#ifndef MHA_AVX512_COMMON_H
#define MHA_AVX512_COMMON_H

#include <stdint.h>

static inline __mmask16 tail_mask(int64_t n) {  // lanes [0, n) of 16
    return n >= 16 ? (__mmask16)0xffff : n <= 0 ? 0 : (__mmask16)((1u << n) - 1u);
}

// 16 x 16 transpose: r[i] lane l -> r[l] lane i.
static inline void transpose16(__m512 r[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int g = 0; g < 4; g++) {
        u[4 * g + 0] = _mm512_shuffle_ps(t[4 * g], t[4 * g + 2], 0x44);
        u[4 * g + 1] = _mm512_shuffle_ps(t[4 * g], t[4 * g + 2], 0xEE);
        u[4 * g + 2] = _mm512_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0x44);
        u[4 * g + 3] = _mm512_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0xEE);
    }
    for (int e = 0; e < 4; e++) {
        const __m512 v = _mm512_shuffle_f32x4(u[e], u[4 + e], 0x88);
        const __m512 w = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0x88);
        const __m512 v2 = _mm512_shuffle_f32x4(u[e], u[4 + e], 0xDD);
        const __m512 w2 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0xDD);
        r[e] = _mm512_shuffle_f32x4(v, w, 0x88);
        r[8 + e] = _mm512_shuffle_f32x4(v, w, 0xDD);
        r[4 + e] = _mm512_shuffle_f32x4(v2, w2, 0x88);
        r[12 + e] = _mm512_shuffle_f32x4(v2, w2, 0xDD);
    }
}

#endif
