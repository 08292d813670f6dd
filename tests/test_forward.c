// test_forward.c: properties of the reference forward that need no PyTorch:
// closed-form cases, layouts (batch_first, unbatched, strided views), thread
// independence, caller workspace, fully masked rows, huge logits, the trace,
// SDPA mask broadcasting. PyTorch agreement is tests/conformance.
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "check.h"
#include "util.h"
#include "mha.h"

static void fill(float *x, int64_t n, float scale) {
    for (int64_t i = 0; i < n; i++) x[i] = scale * frand();
}

static double maxdiff(const float *a, const float *b, int64_t n) {
    double m = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (d > m || isnan(d)) m = isnan(d) ? INFINITY : d;
    }
    return m;
}

static mha_module *module(int64_t E, int64_t H, bool batch_first, bool bkv, bool zero_attn,
                          uint64_t seed) {
    mha_config c;
    mha_config_init(&c, E, H);
    c.batch_first = batch_first;
    c.add_bias_kv = bkv;
    c.add_zero_attn = zero_attn;
    mha_module *m = NULL;
    CHECK_OK(mha_module_create(&m, &c));
    seed_rng(seed);  // the biases below depend on the seed only
    mha_init_options o;
    mha_init_options_init(&o);
    o.seed = seed;
    CHECK_OK(mha_module_init(m, &o));
    // non-zero biases so that they are exercised
    mha_param p;
    CHECK_OK(mha_module_param(&p, m, "in_proj_bias"));
    fill(p.data, p.numel, 0.5f);
    CHECK_OK(mha_module_param(&p, m, "out_proj.bias"));
    fill(p.data, p.numel, 0.5f);
    return m;
}

// Contiguous views for mha_sdpa, q (B, H, L, D), k (B, H, S, D), v (B, H,
// S, Dv), o (B, H, L, Dv) and w (B, H, L, S), and default arguments on
// them (a points into the struct).
typedef struct sdpa_call {
    mha_tensor qt, kt, vt, ot, wt;
    mha_sdpa_args a;
} sdpa_call;

static void sdpa_call_init(sdpa_call *c, float *q, float *k, float *v, float *o, float *w,
                           int64_t B, int64_t H, int64_t L, int64_t S, int64_t D, int64_t Dv) {
    c->qt = mha_tensor_contiguous(q, MHA_F32, 4, (int64_t[]){B, H, L, D});
    c->kt = mha_tensor_contiguous(k, MHA_F32, 4, (int64_t[]){B, H, S, D});
    c->vt = mha_tensor_contiguous(v, MHA_F32, 4, (int64_t[]){B, H, S, Dv});
    c->ot = mha_tensor_contiguous(o, MHA_F32, 4, (int64_t[]){B, H, L, Dv});
    c->wt = mha_tensor_contiguous(w, MHA_F32, 4, (int64_t[]){B, H, L, S});
    mha_sdpa_args_init(&c->a);
    c->a.q = &c->qt;
    c->a.k = &c->kt;
    c->a.v = &c->vt;
}

