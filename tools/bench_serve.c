// bench_serve.c: `mha bench --serve`, a serving workload on the paged KV
// cache. One prompt of P tokens is prefilled once (mha_forward_paged in
// chunks of 512), forked into N sequences that share its blocks, and the N
// then decode together (continuous batching: one mha_forward_paged call per
// step for every sequence still running), each stopping at its own length
// (uniform in [G/4, G], seeded), freeing its blocks. Reported: prefill
// time, decode tokens/s, the step time against the bytes a step must read
// (the weights + every running sequence's K and V) over the read bandwidth
// measured in the same process, and the cache's peak memory against one
// contiguous cache per sequence.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "cli.h"
#include "mha.h"

// A serving run: the module, its paged cache and buffers, and what the run
// measured.
typedef struct serve_run {
    const bench_serve_opts *o;
    int64_t Hkv, d, nblocks;  // KV heads, head dim, the pool's blocks
    uint64_t rng;
    mha_module *m;
    mha_paged_cache *c;
    mha_forward_args a;
    int64_t *ids;   // (N) the sequences: ids[0] the prompt's, then its forks
    int64_t *stop;  // (N) each sequence's new tokens
    int64_t *live;  // (N) the sequences still running (nlive of them)
    int64_t nlive;
    float *x, *y;   // a step's (or a prefill chunk's) input and output rows
    double *steps;  // (G + 1) each decode step's time, ms
    // measured
    double prefill_ms, decode_s;
    int64_t after_fork;          // blocks in use after the forks
    int64_t tokens, peak, step;  // decoded tokens, peak blocks in use, steps
    // first_bytes: the first step's weights + every sequence's history;
    // first_distinct: the weights + the blocks in use, each once; worst: the
    // largest blocks / distinct tokens over the steps; at_peak: at the peak
    // of blocks
    double first_bytes, first_distinct, worst, at_peak;
    // reported: the full step's time, the read bandwidth and the step's
    // fraction of it (capped at 1: bw_disturbed), the pool's memory
    double full_ms, bw, bw_raw, bw_frac, blockb, contiguous;
    bool bw_disturbed;
} serve_run;

static void serve_free(serve_run *s) {
    free(s->ids), free(s->stop), free(s->live), free(s->x), free(s->y), free(s->steps);
    mha_paged_cache_destroy(s->c);
    mha_module_destroy(s->m);
}

// The module (RoPE, --num-kv-heads), its paged cache and the buffers. 0, or
// 1 after printing (serve_free frees what was made).
static int serve_create(serve_run *s, const bench_serve_opts *o) {
    const int64_t N = o->nseq, P = o->prompt, G = o->gen, E = o->E, H = o->H, bs = o->block;
    memset(s, 0, sizeof *s);
    s->o = o;
    s->Hkv = o->Hkv ? o->Hkv : H;
    s->d = E / H;
    s->rng = o->seed * 0x9e3779b97f4a7c15ull + 77;
    mha_config cfg;
    mha_config_init(&cfg, E, H);
    cfg.num_kv_heads = s->Hkv;
    cfg.batch_first = true;
    mha_init_options io;
    mha_init_options_init(&io);
    io.seed = o->seed;
    mha_status st;
    if ((st = mha_module_create(&s->m, &cfg)) || (st = mha_module_init(s->m, &io)))
        return cli_fail("bench --serve", st);
    // blocks: the prompt once, each sequence's own tokens (and a copy of the
    // prompt's last block), with room to spare
    s->nblocks = (P + bs - 1) / bs + N * ((G + bs - 1) / bs + 2) + 8;
    if ((st = mha_paged_cache_create(&s->c, s->nblocks, bs, s->Hkv, s->d, s->d, o->kv_dtype,
                                     o->layout)))
        return cli_fail("bench --serve", st);
    const int64_t chunk = P < 512 ? P : 512;
    s->ids = malloc(sizeof(int64_t) * (size_t)N);
    s->stop = malloc(sizeof(int64_t) * (size_t)N);
    s->live = malloc(sizeof(int64_t) * (size_t)N);
    s->x = malloc(sizeof(float) * (size_t)((chunk > N ? chunk : N) * E));
    s->y = malloc(sizeof(float) * (size_t)((chunk > N ? chunk : N) * E));
    s->steps = malloc(sizeof(double) * (size_t)(G + 1));
    if (!s->ids || !s->stop || !s->live || !s->x || !s->y || !s->steps) {
        fprintf(stderr, "mha bench --serve: out of memory\n");
        return 1;
    }
    mha_forward_args_init(&s->a);
    mha_rope_init(&s->a.rope, MHA_ROPE_NEOX);
    return 0;
}

