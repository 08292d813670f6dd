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

int bench_serve(const bench_serve_opts *o) {
    const int64_t N = o->nseq, P = o->prompt, G = o->gen, E = o->E, H = o->H, bs = o->block;
    const int64_t Hkv = o->Hkv ? o->Hkv : H, d = E / H;
    uint64_t rng = o->seed * 0x9e3779b97f4a7c15ull + 77;
    mha_config cfg;
    mha_config_init(&cfg, E, H);
    cfg.num_kv_heads = Hkv;
    cfg.batch_first = true;
    mha_init_options io;
    mha_init_options_init(&io);
    io.seed = o->seed;
    mha_module *m = NULL;
    mha_paged_cache *c = NULL;
    mha_status st;
    if ((st = mha_module_create(&m, &cfg)) || (st = mha_module_init(m, &io)))
        return cli_fail("bench --serve", st);
    // blocks: the prompt once, each sequence's own tokens (and a copy of the
    // prompt's last block), with room to spare
    const int64_t nblocks = (P + bs - 1) / bs + N * ((G + bs - 1) / bs + 2) + 8;
    if ((st = mha_paged_cache_create(&c, nblocks, bs, Hkv, d, d, o->kv_dtype, o->layout))) {
        mha_module_destroy(m);
        return cli_fail("bench --serve", st);
    }
    const int64_t chunk = P < 512 ? P : 512;
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)N),
            *stop = malloc(sizeof(int64_t) * (size_t)N),
            *live = malloc(sizeof(int64_t) * (size_t)N);
    float *x = malloc(sizeof(float) * (size_t)((chunk > N ? chunk : N) * E)),
          *y = malloc(sizeof(float) * (size_t)((chunk > N ? chunk : N) * E));
    double *steps = malloc(sizeof(double) * (size_t)(G + 1));
    int rc = 0;
    if (!ids || !stop || !live || !x || !y || !steps) {
        fprintf(stderr, "mha bench --serve: out of memory\n");
        rc = 1;
        goto done;
    }
    mha_forward_args a;
    mha_forward_args_init(&a);
    mha_rope_init(&a.rope, MHA_ROPE_NEOX);
    // prefill the prompt once
    if ((st = mha_paged_cache_add(c, &ids[0]))) goto fail;
    const double t0 = cli_now();
    for (int64_t p0 = 0; p0 < P; p0 += chunk) {
        const int64_t k = P - p0 < chunk ? P - p0 : chunk;
        bench_fill_uniform(x, k * E, &rng);
        mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 3, (int64_t[]){1, k, E}),
                   yt = mha_tensor_contiguous(y, MHA_F32, 3, (int64_t[]){1, k, E});
        a.query = a.key = a.value = &xt;
        if ((st = mha_forward_paged(&yt, m, &a, c, ids, NULL, NULL))) goto fail;
    }
    const double prefill_ms = (cli_now() - t0) * 1e3;
    for (int64_t i = 1; i < N; i++)
        if ((st = mha_paged_cache_fork(c, ids[0], &ids[i]))) goto fail;
    const int64_t after_fork = mha_paged_cache_blocks_in_use(c);
    for (int64_t i = 0; i < N; i++)
        stop[i] = G / 4 + (int64_t)(bench_next(&rng) % (uint64_t)(G - G / 4 + 1));
    // decode together, each to its stop
    int64_t nlive = N, tokens = 0, peak = after_fork, step = 0;
    for (int64_t i = 0; i < N; i++) live[i] = ids[i];
    const double t1 = cli_now();
    // worst: the largest blocks / distinct tokens; at_peak: at the peak of blocks
    // first_bytes: every sequence's history; first_distinct: each block once
    double first_bytes = 0, first_distinct = 0, worst = 0.0, at_peak = 0.0;
    while (nlive > 0) {
        bench_fill_uniform(x, nlive * E, &rng);
        mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 3, (int64_t[]){nlive, 1, E}),
                   yt = mha_tensor_contiguous(y, MHA_F32, 3, (int64_t[]){nlive, 1, E});
        a.query = a.key = a.value = &xt;
        if (step == 0)  // the bytes of the first full step: weights + every history
            // (a token's K and V rows of every KV head, with their int8 /
            // int4 scales: a block's bytes over its tokens)
            first_bytes = (double)sizeof(float) * (double)(2 * E * E + 2 * E * Hkv * d) +
                          (double)N * (double)(P + 1) *
                              (double)mha_paged_cache_block_bytes(c) / (double)bs;
        const double s0 = cli_now();
        if ((st = mha_forward_paged(&yt, m, &a, c, live, NULL, NULL))) goto fail;
        steps[step++] = (cli_now() - s0) * 1e3;
        tokens += nlive;
        const int64_t used = mha_paged_cache_blocks_in_use(c);
        if (step <= 2)  // (the step timed as full: its blocks in use, each once)
            first_distinct = (double)sizeof(float) * (double)(2 * E * E + 2 * E * Hkv * d) +
                             (double)used * (double)mha_paged_cache_block_bytes(c);
        peak = used > peak ? used : peak;
        // the tokens held, each once (the prompt, then every running
        // sequence's own): what the blocks in use hold against them
        int64_t distinct = P;
        for (int64_t i = 0; i < nlive; i++) distinct += mha_paged_cache_length(c, live[i]) - P;
        const double over = (double)(used * bs) / (double)distinct;
        worst = over > worst ? over : worst;
        if (used >= peak) at_peak = over;
        int64_t w = 0;
        for (int64_t i = 0; i < nlive; i++) {
            const int64_t seq = live[i];
            int64_t idx = 0;
            while (ids[idx] != seq) idx++;
            if (mha_paged_cache_length(c, seq) - P >= stop[idx]) {
                if ((st = mha_paged_cache_free(c, seq))) goto fail;
            } else {
                live[w++] = seq;
            }
        }
        nlive = w;
    }
    const double decode_s = cli_now() - t1;
    // (the second step: every sequence still runs, the weights are packed)
    const double full_ms = step > 1 ? steps[1] : steps[0];
    qsort(steps, (size_t)step, sizeof *steps, cli_cmp_double);
    const double bw = read_bandwidth(o->threads, first_bytes * 2);
    // the step's rate over the bandwidth, never above 1 silently: above,
    // the probe was disturbed (or its kernels are not the fastest way to
    // the ceiling): capped at 1 and said so
    const double bw_raw = bw > 0 && full_ms > 0 ? first_distinct / (full_ms * 1e-3) * 1e-9 / bw
                                                : 0.0;
    const bool bw_disturbed = bw_raw > 1.0;
    const double bw_frac = bw_disturbed ? 1.0 : bw_raw;
    const double blockb = (double)mha_paged_cache_block_bytes(c);
    const double contiguous = (double)N * (double)(P + G) * blockb / (double)bs;
    if (o->json) {
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
               (long long)Hkv, (long long)bs, mha_paged_layout_name(o->layout),
               mha_kv_dtype_name(o->kv_dtype), o->threads, prefill_ms, (long long)tokens,
               decode_s, (double)tokens / decode_s, (long long)step, steps[step / 2], full_ms,
               first_bytes, first_distinct, bw, bw_frac, bw_raw,
               bw_disturbed ? "true" : "false", (double)peak * blockb / 1048576.0,
               contiguous / 1048576.0, at_peak, worst);
    } else {
        printf("mha bench --serve: %lld sequences sharing a %lld-token prompt, up to %lld new "
               "tokens each (stops uniform in [%lld, %lld]); E %lld, %lld heads, %lld KV heads, "
               "RoPE; paged cache of %lld-token blocks (%s, %s), %d thread%s, kernels %s\n",
               (long long)N, (long long)P, (long long)G, (long long)(G / 4), (long long)G,
               (long long)E, (long long)H, (long long)Hkv, (long long)bs,
               mha_kv_dtype_name(o->kv_dtype), mha_paged_layout_name(o->layout), o->threads,
               o->threads == 1 ? "" : "s", mha_isa());
        printf("  prefill    the prompt once: %.1f ms (%.0f tokens/s), then %lld forks: %lld "
               "blocks in use (no copy)\n",
               prefill_ms, (double)P / (prefill_ms * 1e-3), (long long)(N - 1),
               (long long)after_fork);
        printf("  decode     %lld tokens in %lld steps, %.3f s: %.0f tokens/s (continuous "
               "batching: one call per step for every running sequence)\n",
               (long long)tokens, (long long)step, decode_s, (double)tokens / decode_s);
        printf("  step       all %lld running: %.3f ms; the weights and every sequence's K "
               "and V are %.1f MiB (%.1f GB/s), the weights and the blocks in use, each once, "
               "%.1f MiB (%.1f GB/s = %.1f%%%s of the read bandwidth %.1f GB/s measured here: "
               "decode reads a block that sequences share once for a group of them); median "
               "over all steps %.3f ms\n",
               (long long)N, full_ms, first_bytes / 1048576.0,
               first_bytes / (full_ms * 1e-3) * 1e-9, first_distinct / 1048576.0,
               first_distinct / (full_ms * 1e-3) * 1e-9, 100.0 * bw_frac,
               bw_disturbed ? " (capped, see the warning)" : "", bw, steps[step / 2]);
        if (bw_disturbed)
            printf("  warning    probe disturbed: the step read at %.1f%% of the read bandwidth "
                   "measured here (a noisy neighbour during the probe, or a step from cache)\n",
                   100.0 * bw_raw);
        printf("  memory     peak %.1f MiB of blocks (%lld of %lld) vs %.1f MiB for %lld "
               "contiguous caches of %lld tokens: %.2fx less\n",
               (double)peak * blockb / 1048576.0, (long long)peak, (long long)nblocks,
               contiguous / 1048576.0, (long long)N, (long long)(P + G),
               contiguous / ((double)peak * blockb));
        printf("  sharing    at the peak the blocks hold %.3fx the bytes of the distinct tokens "
               "(the prompt once, each sequence's own after it; at most %.3fx over every step, "
               "the first steps' part-filled blocks)\n",
               at_peak, worst);
    }
    goto done;
fail:
    rc = cli_fail("bench --serve", st);
done:
    free(ids), free(stop), free(live), free(x), free(y), free(steps);
    mha_paged_cache_destroy(c);
    mha_module_destroy(m);
    return rc;
}
