// test_edges.c: numerical and size edges, both implementations.
//   - NaN and Inf inputs propagate as in PyTorch: a bad query row spoils
//     only its own output row; a bad key/value token spoils every row of
//     its batch element (masked or not: NaN logit, 0 * NaN value); the
//     other rows and elements are exact; no crash; mha_backward returns;
//     mha_diag_create names the first bad value
//   - logits of +-1e4 stay finite through the stable softmax (forward,
//     weights, backward), and the two implementations agree
//   - L = 0 (nothing to do, output untouched) and S = 0 (no keys: every row
//     is fully masked, context 0, output = out_proj.bias; zero gradients
//     but for the bias) in forward and backward
//   - sizes whose products overflow are refused with MHA_ERR_OVERFLOW
//     (broadcast views of a few bytes with shapes of 2^31 .. 2^58)
//   - outputs that alias inputs (or each other) are refused
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "util.h"
#include "mha.h"


static const mha_impl impls[2] = {MHA_IMPL_REFERENCE, MHA_IMPL_FUSED};

static mha_module *new_module(int64_t E, int64_t H) {
    mha_config c;
    mha_config_init(&c, E, H);
    mha_module *m = torch_module(&c, 0);
    mha_param b;
    CHECK_OK(mha_module_param(&b, m, "out_proj.bias"));
    for (int64_t i = 0; i < b.numel; i++) b.data[i] = 0.25f * (float)(i % 5) - 0.5f;
    return m;
}

static bool all_finite(const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(x[i])) return false;
    return true;
}

static bool all_nonfinite(const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (isfinite(x[i])) return false;
    return true;
}

// A NaN or an Inf at token T0 of batch element 1. In the query only
// (cross-attention, clean key/value): row T0 of element 1 is non-finite,
// every other row is exactly the clean result. In the key/value (causal
// self-attention): every row of element 1 is non-finite, including rows
// before T0 that mask that key (its logit is NaN, and a weight of 0 times
// a NaN value is NaN: PyTorch gives the same), and element 0 is exact.
static void test_nonfinite(void) {
    enum { E = 16, H = 2, L = 12, N = 2, T0 = 5 };
    mha_module *m = new_module(E, H);
    static float x[L * N * E], x0[L * N * E], kv[L * N * E], y[L * N * E], y0[L * N * E],
        g[L * N * E];
    for (int i = 0; i < L * N * E; i++) x0[i] = x[i] = frand(), kv[i] = frand();
    const float bad[2] = {NAN, INFINITY};
    for (int kind = 0; kind < 2; kind++)
        for (int where = 0; where < 2; where++)  // 0: query only; 1: key and value
            for (int ii = 0; ii < 2; ii++) {
                memcpy(x, x0, sizeof x);
                mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 3, (int64_t[]){L, N, E});
                mha_tensor kvt = mha_tensor_contiguous(kv, MHA_F32, 3, (int64_t[]){L, N, E});
                mha_tensor yt = mha_tensor_contiguous(y, MHA_F32, 3, (int64_t[]){L, N, E});
                mha_tensor y0t = mha_tensor_contiguous(y0, MHA_F32, 3, (int64_t[]){L, N, E});
                mha_forward_args a;
                mha_forward_args_init(&a);
                a.query = &xt;
                a.key = a.value = where ? &xt : &kvt;
                a.opts.is_causal = where == 1;
                a.impl = impls[ii];
                CHECK_OK(mha_forward(&y0t, NULL, m, &a));  // clean
                x[(T0 * N + 1) * E + 3] = bad[kind];
                CHECK_OK(mha_forward(&yt, NULL, m, &a));
                bool ok = true;
                for (int t = 0; t < L; t++)
                    for (int n = 0; n < N; n++) {
                        const float *r = y + (t * N + n) * E, *r0 = y0 + (t * N + n) * E;
                        const bool hit = n == 1 && (where == 1 || t == T0);
                        ok &= hit ? all_nonfinite(r, E) : !memcmp(r, r0, sizeof(float) * E);
                    }
                CHECKF(ok, "%s in the %s (%s): the rows it reaches non-finite, the rest exact",
                       kind ? "Inf" : "NaN", where ? "key/value" : "query",
                       mha_impl_name(impls[ii]));
                mha_tensor gt = mha_tensor_contiguous(g, MHA_F32, 3, (int64_t[]){L, N, E});
                CHECK_OK(mha_backward(&gt, NULL, NULL, NULL, m, &a, &y0t, false));
                mha_diag *d = NULL;
                CHECK_OK(mha_diag_create(&d, m, &a, NULL));
                const char *nf = d ? mha_diag_nonfinite(d) : NULL;
                char want[32];
                snprintf(want, sizeof want, "query[%d, 1, 3]", T0);
                CHECKF(nf && strstr(nf, want), "diagnose: %s (want %s)", nf ? nf : "(none)",
                       want);
                mha_diag_destroy(d);
            }
    mha_module_destroy(m);
}