// The prompt prefilled once (chunks of 512 random rows), forked into the N
// sequences, and each one's stop drawn.
static mha_status serve_prefill(serve_run *s) {
    const bench_serve_opts *o = s->o;
    const int64_t N = o->nseq, P = o->prompt, G = o->gen, E = o->E;
    const int64_t chunk = P < 512 ? P : 512;
    mha_status st;
    if ((st = mha_paged_cache_add(s->c, &s->ids[0]))) return st;
    const double t0 = cli_now();
    for (int64_t p0 = 0; p0 < P; p0 += chunk) {
        const int64_t k = P - p0 < chunk ? P - p0 : chunk;
        bench_fill_uniform(s->x, k * E, &s->rng);
        mha_tensor xt = mha_tensor_contiguous(s->x, MHA_F32, 3, (int64_t[]){1, k, E}),
                   yt = mha_tensor_contiguous(s->y, MHA_F32, 3, (int64_t[]){1, k, E});
        s->a.query = s->a.key = s->a.value = &xt;
        if ((st = mha_forward_paged(&yt, s->m, &s->a, s->c, s->ids, NULL, NULL))) return st;
    }
    s->prefill_ms = (cli_now() - t0) * 1e3;
    for (int64_t i = 1; i < N; i++)
        if ((st = mha_paged_cache_fork(s->c, s->ids[0], &s->ids[i]))) return st;
    s->after_fork = mha_paged_cache_blocks_in_use(s->c);
    for (int64_t i = 0; i < N; i++)
        s->stop[i] = G / 4 + (int64_t)(bench_next(&s->rng) % (uint64_t)(G - G / 4 + 1));
    return MHA_OK;
}

// The weights' bytes (F32: Q and O projections, K and V's).
static double serve_weight_bytes(const serve_run *s) {
    const int64_t E = s->o->E;
    return (double)sizeof(float) * (double)(2 * E * E + 2 * E * s->Hkv * s->d);
}

// After a step: the blocks in use against the tokens they hold.
static void serve_account(serve_run *s) {
    const int64_t P = s->o->prompt, bs = s->o->block;
    const int64_t used = mha_paged_cache_blocks_in_use(s->c);
    if (s->step <= 2)  // (the step timed as full: its blocks in use, each once)
        s->first_distinct = serve_weight_bytes(s) +
                            (double)used * (double)mha_paged_cache_block_bytes(s->c);
    s->peak = used > s->peak ? used : s->peak;
    // the tokens held, each once (the prompt, then every running
    // sequence's own): what the blocks in use hold against them
    int64_t distinct = P;
    for (int64_t i = 0; i < s->nlive; i++)
        distinct += mha_paged_cache_length(s->c, s->live[i]) - P;
    const double over = (double)(used * bs) / (double)distinct;
    s->worst = over > s->worst ? over : s->worst;
    if (used >= s->peak) s->at_peak = over;
}

// The sequences at their stop freed, the others kept running.
static mha_status serve_retire(serve_run *s) {
    const int64_t P = s->o->prompt;
    int64_t w = 0;
    mha_status st;
    for (int64_t i = 0; i < s->nlive; i++) {
        const int64_t seq = s->live[i];
        int64_t idx = 0;
        while (s->ids[idx] != seq) idx++;
        if (mha_paged_cache_length(s->c, seq) - P >= s->stop[idx]) {
            if ((st = mha_paged_cache_free(s->c, seq))) return st;
        } else {
            s->live[w++] = seq;
        }
    }
    s->nlive = w;
    return MHA_OK;
}

