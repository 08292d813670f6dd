// test_dense.c: the dense layer mha_linear (y = x W^T + b) against a
// float64 reference on random shapes (rows 1 to a few hundred, odd in and
// out sizes, K past the 256-chunk of the SIMD sum order), F32/BF16/F16
// weights, with and without a bias (F32 or half), every layout of x, y and
// the weight (contiguous, batched (B, L, I), seq-first storage, padded
// rows, feature stride 2, flipped rows, 4-D with a size-1 dim, 1-D,
// transposed and flipped weights). The tolerance is the project's rule
// with float32's own error measured by a naive float32 dot product:
// |y - ref| <= max(4 x float32's error, 4e-6 (1 + max|ref|)). Every layout
// gives the bits of the contiguous one; the bits do not depend on the
// number of threads (1, 2, 8: packing and GEMM), on how many rows share a
// call, and equal the module's own fused output projection (a one-key
// attention whose V projection is the identity: ctx = x, out = x W_o^T +
// b_o). Every error path: status and message content. Bytes of y's buffer
// outside its view are never written.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "check.h"
#include "mha.h"
#include "util.h"

#define SENTINEL 12345.0f

// The message must contain every one of the given substrings (NULL ends).
static void msg_has(const char *a, const char *b, const char *c) {
    const char *m = mha_last_error();
    CHECKF(strstr(m, a) && (!b || strstr(m, b)) && (!c || strstr(m, c)),
           "message \"%s\" lacks \"%s\" / \"%s\" / \"%s\"", m, a, b ? b : "", c ? c : "");
}

// ---------------------------------------------------------------------------
// Views of a logical (R, F) float matrix, R = B L, in a buffer of their own

enum {
    LAY_2D,         // (R, F) contiguous
    LAY_3D,         // (B, L, F) contiguous
    LAY_SEQ_FIRST,  // (B, L, F) over an (L, B, F) buffer: rows not evenly spaced
    LAY_FSTRIDE2,   // (R, F) with feature stride 2
    LAY_PADDED,     // (B, L, F) rows F + 3 apart
    LAY_FLIPPED,    // (R, F) rows in reverse order (row stride -F)
    LAY_4D,         // (B, 1, L, F), the size-1 dim with an odd stride
    LAY_1D,         // (F), one row only
    LAY_COUNT
};
static const char *lay_name[LAY_COUNT] = {"2d",     "3d",      "seq-first", "fstride2",
                                          "padded", "flipped", "4d",        "1d"};

// Layouts of the same leading dims (x and y must agree): 2-D, 3-D, 4-D, 1-D.
static int group_of(int lay) {
    return lay == LAY_2D || lay == LAY_FSTRIDE2 || lay == LAY_FLIPPED ? 0
           : lay == LAY_4D                                            ? 2
           : lay == LAY_1D                                            ? 3
                                                                      : 1;
}

typedef struct view {
    float *buf;
    size_t n;  // floats in buf
    mha_tensor t;
    int64_t B, L, F;
} view;

static void view_make(view *v, int lay, int64_t B, int64_t L, int64_t F) {
    const int64_t R = B * L;
    v->B = B, v->L = L, v->F = F;
    size_t n = (size_t)(R * F);
    mha_tensor *t = &v->t;
    memset(t, 0, sizeof *t);
    t->dtype = MHA_F32;
    int64_t off = 0;
    switch (lay) {
    case LAY_2D: *t = mha_tensor_contiguous(NULL, MHA_F32, 2, (int64_t[]){R, F}); break;
    case LAY_3D: *t = mha_tensor_contiguous(NULL, MHA_F32, 3, (int64_t[]){B, L, F}); break;
    case LAY_SEQ_FIRST:
        t->ndim = 3;
        t->shape[0] = B, t->shape[1] = L, t->shape[2] = F;
        t->stride[0] = F, t->stride[1] = B * F, t->stride[2] = 1;
        break;
    case LAY_FSTRIDE2:
        t->ndim = 2;
        t->shape[0] = R, t->shape[1] = F;
        t->stride[0] = 2 * F, t->stride[1] = 2;
        n = (size_t)(2 * R * F);
        break;
    case LAY_PADDED:
        t->ndim = 3;
        t->shape[0] = B, t->shape[1] = L, t->shape[2] = F;
        t->stride[0] = L * (F + 3), t->stride[1] = F + 3, t->stride[2] = 1;
        n = (size_t)(R * (F + 3));
        break;
    case LAY_FLIPPED:
        t->ndim = 2;
        t->shape[0] = R, t->shape[1] = F;
        t->stride[0] = -F, t->stride[1] = 1;
        off = (R - 1) * F;
        break;
    case LAY_4D:
        t->ndim = 4;
        t->shape[0] = B, t->shape[1] = 1, t->shape[2] = L, t->shape[3] = F;
        t->stride[0] = L * F, t->stride[1] = 12345, t->stride[2] = F, t->stride[3] = 1;
        break;
    case LAY_1D: *t = mha_tensor_contiguous(NULL, MHA_F32, 1, (int64_t[]){F}); break;
    }
    v->n = n;
    v->buf = malloc(sizeof(float) * (n + 1));
    for (size_t i = 0; i <= n; i++) v->buf[i] = SENTINEL;
    t->data = v->buf + off;
}