// SDPA: identical keys -> uniform weights and output = mean of values;
// causal row 0 -> v[0].
static void test_sdpa_closed_form(void) {
    enum { B = 2, H = 3, L = 4, S = 5, D = 6, Dv = 7 };
    float q[B * H * L * D], k[B * H * S * D], v[B * H * S * Dv], o[B * H * L * Dv],
        w[B * H * L * S];
    fill(q, B * H * L * D, 1.0f);
    for (int bh = 0; bh < B * H; bh++)
        for (int j = 0; j < S; j++)
            for (int c = 0; c < D; c++) k[(bh * S + j) * D + c] = (float)(c + bh) * 0.1f;
    fill(v, B * H * S * Dv, 1.0f);
    sdpa_call sc;
    sdpa_call_init(&sc, q, k, v, o, w, B, H, L, S, D, Dv);
    CHECK_OK(mha_sdpa(&sc.ot, &sc.wt, &sc.a));
    double ew = 0, eo = 0;
    for (int bh = 0; bh < B * H; bh++)
        for (int i = 0; i < L; i++) {
            for (int j = 0; j < S; j++) ew = fmax(ew, fabs(w[(bh * L + i) * S + j] - 0.2));
            for (int c = 0; c < Dv; c++) {
                double mean = 0;
                for (int j = 0; j < S; j++) mean += v[(bh * S + j) * Dv + c] / 5.0;
                eo = fmax(eo, fabs(o[(bh * L + i) * Dv + c] - mean));
            }
        }
    CHECKF(ew < 1e-6 && eo < 1e-6, "uniform weights err %g, mean err %g", ew, eo);
    sc.a.opts.is_causal = true;
    fill(k, B * H * S * D, 1.0f);
    CHECK_OK(mha_sdpa(&sc.ot, &sc.wt, &sc.a));
    eo = 0;
    for (int bh = 0; bh < B * H; bh++) {
        CHECK(w[bh * L * S] == 1.0f);
        for (int j = 1; j < S; j++) CHECK(w[bh * L * S + j] == 0.0f);
        for (int c = 0; c < Dv; c++)
            eo = fmax(eo, fabs(o[bh * L * Dv + c] - v[bh * S * Dv + c]));
        // row i sees keys 0..i only
        for (int i = 0; i < L; i++)
            for (int j = i + 1; j < S; j++) CHECK(w[(bh * L + i) * S + j] == 0.0f);
    }
    CHECKF(eo < 1e-6, "causal row 0 err %g", eo);

    // A 2-D (L, S) float mask broadcast equals the same mask expanded to
    // (B, H, L, S); a custom scale of 0 gives uniform weights.
    float m2[L * S], m4[B * H * L * S], o2[B * H * L * Dv];
    fill(m2, L * S, 3.0f);
    for (int bh = 0; bh < B * H; bh++) memcpy(m4 + bh * L * S, m2, sizeof m2);
    mha_tensor m2t = mha_tensor_contiguous(m2, MHA_F32, 2, (int64_t[]){L, S});
    mha_tensor m4t = mha_tensor_contiguous(m4, MHA_F32, 4, (int64_t[]){B, H, L, S});
    mha_tensor o2t = mha_tensor_contiguous(o2, MHA_F32, 4, (int64_t[]){B, H, L, Dv});
    sc.a.opts.is_causal = false;
    sc.a.attn_mask = &m2t;
    CHECK_OK(mha_sdpa(&sc.ot, NULL, &sc.a));
    sc.a.attn_mask = &m4t;
    CHECK_OK(mha_sdpa(&o2t, NULL, &sc.a));
    CHECK(maxdiff(o, o2, B * H * L * Dv) == 0.0);
    sc.a.attn_mask = NULL;
    sc.a.opts.scale = 1e-30;  // (0 is the default scale, 1 / sqrt(D))
    CHECK_OK(mha_sdpa(&sc.ot, &sc.wt, &sc.a));
    ew = 0;
    for (int i = 0; i < B * H * L * S; i++) ew = fmax(ew, fabs(w[i] - 0.2));
    CHECKF(ew < 1e-7, "scale 1e-30 -> uniform, err %g", ew);
}

