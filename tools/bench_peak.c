// bench_peak.c: what `mha bench` holds its timings against, measured in the
// same process on the same threads (bench.h): the machine's fp32 FMA peak
// and its read bandwidth. x86-64 kernels (target attributes: one binary
// runs on any x86-64 and picks them at run time) with portable fallbacks.
//
// Both are probes on a shared, noisy machine, so each repeats its trials
// until its best settles (bench_settled: the best of the last trials within
// BENCH_SETTLE_TOL of the best before them), within a bounded number of
// trials and seconds, and says how many it ran and whether the best
// settled. The best, not the median: a neighbour only ever slows a trial
// down, so the fastest trial is the nearest to what the machine can do.
// Each trial's rate is the sum of its threads' rates, each thread's work
// over its own CPU time (CLOCK_THREAD_CPUTIME_ID, where there is one), of
// at most as many threads as there are CPUs online: what the threads do
// while they run, whatever else the machine runs: a neighbour that takes
// a thread's CPU for part of a trial no longer makes the peak look low (and
// a benchmark that had the CPUs to itself look faster than the peak). The
// best trial on the wall clock is kept too (best_wall: how busy the CPUs
// were). Timings held against these (wall clock) are at most the peak's
// rate unless the CPUs were shared: a fraction then reads low, not high.
// What it deliberately does not do: decide what a rate above the probe's
// best means (bench_report.c prints such a fraction capped and flagged).
#if defined(__linux__) && !defined(_DEFAULT_SOURCE)
#define _DEFAULT_SOURCE  // madvise, MAP_ANONYMOUS
#endif
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define BENCH_X86 1
#endif

#if defined(__linux__)
#include <sys/mman.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#include "bench.h"
#include "cli.h"
#include "mha.h"

// ---------------------------------------------------------------------------
// When a probe's best has settled: at least `min` trials, and the best of
// the last k within tol (relative) of the best of the trials before them
// (neither still climbing nor an outlier the later trials do not reach).

#define BENCH_SETTLE_TOL 0.015

static double max_of(const double *v, int n) {
    double m = 0.0;
    for (int i = 0; i < n; i++) m = v[i] > m ? v[i] : m;
    return m;
}

static bool bench_settled(const double *v, int n, int k, int min) {
    if (n < min || n <= k) return false;
    const double before = max_of(v, n - k), recent = max_of(v + n - k, k);
    const double hi = before > recent ? before : recent;
    return hi > 0 &&
           (before > recent ? before - recent : recent - before) <= BENCH_SETTLE_TOL * hi;
}

// ---------------------------------------------------------------------------
// A trial's threads: each thread's rate on its own CPU time.

// This thread's CPU seconds (the wall clock where there is no such clock).
static double thread_cpu_now(void) {
#if defined(CLOCK_THREAD_CPUTIME_ID)
    struct timespec ts;
    if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) == 0)
        return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
#endif
    return cli_now();
}

static int cmp_desc(const void *a, const void *b) { return cli_cmp_double(b, a); }

// The sum of the fastest min(nt, CPUs online) of the nt threads' rates
// (sorts r): more threads than CPUs take turns on them, and each alone
// would look as fast as a CPU.
static double rate_sum(double *r, int nt) {
    long ncpu = 0;
#if defined(_SC_NPROCESSORS_ONLN)
    ncpu = sysconf(_SC_NPROCESSORS_ONLN);
#endif
    const int k = ncpu > 0 && ncpu < nt ? (int)ncpu : nt;
    qsort(r, (size_t)nt, sizeof *r, cmp_desc);
    double s = 0.0;
    for (int i = 0; i < k; i++) s += r[i];
    return s;
}

// ---------------------------------------------------------------------------
// The machine's fp32 FMA peak: 12 independent chains acc = acc * m + c per
// thread (enough to cover an FMA latency of 4 cycles on two pipes), with
// constants that keep acc near 1 (no denormals, no overflow).

#define FMA_CHAINS 12

static volatile float g_sink;