// Element offset of logical (r, f) from t.data.
static int64_t view_off(const view *v, int64_t r, int64_t f) {
    const mha_tensor *t = &v->t;
    int64_t off = f * t->stride[t->ndim - 1];
    for (int d = t->ndim - 2; d >= 0; d--) {
        off += (r % t->shape[d]) * t->stride[d];
        r /= t->shape[d];
    }
    return off;
}

static void view_set(view *v, const float *vals) {
    for (int64_t r = 0; r < v->B * v->L; r++)
        for (int64_t f = 0; f < v->F; f++)
            ((float *)v->t.data)[view_off(v, r, f)] = vals[r * v->F + f];
}
static void view_get(float *vals, const view *v) {
    for (int64_t r = 0; r < v->B * v->L; r++)
        for (int64_t f = 0; f < v->F; f++)
            vals[r * v->F + f] = ((const float *)v->t.data)[view_off(v, r, f)];
}
// Floats of the buffer still SENTINEL (for y: those outside the view).
static size_t view_untouched(const view *v) {
    size_t k = 0;
    for (size_t i = 0; i <= v->n; i++) k += v->buf[i] == SENTINEL;
    return k;
}

// ---------------------------------------------------------------------------
// Weights: values rounded to the dtype, stored in a layout

enum { WL_ROWS, WL_TRANSPOSED, WL_PADDED, WL_FLIPPED, WL_COUNT };
static const char *wl_name[WL_COUNT] = {"rows", "transposed", "padded", "flipped"};

typedef struct wview {
    void *buf;
    mha_tensor t;
} wview;

static float round_to(float x, mha_dtype dt) {
    if (dt == MHA_BF16) return mha_bf16_to_f32(mha_f32_to_bf16(x));
    if (dt == MHA_F16) return mha_f16_to_f32(mha_f32_to_f16(x));
    return x;
}

// w (O, I) float values (already representable in dt) as a dt view in layout wl.
static void wview_make(wview *w, const float *vals, int64_t O, int64_t I, mha_dtype dt, int wl) {
    const size_t es = mha_dtype_size(dt);
    const int64_t ld = wl == WL_PADDED ? I + 5 : I;
    const size_t n = (size_t)(O * ld + 1);
    w->buf = calloc(n, es);
    mha_tensor *t = &w->t;
    memset(t, 0, sizeof *t);
    t->dtype = dt;
    t->ndim = 2;
    t->shape[0] = O, t->shape[1] = I;
    int64_t off = 0;
    switch (wl) {
    case WL_ROWS: t->stride[0] = I, t->stride[1] = 1; break;
    case WL_TRANSPOSED: t->stride[0] = 1, t->stride[1] = O; break;
    case WL_PADDED: t->stride[0] = I + 5, t->stride[1] = 1; break;
    case WL_FLIPPED:  // columns reversed
        t->stride[0] = I, t->stride[1] = -1;
        off = I - 1;
        break;
    }
    for (int64_t o = 0; o < O; o++)
        for (int64_t i = 0; i < I; i++) {
            const int64_t e = off + o * t->stride[0] + i * t->stride[1];
            const float x = vals[o * I + i];
            if (dt == MHA_F32) ((float *)w->buf)[e] = x;
            else if (dt == MHA_BF16) ((uint16_t *)w->buf)[e] = mha_f32_to_bf16(x);
            else ((uint16_t *)w->buf)[e] = mha_f32_to_f16(x);
        }
    t->data = (char *)w->buf + off * (int64_t)es;
}

// ---------------------------------------------------------------------------
// Against float64, every layout

// The float32 rule's floor: F32_FLOOR * (1 + max|ref|).
#define F32_FLOOR 4e-6

static int64_t g_cases, g_layout_runs;
static double g_worst_ratio;  // max over cases of err / tol
static char g_worst_at[160];  // that case

