// test_backward.c: the reference backward by finite differences (with and
// without dropout, masks, add_bias_kv/add_zero_attn, kdim/vdim), the
// accumulate flag, thread independence, dropout semantics (eval is exact,
// masks reproducible, the kept fraction), fully masked rows, and misuse.
// Agreement with PyTorch autograd is tests/conformance/backward.py.
#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "check.h"
#include "mha.h"

static uint64_t g_rng = 99;
static float frand(void) {
    g_rng = g_rng * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(g_rng >> 11) * 0x1p-53 * 2.0 - 1.0);
}
static void fill(float *x, int64_t n, float s) {
    for (int64_t i = 0; i < n; i++) x[i] = s * frand();
}

enum { E = 6, H = 2, L = 3, S = 4, N = 2, KD = 5, VD = 3 };

typedef struct problem {
    mha_module *m;
    float q[L * N * E], k[S * N * KD], v[S * N * VD], gy[L * N * E];
    float am[L * S];
    uint8_t kpm[N * S];
    mha_tensor qt, kt, vt, amt, kpt, gyt;
    mha_forward_args a;
} problem;

static void setup(problem *p, bool bkv, bool zero, bool dropout, bool masks) {
    memset(p, 0, sizeof *p);
    mha_config c;
    mha_config_init(&c, E, H);
    c.kdim = KD;
    c.vdim = VD;
    c.add_bias_kv = bkv;
    c.add_zero_attn = zero;
    c.dropout = dropout ? 0.3f : 0.0f;
    c.out_dropout = dropout ? 0.2f : 0.0f;
    CHECK_OK(mha_module_create(&p->m, &c));
    for (int i = 0; i < mha_module_num_params(p->m); i++) {
        mha_param pr;
        CHECK_OK(mha_module_param_at(&pr, p->m, i));
        fill(pr.data, pr.numel, 0.7f);
    }
    fill(p->q, L * N * E, 1.0f);
    fill(p->k, S * N * KD, 1.0f);
    fill(p->v, S * N * VD, 1.0f);
    fill(p->gy, L * N * E, 1.0f);
    fill(p->am, L * S, 1.0f);
    p->kpm[1] = 1;  // batch 0 ignores key 1
    p->qt = mha_tensor_contiguous(p->q, MHA_F32, 3, (int64_t[]){L, N, E});
    p->kt = mha_tensor_contiguous(p->k, MHA_F32, 3, (int64_t[]){S, N, KD});
    p->vt = mha_tensor_contiguous(p->v, MHA_F32, 3, (int64_t[]){S, N, VD});
    p->gyt = mha_tensor_contiguous(p->gy, MHA_F32, 3, (int64_t[]){L, N, E});
    p->amt = mha_tensor_contiguous(p->am, MHA_F32, 2, (int64_t[]){L, S});
    p->kpt = mha_tensor_contiguous(p->kpm, MHA_BOOL, 2, (int64_t[]){N, S});
    mha_forward_args_init(&p->a);
    p->a.query = &p->qt;
    p->a.key = &p->kt;
    p->a.value = &p->vt;
    if (masks) {
        p->a.attn_mask = &p->amt;
        p->a.key_padding_mask = &p->kpt;
        p->a.is_causal = true;
    }
    p->a.training = dropout;
    p->a.dropout_seed = 1234;
    p->a.dropout_offset = 7;
}

// loss = sum(gy * forward(...)) in double
static double loss(problem *p) {
    float y[L * N * E];
    mha_tensor yt = mha_tensor_contiguous(y, MHA_F32, 3, (int64_t[]){L, N, E});
    mha_status st = mha_forward(&yt, NULL, p->m, &p->a);
    CHECK(st == MHA_OK);
    double s = 0;
    for (int i = 0; i < L * N * E; i++) s += (double)p->gy[i] * y[i];
    return s;
}

