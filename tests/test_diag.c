// test_diag.c: known answers of mha_diag_create (issue: "see inside the heads").
//  - uniform attention (zero W_Q: every logit 0) -> entropy ln S, flagged
//    dead, mean distance of a uniform row, logit max/std 0;
//  - two heads with identical projections -> similarity 1; different ->
//    below 1; the matrix symmetric with unit diagonal;
//  - a W_Q slice of rank r -> rank r; a zero slice -> rank 0; full ranks
//    otherwise; spectra descending; W_O columns;
//  - causal attention of a uniform head -> entropy of row i ln(i + 1);
//  - a NaN injected in the query, in a parameter -> reported with its
//    location; a finite run reports none;
//  - row subsampling, bad options and NULL arguments.
// Built without LAPACKE (CMake MHA_LAPACKE=OFF: MHA_HAVE_LAPACKE undefined)
// the ranks are -1 and every spectrum NULL with the documented message
// (mha.h), and every other answer above is the same.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "mha.h"

#ifdef MHA_HAVE_LAPACKE
#define HAVE_SVD 1
#else
#define HAVE_SVD 0
#endif

static uint64_t rs = 99;
static float urand(void) {
    rs = rs * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((rs >> 40) * (1.0 / 16777216.0)) * 2.0f - 1.0f;
}

static mha_module *make(int64_t E, int64_t H) {
    mha_config cfg;
    mha_config_init(&cfg, E, H);
    mha_module *m = NULL;
    CHECK_OK(mha_module_create(&m, &cfg));
    mha_init_options io;
    mha_init_options_init(&io);
    io.seed = 5;
    if (m) CHECK_OK(mha_module_init(m, &io));
    return m;
}

static float *pdata(mha_module *m, const char *name) {
    mha_param p;
    CHECK_OK(mha_module_param(&p, m, name));
    return p.data;
}

// query (L, 1, E), self-attention
static mha_tensor input(float *x, int64_t L, int64_t E) {
    for (int64_t i = 0; i < L * E; i++) x[i] = urand();
    return mha_tensor_contiguous(x, MHA_F32, 3, (int64_t[]){L, 1, E});
}

static mha_diag *diagnose(const mha_module *m, mha_tensor *x, bool causal,
                          const mha_diag_options *o) {
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = a.key = a.value = x;
    a.opts.is_causal = causal;
    mha_diag *d = NULL;
    CHECK_OK(mha_diag_create(&d, m, &a, o));
    return d;
}

static void test_uniform(void) {
    const int64_t E = 16, H = 2, d = 8, L = 10;
    mha_module *m = make(E, H);
    if (!m) return;
    float *W = pdata(m, "in_proj_weight");
    memset(W, 0, sizeof(float) * (size_t)(d * E));  // head 0's W_Q rows
    // head 1 sharp (a freshly initialised head at this size attends almost
    // uniformly: entropy_norm 0.997, rightly flagged)
    for (int64_t i = d * E; i < 2 * d * E; i++) W[i] *= 8.0f;
    float x[L * E];
    mha_tensor xt = input(x, L, E);
    mha_diag *dg = diagnose(m, &xt, false, NULL);
    if (!dg) return;
    CHECK(mha_diag_num_heads(dg) == H && mha_diag_rows(dg) == L);
    const mha_head_diag *h0 = mha_diag_head(dg, 0), *h1 = mha_diag_head(dg, 1);
    CHECKF(fabs(h0->entropy_mean - log((double)L)) < 1e-12, "entropy %g vs ln S %g",
           h0->entropy_mean, log((double)L));
    CHECK(fabs(h0->entropy_min - log((double)L)) < 1e-12);
    CHECK(fabs(h0->entropy_norm - 1.0) < 1e-12);
    CHECK(h0->dead);
    CHECK(h0->logit_max == 0.0 && h0->logit_std == 0.0);
    // uniform row i: mean |i - j| over j < L; averaged over rows
    double md = 0;
    for (int64_t i = 0; i < L; i++)
        for (int64_t j = 0; j < L; j++) md += fabs((double)(i - j)) / (double)(L * L);
    CHECKF(fabs(h0->mean_distance - md) < 1e-12, "distance %g vs %g", h0->mean_distance, md);
    CHECKF(!h1->dead && h1->entropy_mean < log((double)L),
           "head 1: dead %d entropy %g norm %g var ratio %g", h1->dead, h1->entropy_mean,
           h1->entropy_norm, h1->output_var_ratio);
    CHECK(h1->logit_std > 0);
    if (HAVE_SVD) CHECK(h0->rank_q == 0 && h1->rank_q == d);
    else CHECK(h0->rank_q == -1 && h1->rank_q == -1);
    CHECK(mha_diag_nonfinite(dg) == NULL);
    mha_diag_destroy(dg);

    // causal: row i sees i + 1 keys uniformly -> entropy ln(i + 1)
    dg = diagnose(m, &xt, true, NULL);
    if (dg) {
        double e = 0, mn = INFINITY;
        for (int64_t i = 0; i < L; i++) e += log((double)(i + 1)) / (double)L;
        mn = 0.0;  // row 0 sees one key
        h0 = mha_diag_head(dg, 0);
        CHECKF(fabs(h0->entropy_mean - e) < 1e-12, "causal entropy %g vs %g", h0->entropy_mean,
               e);
        CHECK(h0->entropy_min == mn);
        CHECK(fabs(h0->entropy_norm - 1.0) < 1e-12 && h0->dead);
    }
    mha_diag_destroy(dg);
    mha_module_destroy(m);
}

