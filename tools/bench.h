// bench.h: the parts of `mha bench` in files of one job each: bench.c
// the options and the dispatch; bench_module.c the module (or core)
// benchmark; bench_decode.c the decode benchmarks; bench_report.c their
// reports; bench_peak.c the machine's probes (peak FLOPs, read
// bandwidth); bench_serve.c the serving workload; bench_mpi.c --parallel;
// bench_rand.c the seeded random inputs.
#ifndef MHA_BENCH_H
#define MHA_BENCH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "mha.h"

// mha bench's options (bench.c reads and checks them).
typedef struct bench_opts {
    int64_t B, L, S, E, H;
    bool causal, backward, core, json, workspace, no_save, decode;
    bool module;                    // --decode --module: mha_forward_cached
    bool serve;                     // --serve
    int64_t sequences, gen, block;  // --serve
    bool contiguous_pool;           // --pool-order sequential (--decode --block-size)
    mha_paged_layout layout;        // --pool-layout
    int64_t kv_len, kv_heads;       // --decode
    mha_kv_dtype kv_dtype;          // --kv-dtype
    mha_dtype wdtype, dtype;        // --weight-dtype, --dtype (module forward)
    bool wdtype_set;                // --weight-dtype given
    int64_t prune;                  // --prune-heads: the last K heads pruned
    const char *parallel;           // --parallel SCHEME (under mpirun)
    mha_head_gate gate;             // --head-gate
    int64_t window;                 // 0: none
    int threads;                    // 0: the default
    mha_impl impl;
    const char *isa;
    int64_t repeat, warmup;
    uint64_t seed;
} bench_opts;

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

// bench_module.c: the module forward (+ backward) or, with --core, the
// attention core (mha_sdpa, + mha_sdpa_backward): which implementation
// runs (a tiny probe first), the timed runs, the report. `threads`: the
// OpenMP threads; `isa`: mha_isa(). Returns the exit status.
int bench_module(const bench_opts *o, int threads, const char *isa);

// bench_decode.c: --decode, one step of cached attention over a
// contiguous or (--block-size) paged cache, against the read bandwidth
// measured after every step; --decode --module, the module's decode step
// (mha_forward_cached). Return the exit status.
int bench_decode(const bench_opts *o, int threads);
int bench_decode_module(const bench_opts *o, int threads);

// bench_report.c: what the benchmarks measured, printed as a text block
// or one JSON line (--json).
// The module (or core) benchmark's result.
typedef struct bench_result {
    double median, min, max;  // ms
    double flops, gflops, rss_before, rss_max, inputs_mib;
    double visible;    // fraction of the (i, j) score pairs causal/window leave
    bench_probe peak;  // the fp32 FMA peak, or the bf16 dot peak (bench_peak.c)
    bool peak_bf16;    // peak is the bf16 dot peak (--dtype bf16 on a CPU with one)
    int peak_probes;   // 2: probed again after the runs (the rate was above it)
    const char *isa;
    char fwd_ran[64], bwd_ran[64];  // mha_last_impl() of the runs' calls
    int threads;
} bench_result;
void bench_print_module(const bench_opts *o, const bench_result *r);
// A decode benchmark's result (--decode; with --module, the fields so
// marked).
typedef struct bench_decode_result {
    int threads;
    double median, min, max;  // ms, over o->repeat steps
    double bytes, gbs;        // a step's reads (K and V; module: + weights), per second
    double wbytes, kvbytes;   // --module: the weights', K's and V's bytes
    bench_probe bp;           // the best read kernel (bench_bw_probe / bandwidth_probe)
    // the step against the read bandwidth: --decode, the median of each
    // step's fraction of the pass after it (bw, bw_wall: the passes'
    // medians); --module, against bp.best. Each as bench_frac_capped.
    double bw, bw_wall, frac, raw;
    bool dist;
    double best_frac, best_raw;  // --decode: against bp.best
    bool best_dist;
    bool paged, block_major;  // --block-size: the paged cache and its layout
    size_t piece;             // scattered pool: a piece's bytes, its bandwidth
    double pbw, pieces_frac, pieces_raw;
    bool pieces_dist;
    char what[96];  // the storage type and, paged, the blocks
} bench_decode_result;
void bench_print_decode(const bench_opts *o, const bench_decode_result *r);
void bench_print_decode_module(const bench_opts *o, const bench_decode_result *r);
// A measured rate's fraction of a probe's ceiling as the bench reports it:
// never above 1 silently. *raw: the rate over the ceiling; *disturbed: it
// was above 1 (the probe was disturbed, or its kernels are not the fastest
// way to the ceiling): the fraction returned is then 1 (capped), and the
// text and JSON say so.
double bench_frac_capped(double rate, double ceiling, double *raw, bool *disturbed);
// The median of n sorted times.
double bench_median_sorted(const double *t, int64_t n);
// The process's peak memory (max RSS), MiB.
double bench_max_rss_mib(void);

#endif