// batch_first, unbatched and strided views give the same numbers as the
// plain (L, N, E) layout.
static void test_layouts(void) {
    enum { E = 8, H = 2, L = 5, S = 6, N = 3 };
    mha_module *m = module(E, H, false, false, false, 1);
    mha_module *mb = module(E, H, true, false, false, 1);
    float q[L * N * E], kv[S * N * E], y[L * N * E], w[N * L * S];
    fill(q, L * N * E, 1.0f);
    fill(kv, S * N * E, 1.0f);
    mha_tensor qt = mha_tensor_contiguous(q, MHA_F32, 3, (int64_t[]){L, N, E});
    mha_tensor kt = mha_tensor_contiguous(kv, MHA_F32, 3, (int64_t[]){S, N, E});
    mha_tensor yt = mha_tensor_contiguous(y, MHA_F32, 3, (int64_t[]){L, N, E});
    mha_tensor wt = mha_tensor_contiguous(w, MHA_F32, 3, (int64_t[]){N, L, S});
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = &qt;
    a.key = a.value = &kt;
    a.need_weights = true;
    CHECK_OK(mha_forward(&yt, &wt, m, &a));

    // batch_first: copy to (N, L, E)
    float qb[N * L * E], kb[N * S * E], yb[N * L * E], wb[N * L * S];
    for (int l = 0; l < L; l++)
        for (int n = 0; n < N; n++) memcpy(qb + (n * L + l) * E, q + (l * N + n) * E, E * 4);
    for (int s = 0; s < S; s++)
        for (int n = 0; n < N; n++) memcpy(kb + (n * S + s) * E, kv + (s * N + n) * E, E * 4);
    mha_tensor qbt = mha_tensor_contiguous(qb, MHA_F32, 3, (int64_t[]){N, L, E});
    mha_tensor kbt = mha_tensor_contiguous(kb, MHA_F32, 3, (int64_t[]){N, S, E});
    mha_tensor ybt = mha_tensor_contiguous(yb, MHA_F32, 3, (int64_t[]){N, L, E});
    mha_tensor wbt = mha_tensor_contiguous(wb, MHA_F32, 3, (int64_t[]){N, L, S});
    a.query = &qbt;
    a.key = a.value = &kbt;
    CHECK_OK(mha_forward(&ybt, &wbt, mb, &a));
    double e = 0;
    for (int l = 0; l < L; l++)
        for (int n = 0; n < N; n++)
            e = fmax(e, maxdiff(yb + (n * L + l) * E, y + (l * N + n) * E, E));
    CHECKF(e == 0.0, "batch_first differs by %g", e);
    CHECK(maxdiff(w, wb, N * L * S) == 0.0);

    // batch_first module given a strided view of the (L, N, E) data:
    // (N, L, E) with strides (E, N*E, 1) -- no copy
    mha_tensor qv = qt, kvv = kt;
    qv.shape[0] = N;
    qv.shape[1] = L;
    qv.stride[0] = E;
    qv.stride[1] = N * E;
    kvv.shape[0] = N;
    kvv.shape[1] = S;
    kvv.stride[0] = E;
    kvv.stride[1] = N * E;
    a.query = &qv;
    a.key = a.value = &kvv;
    float ys[N * L * E];
    mha_tensor yst = mha_tensor_contiguous(ys, MHA_F32, 3, (int64_t[]){N, L, E});
    CHECK_OK(mha_forward(&yst, &wbt, mb, &a));
    CHECK(maxdiff(ys, yb, N * L * E) == 0.0);

    // unbatched (L, E) equals batch element n of the batched run
    for (int n = 0; n < N; n++) {
        float qu[L * E], ku[S * E], yu[L * E], wu[L * S];
        mha_tensor qut = {q + n * E, MHA_F32, 2, {L, E}, {N * E, 1}};  // strided
        for (int s = 0; s < S; s++) memcpy(ku + s * E, kv + (s * N + n) * E, E * 4);
        (void)qu;
        mha_tensor kut = mha_tensor_contiguous(ku, MHA_F32, 2, (int64_t[]){S, E});
        mha_tensor yut = mha_tensor_contiguous(yu, MHA_F32, 2, (int64_t[]){L, E});
        mha_tensor wut = mha_tensor_contiguous(wu, MHA_F32, 2, (int64_t[]){L, S});
        mha_forward_args au = a;
        au.query = &qut;
        au.key = au.value = &kut;
        CHECK_OK(mha_forward(&yut, &wut, m, &au));
        e = 0;
        for (int l = 0; l < L; l++) e = fmax(e, maxdiff(yu + l * E, y + (l * N + n) * E, E));
        CHECKF(e == 0.0, "unbatched n=%d differs by %g", n, e);
        CHECK(maxdiff(wu, w + n * L * S, L * S) == 0.0);
    }
    mha_module_destroy(m);
    mha_module_destroy(mb);
}

