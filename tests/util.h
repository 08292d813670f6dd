// util.h: what the C tests share besides check.h: one seeded generator,
// the error measures, and a module with PyTorch's initialisation.
#ifndef MHA_TEST_UTIL_H
#define MHA_TEST_UTIL_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "check.h"
#include "mha.h"

// The generator (a 64-bit LCG with Knuth's MMIX constants). Each test
// seeds it in main (and where a case must be reproducible on its own, as
// on every MPI rank), so its cases are its own.
static uint64_t g_rng;
static inline void seed_rng(uint64_t seed) { g_rng = seed; }
static inline uint64_t next(void) {
    g_rng = g_rng * 6364136223846793005ull + 1442695040888963407ull;
    return g_rng >> 11;
}
// Uniform in [-1, 1).
static inline float frand(void) { return (float)((double)next() * 0x1p-53 * 2.0 - 1.0); }
// Uniform in [lo, hi].
static inline int64_t irand(int64_t lo, int64_t hi) {
    return lo + (int64_t)(next() % (uint64_t)(hi - lo + 1));
}

static inline double max_abs(const float *x, int64_t n) {
    double m = 0;
    for (int64_t i = 0; i < n; i++) m = fmax(m, fabs((double)x[i]));
    return m;
}
// max |a - b| / (1 + max |a|).
static inline double rel_err(const float *a, const float *b, int64_t n) {
    double e = 0;
    for (int64_t i = 0; i < n; i++) e = fmax(e, fabs((double)a[i] - b[i]));
    return e / (1.0 + max_abs(a, n));
}

// A module of config c with PyTorch's default initialisation (seed).
static inline mha_module *torch_module(const mha_config *c, uint64_t seed) {
    mha_module *m = NULL;
    CHECK_OK(mha_module_create(&m, c));
    mha_init_options io;
    mha_init_options_init(&io);
    io.seed = seed;
    CHECK_OK(mha_module_init(m, &io));
    return m;
}

// torch_module, then its biases and gate parameters drawn as 0.5 frand()
// (so that they are not trivial), in parameter order.
static inline mha_module *random_module(const mha_config *c, uint64_t seed) {
    mha_module *m = torch_module(c, seed);
    for (int i = 0; m && i < mha_module_num_params(m); i++) {
        mha_param p;
        CHECK_OK(mha_module_param_at(&p, m, i));
        if (p.ndim == 1 || strstr(p.name, "gate"))
            for (int64_t j = 0; j < p.numel; j++) p.data[j] = 0.5f * frand();
    }
    return m;
}

// Random inputs as contiguous seq-first views: query and output gradient
// (L, N, E) drawn interleaved, then the key (S, N, kd), the value (S, N,
// vd), and an (N, S) key padding mask hiding about one key in `every`.
typedef struct test_inputs {
    float *q, *k, *v, *gy;
    uint8_t *kpm;
    mha_tensor qt, kt, vt, gyt, kpt;
} test_inputs;

static inline void test_inputs_make(test_inputs *t, int64_t L, int64_t S, int64_t N, int64_t E,
                                    int64_t kd, int64_t vd, int every) {
    t->q = malloc(sizeof(float) * (size_t)(L * N * E + 1));
    t->gy = malloc(sizeof(float) * (size_t)(L * N * E + 1));
    t->k = malloc(sizeof(float) * (size_t)(S * N * kd + 1));
    t->v = malloc(sizeof(float) * (size_t)(S * N * vd + 1));
    t->kpm = malloc((size_t)(N * S + 1));
    for (int64_t i = 0; i < L * N * E; i++) t->q[i] = frand(), t->gy[i] = frand();
    for (int64_t i = 0; i < S * N * kd; i++) t->k[i] = frand();
    for (int64_t i = 0; i < S * N * vd; i++) t->v[i] = frand();
    for (int64_t i = 0; i < N * S; i++) t->kpm[i] = next() % (uint64_t)every == 0;
    t->qt = mha_tensor_contiguous(t->q, MHA_F32, 3, (int64_t[]){L, N, E});
    t->gyt = mha_tensor_contiguous(t->gy, MHA_F32, 3, (int64_t[]){L, N, E});
    t->kt = mha_tensor_contiguous(t->k, MHA_F32, 3, (int64_t[]){S, N, kd});
    t->vt = mha_tensor_contiguous(t->v, MHA_F32, 3, (int64_t[]){S, N, vd});
    t->kpt = mha_tensor_contiguous(t->kpm, MHA_BOOL, 2, (int64_t[]){N, S});
}

