// bench.c: `mha bench`, the timing of the module (projections included)
// or, with --core, of the attention core alone (mha_sdpa on projected
// (B, H, L, d) tensors), on this machine, with:
//  - the median, min and max of --repeat runs after one warm-up run;
//  - GFLOP/s under a stated dense count (causal counts as dense);
//  - the fraction of this machine's fp32 FMA peak, measured in the same
//    process by a small kernel of independent FMA chains (AVX-512,
//    AVX2+FMA or plain C, whichever the CPU has) on the same threads
//    (bench_peak.c, which also measures the read bandwidth --decode is
//    held against); both probes repeat until their best settles, and a
//    fraction above 1 is printed capped with a "probe disturbed" warning
//    (a JSON flag), never silently;
//  - the process's peak memory (max RSS).
// It also says which implementation actually ran: the public API does not
// report it, so a tiny probe compares the requested implementation's output
// bit for bit with the reference's and the fused one's (they differ in the
// last bits: the reference computes in double).
//
// What it deliberately does not do: any comparison with PyTorch (bench/bench_torch.py and bench/compare.sh
// do that from the --json lines).
// --parallel runs in bench_mpi.c.
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "bench.h"
#include "cli.h"
#include "cmd.h"
#ifdef MHA_HAVE_MPI
#include "mha_mpi.h"
#endif

static const char *bench_help =
    "Usage: mha bench --batch B --seq L [--kv-seq S] --embed-dim E\n"
    "                 --num-heads H [options]\n"
    "Times nn.MultiheadAttention's forward (projections included;\n"
    "batch_first (B, L, E) inputs, self-attention unless --kv-seq differs\n"
    "from --seq, no need_weights) or, with --core, the attention core alone\n"
    "(mha_sdpa on contiguous (B, H, L, d) / (B, H, S, d) tensors, d = E/H).\n"
    "Prints the median time, GFLOP/s (dense count, stated), the fraction of\n"
    "this machine's fp32 FMA peak (measured here, on the same threads; with\n"
    "--dtype bf16 its bf16 dot peak instead, AMX tdpbf16ps or vdpbf16ps,\n"
    "where the CPU has one) and the process's max RSS.\n"
    "The peak and the read bandwidth are probes: short trials repeated until\n"
    "their best settles (within 1.5%, bounded), each thread's work on its own\n"
    "CPU time; the bandwidth the best of three read kernels (plain, software\n"
    "prefetch, non-temporal loads) over a buffer on huge pages. A fraction\n"
    "above 100% is printed capped with a \"probe disturbed\" warning (JSON:\n"
    "the *_fraction capped, *_fraction_raw, *_probe_disturbed).\n"
    "  --batch B          batch size (default 1)\n"
    "  --seq L            query length\n"
    "  --kv-seq S         key/value length (default L)\n"
    "  --embed-dim E      model dimension\n"
    "  --num-heads H      heads (must divide E)\n"
    "  --causal           hide keys j > i (FLOPs still counted dense)\n"
    "  --window W         sliding window: query i sees keys [i - W, i + W]\n"
    "                     ([i - W, i] with --causal); FLOPs still counted\n"
    "                     dense, the visible fraction is printed\n"
    "  --backward         time forward + backward (mha_backward: gradients\n"
    "                     of the inputs and of every parameter; with --core,\n"
    "                     mha_sdpa + mha_sdpa_backward: dq, dk, dv)\n"
    "  --core             the attention core alone (mha_sdpa)\n"
    "  --decode           one decode step instead: --seq (default 1) new\n"
    "                     queries per head against a KV cache of --kv-len N\n"
    "                     tokens (mha_kv_cache_attend; no projections), with\n"
    "                     --num-kv-heads K (default: --num-heads); prints the\n"
    "                     K and V bytes read per second against this machine's\n"
    "                     read bandwidth measured in the same process;\n"
    "                     --kv-dtype f32|bf16|f16|int8|int4 the cache's storage\n"
    "  --serve            a serving workload instead: --sequences N (default\n"
    "                     32) sequences sharing a prompt of --seq P tokens\n"
    "                     (default 2048), prefilled once and forked, then\n"
    "                     decoding together through a paged KV cache\n"
    "                     (mha_forward_paged, one call per step for every\n"
    "                     running sequence), each up to --gen G new tokens\n"
    "                     (default 256; stops uniform in [G/4, G]), blocks of\n"
    "                     --block-size tokens (default 16), --kv-dtype,\n"
    "                     --num-kv-heads; prints tokens/s, the step time\n"
    "                     against the bytes it reads over the read bandwidth,\n"
    "                     and the cache's memory against one contiguous cache\n"
    "                     per sequence\n"
    "  --block-size B     with --decode: a paged KV cache of B-token blocks\n"
    "                     (mha_paged_cache_attend) instead of a contiguous one\n"
    "  --pool-order O     with --block-size: scattered (default: a pool of\n"
    "                     twice the blocks, half of them held by other\n"
    "                     sequences at random, as a busy server's: the cache's\n"
    "                     blocks in short runs at random places) or sequential\n"
    "                     (a pool of the cache's blocks alone)\n"
    "  --pool-layout L    with --block-size (--decode, --serve): head-major\n"
    "                     (default: a KV head's blocks side by side) or\n"
    "                     block-major (a block's KV heads side by side, read\n"
    "                     heads together; mha_paged_layout)\n"
    "  --module           with --decode: the module's decode step instead\n"
    "                     (mha_forward_cached: the q, k, v projections, the\n"
    "                     append, attention over the cache, W_O), --seq new\n"
    "                     tokens per sequence, the cache cut back to --kv-len\n"
    "                     after each step (untimed); prints the bytes a step\n"
    "                     must read (the weights in their storage dtype + K\n"
    "                     and V) per token and against the read bandwidth;\n"
    "                     takes --weight-dtype, --head-gate, --prune-heads\n"
    "  --weight-dtype T   f32, bf16 or f16: the module's weight matrices\n"
    "                     stored in T (mha_config.weight_dtype); default:\n"
    "                     --dtype's for a module forward (+ backward),\n"
    "                     else f32\n"
    "  --dtype T          f32 (default), bf16 or f16: query/key/value and\n"
    "                     the output stored in T (module: and the\n"
    "                     gradients of output and inputs; --core: q, k, v,\n"
    "                     out and the gradients)\n"
    "  --prune-heads K    prune the last K heads (mha_module_prune_heads: their\n"
    "                     attention is skipped; module forward/backward)\n"
    "  --head-gate G      none (default), static or dynamic per-head gates\n"
    "  --parallel SCHEME  under mpirun: heads, heads-fast, ulysses or ring\n"
    "                     across the ranks (mha_mpi.h): the slowest rank's\n"
    "                     time, and per rank the time inside MPI (ring: and\n"
    "                     waiting for its messages), bytes sent against the\n"
    "                     scheme's model, score tiles (ring), the work\n"
    "                     imbalance. --parallel kv --decode: a decode step\n"
    "                     over a KV cache of --kv-len tokens sharded across\n"
    "                     the ranks (mha_mpi_forward_cached)\n"
    "  --no-save          with --backward: no saved forward state\n"
    "                     (mha_forward_args.save, mha_sdpa_args.save), so\n"
    "                     the backward re-runs the forward (default: the\n"
    "                     forward keeps it)\n"
    "  --threads T        OpenMP threads (default: OMP_NUM_THREADS or all)\n"
    "  --impl NAME        auto (default), reference or fused\n"
    "  --isa NAME         force the fused kernels' ISA: scalar, avx2, avx512\n"
    "                     (sets MHA_ISA; an ISA the CPU lacks is ignored)\n"
    "  --repeat N         timed runs (default 5)\n"
    "  --warmup N         untimed runs first (default 1)\n"
    "  --workspace        allocate the forward's scratch once\n"
    "                     (mha_forward_args.workspace) instead of per call\n"
    "  --seed N           seed of the random inputs and weights (default 0)\n"
    "  --json             one JSON object per line instead of the text block\n"
    "FLOP count (dense, kdim = vdim = E): module forward = 2BLE^2 (Q proj)\n"
    "+ 2BS(2E)E (K, V proj) + 2BLE^2 (out proj) + 4BLSE (QK^T and PV); core\n"
    "= 4BLSE. Causal runs are counted as dense. --backward counts the\n"
    "backward as 2x the forward (3x the forward in all).\n"
    "The implementation that ran (impl_ran, backward_impl) is found by a probe\n"
    "on a tiny problem: its output compared bit for bit with the reference's\n"
    "and the fused path's.\n";

#define BENCH_MAX_REPEAT 100000

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

static int bench_usage(const char *msg) { return cli_usage("bench", msg); }

// ---------------------------------------------------------------------------
// Buffers and random data (the seeded floats: bench_rand.c)

// Every buffer the benchmark allocates, freed together.
typedef struct bench_bufs {
    void *p[64];
    int n;
    double bytes;  // total, for the memory report
    bool failed;   // an allocation failed (reported once)
} bench_bufs;

