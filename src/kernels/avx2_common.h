// avx2_common.h: small AVX2 helpers of the AVX2 kernels (avx2.c,
// avx2_decode.c); include after <immintrin.h>, from files built with
// -mavx2 only.
#ifndef MHA_AVX2_COMMON_H
#define MHA_AVX2_COMMON_H

#include <stdint.h>


static inline __m256i tail_mask(int64_t n) {  // lanes [0, n) of 8
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    int32_t c = n >= 8 ? 8 : n <= 0 ? 0 : (int32_t)n;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(c), idx);
}

#endif