// a initialised (mha_forward_args_init) with t's query, key and value (the
// query as all three when self); a points into t.
static inline void test_inputs_args(mha_forward_args *a, test_inputs *t, bool self) {
    mha_forward_args_init(a);
    a->query = &t->qt;
    a->key = self ? &t->qt : &t->kt;
    a->value = self ? &t->qt : &t->vt;
}

// m with its matrices converted to dtype (mha_module_convert: BF16 or
// F16 weights); m is destroyed.
static inline mha_module *module_as(mha_module *m, mha_dtype dtype) {
    mha_module *mh = NULL;
    CHECK_OK(mha_module_convert(&mh, m, dtype));
    mha_module_destroy(m);
    return mh;
}

static inline void test_inputs_free(test_inputs *t) {
    free(t->q), free(t->gy), free(t->k), free(t->v), free(t->kpm);
}

// The fused path against the reference on one case (module m, arguments a;
// a->impl is set here, the rest is the caller's): the forward's output, and
// its weights when a->need_weights, to 2e-5 in rel_err; then, unless
// fwd_only, each one's backward with dY = gy into a fresh gradient module:
// the input gradients (the query's alone when kv_grads is false: the key's
// and value's are not asked for) and every parameter's gradient to 1e-4.
// desc names the case in every message. When grad is not NULL, *grad is the
// fused backward's gradient module (NULL when fwd_only), the caller's to
// destroy.
static inline void check_fused_vs_ref(mha_module **grad, const mha_module *m,
                                      mha_forward_args *a, const mha_tensor *gy, bool fwd_only,
                                      bool kv_grads, const char *desc) {
    mha_shape os, wsh;
    CHECK_OK(mha_forward_shapes(&os, &wsh, m, a));
    int64_t on = 1, wn = 1;
    for (int i = 0; i < os.ndim; i++) on *= os.dims[i];
    for (int i = 0; i < wsh.ndim; i++) wn *= wsh.dims[i];
    const bool need = a->need_weights;
    const mha_tensor *xin[3] = {a->query, a->key, a->value};
    int64_t xn[3];
    for (int j = 0; j < 3; j++) xn[j] = mha_tensor_numel(xin[j]);
    float *y[2], *w[2], *gx[2][3];
    mha_module *g[2] = {NULL, NULL};
    for (int r = 0; r < 2; r++) {
        y[r] = malloc(sizeof(float) * (size_t)on);
        w[r] = malloc(sizeof(float) * (size_t)wn);
        mha_tensor yt = mha_tensor_contiguous(y[r], MHA_F32, os.ndim, os.dims);
        mha_tensor wt = mha_tensor_contiguous(w[r], MHA_F32, wsh.ndim, wsh.dims);
        mha_tensor gt[3];
        for (int j = 0; j < 3; j++) {
            gx[r][j] = malloc(sizeof(float) * (size_t)xn[j]);
            gt[j] = mha_tensor_contiguous(gx[r][j], MHA_F32, xin[j]->ndim, xin[j]->shape);
        }
        a->impl = r ? MHA_IMPL_FUSED : MHA_IMPL_REFERENCE;
        CHECK_OK(mha_forward(&yt, need ? &wt : NULL, m, a));
        if (fwd_only) continue;
        CHECK_OK(mha_module_create(&g[r], mha_module_config(m)));
        CHECK_OK(mha_backward(&gt[0], kv_grads ? &gt[1] : NULL, kv_grads ? &gt[2] : NULL, g[r],
                              m, a, gy, false));
    }
    double e = rel_err(y[0], y[1], on);
    CHECKF(e < 2e-5, "%s: output err %g", desc, e);
    if (need) {
        e = rel_err(w[0], w[1], wn);
        CHECKF(e < 2e-5, "%s: weights err %g", desc, e);
    }
    static const char *gn[3] = {"grad_query", "grad_key", "grad_value"};
    for (int j = 0; !fwd_only && j < (kv_grads ? 3 : 1); j++) {
        e = rel_err(gx[0][j], gx[1][j], xn[j]);
        CHECKF(e < 1e-4, "%s: %s err %g", desc, gn[j], e);
    }
    for (int i = 0; !fwd_only && i < mha_module_num_params(g[0]); i++) {
        mha_param p0, p1;
        CHECK_OK(mha_module_param_at(&p0, g[0], i));
        CHECK_OK(mha_module_param_at(&p1, g[1], i));
        e = rel_err(p0.data, p1.data, p0.numel);
        CHECKF(e < 1e-4, "%s: grad %s err %g", desc, p0.name, e);
    }
    for (int r = 0; r < 2; r++) {
        free(y[r]), free(w[r]);
        for (int j = 0; j < 3; j++) free(gx[r][j]);
    }
    mha_module_destroy(g[0]);
    if (grad) *grad = g[1];
    else mha_module_destroy(g[1]);
}