// x (n floats) rewritten in place as n elements of d (BF16/F16: 2-byte
// elements at the front of the buffer; F32: unchanged).
static void to_dtype(float *x, int64_t n, mha_dtype d) {
    if (d == MHA_F32) return;
    uint16_t *h = (uint16_t *)x;
    for (int64_t i = 0; i < n; i++) {
        const float v = x[i];  // read before the write below (2i < 4i + 4)
        h[i] = d == MHA_BF16 ? mha_f32_to_bf16(v) : mha_f32_to_f16(v);
    }
}

// n floats (64-byte aligned, written so the pages are resident and counted
// in the RSS before the first timed call), or NULL after printing.
static float *bench_alloc(bench_bufs *bb, int64_t n) {
    if (bb->failed) return NULL;
    bb->failed = true;
    size_t bytes;
    if (bb->n == (int)(sizeof bb->p / sizeof bb->p[0])) {
        fprintf(stderr, "mha bench: internal error: too many buffers\n");
        return NULL;
    }
    if (n < 0 || __builtin_mul_overflow((size_t)(n > 0 ? n : 1), sizeof(float), &bytes) ||
        bytes > SIZE_MAX - 64) {
        fprintf(stderr, "mha bench: a buffer of %lld floats is too large\n", (long long)n);
        return NULL;
    }
    bytes = (bytes + 63) & ~(size_t)63;
    void *p = aligned_alloc(64, bytes);
    if (!p) {
        fprintf(stderr, "mha bench: out of memory for %.1f MiB of inputs/outputs\n",
                (double)bytes / 1048576.0);
        return NULL;
    }
    memset(p, 0, bytes);
    bb->failed = false;
    bb->p[bb->n++] = p;
    bb->bytes += (double)bytes;
    return p;
}

static void bench_free(bench_bufs *bb) {
    for (int i = 0; i < bb->n; i++) free(bb->p[i]);
    bb->n = 0;
}

static double max_rss_mib(void) {
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru)) return 0;
    return (double)ru.ru_maxrss / 1024.0;  // ru_maxrss is in KiB on Linux
}

// ---------------------------------------------------------------------------
// The problems: one module (or core) problem with its tensors, run once.

typedef struct problem {
    const bench_opts *o;
    bool self;  // key = value = query (S == L)
    mha_module *m, *grads;
    mha_forward_args a;
    mha_tensor q, k, v, out, gout, gq, gk, gv;
    void *ws;
    size_t ws_bytes;
    mha_sdpa_args sa;
    mha_saved *saved;  // --backward: the forward keeps its state
    // what the last run's forward and backward ran (mha_last_impl(): e.g.
    // "fused avx512", "fused amx bf16", "reference")
    char fwd_ran[64], bwd_ran[64];
} problem;

static void problem_free(problem *p) {
    mha_module_destroy(p->grads);
    mha_module_destroy(p->m);
    mha_saved_destroy(p->saved);
    free(p->ws);
    memset(p, 0, sizeof *p);
}

// Allocates and fills the tensors of a problem of the options' shape (o's
// fields B, L, S, E, H) with impl `impl`. Returns 0, or 1 after printing.
static int problem_setup(problem *p, bench_bufs *bb, const bench_opts *o, mha_impl impl) {
    memset(p, 0, sizeof *p);
    p->o = o;
    uint64_t rng = o->seed * 0x9e3779b97f4a7c15ull + 12345;
    const int64_t B = o->B, L = o->L, S = o->S, E = o->E, H = o->H, d = E / H;
    mha_status st;
    if (o->core) {
        int64_t qs[4] = {B, H, L, d}, ks[4] = {B, H, S, d};
        float *q = bench_alloc(bb, B * H * L * d), *k = bench_alloc(bb, B * H * S * d),
              *v = bench_alloc(bb, B * H * S * d), *out = bench_alloc(bb, B * H * L * d);
        if (!q || !k || !v || !out) return 1;
        bench_fill_uniform(q, B * H * L * d, &rng);
        bench_fill_uniform(k, B * H * S * d, &rng);
        bench_fill_uniform(v, B * H * S * d, &rng);
        const mha_dtype dt = o->dtype;  // every tensor in --dtype
        to_dtype(q, B * H * L * d, dt);
        to_dtype(k, B * H * S * d, dt);
        to_dtype(v, B * H * S * d, dt);
        p->q = mha_tensor_contiguous(q, dt, 4, qs);
        p->k = mha_tensor_contiguous(k, dt, 4, ks);
        p->v = mha_tensor_contiguous(v, dt, 4, ks);
        p->out = mha_tensor_contiguous(out, dt, 4, qs);
        if (o->backward) {  // dout, and dq, dk, dv
            float *g = bench_alloc(bb, B * H * L * d), *gq = bench_alloc(bb, B * H * L * d),
                  *gk = bench_alloc(bb, B * H * S * d), *gv = bench_alloc(bb, B * H * S * d);
            if (!g || !gq || !gk || !gv) return 1;
            bench_fill_uniform(g, B * H * L * d, &rng);
            to_dtype(g, B * H * L * d, dt);
            p->gout = mha_tensor_contiguous(g, dt, 4, qs);
            p->gq = mha_tensor_contiguous(gq, dt, 4, qs);
            p->gk = mha_tensor_contiguous(gk, dt, 4, ks);
            p->gv = mha_tensor_contiguous(gv, dt, 4, ks);
        }
        mha_sdpa_args_init(&p->sa);
        p->sa.q = &p->q;
        p->sa.k = &p->k;
        p->sa.v = &p->v;
        p->sa.opts.is_causal = o->causal;
        p->sa.impl = impl;
        if (o->window) p->sa.opts.window_left = p->sa.opts.window_right = o->window;
        if (o->backward && !o->no_save) {  // the forward keeps its rows for the backward
            if ((st = mha_saved_create(&p->saved))) return cli_fail("bench", st);
            p->sa.save = p->saved;
        }
        return 0;
    }
    mha_config cfg;
    mha_config_init(&cfg, E, H);
    cfg.batch_first = true;
    cfg.weight_dtype = o->wdtype;
    cfg.head_gate = o->gate;
    mha_init_options io;
    mha_init_options_init(&io);
    io.seed = o->seed;
    if ((st = mha_module_create(&p->m, &cfg)) || (st = mha_module_init(p->m, &io)))
        return cli_fail("bench", st);
    if (o->prune) {
        int64_t *pr = malloc(sizeof(int64_t) * (size_t)o->prune);
        if (!pr) return cli_fail("bench", MHA_ERR_NOMEM);
        for (int64_t i = 0; i < o->prune; i++) pr[i] = H - o->prune + i;
        st = mha_module_prune_heads(p->m, pr, o->prune);
        free(pr);
        if (st) return cli_fail("bench", st);
    }
    p->self = S == L;
    int64_t qs[3] = {B, L, E}, ks[3] = {B, S, E};
    float *q = bench_alloc(bb, B * L * E), *out = bench_alloc(bb, B * L * E);
    if (!q || !out) return 1;
    bench_fill_uniform(q, B * L * E, &rng);
    to_dtype(q, B * L * E, o->dtype);
    p->q = mha_tensor_contiguous(q, o->dtype, 3, qs);
    p->out = mha_tensor_contiguous(out, o->dtype, 3, qs);
    if (p->self) {
        p->k = p->v = p->q;
    } else {
        float *k = bench_alloc(bb, B * S * E), *v = bench_alloc(bb, B * S * E);
        if (!k || !v) return 1;
        bench_fill_uniform(k, B * S * E, &rng);
        bench_fill_uniform(v, B * S * E, &rng);
        to_dtype(k, B * S * E, o->dtype);
        to_dtype(v, B * S * E, o->dtype);
        p->k = mha_tensor_contiguous(k, o->dtype, 3, ks);
        p->v = mha_tensor_contiguous(v, o->dtype, 3, ks);
    }
    mha_forward_args_init(&p->a);
    p->a.query = &p->q;
    p->a.key = p->self ? &p->q : &p->k;
    p->a.value = p->self ? &p->q : &p->v;
    p->a.opts.is_causal = o->causal;
    p->a.impl = impl;
    if (o->window) p->a.opts.window_left = p->a.opts.window_right = o->window;
    if (o->workspace) {
        if ((st = mha_forward_workspace_size(&p->ws_bytes, p->m, &p->a)))
            return cli_fail("bench", st);
        p->ws = malloc(p->ws_bytes ? p->ws_bytes : 1);
        if (!p->ws) {
            fprintf(stderr, "mha bench: out of memory for a workspace of %.1f MiB\n",
                    (double)p->ws_bytes / 1048576.0);
            return 1;
        }
        memset(p->ws, 0, p->ws_bytes);
        p->a.workspace = p->ws, p->a.workspace_bytes = p->ws_bytes;
    }
    if (o->backward) {
        float *g = bench_alloc(bb, B * L * E), *gq = bench_alloc(bb, B * L * E),
              *gk = bench_alloc(bb, B * S * E), *gv = bench_alloc(bb, B * S * E);
        if (!g || !gq || !gk || !gv) return 1;
        bench_fill_uniform(g, B * L * E, &rng);
        to_dtype(g, B * L * E, o->dtype);  // the gradients in --dtype, as torch's
        p->gout = mha_tensor_contiguous(g, o->dtype, 3, qs);
        p->gq = mha_tensor_contiguous(gq, o->dtype, 3, qs);
        p->gk = mha_tensor_contiguous(gk, o->dtype, 3, ks);
        p->gv = mha_tensor_contiguous(gv, o->dtype, 3, ks);
        if ((st = mha_module_create(&p->grads, mha_module_config(p->m))))
            return cli_fail("bench", st);
        if (!o->no_save) {
            if ((st = mha_saved_create(&p->saved))) return cli_fail("bench", st);
            p->a.save = p->saved;
        }
    }
    return 0;
}