// Central differences of loss w.r.t. x[0..n) vs the analytic gradient g:
// relative L2 error.
static double fd_error(problem *p, float *x, const float *g, int64_t n) {
    const float eps = 1e-2f;
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        float x0 = x[i];
        x[i] = x0 + eps;
        double lp = loss(p);
        x[i] = x0 - eps;
        double lm = loss(p);
        x[i] = x0;
        double fd = (lp - lm) / (2.0 * ((double)(x0 + eps) - (double)x0));
        num += (fd - g[i]) * (fd - g[i]);
        den += fd * fd;
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

static void check_fd(bool bkv, bool zero, bool dropout, bool masks) {
    problem p;
    setup(&p, bkv, zero, dropout, masks);
    float gq[L * N * E], gk[S * N * KD], gv[S * N * VD];
    mha_tensor gqt = mha_tensor_contiguous(gq, MHA_F32, 3, (int64_t[]){L, N, E});
    mha_tensor gkt = mha_tensor_contiguous(gk, MHA_F32, 3, (int64_t[]){S, N, KD});
    mha_tensor gvt = mha_tensor_contiguous(gv, MHA_F32, 3, (int64_t[]){S, N, VD});
    mha_module *g = NULL;
    CHECK_OK(mha_module_create(&g, mha_module_config(p.m)));
    CHECK_OK(mha_backward(&gqt, &gkt, &gvt, g, p.m, &p.a, &p.gyt, false));
    const double tol = 2e-3;
    double e;
    e = fd_error(&p, p.q, gq, L * N * E);
    CHECKF(e < tol, "bkv %d zero %d drop %d masks %d: grad_query rel err %g", bkv, zero, dropout, masks, e);
    e = fd_error(&p, p.k, gk, S * N * KD);
    CHECKF(e < tol, "bkv %d zero %d drop %d masks %d: grad_key rel err %g", bkv, zero, dropout, masks, e);
    e = fd_error(&p, p.v, gv, S * N * VD);
    CHECKF(e < tol, "bkv %d zero %d drop %d masks %d: grad_value rel err %g", bkv, zero, dropout, masks, e);
    for (int i = 0; i < mha_module_num_params(p.m); i++) {
        mha_param pp, gp;
        CHECK_OK(mha_module_param_at(&pp, p.m, i));
        CHECK_OK(mha_module_param_at(&gp, g, i));
        e = fd_error(&p, pp.data, gp.data, pp.numel);
        CHECKF(e < tol, "bkv %d zero %d drop %d masks %d: grad %s rel err %g", bkv, zero,
               dropout, masks, pp.name, e);
    }
    mha_module_destroy(g);
    mha_module_destroy(p.m);
}

// accumulate = true adds; results do not depend on the number of threads.
static void test_accumulate_threads(void) {
    problem p;
    setup(&p, true, true, true, true);
    float gq1[L * N * E], gq2[L * N * E];
    mha_tensor g1 = mha_tensor_contiguous(gq1, MHA_F32, 3, (int64_t[]){L, N, E});
    mha_tensor g2 = mha_tensor_contiguous(gq2, MHA_F32, 3, (int64_t[]){L, N, E});
    mha_module *a = NULL, *b = NULL;
    CHECK_OK(mha_module_create(&a, mha_module_config(p.m)));
    CHECK_OK(mha_module_create(&b, mha_module_config(p.m)));
#ifdef _OPENMP
    omp_set_num_threads(1);
#endif
    CHECK_OK(mha_backward(&g1, NULL, NULL, a, p.m, &p.a, &p.gyt, false));
#ifdef _OPENMP
    omp_set_num_threads(2);
#endif
    CHECK_OK(mha_backward(&g2, NULL, NULL, b, p.m, &p.a, &p.gyt, false));
    CHECK(memcmp(gq1, gq2, sizeof gq1) == 0);
    for (int i = 0; i < mha_module_num_params(a); i++) {
        mha_param x, y;
        CHECK_OK(mha_module_param_at(&x, a, i));
        CHECK_OK(mha_module_param_at(&y, b, i));
        CHECKF(memcmp(x.data, y.data, (size_t)x.numel * 4) == 0, "%s differs 1 vs 2 threads", x.name);
    }
    // b += once more: exactly twice a (x + x is exact in float)
    CHECK_OK(mha_backward(&g2, NULL, NULL, b, p.m, &p.a, &p.gyt, true));
    for (int i = 0; i < L * N * E; i++) CHECK(gq2[i] == 2.0f * gq1[i]);
    for (int i = 0; i < mha_module_num_params(a); i++) {
        mha_param x, y;
        CHECK_OK(mha_module_param_at(&x, a, i));
        CHECK_OK(mha_module_param_at(&y, b, i));
        bool ok = true;
        for (int64_t j = 0; j < x.numel; j++) ok &= y.data[j] == 2.0f * x.data[j];
        CHECKF(ok, "%s: accumulate did not add", x.name);
    }
    mha_module_destroy(a);
    mha_module_destroy(b);
    mha_module_destroy(p.m);
}

// Eval mode ignores dropout exactly; training masks are reproducible from
// (seed, offset) and drop about p of the weights.
static void test_dropout_semantics(void) {
    enum { E2 = 8, H2 = 2, L2 = 64, N2 = 2 };
    mha_config c;
    mha_config_init(&c, E2, H2);
    mha_module *m0 = NULL, *m1 = NULL;
    CHECK_OK(mha_module_create(&m0, &c));
    c.dropout = 0.5f;
    CHECK_OK(mha_module_create(&m1, &c));
    mha_init_options io;
    mha_init_options_default(&io);
    CHECK_OK(mha_module_init(m0, &io));
    CHECK_OK(mha_module_init(m1, &io));
    static float x[L2 * N2 * E2], y0[L2 * N2 * E2], y1[L2 * N2 * E2],
        w[N2 * H2 * L2 * L2], w2[N2 * H2 * L2 * L2];
    fill(x, L2 * N2 * E2, 1.0f);
    mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 3, (int64_t[]){L2, N2, E2});
    mha_tensor y0t = mha_tensor_contiguous(y0, MHA_F32, 3, (int64_t[]){L2, N2, E2});
    mha_tensor y1t = mha_tensor_contiguous(y1, MHA_F32, 3, (int64_t[]){L2, N2, E2});
    mha_tensor wt = mha_tensor_contiguous(w, MHA_F32, 4, (int64_t[]){N2, H2, L2, L2});
    mha_tensor w2t = mha_tensor_contiguous(w2, MHA_F32, 4, (int64_t[]){N2, H2, L2, L2});
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = a.key = a.value = &xt;
    a.dropout_seed = 5;
    CHECK_OK(mha_forward(&y0t, NULL, m0, &a));
    CHECK_OK(mha_forward(&y1t, NULL, m1, &a));  // eval: p ignored
    CHECK(memcmp(y0, y1, sizeof y0) == 0);
    a.training = true;
    a.need_weights = true;
    a.average_attn_weights = false;
    CHECK_OK(mha_forward(&y1t, &wt, m1, &a));
    CHECK(memcmp(y0, y1, sizeof y0) != 0);
    int64_t zeros = 0, n = N2 * H2 * L2 * L2;
    for (int64_t i = 0; i < n; i++) zeros += w[i] == 0.0f;
    double frac = (double)zeros / (double)n, sd = sqrt(0.25 / (double)n);
    CHECKF(fabs(frac - 0.5) < 5 * sd, "dropped fraction %g (p = 0.5)", frac);
    // kept weights are softmax / (1 - p): each row sums to about 1 / (1-p) * kept mass
    CHECK_OK(mha_forward(&y0t, &w2t, m1, &a));  // same seed/offset: same mask
    CHECK(memcmp(w, w2, sizeof w) == 0);
    a.dropout_offset = 1;
    CHECK_OK(mha_forward(&y0t, &w2t, m1, &a));
    CHECK(memcmp(w, w2, sizeof w) != 0);
    mha_module_destroy(m0);
    mha_module_destroy(m1);
}