#ifdef BENCH_X86
#define FMA12(FMADD)        \
    a0 = FMADD(a0, m, c);   \
    a1 = FMADD(a1, m, c);   \
    a2 = FMADD(a2, m, c);   \
    a3 = FMADD(a3, m, c);   \
    a4 = FMADD(a4, m, c);   \
    a5 = FMADD(a5, m, c);   \
    a6 = FMADD(a6, m, c);   \
    a7 = FMADD(a7, m, c);   \
    a8 = FMADD(a8, m, c);   \
    a9 = FMADD(a9, m, c);   \
    a10 = FMADD(a10, m, c); \
    a11 = FMADD(a11, m, c)

__attribute__((target("avx512f"))) static double fma_avx512(int64_t iters) {
    __m512 a0 = _mm512_set1_ps(0.1f), a1 = _mm512_set1_ps(0.2f), a2 = _mm512_set1_ps(0.3f),
           a3 = _mm512_set1_ps(0.4f), a4 = _mm512_set1_ps(0.5f), a5 = _mm512_set1_ps(0.6f),
           a6 = _mm512_set1_ps(0.7f), a7 = _mm512_set1_ps(0.8f), a8 = _mm512_set1_ps(0.9f),
           a9 = _mm512_set1_ps(1.1f), a10 = _mm512_set1_ps(1.2f), a11 = _mm512_set1_ps(1.3f);
    const __m512 m = _mm512_set1_ps(0.9999f), c = _mm512_set1_ps(1e-4f);
    for (int64_t i = 0; i < iters; i++) { FMA12(_mm512_fmadd_ps); }
    __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                             _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)));
    s = _mm512_add_ps(s, _mm512_add_ps(_mm512_add_ps(a8, a9), _mm512_add_ps(a10, a11)));
    g_sink = _mm512_reduce_add_ps(s);
    return (double)iters * FMA_CHAINS * 16 * 2;
}

__attribute__((target("avx2,fma"))) static double fma_avx2(int64_t iters) {
    __m256 a0 = _mm256_set1_ps(0.1f), a1 = _mm256_set1_ps(0.2f), a2 = _mm256_set1_ps(0.3f),
           a3 = _mm256_set1_ps(0.4f), a4 = _mm256_set1_ps(0.5f), a5 = _mm256_set1_ps(0.6f),
           a6 = _mm256_set1_ps(0.7f), a7 = _mm256_set1_ps(0.8f), a8 = _mm256_set1_ps(0.9f),
           a9 = _mm256_set1_ps(1.1f), a10 = _mm256_set1_ps(1.2f), a11 = _mm256_set1_ps(1.3f);
    const __m256 m = _mm256_set1_ps(0.9999f), c = _mm256_set1_ps(1e-4f);
    for (int64_t i = 0; i < iters; i++) { FMA12(_mm256_fmadd_ps); }
    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                             _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
    s = _mm256_add_ps(s, _mm256_add_ps(_mm256_add_ps(a8, a9), _mm256_add_ps(a10, a11)));
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
    if (__builtin_cpu_supports("avx512f")) {
        *name = "avx512";
        return fma_avx512;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        *name = "avx2";
        return fma_avx2;
    }
#endif
    *name = "scalar";
    return fma_scalar;
}

// The peak's trials: short (PEAK_TRIAL_S of a thread's time each: many
// chances to catch a moment when the CPUs' other halves, the host's, are
// quiet), at least PEAK_MIN_TRIALS, settled over the last PEAK_SETTLE_K,
// at most PEAK_MAX_TRIALS or PEAK_MAX_S seconds of trials.
#define PEAK_TRIAL_S 0.004
#define PEAK_MIN_TRIALS 20
#define PEAK_SETTLE_K 10
#define PEAK_MAX_TRIALS 400
#define PEAK_MAX_S 1.0

// ---------------------------------------------------------------------------
// The bf16 dot peak: what a bf16 product unit does with operands in
// registers. AMX (where mha's kernels use it, so Linux granted the tile
// state): four independent tdpbf16ps (16 x 16 x 32 each) per step on
// tiles loaded once; AVX512-BF16: 12 independent vdpbf16ps chains.