static void test_similarity(void) {
    const int64_t E = 24, H = 3, d = 8, L = 12;
    mha_module *m = make(E, H);
    if (!m) return;
    float *W = pdata(m, "in_proj_weight");
    // head 1 = head 0: the same W_Q and W_K rows (and W_V)
    for (int part = 0; part < 3; part++)
        memcpy(W + (part * E + d) * E, W + part * E * E, sizeof(float) * (size_t)(d * E));
    float *b = pdata(m, "in_proj_bias");
    for (int64_t i = 0; i < 3 * E; i++) b[i] = 0.1f * urand();
    for (int part = 0; part < 3; part++)
        memcpy(b + part * E + d, b + part * E, sizeof(float) * (size_t)d);
    float x[L * E];
    mha_tensor xt = input(x, L, E);
    mha_diag *dg = diagnose(m, &xt, false, NULL);
    if (!dg) return;
    const double s01 = mha_diag_similarity(dg, 0, 1), s02 = mha_diag_similarity(dg, 0, 2);
    CHECKF(fabs(s01 - 1.0) < 1e-12, "identical heads: similarity %.15g", s01);
    CHECKF(s02 < 0.999 && s02 > 0.0, "different heads: similarity %g", s02);
    for (int64_t i = 0; i < H; i++) {
        CHECK(mha_diag_similarity(dg, i, i) == 1.0);
        for (int64_t j = 0; j < H; j++)
            CHECK(mha_diag_similarity(dg, i, j) == mha_diag_similarity(dg, j, i));
    }
    CHECK(isnan(mha_diag_similarity(dg, 0, 3)));
    const mha_head_diag *h0 = mha_diag_head(dg, 0), *h1 = mha_diag_head(dg, 1);
    CHECK(h0->entropy_mean == h1->entropy_mean && h0->logit_max == h1->logit_max);
    mha_diag_destroy(dg);
    mha_module_destroy(m);
}

// Built without LAPACKE: every rank -1; every spectrum NULL, *n = 0, with
// the documented message; bad arguments still NULL.
static void test_no_svd(const mha_diag *dg) {
    const int64_t H = mha_diag_num_heads(dg);
    for (int64_t h = 0; h < H; h++) {
        const mha_head_diag *hd = mha_diag_head(dg, h);
        CHECKF(hd->rank_q == -1 && hd->rank_k == -1 && hd->rank_v == -1 && hd->rank_o == -1,
               "head %lld: ranks %lld %lld %lld %lld, want -1 without LAPACKE", (long long)h,
               (long long)hd->rank_q, (long long)hd->rank_k, (long long)hd->rank_v,
               (long long)hd->rank_o);
        for (const char *w = "qkvo"; *w; w++) {
            int64_t n = 7;
            const double *sv = mha_diag_spectrum(dg, h, *w, &n);
            const char *msg = mha_last_error();
            CHECKF(sv == NULL && n == 0 &&
                       strstr(msg, "singular values unavailable: mha was built without LAPACKE"),
                   "head %lld '%c': spectrum %p, n %lld, last error \"%s\"", (long long)h, *w,
                   (const void *)sv, (long long)n, msg);
        }
    }
    int64_t n = 7;
    CHECK(mha_diag_spectrum(dg, 0, 'x', &n) == NULL && n == 0);
    CHECK(mha_diag_spectrum(dg, H, 'q', &n) == NULL);
    CHECK(mha_diag_spectrum(NULL, 0, 'q', &n) == NULL);
    printf("test_diag: built without LAPACKE: ranks -1, no spectra (as documented)\n");
}

