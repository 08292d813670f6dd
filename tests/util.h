// util.h: what the C tests share besides check.h: one seeded generator,
// the error measures, and a module with PyTorch's initialisation.
#ifndef MHA_TEST_UTIL_H
#define MHA_TEST_UTIL_H

#include <math.h>
#include <stdint.h>

#include "check.h"
#include "mha.h"

// The generator (a 64-bit LCG with Knuth's MMIX constants). Each test
// seeds it in main (and where a case must be reproducible on its own, as
// on every MPI rank), so its cases are its own.
static uint64_t g_rng;
static inline void seed_rng(uint64_t seed) { g_rng = seed; }
static inline uint64_t next(void) {
    g_rng = g_rng * 6364136223846793005ull + 1442695040888963407ull;
    return g_rng >> 11;
}
// Uniform in [-1, 1).
static inline float frand(void) { return (float)((double)next() * 0x1p-53 * 2.0 - 1.0); }
// Uniform in [lo, hi].
static inline int64_t irand(int64_t lo, int64_t hi) {
    return lo + (int64_t)(next() % (uint64_t)(hi - lo + 1));
}

static inline double max_abs(const float *x, int64_t n) {
    double m = 0;
    for (int64_t i = 0; i < n; i++) m = fmax(m, fabs((double)x[i]));
    return m;
}
// max |a - b| / (1 + max |a|).
static inline double rel_err(const float *a, const float *b, int64_t n) {
    double e = 0;
    for (int64_t i = 0; i < n; i++) e = fmax(e, fabs((double)a[i] - b[i]));
    return e / (1.0 + max_abs(a, n));
}

// A module of config c with PyTorch's default initialisation (seed).
static inline mha_module *torch_module(const mha_config *c, uint64_t seed) {
    mha_module *m = NULL;
    CHECK_OK(mha_module_create(&m, c));
    mha_init_options io;
    mha_init_options_default(&io);
    io.seed = seed;
    CHECK_OK(mha_module_init(m, &io));
    return m;
}

#endif