// One run: the forward (and the backward), or the core.
static mha_status problem_run(problem *p) {
    mha_status st;
    if (p->o->core) st = mha_sdpa(&p->out, NULL, &p->sa);
    else st = mha_forward(&p->out, NULL, p->m, &p->a);  // (p->a.workspace: p->ws)
    if (st) return st;
    snprintf(p->fwd_ran, sizeof p->fwd_ran, "%s", mha_last_impl());
    if (!p->o->backward) return st;
    st = p->o->core
             ? mha_sdpa_backward(&p->gq, &p->gk, &p->gv, &p->gout, &p->sa)
             : mha_backward(&p->gq, &p->gk, &p->gv, p->grads, p->m, &p->a, &p->gout, false);
    if (!st) snprintf(p->bwd_ran, sizeof p->bwd_ran, "%s", mha_last_impl());
    return st;
}

// ---------------------------------------------------------------------------
// Whether the library takes the requested implementation for a problem of
// this kind: a tiny one run first (what ran is read off the real problem's
// runs, mha_last_impl()).

// Runs the tiny problem with impl; *unsupported is set when the library
// refused the impl (MHA_ERR_UNSUPPORTED). Returns 0, or 1 after printing.
static int probe_run(bench_bufs *bb, const bench_opts *o, mha_impl impl, bool *unsupported,
                     char *why, size_t why_cap) {
    bench_opts t = *o;
    t.B = 1;
    t.H = 2;
    t.E = 32;
    t.L = 17;
    t.S = o->S == o->L ? 17 : 19;
    t.workspace = false;
    t.prune = o->prune ? 1 : 0;  // the last of the two heads
    problem p;
    int rc = problem_setup(&p, bb, &t, impl);
    if (rc) {
        problem_free(&p);
        return rc;
    }
    mha_status st = problem_run(&p);
    *unsupported = st == MHA_ERR_UNSUPPORTED;
    if (*unsupported) snprintf(why, why_cap, "%s", mha_last_error());
    if (st && !*unsupported) {
        problem_free(&p);
        return cli_fail("bench", st);
    }
    problem_free(&p);
    return 0;
}

// Returns 0 when impl runs problems of o's kind; 1 after printing an
// error; 3 when the library refused impl (message in why).
static int probe_impl(const bench_opts *o, char *why, size_t why_cap) {
    bench_bufs bb = {0};
    bool unsup = false;
    int rc = probe_run(&bb, o, o->impl, &unsup, why, why_cap);
    if (!rc && unsup) rc = 3;
    bench_free(&bb);
    return rc;
}

// ---------------------------------------------------------------------------
// Options

// Every option its own value: two that shared one ('Y': --dtype and
// --pool-layout) both went to the first handler that takes it
// (tests/cli/test_cli_options.py runs every documented option).
static const struct option bench_long_opts[] = {{"batch", required_argument, 0, 'b'},
                                                {"seq", required_argument, 0, 'l'},
                                                {"kv-seq", required_argument, 0, 's'},
                                                {"embed-dim", required_argument, 0, 'e'},
                                                {"num-heads", required_argument, 0, 'n'},
                                                {"causal", no_argument, 0, 'c'},
                                                {"window", required_argument, 0, 'w'},
                                                {"backward", no_argument, 0, 'B'},
                                                {"core", no_argument, 0, 'C'},
                                                {"threads", required_argument, 0, 't'},
                                                {"no-save", no_argument, 0, 'N'},
                                                {"decode", no_argument, 0, 'D'},
                                                {"kv-len", required_argument, 0, 'K'},
                                                {"num-kv-heads", required_argument, 0, 'G'},
                                                {"kv-dtype", required_argument, 0, 'T'},
                                                {"weight-dtype", required_argument, 0, 'X'},
                                                {"dtype", required_argument, 0, 'Y'},
                                                {"prune-heads", required_argument, 0, 'P'},
                                                {"head-gate", required_argument, 0, 'g'},
                                                {"parallel", required_argument, 0, 'Z'},
                                                {"impl", required_argument, 0, 'i'},
                                                {"isa", required_argument, 0, 'I'},
                                                {"repeat", required_argument, 0, 'r'},
                                                {"json", no_argument, 0, 'j'},
                                                {"workspace", no_argument, 0, 'W'},
                                                {"seed", required_argument, 0, 'S'},
                                                {"warmup", required_argument, 0, 'u'},
                                                {"help", no_argument, 0, 'h'},
                                                {"module", no_argument, 0, 'M'},
                                                {"serve", no_argument, 0, 'V'},
                                                {"sequences", required_argument, 0, 'q'},
                                                {"gen", required_argument, 0, 'Q'},
                                                {"block-size", required_argument, 0, 'k'},
                                                {"pool-order", required_argument, 0, 'O'},
                                                {"pool-layout", required_argument, 0, 'L'},
                                                {0, 0, 0, 0}};

// One handler per group of options: each takes option c (its value in
// optarg) and returns -1 when it took it, the exit status when its value
// is bad, or BENCH_NOT_MINE when c is not of its group.
enum { BENCH_NOT_MINE = -2 };

// The problem's sizes and masking: --batch, --seq, --kv-seq, --embed-dim,
// --num-heads, --causal, --window, --kv-len, --num-kv-heads.
static int bench_opt_problem(bench_opts *o, int c) {
    const int64_t big = (int64_t)1 << 31;
    switch (c) {
    case 'b':
        if (cli_parse_int(&o->B, optarg, 1, big))
            return bench_usage("--batch needs a positive integer");
        break;
    case 'l':
        if (cli_parse_int(&o->L, optarg, 1, big))
            return bench_usage("--seq needs a positive integer");
        break;
    case 's':
        if (cli_parse_int(&o->S, optarg, 1, big))
            return bench_usage("--kv-seq needs a positive integer");
        break;
    case 'e':
        if (cli_parse_int(&o->E, optarg, 1, big))
            return bench_usage("--embed-dim needs a positive integer");
        break;
    case 'n':
        if (cli_parse_int(&o->H, optarg, 1, big))
            return bench_usage("--num-heads needs a positive integer");
        break;
    case 'c': o->causal = true; break;
    case 'w':
        if (cli_parse_int(&o->window, optarg, 1, big))
            return bench_usage("--window needs a positive integer");
        break;
    case 'K':
        if (cli_parse_int(&o->kv_len, optarg, 1, big))
            return bench_usage("--kv-len needs a positive integer");
        break;
    case 'G':
        if (cli_parse_int(&o->kv_heads, optarg, 1, big))
            return bench_usage("--num-kv-heads needs a positive integer");
        break;
    case 'q':
        if (cli_parse_int(&o->sequences, optarg, 1, 1 << 20))
            return bench_usage("--sequences needs a positive integer");
        break;
    case 'Q':
        if (cli_parse_int(&o->gen, optarg, 1, big))
            return bench_usage("--gen needs a positive integer");
        break;
    case 'k':
        if (cli_parse_int(&o->block, optarg, 1, 1 << 20))
            return bench_usage("--block-size needs a positive integer");
        break;
    case 'O':
        if (strcmp(optarg, "sequential") && strcmp(optarg, "scattered"))
            return bench_usage("--pool-order needs sequential or scattered");
        o->contiguous_pool = strcmp(optarg, "sequential") == 0;
        break;
    case 'L':
        if (mha_paged_layout_from_name(&o->layout, optarg))
            return bench_usage("--pool-layout needs head-major or block-major");
        break;
    default: return BENCH_NOT_MINE;
    }
    return -1;
}

// What is timed: --backward, --core, --no-save, --decode, --module,
// --kv-dtype, --weight-dtype, --dtype, --parallel, --prune-heads,
// --head-gate, --workspace.
static int bench_opt_what(bench_opts *o, int c) {
    const int64_t big = (int64_t)1 << 31;
    switch (c) {
    case 'B': o->backward = true; break;
    case 'C': o->core = true; break;
    case 'N': o->no_save = true; break;
    case 'D': o->decode = true; break;
    case 'M': o->module = true; break;
    case 'V': o->serve = true; break;
    case 'T':
        if (mha_kv_dtype_from_name(&o->kv_dtype, optarg))
            return bench_usage("--kv-dtype needs f32, bf16, f16, int8 or int4");
        break;
    case 'X':
    case 'Y': {
        if (c == 'X') o->wdtype_set = true;
        if (cli_float_dtype(c == 'X' ? &o->wdtype : &o->dtype, optarg))
            return bench_usage(c == 'X' ? "--weight-dtype needs f32, bf16 or f16"
                                        : "--dtype needs f32, bf16 or f16");
        break;
    }
    case 'Z': {
#ifdef MHA_HAVE_MPI
        // a scheme of mha_mpi.h or kv (--decode): checked now, a bad name
        // is a usage error
        mha_parallel par;
        if (strcmp(optarg, "kv") && mha_parallel_from_name(&par, optarg)) {
            char q[80];
            return cli_usagef("bench",
                              "unknown --parallel %s (available: heads, heads-fast, ulysses, "
                              "ring; kv with --decode)",
                              mha_escape(q, sizeof q, optarg));
        }
        o->parallel = optarg;
        break;
#else
        return bench_usage("--parallel needs an mha built with MPI (install libopenmpi-dev "
                           "and rebuild)");
#endif
    }
    case 'P':
        if (cli_parse_int(&o->prune, optarg, 0, big))
            return bench_usage("--prune-heads needs a non-negative integer");
        break;
    case 'g':
        if (mha_head_gate_from_name(&o->gate, optarg))
            return bench_usage("--head-gate needs none, static or dynamic");
        break;
    case 'W': o->workspace = true; break;
    default: return BENCH_NOT_MINE;
    }
    return -1;
}