// Same results with 1 and 2 threads, and with a caller workspace; per-head
// weights averaged equal the averaged weights.
static void test_threads_workspace(void) {
    enum { E = 24, H = 4, L = 40, S = 33, N = 3 };  // big enough to use threads
    mha_module *m = module(E, H, false, true, true, 2);
    static float q[L * N * E], kv[S * N * E], y1[L * N * E], y2[L * N * E],
        w1[N * H * L * (S + 2)], w2[N * H * L * (S + 2)], wa[N * L * (S + 2)];
    fill(q, L * N * E, 2.0f);
    fill(kv, S * N * E, 2.0f);
    mha_tensor qt = mha_tensor_contiguous(q, MHA_F32, 3, (int64_t[]){L, N, E});
    mha_tensor kt = mha_tensor_contiguous(kv, MHA_F32, 3, (int64_t[]){S, N, E});
    mha_tensor y1t = mha_tensor_contiguous(y1, MHA_F32, 3, (int64_t[]){L, N, E});
    mha_tensor y2t = mha_tensor_contiguous(y2, MHA_F32, 3, (int64_t[]){L, N, E});
    mha_tensor w1t = mha_tensor_contiguous(w1, MHA_F32, 4, (int64_t[]){N, H, L, S + 2});
    mha_tensor w2t = mha_tensor_contiguous(w2, MHA_F32, 4, (int64_t[]){N, H, L, S + 2});
    mha_tensor wat = mha_tensor_contiguous(wa, MHA_F32, 3, (int64_t[]){N, L, S + 2});
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = &qt;
    a.key = a.value = &kt;
    a.opts.is_causal = true;
    a.need_weights = true;
    a.average_attn_weights = false;
#ifdef _OPENMP
    omp_set_num_threads(1);
#endif
    CHECK_OK(mha_forward(&y1t, &w1t, m, &a));
#ifdef _OPENMP
    omp_set_num_threads(2);
#endif
    size_t bytes = 0;
    CHECK_OK(mha_forward_workspace_size(&bytes, m, &a));
    char *ws = malloc(bytes + 1);
    // an unaligned caller block works too
    a.workspace = ws + 1, a.workspace_bytes = bytes;
    CHECK_OK(mha_forward(&y2t, &w2t, m, &a));
    CHECK(memcmp(y1, y2, sizeof y1) == 0);
    CHECK(memcmp(w1, w2, sizeof w1) == 0);
    a.workspace = ws, a.workspace_bytes = bytes / 2;
    CHECK_FAILS(mha_forward(&y2t, &w2t, m, &a), MHA_ERR_INVALID_ARG);
    CHECK(strstr(mha_last_error(), "workspace") != NULL);
    a.workspace = NULL, a.workspace_bytes = 0;
    free(ws);
    a.average_attn_weights = true;
    CHECK_OK(mha_forward(&y2t, &wat, m, &a));
    CHECK(memcmp(y1, y2, sizeof y1) == 0);
    double e = 0;
    for (int n = 0; n < N; n++)
        for (int i = 0; i < L * (S + 2); i++) {
            double s = 0;
            for (int h = 0; h < H; h++) s += w1[(n * H + h) * L * (S + 2) + i];
            e = fmax(e, fabs(s / H - wa[n * L * (S + 2) + i]));
        }
    CHECKF(e < 1e-7, "mean of per-head weights vs averaged: %g", e);
    mha_module_destroy(m);
}

