// test_sdpa_backward.c: mha_sdpa_backward. The reference (float64 views)
// against finite differences of mha_sdpa's reference; the fused path
// against the reference on random configurations (GQA, every mask kind and
// broadcast, causal with L != S, windows, custom scale, strided views);
// soft cap, ALiBi (given and default slopes) and sinks; the same bits with
// 1 and 2 threads; fully masked rows; misuse.
// Attention dropout (dropout_p): fused vs reference forward (out, weights)
// and backward with the same keep mask, finite differences of the
// reference with the mask fixed by its seed, 1 vs 2 threads, p = 0 the
// same bits as no dropout, the zeroed fraction against p and the zeros
// against the documented Philox rule, bad p refused.
// args.save: out and gradients the same bits with the forward's state as
// without, another call's state refused.
// The sinks' gradient (dsinks): fused vs reference and the reference
// against finite differences, with and without GQA, causal or not, rows
// dominated by a sink, a sink of -inf, dropout, over tiles; bf16 inputs
// (bf16 and float32 compute) against the reference, the same bits for
// 1, 2, 4 threads; dsinks without sinks refused.
// Agreement with PyTorch autograd: tests/infer/test_infer.py.
#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "check.h"
#include "flash.h"
#include "mha.h"
#include "util.h"

typedef struct scase {
    int64_t B, H, Hkv, L, S, D, Dv;
    bool causal, custom_scale;
    int64_t wl, wr;
    int am;       // 0 none, 1 bool (L, S), 2 float (B, H, L, S), 3 float (1, H, L, S)
    int kpm;      // 0 none, 1 bool (B, S)
    int64_t pad;  // extra elements per row of q, k, v, dout (strided views)
    float p;      // dropout_p (0: none)
    uint64_t seed, offset;
    float softcap;     // 0: none
    int alibi;         // 0 none, 1 slopes given, 2 the paper's (opts.alibi)
    bool sinks;        // one sink logit per query head
    float sink_shift;  // added to every sink (large: rows dominated by it)
    bool sink_ninf;    // sinks[0] = -inf (its weight 0 everywhere)
} scase;

typedef struct sbufs {
    void *q, *k, *v, *dout, *am, *kpm;
    mha_tensor tq, tk, tv, tdo, tam, tkpm;
    float *slopes, *sinks;  // (H) each
} sbufs;

static int64_t prod4(const int64_t d[4]) { return d[0] * d[1] * d[2] * d[3]; }

// The sinks' gradients, fused vs reference: the worst error / tolerance
// and the worst finite-difference error (printed at the end).
static double g_sinks_worst, g_sinks_fd_worst, g_sinks_bf16_worst;

// A (d0, d1, d2, d3) view of dtype dt whose rows carry pad extra elements,
// filled with frand() * s.
static void *make4(mha_tensor *t, mha_dtype dt, const int64_t d[4], int64_t pad, double s) {
    const int64_t ld = d[3] + pad, n = d[0] * d[1] * d[2] * ld + 1;
    const size_t es = mha_dtype_size(dt);
    char *p = calloc((size_t)n, es);
    for (int64_t i = 0; i < n; i++) {
        const double x = s * frand();
        if (dt == MHA_F64) ((double *)p)[i] = x;
        else ((float *)p)[i] = (float)x;
    }
    memset(t, 0, sizeof *t);
    *t = (mha_tensor){p, dt, 4, {d[0], d[1], d[2], d[3]}, {d[1] * d[2] * ld, d[2] * ld, ld, 1}};
    return p;
}

static void make_inputs(sbufs *s, const scase *c, mha_dtype dt) {
    const int64_t qd[4] = {c->B, c->H, c->L, c->D}, kd[4] = {c->B, c->Hkv, c->S, c->D},
                  vd[4] = {c->B, c->Hkv, c->S, c->Dv}, od[4] = {c->B, c->H, c->L, c->Dv};
    s->q = make4(&s->tq, dt, qd, c->pad, 1.0);
    s->k = make4(&s->tk, dt, kd, c->pad, 1.0);
    s->v = make4(&s->tv, dt, vd, c->pad, 1.0);
    s->dout = make4(&s->tdo, dt, od, c->pad, 1.0);
    s->am = s->kpm = NULL;
    s->slopes = malloc(sizeof(float) * (size_t)c->H);
    s->sinks = malloc(sizeof(float) * (size_t)c->H);
    for (int64_t h = 0; h < c->H; h++) {
        s->slopes[h] = 0.15f * (float)(h + 1) / (float)c->H;
        s->sinks[h] = 0.4f * (float)h - 0.5f + c->sink_shift;
    }
    if (c->sink_ninf) s->sinks[0] = -INFINITY;
    if (c->am == 1) {
        uint8_t *m = malloc((size_t)(c->L * c->S));
        for (int64_t i = 0; i < c->L * c->S; i++) m[i] = next() % 6 == 0;
        s->am = m;
        s->tam = mha_tensor_contiguous(m, MHA_BOOL, 2, (int64_t[]){c->L, c->S});
    } else if (c->am >= 2) {
        const int64_t B = c->am == 2 ? c->B : 1, n = B * c->H * c->L * c->S;
        float *m = malloc(sizeof(float) * (size_t)n);
        for (int64_t i = 0; i < n; i++) m[i] = next() % 8 == 0 ? -INFINITY : 0.5f * frand();
        s->am = m;
        s->tam = mha_tensor_contiguous(m, MHA_F32, 4, (int64_t[]){B, c->H, c->L, c->S});
    }
    if (c->kpm) {
        uint8_t *m = malloc((size_t)(c->B * c->S));
        for (int64_t i = 0; i < c->B * c->S; i++) m[i] = next() % 5 == 0;
        s->kpm = m;
        s->tkpm = mha_tensor_contiguous(m, MHA_BOOL, 2, (int64_t[]){c->B, c->S});
    }
}

static void free_inputs(sbufs *s) {
    free(s->q), free(s->k), free(s->v), free(s->dout), free(s->am), free(s->kpm);
    free(s->slopes), free(s->sinks);
}

