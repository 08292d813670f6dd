// bench_module.c: `mha bench` without --decode or --serve: the timing of
// the module's forward (projections included; + mha_backward with
// --backward) or, with --core, of the attention core alone (mha_sdpa on
// projected (B, H, L, d) tensors; + mha_sdpa_backward), on this machine,
// with:
//  - the median, min and max of --repeat runs after --warmup runs;
//  - GFLOP/s under a stated dense count (causal counts as dense);
//  - the fraction of this machine's fp32 FMA peak (or, --dtype bf16, its
//    bf16 dot peak), measured in the same process on the same threads
//    (bench_peak.c) before the runs and, when the runs beat it, once more
//    after them;
//  - the process's peak memory (max RSS).
// It also says which implementation actually ran: a tiny probe first tells
// whether the library takes the requested one (MHA_ERR_UNSUPPORTED), and
// the runs read what ran off mha_last_impl().
//
// What it deliberately does not do: print (bench_report.c does) or read
// the options (bench.c).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "cli.h"

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

// The core problem's tensors, every one in --dtype: q (B, H, L, d), k and v
// (B, H, S, d), out; with --backward dout and dq, dk, dv. 0, or 1 after
// printing.
static int setup_core(problem *p, bench_bufs *bb, const bench_opts *o, mha_impl impl,
                      uint64_t *rng) {
    const int64_t B = o->B, L = o->L, S = o->S, E = o->E, H = o->H, d = E / H;
    mha_status st;
    int64_t qs[4] = {B, H, L, d}, ks[4] = {B, H, S, d};
    float *q = bench_alloc(bb, B * H * L * d), *k = bench_alloc(bb, B * H * S * d),
          *v = bench_alloc(bb, B * H * S * d), *out = bench_alloc(bb, B * H * L * d);
    if (!q || !k || !v || !out) return 1;
    bench_fill_uniform(q, B * H * L * d, rng);
    bench_fill_uniform(k, B * H * S * d, rng);
    bench_fill_uniform(v, B * H * S * d, rng);
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
        bench_fill_uniform(g, B * H * L * d, rng);
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

// The module: created in --weight-dtype with --head-gate's gates,
// initialised from --seed, its last --prune-heads heads pruned. 0, or 1
// after printing.
static int setup_module(problem *p, const bench_opts *o) {
    mha_config cfg;
    mha_config_init(&cfg, o->E, o->H);
    cfg.batch_first = true;
    cfg.weight_dtype = o->wdtype;
    cfg.head_gate = o->gate;
    mha_init_options io;
    mha_init_options_init(&io);
    io.seed = o->seed;
    mha_status st;
    if ((st = mha_module_create(&p->m, &cfg)) || (st = mha_module_init(p->m, &io)))
        return cli_fail("bench", st);
    if (o->prune) {
        int64_t *pr = malloc(sizeof(int64_t) * (size_t)o->prune);
        if (!pr) return cli_fail("bench", MHA_ERR_NOMEM);
        for (int64_t i = 0; i < o->prune; i++) pr[i] = o->H - o->prune + i;
        st = mha_module_prune_heads(p->m, pr, o->prune);
        free(pr);
        if (st) return cli_fail("bench", st);
    }
    return 0;
}

// The module forward's inputs in --dtype: query (B, L, E), key and value
// (B, S, E; the query itself when S == L), out (B, L, E); its arguments
// and, with --workspace, its scratch. 0, or 1 after printing.
static int setup_inputs(problem *p, bench_bufs *bb, const bench_opts *o, mha_impl impl,
                        uint64_t *rng) {
    const int64_t B = o->B, L = o->L, S = o->S, E = o->E;
    mha_status st;
    p->self = S == L;
    int64_t qs[3] = {B, L, E}, ks[3] = {B, S, E};
    float *q = bench_alloc(bb, B * L * E), *out = bench_alloc(bb, B * L * E);
    if (!q || !out) return 1;
    bench_fill_uniform(q, B * L * E, rng);
    to_dtype(q, B * L * E, o->dtype);
    p->q = mha_tensor_contiguous(q, o->dtype, 3, qs);
    p->out = mha_tensor_contiguous(out, o->dtype, 3, qs);
    if (p->self) {
        p->k = p->v = p->q;
    } else {
        float *k = bench_alloc(bb, B * S * E), *v = bench_alloc(bb, B * S * E);
        if (!k || !v) return 1;
        bench_fill_uniform(k, B * S * E, rng);
        bench_fill_uniform(v, B * S * E, rng);
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
    return 0;
}

// --backward of the module: dout (random), the input gradients, the
// parameters' gradients (a module of the same config) and, unless
// --no-save, the forward's saved state. 0, or 1 after printing.
static int setup_grads(problem *p, bench_bufs *bb, const bench_opts *o, uint64_t *rng) {
    const int64_t B = o->B, L = o->L, S = o->S, E = o->E;
    int64_t qs[3] = {B, L, E}, ks[3] = {B, S, E};
    mha_status st;
    float *g = bench_alloc(bb, B * L * E), *gq = bench_alloc(bb, B * L * E),
          *gk = bench_alloc(bb, B * S * E), *gv = bench_alloc(bb, B * S * E);
    if (!g || !gq || !gk || !gv) return 1;
    bench_fill_uniform(g, B * L * E, rng);
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
    return 0;
}

// Allocates and fills the tensors of a problem of the options' shape (o's
// fields B, L, S, E, H) with impl `impl`. Returns 0, or 1 after printing.
static int problem_setup(problem *p, bench_bufs *bb, const bench_opts *o, mha_impl impl) {
    memset(p, 0, sizeof *p);
    p->o = o;
    uint64_t rng = o->seed * 0x9e3779b97f4a7c15ull + 12345;
    if (o->core) return setup_core(p, bb, o, impl, &rng);
    int rc = setup_module(p, o);
    if (!rc) rc = setup_inputs(p, bb, o, impl, &rng);
    if (!rc && o->backward) rc = setup_grads(p, bb, o, &rng);
    return rc;
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
             ? mha_sdpa_backward(&p->gq, &p->gk, &p->gv, NULL, &p->gout, &p->sa)
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
// The benchmark

// o->warmup untimed runs, then o->repeat timed ones (ms in times). 0, or 1
// after printing.
static int problem_time(problem *p, const bench_opts *o, double *times) {
    mha_status st = MHA_OK;
    for (int64_t i = 0; !st && i < o->warmup; i++) st = problem_run(p);
    for (int64_t i = 0; !st && i < o->repeat; i++) {
        double t0 = cli_now();
        st = problem_run(p);
        times[i] = (cli_now() - t0) * 1e3;
    }
    return st ? cli_fail("bench", st) : 0;
}

// The fraction of the (i, j) score pairs that causal / window leave
// visible.
static double visible_fraction(const bench_opts *o) {
    double vis = 0;
    for (int64_t i = 0; i < o->L; i++) {
        int64_t lo = 0, hi = o->S;
        if (o->window && i - o->window > lo) lo = i - o->window;
        if (o->causal && i + 1 < hi) hi = i + 1;
        if (o->window && i + o->window + 1 < hi) hi = i + o->window + 1;
        if (hi > lo) vis += (double)(hi - lo);
    }
    return o->L && o->S ? vis / ((double)o->L * (double)o->S) : 0;
}

// The runs' times (sorted here), the dense FLOP count and the rate.
static void result_times(bench_result *r, const bench_opts *o, double *times) {
    qsort(times, (size_t)o->repeat, sizeof *times, cli_cmp_double);
    int64_t n = o->repeat;
    r->median = bench_median_sorted(times, n);
    r->min = times[0];
    r->max = times[n - 1];
    const double B = (double)o->B, L = (double)o->L, S = (double)o->S, E = (double)o->E;
    r->flops = o->core ? 4 * B * L * S * E
                       : 4 * B * L * E * E + 4 * B * S * E * E + 4 * B * L * S * E;
    if (o->backward) r->flops *= 3;
    r->visible = visible_fraction(o);
    r->gflops = r->median > 0 ? r->flops / (r->median * 1e-3) * 1e-9 : 0;
}

// The rate above the peak: the probe was disturbed; once more, the
// better of the two kept (their trials counted together).
static void peak_again(bench_result *r) {
    const bench_probe again = r->peak_bf16 ? peak_probe_bf16(r->threads)
                                           : peak_probe(r->threads);
    r->peak_probes = 2;
    const int trials = r->peak.trials + again.trials;
    const double wall = r->peak.best_wall;
    if (again.best > r->peak.best) r->peak = again;
    r->peak.trials = trials;
    if (wall > r->peak.best_wall) r->peak.best_wall = wall;
}

int bench_module(const bench_opts *o, int threads, const char *isa) {
    bench_result r;
    memset(&r, 0, sizeof r);
    r.threads = threads;
    r.isa = isa;
    // Which implementation runs (and whether the library accepts it).
    char why[512] = "";
    int rc = probe_impl(o, why, sizeof why);
    if (rc == 3) {
        fprintf(stderr, "mha bench: %s--impl %s is not supported here: %s\n",
                o->core ? "--core " : "", mha_impl_name(o->impl), why);
        return 1;
    }
    if (rc) return rc;

    // bf16 inputs: held against the bf16 dot peak where the CPU has one
    const bool bf = o->dtype == MHA_BF16;
    r.peak = bf ? peak_probe_bf16(r.threads) : (bench_probe){0};
    r.peak_bf16 = r.peak.kernel != NULL;
    if (!r.peak_bf16) r.peak = peak_probe(r.threads);
    r.peak_probes = 1;

    bench_bufs bb = {0};
    problem p;
    rc = problem_setup(&p, &bb, o, o->impl);
    double *times = rc ? NULL : malloc((size_t)o->repeat * sizeof *times);
    if (!rc && !times) {
        fprintf(stderr, "mha bench: out of memory\n");
        rc = 1;
    }
    r.rss_before = bench_max_rss_mib();
    r.inputs_mib = bb.bytes / 1048576.0;
    if (!rc) rc = problem_time(&p, o, times);
    if (!rc) {
        snprintf(r.fwd_ran, sizeof r.fwd_ran, "%s", p.fwd_ran);
        snprintf(r.bwd_ran, sizeof r.bwd_ran, "%s", o->backward ? p.bwd_ran : "none");
        r.rss_max = bench_max_rss_mib();
        result_times(&r, o, times);
        if (r.gflops > r.peak.best) peak_again(&r);
        bench_print_module(o, &r);
    }
    free(times);
    problem_free(&p);
    bench_free(&bb);
    return rc;
}