#ifdef BENCH_X86
static float g_tiles[8][256] __attribute__((aligned(64)));  // zeros: the operands

__attribute__((target("amx-tile,amx-bf16"))) static double dp_amx(int64_t iters) {
    struct {
        uint8_t palette, start;
        uint8_t reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
    _tile_loadd(4, g_tiles[4], 64);
    _tile_loadd(5, g_tiles[5], 64);
    _tile_loadd(6, g_tiles[6], 64);
    _tile_loadd(7, g_tiles[7], 64);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t i = 0; i < iters; i++) {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    float out[256];
    _tile_stored(0, out, 64);
    _tile_release();
    g_sink = out[0];
    return (double)iters * 4 * 16 * 16 * 32 * 2;
}

#if defined(__GNUC__) && (__GNUC__ >= 11 || defined(__clang__))
__attribute__((target("avx512f,avx512bf16"))) static double dp_avx512bf16(int64_t iters) {
    __m512 acc[FMA_CHAINS];
    for (int j = 0; j < FMA_CHAINS; j++) acc[j] = _mm512_set1_ps(0.01f * (float)j);
    const __m512bh a = (__m512bh)_mm512_set1_epi32(0x3a803a80);  // bf16 pairs of 2^-10
    for (int64_t i = 0; i < iters; i++)
        for (int j = 0; j < FMA_CHAINS; j++) acc[j] = _mm512_dpbf16_ps(acc[j], a, a);
    __m512 s = acc[0];
    for (int j = 1; j < FMA_CHAINS; j++) s = _mm512_add_ps(s, acc[j]);
    g_sink = _mm512_reduce_add_ps(s);
    return (double)iters * FMA_CHAINS * 16 * 2 * 2;
}
#define BENCH_DPBF16 1
#endif
#endif

// AVX512-BF16 on this CPU (CPUID leaf 7 subleaf 1, EAX bit 5).
static bool has_avx512bf16(void) {
#if defined(BENCH_X86) && defined(BENCH_DPBF16)
    unsigned a, b, c, d;
    __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(1));
    return (a >> 5 & 1) && __builtin_cpu_supports("avx512f");
#else
    return false;
#endif
}

static fma_fn dp_pick(const char **name) {
#ifdef BENCH_X86
    if (strcmp(mha_isa(), "amx") == 0) {
        *name = "amx tdpbf16ps";
        return dp_amx;
    }
#ifdef BENCH_DPBF16
    if (has_avx512bf16()) {
        *name = "avx512 vdpbf16ps";
        return dp_avx512bf16;
    }
#endif
#endif
    return NULL;
}

static bench_probe probe_rate(int nt, fma_fn fn, const char *kernel);

bench_probe peak_probe(int nt) {
    const char *name;
    fma_fn fn = fma_pick(&name);
    return probe_rate(nt, fn, name);
}

bench_probe peak_probe_bf16(int nt) {
    const char *name = NULL;
    fma_fn fn = dp_pick(&name);
    if (!fn) return (bench_probe){0};
    return probe_rate(nt, fn, name);
}

