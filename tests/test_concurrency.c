// test_concurrency.c: many threads using one shared module at once.
// The module (grouped-query heads, dynamic gates, a pruned head) and the
// inputs are read-only; each thread has its own outputs, gradient module,
// saved state, KV cache and diagnostics. Every result must be bit for bit
// the serial one: forward (fused and reference, per-head weights), backward
// (fused, with and without a saved forward), cached decoding, mha_sdpa,
// mha_diag_create and a shared dense layer (mha_linear, BF16 weight). The
// last-error message is per thread: each thread provokes its own error and
// must read its own message back while the others work.
// The module's packed weights (mha_module_params_changed) start stale, so
// the threads race to fill them, and the threads keep marking them stale
// (mha_module_params_changed, mha_module_param_at: allowed while others
// run) so that fills, readers of the old copy and fallbacks to per-call
// packing overlap all along.
// Run under ThreadSanitizer by tests/tsan.sh (a build without OpenMP, whose
// runtime is not instrumented); here it checks the results.
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "util.h"
#include "mha.h"

enum { E = 32, H = 4, HKV = 2, L = 24, N = 2, NIN = 3, WORKERS = 8, ITERS = 40 };
enum { D = E / H };

static mha_module *g_m;
static mha_linear *g_lin;  // (E + 5, E) BF16 weight, F32 bias
static float g_x[NIN][L * N * E];
static float g_gy[L * N * E];

// What one input gives, serially.
typedef struct result {
    float y_fused[L * N * E], y_ref[L * N * E], w[N * H * L * L];
    float gx[L * N * E], gx_saved[L * N * E];
    float *gparams;  // every parameter gradient, concatenated
    float y_dec[L * N * E];
    float sdpa[N * H * L * D];
    double entropy[H];
    float y_lin[L * N * (E + 5)];
} result;

static result g_want[NIN];
static int64_t g_nparam_floats;