// How it runs: --threads, --impl, --isa, --repeat, --warmup, --json,
// --seed.
static int bench_opt_how(bench_opts *o, int c) {
    int64_t v;
    switch (c) {
    case 't':
        if (cli_parse_int(&v, optarg, 1, 4096))
            return bench_usage("--threads needs an integer in [1, 4096]");
        o->threads = (int)v;
        break;
    case 'i':
        if (mha_impl_from_name(&o->impl, optarg)) {
            char q[80];
            fprintf(stderr,
                    "mha bench: unknown --impl %s (available: auto, reference, fused)\n",
                    mha_escape(q, sizeof q, optarg));
            return 2;
        }
        break;
    case 'I':
        if (strcmp(optarg, "scalar") && strcmp(optarg, "avx2") && strcmp(optarg, "avx512")) {
            char q[80];
            fprintf(stderr, "mha bench: unknown --isa %s (available: scalar, avx2, avx512)\n",
                    mha_escape(q, sizeof q, optarg));
            return 2;
        }
        o->isa = optarg;
        break;
    case 'r':
        if (cli_parse_int(&o->repeat, optarg, 1, BENCH_MAX_REPEAT))
            return bench_usage("--repeat needs an integer in [1, 100000]");
        break;
    case 'u':
        if (cli_parse_int(&o->warmup, optarg, 0, BENCH_MAX_REPEAT))
            return bench_usage("--warmup needs an integer in [0, 100000]");
        break;
    case 'j': o->json = true; break;
    case 'S':
        if (cli_parse_int(&v, optarg, 0, INT64_MAX))
            return bench_usage("--seed needs a non-negative integer");
        o->seed = (uint64_t)v;
        break;
    default: return BENCH_NOT_MINE;
    }
    return -1;
}

// The checks across options once all are read (and the defaults that
// follow from others). Returns -1 to go on, else the exit status.
static int bench_check(bench_opts *o) {
    if (o->module && !o->decode) return bench_usage("--module goes with --decode");
    if (!o->serve && (o->sequences || o->gen))
        return bench_usage("--sequences and --gen go with --serve");
    if (o->block && !o->serve && (!o->decode || o->module))
        return bench_usage("--block-size goes with --serve or --decode (not --module)");
    if (o->serve) {
        if (o->decode || o->core || o->backward || o->parallel || o->prune || o->gate)
            return bench_usage("--serve times its own workload (no --decode, --core, "
                               "--backward, --parallel, --prune-heads, --head-gate)");
        if (!o->E || !o->H) return bench_usage("--serve needs --embed-dim and --num-heads");
        if (!o->kv_heads) o->kv_heads = o->H;
        if (o->E % o->H || o->H % o->kv_heads)
            return bench_usage("--serve: --num-heads must divide --embed-dim and "
                               "--num-kv-heads must divide --num-heads");
        if (!o->L) o->L = 2048;
        if (!o->sequences) o->sequences = 32;
        if (!o->gen) o->gen = 256;
        if (!o->block) o->block = 16;
        if (o->gen < 2) return bench_usage("--serve: --gen must be at least 2");
        return -1;
    }
    if ((o->core || (o->decode && !o->module)) && (o->prune || o->gate))
        return bench_usage(
            "--prune-heads and --head-gate are for the module, not --core or --decode");
    if (o->decode) {
        if (!o->kv_len || !o->E || !o->H)
            return bench_usage("--decode needs --kv-len, --embed-dim and --num-heads");
        if (!o->kv_heads) o->kv_heads = o->H;
        if (o->E % o->H || o->H % o->kv_heads)
            return bench_usage("--decode: --num-heads must divide --embed-dim and "
                               "--num-kv-heads must divide --num-heads");
        if (!o->L) o->L = 1;
        if (o->prune > o->H) return bench_usage("--prune-heads is more than --num-heads");
        return -1;
    }
    if (!o->L || !o->E || !o->H)
        return bench_usage("--seq, --embed-dim and --num-heads are required");
    if (!o->S) o->S = o->L;
    if (o->E % o->H) {
        fprintf(stderr, "mha bench: --embed-dim %lld is not divisible by --num-heads %lld\n",
                (long long)o->E, (long long)o->H);
        return 2;
    }
    if (o->core && o->workspace)
        return bench_usage("--workspace is for the module, not --core");
    if (o->prune > o->H) {
        fprintf(stderr, "mha bench: --prune-heads %lld is more than --num-heads %lld\n",
                (long long)o->prune, (long long)o->H);
        return 2;
    }
    // Every tensor has at most max(L, S) * B * E floats; keep that within
    // what int64_t and size_t hold.
    int64_t n;
    if (__builtin_mul_overflow(o->B, o->L > o->S ? o->L : o->S, &n) ||
        __builtin_mul_overflow(n, o->E, &n) || n > ((int64_t)1 << 40)) {
        fprintf(stderr, "mha bench: batch x seq x embed_dim is too large\n");
        return 2;
    }
    return -1;
}

static int bench_parse(bench_opts *o, int argc, char **argv) {
    memset(o, 0, sizeof *o);
    o->B = 1;
    o->repeat = 5;
    o->warmup = 1;
    o->impl = MHA_IMPL_AUTO;
    int c;
    opterr = 0;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", bench_long_opts, NULL)) != -1) {
        if (c == 'h') {
            fputs(bench_help, stdout);
            return 0;
        }
        int rc = bench_opt_problem(o, c);
        if (rc == BENCH_NOT_MINE) rc = bench_opt_what(o, c);
        if (rc == BENCH_NOT_MINE) rc = bench_opt_how(o, c);
        if (rc == BENCH_NOT_MINE) rc = cli_bad_option("bench", argv, bench_long_opts);
        if (rc != -1) return rc;
    }
    if (optind < argc) return cli_unexpected("bench", argv[optind]);
    // the module in --dtype (as torch's module.to(dtype)): its weight
    // matrices follow --dtype unless given (forward and backward)
    if (!o->wdtype_set && !o->decode && !o->serve) o->wdtype = o->dtype;
    return bench_check(o);
}

// ---------------------------------------------------------------------------
// Output

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

// A measured rate's fraction of a probe's ceiling as the bench reports it:
// never above 1 silently. *raw: the rate over the ceiling; *disturbed: it
// was above 1 (the probe was disturbed, or its kernels are not the fastest
// way to the ceiling): the fraction returned is then 1 (capped), and the
// text and JSON say so.
static double frac_capped(double rate, double ceiling, double *raw, bool *disturbed) {
    *raw = ceiling > 0 ? rate / ceiling : 0.0;
    *disturbed = *raw > 1.0;
    return *disturbed ? 1.0 : *raw;
}

// "83.2%", or "100.0% (capped, see the warning)" for a disturbed fraction.
static const char *frac_text(char *buf, size_t cap, double raw) {
    if (raw > 1.0) snprintf(buf, cap, "100.0%% (capped, see the warning)");
    else snprintf(buf, cap, "%.1f%%", 100.0 * raw);
    return buf;
}

// The warning line under a capped fraction: what it was held against.
static void frac_warn(double raw, const char *probe) {
    if (raw > 1.0)
        printf("  warning    probe disturbed: measured rate above the probe's %s (%.1f%% of "
               "it): the fraction is printed capped at 100%%\n",
               probe, 100.0 * raw);
}

// "best of 14 trials, settled" / "... not settled"
static const char *probe_text(char *buf, size_t cap, const bench_probe *p) {
    snprintf(buf, cap, "best of %d %s, %s", p->trials, p->trials == 1 ? "trial" : "trials",
             p->settled ? "settled" : "not settled within its bound");
    return buf;
}

static const char *flop_note(const bench_opts *o) {
    if (o->core && o->backward)
        return o->causal ? "core dense 4BLSE (QK^T + PV), x3 for forward + backward "
                           "(mha_sdpa_backward = 2x forward); causal counted as dense"
                         : "core dense 4BLSE (QK^T + PV), x3 for forward + backward "
                           "(mha_sdpa_backward = 2x forward)";
    if (o->core)
        return o->causal ? "core dense 4BLSE (QK^T + PV); causal counted as dense"
                         : "core dense 4BLSE (QK^T + PV)";
    if (o->backward)
        return o->causal ? "module forward dense 4BLE^2 + 4BSE^2 + 4BLSE (projections "
                           "+ QK^T + PV), x3 for forward + backward (backward = 2x "
                           "forward); causal counted as dense"
                         : "module forward dense 4BLE^2 + 4BSE^2 + 4BLSE (projections "
                           "+ QK^T + PV), x3 for forward + backward (backward = 2x "
                           "forward)";
    return o->causal ? "module forward dense 4BLE^2 + 4BSE^2 + 4BLSE (projections + "
                       "QK^T + PV); causal counted as dense"
                     : "module forward dense 4BLE^2 + 4BSE^2 + 4BLSE (projections + "
                       "QK^T + PV)";
}