// The trials of a peak kernel fn (its FLOP per call returned) on nt threads.
static bench_probe probe_rate(int nt, fma_fn fn, const char *kernel) {
    bench_probe p = {0};
    p.kernel = kernel;
    int64_t iters = 1 << 10;
    double t = 0;
    for (;;) {  // calibrate on one thread: a run of at least 1 ms
        double t0 = thread_cpu_now();
        fn(iters);
        t = thread_cpu_now() - t0;
        if (t >= 0.001 || iters > ((int64_t)1 << 40)) break;
        iters *= 2;
    }
    iters = (int64_t)((double)iters * PEAK_TRIAL_S / (t > 0 ? t : 1e-3)) + 1;
    double g[PEAK_MAX_TRIALS], *r = malloc(sizeof(double) * (size_t)(nt > 0 ? nt : 1));
    if (!r) return p;
    const double start = cli_now();
    while (p.trials < PEAK_MAX_TRIALS) {
        // (zeros for threads an OpenMP runtime did not give)
        for (int i = 0; i < nt; i++) r[i] = 0.0;
        double wall = cli_now(), flops = 0;
#pragma omp parallel num_threads(nt) reduction(+ : flops)
        {
            int id = 0;
#ifdef _OPENMP
            id = omp_get_thread_num();
#endif
            if (id >= nt) id = 0;
            const double c0 = thread_cpu_now(), f = fn(iters), c1 = thread_cpu_now();
            r[id] = f / (c1 - c0 > 0 ? c1 - c0 : 1e-9) * 1e-9;
            flops += f;
        }
        const double now = cli_now(), w = flops / (now - wall) * 1e-9;
        p.best_wall = w > p.best_wall ? w : p.best_wall;
        g[p.trials++] = rate_sum(r, nt);
        if ((p.settled = bench_settled(g, p.trials, PEAK_SETTLE_K, PEAK_MIN_TRIALS))) break;
        if (now - start > PEAK_MAX_S && p.trials >= PEAK_MIN_TRIALS) break;
    }
    free(r);
    p.best = max_of(g, p.trials);
    return p;
}

// ---------------------------------------------------------------------------
// The read bandwidth: read kernels, each the sum of buf[b, e) (b and e
// multiples of 64 floats, buf 64-byte aligned), all run on every thread
// over a buffer on huge pages; the best of them is the bandwidth.
//  - plain: the widest loads the CPU has, the fetching left to the
//    hardware (narrow loads measure a lower bandwidth: 16-byte loads ~20
//    GB/s on the Xeon against ~31 with 64-byte ones);
//  - prefetch: the same with a software prefetch READ_PF_BYTES ahead into
//    L2 (prefetcht1, as the decode kernels do: a prefetch into L1 holds a
//    line fill buffer until its line comes);
//  - stream: non-temporal loads (vmovntdqa; AVX-512 or AVX2), which some
//    memory systems serve faster.
// The portable fallbacks (any other CPU or compiler): 8 independent 4-lane
// sums (GCC/Clang vector extension: never compute-bound, whatever the
// baseline ISA), plain and with __builtin_prefetch.

#define READ_PF_BYTES 2048

typedef double (*read_fn)(const float *buf, size_t b, size_t e);

typedef float v4f __attribute__((vector_size(16)));

static double sum_v4(const float *buf, size_t b, size_t e, bool pf) {
    v4f a0 = {0}, a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (size_t i = b; i + 32 <= e; i += 32) {
        if (pf) {
            __builtin_prefetch((const char *)(buf + i) + READ_PF_BYTES, 0, 2);
            __builtin_prefetch((const char *)(buf + i) + READ_PF_BYTES + 64, 0, 2);
        }
        v4f x[8];
        memcpy(x, buf + i, sizeof x);
        a0 += x[0], a1 += x[1], a2 += x[2], a3 += x[3];
        a4 += x[4], a5 += x[5], a6 += x[6], a7 += x[7];
    }
    const v4f sum = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7));
    return (double)sum[0] + sum[1] + sum[2] + sum[3];
}
static double rd_plain_v4(const float *buf, size_t b, size_t e) {
    return sum_v4(buf, b, e, false);
}
static double rd_prefetch_v4(const float *buf, size_t b, size_t e) {
    return sum_v4(buf, b, e, true);
}