static void test_rank(void) {
    const int64_t E = 32, H = 4, d = 8, L = 6;
    mha_module *m = make(E, H);
    if (!m) return;
    float *W = pdata(m, "in_proj_weight");
    // head 1's W_Q slice = A (d, r) B (r, E), rank r = 3; head 2's zero
    const int r = 3;
    float A[8 * 3], B[3 * 32];
    for (int i = 0; i < d * r; i++) A[i] = urand();
    for (int i = 0; i < r * E; i++) B[i] = urand();
    for (int64_t i = 0; i < d; i++)
        for (int64_t c = 0; c < E; c++) {
            float s = 0;
            for (int t = 0; t < r; t++) s += A[i * r + t] * B[t * E + c];
            W[(d + i) * E + c] = s;
        }
    memset(W + 2 * d * E, 0, sizeof(float) * (size_t)(d * E));
    // W_O columns of head 3: rank 1 (every column the same)
    float *Wo = pdata(m, "out_proj.weight");
    for (int64_t row = 0; row < E; row++)
        for (int64_t c = 1; c < d; c++) Wo[row * E + 3 * d + c] = Wo[row * E + 3 * d];
    float x[L * E];
    mha_tensor xt = input(x, L, E);
    mha_diag *dg = diagnose(m, &xt, false, NULL);
    if (!dg) return;
    if (!HAVE_SVD) {
        test_no_svd(dg);
        mha_diag_destroy(dg);
        mha_module_destroy(m);
        return;
    }
    CHECK(mha_diag_head(dg, 0)->rank_q == d);
    CHECKF(mha_diag_head(dg, 1)->rank_q == r, "rank %lld, want %d",
           (long long)mha_diag_head(dg, 1)->rank_q, r);
    CHECK(mha_diag_head(dg, 2)->rank_q == 0);
    for (int64_t h = 0; h < H; h++) {
        const mha_head_diag *hd = mha_diag_head(dg, h);
        CHECK(hd->rank_k == d && hd->rank_v == d);
        CHECK(hd->rank_o == (h == 3 ? 1 : d));
        for (const char *w = "qkvo"; *w; w++) {
            int64_t n = 0;
            const double *sv = mha_diag_spectrum(dg, h, *w, &n);
            CHECK(sv && n == d);
            for (int64_t i = 1; sv && i < n; i++) CHECK(sv[i] <= sv[i - 1] && sv[i] >= 0);
        }
    }
    // the rank-3 slice: the 4th singular value is at rounding level
    int64_t n;
    const double *sv = mha_diag_spectrum(dg, 1, 'q', &n);
    CHECK(sv && sv[r] < 1e-5 * sv[0] && sv[r - 1] > 1e-3 * sv[0]);
    CHECK(mha_diag_spectrum(dg, 0, 'x', &n) == NULL && n == 0);
    CHECK(mha_diag_spectrum(dg, 4, 'q', &n) == NULL);
    CHECK(mha_diag_spectrum(dg, 0, '\0', &n) == NULL);
    CHECK(mha_diag_head(dg, -1) == NULL && mha_diag_head(dg, H) == NULL);
    mha_diag_destroy(dg);
    mha_module_destroy(m);
}

static void test_nonfinite(void) {
    const int64_t E = 16, H = 2, L = 5;
    mha_module *m = make(E, H);
    if (!m) return;
    float x[L * E];
    mha_tensor xt = input(x, L, E);
    x[(3 * 1 + 0) * E + 7] = NAN;  // query[3, 0, 7]
    mha_diag *dg = diagnose(m, &xt, false, NULL);
    const char *w = dg ? mha_diag_nonfinite(dg) : NULL;
    CHECKF(w && strncmp(w, "query[3, 0, 7] = ", 17) == 0, "reported: %s", w ? w : "(none)");
    mha_diag_destroy(dg);
    x[(3 * 1 + 0) * E + 7] = 0.5f;
    float *Wo = pdata(m, "out_proj.weight");
    Wo[2 * E + 9] = INFINITY;
    dg = diagnose(m, &xt, false, NULL);
    w = dg ? mha_diag_nonfinite(dg) : NULL;
    CHECKF(w && strncmp(w, "out_proj.weight[2, 9] = inf", 27) == 0, "reported: %s",
           w ? w : "(none)");
    mha_diag_destroy(dg);
    Wo[2 * E + 9] = 0.0f;
    // a finite input whose logits overflow float32 is still finite in
    // double: large but no report
    float *W = pdata(m, "in_proj_weight");
    for (int64_t i = 0; i < E * E; i++) W[i] *= 1e20f;
    dg = diagnose(m, &xt, false, NULL);
    CHECK(dg && mha_diag_nonfinite(dg) == NULL);
    CHECK(dg && mha_diag_head(dg, 0)->logit_max > 1e15);
    mha_diag_destroy(dg);
    mha_module_destroy(m);
}