// A fully masked query row: its grad_query is 0; grads still finite.
static void test_fully_masked(void) {
    problem p;
    setup(&p, false, false, false, false);
    uint8_t am[L * S] = {0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0};
    mha_tensor amt = mha_tensor_contiguous(am, MHA_BOOL, 2, (int64_t[]){L, S});
    p.a.attn_mask = &amt;
    float gq[L * N * E];
    mha_tensor gqt = mha_tensor_contiguous(gq, MHA_F32, 3, (int64_t[]){L, N, E});
    mha_module *g = NULL;
    CHECK_OK(mha_module_create(&g, mha_module_config(p.m)));
    CHECK_OK(mha_backward(&gqt, NULL, NULL, g, p.m, &p.a, &p.gyt, false));
    for (int n = 0; n < N; n++)
        for (int e = 0; e < E; e++) CHECK(gq[(1 * N + n) * E + e] == 0.0f);
    for (int i = 0; i < mha_module_num_params(g); i++) {
        mha_param x;
        CHECK_OK(mha_module_param_at(&x, g, i));
        for (int64_t j = 0; j < x.numel; j++) CHECK(isfinite(x.data[j]));
    }
    // out_proj.bias gets every row's grad_output, the masked row included
    mha_param ob;
    CHECK_OK(mha_module_param(&ob, g, "out_proj.bias"));
    for (int e = 0; e < E; e++) {
        double s = 0;
        for (int r = 0; r < L * N; r++) s += p.gy[r * E + e];
        CHECK(fabs(ob.data[e] - s) < 1e-5);
    }
    mha_module_destroy(g);
    mha_module_destroy(p.m);
}

