// bench_peak.c: what `mha bench` holds its timings against, measured in the
// same process on the same threads (bench.h): the machine's fp32 FMA peak
// and its read bandwidth. x86-64 kernels (target attributes: one binary
// runs on any x86-64 and picks them at run time) with portable fallbacks.
#if defined(__linux__) && !defined(_DEFAULT_SOURCE)
#define _DEFAULT_SOURCE  // madvise
#endif
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define BENCH_X86 1
#endif

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "bench.h"
#include "cli.h"

// The machine's fp32 FMA peak: 12 independent chains acc = acc * m + c per
// thread (enough to cover an FMA latency of 4 cycles on two pipes), with
// constants that keep acc near 1 (no denormals, no overflow).

#define FMA_CHAINS 12

static volatile float g_sink;

#ifdef BENCH_X86
#define FMA12(FMADD)                                                          \
    a0 = FMADD(a0, m, c); a1 = FMADD(a1, m, c); a2 = FMADD(a2, m, c);         \
    a3 = FMADD(a3, m, c); a4 = FMADD(a4, m, c); a5 = FMADD(a5, m, c);         \
    a6 = FMADD(a6, m, c); a7 = FMADD(a7, m, c); a8 = FMADD(a8, m, c);         \
    a9 = FMADD(a9, m, c); a10 = FMADD(a10, m, c); a11 = FMADD(a11, m, c)

__attribute__((target("avx512f"))) static double fma_avx512(int64_t iters) {
    __m512 a0 = _mm512_set1_ps(0.1f), a1 = _mm512_set1_ps(0.2f),
           a2 = _mm512_set1_ps(0.3f), a3 = _mm512_set1_ps(0.4f),
           a4 = _mm512_set1_ps(0.5f), a5 = _mm512_set1_ps(0.6f),
           a6 = _mm512_set1_ps(0.7f), a7 = _mm512_set1_ps(0.8f),
           a8 = _mm512_set1_ps(0.9f), a9 = _mm512_set1_ps(1.1f),
           a10 = _mm512_set1_ps(1.2f), a11 = _mm512_set1_ps(1.3f);
    const __m512 m = _mm512_set1_ps(0.9999f), c = _mm512_set1_ps(1e-4f);
    for (int64_t i = 0; i < iters; i++) { FMA12(_mm512_fmadd_ps); }
    __m512 s = _mm512_add_ps(
        _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
        _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)));
    s = _mm512_add_ps(s, _mm512_add_ps(_mm512_add_ps(a8, a9),
                                       _mm512_add_ps(a10, a11)));
    g_sink = _mm512_reduce_add_ps(s);
    return (double)iters * FMA_CHAINS * 16 * 2;
}

__attribute__((target("avx2,fma"))) static double fma_avx2(int64_t iters) {
    __m256 a0 = _mm256_set1_ps(0.1f), a1 = _mm256_set1_ps(0.2f),
           a2 = _mm256_set1_ps(0.3f), a3 = _mm256_set1_ps(0.4f),
           a4 = _mm256_set1_ps(0.5f), a5 = _mm256_set1_ps(0.6f),
           a6 = _mm256_set1_ps(0.7f), a7 = _mm256_set1_ps(0.8f),
           a8 = _mm256_set1_ps(0.9f), a9 = _mm256_set1_ps(1.1f),
           a10 = _mm256_set1_ps(1.2f), a11 = _mm256_set1_ps(1.3f);
    const __m256 m = _mm256_set1_ps(0.9999f), c = _mm256_set1_ps(1e-4f);
    for (int64_t i = 0; i < iters; i++) { FMA12(_mm256_fmadd_ps); }
    __m256 s = _mm256_add_ps(
        _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
        _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
    s = _mm256_add_ps(s, _mm256_add_ps(_mm256_add_ps(a8, a9),
                                       _mm256_add_ps(a10, a11)));
    float t[8];
    _mm256_storeu_ps(t, s);
    g_sink = t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
    return (double)iters * FMA_CHAINS * 8 * 2;
}
#endif

// Portable fallback: a multiply and an add per element (2 FLOP), 12 chains
// of 8 lanes the compiler may vectorise with whatever the build targets.
static double fma_scalar(int64_t iters) {
    float a[FMA_CHAINS][8];
    for (int j = 0; j < FMA_CHAINS; j++)
        for (int l = 0; l < 8; l++) a[j][l] = 0.1f * (float)(j + 1) + 0.01f * (float)l;
    const float m = 0.9999f, c = 1e-4f;
    for (int64_t i = 0; i < iters; i++)
        for (int j = 0; j < FMA_CHAINS; j++)
            for (int l = 0; l < 8; l++) a[j][l] = a[j][l] * m + c;
    float s = 0;
    for (int j = 0; j < FMA_CHAINS; j++)
        for (int l = 0; l < 8; l++) s += a[j][l];
    g_sink = s;
    return (double)iters * FMA_CHAINS * 8 * 2;
}

typedef double (*fma_fn)(int64_t iters);

static fma_fn fma_pick(const char **name) {
#ifdef BENCH_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) { *name = "avx512"; return fma_avx512; }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        *name = "avx2";
        return fma_avx2;
    }
#endif
    *name = "scalar";
    return fma_scalar;
}