static void test_options(void) {
    const int64_t E = 16, H = 2, L = 40;
    mha_module *m = make(E, H);
    if (!m) return;
    float x[L * E];
    mha_tensor xt = input(x, L, E);
    mha_diag_options o;
    mha_diag_options_init(&o);
    CHECK(o.max_rows == 256 && o.dead_entropy == 0.98 && o.dead_output == 1e-4);
    o.max_rows = 8;
    mha_diag *dg = diagnose(m, &xt, false, &o);
    CHECK(dg && mha_diag_rows(dg) == 8 && mha_diag_head(dg, 0)->rows == 8);
    mha_diag_destroy(dg);
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = a.key = a.value = &xt;
    o.max_rows = -1;
    dg = NULL;
    CHECK_FAILS(mha_diag_create(&dg, m, &a, &o), MHA_ERR_INVALID_ARG);
    CHECK(dg == NULL);
    mha_diag_options_init(&o);
    o.dead_entropy = 1.5;
    CHECK_FAILS(mha_diag_create(&dg, m, &a, &o), MHA_ERR_INVALID_ARG);
    CHECK_FAILS(mha_diag_create(NULL, m, &a, NULL), MHA_ERR_INVALID_ARG);
    CHECK_FAILS(mha_diag_create(&dg, NULL, &a, NULL), MHA_ERR_INVALID_ARG);
    // the forward's own checks apply: a key of the wrong width
    float kx[L * 8];
    mha_tensor kt = mha_tensor_contiguous(kx, MHA_F32, 3, (int64_t[]){L, 1, 8});
    a.key = &kt;
    CHECK_FAILS(mha_diag_create(&dg, m, &a, NULL), MHA_ERR_SHAPE);
    mha_diag_destroy(NULL);
    CHECK(mha_diag_num_heads(NULL) == 0 && mha_diag_nonfinite(NULL) == NULL);
    mha_module_destroy(m);
}

// head_dim != E / H (E 10, H 3, d 4, one KV head, separate q/k/v): the
// ranks of each head's W_Q rows, W_K / W_V rows and W_O columns of the
// (E, Eq) out_proj.weight; a custom scale scales the logits it reports.
static void test_rank_head_dim(void) {
    const int64_t E = 10, H = 3, d = 4, Eq = 12, L = 7;
    mha_config cfg;
    mha_config_init(&cfg, E, H);
    cfg.head_dim = d;
    cfg.num_kv_heads = 1;
    cfg.separate_qkv = true;
    mha_module *m = NULL;
    CHECK_OK(mha_module_create(&m, &cfg));
    if (!m) return;
    mha_init_options io;
    mha_init_options_init(&io);
    io.seed = 9;
    CHECK_OK(mha_module_init(m, &io));
    float *Wq = pdata(m, "q_proj_weight"), *Wo = pdata(m, "out_proj.weight");
    for (int64_t i = 0; i < d; i++)  // head 1: rows 5..7 copies of row 4 (rank 1)
        for (int64_t c = 0; c < E; c++) Wq[(d + i) * E + c] = Wq[d * E + c] * (float)(i + 1);
    memset(Wq + 2 * d * E, 0, sizeof(float) * (size_t)(d * E));  // head 2: zero
    for (int64_t row = 0; row < E; row++)  // head 0's W_O columns: rank 1
        for (int64_t c = 1; c < d; c++) Wo[row * Eq + c] = Wo[row * Eq] * 0.5f * (float)c;
    float x[L * 10];
    mha_tensor xt = input(x, L, E);
    mha_diag *dg = diagnose(m, &xt, false, NULL);
    if (dg && HAVE_SVD) {
        static const int64_t want_q[3] = {4, 1, 0}, want_o[3] = {1, 4, 4};
        for (int64_t h = 0; h < H; h++) {
            const mha_head_diag *hd = mha_diag_head(dg, h);
            CHECKF(hd->rank_q == want_q[h] && hd->rank_o == want_o[h] && hd->rank_k == d &&
                       hd->rank_v == d,
                   "head_dim head %lld: ranks q %lld k %lld v %lld o %lld", (long long)h,
                   (long long)hd->rank_q, (long long)hd->rank_k, (long long)hd->rank_v,
                   (long long)hd->rank_o);
            int64_t n = 0;
            CHECK(mha_diag_spectrum(dg, h, 'o', &n) && n == d);
        }
    }
    if (dg && !HAVE_SVD) CHECK(mha_diag_head(dg, 0)->rank_q == -1);
    // the scale: 2 / sqrt(d) doubles the logits (max and std)
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = a.key = a.value = &xt;
    a.opts.scale = 2.0 / sqrt((double)d);
    mha_diag *d2 = NULL;
    CHECK_OK(mha_diag_create(&d2, m, &a, NULL));
    for (int64_t h = 0; dg && d2 && h < 2; h++) {
        const mha_head_diag *h1 = mha_diag_head(dg, h), *h2 = mha_diag_head(d2, h);
        CHECKF(fabs(h2->logit_max - 2 * h1->logit_max) <= 1e-9 * (1 + fabs(h1->logit_max)) &&
                   fabs(h2->logit_std - 2 * h1->logit_std) <= 1e-9 * (1 + h1->logit_std),
               "scale: logit max %g -> %g, std %g -> %g", h1->logit_max, h2->logit_max,
               h1->logit_std, h2->logit_std);
    }
    a.opts.scale = NAN;
    mha_diag *d3 = NULL;
    CHECK_FAILS(mha_diag_create(&d3, m, &a, NULL), MHA_ERR_INVALID_ARG);
    mha_diag_destroy(d2);
    mha_diag_destroy(dg);
    mha_module_destroy(m);
}