static void args_of(mha_sdpa_args *a, const scase *c, const sbufs *s, mha_impl impl) {
    mha_sdpa_args_init(a);
    a->q = &s->tq, a->k = &s->tk, a->v = &s->tv;
    a->attn_mask = c->am ? &s->tam : NULL;
    a->key_padding_mask = c->kpm ? &s->tkpm : NULL;
    a->opts.is_causal = c->causal;
    a->opts.window_left = c->wl, a->opts.window_right = c->wr;
    a->opts.scale = c->custom_scale ? 0.37 : 0.0;
    a->impl = impl;
    a->opts.dropout_p = c->p, a->opts.dropout_seed = c->seed,
    a->opts.dropout_offset = c->offset;
    a->opts.softcap = c->softcap;
    a->opts.alibi = c->alibi == 2;
    a->opts.alibi_slopes = c->alibi == 1 ? s->slopes : NULL;
    a->opts.sinks = c->sinks ? s->sinks : NULL;
}

typedef struct sgrads {
    void *dq, *dk, *dv;
    mha_tensor tq, tk, tv;
    float *ds;  // (H): the sinks' gradient when the case has sinks, else NULL
} sgrads;

static void make_grads(sgrads *g, const scase *c, mha_dtype dt) {
    const int64_t qd[4] = {c->B, c->H, c->L, c->D}, kd[4] = {c->B, c->Hkv, c->S, c->D},
                  vd[4] = {c->B, c->Hkv, c->S, c->Dv};
    g->dq = make4(&g->tq, dt, qd, 0, 9.0);  // (garbage: every element is written)
    g->dk = make4(&g->tk, dt, kd, 0, 9.0);
    g->dv = make4(&g->tv, dt, vd, 0, 9.0);
    g->ds = NULL;
    if (c->sinks) {
        g->ds = malloc(sizeof(float) * (size_t)c->H);
        for (int64_t h = 0; h < c->H; h++) g->ds[h] = 9.0f * (float)frand();
    }
}

static void free_grads(sgrads *g) { free(g->dq), free(g->dk), free(g->dv), free(g->ds); }

// The largest |a - b| over the sinks' gradients (H), relative to 1 + max
// |b|; 0 without sinks.
static double sinks_err(const float *a, const float *b, int64_t H) {
    double e = 0.0, mx = 0.0;
    for (int64_t h = 0; a && b && h < H; h++) {
        const double d = fabs((double)a[h] - (double)b[h]);
        if (!(d <= e)) e = d;  // (NaN: inf-like)
        mx = fmax(mx, fabs((double)b[h]));
    }
    return e / (1.0 + mx);
}

// Whether two sinks' gradients hold the same bits (both NULL: yes).
static bool sinks_same(const float *a, const float *b, int64_t H) {
    return (!a && !b) || (a && b && !memcmp(a, b, sizeof(float) * (size_t)H));
}

static scase random_case(int i) {
    scase c;
    memset(&c, 0, sizeof c);
    c.B = irand(1, 2);
    c.Hkv = irand(1, 3);
    c.H = c.Hkv * irand(1, 3);
    c.L = i % 5 == 0 ? irand(60, 140) : irand(1, 20);
    c.S = i % 7 == 0 ? irand(60, 200) : irand(1, 20);
    c.D = i % 6 == 0 ? 64 : irand(1, 17);
    c.Dv = i % 3 == 0 ? irand(1, 17) : c.D;
    c.causal = i % 2 == 1;
    c.custom_scale = i % 4 == 3;
    c.wl = i % 5 == 2 ? irand(0, 8) : -1;
    c.wr = i % 9 == 4 ? irand(0, 8) : -1;
    c.am = (int)(i % 4);
    c.kpm = i % 3 == 1;
    c.pad = i % 8 == 5 ? 3 : 0;
    c.softcap = i % 5 == 1 ? 1.5f : 0.0f;
    c.alibi = i % 6 == 2 ? 1 : i % 11 == 3 ? 2 : 0;
    c.sinks = i % 4 == 2;
    return c;
}

static void print_case(const scase *c) {
    printf("  case B %lld H %lld Hkv %lld L %lld S %lld D %lld Dv %lld causal %d scale %d "
           "window %lld/%lld attn_mask %d kpm %d pad %lld dropout %g seed %llu offset %llu "
           "softcap %g alibi %d sinks %d (shift %g, -inf %d)\n",
           (long long)c->B, (long long)c->H, (long long)c->Hkv, (long long)c->L,
           (long long)c->S, (long long)c->D, (long long)c->Dv, c->causal, c->custom_scale,
           (long long)c->wl, (long long)c->wr, c->am, c->kpm, (long long)c->pad, (double)c->p,
           (unsigned long long)c->seed, (unsigned long long)c->offset, (double)c->softcap,
           c->alibi, c->sinks, (double)c->sink_shift, c->sink_ninf);
}

// The largest |a - b| over a gradient, relative to 1 + max |b|.
static double grad_err(const mha_tensor *a, const mha_tensor *b) {
    double e = 0.0, mx = 0.0;
    const int64_t *d = a->shape;
    for (int64_t i0 = 0; i0 < d[0]; i0++)
        for (int64_t i1 = 0; i1 < d[1]; i1++)
            for (int64_t i2 = 0; i2 < d[2]; i2++)
                for (int64_t i3 = 0; i3 < d[3]; i3++) {
                    const int64_t oa = i0 * a->stride[0] + i1 * a->stride[1] +
                                       i2 * a->stride[2] + i3 * a->stride[3];
                    const int64_t ob = i0 * b->stride[0] + i1 * b->stride[1] +
                                       i2 * b->stride[2] + i3 * b->stride[3];
                    const double x = a->dtype == MHA_F64 ? ((double *)a->data)[oa]
                                                         : ((float *)a->data)[oa];
                    const double y = b->dtype == MHA_F64 ? ((double *)b->data)[ob]
                                                         : ((float *)b->data)[ob];
                    if (!(fabs(x - y) <= e)) e = fabs(x - y);  // (NaN: inf-like)
                    mx = fmax(mx, fabs(y));
                }
    return e / (1.0 + mx);
}