#ifdef BENCH_X86
// (always inlined into each target's kernel: the loads are the variant)
#define SUM512(LOAD, PF)                                                            \
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                     \
    for (size_t i = b; i < e; i += 64) {                                            \
        if (PF) {                                                                   \
            const char *p = (const char *)(buf + i) + READ_PF_BYTES;                \
            _mm_prefetch(p, _MM_HINT_T1), _mm_prefetch(p + 64, _MM_HINT_T1);        \
            _mm_prefetch(p + 128, _MM_HINT_T1), _mm_prefetch(p + 192, _MM_HINT_T1); \
        }                                                                           \
        a0 = _mm512_add_ps(a0, LOAD(buf + i));                                      \
        a1 = _mm512_add_ps(a1, LOAD(buf + i + 16));                                 \
        a2 = _mm512_add_ps(a2, LOAD(buf + i + 32));                                 \
        a3 = _mm512_add_ps(a3, LOAD(buf + i + 48));                                 \
    }                                                                               \
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)))

#define LOAD512(p) _mm512_load_ps(p)
#define NTLOAD512(p) _mm512_castsi512_ps(_mm512_stream_load_si512((void *)(p)))
__attribute__((target("avx512f"))) static double rd_plain_avx512(const float *buf, size_t b,
                                                                 size_t e) {
    SUM512(LOAD512, 0);
}
__attribute__((target("avx512f"))) static double rd_prefetch_avx512(const float *buf, size_t b,
                                                                    size_t e) {
    SUM512(LOAD512, 1);
}
__attribute__((target("avx512f"))) static double rd_stream_avx512(const float *buf, size_t b,
                                                                  size_t e) {
    SUM512(NTLOAD512, 0);
}

#define SUM256(LOAD, PF)                                                                   \
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, \
           a7 = a0;                                                                        \
    for (size_t i = b; i < e; i += 64) {                                                   \
        if (PF) {                                                                          \
            const char *p = (const char *)(buf + i) + READ_PF_BYTES;                       \
            _mm_prefetch(p, _MM_HINT_T1), _mm_prefetch(p + 64, _MM_HINT_T1);               \
            _mm_prefetch(p + 128, _MM_HINT_T1), _mm_prefetch(p + 192, _MM_HINT_T1);        \
        }                                                                                  \
        a0 = _mm256_add_ps(a0, LOAD(buf + i)), a1 = _mm256_add_ps(a1, LOAD(buf + i + 8));  \
        a2 = _mm256_add_ps(a2, LOAD(buf + i + 16));                                        \
        a3 = _mm256_add_ps(a3, LOAD(buf + i + 24));                                        \
        a4 = _mm256_add_ps(a4, LOAD(buf + i + 32));                                        \
        a5 = _mm256_add_ps(a5, LOAD(buf + i + 40));                                        \
        a6 = _mm256_add_ps(a6, LOAD(buf + i + 48));                                        \
        a7 = _mm256_add_ps(a7, LOAD(buf + i + 56));                                        \
    }                                                                                      \
    const __m256 s =                                                                       \
        _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),         \
                      _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));        \
    float t[8];                                                                            \
    _mm256_storeu_ps(t, s);                                                                \
    return (double)t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7]

#define LOAD256(p) _mm256_load_ps(p)
#define NTLOAD256(p) _mm256_castsi256_ps(_mm256_stream_load_si256((const void *)(p)))
__attribute__((target("avx2"))) static double rd_plain_avx2(const float *buf, size_t b,
                                                            size_t e) {
    SUM256(LOAD256, 0);
}
__attribute__((target("avx2"))) static double rd_prefetch_avx2(const float *buf, size_t b,
                                                               size_t e) {
    SUM256(LOAD256, 1);
}
__attribute__((target("avx2"))) static double rd_stream_avx2(const float *buf, size_t b,
                                                             size_t e) {
    SUM256(NTLOAD256, 0);
}
#endif

typedef struct read_kernel {
    const char *name;
    read_fn fn;
} read_kernel;

// The read kernels of this CPU's widest ISA (chosen at run time). Returns
// how many (at most 3); the first is the plain one.
static int read_kernels(read_kernel *k) {
#ifdef BENCH_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) {
        k[0] = (read_kernel){"avx512 plain", rd_plain_avx512};
        k[1] = (read_kernel){"avx512 prefetch", rd_prefetch_avx512};
        k[2] = (read_kernel){"avx512 stream", rd_stream_avx512};
        return 3;
    }
    if (__builtin_cpu_supports("avx2")) {
        k[0] = (read_kernel){"avx2 plain", rd_plain_avx2};
        k[1] = (read_kernel){"avx2 prefetch", rd_prefetch_avx2};
        k[2] = (read_kernel){"avx2 stream", rd_stream_avx2};
        return 3;
    }
