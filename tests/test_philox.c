// test_philox.c: Philox4x32-10 against Random123's published known-answer
// vectors, and the dropout keep decision built on it (philox.h): keep rate,
// the p = 0 / p = 1 ends, the row helper against the one-element definition,
// and that offsets, seeds and streams give different masks.
//
// Known answers: Random123 (https://github.com/DEShawResearch/random123),
// tests/kat_vectors, lines "philox4x32 10 ..." (zeros, all ones, digits of
// pi), and tests/old_kat_vectors (the vectors the Random123 paper's Crush
// runs satisfied), a selection of its "philox4x32 10" lines. Format there:
// ctr[0..3] key[0..1] expected[0..3], words in index order.
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "mha.h"
#include "philox.h"

typedef struct kat {
    const char *source;
    uint32_t ctr[4], key[2], expected[4];
} kat;

static const kat KATS[] = {
    // tests/kat_vectors
    {"kat_vectors zeros",
     {0x00000000, 0x00000000, 0x00000000, 0x00000000},
     {0x00000000, 0x00000000},
     {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
    {"kat_vectors ones",
     {0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff},
     {0xffffffff, 0xffffffff},
     {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
    {"kat_vectors pi",
     {0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
     {0xa4093822, 0x299f31d0},
     {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
    // tests/old_kat_vectors
    {"old_kat_vectors ctr0=1 key0=1",
     {0x00000001, 0x00000000, 0x00000000, 0x00000000},
     {0x00000001, 0x00000000},
     {0xac08141b, 0xdfc5ccbe, 0x79c07a47, 0xa7f66093}},
    {"old_kat_vectors ctr3=1 key0=1",
     {0x00000000, 0x00000000, 0x00000000, 0x00000001},
     {0x00000001, 0x00000000},
     {0x127bee41, 0x1e047488, 0x48842b20, 0x0a393496}},
    {"old_kat_vectors ctr1=ffffffff key0=1",
     {0x00000000, 0xffffffff, 0x00000000, 0x00000000},
     {0x00000001, 0x00000000},
     {0x04e2eae1, 0x463cc999, 0xe7786310, 0x65b3dc49}},
    {"old_kat_vectors pi key0=1",
     {0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
     {0x00000001, 0x00000000},
     {0x38527b8f, 0xfad9a48c, 0x20e675c0, 0xf2fea26a}},
    {"old_kat_vectors ctr2=1 key1=1",
     {0x00000000, 0x00000000, 0x00000001, 0x00000000},
     {0x00000000, 0x00000001},
     {0x7f6c13ff, 0x114b2447, 0x0550eced, 0xea1fc805}},
    {"old_kat_vectors pi2 key1=1",
     {0xa4093822, 0x299f31d0, 0x082efa98, 0xec4e6c89},
     {0x00000000, 0x00000001},
     {0x1c28fa3f, 0x8c5bf977, 0xbb989783, 0x0c1a3737}},
    {"old_kat_vectors ctr3=80000000 key1=ffffffff",
     {0x00000000, 0x00000000, 0x00000000, 0x80000000},
     {0x00000000, 0xffffffff},
     {0x2a460458, 0x0a2709e5, 0x47bc9115, 0x0f96d8af}},
    {"old_kat_vectors pi3 key1=80000000",
     {0x452821e6, 0x38d01377, 0xbe5466cf, 0x34e90c6c},
     {0x00000000, 0x80000000},
     {0x94ca5566, 0x14924b2f, 0x28214292, 0x59faeaee}},
};

static void test_kat(void) {
    for (size_t t = 0; t < sizeof KATS / sizeof KATS[0]; t++) {
        const kat *k = &KATS[t];
        uint32_t out[4];
        mha_philox4x32_10(out, k->ctr, k->key);
        int ok = memcmp(out, k->expected, sizeof out) == 0;
        CHECKF(ok, "%s: got %08x %08x %08x %08x", k->source, out[0], out[1], out[2], out[3]);
        printf("kat %-44s %s\n", k->source, ok ? "ok" : "FAILED");
        // The inline version used by the dropout loops is the same function.
        uint32_t out2[4];
        mha__philox4x32_10(out2, k->ctr, k->key);
        CHECK(memcmp(out2, k->expected, sizeof out2) == 0);
    }
    // out may alias ctr.
    uint32_t c[4] = {0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344};
    uint32_t key[2] = {0xa4093822, 0x299f31d0};
    mha_philox4x32_10(c, c, key);
    CHECK(c[0] == 0xd16cfe09 && c[1] == 0x94fdcceb && c[2] == 0x5001e420 && c[3] == 0x24126ea1);
}

// The one-element definition, restated from the contract independently of
// philox.h's helpers (only the generator itself is shared).
static int keep_by_definition(uint64_t seed, uint64_t offset, uint32_t xl, uint32_t xh,
                              uint64_t idx, float p) {
    uint64_t block = idx / 4;
    uint32_t ctr[4] = {(uint32_t)(block & 0xffffffffu), (uint32_t)(block >> 32),
                       (uint32_t)(offset & 0xffffffffu), (uint32_t)(offset >> 32)};
    uint32_t key[2] = {(uint32_t)(seed & 0xffffffffu) ^ xl, (uint32_t)(seed >> 32) ^ xh};
    uint32_t r[4];
    mha_philox4x32_10(r, ctr, key);
    float u = (float)(r[idx % 4] >> 8) * (1.0f / 16777216.0f);
    return u >= p;
}

enum { NDRAW = 1000000 };

static void test_keep_rate(uint8_t *mask) {
    const float ps[] = {0.1f, 0.5f, 0.9f};
    const uint32_t streams[2][2] = {{MHA__DROPOUT_STREAM_ATTN_LO, MHA__DROPOUT_STREAM_ATTN_HI},
                                    {MHA__DROPOUT_STREAM_OUT_LO, MHA__DROPOUT_STREAM_OUT_HI}};
    for (int s = 0; s < 2; s++) {
        for (int i = 0; i < 3; i++) {
            float p = ps[i];
            uint64_t seed = 0x0123456789abcdefull + (uint64_t)i;
            mha__dropout_row(mask, seed, 7, streams[s][0], streams[s][1], 0, NDRAW, p);
            int64_t kept = 0, kept_lane[4] = {0, 0, 0, 0};
            for (int64_t j = 0; j < NDRAW; j++) {
                kept += mask[j];
                kept_lane[j % 4] += mask[j];
            }
            double q = 1.0 - (double)p;
            double mean = NDRAW * q, sigma = sqrt(NDRAW * q * (1.0 - q));
            double z = ((double)kept - mean) / sigma;
            printf("keep rate stream %s p=%.1f: %.6f (expected %.6f, z=%+.2f)\n",
                   s ? "out" : "attn", p, (double)kept / NDRAW, q, z);
            CHECKF(fabs(z) <= 5.0, "p=%g kept %lld of %d, z=%g", p, (long long)kept, NDRAW, z);
            // Each lane of the 4-word blocks separately.
            for (int l = 0; l < 4; l++) {
                double nl = NDRAW / 4;
                double zl = ((double)kept_lane[l] - nl * q) / sqrt(nl * q * (1.0 - q));
                CHECKF(fabs(zl) <= 5.0, "p=%g lane %d z=%g", p, l, zl);
            }
        }
    }
}

static void test_ends(uint8_t *mask) {
    // p = 0 keeps everything (u >= 0 always), p = 1 keeps nothing (u < 1).
    mha__dropout_row(mask, 42, 3, 0, 0, 5, NDRAW, 0.0f);
    int64_t kept = 0;
    for (int64_t j = 0; j < NDRAW; j++) kept += mask[j];
    CHECKF(kept == NDRAW, "p=0 kept %lld of %d", (long long)kept, NDRAW);
    mha__dropout_row(mask, 42, 3, 0, 0, 5, NDRAW, 1.0f);
    kept = 0;
    for (int64_t j = 0; j < NDRAW; j++) kept += mask[j];
    CHECKF(kept == 0, "p=1 kept %lld", (long long)kept);
    int all = 1;
    for (uint64_t j = 0; j < 1000; j++) all &= mha__dropout_keep(99, 1, 0, 0, j, 0.0f);
    CHECK(all);
    printf("p=0 keeps all, p=1 keeps none\n");
}

// The row helper equals the one-element definition, for every start lane,
// lengths that end mid-block, indices past 2^34 (block's high word), and
// offsets and seeds with high words set.
static void test_row_agrees(void) {
    const uint64_t idx0s[] = {0, 1, 2, 3, 4, 5, 1001, (1ull << 34) - 3, 0xfffffffffffff000ull};
    const int64_t ns[] = {0, 1, 2, 3, 4, 5, 7, 64, 257};
    const uint64_t seeds[] = {0, 0xdeadbeefcafef00dull};
    const uint64_t offsets[] = {0, 1, 0x100000003ull};
    const float ps[] = {0.0f, 0.3f, 0.5f, 0.97f};
    uint8_t row[257];
    int64_t mism = 0, total = 0;
    for (size_t a = 0; a < sizeof idx0s / sizeof idx0s[0]; a++)
        for (size_t b = 0; b < sizeof ns / sizeof ns[0]; b++)
            for (size_t c = 0; c < sizeof seeds / sizeof seeds[0]; c++)
                for (size_t d = 0; d < sizeof offsets / sizeof offsets[0]; d++)
                    for (size_t e = 0; e < sizeof ps / sizeof ps[0]; e++)
                        for (int s = 0; s < 2; s++) {
                            uint32_t xl = s ? MHA__DROPOUT_STREAM_OUT_LO : 0;
                            uint32_t xh = s ? MHA__DROPOUT_STREAM_OUT_HI : 0;
                            memset(row, 0xAA, sizeof row);
                            mha__dropout_row(row, seeds[c], offsets[d], xl, xh, idx0s[a],
                                             ns[b], ps[e]);
                            for (int64_t i = 0; i < ns[b]; i++) {
                                uint64_t idx = idx0s[a] + (uint64_t)i;
                                int k1 = mha__dropout_keep(seeds[c], offsets[d], xl, xh, idx,
                                                           ps[e]);
                                int k2 = keep_by_definition(seeds[c], offsets[d], xl, xh, idx,
                                                            ps[e]);
                                mism += (row[i] != k1) + (k1 != k2);
                                total++;
                            }
                            // Nothing written past n.
                            for (int64_t i = ns[b]; i < (int64_t)sizeof row; i++)
                                mism += row[i] != 0xAA;
                        }
    printf("row helper vs definition: %lld elements, %lld mismatches\n", (long long)total,
           (long long)mism);
    CHECKF(mism == 0, "%lld mismatches", (long long)mism);
}

// Fraction of equal entries of two masks drawn at p = 0.5 must be about 1/2
// (independent masks), never 1.
static void check_independent(const char *what, const uint8_t *a, const uint8_t *b, int64_t n) {
    int64_t same = 0;
    for (int64_t i = 0; i < n; i++) same += a[i] == b[i];
    double z = ((double)same - 0.5 * n) / sqrt(0.25 * n);
    printf("masks differ by %s: %.4f equal (z=%+.2f)\n", what, (double)same / n, z);
    CHECKF(fabs(z) <= 5.0, "%s: %lld of %lld equal, z=%g", what, (long long)same, (long long)n,
           z);
}

static void test_streams_differ(void) {
    enum { N = 65536 };
    static uint8_t base[N], other[N];
    const uint64_t seed = 1234;
    mha__dropout_row(base, seed, 10, 0, 0, 0, N, 0.5f);
    mha__dropout_row(other, seed, 11, 0, 0, 0, N, 0.5f);
    check_independent("offset 10 vs 11", base, other, N);
    mha__dropout_row(other, seed, 10 + (1ull << 32), 0, 0, 0, N, 0.5f);
    check_independent("offset high word", base, other, N);
    mha__dropout_row(other, seed + 1, 10, 0, 0, 0, N, 0.5f);
    check_independent("seed 1234 vs 1235", base, other, N);
    mha__dropout_row(other, seed | (1ull << 40), 10, 0, 0, 0, N, 0.5f);
    check_independent("seed high word", base, other, N);
    mha__dropout_row(other, seed, 10, MHA__DROPOUT_STREAM_OUT_LO, MHA__DROPOUT_STREAM_OUT_HI,
                     0, N, 0.5f);
    check_independent("stream attn vs out", base, other, N);
    mha__dropout_row(other, seed, 10, 0, 0, N, N, 0.5f);
    check_independent("element range", base, other, N);
    // Same arguments: the same mask (regenerated, never stored).
    mha__dropout_row(other, seed, 10, 0, 0, 0, N, 0.5f);
    CHECK(memcmp(base, other, N) == 0);
}

int main(void) {
    uint8_t *mask = malloc(NDRAW);
    if (!mask) {
        fprintf(stderr, "test_philox: out of memory\n");
        return 1;
    }
    test_kat();
    test_keep_rate(mask);
    test_ends(mask);
    test_row_agrees();
    test_streams_differ();
    free(mask);
    return check_summary("test_philox");
}