// The fused path against the reference, float32 views; the fused bits with
// 1 and 2 threads (with 2, fewer (b, KV head) items than threads take the
// path over tiles: the same bits).
static void fused_vs_reference_case(int i, scase c) {
    sbufs s;
    make_inputs(&s, &c, MHA_F32);
    sgrads gr, gf, g1;
    make_grads(&gr, &c, MHA_F32), make_grads(&gf, &c, MHA_F32), make_grads(&g1, &c, MHA_F32);
    mha_sdpa_args a;
    args_of(&a, &c, &s, MHA_IMPL_REFERENCE);
    // the forward (out and weights), then the gradients
    const int64_t od[4] = {c.B, c.H, c.L, c.Dv}, wd[4] = {c.B, c.H, c.L, c.S};
    float *o[2], *w[2];
    mha_tensor to[2], tw[2];
    for (int k = 0; k < 2; k++) {
        o[k] = calloc((size_t)prod4(od) + 1, sizeof(float));
        w[k] = calloc((size_t)prod4(wd) + 1, sizeof(float));
        to[k] = mha_tensor_contiguous(o[k], MHA_F32, 4, od);
        tw[k] = mha_tensor_contiguous(w[k], MHA_F32, 4, wd);
    }
    CHECK_OK(mha_sdpa(&to[0], &tw[0], &a));
    CHECK_OK(mha_sdpa_backward(&gr.tq, &gr.tk, &gr.tv, gr.ds, &s.tdo, &a));
    a.impl = c.pad ? MHA_IMPL_AUTO : MHA_IMPL_FUSED;  // (auto: fused, rows strided)
    CHECK_OK(mha_sdpa(&to[1], &tw[1], &a));
    const double eo = grad_err(&to[1], &to[0]), ew = grad_err(&tw[1], &tw[0]);
    const double ftol = 4e-6 * sqrt((double)c.S);
    CHECKF(eo <= ftol && ew <= ftol, "fused vs reference forward %d: out %.3g weights %.3g", i,
           eo, ew);
    if (!(eo <= ftol && ew <= ftol)) print_case(&c);
    for (int k = 0; k < 2; k++) free(o[k]), free(w[k]);
    CHECK_OK(mha_sdpa_backward(&gf.tq, &gf.tk, &gf.tv, gf.ds, &s.tdo, &a));
    const double eq = grad_err(&gf.tq, &gr.tq), ek = grad_err(&gf.tk, &gr.tk),
                 ev = grad_err(&gf.tv, &gr.tv);
    const double tol = 4e-6 * sqrt((double)(c.S + c.L));  // float32 sums of length ~S, L
    CHECKF(eq <= tol && ek <= tol && ev <= tol,
           "fused vs reference %d: dq %.3g dk %.3g dv %.3g > %.3g", i, eq, ek, ev, tol);
    if (!(eq <= tol && ek <= tol && ev <= tol)) print_case(&c);
    // the sinks: double sums over the B L rows of float32 stats and Dsum
    // (each a float32 sum over Dv, or over the S keys when saturated)
    const double es = sinks_err(gf.ds, gr.ds, c.H),
                 stol = 4e-6 * sqrt((double)(c.S + c.Dv + c.B * c.L));
    g_sinks_worst = fmax(g_sinks_worst, es / stol);
    CHECKF(es <= stol, "fused vs reference %d: dsinks %.3g > %.3g", i, es, stol);
    if (!(es <= stol)) print_case(&c);
#ifdef _OPENMP
    const int nt = omp_get_max_threads();
    omp_set_num_threads(1);
    CHECK_OK(mha_sdpa_backward(&g1.tq, &g1.tk, &g1.tv, g1.ds, &s.tdo, &a));
    omp_set_num_threads(nt < 2 ? 2 : nt);
    CHECK_OK(mha_sdpa_backward(&gf.tq, &gf.tk, &gf.tv, gf.ds, &s.tdo, &a));
    omp_set_num_threads(nt);
    const size_t bq = sizeof(float) * (size_t)prod4(gf.tq.shape),
                 bk = sizeof(float) * (size_t)prod4(gf.tk.shape),
                 bv = sizeof(float) * (size_t)prod4(gf.tv.shape);
    CHECKF(!memcmp(g1.dq, gf.dq, bq) && !memcmp(g1.dk, gf.dk, bk) &&
               !memcmp(g1.dv, gf.dv, bv) && sinks_same(g1.ds, gf.ds, c.H),
           "fused %d: 1 and 2 threads give different bits", i);
#endif
    free_grads(&gr), free_grads(&gf), free_grads(&g1);
    free_inputs(&s);
}

static void fused_vs_reference(int i) { fused_vs_reference_case(i, random_case(i)); }

// A batch of one over one KV head, large enough for two threads: the
// fused path over tiles (grouped-query heads, masks, causal, windows).
static void one_kv_head(int i) {
    scase c = random_case(i);
    c.B = 1, c.Hkv = 1, c.H = 1 + i % 3;
    c.L = 70 + 37 * i, c.S = 65 + 41 * i;
    fused_vs_reference_case(100 + i, c);
}

// sum(out * dout) of the reference forward on float64 views.
static double loss(const mha_sdpa_args *a0, const sbufs *s, const scase *c) {
    mha_sdpa_args a = *a0;
    a.impl = MHA_IMPL_REFERENCE;
    const int64_t od[4] = {c->B, c->H, c->L, c->Dv};
    double *o = calloc((size_t)prod4(od), sizeof(double));
    mha_tensor to = mha_tensor_contiguous(o, MHA_F64, 4, od);
    CHECK_OK(mha_sdpa(&to, NULL, &a));
    double l = 0.0;
    for (int64_t b = 0; b < c->B; b++)
        for (int64_t h = 0; h < c->H; h++)
            for (int64_t t = 0; t < c->L; t++)
                for (int64_t e = 0; e < c->Dv; e++)
                    l += o[((b * c->H + h) * c->L + t) * c->Dv + e] *
                         ((double *)s->dout)[b * s->tdo.stride[0] + h * s->tdo.stride[1] +
                                             t * s->tdo.stride[2] + e];
    free(o);
    return l;
}