static const char *dtype_label(mha_dtype d) {
    return d == MHA_BF16 ? "bf16" : d == MHA_F16 ? "f16" : "f32";
}

static void print_json(const bench_opts *o, const bench_result *r) {
    double raw;
    bool dist;
    const double frac = frac_capped(r->gflops, r->peak.best, &raw, &dist);
    printf("{\"what\": \"mha\", \"impl\": \"%s\", \"impl_ran\": \"%s\", "
           "\"backward_impl\": \"%s\", \"isa\": \"%s\", \"threads\": %d, "
           "\"batch\": %lld, \"seq\": %lld, \"kv_seq\": %lld, \"embed_dim\": %lld, "
           "\"num_heads\": %lld, \"causal\": %s, \"backward\": %s, \"core\": %s, "
           "\"workspace\": \"%s\", \"repeat\": %lld, \"warmup\": %lld, "
           "\"median_ms\": %.4f, \"min_ms\": %.4f, \"max_ms\": %.4f, "
           "\"flop_count\": %.6g, \"gflops\": %.3f, \"peak_gflops\": %.3f, "
           "\"peak_isa\": \"%s\", \"peak_kind\": \"%s\", \"peak_fraction\": %.4f, \"peak_fraction_raw\": %.4f, "
           "\"peak_probe_disturbed\": %s, \"peak_trials\": %d, \"peak_settled\": %s, "
           "\"peak_probes\": %d, \"peak_wall_gflops\": %.3f, \"max_rss_mib\": %.1f, "
           "\"rss_before_mib\": %.1f, \"inputs_mib\": %.1f, "
           "\"window\": %lld, \"visible_fraction\": %.6f, \"saved_forward\": %s, "
           "\"dtype\": \"%s\", \"weight_dtype\": \"%s\", \"pruned_heads\": %lld, "
           "\"head_gate\": \"%s\", \"flop_count_note\": \"%s\"}\n",
           mha_impl_name(o->impl), r->fwd_ran, r->bwd_ran, r->isa, r->threads, (long long)o->B,
           (long long)o->L, (long long)o->S, (long long)o->E, (long long)o->H,
           o->causal ? "true" : "false", o->backward ? "true" : "false",
           o->core ? "true" : "false",
           o->core        ? "n/a"
           : o->workspace ? "preallocated"
                          : "per-call",
           (long long)o->repeat, (long long)o->warmup, r->median, r->min, r->max, r->flops,
           r->gflops, r->peak.best, r->peak.kernel, r->peak_bf16 ? "bf16 dot" : "fp32 FMA",
           frac, raw, dist ? "true" : "false", r->peak.trials,
           r->peak.settled ? "true" : "false", r->peak_probes, r->peak.best_wall, r->rss_max,
           r->rss_before, r->inputs_mib, (long long)o->window, r->visible,
           o->backward && !o->no_save ? "true" : "false", dtype_label(o->dtype),
           dtype_label(o->wdtype), (long long)o->prune, mha_head_gate_name(o->gate),
           flop_note(o));
}

static void print_text(const bench_opts *o, const bench_result *r) {
    printf("mha bench: %s, impl %s (ran: %s), fused kernels %s, %d thread%s\n",
           o->core       ? "attention core (mha_sdpa)"
           : o->backward ? "module forward + backward"
                         : "module forward",
           mha_impl_name(o->impl), r->fwd_ran, r->isa, r->threads, r->threads == 1 ? "" : "s");
    if (o->backward && o->core)
        printf("  backward   mha_sdpa_backward ran the %s implementation%s\n", r->bwd_ran,
               o->no_save ? ", the forward's rows recomputed (--no-save)"
                          : ", from the forward's saved rows (args.save)");
    else if (o->backward)
        printf("  backward   mha_backward ran the %s implementation%s\n", r->bwd_ran,
               o->no_save ? ", re-running the forward (--no-save)"
                          : ", from the forward's saved state (args.save)");
    if (o->core)
        printf("  shape      q (%lld, %lld, %lld, %lld), k/v (%lld, %lld, %lld, %lld)%s\n",
               (long long)o->B, (long long)o->H, (long long)o->L, (long long)(o->E / o->H),
               (long long)o->B, (long long)o->H, (long long)o->S, (long long)(o->E / o->H),
               o->causal ? ", causal" : "");
    else
        printf("  shape      batch %lld, seq %lld, kv_seq %lld, embed_dim %lld, heads %lld "
               "(d %lld)%s%s\n",
               (long long)o->B, (long long)o->L, (long long)o->S, (long long)o->E,
               (long long)o->H, (long long)(o->E / o->H), o->causal ? ", causal" : "",
               o->S == o->L ? ", self-attention" : "");
    if (o->prune || o->gate)
        printf("  heads      %lld of %lld pruned (the last; their attention skipped), "
               "gates %s\n",
               (long long)o->prune, (long long)o->H, mha_head_gate_name(o->gate));
    printf("  time       median %.3f ms (min %.3f, max %.3f; %lld run%s after %lld "
           "warm-up%s)\n",
           r->median, r->min, r->max, (long long)o->repeat, o->repeat == 1 ? "" : "s",
           (long long)o->warmup, o->warmup == 1 ? "" : "s");
    printf("  work       %.3f GFLOP: %s\n", r->flops * 1e-9, flop_note(o));
    if (o->causal || o->window)
        printf("  band       %s%s: %.1f%% of the (i, j) score pairs are visible\n",
               o->causal ? (o->window ? "causal, " : "causal") : "", o->window ? "window" : "",
               100.0 * r->visible);
    char ft[64], pt[96];
    double raw;
    bool dist;
    (void)frac_capped(r->gflops, r->peak.best, &raw, &dist);
    printf("  speed      %.1f GFLOP/s = %s of the measured %s peak %.1f GFLOP/s (%s, "
           "%d thread%s; each thread's products on its CPU time, %s%s; %.1f on the wall "
           "clock%s)\n",
           r->gflops, frac_text(ft, sizeof ft, raw), r->peak_bf16 ? "bf16 dot" : "fp32 FMA",
           r->peak.best, r->peak.kernel, r->threads, r->threads == 1 ? "" : "s",
           probe_text(pt, sizeof pt, &r->peak),
           r->peak_probes > 1 ? "; probed again after the runs" : "", r->peak.best_wall,
           r->peak.best_wall < 0.9 * r->peak.best ? ": the CPUs shared with other work" : "");
    frac_warn(raw, "peak");
    printf("  memory     process max RSS %.1f MiB (%.1f MiB before the first call; the "
           "benchmark's own tensors %.1f MiB)\n",
           r->rss_max, r->rss_before, r->inputs_mib);
    if (!o->core)
        printf("  scratch    %s\n", o->workspace ? "allocated once (args.workspace)"
                                                 : "allocated by every call (mha_forward)");
    if (o->impl == MHA_IMPL_FUSED && strncmp(r->fwd_ran, "fused", 5) != 0)
        printf("  note       --impl fused was accepted but the %s path ran\n", r->fwd_ran);
}

// ---------------------------------------------------------------------------
// mha bench --decode: one step of cached attention.
// The median of n sorted times.
static double median_sorted(const double *t, int64_t n) {
    return n % 2 ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2]);
}

// The bytes of a bandwidth buffer for a step that reads `bytes`: twice
// those (at least 512 MiB: beyond the caches).
static size_t bandwidth_bytes(double bytes) {
    return (size_t)(bytes * 2 > 512.0 * 1048576 ? bytes * 2 : 512.0 * 1048576);
}

// The read bandwidth on these threads, over a buffer of bandwidth_bytes.
static bench_probe bandwidth_over(int threads, double bytes) {
    return bandwidth_probe(threads, bandwidth_bytes(bytes));
}

// Fills cache c with N random tokens per (batch, KV head), K = V, appended
// in chunks of 4096 (a bounded temporary). 0, or 1 after printing why.
// Fills a decode bench's cache with N random tokens per sequence, in chunks
// of 4096: contiguous cache c, or (c NULL) paged cache pc's sequences ids.
static int fill_cache(mha_kv_cache *c, mha_paged_cache *pc, const int64_t *ids, int64_t B,
                      int64_t Hkv, int64_t d, int64_t N, uint64_t *rng) {
    const int64_t chunk = 4096;
    float *kv = malloc(sizeof(float) * (size_t)(B * Hkv * chunk * d));
    if (!kv) {
        fprintf(stderr, "mha bench: out of memory\n");
        return 1;
    }
    int rc = 0;
    for (int64_t n0 = 0; !rc && n0 < N; n0 += chunk) {
        const int64_t n = N - n0 < chunk ? N - n0 : chunk;
        bench_fill_uniform(kv, B * Hkv * n * d, rng);
        mha_tensor kt = mha_tensor_contiguous(kv, MHA_F32, 4, (int64_t[]){B, Hkv, n, d});
        mha_status st = c ? mha_kv_cache_append(c, &kt, &kt, NULL)
                          : mha_paged_cache_append(pc, B, ids, NULL, &kt, &kt, NULL);
        if (st) rc = cli_fail("bench", st);
    }
    free(kv);
    return rc;
}