static void test_misuse(void) {
    problem p;
    setup(&p, false, false, false, false);
    float gq[L * N * E];
    mha_tensor bad = mha_tensor_contiguous(gq, MHA_F32, 3, (int64_t[]){N, L, E});
    CHECK_FAILS(mha_backward(&bad, NULL, NULL, NULL, p.m, &p.a, &p.gyt, false), MHA_ERR_SHAPE);
    CHECK_FAILS(mha_backward(NULL, NULL, NULL, NULL, p.m, &p.a, NULL, false), MHA_ERR_INVALID_ARG);
    mha_tensor gy_bad = mha_tensor_contiguous(p.gy, MHA_F32, 3, (int64_t[]){L, N, E - 1});
    CHECK_FAILS(mha_backward(NULL, NULL, NULL, NULL, p.m, &p.a, &gy_bad, false), MHA_ERR_SHAPE);
    CHECK_FAILS(mha_backward(NULL, NULL, NULL, p.m, p.m, &p.a, &p.gyt, false), MHA_ERR_INVALID_ARG);
    mha_config c;
    mha_config_init(&c, E, H);  // kdim/vdim differ from the module's
    mha_module *other = NULL;
    CHECK_OK(mha_module_create(&other, &c));
    CHECK_FAILS(mha_backward(NULL, NULL, NULL, other, p.m, &p.a, &p.gyt, false), MHA_ERR_INVALID_ARG);
    mha_tensor alias = mha_tensor_contiguous(p.q, MHA_F32, 3, (int64_t[]){L, N, E});
    CHECK_FAILS(mha_backward(&alias, NULL, NULL, NULL, p.m, &p.a, &p.gyt, false), MHA_ERR_INVALID_ARG);
    mha_module_destroy(other);
    mha_module_destroy(p.m);
}

int main(void) {
    for (int bkv = 0; bkv < 2; bkv++)
        for (int zero = 0; zero < 2; zero++)
            for (int masks = 0; masks < 2; masks++) check_fd(bkv, zero, false, masks);
    check_fd(true, true, true, true);
    check_fd(false, false, true, false);
    test_accumulate_threads();
    test_dropout_semantics();
    test_fully_masked();
    test_misuse();
    return check_summary("test_backward");
}