static void one_case(int64_t B, int64_t L, int64_t I, int64_t O, mha_dtype wdt, int bias_kind) {
    const int64_t R = B * L;
    float *wv = malloc(sizeof(float) * (size_t)(O * I + 1));
    float *bv = malloc(sizeof(float) * (size_t)(O + 1));
    float *xv = malloc(sizeof(float) * (size_t)(R * I + 1));
    for (int64_t k = 0; k < O * I; k++) wv[k] = round_to(frand() / 4, wdt);
    // bias_kind: 0 none, 1 F32, 2 the weight's dtype (half when it is)
    const mha_dtype bdt = bias_kind == 2 ? wdt : MHA_F32;
    for (int64_t o = 0; o < O; o++) bv[o] = round_to(frand(), bdt);
    for (int64_t k = 0; k < R * I; k++) xv[k] = 2 * frand();
    // references: float64, and a naive float32 chain (float32's own error)
    double *ref = malloc(sizeof(double) * (size_t)(R * O + 1));
    double err32 = 0, mref = 0;
    for (int64_t r = 0; r < R; r++)
        for (int64_t o = 0; o < O; o++) {
            double s = bias_kind ? bv[o] : 0.0;
            float s32 = 0.0f;
            for (int64_t i = 0; i < I; i++) {
                s += (double)xv[r * I + i] * (double)wv[o * I + i];
                s32 += xv[r * I + i] * wv[o * I + i];
            }
            s32 += bias_kind ? bv[o] : 0.0f;
            ref[r * O + o] = s;
            err32 = fmax(err32, fabs((double)s32 - s));
            mref = fmax(mref, fabs(s));
        }
    const double tol = fmax(4 * err32, F32_FLOOR * (1 + mref));

    // the contiguous case: the numbers, and the bits every layout must give
    wview w0;
    wview_make(&w0, wv, O, I, wdt, WL_ROWS);
    uint16_t *bh = malloc(sizeof(uint16_t) * (size_t)(O + 1));
    for (int64_t o = 0; o < O; o++)
        bh[o] = bdt == MHA_BF16 ? mha_f32_to_bf16(bv[o]) : mha_f32_to_f16(bv[o]);
    mha_tensor bt = mha_tensor_contiguous(bdt == MHA_F32 ? (void *)bv : (void *)bh, bdt, 1,
                                          (int64_t[]){O});
    mha_linear *l = NULL;
    CHECK_OK(mha_linear_create(&l, &w0.t, bias_kind ? &bt : NULL));
    float *y0 = malloc(sizeof(float) * (size_t)(R * O + 1));
    float *y1 = malloc(sizeof(float) * (size_t)(R * O + 1));
    mha_tensor xt = mha_tensor_contiguous(xv, MHA_F32, 2, (int64_t[]){R, I});
    mha_tensor yt = mha_tensor_contiguous(y0, MHA_F32, 2, (int64_t[]){R, O});
    CHECK_OK(mha_linear_forward(l, &yt, &xt));
    double err = 0;
    for (int64_t k = 0; k < R * O; k++) err = fmax(err, fabs((double)y0[k] - ref[k]));
    CHECKF(err <= tol,
           "R %lld (B %lld, L %lld), I %lld, O %lld, weight %s, bias %d: max|y - "
           "ref| %.3g > tol %.3g (float32 naive %.3g)",
           (long long)R, (long long)B, (long long)L, (long long)I, (long long)O,
           mha_dtype_name(wdt), bias_kind, err, tol, err32);
    if (err / tol > g_worst_ratio) {
        g_worst_ratio = err / tol;
        snprintf(g_worst_at, sizeof g_worst_at, "R %lld, I %lld, O %lld, weight %s, bias %s",
                 (long long)R, (long long)I, (long long)O, mha_dtype_name(wdt),
                 bias_kind ? mha_dtype_name(bdt) : "none");
    }
    printf("R %4lld = %3lld x %3lld, I %4lld, O %4lld, weight %-4s, bias %-4s: max|err| %.3g, "
           "tol %.3g\n",
           (long long)R, (long long)B, (long long)L, (long long)I, (long long)O,
           mha_dtype_name(wdt), bias_kind ? mha_dtype_name(bdt) : "none", err, tol);
    g_cases++;

    // every layout of x and y, and of the weight: the same bits
    for (int wl = 0; wl < WL_COUNT; wl++) {
        wview w;
        wview_make(&w, wv, O, I, wdt, wl);
        mha_linear *lw = NULL;
        CHECK_OK(mha_linear_create(&lw, &w.t, bias_kind ? &bt : NULL));
        free(w.buf);  // the layer keeps no pointer into it
        // the row-major weight with every pair of x and y layouts of the
        // same leading dims (up to 4M multiply-adds), the others with a few
        const bool all = wl == WL_ROWS && (double)R * (double)I * (double)O <= 4e6;
        for (int pair = 0; pair < LAY_COUNT * LAY_COUNT && lw; pair++) {
            const int lx = pair / LAY_COUNT, ly = pair % LAY_COUNT;
            if (!all && ly != (lx * 3 + wl + (int)(R % 5)) % LAY_COUNT) continue;
            if (group_of(lx) != group_of(ly) || (lx == LAY_1D && R != 1)) continue;
            view vx, vy;
            view_make(&vx, lx, B, L, I);
            view_make(&vy, ly, B, L, O);
            view_set(&vx, xv);
            CHECK_OK(mha_linear_forward(lw, &vy.t, &vx.t));
            view_get(y1, &vy);
            CHECKF(!memcmp(y0, y1, sizeof(float) * (size_t)(R * O)),
                   "R %lld, I %lld, O %lld, %s weight %s, x %s, y %s: not the contiguous "
                   "case's bits",
                   (long long)R, (long long)I, (long long)O, mha_dtype_name(wdt), wl_name[wl],
                   lay_name[lx], lay_name[ly]);
            const size_t outside = vy.n + 1 - (size_t)(R * O);
            CHECKF(view_untouched(&vy) == outside, "y %s: %zu floats outside the view written",
                   lay_name[ly], outside - view_untouched(&vy));
            free(vx.buf);
            free(vy.buf);
            g_layout_runs++;
        }
        mha_linear_destroy(lw);
    }
    // 4 rows from the middle alone: the same bits as within the batch
    if (R > 4) {
        const int64_t r0 = R / 3;
        mha_tensor xs = mha_tensor_contiguous(xv + r0 * I, MHA_F32, 2, (int64_t[]){4, I});
        mha_tensor ys = mha_tensor_contiguous(y1, MHA_F32, 2, (int64_t[]){4, O});
        CHECK_OK(mha_linear_forward(l, &ys, &xs));
        CHECKF(!memcmp(y1, y0 + r0 * O, sizeof(float) * (size_t)(4 * O)),
               "rows %lld..%lld alone differ from the same rows in a call of %lld",
               (long long)r0, (long long)r0 + 3, (long long)R);
    }
    mha_linear_destroy(l);
    free(w0.buf);
    free(bh);
    free(wv), free(bv), free(xv), free(ref), free(y0), free(y1);
}