// GFLOP/s of nt threads each running ~0.1 s of FMA chains: the best of 3
// parallel runs (the machine may be shared), each the FLOPs of all threads
// over the wall time of the whole parallel region.
double peak_gflops(int nt, const char **isa) {
    fma_fn fn = fma_pick(isa);
    int64_t iters = 1 << 14;
    double t = 0;
    for (;;) {  // calibrate on one thread: a run of at least 10 ms
        double t0 = cli_now();
        fn(iters);
        t = cli_now() - t0;
        if (t >= 0.01 || iters > ((int64_t)1 << 40)) break;
        iters *= 4;
    }
    iters = (int64_t)((double)iters * 0.1 / (t > 0 ? t : 1e-3)) + 1;
    double best = 0;
    for (int rep = 0; rep < 3; rep++) {
        double flops = 0, t0 = cli_now();
#pragma omp parallel num_threads(nt) reduction(+ : flops)
        flops += fn(iters);
        double gf = flops / (cli_now() - t0) * 1e-9;
        if (gf > best) best = gf;
    }
    return best;
}

// Sum of buf[b, e) (e - b a multiple of 64 floats) with the widest loads
// the CPU has: narrow loads measure a lower bandwidth (16-byte loads:
// ~20 GB/s here against ~31 with 64-byte ones).
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx512f"))) static double sum_avx512(const float *buf, size_t b,
                                                             size_t e) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = b; i < e; i += 64) {
        a0 = _mm512_add_ps(a0, _mm512_loadu_ps(buf + i));
        a1 = _mm512_add_ps(a1, _mm512_loadu_ps(buf + i + 16));
        a2 = _mm512_add_ps(a2, _mm512_loadu_ps(buf + i + 32));
        a3 = _mm512_add_ps(a3, _mm512_loadu_ps(buf + i + 48));
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}
#endif

// Sum of buf[b, e) (e - b a multiple of 64 floats): the widest loads where
// the CPU has them (wide), else 8 independent 4-lane sums (GCC/Clang
// vector extension: never compute-bound, whatever the baseline ISA).
static double sum_range(const float *buf, size_t b, size_t e, bool wide) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (wide) return sum_avx512(buf, b, e);
#else
    (void)wide;
#endif
    typedef float v4 __attribute__((vector_size(16)));
    v4 a0 = {0}, a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (size_t i = b; i + 32 <= e; i += 32) {
        v4 x[8];
        memcpy(x, buf + i, sizeof x);
        a0 += x[0], a1 += x[1], a2 += x[2], a3 += x[3];
        a4 += x[4], a5 += x[5], a6 += x[6], a7 += x[7];
    }
    const v4 sum = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7));
    return (double)sum[0] + sum[1] + sum[2] + sum[3];
}

// A buffer of at least `bytes` (a whole number of 2 MiB) on huge pages where
// the kernel gives them, as the library's large buffers are (mha__alloc):
// the read bandwidth of the same kind of memory. *n: its floats.
static float *bandwidth_buffer(int nt, size_t bytes, size_t *n) {
    const size_t huge = (size_t)2 << 20;
    *n = (bytes + huge - 1) / huge * huge / sizeof(float);
    float *buf = aligned_alloc(huge, *n * sizeof(float));
    if (!buf) return NULL;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    (void)madvise(buf, *n * sizeof(float), MADV_HUGEPAGE);
#endif
    const size_t m = *n;
#pragma omp parallel for schedule(static) num_threads(nt)
    for (size_t i = 0; i < m; i++) buf[i] = (float)(i & 1023) * 1e-3f;
    return buf;
}

static bool wide_loads(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    return __builtin_cpu_supports("avx512f");
#else
    return false;
#endif
}