// Logits near +-1e4 (q, k of size 100 in d = 1): finite weights summing to
// 1, finite outputs and gradients, both implementations the same within
// the tolerance.
static void test_big_logits(void) {
    enum { B = 2, H = 2, L = 9, S = 11, D = 4 };
    static float q[B * H * L * D], k[B * H * S * D], v[B * H * S * D], o[2][B * H * L * D],
        w[2][B * H * L * S];
    for (int i = 0; i < B * H * L * D; i++) q[i] = 50.0f * frand();
    for (int i = 0; i < B * H * S * D; i++) k[i] = 50.0f * frand(), v[i] = frand();
    mha_tensor qt = mha_tensor_contiguous(q, MHA_F32, 4, (int64_t[]){B, H, L, D});
    mha_tensor kt = mha_tensor_contiguous(k, MHA_F32, 4, (int64_t[]){B, H, S, D});
    mha_tensor vt = mha_tensor_contiguous(v, MHA_F32, 4, (int64_t[]){B, H, S, D});
    double lmax = 0;
    for (int b = 0; b < B * H; b++)
        for (int i = 0; i < L; i++)
            for (int j = 0; j < S; j++) {
                double s = 0;
                for (int c = 0; c < D; c++)
                    s += (double)q[(b * L + i) * D + c] * k[(b * S + j) * D + c];
                lmax = fmax(lmax, fabs(s) / sqrt((double)D));
            }
    CHECKF(lmax > 2000, "the test's logits reach %g", lmax);
    for (int ii = 0; ii < 2; ii++) {
        mha_tensor ot = mha_tensor_contiguous(o[ii], MHA_F32, 4, (int64_t[]){B, H, L, D});
        mha_tensor wt = mha_tensor_contiguous(w[ii], MHA_F32, 4, (int64_t[]){B, H, L, S});
        mha_sdpa_args a;
        mha_sdpa_args_init(&a);
        a.q = &qt, a.k = &kt, a.v = &vt;
        a.impl = impls[ii];
        CHECK_OK(mha_sdpa(&ot, &wt, &a));
        CHECK(all_finite(o[ii], B * H * L * D) && all_finite(w[ii], B * H * L * S));
        double worst = 0;
        for (int r = 0; r < B * H * L; r++) {
            double s = 0;
            for (int j = 0; j < S; j++) s += w[ii][r * S + j];
            worst = fmax(worst, fabs(s - 1.0));
        }
        CHECKF(worst < 1e-5, "%s: weight rows sum to 1 within %g", mha_impl_name(impls[ii]),
               worst);
    }
    double e = 0;
    for (int i = 0; i < B * H * L * D; i++) e = fmax(e, fabs((double)o[0][i] - o[1][i]));
    CHECKF(e < 2e-5 * 2, "fused vs reference at logits %g: %g", lmax, e);
    // the module, inputs x 100 (logits ~1e4): finite output and gradients
    enum { E = 16, MH = 2, T = 10 };
    mha_module *m = new_module(E, MH);
    static float x[T * E], y[T * E], gx[T * E], gy[T * E];
    for (int i = 0; i < T * E; i++) x[i] = 100.0f * frand(), gy[i] = frand();
    mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 2, (int64_t[]){T, E});
    mha_tensor yt = mha_tensor_contiguous(y, MHA_F32, 2, (int64_t[]){T, E});
    mha_tensor gt = mha_tensor_contiguous(gx, MHA_F32, 2, (int64_t[]){T, E});
    mha_tensor gyt = mha_tensor_contiguous(gy, MHA_F32, 2, (int64_t[]){T, E});
    for (int ii = 0; ii < 2; ii++) {
        mha_forward_args a;
        mha_forward_args_init(&a);
        a.query = a.key = a.value = &xt;
        a.impl = impls[ii];
        mha_module *g = NULL;
        CHECK_OK(mha_module_create(&g, mha_module_config(m)));
        CHECK_OK(mha_forward(&yt, NULL, m, &a));
        CHECK_OK(mha_backward(&gt, NULL, NULL, g, m, &a, &gyt, false));
        bool fin = all_finite(y, T * E) && all_finite(gx, T * E);
        for (int i = 0; g && i < mha_module_num_params(g); i++) {
            mha_param p;
            CHECK_OK(mha_module_param_at(&p, g, i));
            fin &= all_finite(p.data, p.numel);
        }
        CHECKF(fin, "module at logits ~1e4 (%s): finite output and gradients",
               mha_impl_name(impls[ii]));
        mha_module_destroy(g);
    }
    mha_module_destroy(m);
}