// A busy server's pool: half its blocks held by other sequences at random.
// Every block of pc (2 nb of bs tokens) goes to a one-block sequence, then
// a random half of those sequences is freed (the others stay until the
// pool goes), so the nb blocks filled next come in short runs (the free
// runs: 2 blocks on average) at random places. 0, or 1 after printing
// why.
static int scatter_pool(mha_paged_cache *pc, int64_t nb, int64_t bs, int64_t Hkv, int64_t d,
                        uint64_t *rng) {
    int64_t *sid = malloc(sizeof *sid * (size_t)(2 * nb));
    float *kv = calloc((size_t)(Hkv * bs * d), sizeof(float));
    int rc = 0;
    if (!sid || !kv) {
        fprintf(stderr, "mha bench: out of memory\n");
        rc = 1;
    }
    mha_tensor kt = mha_tensor_contiguous(kv, MHA_F32, 4, (int64_t[]){1, Hkv, bs, d});
    int64_t n = 0;
    for (mha_status st; !rc && n < 2 * nb; n++)
        if ((st = mha_paged_cache_add(pc, &sid[n])) ||
            (st = mha_paged_cache_append(pc, 1, &sid[n], NULL, &kt, &kt, NULL)))
            rc = cli_fail("bench", st);
    for (int64_t i = n - 1; i > 0; i--) {  // Fisher-Yates
        const int64_t j = (int64_t)(bench_next(rng) % (uint64_t)(i + 1)), t = sid[i];
        sid[i] = sid[j], sid[j] = t;
    }
    for (int64_t i = 0; i < n && i < nb; i++) {
        mha_status st = mha_paged_cache_free(pc, sid[i]);
        if (st && !rc) rc = cli_fail("bench", st);
    }
    free(sid);
    free(kv);
    return rc;
}

// A decode bench's buffers: the input (nin random floats, after the
// cache's N tokens from the same generator) and the output (nin floats),
// the run times (o->repeat); cache c filled (fill_cache). 0, or 1 after
// printing why (the buffers are still freed by the caller).
static int decode_setup(const bench_opts *o, mha_kv_cache *c, mha_paged_cache *pc,
                        const int64_t *ids, int64_t B, int64_t Hkv, int64_t d, int64_t N,
                        int64_t nin, float **in, float **out, double **times) {
    uint64_t rng = o->seed * 0x9e3779b97f4a7c15ull + 7;
    if (pc && !o->contiguous_pool &&
        scatter_pool(pc, B * ((N + o->block - 1) / o->block), o->block, Hkv, d, &rng))
        return 1;
    *in = malloc(sizeof(float) * (size_t)nin);
    *out = malloc(sizeof(float) * (size_t)nin);
    *times = malloc(sizeof(double) * (size_t)o->repeat);
    if (!*in || !*out || !*times) {
        fprintf(stderr, "mha bench: out of memory\n");
        return 1;
    }
    if (fill_cache(c, pc, ids, B, Hkv, d, N, &rng)) return 1;
    bench_fill_uniform(*in, nin, &rng);
    return 0;
}

static int bench_decode(const bench_opts *o, int threads) {
    const int64_t B = o->B, H = o->H, Hkv = o->kv_heads, d = o->E / o->H, N = o->kv_len,
                  T = o->L;
    mha_kv_cache *c = NULL;
    mha_paged_cache *pc = NULL;  // --block-size: the paged cache, sequences ids
    int64_t *ids = o->block ? calloc((size_t)B, sizeof *ids) : NULL;
    if (o->block && !ids) return cli_fail("bench", MHA_ERR_NOMEM);
    // (scattered: a pool of twice the blocks, half of them held by others)
    const int64_t nblk = o->block ? B * ((N + o->block - 1) / o->block) : 0;
    mha_status st = o->block
                        ? mha_paged_cache_create(&pc, o->contiguous_pool ? nblk : 2 * nblk,
                                                 o->block, Hkv, d, d, o->kv_dtype, o->layout)
                        : mha_kv_cache_create(&c, B, Hkv, d, d, N, o->kv_dtype);
    for (int64_t b = 0; !st && pc && b < B; b++) st = mha_paged_cache_add(pc, &ids[b]);
    if (st) {
        mha_paged_cache_destroy(pc);
        free(ids);
        return cli_fail("bench", st);
    }
    float *q, *out;
    double *times;
    int rc = decode_setup(o, c, pc, ids, B, Hkv, d, N, B * H * T * d, &q, &out, &times);
    mha_tensor qt = mha_tensor_contiguous(q, MHA_F32, 4, (int64_t[]){B, H, T, d});
    mha_tensor ot = mha_tensor_contiguous(out, MHA_F32, 4, (int64_t[]){B, H, T, d});
    const double bytes =  // all N rows are in use
        rc   ? 0.0
        : pc ? (double)nblk * (double)mha_paged_cache_block_bytes(pc)
             : (double)mha_kv_cache_bytes(c);
    // after every timed step, one pass of the read bandwidth over twice its
    // bytes (at least 512 MiB: beyond the caches): each step's fraction
    // against the bandwidth of the same moment (the machine's memory is
    // shared, its bandwidth moves with the neighbours')
    bench_bw *bwb = rc ? NULL : bench_bw_create(threads, bandwidth_bytes(bytes));
    double *bws = malloc(sizeof(double) * (size_t)(3 * o->repeat)), *fr = bws + o->repeat,
           *bww = fr + o->repeat;  // the passes on the threads' CPU time, on the wall clock
    if (!rc && (!bwb || !bws)) {
        fprintf(stderr, "mha bench: out of memory for the bandwidth buffer\n");
        rc = 1;
    }
    for (int64_t i = 0; !rc && i < o->warmup + o->repeat; i++) {
        double t0 = cli_now();
        st = pc ? mha_paged_cache_attend(&ot, &qt, pc, B, ids, NULL, NULL)
                : mha_kv_cache_attend(&ot, &qt, c, NULL, NULL);
        if (st) rc = cli_fail("bench", st);
        else if (i >= o->warmup) {
            const int64_t k = i - o->warmup;
            times[k] = (cli_now() - t0) * 1e3;
            bws[k] = bench_bw_pass(bwb, &bww[k]);
            fr[k] = bws[k] > 0 ? bytes / (times[k] * 1e-3) * 1e-9 / bws[k] : 0.0;
        }
    }
    const bench_probe bp = bench_bw_probe(bwb);  // the buffer's rounds of every read kernel
    bench_bw_free(bwb);
    if (!rc) {
        qsort(times, (size_t)o->repeat, sizeof *times, cli_cmp_double);
        qsort(bws, (size_t)o->repeat, sizeof *bws, cli_cmp_double);
        qsort(fr, (size_t)o->repeat, sizeof *fr, cli_cmp_double);
        qsort(bww, (size_t)o->repeat, sizeof *bww, cli_cmp_double);
        const int64_t n = o->repeat;
        const double med = median_sorted(times, n);
        const double bw = median_sorted(bws, n), gbs = bytes / (med * 1e-3) * 1e-9,
                     bw_wall = median_sorted(bww, n);
        // the fractions as reported: each never above 1 silently
        double raw, best_raw, pieces_raw;
        bool dist, best_dist, pieces_dist;
        const double frac = frac_capped(median_sorted(fr, n), 1.0, &raw, &dist);
        const double best_frac = frac_capped(gbs, bp.best, &best_raw, &best_dist);
        // scattered blocks: the same memory read as pieces of a head's
        // block of K rows (head-major; block-major: a block's K rows of
        // every head; int8 / int4: their scales in the rows), in a random
        // order (the layout's ceiling)
        const bool bm = mha_paged_cache_layout(pc) == MHA_PAGED_BLOCK_MAJOR;
        const size_t piece = pc ? mha_paged_cache_block_bytes(pc) / (size_t)(bm ? 2 : 2 * Hkv)
                                : 0;
        const double pbw = pc && !o->contiguous_pool
                               ? read_bandwidth_pieces(threads, bandwidth_bytes(bytes), piece,
                                                       o->seed + 1)
                               : 0.0;
        const double pieces_frac = frac_capped(gbs, pbw, &pieces_raw, &pieces_dist);
        const char *kv_name = mha_kv_dtype_name(o->kv_dtype);
        char what[96];  // the storage type and, paged, the blocks
        if (pc)
            snprintf(what, sizeof what, "%s; blocks of %lld, %s, %s", kv_name,
                     (long long)o->block, o->contiguous_pool ? "in order" : "scattered",
                     mha_paged_layout_name(o->layout));
        else snprintf(what, sizeof what, "%s", kv_name);
        if (o->json)
            printf("{\"what\": \"mha\", \"decode\": true, \"threads\": %d, \"isa\": \"%s\", "
                   "\"batch\": %lld, \"num_heads\": %lld, \"num_kv_heads\": %lld, "
                   "\"head_dim\": %lld, \"queries\": %lld, \"kv_len\": %lld, "
                   "\"kv_dtype\": \"%s\", \"block_size\": %lld, \"pool_layout\": \"%s\", "
                   "\"repeat\": %lld, "
                   "\"median_ms\": %.4f, "
                   "\"min_ms\": %.4f, \"max_ms\": %.4f, \"kv_bytes\": %.6g, "
                   "\"kv_gbps\": %.3f, \"read_bandwidth_gbps\": %.3f, "
                   "\"read_bandwidth_wall_gbps\": %.3f, "
                   "\"bandwidth_fraction\": %.4f, \"bandwidth_fraction_raw\": %.4f, "
                   "\"bandwidth_probe_disturbed\": %s, \"bandwidth_kernel\": \"%s\", "
                   "\"bandwidth_best_gbps\": %.3f, \"bandwidth_best_fraction\": %.4f, "
                   "\"bandwidth_best_fraction_raw\": %.4f, \"bandwidth_trials\": %d, "
                   "\"bandwidth_settled\": %s, \"bandwidth_buffer_mib\": %.1f, "
                   "\"bandwidth_hugepage_mib\": %.1f, \"piece_bytes\": %zu, "
                   "\"random_pieces_gbps\": %.3f, \"random_pieces_fraction\": %.4f, "
                   "\"random_pieces_fraction_raw\": %.4f, \"max_rss_mib\": %.1f}\n",
                   threads, mha_isa(), (long long)B, (long long)H, (long long)Hkv,
                   (long long)d, (long long)T, (long long)N, kv_name, (long long)o->block,
                   pc ? mha_paged_layout_name(o->layout) : "", (long long)o->repeat, med,
                   times[0], times[n - 1], bytes, gbs, bw, bw_wall, frac, raw,
                   dist || best_dist || pieces_dist ? "true" : "false",
                   bp.kernel ? bp.kernel : "", bp.best, best_frac, best_raw, bp.trials,
                   bp.settled ? "true" : "false", bp.buffer_mib, bp.huge_mib,
                   pbw > 0 ? piece : 0, pbw, pieces_frac, pieces_raw, max_rss_mib());
        else {
            char ft[64], bft[64], pt[96];
            printf("mha bench: decode step (%s), %d thread%s, kernels %s\n"
                   "  shape      batch %lld, %lld query head%s x %lld quer%s, %lld KV head%s, "
                   "d %lld, %lld cached tokens (%s)\n"
                   "  time       median %.3f ms (min %.3f, max %.3f; %lld runs)\n"
                   "  reads      K and V: %.1f MiB per step = %.1f GB/s; %s of the read "
                   "bandwidth (the median over the steps of each step's\n"
                   "             against a pass of the best read kernel right after it; "
                   "median %.1f GB/s on the threads' CPU time, %.1f on the wall clock%s, %d "
                   "thread%s)\n",
                   pc ? "mha_paged_cache_attend" : "mha_kv_cache_attend", threads,
                   threads == 1 ? "" : "s", mha_isa(), (long long)B, (long long)H,
                   H == 1 ? "" : "s", (long long)T, T == 1 ? "y" : "ies", (long long)Hkv,
                   Hkv == 1 ? "" : "s", (long long)d, (long long)N, what, med, times[0],
                   times[n - 1], (long long)o->repeat, bytes / 1048576.0, gbs,
                   frac_text(ft, sizeof ft, raw), bw, bw_wall,
                   bw_wall < 0.9 * bw ? ": the CPUs shared with other work" : "", threads,
                   threads == 1 ? "" : "s");
            frac_warn(raw, "read bandwidth at its step");
            printf("  bandwidth  best read kernel %s: %.1f GB/s (%s; each thread's bytes on "
                   "its CPU time; a %.0f MiB buffer, %.0f MiB of it on huge pages%s); the "
                   "step reads %s of that\n",
                   bp.kernel ? bp.kernel : "none", bp.best, probe_text(pt, sizeof pt, &bp),
                   bp.buffer_mib, bp.huge_mib > 0 ? bp.huge_mib : 0.0,
                   bp.huge_mib < 0 ? " (unknown)" : "", frac_text(bft, sizeof bft, best_raw));
            frac_warn(best_raw, "best read bandwidth");
            if (pbw > 0) {
                printf("  pieces     the same bytes read as random %zu-byte pieces (%s "
                       "block of K rows; the\n"
                       "             pool's blocks scattered): %.1f GB/s here; the step reads "
                       "%s of that\n",
                       piece, bm ? "a" : "a head's", pbw, frac_text(pt, sizeof pt, pieces_raw));
                frac_warn(pieces_raw, "random-pieces bandwidth");
            }
            printf("  memory     process max RSS %.1f MiB\n", max_rss_mib());
        }
    }
    free(q);
    free(out);
    free(times);
    free(bws);
    free(ids);
    mha_kv_cache_destroy(c);
    mha_paged_cache_destroy(pc);
    return rc;
}