// One pass of the parallel sum over a bandwidth buffer of n floats: GB/s.
static double bandwidth_pass(const float *buf, size_t n, int nt, bool wide) {
    double t0 = cli_now(), total = 0.0;
#pragma omp parallel for schedule(static) num_threads(nt) reduction(+ : total)
    for (size_t b = 0; b < n; b += 4096)
        total += sum_range(buf, b, b + 4096 < n ? b + 4096 : n, wide && b + 4096 <= n);
    const double t = cli_now() - t0;
    volatile float sink = (float)total;
    (void)sink;
    return (double)(n * sizeof(float)) / t * 1e-9;
}

// Read bandwidth of this machine on nt threads: a parallel sum over a buffer
// of `bytes` (median of 5 passes after one), in GB/s.
double read_bandwidth(int nt, size_t bytes) {
    size_t n;
    float *buf = bandwidth_buffer(nt, bytes, &n);
    if (!buf) return 0.0;
    const bool wide = wide_loads();
    double g[6];
    for (int r = 0; r < 6; r++) g[r] = bandwidth_pass(buf, n, nt, wide);
    free(buf);
    qsort(g + 1, 5, sizeof g[0], cli_cmp_double);
    return g[3];
}

struct bench_bw {
    float *buf;
    size_t n;
    int nt;
    bool wide;
};

bench_bw *bench_bw_create(int nt, size_t bytes) {
    bench_bw *b = malloc(sizeof *b);
    if (!b) return NULL;
    b->nt = nt, b->wide = wide_loads();
    if (!(b->buf = bandwidth_buffer(nt, bytes, &b->n))) {
        free(b);
        return NULL;
    }
    (void)bandwidth_pass(b->buf, b->n, nt, b->wide);  // (the first pass faults pages in)
    return b;
}

double bench_bw_pass(bench_bw *b) {
    return b ? bandwidth_pass(b->buf, b->n, b->nt, b->wide) : 0.0;
}

void bench_bw_free(bench_bw *b) {
    if (b) free(b->buf);
    free(b);
}

// The read bandwidth over pieces of `piece` bytes taken in a random order
// (a paged cache's blocks scattered over its pool): the buffer cut into
// pieces (rounded up to 256 bytes), shuffled (seeded), each thread summing
// its share of them in that order; two plain readers, one that leaves the
// fetching to the hardware, one that also prefetches the piece 4 ahead
// (the better of the two: small pieces gain by it, large ones lose), each
// the median of 5 passes after one; in GB/s.
double read_bandwidth_pieces(int nt, size_t bytes, size_t piece, uint64_t seed) {
    piece = (piece + 255) / 256 * 256;
    size_t n;
    float *buf = bandwidth_buffer(nt, bytes, &n);
    const size_t np = n * sizeof(float) / piece, pf = piece / sizeof(float);
    size_t *ord = np ? malloc(sizeof *ord * np) : NULL;
    if (!buf || !ord) {
        free(buf), free(ord);
        return 0.0;
    }
    for (size_t i = 0; i < np; i++) ord[i] = i;
    for (size_t i = np - 1; i > 0; i--) {  // Fisher-Yates
        const size_t j = (size_t)(bench_next(&seed) % (uint64_t)(i + 1)), t = ord[i];
        ord[i] = ord[j], ord[j] = t;
    }
    const bool wide = wide_loads();
    double best = 0.0;
    volatile float sink = 0.0f;
    for (int ahead = 0; ahead <= 4; ahead += 4) {
        double t[6];
        for (int r = 0; r < 6; r++) {
            double t0 = cli_now(), total = 0.0;
#pragma omp parallel for schedule(static) num_threads(nt) reduction(+ : total)
            for (size_t i = 0; i < np; i++) {
                if (ahead && i + (size_t)ahead < np) {
                    const char *p = (const char *)(buf + ord[i + (size_t)ahead] * pf);
                    for (size_t b = 0; b < piece; b += 64) __builtin_prefetch(p + b, 0, 3);
                }
                total += sum_range(buf, ord[i] * pf, ord[i] * pf + pf, wide);
            }
            t[r] = cli_now() - t0;
            sink += (float)total;
        }
        qsort(t + 1, 5, sizeof t[0], cli_cmp_double);
        const double gbs = (double)(np * piece) / t[3] * 1e-9;
        if (gbs > best) best = gbs;
    }
    (void)sink;
    free(buf), free(ord);
    return best;
}