// qk_norm: the diagnostics see the normalised q and k. RMSNorm makes
// each head's q scale-free, so W_Q and b_Q times 8 leave every head's entropy as
// it was (to 1e-4: eps aside); a zero q_norm.weight makes q zero, every row uniform:
// entropy ln L.
static void test_qk_norm(void) {
    const int64_t E = 16, H = 2, L = 10;
    for (int kind = MHA_QK_NORM_HEAD; kind <= MHA_QK_NORM_ALL; kind++) {
        mha_config cfg;
        mha_config_init(&cfg, E, H);
        cfg.qk_norm = (mha_qk_norm)kind;
        mha_module *m = NULL;
        CHECK_OK(mha_module_create(&m, &cfg));
        mha_init_options io;
        mha_init_options_init(&io);
        io.seed = 7;
        CHECK_OK(mha_module_init(m, &io));
        float x[L * E];
        mha_tensor xt = input(x, L, E);
        mha_diag *d0 = diagnose(m, &xt, false, NULL);
        float *W = pdata(m, "in_proj_weight");
        float *b = pdata(m, "in_proj_bias");
        for (int64_t i = 0; i < E * E; i++) W[i] *= 8.0f;  // W_Q and b_Q
        for (int64_t i = 0; i < E; i++) b[i] *= 8.0f;
        mha_diag *d1 = diagnose(m, &xt, false, NULL);
        for (int64_t h = 0; d0 && d1 && h < H; h++) {
            const double e0 = mha_diag_head(d0, h)->entropy_mean,
                         e1 = mha_diag_head(d1, h)->entropy_mean;
            CHECKF(fabs(e0 - e1) < 1e-4 && e0 < log((double)L) - 1e-3,
                   "qk_norm %d head %lld: entropy %g, W_Q x 8: %g (ln L %g)", kind,
                   (long long)h, e0, e1, log((double)L));
        }
        mha_diag_destroy(d0);
        mha_diag_destroy(d1);
        float *qn = pdata(m, "q_norm.weight");
        memset(qn, 0, sizeof(float) * (size_t)(kind == MHA_QK_NORM_HEAD ? E / H : E));
        mha_diag *dz = diagnose(m, &xt, false, NULL);
        for (int64_t h = 0; dz && h < H; h++)
            CHECKF(fabs(mha_diag_head(dz, h)->entropy_mean - log((double)L)) < 1e-12,
                   "qk_norm %d head %lld: zero q_norm.weight, entropy %g vs ln L", kind,
                   (long long)h, mha_diag_head(dz, h)->entropy_mean);
        mha_diag_destroy(dz);
        mha_module_destroy(m);
    }
}

int main(void) {
    test_uniform();
    test_similarity();
    test_rank();
    test_rank_head_dim();
    test_nonfinite();
    test_options();
    test_qk_norm();
    return check_summary("test_diag");
}