// mha bench --decode --module: one module decode step (mha_forward_cached,
// projections included) of T = --seq new tokens per sequence over a cache
// holding --kv-len N tokens; the cache is cut back to N after every step
// (untimed), so each step sees the same context. What a step must read:
// every parameter in its storage dtype (the weights dominate) and the K and
// V of the N + T cached tokens.
static int bench_decode_module(const bench_opts *o, int threads) {
    const int64_t B = o->B, E = o->E, H = o->H, Hkv = o->kv_heads, d = E / H, N = o->kv_len,
                  T = o->L;
    mha_config cfg;
    mha_config_init(&cfg, E, H);
    cfg.num_kv_heads = Hkv;
    cfg.weight_dtype = o->wdtype;
    cfg.head_gate = o->gate;
    mha_module *m = NULL;
    mha_kv_cache *c = NULL;
    mha_init_options io;
    mha_init_options_init(&io);
    io.seed = o->seed;
    mha_status st = mha_module_create(&m, &cfg);
    if (!st) st = mha_module_init(m, &io);
    if (!st && o->prune) {  // the last --prune-heads heads
        int64_t *heads = malloc(sizeof(int64_t) * (size_t)o->prune);
        if (!heads) {
            mha_module_destroy(m);
            fprintf(stderr, "mha bench: out of memory\n");
            return 1;
        }
        for (int64_t i = 0; i < o->prune; i++) heads[i] = H - o->prune + i;
        st = mha_module_prune_heads(m, heads, o->prune);
        free(heads);
    }
    if (!st) st = mha_kv_cache_create(&c, B, Hkv, d, d, N + T, o->kv_dtype);
    if (st) {
        mha_module_destroy(m);
        return cli_fail("bench", st);
    }
    float *x, *y;
    double *times;
    int rc = decode_setup(o, c, NULL, NULL, B, Hkv, d, N, T * B * E, &x, &y, &times);
    double wbytes = 0;  // every parameter in its storage dtype
    for (int i = 0; !rc && i < mha_module_num_params(m); i++) {
        mha_param p;  // (before the warm-up: handing out p marks the packed weights stale)
        if ((st = mha_module_param_at(&p, m, i))) rc = cli_fail("bench", st);
        else wbytes += (double)p.numel * (double)mha_dtype_size(p.dtype);
    }
    mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 3, (int64_t[]){T, B, E});
    mha_tensor yt = mha_tensor_contiguous(y, MHA_F32, 3, (int64_t[]){T, B, E});
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = a.key = a.value = &xt;
    for (int64_t i = 0; !rc && i < o->warmup + o->repeat; i++) {
        const double t0 = cli_now();
        if ((st = mha_forward_cached(&yt, m, &a, c))) rc = cli_fail("bench", st);
        const double ms = (cli_now() - t0) * 1e3;
        if (!rc && i >= o->warmup) times[i - o->warmup] = ms;
        if (!rc && (st = mha_kv_cache_truncate(c, -1, N))) rc = cli_fail("bench", st);
    }
    if (!rc) {
        qsort(times, (size_t)o->repeat, sizeof *times, cli_cmp_double);
        const int64_t n = o->repeat;
        const double med = median_sorted(times, n);
        const double kvbytes = (double)mha_kv_cache_bytes(c);  // N + T rows: all in use
        const double bytes = wbytes + kvbytes, gbs = bytes / (med * 1e-3) * 1e-9;
        const bench_probe bp = bandwidth_over(threads, bytes);
        const double bw = bp.best;
        double raw;
        bool dist;
        const double frac = frac_capped(gbs, bw, &raw, &dist);
        const char *kv_name = mha_kv_dtype_name(o->kv_dtype);
        if (o->json)
            printf("{\"what\": \"mha\", \"decode\": true, \"module\": true, \"threads\": %d, "
                   "\"isa\": \"%s\", \"batch\": %lld, \"embed_dim\": %lld, "
                   "\"num_heads\": %lld, \"num_kv_heads\": %lld, \"head_dim\": %lld, "
                   "\"tokens\": %lld, \"kv_len\": %lld, \"weight_dtype\": \"%s\", "
                   "\"kv_dtype\": \"%s\", \"head_gate\": \"%s\", \"pruned\": %lld, "
                   "\"repeat\": %lld, \"median_ms\": %.4f, \"min_ms\": %.4f, "
                   "\"max_ms\": %.4f, \"ms_per_token\": %.4f, \"weight_bytes\": %.6g, "
                   "\"kv_bytes\": %.6g, \"bytes_per_token\": %.6g, \"gbps\": %.3f, "
                   "\"read_bandwidth_gbps\": %.3f, \"read_bandwidth_wall_gbps\": %.3f, "
                   "\"bandwidth_fraction\": %.4f, "
                   "\"bandwidth_fraction_raw\": %.4f, \"bandwidth_probe_disturbed\": %s, "
                   "\"bandwidth_kernel\": \"%s\", \"bandwidth_trials\": %d, "
                   "\"bandwidth_settled\": %s, \"max_rss_mib\": %.1f}\n",
                   threads, mha_isa(), (long long)B, (long long)E, (long long)H, (long long)Hkv,
                   (long long)d, (long long)T, (long long)N, dtype_label(o->wdtype), kv_name,
                   mha_head_gate_name(o->gate), (long long)o->prune, (long long)o->repeat, med,
                   times[0], times[n - 1], med / (double)(B * T), wbytes, kvbytes,
                   bytes / (double)(B * T), gbs, bw, bp.best_wall, frac, raw,
                   dist ? "true" : "false", bp.kernel ? bp.kernel : "", bp.trials,
                   bp.settled ? "true" : "false", max_rss_mib());
        else {
            char ft[64], pt[96];
            printf("mha bench: module decode step (mha_forward_cached), %d thread%s, kernels "
                   "%s\n"
                   "  shape      batch %lld x %lld new token%s, E %lld, %lld head%s (%lld KV), "
                   "d %lld, %lld cached tokens, weights %s, cache %s\n"
                   "  time       median %.3f ms (min %.3f, max %.3f; %lld runs) = %.3f ms per "
                   "token\n"
                   "  reads      weights %.2f MiB + K and V %.2f MiB = %.2f MiB per step "
                   "(%.2f MiB per token)\n"
                   "             = %.1f GB/s = %s of the read bandwidth %.1f GB/s measured "
                   "here (%d thread%s; best read kernel %s, %s)\n",
                   threads, threads == 1 ? "" : "s", mha_isa(), (long long)B, (long long)T,
                   T == 1 ? "" : "s", (long long)E, (long long)H, H == 1 ? "" : "s",
                   (long long)Hkv, (long long)d, (long long)N, dtype_label(o->wdtype), kv_name,
                   med, times[0], times[n - 1], (long long)o->repeat, med / (double)(B * T),
                   wbytes / 1048576.0, kvbytes / 1048576.0, bytes / 1048576.0,
                   bytes / (double)(B * T) / 1048576.0, gbs, frac_text(ft, sizeof ft, raw), bw,
                   threads, threads == 1 ? "" : "s", bp.kernel ? bp.kernel : "none",
                   probe_text(pt, sizeof pt, &bp));
            frac_warn(raw, "read bandwidth (a step's bytes that stay in the caches read "
                           "faster than memory)");
            printf("  memory     process max RSS %.1f MiB\n", max_rss_mib());
        }
    }
    free(x);
    free(y);
    free(times);
    mha_kv_cache_destroy(c);
    mha_module_destroy(m);
    return rc;
}