// L = 0 and S = 0, forward and backward.
static void test_empty(void) {
    enum { E = 8, H = 2, N = 3, T = 4 };
    mha_module *m = new_module(E, H);
    mha_param bo;
    CHECK_OK(mha_module_param(&bo, m, "out_proj.bias"));
    static float q[T * N * E], k[T * N * E], y[T * N * E], w[N * T * T], gq[T * N * E],
        gk[T * N * E], gy[T * N * E];
    for (int i = 0; i < T * N * E; i++) q[i] = k[i] = frand(), gy[i] = frand();
    for (int ii = 0; ii < 2; ii++)
        for (int c = 0; c < 2; c++) {  // c 0: L = 0; 1: S = 0
            const int64_t L = c ? T : 0, S = c ? 0 : T;
            for (int i = 0; i < T * N * E; i++) y[i] = 7.0f, gq[i] = gk[i] = 7.0f;
            mha_tensor qt = mha_tensor_contiguous(q, MHA_F32, 3, (int64_t[]){L, N, E});
            mha_tensor kt = mha_tensor_contiguous(k, MHA_F32, 3, (int64_t[]){S, N, E});
            mha_tensor yt = mha_tensor_contiguous(y, MHA_F32, 3, (int64_t[]){L, N, E});
            mha_tensor wt = mha_tensor_contiguous(w, MHA_F32, 3, (int64_t[]){N, L, S});
            mha_forward_args a;
            mha_forward_args_init(&a);
            a.query = &qt;
            a.key = a.value = &kt;
            a.impl = impls[ii];
            a.need_weights = true;
            CHECK_OK(mha_forward(&yt, &wt, m, &a));
            bool ok = true;
            for (int i = 0; i < T * N * E; i++)
                ok &= c ? y[i] == bo.data[i % E] : y[i] == 7.0f;
            CHECKF(ok, "%s, %s: %s", c ? "S = 0" : "L = 0", mha_impl_name(impls[ii]),
                   c ? "every output row is out_proj.bias" : "the output is untouched");
            mha_tensor gqt = mha_tensor_contiguous(gq, MHA_F32, 3, (int64_t[]){L, N, E});
            mha_tensor gkt = mha_tensor_contiguous(gk, MHA_F32, 3, (int64_t[]){S, N, E});
            static float gv[T * N * E];
            mha_tensor gvt = mha_tensor_contiguous(gv, MHA_F32, 3, (int64_t[]){S, N, E});
            mha_tensor gyt = mha_tensor_contiguous(gy, MHA_F32, 3, (int64_t[]){L, N, E});
            mha_module *g = NULL;
            CHECK_OK(mha_module_create(&g, mha_module_config(m)));
            a.need_weights = false;
            CHECK_OK(mha_backward(&gqt, &gkt, &gvt, g, m, &a, &gyt, false));
            // only the output bias sees a gradient (S = 0: sum of dy)
            for (int i = 0; g && i < mha_module_num_params(g); i++) {
                mha_param p;
                CHECK_OK(mha_module_param_at(&p, g, i));
                double mx = 0;
                for (int64_t j = 0; j < p.numel; j++) mx = fmax(mx, fabs(p.data[j]));
                if (c && !strcmp(p.name, "out_proj.bias")) {
                    double e = 0;
                    for (int o = 0; o < E; o++) {
                        double s = 0;
                        for (int r = 0; r < T * N; r++) s += gy[r * E + o];
                        e = fmax(e, fabs(s - p.data[o]));
                    }
                    CHECKF(e < 1e-5, "S = 0 (%s): grad out_proj.bias = sum of dy (%g)",
                           mha_impl_name(impls[ii]), e);
                } else {
                    CHECKF(mx == 0.0, "%s (%s): grad %s is 0 (max %g)", c ? "S = 0" : "L = 0",
                           mha_impl_name(impls[ii]), p.name, mx);
                }
            }
            if (c) {
                bool z = true;
                for (int i = 0; i < T * N * E; i++) z &= gq[i] == 0.0f;
                CHECKF(z, "S = 0 (%s): grad_query is 0", mha_impl_name(impls[ii]));
            }
            mha_module_destroy(g);
        }
    mha_module_destroy(m);
}