static void random_cases(void) {
    // fixed ones: one row, one feature, K past 256 (two chunks), sizes
    // around the panel widths
    static const int64_t fixed[][4] = {{1, 1, 1, 1},     {1, 1, 7, 3},      {1, 3, 1, 1},
                                       {2, 5, 17, 33},   {1, 300, 257, 65}, {3, 97, 517, 15},
                                       {1, 13, 96, 384}, {4, 25, 384, 1536}};
    const mha_dtype dts[3] = {MHA_F32, MHA_BF16, MHA_F16};
    for (size_t c = 0; c < sizeof fixed / sizeof fixed[0]; c++)
        one_case(fixed[c][0], fixed[c][1], fixed[c][2], fixed[c][3], dts[c % 3], (int)(c % 3));
    for (int c = 0; c < 30; c++) {
        const int64_t B = irand(1, 4), L = irand(1, 90);
        const int64_t I = 2 * irand(0, 160) + 1, O = 2 * irand(0, 150) + 1;
        one_case(B, L, I, O, dts[c % 3], (int)irand(0, 2));
    }
}

// ---------------------------------------------------------------------------
// Empty sizes: I = 0 gives the bias, O = 0 or no rows write nothing

static void empty_sizes(void) {
    float b[5] = {1, -2, 3, -4, 5}, y[3 * 5], x[3];
    mha_tensor w0 = mha_tensor_contiguous(b, MHA_F32, 2, (int64_t[]){5, 0});
    mha_tensor bt = mha_tensor_contiguous(b, MHA_F32, 1, (int64_t[]){5});
    mha_linear *l = NULL;
    CHECK_OK(mha_linear_create(&l, &w0, &bt));
    mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 2, (int64_t[]){3, 0});
    mha_tensor yt = mha_tensor_contiguous(y, MHA_F32, 2, (int64_t[]){3, 5});
    for (int k = 0; k < 15; k++) y[k] = SENTINEL;
    CHECK_OK(mha_linear_forward(l, &yt, &xt));
    bool ok = true;
    for (int k = 0; k < 15; k++) ok &= y[k] == b[k % 5];
    CHECKF(ok, "I = 0: y is not the bias on every row");
    mha_linear_destroy(l);

    float w[2 * 3] = {1, 2, 3, 4, 5, 6};
    mha_tensor wt = mha_tensor_contiguous(w, MHA_F32, 2, (int64_t[]){0, 3});
    CHECK_OK(mha_linear_create(&l, &wt, NULL));
    mha_tensor x3 = mha_tensor_contiguous(x, MHA_F32, 2, (int64_t[]){1, 3});
    mha_tensor y0 = mha_tensor_contiguous(y, MHA_F32, 2, (int64_t[]){1, 0});
    CHECK_OK(mha_linear_forward(l, &y0, &x3));  // O = 0: nothing to write
    mha_linear_destroy(l);

    wt = mha_tensor_contiguous(w, MHA_F32, 2, (int64_t[]){2, 3});
    CHECK_OK(mha_linear_create(&l, &wt, NULL));
    mha_tensor xr = mha_tensor_contiguous(x, MHA_F32, 3, (int64_t[]){2, 0, 3});
    mha_tensor yr = mha_tensor_contiguous(NULL, MHA_F32, 3, (int64_t[]){2, 0, 2});
    CHECK_OK(mha_linear_forward(l, &yr, &xr));  // no rows
    mha_linear_destroy(l);
}