// Fully masked rows: weights 0, output = out_proj.bias. S = 0 is the same.
// With add_bias_kv the appended key is never masked.
static void test_fully_masked(void) {
    enum { E = 8, H = 2, L = 3, S = 4, N = 2 };
    mha_module *m = module(E, H, true, false, false, 3);
    mha_param ob;
    CHECK_OK(mha_module_param(&ob, m, "out_proj.bias"));
    float q[N * L * E], kv[N * S * E], y[N * L * E], w[N * L * S];
    fill(q, N * L * E, 1.0f);
    fill(kv, N * S * E, 1.0f);
    uint8_t kpm[N * S] = {0, 0, 1, 0, 1, 1, 1, 1};  // batch 1: all masked
    float am[L * S] = {0, 0, 0, 0, -INFINITY, -INFINITY, -INFINITY, -INFINITY, 0, 0, 0, 0};
    mha_tensor qt = mha_tensor_contiguous(q, MHA_F32, 3, (int64_t[]){N, L, E});
    mha_tensor kt = mha_tensor_contiguous(kv, MHA_F32, 3, (int64_t[]){N, S, E});
    mha_tensor yt = mha_tensor_contiguous(y, MHA_F32, 3, (int64_t[]){N, L, E});
    mha_tensor wt = mha_tensor_contiguous(w, MHA_F32, 3, (int64_t[]){N, L, S});
    mha_tensor kpt = mha_tensor_contiguous(kpm, MHA_BOOL, 2, (int64_t[]){N, S});
    mha_tensor amt = mha_tensor_contiguous(am, MHA_F32, 2, (int64_t[]){L, S});
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = &qt;
    a.key = a.value = &kt;
    a.key_padding_mask = &kpt;
    a.attn_mask = &amt;  // row 1 fully masked by a float -inf mask
    a.need_weights = true;
    CHECK_OK(mha_forward(&yt, &wt, m, &a));
    for (int n = 0; n < N; n++)
        for (int l = 0; l < L; l++) {
            bool dead = n == 1 || l == 1;
            double rs = 0;
            for (int j = 0; j < S; j++) rs += w[(n * L + l) * S + j];
            if (dead) {
                CHECKF(rs == 0.0, "n %d l %d: weights sum %g, want 0", n, l, rs);
                CHECKF(maxdiff(y + (n * L + l) * E, ob.data, E) == 0.0,
                       "n %d l %d: output is not out_proj.bias", n, l);
            } else {
                CHECKF(fabs(rs - 1.0) < 1e-6, "n %d l %d: weights sum %g", n, l, rs);
                CHECK(w[(n * L + l) * S + 2] == 0.0f);  // masked key
            }
        }
    // S = 0: every row fully masked
    mha_tensor k0 = mha_tensor_contiguous(kv, MHA_F32, 3, (int64_t[]){N, 0, E});
    mha_tensor w0 = mha_tensor_contiguous(w, MHA_F32, 3, (int64_t[]){N, L, 0});
    mha_forward_args a0;
    mha_forward_args_init(&a0);
    a0.query = &qt;
    a0.key = a0.value = &k0;
    a0.need_weights = true;
    CHECK_OK(mha_forward(&yt, &w0, m, &a0));
    for (int r = 0; r < N * L; r++) CHECK(maxdiff(y + r * E, ob.data, E) == 0.0);
    // L = 0: nothing to do, no error
    mha_tensor q0 = mha_tensor_contiguous(q, MHA_F32, 3, (int64_t[]){N, 0, E});
    mha_tensor y0 = mha_tensor_contiguous(y, MHA_F32, 3, (int64_t[]){N, 0, E});
    mha_tensor w00 = mha_tensor_contiguous(w, MHA_F32, 3, (int64_t[]){N, 0, S});
    a0.query = &q0;
    a0.key = a0.value = &kt;
    CHECK_OK(mha_forward(&y0, &w00, m, &a0));
    mha_module_destroy(m);

    // add_bias_kv + add_zero_attn: all real keys masked, the two appended
    // keys are not: weights on them sum to 1.
    mha_module *mb = module(E, H, true, true, true, 4);
    float w2[N * L * (S + 2)];
    mha_tensor w2t = mha_tensor_contiguous(w2, MHA_F32, 3, (int64_t[]){N, L, S + 2});
    uint8_t all[N * S];
    memset(all, 1, sizeof all);
    mha_tensor allt = mha_tensor_contiguous(all, MHA_BOOL, 2, (int64_t[]){N, S});
    a.key_padding_mask = &allt;
    a.attn_mask = NULL;
    CHECK_OK(mha_forward(&yt, &w2t, mb, &a));
    for (int r = 0; r < N * L; r++) {
        double s = w2[r * (S + 2) + S] + w2[r * (S + 2) + S + 1];
        CHECKF(fabs(s - 1.0) < 1e-6, "row %d: appended keys' weight %g", r, s);
    }
    mha_module_destroy(mb);
}

// Logits of 1e4 stay finite: the softmax subtracts the row max.
static void test_huge_logits(void) {
    enum { B = 1, H = 1, L = 3, S = 3, D = 1 };
    float q[3] = {100.0f, -100.0f, 100.0f}, k[3] = {100.0f, 90.0f, -100.0f},
          v[3] = {1.0f, 2.0f, 3.0f}, o[3], w[9];
    sdpa_call sc;
    sdpa_call_init(&sc, q, k, v, o, w, B, H, L, S, D, D);
    CHECK_OK(mha_sdpa(&sc.ot, &sc.wt, &sc.a));  // scores 1e4, 9e3, -1e4, ...
    for (int i = 0; i < 9; i++) CHECK(isfinite(w[i]));
    CHECK(w[0] == 1.0f && w[1] == 0.0f && w[2] == 0.0f);
    CHECK(o[0] == 1.0f && o[1] == 3.0f && o[2] == 1.0f);
}

// The trace reports every step in order, with the right shapes.
typedef struct trace_log {
    char steps[64][16];
    int n;
    int64_t rows[64], cols[64];
} trace_log;