// The reference gradients (float64 views) against central differences of
// the reference forward, a few elements of q, k and v per case.
static void finite_differences_case(int i, scase c) {
    c.L = c.L > 12 ? 12 : c.L, c.S = c.S > 12 ? 12 : c.S, c.D = c.D > 9 ? 9 : c.D;
    c.Dv = c.Dv > 9 ? 9 : c.Dv;
    sbufs s;
    make_inputs(&s, &c, MHA_F64);
    sgrads g;
    make_grads(&g, &c, MHA_F64);
    mha_sdpa_args a;
    args_of(&a, &c, &s, MHA_IMPL_AUTO);  // (auto on float64: the reference)
    CHECK_OK(mha_sdpa_backward(&g.tq, &g.tk, &g.tv, g.ds, &s.tdo, &a));
    double worst = 0.0;
    for (int which = 0; which < 3; which++) {
        const mha_tensor *x = which == 0 ? &s.tq : which == 1 ? &s.tk : &s.tv;
        const mha_tensor *gx = which == 0 ? &g.tq : which == 1 ? &g.tk : &g.tv;
        for (int r = 0; r < 4; r++) {
            int64_t idx[4], off = 0, goff = 0;
            for (int d = 0; d < 4; d++) {
                idx[d] = irand(0, x->shape[d] - 1);
                off += idx[d] * x->stride[d];
                goff += idx[d] * gx->stride[d];
            }
            double *p = (double *)x->data + off, x0 = *p, h = 1e-5;
            *p = x0 + h;
            const double lp = loss(&a, &s, &c);
            *p = x0 - h;
            const double lm = loss(&a, &s, &c);
            *p = x0;
            const double fd = (lp - lm) / (2 * h), an = ((double *)gx->data)[goff];
            const double err = fabs(fd - an) / (1.0 + fabs(an));
            worst = fmax(worst, err);
        }
    }
    // the sinks (float32 logits): steps of about 2^-12 (the float32
    // values taken); a sink of -inf has weight 0 and gradient 0
    for (int64_t hh = 0; c.sinks && hh < c.H; hh++) {
        const float x0 = s.sinks[hh], xp = x0 + 0x1p-12f, xm = x0 - 0x1p-12f;
        if (!isfinite(x0)) {
            CHECKF(g.ds[hh] == 0.0f, "finite differences %d: the -inf sink's gradient %g", i,
                   (double)g.ds[hh]);
            continue;
        }
        s.sinks[hh] = xp;
        const double lp = loss(&a, &s, &c);
        s.sinks[hh] = xm;
        const double lm = loss(&a, &s, &c);
        s.sinks[hh] = x0;
        const double fd = (lp - lm) / ((double)xp - (double)xm), an = g.ds[hh];
        const double err = fabs(fd - an) / (1.0 + fabs(an));
        worst = fmax(worst, err);
        g_sinks_fd_worst = fmax(g_sinks_fd_worst, err);
    }
    CHECKF(worst <= 1e-6, "finite differences %d: worst relative error %.3g", i, worst);
    if (!(worst <= 1e-6)) print_case(&c);
    free_grads(&g);
    free_inputs(&s);
}

static void finite_differences(int i) { finite_differences_case(i, random_case(i)); }

// The sinks' gradient (dsinks) on random configurations with sinks: with
// and without GQA, causal and not, rows the sinks dominate (shift 4) or a
// sink of -inf, dropout on some; fused vs reference (and its bits with 1
// and 2 threads), the reference against finite differences, and a batch
// of one over one KV head (the fused path over tiles).
static void sinks_case(int i) {
    scase c = random_case(500 + i);
    c.sinks = true;
    c.causal = i % 2 == 1;
    if (i % 4 < 2) c.H = c.Hkv;  // (else GQA: at least 2 query heads per KV head)
    else c.H = c.Hkv * (2 + i % 2);
    c.sink_shift = i % 3 == 1 ? 4.0f : 0.0f;
    c.sink_ninf = i % 5 == 3;
    if (i % 6 == 5) c.p = 0.3f, c.seed = 77 + (uint64_t)i, c.offset = (uint64_t)i;
    fused_vs_reference_case(500 + i, c);
    finite_differences_case(600 + i, c);
    c.B = 1, c.Hkv = 1, c.H = 1 + i % 3;
    c.L = 70 + 13 * i, c.S = 65 + 17 * i;
    fused_vs_reference_case(700 + i, c);
}

// bf16 q, k, v and dout with sinks, computed in bf16 (forced on tables
// without a bf16 unit) and in float32 on the converted rows: dsinks within
// a bf16 bound of the reference's on the same (rounded) values (the
// forward's O, whose Dsum the gradient takes, carries P's rounding to
// bf16: 2^-8 max|v| relative), the same bits with 1, 2 and 4 threads.
static void sinks_bf16(int i) {
    scase c = random_case(800 + i);
    c.sinks = true, c.causal = i % 2 == 1, c.pad = 0, c.p = 0.0f;
    c.H = c.Hkv * (1 + i % 3);
    sbufs s;
    make_inputs(&s, &c, MHA_F32);
    void *f32[4] = {s.q, s.k, s.v, s.dout};
    mha_tensor *t[4] = {&s.tq, &s.tk, &s.tv, &s.tdo};
    mha_tensor t16[4];
    uint16_t *b16[4];
    for (int j = 0; j < 4; j++) {  // the values rounded to bf16, in both
        const int64_t n = t[j]->shape[0] * t[j]->stride[0];
        b16[j] = malloc(sizeof(uint16_t) * (size_t)(n + 1));
        for (int64_t e = 0; e <= n; e++) {
            b16[j][e] = mha_f32_to_bf16(((float *)f32[j])[e]);
            ((float *)f32[j])[e] = mha_bf16_to_f32(b16[j][e]);
        }
        t16[j] = *t[j];
        t16[j].data = b16[j], t16[j].dtype = MHA_BF16;
    }
    mha_sdpa_args a;
    args_of(&a, &c, &s, MHA_IMPL_REFERENCE);
    sgrads gr, gb[3];
    make_grads(&gr, &c, MHA_F32);
    CHECK_OK(mha_sdpa_backward(&gr.tq, &gr.tk, &gr.tv, gr.ds, &s.tdo, &a));
    double vmax = 0.0;
    for (int64_t e = 0; e < prod4(s.tv.shape); e++) vmax = fmax(vmax, fabs(((float *)s.v)[e]));
    a.q = &t16[0], a.k = &t16[1], a.v = &t16[2];
    a.impl = MHA_IMPL_FUSED;
    for (int force = 0; force < 2; force++) {
        mha__flash_force_bf16(force == 1);
        const int threads[3] = {1, 2, 4};
        for (int r = 0; r < 3; r++) {
#ifdef _OPENMP
            omp_set_num_threads(threads[r]);
#endif
            make_grads(&gb[r], &c, MHA_F32);
            CHECK_OK(mha_sdpa_backward(&gb[r].tq, &gb[r].tk, &gb[r].tv, gb[r].ds, &t16[3], &a));
        }
        const bool bf = strstr(mha_last_impl(), " bf16") != NULL;
        // dsink_h = -sum_{b, i} P_sink Dsum_i, each Dsum_i = dO_i . O_i off by
        // the Dv elements' errors of O (2^-8 max|v| in bf16): summed as
        // independent errors over the Dv B L terms
        double dmax = 0.0;
        for (int64_t e = 0; e < prod4(s.tdo.shape); e++)
            dmax = fmax(dmax, fabs(((float *)s.dout)[e]));
        const double bound = (bf ? 0x1p-8 : 4e-6) * vmax * dmax *
                                 sqrt((double)(c.Dv * c.B * c.L)) +
                             1e-5;
        double worst = 0.0;
        for (int64_t h = 0; h < c.H; h++)
            worst = fmax(worst, fabs((double)gb[0].ds[h] - (double)gr.ds[h]));
        g_sinks_bf16_worst = fmax(g_sinks_bf16_worst, worst / bound);
        CHECKF(worst <= bound, "bf16 sinks %d (%s): dsinks off the reference by %.3g > %.3g",
               i, bf ? "bf16 compute" : "float32 compute", worst, bound);
        if (!(worst <= bound)) print_case(&c);
        for (int r = 1; r < 3; r++)
            CHECKF(sinks_same(gb[0].ds, gb[r].ds, c.H),
                   "bf16 sinks %d: dsinks bits differ at %d threads", i, threads[r]);
        for (int r = 0; r < 3; r++) free_grads(&gb[r]);
    }
    mha__flash_force_bf16(false);
#ifdef _OPENMP
    omp_set_num_threads(2);
#endif
    for (int j = 0; j < 4; j++) free(b16[j]);
    free_grads(&gr);
    free_inputs(&s);
}