// ---------------------------------------------------------------------------
// Threads: 1, 2, 8 give the same bits (packing and GEMM threaded)

static void threads(void) {
#ifdef _OPENMP
    const int64_t R = 301, I = 517, O = 611;  // both above the one-thread work
    float *w = malloc(sizeof(float) * (size_t)(O * I)), *b = malloc(sizeof(float) * (size_t)O);
    float *x = malloc(sizeof(float) * (size_t)(R * I));
    float *y[3];
    for (int64_t k = 0; k < O * I; k++) w[k] = frand();
    for (int64_t k = 0; k < O; k++) b[k] = frand();
    for (int64_t k = 0; k < R * I; k++) x[k] = frand();
    const int nts[3] = {1, 2, 8};
    const int before = omp_get_max_threads();
    for (int dt = 0; dt < 3; dt++) {
        const mha_dtype wdt = dt == 0 ? MHA_F32 : dt == 1 ? MHA_BF16 : MHA_F16;
        wview wv;
        wview_make(&wv, w, O, I, wdt, dt == 2 ? WL_TRANSPOSED : WL_ROWS);
        for (int t = 0; t < 3; t++) {
            omp_set_num_threads(nts[t]);
            y[t] = malloc(sizeof(float) * (size_t)(R * O));
            mha_tensor bt = mha_tensor_contiguous(b, MHA_F32, 1, (int64_t[]){O});
            mha_linear *l = NULL;
            CHECK_OK(mha_linear_create(&l, &wv.t, &bt));
            // x through a gathered view (seq-first 3-D) for one of them
            view vx;
            view_make(&vx, t == 1 ? LAY_SEQ_FIRST : LAY_3D, 7, 43, I);
            view_set(&vx, x);
            mha_tensor yt = mha_tensor_contiguous(y[t], MHA_F32, 3, (int64_t[]){7, 43, O});
            CHECK_OK(mha_linear_forward(l, &yt, &vx.t));
            free(vx.buf);
            mha_linear_destroy(l);
        }
        CHECKF(!memcmp(y[0], y[1], sizeof(float) * (size_t)(R * O)) &&
                   !memcmp(y[0], y[2], sizeof(float) * (size_t)(R * O)),
               "%s weight: 1, 2 and 8 threads give different bits", mha_dtype_name(wdt));
        printf("threads 1, 2, 8: %s weight (%lld, %lld), %lld rows: same bits\n",
               mha_dtype_name(wdt), (long long)O, (long long)I, (long long)R);
        for (int t = 0; t < 3; t++) free(y[t]);
        free(wv.buf);
    }
    omp_set_num_threads(before);
    free(w), free(b), free(x);
#else
    printf("threads: built without OpenMP, skipped\n");
#endif
}

// ---------------------------------------------------------------------------
// The module's own projection: a one-key attention whose V projection is
// the identity gives ctx = x exactly, so the fused output is x W_o^T + b_o
// through the module's projection GEMM.

