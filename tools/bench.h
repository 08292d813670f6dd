// bench.h: the parts of `mha bench` (bench.c) in files of their own.
#ifndef MHA_BENCH_H
#define MHA_BENCH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "mha.h"

// bench_peak.c: what the timings are held against, measured in the same
// process on nt threads. A probe's result: the best of its trials (GFLOP/s
// or GB/s), the kernel that gave it, how many trials ran and whether the
// best settled (the best of the last trials within 1.5% of the best before
// them; trials stop there, or at a bound on their number and time).
typedef struct bench_probe {
    double best;         // the best trial: its threads' rates on their CPU time
    double best_wall;    // the best trial on the wall clock (all threads together)
    const char *kernel;  // peak: "avx512", "avx2" or "scalar"; bandwidth:
                         // e.g. "avx512 stream" (plain, prefetch or stream)
    int trials;
    bool settled;
    bool hugepages;     // bandwidth: madvise(MADV_HUGEPAGE) was accepted
    double huge_mib;    // bandwidth: of the buffer, MiB on huge pages (-1: unknown)
    double buffer_mib;  // bandwidth: the buffer's size
} bench_probe;
// The fp32 FMA peak: short trials of independent FMA chains on every
// thread until the best settles.
bench_probe peak_probe(int nt);
// The bf16 dot peak likewise (kernel "amx tdpbf16ps" where mha's kernels
// use AMX, else "avx512 vdpbf16ps"); best 0 and no kernel where the CPU
// has neither.
bench_probe peak_probe_bf16(int nt);
// The read bandwidth over a buffer of `bytes` (on huge pages where the
// kernel gives them): the best of the read kernels (plain, software
// prefetch, non-temporal loads; the widest ISA the CPU has), taking turns
// until the best settles. best 0: no buffer.
bench_probe bandwidth_probe(int nt, size_t bytes);
double read_bandwidth(int nt, size_t bytes);  // bandwidth_probe's best
// A bandwidth buffer of `bytes` to measure the read bandwidth between the
// steps of a benchmark (the machine's memory is shared: its bandwidth moves
// with its neighbours'): created with bandwidth_probe's rounds over it
// (bench_bw_probe), then one pass of the probe's best kernel each
// bench_bw_pass, in GB/s on the threads' CPU time (*wall, if not NULL: on
// the wall clock; 0 where the buffer could not be had).
typedef struct bench_bw bench_bw;
bench_bw *bench_bw_create(int nt, size_t bytes);
bench_probe bench_bw_probe(const bench_bw *b);
double bench_bw_pass(bench_bw *b, double *wall);
void bench_bw_free(bench_bw *b);
// The read bandwidth over pieces of `piece` bytes of a buffer of `bytes`,
// taken in a random order (seeded): a scattered pool's ceiling.
double read_bandwidth_pieces(int nt, size_t bytes, size_t piece, uint64_t seed);

// bench_rand.c: the seeded generator (splitmix64) and uniform floats in
// [-1, 1).
uint64_t bench_next(uint64_t *s);
void bench_fill_uniform(float *x, int64_t n, uint64_t *s);

// mha bench --serve (bench_serve.c): nseq sequences sharing a prompt of
// `prompt` tokens, each decoding up to gen tokens, through a paged cache of
// `block`-token blocks.
typedef struct bench_serve_opts {
    int64_t nseq, prompt, gen, E, H, Hkv, block;
    mha_kv_dtype kv_dtype;
    mha_paged_layout layout;
    uint64_t seed;
    bool json;
    int threads;
} bench_serve_opts;
int bench_serve(const bench_serve_opts *o);

// mha bench --parallel (bench_mpi.c).
// kv_len > 0 (--parallel kv --decode): a decode step over a sharded KV cache.
int bench_parallel(const char *scheme, int64_t B, int64_t L, int64_t E, int64_t H, int64_t Hkv,
                   bool causal, bool backward, int64_t repeat, int64_t warmup, uint64_t seed,
                   bool json, int64_t kv_len);

#endif
