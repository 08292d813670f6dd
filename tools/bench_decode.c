// bench_decode.c: `mha bench --decode`, one decode step timed: the
// attention of --seq new queries per head over a KV cache of --kv-len
// tokens (mha_kv_cache_attend; with --block-size a paged cache,
// mha_paged_cache_attend, its pool scattered as a busy server's or in
// order), each step held against a pass of the best read kernel right
// after it (the machine's memory is shared: its bandwidth moves with the
// neighbours'); and `--decode --module`, the module's decode step
// (mha_forward_cached, projections included) against the bytes it must
// read. The probes: bench_peak.c; the report: bench_report.c.
#include <stdio.h>
#include <stdlib.h>

#include "bench.h"
#include "cli.h"

// The bytes of a bandwidth buffer for a step that reads `bytes`: twice
// those (at least 512 MiB: beyond the caches).
static size_t bandwidth_bytes(double bytes) {
    return (size_t)(bytes * 2 > 512.0 * 1048576 ? bytes * 2 : 512.0 * 1048576);
}

// The read bandwidth on these threads, over a buffer of bandwidth_bytes.
static bench_probe bandwidth_over(int threads, double bytes) {
    return bandwidth_probe(threads, bandwidth_bytes(bytes));
}

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
// printing why (the buffers, NULL or not, are still freed by the caller).
static int decode_setup(const bench_opts *o, mha_kv_cache *c, mha_paged_cache *pc,
                        const int64_t *ids, int64_t B, int64_t Hkv, int64_t d, int64_t N,
                        int64_t nin, float **in, float **out, double **times) {
    uint64_t rng = o->seed * 0x9e3779b97f4a7c15ull + 7;
    *in = *out = NULL;
    *times = NULL;
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

// ---------------------------------------------------------------------------
// mha bench --decode: one step of cached attention.

// A decode bench's cache: contiguous (c) or, with --block-size, paged (pc:
// B sequences ids; scattered, a pool of twice the nblk blocks the cache
// needs, half of them held by others).
typedef struct decode_cache {
    mha_kv_cache *c;
    mha_paged_cache *pc;
    int64_t *ids;
    int64_t nblk;
} decode_cache;

static void decode_cache_free(decode_cache *dc) {
    mha_kv_cache_destroy(dc->c);
    mha_paged_cache_destroy(dc->pc);
    free(dc->ids);
}

// Creates o's cache (empty). 0, or 1 after printing (nothing left to free).
static int decode_cache_create(decode_cache *dc, const bench_opts *o) {
    const int64_t B = o->B, Hkv = o->kv_heads, d = o->E / o->H, N = o->kv_len;
    *dc = (decode_cache){0};
    dc->ids = o->block ? calloc((size_t)B, sizeof *dc->ids) : NULL;
    if (o->block && !dc->ids) return cli_fail("bench", MHA_ERR_NOMEM);
    dc->nblk = o->block ? B * ((N + o->block - 1) / o->block) : 0;
    mha_status st = o->block
                        ? mha_paged_cache_create(&dc->pc,
                                                 o->contiguous_pool ? dc->nblk : 2 * dc->nblk,
                                                 o->block, Hkv, d, d, o->kv_dtype, o->layout)
                        : mha_kv_cache_create(&dc->c, B, Hkv, d, d, N, o->kv_dtype);
    for (int64_t b = 0; !st && dc->pc && b < B; b++)
        st = mha_paged_cache_add(dc->pc, &dc->ids[b]);
    if (st) {
        decode_cache_free(dc);
        return cli_fail("bench", st);
    }
    return 0;
}

// One attention step over the cache: out (B, H, T, d) from q.
static mha_status decode_step(mha_tensor *ot, const mha_tensor *qt, const decode_cache *dc,
                              int64_t B) {
    return dc->pc ? mha_paged_cache_attend(ot, qt, dc->pc, B, dc->ids, NULL, NULL)
                  : mha_kv_cache_attend(ot, qt, dc->c, NULL, NULL);
}

// o->warmup untimed steps, then o->repeat timed ones, each followed by a
// pass of the read bandwidth (bwb): times (ms), bws and bww (the pass in
// GB/s on the threads' CPU time and on the wall clock) and fr (the step's
// rate over its pass's). 0, or 1 after printing.
static int decode_time(const bench_opts *o, mha_tensor *ot, const mha_tensor *qt,
                       const decode_cache *dc, bench_bw *bwb, double bytes, double *times,
                       double *bws, double *bww, double *fr) {
    for (int64_t i = 0; i < o->warmup + o->repeat; i++) {
        double t0 = cli_now();
        mha_status st = decode_step(ot, qt, dc, o->B);
        if (st) return cli_fail("bench", st);
        if (i >= o->warmup) {
            const int64_t k = i - o->warmup;
            times[k] = (cli_now() - t0) * 1e3;
            bws[k] = bench_bw_pass(bwb, &bww[k]);
            fr[k] = bws[k] > 0 ? bytes / (times[k] * 1e-3) * 1e-9 / bws[k] : 0.0;
        }
    }
    return 0;
}

// The steps' medians (the arrays sorted here) and fractions against the
// bandwidth: each step's pass, the best read kernel's (bp) and, for a
// scattered pool, random pieces of a block's K rows (probed here).
static void decode_result(bench_decode_result *r, const bench_opts *o, const decode_cache *dc,
                          double *times, double *bws, double *bww, double *fr) {
    const mha_paged_cache *pc = dc->pc;
    qsort(times, (size_t)o->repeat, sizeof *times, cli_cmp_double);
    qsort(bws, (size_t)o->repeat, sizeof *bws, cli_cmp_double);
    qsort(fr, (size_t)o->repeat, sizeof *fr, cli_cmp_double);
    qsort(bww, (size_t)o->repeat, sizeof *bww, cli_cmp_double);
    const int64_t n = o->repeat;
    r->median = bench_median_sorted(times, n);
    r->min = times[0];
    r->max = times[n - 1];
    r->bw = bench_median_sorted(bws, n);
    r->gbs = r->bytes / (r->median * 1e-3) * 1e-9;
    r->bw_wall = bench_median_sorted(bww, n);
    // the fractions as reported: each never above 1 silently
    r->frac = bench_frac_capped(bench_median_sorted(fr, n), 1.0, &r->raw, &r->dist);
    r->best_frac = bench_frac_capped(r->gbs, r->bp.best, &r->best_raw, &r->best_dist);
    // scattered blocks: the same memory read as pieces of a head's
    // block of K rows (head-major; block-major: a block's K rows of
    // every head; int8 / int4: their scales in the rows), in a random
    // order (the layout's ceiling)
    r->paged = pc != NULL;
    r->block_major = mha_paged_cache_layout(pc) == MHA_PAGED_BLOCK_MAJOR;
    r->piece = pc ? mha_paged_cache_block_bytes(pc) /
                        (size_t)(r->block_major ? 2 : 2 * o->kv_heads)
                  : 0;
    r->pbw = pc && !o->contiguous_pool
                 ? read_bandwidth_pieces(r->threads, bandwidth_bytes(r->bytes), r->piece,
                                         o->seed + 1)
                 : 0.0;
    r->pieces_frac = bench_frac_capped(r->gbs, r->pbw, &r->pieces_raw, &r->pieces_dist);
    const char *kv_name = mha_kv_dtype_name(o->kv_dtype);
    if (pc)
        snprintf(r->what, sizeof r->what, "%s; blocks of %lld, %s, %s", kv_name,
                 (long long)o->block, o->contiguous_pool ? "in order" : "scattered",
                 mha_paged_layout_name(o->layout));
    else snprintf(r->what, sizeof r->what, "%s", kv_name);
}

int bench_decode(const bench_opts *o, int threads) {
    const int64_t B = o->B, H = o->H, Hkv = o->kv_heads, d = o->E / o->H, N = o->kv_len,
                  T = o->L;
    decode_cache dc;
    if (decode_cache_create(&dc, o)) return 1;
    float *q, *out;
    double *times;
    int rc = decode_setup(o, dc.c, dc.pc, dc.ids, B, Hkv, d, N, B * H * T * d, &q, &out, &times);
    mha_tensor qt = mha_tensor_contiguous(q, MHA_F32, 4, (int64_t[]){B, H, T, d});
    mha_tensor ot = mha_tensor_contiguous(out, MHA_F32, 4, (int64_t[]){B, H, T, d});
    bench_decode_result r = {.threads = threads};
    r.bytes =  // all N rows are in use
        rc      ? 0.0
        : dc.pc ? (double)dc.nblk * (double)mha_paged_cache_block_bytes(dc.pc)
                : (double)mha_kv_cache_bytes(dc.c);
    // after every timed step, one pass of the read bandwidth over twice its
    // bytes (at least 512 MiB: beyond the caches): each step's fraction
    // against the bandwidth of the same moment (the machine's memory is
    // shared, its bandwidth moves with the neighbours')
    bench_bw *bwb = rc ? NULL : bench_bw_create(threads, bandwidth_bytes(r.bytes));
    double *bws = malloc(sizeof(double) * (size_t)(3 * o->repeat)), *fr = bws + o->repeat,
           *bww = fr + o->repeat;  // the passes on the threads' CPU time, on the wall clock
    if (!rc && (!bwb || !bws)) {
        fprintf(stderr, "mha bench: out of memory for the bandwidth buffer\n");
        rc = 1;
    }
    if (!rc) rc = decode_time(o, &ot, &qt, &dc, bwb, r.bytes, times, bws, bww, fr);
    r.bp = bench_bw_probe(bwb);  // the buffer's rounds of every read kernel
    bench_bw_free(bwb);
    if (!rc) {
        decode_result(&r, o, &dc, times, bws, bww, fr);
        bench_print_decode(o, &r);
    }
    free(q);
    free(out);
    free(times);
    free(bws);
    decode_cache_free(&dc);
    return rc;
}

// ---------------------------------------------------------------------------
// mha bench --decode --module: one module decode step (mha_forward_cached,
// projections included) of T = --seq new tokens per sequence over a cache
// holding --kv-len N tokens; the cache is cut back to N after every step
// (untimed), so each step sees the same context. What a step must read:
// every parameter in its storage dtype (the weights dominate) and the K and
// V of the N + T cached tokens.

// The module (--weight-dtype, --head-gate, --num-kv-heads; its last
// --prune-heads heads pruned) and its cache (room for N + T tokens). 0, or
// 1 after printing (nothing left to free).
static int decode_module_create(const bench_opts *o, mha_module **m, mha_kv_cache **c) {
    const int64_t B = o->B, E = o->E, H = o->H, Hkv = o->kv_heads, d = E / H;
    mha_config cfg;
    mha_config_init(&cfg, E, H);
    cfg.num_kv_heads = Hkv;
    cfg.weight_dtype = o->wdtype;
    cfg.head_gate = o->gate;
    *m = NULL;
    *c = NULL;
    mha_init_options io;
    mha_init_options_init(&io);
    io.seed = o->seed;
    mha_status st = mha_module_create(m, &cfg);
    if (!st) st = mha_module_init(*m, &io);
    if (!st && o->prune) {  // the last --prune-heads heads
        int64_t *heads = malloc(sizeof(int64_t) * (size_t)o->prune);
        if (!heads) {
            mha_module_destroy(*m);
            fprintf(stderr, "mha bench: out of memory\n");
            return 1;
        }
        for (int64_t i = 0; i < o->prune; i++) heads[i] = H - o->prune + i;
        st = mha_module_prune_heads(*m, heads, o->prune);
        free(heads);
    }
    if (!st) st = mha_kv_cache_create(c, B, Hkv, d, d, o->kv_len + o->L, o->kv_dtype);
    if (st) {
        mha_module_destroy(*m);
        return cli_fail("bench", st);
    }
    return 0;
}

// Every parameter's bytes in its storage dtype (*wbytes). 0, or 1 after
// printing.
static int weight_bytes(const mha_module *m, double *wbytes) {
    mha_status st;
    *wbytes = 0;
    for (int i = 0; i < mha_module_num_params(m); i++) {
        mha_param p;  // (before the warm-up: handing out p marks the packed weights stale)
        if ((st = mha_module_param_at(&p, m, i))) return cli_fail("bench", st);
        *wbytes += (double)p.numel * (double)mha_dtype_size(p.dtype);
    }
    return 0;
}

int bench_decode_module(const bench_opts *o, int threads) {
    const int64_t B = o->B, E = o->E, H = o->H, Hkv = o->kv_heads, d = E / H, N = o->kv_len,
                  T = o->L;
    mha_module *m;
    mha_kv_cache *c;
    if (decode_module_create(o, &m, &c)) return 1;
    float *x, *y;
    double *times;
    mha_status st;
    int rc = decode_setup(o, c, NULL, NULL, B, Hkv, d, N, T * B * E, &x, &y, &times);
    bench_decode_result r = {.threads = threads};
    if (!rc) rc = weight_bytes(m, &r.wbytes);
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
        r.median = bench_median_sorted(times, n);
        r.min = times[0];
        r.max = times[n - 1];
        r.kvbytes = (double)mha_kv_cache_bytes(c);  // N + T rows: all in use
        r.bytes = r.wbytes + r.kvbytes;
        r.gbs = r.bytes / (r.median * 1e-3) * 1e-9;
        r.bp = bandwidth_over(threads, r.bytes);
        r.bw = r.bp.best;
        r.frac = bench_frac_capped(r.gbs, r.bw, &r.raw, &r.dist);
        bench_print_decode_module(o, &r);
    }
    free(x);
    free(y);
    free(times);
    mha_kv_cache_destroy(c);
    mha_module_destroy(m);
    return rc;
}