// Runs everything on input i into r; returns 0 or the number of failed
// calls (a status that is not MHA_OK).
static int run_all(result *r, int i) {
    int bad = 0;
    mha_tensor xt = mha_tensor_contiguous(g_x[i], MHA_F32, 3, (int64_t[]){L, N, E});
    mha_tensor gyt = mha_tensor_contiguous(g_gy, MHA_F32, 3, (int64_t[]){L, N, E});
    mha_tensor yt = mha_tensor_contiguous(r->y_fused, MHA_F32, 3, (int64_t[]){L, N, E});
    mha_tensor wt = mha_tensor_contiguous(r->w, MHA_F32, 4, (int64_t[]){N, H, L, L});
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = a.key = a.value = &xt;
    a.opts.is_causal = true;
    a.need_weights = true;
    a.average_attn_weights = false;
    a.impl = MHA_IMPL_FUSED;
    bad += mha_forward(&yt, &wt, g_m, &a) != MHA_OK;
    mha_tensor yr = mha_tensor_contiguous(r->y_ref, MHA_F32, 3, (int64_t[]){L, N, E});
    a.impl = MHA_IMPL_REFERENCE;
    a.need_weights = false;
    bad += mha_forward(&yr, NULL, g_m, &a) != MHA_OK;
    // backward: recomputing, then from a saved forward
    mha_module *g = NULL;
    bad += mha_module_create(&g, mha_module_config(g_m)) != MHA_OK;
    mha_tensor gxt = mha_tensor_contiguous(r->gx, MHA_F32, 3, (int64_t[]){L, N, E});
    a.impl = MHA_IMPL_FUSED;
    if (g) bad += mha_backward(&gxt, NULL, NULL, g, g_m, &a, &gyt, false) != MHA_OK;
    mha_saved *sv = NULL;
    bad += mha_saved_create(&sv) != MHA_OK;
    a.save = sv;
    float ytmp[L * N * E];
    mha_tensor yt2 = mha_tensor_contiguous(ytmp, MHA_F32, 3, (int64_t[]){L, N, E});
    bad += mha_forward(&yt2, NULL, g_m, &a) != MHA_OK;
    mha_tensor gxs = mha_tensor_contiguous(r->gx_saved, MHA_F32, 3, (int64_t[]){L, N, E});
    mha_module *g2 = NULL;
    bad += mha_module_create(&g2, mha_module_config(g_m)) != MHA_OK;
    if (g2) bad += mha_backward(&gxs, NULL, NULL, g2, g_m, &a, &gyt, false) != MHA_OK;
    a.save = NULL;
    mha_saved_destroy(sv);
    int64_t off = 0;
    for (int k = 0; g && g2 && k < mha_module_num_params(g); k++) {
        mha_param p, p2;
        bad += mha_module_param_at(&p, g, k) != MHA_OK;
        bad += mha_module_param_at(&p2, g2, k) != MHA_OK;
        memcpy(r->gparams + off, p.data, sizeof(float) * (size_t)p.numel);
        off += p.numel;
        memcpy(r->gparams + off, p2.data, sizeof(float) * (size_t)p.numel);
        off += p.numel;
    }
    mha_module_destroy(g);
    mha_module_destroy(g2);
    // cached decoding, token by token
    mha_kv_cache *c = NULL;
    bad += mha_kv_cache_create(&c, N, HKV, D, D, L, MHA_KV_F32) != MHA_OK;
    for (int t = 0; c && t < L; t++) {
        mha_tensor qc = mha_tensor_contiguous(g_x[i] + t * N * E, MHA_F32, 3,
                                              (int64_t[]){1, N, E});
        mha_tensor oc = mha_tensor_contiguous(r->y_dec + t * N * E, MHA_F32, 3,
                                              (int64_t[]){1, N, E});
        mha_forward_args ac;
        mha_forward_args_init(&ac);
        ac.query = ac.key = ac.value = &qc;
        bad += mha_forward_cached(&oc, g_m, &ac, c) != MHA_OK;
    }
    mha_kv_cache_destroy(c);
    // the attention core on the input seen as (N, H, L, D) heads
    mha_tensor q4 = mha_tensor_contiguous(g_x[i], MHA_F32, 4, (int64_t[]){N, H, L, D});
    mha_tensor o4 = mha_tensor_contiguous(r->sdpa, MHA_F32, 4, (int64_t[]){N, H, L, D});
    mha_sdpa_args sa;
    mha_sdpa_args_init(&sa);
    sa.q = sa.k = sa.v = &q4;
    sa.opts.is_causal = true;
    sa.impl = MHA_IMPL_FUSED;
    bad += mha_sdpa(&o4, NULL, &sa) != MHA_OK;
    // diagnostics
    mha_diag *dg = NULL;
    bad += mha_diag_create(&dg, g_m, &a, NULL) != MHA_OK;
    for (int h = 0; dg && h < H; h++) r->entropy[h] = mha_diag_head(dg, h)->entropy_mean;
    mha_diag_destroy(dg);
    // the dense layer over the input's (L, N, E) rows
    mha_tensor yl = mha_tensor_contiguous(r->y_lin, MHA_F32, 3, (int64_t[]){L, N, E + 5});
    bad += mha_linear_forward(g_lin, &yl, &xt) != MHA_OK;
    return bad;
}

static bool same(const result *a, const result *b) {
    return !memcmp(a->y_fused, b->y_fused, sizeof a->y_fused) &&
           !memcmp(a->y_ref, b->y_ref, sizeof a->y_ref) && !memcmp(a->w, b->w, sizeof a->w) &&
           !memcmp(a->gx, b->gx, sizeof a->gx) &&
           !memcmp(a->gx_saved, b->gx_saved, sizeof a->gx_saved) &&
           !memcmp(a->gparams, b->gparams, sizeof(float) * (size_t)g_nparam_floats) &&
           !memcmp(a->y_dec, b->y_dec, sizeof a->y_dec) &&
           !memcmp(a->sdpa, b->sdpa, sizeof a->sdpa) &&
           !memcmp(a->entropy, b->entropy, sizeof a->entropy) &&
           !memcmp(a->y_lin, b->y_lin, sizeof a->y_lin);
}

typedef struct worker {
    int id, mismatches, failures, wrong_errors;
    pthread_t th;
} worker;

static void *work(void *arg) {
    worker *w = arg;
    result *r = calloc(1, sizeof *r);
    float *gp = malloc(sizeof(float) * (size_t)g_nparam_floats);
    if (!r || !gp) {
        w->failures++;
        free(r), free(gp);
        return NULL;
    }
    r->gparams = gp;
    for (int it = 0; it < ITERS; it++) {
        const int i = (w->id + it) % NIN;
        w->failures += run_all(r, i);
        w->mismatches += !same(r, &g_want[i]);
        // the packed weights stale again, while the others compute (the
        // parameters themselves do not change)
        if (it % 3 == w->id % 3) mha_module_params_changed(g_m);
        mha_param p;
        w->failures += mha_module_param_at(&p, g_m, it % mha_module_num_params(g_m)) != MHA_OK;
        // a thread's own error message, while the others run
        mha_config c;
        mha_config_init(&c, 100 + w->id, 64);
        mha_module *m = NULL;
        const bool refused = mha_module_create(&m, &c) == MHA_ERR_INVALID_ARG;
        char want[64];
        snprintf(want, sizeof want, "embed_dim %d is not divisible by num_heads 64",
                 100 + w->id);
        w->wrong_errors += !refused || !strstr(mha_last_error(), want);
        mha_module_destroy(m);
    }
    free(gp);
    free(r);
    return NULL;
}