// The gradients of a backward of m on a (dY = dy, a->impl as the caller
// set it) into gx[0..2] (the query's, then with kv_grads the key's and
// value's; a->query, key, value's shapes) and a fresh gradient module *g.
static inline void backward_into(float *gx[3], mha_module **g, const mha_module *m,
                                 const mha_forward_args *a, const mha_tensor *dy,
                                 bool kv_grads) {
    const mha_tensor *xin[3] = {a->query, a->key, a->value};
    mha_tensor gt[3];
    for (int j = 0; j < 3; j++)
        if (j == 0 || kv_grads)
            gt[j] = mha_tensor_contiguous(gx[j], MHA_F32, xin[j]->ndim, xin[j]->shape);
    CHECK_OK(mha_module_create(g, mha_module_config(m)));
    CHECK_OK(mha_backward(&gt[0], kv_grads ? &gt[1] : NULL, kv_grads ? &gt[2] : NULL, *g, m, a,
                          dy, false));
}

// Runs rb's gradients (gx, g) the same bits as run 0's: the input
// gradients (the query's, with kv_grads the key's and value's too) and
// every parameter's; what names run rb in the messages.
static inline void check_grads_bits(float *gx[][3], mha_module **g, const mha_forward_args *a,
                                    int rb, bool kv_grads, const char *desc, const char *what) {
    static const char *gn[3] = {"grad_query", "grad_key", "grad_value"};
    const mha_tensor *xin[3] = {a->query, a->key, a->value};
    for (int j = 0; j < (kv_grads ? 3 : 1); j++)
        CHECKF(memcmp(gx[0][j], gx[rb][j], sizeof(float) * (size_t)mha_tensor_numel(xin[j])) ==
                   0,
               "%s %s: %s", desc, gn[j], what);
    for (int i = 0; i < mha_module_num_params(g[0]); i++) {
        mha_param p0, pr;
        CHECK_OK(mha_module_param_at(&p0, g[0], i));
        CHECK_OK(mha_module_param_at(&pr, g[rb], i));
        CHECKF(memcmp(p0.data, pr.data, (size_t)p0.numel * 4) == 0, "%s grad %s: %s", desc,
               p0.name, what);
    }
}