static void on_trace(void *user, const char *step, int64_t b, int64_t h, const mha_tensor *t) {
    trace_log *lg = user;
    (void)b;
    (void)h;
    if (lg->n < 64) {
        snprintf(lg->steps[lg->n], 16, "%s", step);
        lg->rows[lg->n] = t->shape[t->ndim - 2];
        lg->cols[lg->n] = t->shape[t->ndim - 1];
        lg->n++;
    }
}

static void test_trace(void) {
    enum { E = 6, H = 2, L = 3, S = 4 };
    mha_module *m = module(E, H, false, false, false, 5);
    float q[L * E], kv[S * E], y[L * E];
    fill(q, L * E, 1.0f);
    fill(kv, S * E, 1.0f);
    mha_tensor qt = mha_tensor_contiguous(q, MHA_F32, 2, (int64_t[]){L, E});
    mha_tensor kt = mha_tensor_contiguous(kv, MHA_F32, 2, (int64_t[]){S, E});
    mha_tensor yt = mha_tensor_contiguous(y, MHA_F32, 2, (int64_t[]){L, E});
    trace_log lg;
    memset(&lg, 0, sizeof lg);
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = &qt;
    a.key = a.value = &kt;
    a.trace = on_trace;
    a.trace_user = &lg;
    CHECK_OK(mha_forward(&yt, NULL, m, &a));
    const char *want[] = {"q",       "k",       "v",      "scores",        "scaled_scores",
                          "weights", "context", "scores", "scaled_scores", "weights",
                          "context", "concat",  "output"};
    CHECK(lg.n == 13);
    for (int i = 0; i < 13 && i < lg.n; i++)
        CHECKF(!strcmp(lg.steps[i], want[i]), "step %d is %s, want %s", i, lg.steps[i], want[i]);
    CHECK(lg.rows[3] == L && lg.cols[3] == S);
    CHECK(lg.rows[6] == L && lg.cols[6] == E / H);
    mha_module_destroy(m);
    // head_dim != E / H: "q" and "concat" are (N, L, Eq), Eq = H d; k, v
    // (N, S, Ekv); "context" (L, d); "output" (N, L, E)
    mha_config c;
    mha_config_init(&c, E, H);
    c.head_dim = 5;
    c.num_kv_heads = 1;
    CHECK_OK(mha_module_create(&m, &c));
    memset(&lg, 0, sizeof lg);
    CHECK_OK(mha_forward(&yt, NULL, m, &a));
    CHECK(lg.n == 13);
    CHECKF(lg.cols[0] == 10 && lg.cols[1] == 5 && lg.cols[2] == 5 && lg.cols[6] == 5 &&
               lg.cols[11] == 10 && lg.cols[12] == E && lg.rows[11] == L,
           "head_dim trace: q %lld k %lld v %lld context %lld concat %lld output %lld",
           (long long)lg.cols[0], (long long)lg.cols[1], (long long)lg.cols[2],
           (long long)lg.cols[6], (long long)lg.cols[11], (long long)lg.cols[12]);
    mha_module_destroy(m);
}

// The kept scratch block (mha_forward, mha_release_scratch): a forward
// whose scratch is over 1 MiB, run again (the kept block, holding the last
// call's values; under ASan every block handed out is filled with NaN
// bytes), after mha_release_scratch, after a smaller call (its own block
// kept) and on a thread that exits afterwards (its block freed then:
// LeakSanitizer would report it): the same bits every time; the sdpa and
// its backward likewise.
typedef struct scratch_run {
    const mha_module *m;
    const mha_forward_args *a;
    mha_tensor *y;
    mha_status st;
} scratch_run;

static void *scratch_thread(void *arg) {
    scratch_run *r = arg;
    r->st = mha_forward(r->y, NULL, r->m, r->a);
    return NULL;
}