// A row whose every key is masked: zero gradients from it (dq row 0), both
// paths.
static void fully_masked_row(void) {
    scase c = {
        .B = 1, .H = 2, .Hkv = 1, .L = 5, .S = 7, .D = 4, .Dv = 4, .wl = -1, .wr = -1, .am = 1};
    sbufs s;
    make_inputs(&s, &c, MHA_F32);
    uint8_t *m = s.am;
    for (int64_t j = 0; j < c.S; j++) m[2 * c.S + j] = 1;  // query row 2: every key masked
    for (int impl = 0; impl < 2; impl++) {
        sgrads g;
        make_grads(&g, &c, MHA_F32);
        mha_sdpa_args a;
        args_of(&a, &c, &s, impl ? MHA_IMPL_FUSED : MHA_IMPL_REFERENCE);
        CHECK_OK(mha_sdpa_backward(&g.tq, &g.tk, &g.tv, g.ds, &s.tdo, &a));
        bool zero = true, finite = true;
        for (int64_t h = 0; h < c.H; h++)
            for (int64_t e = 0; e < c.D; e++)
                zero = zero && ((float *)g.dq)[(h * c.L + 2) * c.D + e] == 0.0f;
        for (int64_t n = 0; n < c.S * c.D; n++)
            finite = finite && isfinite(((float *)g.dk)[n]) && isfinite(((float *)g.dv)[n]);
        CHECKF(zero && finite, "fully masked row (%s): dq row 0 and finite dk, dv",
               impl ? "fused" : "reference");
        free_grads(&g);
    }
    free_inputs(&s);
}

static void misuse(void) {
    scase c = {.B = 1, .H = 4, .Hkv = 2, .L = 3, .S = 5, .D = 4, .Dv = 4, .wl = -1, .wr = -1};
    sbufs s;
    make_inputs(&s, &c, MHA_F32);
    sgrads g;
    make_grads(&g, &c, MHA_F32);
    mha_sdpa_args a;
    args_of(&a, &c, &s, MHA_IMPL_AUTO);
    CHECK_FAILS(mha_sdpa_backward(&g.tq, &g.tk, &g.tv, g.ds, &s.tdo, NULL), MHA_ERR_INVALID_ARG);
    CHECK_FAILS(mha_sdpa_backward(NULL, &g.tk, &g.tv, g.ds, &s.tdo, &a), MHA_ERR_INVALID_ARG);
    CHECK(strstr(mha_last_error(), "dq is NULL") != NULL);
    CHECK_FAILS(mha_sdpa_backward(&g.tq, &g.tk, &g.tv, g.ds, NULL, &a), MHA_ERR_INVALID_ARG);
    mha_tensor bad = g.tk;
    bad.shape[1] = 4;  // dk shaped as q's heads
    bad.stride[0] = 4 * c.S * c.D;
    CHECK_FAILS(mha_sdpa_backward(&g.tq, &bad, &g.tv, g.ds, &s.tdo, &a), MHA_ERR_SHAPE);
    CHECK(strstr(mha_last_error(), "dk") != NULL);
    CHECK_FAILS(mha_sdpa_backward(&s.tq, &g.tk, &g.tv, g.ds, &s.tdo, &a), MHA_ERR_INVALID_ARG);
    CHECK(strstr(mha_last_error(), "overlaps") != NULL);
    CHECK_FAILS(mha_sdpa_backward(&g.tq, &g.tk, &g.tk, g.ds, &s.tdo, &a), MHA_ERR_INVALID_ARG);
    a.opts.window_left = -2;
    CHECK_FAILS(mha_sdpa_backward(&g.tq, &g.tk, &g.tv, g.ds, &s.tdo, &a), MHA_ERR_INVALID_ARG);
    a.opts.window_left = -1;
    // dsinks without opts.sinks: refused, naming both; dsinks over the
    // sinks or a gradient: refused (overlap)
    float dsinks[4], sinks[4] = {0.5f, -1.0f, 2.0f, 0.0f};
    CHECK_FAILS(mha_sdpa_backward(&g.tq, &g.tk, &g.tv, dsinks, &s.tdo, &a), MHA_ERR_INVALID_ARG);
    CHECK(strstr(mha_last_error(), "dsinks") && strstr(mha_last_error(), "opts.sinks"));
    a.opts.sinks = sinks;
    CHECK_FAILS(mha_sdpa_backward(&g.tq, &g.tk, &g.tv, sinks, &s.tdo, &a), MHA_ERR_INVALID_ARG);
    CHECK(strstr(mha_last_error(), "dsinks overlaps opts.sinks") != NULL);
    CHECK_FAILS(mha_sdpa_backward(&g.tq, &g.tk, &g.tv, (float *)g.dq + 1, &s.tdo, &a),
                MHA_ERR_INVALID_ARG);
    CHECK(strstr(mha_last_error(), "dsinks overlaps dq") != NULL);
    for (int impl = 0; impl < 2; impl++) {  // (a NULL dsinks with sinks: fine)
        a.impl = impl ? MHA_IMPL_FUSED : MHA_IMPL_REFERENCE;
        CHECK_OK(mha_sdpa_backward(&g.tq, &g.tk, &g.tv, NULL, &s.tdo, &a));
        CHECK_OK(mha_sdpa_backward(&g.tq, &g.tk, &g.tv, dsinks, &s.tdo, &a));
        CHECK(isfinite(dsinks[0]) && isfinite(dsinks[3]));
    }
    a.impl = MHA_IMPL_AUTO;
    a.opts.sinks = NULL;
    sgrads g64;
    make_grads(&g64, &c, MHA_F64);
    a.impl = MHA_IMPL_FUSED;  // fused with float64 gradients: refused, naming one
    CHECK_FAILS(mha_sdpa_backward(&g64.tq, &g64.tk, &g64.tv, g64.ds, &s.tdo, &a),
                MHA_ERR_UNSUPPORTED);
    CHECK(strstr(mha_last_error(), "dq is F64") != NULL);
    a.impl = MHA_IMPL_AUTO;  // auto: the reference writes float64 gradients
    CHECK_OK(mha_sdpa_backward(&g64.tq, &g64.tk, &g64.tv, g64.ds, &s.tdo, &a));
    free_grads(&g64);
    mha_tensor k3 = s.tk;  // 3 KV heads for 4 query heads: refused
    k3.shape[1] = 3;
    a.k = &k3;
    CHECK_FAILS(mha_sdpa_backward(&g.tq, &g.tk, &g.tv, g.ds, &s.tdo, &a), MHA_ERR_SHAPE);
    free_grads(&g);
    free_inputs(&s);
}