#endif
    k[0] = (read_kernel){"portable plain", rd_plain_v4};
    k[1] = (read_kernel){"portable prefetch", rd_prefetch_v4};
    return 2;
}

// A buffer of at least `bytes` (a whole number of 2 MiB, 2 MiB aligned) on
// huge pages where the kernel gives them, as the library's large buffers
// are (mha__alloc): an anonymous mmap trimmed to a 2 MiB boundary and
// madvise(MADV_HUGEPAGE); else aligned_alloc (and the same madvise); else
// nothing. Written by the threads that read it (first touch).
typedef struct read_buf {
    float *p;
    size_t n;         // floats
    bool mapped;      // p came from mmap (else aligned_alloc)
    bool huge;        // madvise(MADV_HUGEPAGE) was accepted
    double huge_mib;  // of which backed by huge pages (AnonHugePages); -1: unknown
} read_buf;

// The process's AnonHugePages in MiB (/proc/self/smaps_rollup), -1 where
// it cannot be read.
static double anon_huge_mib(void) {
    double kib = -1.0;
#if defined(__linux__)
    FILE *f = fopen("/proc/self/smaps_rollup", "r");
    if (!f) return -1.0;
    char line[256];
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "AnonHugePages: %lf kB", &kib) == 1) break;
    fclose(f);
#endif
    return kib < 0 ? -1.0 : kib / 1024.0;
}

static bool read_buf_alloc(read_buf *rb, int nt, size_t bytes) {
    const size_t huge = (size_t)2 << 20;
    (void)nt;  // (without OpenMP)
    memset(rb, 0, sizeof *rb);
    if (bytes > SIZE_MAX - 2 * huge) return false;
    const size_t len = bytes ? (bytes + huge - 1) / huge * huge : huge;
    const double huge0 = anon_huge_mib();
#if defined(__linux__) && defined(MAP_ANONYMOUS)
    char *m = mmap(NULL, len + huge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m != MAP_FAILED) {
        char *a = (char *)(((uintptr_t)m + huge - 1) & ~(uintptr_t)(huge - 1));
        if (a > m) (void)munmap(m, (size_t)(a - m));
        if (m + len + huge > a + len)
            (void)munmap(a + len, (size_t)(m + len + huge - (a + len)));
        rb->p = (float *)a, rb->mapped = true;
    }
#endif
    if (!rb->p) rb->p = aligned_alloc(huge, len);
    if (!rb->p) return false;
    rb->n = len / sizeof(float);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    rb->huge = madvise(rb->p, len, MADV_HUGEPAGE) == 0;
#endif
    float *p = rb->p;
    const size_t n = rb->n;
#pragma omp parallel for schedule(static) num_threads(nt)
    for (size_t i = 0; i < n; i++) p[i] = (float)(i & 1023) * 1e-3f;
    const double huge1 = anon_huge_mib();
    rb->huge_mib = huge0 >= 0 && huge1 >= 0 ? huge1 - huge0 : -1.0;
    return true;
}

static void read_buf_free(read_buf *rb) {
#if defined(__linux__) && defined(MAP_ANONYMOUS)
    if (rb->mapped) (void)munmap(rb->p, rb->n * sizeof(float));
#endif
    if (!rb->mapped) free(rb->p);
    memset(rb, 0, sizeof *rb);
}