// Shapes whose products overflow: refused with MHA_ERR_OVERFLOW, promptly.
static void test_overflow(void) {
    mha_module *m = new_module(8, 2);
    static float x[8], y[8];
    const int64_t big[3] = {(int64_t)1 << 31, (int64_t)1 << 40, (int64_t)1 << 58};
    for (int i = 0; i < 3; i++)
        for (int ii = 0; ii < 2; ii++) {
            // a broadcast view: every row the same 8 floats
            mha_tensor qt = {x, MHA_F32, 3, {big[i], 1, 8}, {0, 0, 1}};
            mha_tensor yt = {y, MHA_F32, 3, {big[i], 1, 8}, {0, 0, 1}};
            mha_forward_args a;
            mha_forward_args_init(&a);
            a.query = a.key = a.value = &qt;
            a.impl = impls[ii];
            CHECK_FAILS(mha_forward(&yt, NULL, m, &a), MHA_ERR_OVERFLOW);
            CHECK(strstr(mha_last_error(), "overflow") != NULL);
            size_t ws = 0;
            CHECK_FAILS(mha_forward_workspace_size(&ws, m, &a), MHA_ERR_OVERFLOW);
        }
    // a view whose element count overflows int64
    mha_tensor qt = {x, MHA_F32, 3, {(int64_t)1 << 40, (int64_t)1 << 40, 8}, {0, 0, 1}};
    mha_tensor yt = qt;
    yt.data = y;
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = a.key = a.value = &qt;
    CHECK_FAILS(mha_forward(&yt, NULL, m, &a), MHA_ERR_OVERFLOW);
    // configs and caches too large to address
    mha_config c;
    mha_config_init(&c, (int64_t)1 << 40, 1);
    mha_module *mm = NULL;
    CHECK_FAILS(mha_module_create(&mm, &c), MHA_ERR_OVERFLOW);
    mha_kv_cache *kc = NULL;
    CHECK_FAILS(mha_kv_cache_create(&kc, (int64_t)1 << 30, 1 << 20, 128, 128, (int64_t)1 << 30,
                                    MHA_KV_F32),
                MHA_ERR_OVERFLOW);
    mha_module_destroy(m);
}