int main(void) {
    seed_rng(77);
    mha_config c;
    mha_config_init(&c, E, H);
    c.num_kv_heads = HKV;
    c.head_gate = MHA_GATE_DYNAMIC;
    CHECK_OK(mha_module_create(&g_m, &c));
    mha_init_options io;
    mha_init_options_init(&io);
    CHECK_OK(mha_module_init(g_m, &io));
    mha_param gw;
    CHECK_OK(mha_module_param(&gw, g_m, "gate_proj.weight"));
    for (int64_t k = 0; k < gw.numel; k++) gw.data[k] = 0.3f * frand();
    const int64_t pruned = 3;
    CHECK_OK(mha_module_prune_heads(g_m, &pruned, 1));
    static uint16_t lw[(E + 5) * E];
    static float lb[E + 5];
    for (int k = 0; k < (E + 5) * E; k++) lw[k] = mha_f32_to_bf16(frand());
    for (int k = 0; k < E + 5; k++) lb[k] = frand();
    mha_tensor lwt = mha_tensor_contiguous(lw, MHA_BF16, 2, (int64_t[]){E + 5, E});
    mha_tensor lbt = mha_tensor_contiguous(lb, MHA_F32, 1, (int64_t[]){E + 5});
    CHECK_OK(mha_linear_create(&g_lin, &lwt, &lbt));
    for (int i = 0; i < NIN; i++)
        for (int k = 0; k < L * N * E; k++) g_x[i][k] = frand();
    for (int k = 0; k < L * N * E; k++) g_gy[k] = frand();
    for (int k = 0; k < mha_module_num_params(g_m); k++) {
        mha_param p;
        CHECK_OK(mha_module_param_at(&p, g_m, k));
        g_nparam_floats += 2 * p.numel;
    }
    for (int i = 0; i < NIN; i++) {
        g_want[i].gparams = malloc(sizeof(float) * (size_t)g_nparam_floats);
        CHECK(g_want[i].gparams != NULL);
        CHECK(run_all(&g_want[i], i) == 0);
    }
    // serially again: the same bits (nothing depends on earlier calls)
    result *again = calloc(1, sizeof *again);
    again->gparams = malloc(sizeof(float) * (size_t)g_nparam_floats);
    CHECK(run_all(again, 1) == 0 && same(again, &g_want[1]));
    free(again->gparams);
    free(again);
    mha_module_params_changed(g_m);  // (the threads race to fill the copy)
    worker w[WORKERS];
    memset(w, 0, sizeof w);
    for (int t = 0; t < WORKERS; t++) {
        w[t].id = t;
        CHECK(pthread_create(&w[t].th, NULL, work, &w[t]) == 0);
    }
    int mism = 0, fails = 0, wrong = 0;
    for (int t = 0; t < WORKERS; t++) {
        CHECK(pthread_join(w[t].th, NULL) == 0);
        CHECKF(w[t].mismatches == 0,
               "thread %d: %d of %d iterations differ from the serial "
               "results",
               t, w[t].mismatches, ITERS);
        CHECKF(w[t].failures == 0, "thread %d: %d calls failed", t, w[t].failures);
        CHECKF(w[t].wrong_errors == 0, "thread %d: %d last-error messages were not its own", t,
               w[t].wrong_errors);
        mism += w[t].mismatches, fails += w[t].failures, wrong += w[t].wrong_errors;
    }
    printf("%d threads x %d iterations on one shared module (forward fused/reference with "
           "weights, backward recomputed/saved, cached decode, sdpa, diagnose, dense layer): %d "
           "results "
           "differing from serial, %d failed calls, %d foreign error messages\n",
           WORKERS, ITERS, mism, fails, wrong);
    for (int i = 0; i < NIN; i++) free(g_want[i].gparams);
    mha_module_destroy(g_m);
    mha_linear_destroy(g_lin);
    return check_summary("test_concurrency");
}