// One pass of kernel fn over the buffer on nt threads (each its own
// contiguous part, in the static schedule's order): GB/s, the sum of the
// threads' rates on their CPU time (rate_sum; *wall: on the wall clock).
static double read_pass(const read_buf *rb, read_fn fn, int nt, double *r, double *wall) {
    const float *buf = rb->p;
    const size_t nb = rb->n / 64;  // blocks of 64 floats
    for (int i = 0; i < nt; i++) r[i] = 0.0;
    double t0 = cli_now(), total = 0.0;
#pragma omp parallel num_threads(nt) reduction(+ : total)
    {
        size_t id = 0, nth = 1;
#ifdef _OPENMP
        id = (size_t)omp_get_thread_num(), nth = (size_t)omp_get_num_threads();
#endif
        const size_t b = nb * id / nth * 64, e = nb * (id + 1) / nth * 64;
        const double c0 = thread_cpu_now();
        total += fn(buf, b, e);
        const double c1 = thread_cpu_now();
        if (id < (size_t)nt)
            r[id] = (double)((e - b) * sizeof(float)) / (c1 - c0 > 0 ? c1 - c0 : 1e-9) * 1e-9;
    }
    const double t = cli_now() - t0;
    volatile float sink = (float)total;
    (void)sink;
    if (wall) *wall = (double)(nb * 64 * sizeof(float)) / t * 1e-9;
    return rate_sum(r, nt);
}

// The bandwidth's rounds (one pass of every kernel each, the kernels taking
// turns so that the neighbours' load falls on all of them): at least
// READ_MIN_ROUNDS, settled over the last READ_SETTLE_ROUNDS rounds' passes,
// at most READ_MAX_ROUNDS or READ_MAX_S seconds.
#define READ_MIN_ROUNDS 3
#define READ_SETTLE_ROUNDS 2
#define READ_MAX_ROUNDS 8
#define READ_MAX_S 3.0

// Runs the rounds over rb (r: nt doubles); *best_kernel: the index of the
// kernel of the fastest pass.
static bench_probe read_probe(const read_buf *rb, const read_kernel *k, int nk, int nt,
                              double *r, int *best_kernel) {
    bench_probe p = {0};
    double g[READ_MAX_ROUNDS * 3], wall;
    int who[READ_MAX_ROUNDS * 3];
    const double start = cli_now();
    for (int round = 0; round < READ_MAX_ROUNDS; round++) {
        for (int i = 0; i < nk; i++) {
            who[p.trials] = i, g[p.trials++] = read_pass(rb, k[i].fn, nt, r, &wall);
            p.best_wall = wall > p.best_wall ? wall : p.best_wall;
        }
        if ((p.settled = bench_settled(g, p.trials, READ_SETTLE_ROUNDS * nk,
                                       READ_MIN_ROUNDS * nk)))
            break;
        if (cli_now() - start > READ_MAX_S && round + 1 >= READ_MIN_ROUNDS) break;
    }
    int b = 0;
    for (int i = 1; i < p.trials; i++) b = g[i] > g[b] ? i : b;
    p.best = g[b];
    *best_kernel = who[b];
    p.kernel = k[who[b]].name;
    p.hugepages = rb->huge;
    p.huge_mib = rb->huge_mib;
    p.buffer_mib = (double)(rb->n * sizeof(float)) / 1048576.0;
    return p;
}

bench_probe bandwidth_probe(int nt, size_t bytes) {
    bench_probe p = {0};
    read_buf rb;
    double *r = malloc(sizeof(double) * (size_t)(nt > 0 ? nt : 1));
    if (r && read_buf_alloc(&rb, nt, bytes)) {
        read_kernel k[3];
        const int nk = read_kernels(k);
        int bk;
        p = read_probe(&rb, k, nk, nt, r, &bk);
        read_buf_free(&rb);
    }
    free(r);
    return p;
}

double read_bandwidth(int nt, size_t bytes) { return bandwidth_probe(nt, bytes).best; }

struct bench_bw {
    read_buf rb;
    read_fn fn;  // the probe's best kernel
    bench_probe probe;
    int nt;
    double *r;  // nt threads' rates
};

