// philox.c: the public Philox4x32-10 entry point and the row-at-a-time
// dropout mask. The generator and the keep decision are defined in
// philox.h (Salmon et al., SC 2011, https://doi.org/10.1145/2063384.2063405;
// Random123's philox4x32 with 10 rounds). This file does no dropout itself:
// forward and backward call mha__dropout_keep / mha__dropout_row.
#include "philox.h"

void mha_philox4x32_10(uint32_t out[4], const uint32_t ctr[4], const uint32_t key[2]) {
    if (!out || !ctr || !key) return;  // void API: nothing to report
    uint32_t c[4] = {ctr[0], ctr[1], ctr[2], ctr[3]};
    uint32_t k[2] = {key[0], key[1]};
    mha__philox4x32_10(out, c, k);  // copies: out may alias ctr or key
}

// Element idx0 + i sits in block (idx0 + i) / 4, lane (idx0 + i) % 4. A
// block's four words serve up to four consecutive elements, so each block is
// computed once; the partial blocks at both ends are handled by the same
// loop (lane starts at idx0 % 4 and the last block stops at n).
void mha__dropout_row(uint8_t *keep, uint64_t seed, uint64_t offset, uint32_t xl, uint32_t xh,
                      uint64_t idx0, int64_t n, float p) {
    if (n <= 0) return;
    uint32_t key[2] = {(uint32_t)seed ^ xl, (uint32_t)(seed >> 32) ^ xh};
    uint64_t block = idx0 / 4;
    unsigned lane = (unsigned)(idx0 % 4);
    int64_t i = 0;
    while (i < n) {
        uint32_t ctr[4] = {(uint32_t)block, (uint32_t)(block >> 32), (uint32_t)offset,
                           (uint32_t)(offset >> 32)};
        uint32_t r[4];
        mha__philox4x32_10(r, ctr, key);
        for (; lane < 4 && i < n; lane++, i++)
            keep[i] = (uint8_t)(mha__philox_u01(r[lane]) >= p);
        lane = 0;
        block++;
    }
}

// Output dropout factor of element (n, t, e) of an (N, L, E) output with
// dropout p: 0 or 1/(1-p).
float mha__out_drop_factor(uint64_t seed, uint64_t offset, float p, int64_t L, int64_t E,
                           int64_t n, int64_t t, int64_t e) {
    uint64_t idx = (uint64_t)((n * L + t) * E + e);
    return mha__dropout_keep(seed, offset, MHA__DROPOUT_STREAM_OUT_LO,
                             MHA__DROPOUT_STREAM_OUT_HI, idx, p)
               ? 1.0f / (1.0f - p)
               : 0.0f;
}