// ---------------------------------------------------------------------------
// Attention dropout

// Case i with dropout: p among 0.1 .. 0.9, a random seed and offset.
static scase dropout_case(int i) {
    static const float ps[4] = {0.1f, 0.25f, 0.5f, 0.9f};
    scase c = random_case(i);
    c.p = ps[(i / 2) % 4];
    c.seed = next();
    c.offset = next() % 1000;
    return c;
}

// out (B, H, L, Dv) and weights (B, H, L, S) of mha_sdpa, contiguous.
typedef struct sfwd {
    float *o, *w;
    mha_tensor to, tw;
} sfwd;

static void run_fwd(sfwd *f, const scase *c, const mha_sdpa_args *a) {
    const int64_t od[4] = {c->B, c->H, c->L, c->Dv}, wd[4] = {c->B, c->H, c->L, c->S};
    f->o = malloc(sizeof(float) * (size_t)prod4(od) + 1);
    f->w = malloc(sizeof(float) * (size_t)prod4(wd) + 1);
    f->to = mha_tensor_contiguous(f->o, MHA_F32, 4, od);
    f->tw = mha_tensor_contiguous(f->w, MHA_F32, 4, wd);
    CHECK_OK(mha_sdpa(&f->to, &f->tw, a));
}

static void free_fwd(sfwd *f) { free(f->o), free(f->w); }

// The number of elements where exactly one of a, b is 0 (the keep masks
// disagree; masked weights are 0 in both).
static int64_t zero_mismatches(const float *a, const float *b, int64_t n) {
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++) m += (a[i] == 0.0f) != (b[i] == 0.0f);
    return m;
}

// The forward with dropout, fused against the reference: out and weights
// (after dropout: the same zeros), and the fused bits with 1 and 2 threads.
static void dropout_forward_case(int i, const scase *c) {
    sbufs s;
    make_inputs(&s, c, MHA_F32);
    mha_sdpa_args a;
    args_of(&a, c, &s, MHA_IMPL_REFERENCE);
    sfwd r, f;
    run_fwd(&r, c, &a);
    a.impl = MHA_IMPL_FUSED;
    run_fwd(&f, c, &a);
    const int64_t no = prod4(r.to.shape), nw = prod4(r.tw.shape);
    const double eo = rel_err(r.o, f.o, no), ew = rel_err(r.w, f.w, nw);
    const int64_t zm = zero_mismatches(r.w, f.w, nw);
    CHECKF(eo <= 2e-5 && ew <= 2e-5 && zm == 0,
           "dropout forward %d: out %.3g weights %.3g (> 2e-5), %lld weights zero in one "
           "only",
           i, eo, ew, (long long)zm);
    if (!(eo <= 2e-5 && ew <= 2e-5 && zm == 0)) print_case(c);
#ifdef _OPENMP
    const int nt = omp_get_max_threads();
    sfwd f1;
    omp_set_num_threads(1);
    run_fwd(&f1, c, &a);
    omp_set_num_threads(nt < 2 ? 2 : nt);
    free_fwd(&f);
    run_fwd(&f, c, &a);
    omp_set_num_threads(nt);
    CHECKF(!memcmp(f1.o, f.o, sizeof(float) * (size_t)no) &&
               !memcmp(f1.w, f.w, sizeof(float) * (size_t)nw),
           "dropout forward %d: 1 and 2 threads give different bits", i);
    free_fwd(&f1);
#endif
    free_fwd(&r), free_fwd(&f);
    free_inputs(&s);
}

// Forward and backward with dropout, fused against the reference, on
// random configurations (GQA, masks, causal, windows, strided rows).
static void dropout_fused_vs_reference(int i) {
    const scase c = dropout_case(i);
    dropout_forward_case(200 + i, &c);
    fused_vs_reference_case(200 + i, c);
}

// A batch of one over one KV head with dropout, large enough for two
// threads (the backward over tiles).
static void dropout_one_kv_head(int i) {
    scase c = dropout_case(i);
    c.B = 1, c.Hkv = 1, c.H = 1 + i % 3;
    c.L = 70 + 37 * i, c.S = 65 + 41 * i;
    dropout_forward_case(300 + i, &c);
    fused_vs_reference_case(300 + i, c);
}