bench_bw *bench_bw_create(int nt, size_t bytes) {
    bench_bw *b = calloc(1, sizeof *b);
    if (!b) return NULL;
    b->nt = nt;
    b->r = malloc(sizeof(double) * (size_t)(nt > 0 ? nt : 1));
    if (!b->r || !read_buf_alloc(&b->rb, nt, bytes)) {
        free(b->r), free(b);
        return NULL;
    }
    read_kernel k[3];
    const int nk = read_kernels(k);
    int bk;
    b->probe = read_probe(&b->rb, k, nk, nt, b->r, &bk);
    b->fn = k[bk].fn;
    return b;
}

double bench_bw_pass(bench_bw *b, double *wall) {
    if (wall) *wall = 0.0;
    return b ? read_pass(&b->rb, b->fn, b->nt, b->r, wall) : 0.0;
}

bench_probe bench_bw_probe(const bench_bw *b) {
    const bench_probe none = {0};
    return b ? b->probe : none;
}

void bench_bw_free(bench_bw *b) {
    if (b) read_buf_free(&b->rb), free(b->r);
    free(b);
}

// The read bandwidth over pieces of `piece` bytes taken in a random order
// (a paged cache's blocks scattered over its pool): the buffer cut into
// pieces (rounded up to 256 bytes), shuffled (seeded), each thread summing
// its share of them in that order with the plain kernel; two readers, one
// that leaves the fetching to the hardware, one that also prefetches the
// piece 4 ahead (small pieces gain by it, large ones lose), each the best
// of 5 passes after one, a pass's rate the sum of its threads' on their CPU
// time (rate_sum); the better of the two, in GB/s.
double read_bandwidth_pieces(int nt, size_t bytes, size_t piece, uint64_t seed) {
    piece = (piece + 255) / 256 * 256;
    read_buf rb;
    double *r = malloc(sizeof(double) * (size_t)(nt > 0 ? nt : 1));
    if (!r || !read_buf_alloc(&rb, nt, bytes)) {
        free(r);
        return 0.0;
    }
    const float *buf = rb.p;
    const size_t np = rb.n * sizeof(float) / piece, pf = piece / sizeof(float);
    size_t *ord = np ? malloc(sizeof *ord * np) : NULL;
    if (!ord) {
        read_buf_free(&rb);
        free(r);
        return 0.0;
    }
    for (size_t i = 0; i < np; i++) ord[i] = i;
    for (size_t i = np - 1; i > 0; i--) {  // Fisher-Yates
        const size_t j = (size_t)(bench_next(&seed) % (uint64_t)(i + 1)), t = ord[i];
        ord[i] = ord[j], ord[j] = t;
    }
    read_kernel k[3];
    (void)read_kernels(k);
    const read_fn fn = k[0].fn;
    double best = 0.0;
    volatile float sink = 0.0f;
    for (int ahead = 0; ahead <= 4; ahead += 4) {
        for (int rep = 0; rep < 6; rep++) {
            double total = 0.0;
            for (int i = 0; i < nt; i++) r[i] = 0.0;
#pragma omp parallel num_threads(nt) reduction(+ : total)
            {
                int id = 0;
#ifdef _OPENMP
                id = omp_get_thread_num();
#endif
                size_t mine = 0;
                const double c0 = thread_cpu_now();
#pragma omp for schedule(static) nowait
                for (size_t i = 0; i < np; i++) {
                    if (ahead && i + (size_t)ahead < np) {
                        const char *p = (const char *)(buf + ord[i + (size_t)ahead] * pf);
                        for (size_t b = 0; b < piece; b += 64) __builtin_prefetch(p + b, 0, 3);
                    }
                    total += fn(buf, ord[i] * pf, ord[i] * pf + pf);
                    mine++;
                }
                const double c1 = thread_cpu_now();
                if (id < nt)
                    r[id] = (double)(mine * piece) / (c1 - c0 > 0 ? c1 - c0 : 1e-9) * 1e-9;
            }
            const double gbs = rate_sum(r, nt);
            sink += (float)total;
            if (rep > 0 && gbs > best) best = gbs;
        }
    }
    (void)sink;
    read_buf_free(&rb);
    free(ord);
    free(r);
    return best;
}
