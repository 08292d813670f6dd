// philox.h: the Philox4x32-10 counter-based generator and the dropout keep
// decision built on it. Internal, not installed.
//
// Philox4x32-10 is exactly Random123's philox4x32 with 10 rounds (Salmon,
// Moraes, Dror, Shaw, "Parallel random numbers: as easy as 1, 2, 3", SC 2011,
// https://doi.org/10.1145/2063384.2063405; constants and known-answer tests
// from Random123, https://github.com/DEShawResearch/random123). The public
// entry point is mha_philox4x32_10 (philox.c); mha__philox4x32_10 below is
// the same function, inline for the dropout loops.
//
// Dropout keep decision (the one definition; forward and backward both use
// it, so a mask is never stored, only regenerated):
//   element idx of a stream, seed, offset, p:
//     block = idx / 4, lane = idx % 4
//     ctr   = {lo32(block), hi32(block), lo32(offset), hi32(offset)}
//     key   = {lo32(seed) ^ xor_lo, hi32(seed) ^ xor_hi}
//     r     = philox4x32_10(ctr, key)[lane]
//     u     = (float)(r >> 8) * 2^-24          (24 bits: exact, in [0, 1))
//     keep  iff u >= p
// so P(keep) = 1 - p up to the 2^-24 grid; p = 0 keeps every element and
// p = 1 none. The streams (attention weights, output) differ by the key's
// xor constants, so the same (seed, offset, idx) gives independent masks.
#ifndef MHA_PHILOX_H
#define MHA_PHILOX_H

#include <stdbool.h>
#include <stdint.h>

#include "mha.h"

// Dropout on the attention weights of head (b, h): weight (i, j) is kept
// with probability 1 - p (and scaled by 1/(1-p)) as decided by
// mha__dropout_keep(seed, offset, stream ATTN, ((b*H + h)*L + i)*S + j, p)
// (philox.h). NULL: no dropout.
typedef struct mha__dropout {
    float p;
    uint64_t seed, offset;
    int64_t H, L, S;
} mha__dropout;

// Stream of the dropout on the attention weights: key = seed.
#define MHA__DROPOUT_STREAM_ATTN_LO 0x00000000u
#define MHA__DROPOUT_STREAM_ATTN_HI 0x00000000u
// Stream of the dropout after the output projection: key = seed ^ the
// 64-bit golden ratio 0x9E3779B97F4A7C15 (split lo/hi as below).
#define MHA__DROPOUT_STREAM_OUT_LO 0x9E3779B9u
#define MHA__DROPOUT_STREAM_OUT_HI 0x7F4A7C15u

// Random123's constants for philox4x32: the round multipliers and the Weyl
// sequence that bumps the key (golden ratio, sqrt(3) - 1).
#define MHA__PHILOX_M0 0xD2511F53u
#define MHA__PHILOX_M1 0xCD9E8D57u
#define MHA__PHILOX_W0 0x9E3779B9u
#define MHA__PHILOX_W1 0xBB67AE85u

// One round (Random123's _philox4x32round), with 32x32 -> 64-bit products
// split into hi and lo halves:
//   hi0:lo0 = M0 * c0,  hi1:lo1 = M1 * c2
//   c' = {hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0}
// Between rounds the key is bumped: k0 += W0, k1 += W1 (mod 2^32). Ten
// rounds, the first with the unbumped key.
static inline void mha__philox4x32_10(uint32_t out[4], const uint32_t ctr[4],
                                      const uint32_t key[2]) {
    uint32_t c0 = ctr[0], c1 = ctr[1], c2 = ctr[2], c3 = ctr[3];
    uint32_t k0 = key[0], k1 = key[1];
    for (int r = 0; r < 10; r++) {
        if (r > 0) {
            k0 += MHA__PHILOX_W0;
            k1 += MHA__PHILOX_W1;
        }
        uint64_t p0 = (uint64_t)MHA__PHILOX_M0 * c0;
        uint64_t p1 = (uint64_t)MHA__PHILOX_M1 * c2;
        uint32_t hi0 = (uint32_t)(p0 >> 32), lo0 = (uint32_t)p0;
        uint32_t hi1 = (uint32_t)(p1 >> 32), lo1 = (uint32_t)p1;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
    }
    out[0] = c0;
    out[1] = c1;
    out[2] = c2;
    out[3] = c3;
}

// u = (float)(r >> 8) * 2^-24, uniform on the 2^-24 grid of [0, 1).
static inline float mha__philox_u01(uint32_t r) { return (float)(r >> 8) * 0x1p-24f; }

// The keep decision for element idx of a stream (definition above).
static inline bool mha__dropout_keep(uint64_t seed, uint64_t offset, uint32_t stream_key_xor_lo,
                                     uint32_t stream_key_xor_hi, uint64_t idx, float p) {
    uint64_t block = idx / 4;
    uint32_t ctr[4] = {(uint32_t)block, (uint32_t)(block >> 32), (uint32_t)offset,
                       (uint32_t)(offset >> 32)};
    uint32_t key[2] = {(uint32_t)seed ^ stream_key_xor_lo,
                       (uint32_t)(seed >> 32) ^ stream_key_xor_hi};
    uint32_t r[4];
    mha__philox4x32_10(r, ctr, key);
    return mha__philox_u01(r[idx % 4]) >= p;
}

// keep[i] = mha__dropout_keep(seed, offset, xl, xh, idx0 + i, p) (1 or 0)
// for i in [0, n), computing each Philox block once. keep: (n) bytes.
// idx0 + n must not wrap around 2^64.
void mha__dropout_row(uint8_t *keep, uint64_t seed, uint64_t offset, uint32_t xl, uint32_t xh,
                      uint64_t idx0, int64_t n, float p);

// Output dropout factor of element (n, t, e) of an (N, L, E) output with
// dropout p: 0 or 1/(1-p) (philox.c).
float mha__out_drop_factor(uint64_t seed, uint64_t offset, float p, int64_t L, int64_t E,
                           int64_t n, int64_t t, int64_t e);

#endif  // MHA_PHILOX_H