static void module_bits(mha_dtype wdt) {
    enum { E = 48, H = 4, N = 37 };
    mha_config c;
    mha_config_init(&c, E, H);
    c.batch_first = true;
    c.weight_dtype = wdt;
    mha_module *m = random_module(&c, 5);
    mha_param w, b, ib;
    CHECK_OK(mha_module_param(&w, m, "in_proj_weight"));
    CHECK_OK(mha_module_param(&b, m, "in_proj_bias"));
    // V rows [2E, 3E): the identity, exact in every dtype; V bias 0
    for (int64_t r = 0; r < E; r++)
        for (int64_t i = 0; i < E; i++) {
            const float v = r == i ? 1.0f : 0.0f;
            const int64_t e = (2 * E + r) * E + i;
            if (wdt == MHA_F32) ((float *)w.storage)[e] = v;
            else if (wdt == MHA_BF16) ((uint16_t *)w.storage)[e] = mha_f32_to_bf16(v);
            else ((uint16_t *)w.storage)[e] = mha_f32_to_f16(v);
        }
    for (int64_t r = 0; r < E; r++) b.data[2 * E + r] = 0.0f;
    CHECK_OK(mha_module_param(&w, m, "out_proj.weight"));
    CHECK_OK(mha_module_param(&ib, m, "out_proj.bias"));
    float x[N * E], y[N * E], yl[N * E];
    for (int k = 0; k < N * E; k++) x[k] = frand();
    mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 3, (int64_t[]){N, 1, E});
    mha_tensor yt = mha_tensor_contiguous(y, MHA_F32, 3, (int64_t[]){N, 1, E});
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = a.key = a.value = &xt;
    a.impl = MHA_IMPL_FUSED;
    CHECK_OK(mha_forward(&yt, NULL, m, &a));
    mha_tensor wt = mha_tensor_contiguous(w.storage, w.dtype, 2, (int64_t[]){E, E});
    mha_tensor bt = mha_tensor_contiguous(ib.data, MHA_F32, 1, (int64_t[]){E});
    mha_linear *l = NULL;
    CHECK_OK(mha_linear_create(&l, &wt, &bt));
    mha_tensor x2 = mha_tensor_contiguous(x, MHA_F32, 2, (int64_t[]){N, E});
    mha_tensor ylt = mha_tensor_contiguous(yl, MHA_F32, 2, (int64_t[]){N, E});
    CHECK_OK(mha_linear_forward(l, &ylt, &x2));
    CHECKF(!memcmp(y, yl, sizeof y),
           "%s weights: mha_linear with out_proj differs from the module's fused output",
           mha_dtype_name(wdt));
    printf("module (%s weights, %s): fused out projection == mha_linear, bit for bit\n",
           mha_dtype_name(wdt), mha_isa());
    mha_linear_destroy(l);
    mha_module_destroy(m);
}

// ---------------------------------------------------------------------------
// Errors: status, message, *out NULL, y unchanged

// (sanitizers abort on an allocation larger than they support instead of
// returning NULL)
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define UNDER_SANITIZER 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || \
    __has_feature(memory_sanitizer)
#define UNDER_SANITIZER 1
#endif
#endif

