// bench.h: the parts of `mha bench` (bench.c) in files of their own.
#ifndef MHA_BENCH_H
#define MHA_BENCH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "mha.h"

// bench_peak.c: this machine's fp32 FMA peak in GFLOP/s on nt threads
// (*isa: the kernel's ISA, "avx512", "avx2" or "scalar"), and its read
// bandwidth in GB/s on nt threads over a buffer of `bytes`.
double peak_gflops(int nt, const char **isa);
double read_bandwidth(int nt, size_t bytes);
// A bandwidth buffer of `bytes` to measure the read bandwidth between the
// steps of a benchmark (the machine's memory is shared: its bandwidth moves
// with its neighbours'): one pass of the sum each bench_bw_pass, in GB/s
// (0 where the buffer could not be had).
typedef struct bench_bw bench_bw;
bench_bw *bench_bw_create(int nt, size_t bytes);
double bench_bw_pass(bench_bw *b);
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