// The backward of m on a (dY = dy, a->impl as the caller set it, a->save
// NULL) recomputing its forward and after a forward that kept its saved
// state in sv: the same bits (check_grads_bits; kv_grads as there). Leaves
// a->save NULL and sv holding that forward.
static inline void check_saved_bits(const mha_module *m, mha_forward_args *a,
                                    const mha_tensor *dy, mha_saved *sv, bool kv_grads,
                                    const char *desc) {
    mha_shape os, wsh;
    CHECK_OK(mha_forward_shapes(&os, &wsh, m, a));
    const mha_tensor *xin[3] = {a->query, a->key, a->value};
    int64_t ny = 1;
    for (int i = 0; i < os.ndim; i++) ny *= os.dims[i];
    float *y = malloc(sizeof(float) * (size_t)ny), *gx[2][3];
    mha_module *g[2];
    for (int r = 0; r < 2; r++) {
        for (int j = 0; j < 3; j++)
            gx[r][j] = malloc(sizeof(float) * (size_t)mha_tensor_numel(xin[j]));
        mha_tensor yt = mha_tensor_contiguous(y, MHA_F32, os.ndim, os.dims);
        a->save = r ? sv : NULL;
        CHECK_OK(mha_forward(&yt, NULL, m, a));
        backward_into(gx[r], &g[r], m, a, dy, kv_grads);
    }
    a->save = NULL;
    check_grads_bits(gx, g, a, 1, kv_grads, desc,
                     "after a saved forward, differs from the recomputing backward");
    for (int r = 0; r < 2; r++) {
        for (int j = 0; j < 3; j++) free(gx[r][j]);
        mha_module_destroy(g[r]);
    }
    free(y);
}

// The forward (its weights too when a->need_weights) and the backward (dY
// = dy, into a fresh gradient module; the query's gradient, with kv_grads
// the key's and value's too) of m on a with 1, 2 and 8 OpenMP threads:
// the output, the weights and every gradient with 2 and 8 threads the same
// bits as with 1. desc names the case in the messages. Leaves 2 threads
// set.
static inline void check_threads_bits(const mha_module *m, const mha_forward_args *a,
                                      const mha_tensor *dy, bool kv_grads, const char *desc) {
    mha_shape os, wsh;
    mha_status st = mha_forward_shapes(&os, &wsh, m, a);
    if (st) {
        CHECK_OK(st);
        return;
    }
    const int64_t ny = mha_tensor_numel(a->query);
    int64_t nw = 1;
    for (int i = 0; i < wsh.ndim; i++) nw *= wsh.dims[i];
    const int threads[3] = {1, 2, 8};
    const mha_tensor *xin[3] = {a->query, a->key, a->value};
    float *y[3], *w[3], *gx[3][3];
    mha_module *g[3];
    for (int r = 0; r < 3; r++) {
#ifdef _OPENMP
        omp_set_num_threads(threads[r]);
#endif
        y[r] = malloc(sizeof(float) * (size_t)ny);
        w[r] = malloc(sizeof(float) * (size_t)nw);
        for (int j = 0; j < 3; j++)
            gx[r][j] = malloc(sizeof(float) * (size_t)mha_tensor_numel(xin[j]));
        mha_tensor yt = mha_tensor_contiguous(y[r], MHA_F32, os.ndim, os.dims);
        mha_tensor wt = mha_tensor_contiguous(w[r], MHA_F32, wsh.ndim, wsh.dims);
        CHECK_OK(mha_forward(&yt, a->need_weights ? &wt : NULL, m, a));
        backward_into(gx[r], &g[r], m, a, dy, kv_grads);
    }
    for (int r = 1; r < 3; r++) {
        const size_t by = sizeof(float) * (size_t)ny, bw = sizeof(float) * (size_t)nw;
        CHECKF(memcmp(y[0], y[r], by) == 0, "%s output: 1 vs %d threads", desc, threads[r]);
        if (a->need_weights)
            CHECKF(memcmp(w[0], w[r], bw) == 0, "%s weights: 1 vs %d threads", desc, threads[r]);
        char what[32];
        snprintf(what, sizeof what, "1 vs %d threads", threads[r]);
        check_grads_bits(gx, g, a, r, kv_grads, desc, what);
    }
    for (int r = 0; r < 3; r++) {
        mha_module_destroy(g[r]);
        free(y[r]), free(w[r]);
        for (int j = 0; j < 3; j++) free(gx[r][j]);
    }
#ifdef _OPENMP
    omp_set_num_threads(2);
#endif
}

#endif