static void create_errors(void) {
    float w[5 * 3], b[6];
    for (int k = 0; k < 15; k++) w[k] = (float)k;
    mha_tensor wt = mha_tensor_contiguous(w, MHA_F32, 2, (int64_t[]){5, 3});
    mha_tensor bt = mha_tensor_contiguous(b, MHA_F32, 1, (int64_t[]){5});
    mha_linear *l = (mha_linear *)&l;  // must come back NULL
    CHECK_FAILS(mha_linear_create(NULL, &wt, &bt), MHA_ERR_INVALID_ARG);
    msg_has("linear", "out is NULL", NULL);
    CHECK_FAILS(mha_linear_create(&l, NULL, &bt), MHA_ERR_INVALID_ARG);
    msg_has("weight is NULL", NULL, NULL);
    CHECK(l == NULL);

    mha_tensor t = wt;
    t.data = NULL;
    CHECK_FAILS(mha_linear_create(&l, &t, NULL), MHA_ERR_INVALID_ARG);
    msg_has("weight", "data is NULL", NULL);
    t = wt;
    t.dtype = MHA_F64;
    CHECK_FAILS(mha_linear_create(&l, &t, NULL), MHA_ERR_DTYPE);
    msg_has("weight", "F64", "expected F32, BF16 or F16");
    t.dtype = MHA_I64;
    CHECK_FAILS(mha_linear_create(&l, &t, NULL), MHA_ERR_DTYPE);
    msg_has("weight", "I64", NULL);
    t.dtype = (mha_dtype)99;
    CHECK_FAILS(mha_linear_create(&l, &t, NULL), MHA_ERR_INVALID_ARG);
    msg_has("weight", "invalid dtype 99", NULL);
    t = mha_tensor_contiguous(w, MHA_F32, 3, (int64_t[]){1, 5, 3});
    CHECK_FAILS(mha_linear_create(&l, &t, NULL), MHA_ERR_SHAPE);
    msg_has("weight", "expected 2 dims (O, I)", "(1, 5, 3)");
    t = mha_tensor_contiguous(w, MHA_F32, 1, (int64_t[]){15});
    CHECK_FAILS(mha_linear_create(&l, &t, NULL), MHA_ERR_SHAPE);
    msg_has("weight", "expected 2 dims", "(15,)");
    t = wt;
    t.shape[1] = -3;
    CHECK_FAILS(mha_linear_create(&l, &t, NULL), MHA_ERR_SHAPE);
    msg_has("weight", "dim 1 is negative (-3)", NULL);

    mha_tensor b6 = mha_tensor_contiguous(b, MHA_F32, 1, (int64_t[]){6});
    CHECK_FAILS(mha_linear_create(&l, &wt, &b6), MHA_ERR_SHAPE);
    msg_has("bias has 6 elements", "(5, 3)", "5 outputs");
    mha_tensor b2 = mha_tensor_contiguous(b, MHA_F32, 2, (int64_t[]){1, 5});
    CHECK_FAILS(mha_linear_create(&l, &wt, &b2), MHA_ERR_SHAPE);
    msg_has("bias", "expected 1 dim (O)", "(1, 5)");
    mha_tensor bd = bt;
    bd.dtype = MHA_F64;
    CHECK_FAILS(mha_linear_create(&l, &wt, &bd), MHA_ERR_DTYPE);
    msg_has("bias", "F64", NULL);
    bd = bt;
    bd.data = NULL;
    CHECK_FAILS(mha_linear_create(&l, &wt, &bd), MHA_ERR_INVALID_ARG);
    msg_has("bias", "data is NULL", NULL);
    CHECK(l == NULL);

    // a broadcast (stride 0) weight whose packed form cannot be sized
    mha_tensor big = wt;
    big.shape[0] = big.shape[1] = (int64_t)1 << 31;
    big.stride[0] = big.stride[1] = 0;
    CHECK_FAILS(mha_linear_create(&l, &big, NULL), MHA_ERR_OVERFLOW);
    msg_has("overflows", "(2147483648, 2147483648)", NULL);
#ifndef UNDER_SANITIZER
    // ... and one that cannot be allocated: 2^48 floats, 1 PiB, more than
    // a 47-bit address space holds
    big.shape[0] = big.shape[1] = (int64_t)1 << 24;
    CHECK_FAILS(mha_linear_create(&l, &big, NULL), MHA_ERR_NOMEM);
    msg_has("out of memory", "(16777216, 16777216)", NULL);
#endif
    CHECK(l == NULL);
    mha_linear_destroy(NULL);  // accepted
}

