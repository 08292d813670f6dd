// bench_rand.c: the benchmarks' seeded inputs (bench.h), shared by
// bench_module.c, bench_decode.c and bench_serve.c.
#include "bench.h"

// splitmix64: a seeded, portable stream.
uint64_t bench_next(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// n uniform floats in [-1, 1) from the stream.
void bench_fill_uniform(float *x, int64_t n, uint64_t *s) {
    for (int64_t i = 0; i < n; i++)
        x[i] = (float)((double)(bench_next(s) >> 40) * 0x1p-23 - 1.0);
}