// Outputs that overlap inputs or each other are refused.
static void test_aliasing(void) {
    enum { E = 8, H = 2, T = 5 };
    mha_module *m = new_module(E, H);
    static float buf[4 * T * E + T * T];
    float *x = buf, *y = buf + T * E, *g = buf + 2 * T * E, *w = buf + 4 * T * E;
    for (int i = 0; i < 4 * T * E + T * T; i++) buf[i] = frand();
    mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 2, (int64_t[]){T, E});
    mha_tensor yt = mha_tensor_contiguous(y, MHA_F32, 2, (int64_t[]){T, E});
    mha_tensor wt = mha_tensor_contiguous(w, MHA_F32, 2, (int64_t[]){T, T});
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = a.key = a.value = &xt;
    a.need_weights = true;
    for (int ii = 0; ii < 2; ii++) {
        a.impl = impls[ii];
        mha_tensor in_place = xt;  // out = query
        CHECK_FAILS(mha_forward(&in_place, &wt, m, &a), MHA_ERR_INVALID_ARG);
        CHECK(strstr(mha_last_error(), "overlap") != NULL);
        mha_tensor half_over = mha_tensor_contiguous(x + E / 2, MHA_F32, 2, (int64_t[]){T, E});
        CHECK_FAILS(mha_forward(&half_over, &wt, m, &a), MHA_ERR_INVALID_ARG);
        mha_tensor w_over = mha_tensor_contiguous(y + 3, MHA_F32, 2, (int64_t[]){T, T});
        CHECK_FAILS(mha_forward(&yt, &w_over, m, &a), MHA_ERR_INVALID_ARG);  // weights in out
        CHECK_OK(mha_forward(&yt, &wt, m, &a));                              // disjoint: fine
        mha_tensor gx_over = mha_tensor_contiguous(y, MHA_F32, 2, (int64_t[]){T, E});
        mha_tensor gyt = mha_tensor_contiguous(g, MHA_F32, 2, (int64_t[]){T, E});
        a.need_weights = false;
        CHECK_FAILS(mha_backward(&xt, NULL, NULL, NULL, m, &a, &gyt, false),
                    MHA_ERR_INVALID_ARG);  // grad_query = query
        mha_tensor gq2 = mha_tensor_contiguous(g + 2, MHA_F32, 2, (int64_t[]){T, E});
        CHECK_FAILS(mha_backward(&gq2, NULL, NULL, NULL, m, &a, &gyt, false),
                    MHA_ERR_INVALID_ARG);  // grad_query over grad_output
        CHECK_OK(mha_backward(&gx_over, NULL, NULL, NULL, m, &a, &gyt, false));
        a.need_weights = true;
    }
    // the cached forward: out = query refused
    mha_kv_cache *kc = NULL;
    CHECK_OK(mha_kv_cache_create(&kc, 1, H, E / H, E / H, T, MHA_KV_F32));
    mha_tensor x1 = mha_tensor_contiguous(x, MHA_F32, 2, (int64_t[]){1, E});
    mha_forward_args ac;
    mha_forward_args_init(&ac);
    ac.query = ac.key = ac.value = &x1;
    CHECK_FAILS(mha_forward_cached(&x1, m, &ac, kc), MHA_ERR_INVALID_ARG);
    CHECK(mha_kv_cache_length(kc, 0) == 0);  // nothing appended
    mha_kv_cache_destroy(kc);
    mha_module_destroy(m);
}

int main(void) {
    seed_rng(5150);
    test_nonfinite();
    test_big_logits();
    test_empty();
    test_overflow();
    test_aliasing();
    return check_summary("test_edges");
}