// dropout_p = 0 with any seed and offset: the very bits of the call
// without dropout (args_init's), forward and backward, both paths.
static void dropout_zero_same_bits(int i) {
    scase c = random_case(i), c0 = c;
    c.seed = next(), c.offset = next();
    sbufs s;
    make_inputs(&s, &c, MHA_F32);
    for (int impl = 0; impl < 2; impl++) {
        mha_sdpa_args a, a0;
        const mha_impl im = impl ? MHA_IMPL_FUSED : MHA_IMPL_REFERENCE;
        args_of(&a, &c, &s, im), args_of(&a0, &c0, &s, im);
        sfwd f, f0;
        run_fwd(&f, &c, &a), run_fwd(&f0, &c0, &a0);
        sgrads g, g0;
        make_grads(&g, &c, MHA_F32), make_grads(&g0, &c, MHA_F32);
        CHECK_OK(mha_sdpa_backward(&g.tq, &g.tk, &g.tv, g.ds, &s.tdo, &a));
        CHECK_OK(mha_sdpa_backward(&g0.tq, &g0.tk, &g0.tv, g0.ds, &s.tdo, &a0));
        CHECKF(!memcmp(f.o, f0.o, sizeof(float) * (size_t)prod4(f.to.shape)) &&
                   !memcmp(f.w, f0.w, sizeof(float) * (size_t)prod4(f.tw.shape)) &&
                   !memcmp(g.dq, g0.dq, sizeof(float) * (size_t)prod4(g.tq.shape)) &&
                   !memcmp(g.dk, g0.dk, sizeof(float) * (size_t)prod4(g.tk.shape)) &&
                   !memcmp(g.dv, g0.dv, sizeof(float) * (size_t)prod4(g.tv.shape)) &&
                   sinks_same(g.ds, g0.ds, c.H),
               "dropout_p 0 (%s) %d: not the bits of no dropout", impl ? "fused" : "reference",
               i);
        free_fwd(&f), free_fwd(&f0), free_grads(&g), free_grads(&g0);
    }
    free_inputs(&s);
}

// The keep rule mha.h documents for weight (b, h, i, j), from the public
// Philox: word idx % 4 of philox(ctr {idx / 4, offset}, key seed).
static bool documented_keep(const scase *c, int64_t b, int64_t h, int64_t i, int64_t j) {
    const uint64_t idx = (uint64_t)(((b * c->H + h) * c->L + i) * c->S + j), blk = idx / 4;
    const uint32_t ctr[4] = {(uint32_t)blk, (uint32_t)(blk >> 32), (uint32_t)c->offset,
                             (uint32_t)(c->offset >> 32)},
                   key[2] = {(uint32_t)c->seed, (uint32_t)(c->seed >> 32)};
    uint32_t r[4];
    mha_philox4x32_10(r, ctr, key);
    return (float)(r[idx % 4] >> 8) * 0x1p-24f >= c->p;
}

// No masks, grouped-query heads: the weights after dropout are 0 exactly
// where the documented rule drops (per query head), elsewhere the
// no-dropout weights times 1/(1-p); the zeroed fraction within 5 standard
// deviations of p; a new offset, a new mask.
static void dropout_statistics(void) {
    scase c = {.B = 2,
               .H = 4,
               .Hkv = 2,
               .L = 90,
               .S = 110,
               .D = 16,
               .Dv = 8,
               .wl = -1,
               .wr = -1,
               .p = 0.3f,
               .seed = 0x9E3779B97F4A7C15ull,
               .offset = 5};
    scase c0 = c;
    c0.p = 0.0f;
    sbufs s;
    make_inputs(&s, &c, MHA_F32);
    const int64_t n = c.B * c.H * c.L * c.S;
    for (int impl = 0; impl < 2; impl++) {
        const mha_impl im = impl ? MHA_IMPL_FUSED : MHA_IMPL_REFERENCE;
        mha_sdpa_args a, a0;
        args_of(&a, &c, &s, im), args_of(&a0, &c0, &s, im);
        sfwd f, f0, f2;
        run_fwd(&f, &c, &a), run_fwd(&f0, &c0, &a0);
        int64_t zeros = 0, rule = 0, scaled = 0;
        for (int64_t b = 0; b < c.B; b++)
            for (int64_t h = 0; h < c.H; h++)
                for (int64_t i = 0; i < c.L; i++)
                    for (int64_t j = 0; j < c.S; j++) {
                        const int64_t e = ((b * c.H + h) * c.L + i) * c.S + j;
                        const bool keep = documented_keep(&c, b, h, i, j);
                        zeros += f.w[e] == 0.0f;
                        rule += keep != (f.w[e] != 0.0f);
                        const double want = f0.w[e] / (1.0 - (double)c.p);
                        scaled += keep && !(fabs(f.w[e] - want) <= 1e-6 * want);
                    }
        const double frac = (double)zeros / (double)n,
                     sd = sqrt((double)c.p * (1.0 - c.p) / (double)n);
        const char *name = impl ? "fused" : "reference";
        CHECKF(rule == 0, "dropout (%s): %lld weights against the documented keep rule", name,
               (long long)rule);
        CHECKF(scaled == 0, "dropout (%s): %lld kept weights not w / (1 - p)", name,
               (long long)scaled);
        CHECKF(fabs(frac - c.p) <= 5 * sd, "dropout (%s): zeroed fraction %.4f, p %.2f", name,
               frac, (double)c.p);
        a.opts.dropout_offset++;  // the next step's mask
        run_fwd(&f2, &c, &a);
        const int64_t moved = zero_mismatches(f.w, f2.w, n);
        CHECKF(fabs((double)moved / n - 2 * c.p * (1 - c.p)) <= 10 * sd,
               "dropout (%s): offset + 1 changes %lld of %lld keep decisions", name,
               (long long)moved, (long long)n);
        free_fwd(&f), free_fwd(&f0), free_fwd(&f2);
    }
    free_inputs(&s);
}

// dropout_p out of [0, 1) or NaN: refused by both entry points, naming it.
static void dropout_misuse(void) {
    scase c = {.B = 1, .H = 4, .Hkv = 2, .L = 3, .S = 5, .D = 4, .Dv = 4, .wl = -1, .wr = -1};
    sbufs s;
    make_inputs(&s, &c, MHA_F32);
    sgrads g;
    make_grads(&g, &c, MHA_F32);
    float o[48];
    mha_tensor to = mha_tensor_contiguous(o, MHA_F32, 4, (int64_t[]){1, 4, 3, 4});
    const float bad[3] = {-0.1f, 1.0f, NAN};
    for (int impl = 0; impl < 3; impl++)
        for (int i = 0; i < 3; i++) {
            mha_sdpa_args a;
            args_of(&a, &c, &s, (mha_impl)impl);
            a.opts.dropout_p = bad[i];
            CHECK_FAILS(mha_sdpa(&to, NULL, &a), MHA_ERR_INVALID_ARG);
            CHECK(strstr(mha_last_error(), "dropout_p") != NULL);
            CHECK_FAILS(mha_sdpa_backward(&g.tq, &g.tk, &g.tv, g.ds, &s.tdo, &a),
                        MHA_ERR_INVALID_ARG);
            CHECK(strstr(mha_last_error(), "dropout_p") != NULL);
        }
    mha_sdpa_args a;
    args_of(&a, &c, &s, MHA_IMPL_AUTO);
    a.opts.dropout_p = 0.999f;  // just below 1: allowed
    CHECK_OK(mha_sdpa(&to, NULL, &a));
    CHECK_OK(mha_sdpa_backward(&g.tq, &g.tk, &g.tv, g.ds, &s.tdo, &a));
    free_grads(&g);
    free_inputs(&s);
}