int cmd_bench(int argc, char **argv) {
    bench_opts o;
    int rc = bench_parse(&o, argc, argv);
    if (rc >= 0) return rc;
    // Before any library call: the kernel table is chosen once per process.
    if (o.isa && setenv("MHA_ISA", o.isa, 1)) {
        fprintf(stderr, "mha bench: cannot set MHA_ISA\n");
        return 1;
    }
    if (o.parallel && o.module)
        return bench_usage("--module times one process (no --parallel)");
    if (o.parallel) {
        const bool kv = !strcmp(o.parallel, "kv");
        if (kv != o.decode)
            return bench_usage("--parallel kv goes with --decode (a decode step over a sharded "
                               "KV cache), and --decode with --parallel kv only");
        if (o.core || (!kv && o.S != o.L) || o.prune || o.gate || o.workspace)
            return bench_usage("--parallel times the module's self-attention (no --core, "
                               "--kv-seq, --prune-heads, --head-gate, --workspace)");
#ifdef _OPENMP
        if (o.threads) omp_set_num_threads(o.threads);
#endif
        return bench_parallel(o.parallel, o.B, o.L, o.E, o.H, o.kv_heads ? o.kv_heads : o.H,
                              o.causal, o.backward, o.repeat, o.warmup, o.seed, o.json,
                              kv ? o.kv_len : 0);
    }
    bench_result r;
    memset(&r, 0, sizeof r);
    r.threads = 1;
#ifdef _OPENMP
    if (o.threads) omp_set_num_threads(o.threads);
    r.threads = omp_get_max_threads();
#else
    if (o.threads > 1)
        fprintf(stderr, "mha bench: built without OpenMP: --threads %d ignored, 1 thread\n",
                o.threads);
#endif
    r.isa = mha_isa();
    if (o.serve) {
        const bench_serve_opts so = {o.sequences, o.L,        o.gen,   o.E,
                                     o.H,         o.kv_heads, o.block, o.kv_dtype,
                                     o.layout,    o.seed,     o.json,  r.threads};
        return bench_serve(&so);
    }
    if (o.decode)
        return o.module ? bench_decode_module(&o, r.threads) : bench_decode(&o, r.threads);

    // Which implementation runs (and whether the library accepts it).
    char why[512] = "";
    rc = probe_impl(&o, why, sizeof why);
    if (rc == 3) {
        fprintf(stderr, "mha bench: %s--impl %s is not supported here: %s\n",
                o.core ? "--core " : "", mha_impl_name(o.impl), why);
        return 1;
    }
    if (rc) return rc;

    // bf16 inputs: held against the bf16 dot peak where the CPU has one
    const bool bf = o.dtype == MHA_BF16;
    r.peak = bf ? peak_probe_bf16(r.threads) : (bench_probe){0};
    r.peak_bf16 = r.peak.kernel != NULL;
    if (!r.peak_bf16) r.peak = peak_probe(r.threads);
    r.peak_probes = 1;

    bench_bufs bb = {0};
    problem p;
    rc = problem_setup(&p, &bb, &o, o.impl);
    double *times = rc ? NULL : malloc((size_t)o.repeat * sizeof *times);
    if (!rc && !times) {
        fprintf(stderr, "mha bench: out of memory\n");
        rc = 1;
    }
    r.rss_before = max_rss_mib();
    r.inputs_mib = bb.bytes / 1048576.0;
    mha_status st = MHA_OK;
    for (int64_t i = 0; !rc && !st && i < o.warmup; i++) st = problem_run(&p);
    for (int64_t i = 0; !rc && !st && i < o.repeat; i++) {
        double t0 = cli_now();
        st = problem_run(&p);
        times[i] = (cli_now() - t0) * 1e3;
    }
    if (!rc && st) rc = cli_fail("bench", st);
    if (!rc) {
        snprintf(r.fwd_ran, sizeof r.fwd_ran, "%s", p.fwd_ran);
        snprintf(r.bwd_ran, sizeof r.bwd_ran, "%s", o.backward ? p.bwd_ran : "none");
        r.rss_max = max_rss_mib();
        qsort(times, (size_t)o.repeat, sizeof *times, cli_cmp_double);
        int64_t n = o.repeat;
        r.median = median_sorted(times, n);
        r.min = times[0];
        r.max = times[n - 1];
        const double B = (double)o.B, L = (double)o.L, S = (double)o.S, E = (double)o.E;
        r.flops = o.core ? 4 * B * L * S * E
                         : 4 * B * L * E * E + 4 * B * S * E * E + 4 * B * L * S * E;
        if (o.backward) r.flops *= 3;
        // visible (i, j) pairs under causal / window
        double vis = 0;
        for (int64_t i = 0; i < o.L; i++) {
            int64_t lo = 0, hi = o.S;
            if (o.window && i - o.window > lo) lo = i - o.window;
            if (o.causal && i + 1 < hi) hi = i + 1;
            if (o.window && i + o.window + 1 < hi) hi = i + o.window + 1;
            if (hi > lo) vis += (double)(hi - lo);
        }
        r.visible = o.L && o.S ? vis / ((double)o.L * (double)o.S) : 0;
        r.gflops = r.median > 0 ? r.flops / (r.median * 1e-3) * 1e-9 : 0;
        if (r.gflops > r.peak.best) {  // the probe was disturbed: once more, the better
            const bench_probe again = r.peak_bf16 ? peak_probe_bf16(r.threads)
                                                  : peak_probe(r.threads);
            r.peak_probes = 2;
            const int trials = r.peak.trials + again.trials;
            const double wall = r.peak.best_wall;
            if (again.best > r.peak.best) r.peak = again;
            r.peak.trials = trials;
            if (wall > r.peak.best_wall) r.peak.best_wall = wall;
        }
        if (o.json) print_json(&o, &r);
        else print_text(&o, &r);
    }
    free(times);
    problem_free(&p);
    bench_free(&bb);
    return rc;
}