static void test_kept_scratch(void) {
    enum { E = 64, H = 4, L = 300, N = 3, Ls = 40 };
    mha_config cfg;
    mha_config_init(&cfg, E, H);
    mha_module *m = random_module(&cfg, 31);
    float *x = malloc(sizeof(float) * L * N * E), *y0 = malloc(sizeof(float) * L * N * E),
          *y1 = malloc(sizeof(float) * L * N * E);
    fill(x, L * N * E, 1.0f);
    mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 3, (int64_t[]){L, N, E});
    mha_tensor xs = mha_tensor_contiguous(x, MHA_F32, 3, (int64_t[]){Ls, N, E});
    mha_tensor y0t = mha_tensor_contiguous(y0, MHA_F32, 3, (int64_t[]){L, N, E});
    mha_tensor y1t = mha_tensor_contiguous(y1, MHA_F32, 3, (int64_t[]){L, N, E});
    mha_forward_args a, as;
    mha_forward_args_init(&a);
    a.query = a.key = a.value = &xt;
    a.opts.is_causal = true;
    as = a;
    as.query = as.key = as.value = &xs;
    size_t bytes = 0;
    CHECK_OK(mha_forward_workspace_size(&bytes, m, &a));
    CHECKF(bytes > (1u << 20), "the case's scratch is %zu bytes, not over 1 MiB", bytes);
    CHECK_OK(mha_forward(&y0t, NULL, m, &a));
    const char *what[5] = {"the kept block", "the kept block again",
                           "after mha_release_scratch", "after a smaller call",
                           "on a thread of its own"};
    for (int i = 0; i < 5; i++) {
        memset(y1, 0, sizeof(float) * L * N * E);
        if (i == 2) mha_release_scratch();
        if (i == 3) {
            mha_tensor ys = mha_tensor_contiguous(y1, MHA_F32, 3, (int64_t[]){Ls, N, E});
            CHECK_OK(mha_forward(&ys, NULL, m, &as));
        }
        if (i == 4) {
            scratch_run r = {m, &a, &y1t, MHA_ERR_UNSUPPORTED};
            pthread_t th;
            CHECK(pthread_create(&th, NULL, scratch_thread, &r) == 0);
            pthread_join(th, NULL);
            CHECK_OK(r.st);
        } else {
            CHECK_OK(mha_forward(&y1t, NULL, m, &a));
        }
        CHECKF(memcmp(y0, y1, sizeof(float) * L * N * E) == 0, "mha_forward %s: other bits",
               what[i]);
    }
    // the sdpa and its backward: twice each, the same bits
    {
        enum { B = 1, Hs = 4, T = 256, D = 64 };
        const int64_t n = B * Hs * T * D;
        float *q = malloc(sizeof(float) * (size_t)n * 6);
        fill(q, n * 3, 1.0f);
        float *o = q + 3 * n, *dq = q + 4 * n, *dq2 = q + 5 * n;
        const int64_t sh[4] = {B, Hs, T, D};
        mha_tensor qt = mha_tensor_contiguous(q, MHA_F32, 4, sh),
                   kt = mha_tensor_contiguous(q + n, MHA_F32, 4, sh),
                   vt = mha_tensor_contiguous(q + 2 * n, MHA_F32, 4, sh),
                   ot = mha_tensor_contiguous(o, MHA_F32, 4, sh);
        mha_sdpa_args sa;
        mha_sdpa_args_init(&sa);
        sa.q = &qt, sa.k = &kt, sa.v = &vt;
        sa.opts.is_causal = true;
        float *dk = malloc(sizeof(float) * (size_t)n * 4), *dv = dk + n;
        mha_tensor dkt = mha_tensor_contiguous(dk, MHA_F32, 4, sh),
                   dvt = mha_tensor_contiguous(dv, MHA_F32, 4, sh);
        for (int r = 0; r < 2; r++) {
            mha_tensor dqt = mha_tensor_contiguous(r ? dq2 : dq, MHA_F32, 4, sh);
            CHECK_OK(mha_sdpa(&ot, NULL, &sa));
            CHECK_OK(mha_sdpa_backward(&dqt, &dkt, &dvt, NULL, &ot, &sa));
        }
        CHECKF(memcmp(dq, dq2, sizeof(float) * (size_t)n) == 0,
               "mha_sdpa_backward on the kept block: other bits");
        free(q), free(dk);
    }
    mha_release_scratch();
    mha_release_scratch();  // (nothing kept: nothing to do)
    free(x), free(y0), free(y1);
    mha_module_destroy(m);
}

int main(void) {
    seed_rng(12345);
    test_sdpa_closed_form();
    test_layouts();
    test_threads_workspace();
    test_kept_scratch();
    test_fully_masked();
    test_huge_logits();
    test_trace();
    return check_summary("test_forward");
}