// args.save (a training forward's state): for random cases (dropout on
// some), float32 and bf16 tensors, 1 and 2 threads (per head and over
// tiles): mha_sdpa's out is the same bits with and without it, and
// mha_sdpa_backward from it gives the bits of the backward that computes
// the forward's rows again; the state of another call (other options) is
// refused; one from the reference path is not used (the same bits).
static void saved_state(int i) {
    scase c = random_case(i);
    if (i % 3 == 0) c.p = 0.25f, c.seed = 5 + (uint64_t)i, c.offset = (uint64_t)i;
    const mha_dtype dts[2] = {MHA_F32, MHA_BF16};
    for (int di = 0; di < 2; di++) {
        const mha_dtype dt = dts[di];
        sbufs s;
        make_inputs(&s, &c, MHA_F32);
        if (dt == MHA_BF16) {  // the same values as bf16 views
            void *h[4] = {s.q, s.k, s.v, s.dout};
            mha_tensor *t[4] = {&s.tq, &s.tk, &s.tv, &s.tdo};
            for (int j = 0; j < 4; j++) {
                const int64_t n = t[j]->shape[0] * t[j]->stride[0];
                uint16_t *b = malloc(sizeof(uint16_t) * (size_t)(n + 1));
                for (int64_t e = 0; e <= n; e++) b[e] = mha_f32_to_bf16(((float *)h[j])[e]);
                free(h[j]);
                t[j]->data = b, t[j]->dtype = MHA_BF16;
            }
            s.q = s.tq.data, s.k = s.tk.data, s.v = s.tv.data, s.dout = s.tdo.data;
        }
        const int64_t od[4] = {c.B, c.H, c.L, c.Dv};
        mha_tensor to1, to2;
        void *o1 = make4(&to1, MHA_F32, od, 0, 0.0), *o2 = make4(&to2, MHA_F32, od, 0, 0.0);
        to1.dtype = to2.dtype = dt;  // (half views use the first half of the buffer)
        for (int nt = 1; nt <= 2; nt++) {
#ifdef _OPENMP
            omp_set_num_threads(nt);
#endif
            mha_sdpa_args a;
            args_of(&a, &c, &s, MHA_IMPL_FUSED);
            sgrads g1, g2;
            make_grads(&g1, &c, MHA_F32), make_grads(&g2, &c, MHA_F32);
            CHECK_OK(mha_sdpa(&to1, NULL, &a));
            CHECK_OK(mha_sdpa_backward(&g1.tq, &g1.tk, &g1.tv, g1.ds, &s.tdo, &a));
            mha_saved *sv = NULL;
            CHECK_OK(mha_saved_create(&sv));
            a.save = sv;
            CHECK_OK(mha_sdpa(&to2, NULL, &a));
            CHECK_OK(mha_sdpa_backward(&g2.tq, &g2.tk, &g2.tv, g2.ds, &s.tdo, &a));
            const size_t on = (size_t)prod4(od) * mha_dtype_size(dt);
            CHECKF(memcmp(o1, o2, on) == 0, "case %d %s %d threads: out differs with save", i,
                   mha_dtype_name(dt), nt);
            const int64_t nq = c.B * c.H * c.L * c.D, nk = c.B * c.Hkv * c.S * c.D,
                          nv = c.B * c.Hkv * c.S * c.Dv;
            CHECKF(memcmp(g1.dq, g2.dq, sizeof(float) * (size_t)nq) == 0 &&
                       memcmp(g1.dk, g2.dk, sizeof(float) * (size_t)nk) == 0 &&
                       memcmp(g1.dv, g2.dv, sizeof(float) * (size_t)nv) == 0 &&
                       sinks_same(g1.ds, g2.ds, c.H),
                   "case %d %s %d threads: the backward from the saved state differs", i,
                   mha_dtype_name(dt), nt);
            // another call's state: refused
            a.opts.is_causal = !a.opts.is_causal;
            CHECK_FAILS(mha_sdpa_backward(&g2.tq, &g2.tk, &g2.tv, g2.ds, &s.tdo, &a),
                        MHA_ERR_INVALID_ARG);
            CHECK(strstr(mha_last_error(), "args.save") != NULL);
            a.opts.is_causal = !a.opts.is_causal;
            // the reference forward keeps nothing: the backward recomputes
            a.impl = MHA_IMPL_REFERENCE;
            if (dt == MHA_F32) {
                CHECK_OK(mha_sdpa(&to2, NULL, &a));
                a.impl = MHA_IMPL_FUSED;
                CHECK_OK(mha_sdpa_backward(&g2.tq, &g2.tk, &g2.tv, g2.ds, &s.tdo, &a));
                CHECK(memcmp(g1.dq, g2.dq, sizeof(float) * (size_t)nq) == 0);
            }
            mha_saved_destroy(sv);
            free_grads(&g1), free_grads(&g2);
        }
        free(o1), free(o2);
        free_inputs(&s);
    }
}

int main(void) {
    seed_rng(20261201);
    for (int i = 0; i < 80; i++) fused_vs_reference(i);
    for (int i = 0; i < 6; i++) one_kv_head(i);
    for (int i = 0; i < 40; i++) finite_differences(i);
    fully_masked_row();
    misuse();
    for (int i = 0; i < 60; i++) dropout_fused_vs_reference(i);
    for (int i = 0; i < 4; i++) dropout_one_kv_head(i);
    for (int i = 0; i < 30; i++) finite_differences_case(400 + i, dropout_case(i));
    for (int i = 0; i < 8; i++) dropout_zero_same_bits(i);
    dropout_statistics();
    dropout_misuse();
    for (int i = 0; i < 24; i++) saved_state(i);
    for (int i = 0; i < 24; i++) sinks_case(i);
    for (int i = 0; i < 6; i++) sinks_bf16(i);
    printf("sinks' gradient: fused vs reference worst error / tolerance %.3g (bf16 inputs "
           "%.3g), finite differences worst %.3g\n",
           g_sinks_worst, g_sinks_bf16_worst, g_sinks_fd_worst);
    return check_summary("test_sdpa_backward");
}