// The N sequences decode together, one call per step for every running
// one, each to its stop.
static mha_status serve_decode(serve_run *s) {
    const int64_t N = s->o->nseq, P = s->o->prompt, E = s->o->E, bs = s->o->block;
    mha_status st;
    s->nlive = N;
    s->peak = s->after_fork;
    for (int64_t i = 0; i < N; i++) s->live[i] = s->ids[i];
    const double t1 = cli_now();
    while (s->nlive > 0) {
        bench_fill_uniform(s->x, s->nlive * E, &s->rng);
        mha_tensor xt = mha_tensor_contiguous(s->x, MHA_F32, 3, (int64_t[]){s->nlive, 1, E}),
                   yt = mha_tensor_contiguous(s->y, MHA_F32, 3, (int64_t[]){s->nlive, 1, E});
        s->a.query = s->a.key = s->a.value = &xt;
        if (s->step == 0)  // the bytes of the first full step: weights + every history
            // (a token's K and V rows of every KV head, with their int8 /
            // int4 scales: a block's bytes over its tokens)
            s->first_bytes = serve_weight_bytes(s) +
                             (double)N * (double)(P + 1) *
                                 (double)mha_paged_cache_block_bytes(s->c) / (double)bs;
        const double s0 = cli_now();
        if ((st = mha_forward_paged(&yt, s->m, &s->a, s->c, s->live, NULL, NULL))) return st;
        s->steps[s->step++] = (cli_now() - s0) * 1e3;
        s->tokens += s->nlive;
        serve_account(s);
        if ((st = serve_retire(s))) return st;
    }
    s->decode_s = cli_now() - t1;
    return MHA_OK;
}

// The full step against the read bandwidth measured now, and the pool's
// memory against contiguous caches.
static void serve_measure(serve_run *s) {
    const bench_serve_opts *o = s->o;
    // (the second step: every sequence still runs, the weights are packed)
    s->full_ms = s->step > 1 ? s->steps[1] : s->steps[0];
    qsort(s->steps, (size_t)s->step, sizeof *s->steps, cli_cmp_double);
    s->bw = read_bandwidth(o->threads, s->first_bytes * 2);
    // the step's rate over the bandwidth, never above 1 silently: above,
    // the probe was disturbed (or its kernels are not the fastest way to
    // the ceiling): capped at 1 and said so
    s->bw_raw = s->bw > 0 && s->full_ms > 0
                    ? s->first_distinct / (s->full_ms * 1e-3) * 1e-9 / s->bw
                    : 0.0;
    s->bw_disturbed = s->bw_raw > 1.0;
    s->bw_frac = s->bw_disturbed ? 1.0 : s->bw_raw;
    s->blockb = (double)mha_paged_cache_block_bytes(s->c);
    s->contiguous = (double)o->nseq * (double)(o->prompt + o->gen) * s->blockb /
                    (double)o->block;
}

static void serve_print_json(const serve_run *s) {
    const bench_serve_opts *o = s->o;
    const int64_t N = o->nseq, P = o->prompt, G = o->gen, E = o->E, H = o->H, bs = o->block;
    printf("{\"serve\": true, \"sequences\": %lld, \"prompt\": %lld, \"max_new\": %lld, "
           "\"embed_dim\": %lld, \"num_heads\": %lld, \"num_kv_heads\": %lld, "
           "\"block_size\": %lld, \"pool_layout\": \"%s\", \"kv_dtype\": \"%s\", "
           "\"threads\": %d, "
           "\"prefill_ms\": %.3f, \"decode_tokens\": %lld, \"decode_s\": %.4f, "
           "\"tokens_per_s\": %.1f, \"steps\": %lld, \"step_ms_median\": %.4f, "
           "\"full_step_ms\": %.4f, \"full_step_bytes\": %.0f, "
           "\"full_step_distinct_bytes\": %.0f, \"read_bandwidth_gbps\": %.3f, "
           "\"bandwidth_fraction\": %.4f, \"bandwidth_fraction_raw\": %.4f, "
           "\"bandwidth_probe_disturbed\": %s, "
           "\"peak_cache_mib\": %.2f, \"contiguous_mib\": %.2f, "
           "\"peak_blocks_over_distinct\": %.4f, \"max_blocks_over_distinct\": %.4f}\n",
           (long long)N, (long long)P, (long long)G, (long long)E, (long long)H,
           (long long)s->Hkv, (long long)bs, mha_paged_layout_name(o->layout),
           mha_kv_dtype_name(o->kv_dtype), o->threads, s->prefill_ms, (long long)s->tokens,
           s->decode_s, (double)s->tokens / s->decode_s, (long long)s->step,
           s->steps[s->step / 2], s->full_ms, s->first_bytes, s->first_distinct, s->bw,
           s->bw_frac, s->bw_raw, s->bw_disturbed ? "true" : "false",
           (double)s->peak * s->blockb / 1048576.0, s->contiguous / 1048576.0, s->at_peak,
           s->worst);
}