static void forward_errors(void) {
    float w[5 * 3], x[2 * 4 * 2], y[3 * 5 * 2];
    for (int k = 0; k < 15; k++) w[k] = (float)k / 7;
    for (int k = 0; k < 16; k++) x[k] = (float)k;
    mha_tensor wt = mha_tensor_contiguous(w, MHA_F32, 2, (int64_t[]){5, 3});
    mha_linear *l = NULL;
    CHECK_OK(mha_linear_create(&l, &wt, NULL));
    for (int k = 0; k < 30; k++) y[k] = SENTINEL;
    mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 2, (int64_t[]){2, 3});
    mha_tensor yt = mha_tensor_contiguous(y, MHA_F32, 2, (int64_t[]){2, 5});

    CHECK_FAILS(mha_linear_forward(NULL, &yt, &xt), MHA_ERR_INVALID_ARG);
    msg_has("linear", "layer is NULL", NULL);
    CHECK_FAILS(mha_linear_forward(l, NULL, &xt), MHA_ERR_INVALID_ARG);
    msg_has("y is NULL", NULL, NULL);
    CHECK_FAILS(mha_linear_forward(l, &yt, NULL), MHA_ERR_INVALID_ARG);
    msg_has("x is NULL", NULL, NULL);
    mha_tensor t = xt;
    t.data = NULL;
    CHECK_FAILS(mha_linear_forward(l, &yt, &t), MHA_ERR_INVALID_ARG);
    msg_has("x", "data is NULL", NULL);
    t = xt;
    t.dtype = MHA_F64;
    CHECK_FAILS(mha_linear_forward(l, &yt, &t), MHA_ERR_DTYPE);
    msg_has("x is F64", "x and y must be F32", NULL);
    t = yt;
    t.dtype = MHA_BF16;
    CHECK_FAILS(mha_linear_forward(l, &t, &xt), MHA_ERR_DTYPE);
    msg_has("y is BF16", NULL, NULL);
    t = xt;
    t.dtype = MHA_U8;
    CHECK_FAILS(mha_linear_forward(l, &yt, &t), MHA_ERR_DTYPE);
    msg_has("x is U8", NULL, NULL);
    t = xt;
    t.dtype = (mha_dtype)77;
    CHECK_FAILS(mha_linear_forward(l, &yt, &t), MHA_ERR_INVALID_ARG);
    msg_has("x", "invalid dtype 77", NULL);
    t = mha_tensor_contiguous(x, MHA_F32, 0, NULL);
    CHECK_FAILS(mha_linear_forward(l, &yt, &t), MHA_ERR_SHAPE);
    msg_has("x has 0 dims", "(..., 3)", NULL);
    t = mha_tensor_contiguous(x, MHA_F32, 2, (int64_t[]){2, 4});
    CHECK_FAILS(mha_linear_forward(l, &yt, &t), MHA_ERR_SHAPE);
    msg_has("x (2, 4) has 4 features", "(5, 3)", "takes 3");
    t = xt;
    t.shape[0] = -2;
    CHECK_FAILS(mha_linear_forward(l, &yt, &t), MHA_ERR_SHAPE);
    msg_has("x", "dim 0 is negative (-2)", NULL);
    t = mha_tensor_contiguous(y, MHA_F32, 2, (int64_t[]){2, 4});
    CHECK_FAILS(mha_linear_forward(l, &t, &xt), MHA_ERR_SHAPE);
    msg_has("y has shape (2, 4), expected (2, 5)", "5 outputs", NULL);
    t = mha_tensor_contiguous(y, MHA_F32, 2, (int64_t[]){3, 5});
    CHECK_FAILS(mha_linear_forward(l, &t, &xt), MHA_ERR_SHAPE);
    msg_has("y has shape (3, 5), expected (2, 5)", NULL, NULL);
    t = mha_tensor_contiguous(y, MHA_F32, 3, (int64_t[]){1, 2, 5});
    CHECK_FAILS(mha_linear_forward(l, &t, &xt), MHA_ERR_SHAPE);
    msg_has("y has shape (1, 2, 5), expected (2, 5)", NULL, NULL);
    t = yt;
    t.stride[0] = 0;
    CHECK_FAILS(mha_linear_forward(l, &t, &xt), MHA_ERR_INVALID_ARG);
    msg_has("y has stride 0 along dim 0 of size 2", NULL, NULL);
    // y over x's memory (x (2, 3) at x, y (2, 5) from x + 4)
    t = mha_tensor_contiguous(x + 4, MHA_F32, 2, (int64_t[]){2, 5});
    CHECK_FAILS(mha_linear_forward(l, &t, &xt), MHA_ERR_INVALID_ARG);
    msg_has("y overlaps x", NULL, NULL);
    t = xt;
    t.stride[0] = INT64_MAX / 2;
    CHECK_FAILS(mha_linear_forward(l, &yt, &t), MHA_ERR_OVERFLOW);
    msg_has("x", "strides overflow", NULL);
    bool unchanged = true;
    for (int k = 0; k < 30; k++) unchanged &= y[k] == SENTINEL;
    CHECKF(unchanged, "a failed forward wrote into y");
    CHECK_OK(mha_linear_forward(l, &yt, &xt));  // the baseline is valid
    mha_linear_destroy(l);
}

int main(void) {
    seed_rng(20261201);
    printf("ISA %s\n", mha_isa());
    random_cases();
    empty_sizes();
    threads();
    module_bits(MHA_F32);
    module_bits(MHA_BF16);
    module_bits(MHA_F16);
    create_errors();
    forward_errors();
    printf("%lld cases against float64 (worst error / tolerance %.3f), %lld layout runs "
           "bit-identical to the contiguous ones\n",
           (long long)g_cases, g_worst_ratio, (long long)g_layout_runs);
    printf("test_dense: worst error/bound %.3g (%s, ISA %s)\n", g_worst_ratio,
           g_worst_at[0] ? g_worst_at : "-", mha_isa());
    return check_summary("test_dense");
}