static void serve_print_text(const serve_run *s) {
    const bench_serve_opts *o = s->o;
    const int64_t N = o->nseq, P = o->prompt, G = o->gen, E = o->E, H = o->H, bs = o->block;
    printf("mha bench --serve: %lld sequences sharing a %lld-token prompt, up to %lld new "
           "tokens each (stops uniform in [%lld, %lld]); E %lld, %lld heads, %lld KV heads, "
           "RoPE; paged cache of %lld-token blocks (%s, %s), %d thread%s, kernels %s\n",
           (long long)N, (long long)P, (long long)G, (long long)(G / 4), (long long)G,
           (long long)E, (long long)H, (long long)s->Hkv, (long long)bs,
           mha_kv_dtype_name(o->kv_dtype), mha_paged_layout_name(o->layout), o->threads,
           o->threads == 1 ? "" : "s", mha_isa());
    printf("  prefill    the prompt once: %.1f ms (%.0f tokens/s), then %lld forks: %lld "
           "blocks in use (no copy)\n",
           s->prefill_ms, (double)P / (s->prefill_ms * 1e-3), (long long)(N - 1),
           (long long)s->after_fork);
    printf("  decode     %lld tokens in %lld steps, %.3f s: %.0f tokens/s (continuous "
           "batching: one call per step for every running sequence)\n",
           (long long)s->tokens, (long long)s->step, s->decode_s,
           (double)s->tokens / s->decode_s);
    printf("  step       all %lld running: %.3f ms; the weights and every sequence's K "
           "and V are %.1f MiB (%.1f GB/s), the weights and the blocks in use, each once, "
           "%.1f MiB (%.1f GB/s = %.1f%%%s of the read bandwidth %.1f GB/s measured here: "
           "decode reads a block that sequences share once for a group of them); median "
           "over all steps %.3f ms\n",
           (long long)N, s->full_ms, s->first_bytes / 1048576.0,
           s->first_bytes / (s->full_ms * 1e-3) * 1e-9, s->first_distinct / 1048576.0,
           s->first_distinct / (s->full_ms * 1e-3) * 1e-9, 100.0 * s->bw_frac,
           s->bw_disturbed ? " (capped, see the warning)" : "", s->bw, s->steps[s->step / 2]);
    if (s->bw_disturbed)
        printf("  warning    probe disturbed: the step read at %.1f%% of the read bandwidth "
               "measured here (a noisy neighbour during the probe, or a step from cache)\n",
               100.0 * s->bw_raw);
    printf("  memory     peak %.1f MiB of blocks (%lld of %lld) vs %.1f MiB for %lld "
           "contiguous caches of %lld tokens: %.2fx less\n",
           (double)s->peak * s->blockb / 1048576.0, (long long)s->peak, (long long)s->nblocks,
           s->contiguous / 1048576.0, (long long)N, (long long)(P + G),
           s->contiguous / ((double)s->peak * s->blockb));
    printf("  sharing    at the peak the blocks hold %.3fx the bytes of the distinct tokens "
           "(the prompt once, each sequence's own after it; at most %.3fx over every step, "
           "the first steps' part-filled blocks)\n",
           s->at_peak, s->worst);
}

int bench_serve(const bench_serve_opts *o) {
    serve_run s;
    int rc = serve_create(&s, o);
    if (!rc) {
        mha_status st = serve_prefill(&s);
        if (!st) st = serve_decode(&s);
        if (st) rc = cli_fail("bench --serve", st);
    }
    if (!rc) {
        serve_measure(&s);
        if (o->json) serve_print_json(&s);
        else serve_print_text(&s);
    }
    serve_free(&s);
    return rc;
}
