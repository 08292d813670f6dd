// test_module.c: module construction, parameter names/shapes, the
// initialisation schemes (distribution checks), save/load round trip.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "mha.h"

static void test_params_packed(void) {
    mha_config c;
    mha_config_init(&c, 12, 3);
    c.add_bias_kv = true;
    mha_module *m = NULL;
    CHECK_OK(mha_module_create(&m, &c));
    const char *want[] = {"in_proj_weight", "in_proj_bias",    "bias_k",
                          "bias_v",         "out_proj.weight", "out_proj.bias"};
    const int64_t numel[] = {36 * 12, 36, 12, 12, 144, 12};
    CHECK(mha_module_num_params(m) == 6);
    for (int i = 0; i < 6; i++) {
        mha_param p;
        CHECK_OK(mha_module_param_at(&p, m, i));
        CHECKF(!strcmp(p.name, want[i]), "param %d is %s, want %s", i, p.name, want[i]);
        CHECK(p.numel == numel[i]);
        CHECK(((uintptr_t)p.data & 63) == 0);
        for (int64_t j = 0; j < p.numel; j++) CHECK(p.data[j] == 0.0f);
    }
    mha_param p;
    CHECK_OK(mha_module_param(&p, m, "bias_k"));
    CHECK(p.ndim == 3 && p.shape[0] == 1 && p.shape[1] == 1 && p.shape[2] == 12);
    CHECK_FAILS(mha_module_param(&p, m, "q_proj_weight"), MHA_ERR_NOT_FOUND);
    CHECK_FAILS(mha_module_param_at(&p, m, 6), MHA_ERR_INVALID_ARG);
    CHECK(mha_module_config(m)->kdim == 12 && mha_module_config(m)->vdim == 12);
    mha_module_destroy(m);
}

static void test_params_separate(void) {
    mha_config c;
    mha_config_init(&c, 8, 2);
    c.kdim = 5;
    c.vdim = 3;
    c.bias = false;
    mha_module *m = NULL;
    CHECK_OK(mha_module_create(&m, &c));
    CHECK(mha_module_num_params(m) == 4);
    mha_param p;
    CHECK_OK(mha_module_param(&p, m, "k_proj_weight"));
    CHECK(p.shape[0] == 8 && p.shape[1] == 5);
    CHECK_OK(mha_module_param(&p, m, "v_proj_weight"));
    CHECK(p.shape[0] == 8 && p.shape[1] == 3);
    CHECK_FAILS(mha_module_param(&p, m, "in_proj_bias"), MHA_ERR_NOT_FOUND);
    CHECK_FAILS(mha_module_param(&p, m, "in_proj_weight"), MHA_ERR_NOT_FOUND);
    mha_module_destroy(m);
}

static void test_bad_config(void) {
    mha_config c;
    mha_module *m = NULL;
    mha_config_init(&c, 10, 3);
    CHECK_FAILS(mha_module_create(&m, &c), MHA_ERR_INVALID_ARG);
    CHECKF(strstr(mha_last_error(), "10") && strstr(mha_last_error(), "3"),
           "message must name both numbers: %s", mha_last_error());
    CHECK(m == NULL);
    mha_config_init(&c, 0, 1);
    CHECK_FAILS(mha_module_create(&m, &c), MHA_ERR_INVALID_ARG);
    mha_config_init(&c, 8, 0);
    CHECK_FAILS(mha_module_create(&m, &c), MHA_ERR_INVALID_ARG);
    mha_config_init(&c, 8, -2);
    CHECK_FAILS(mha_module_create(&m, &c), MHA_ERR_INVALID_ARG);
    mha_config_init(&c, 8, 2);
    c.kdim = -1;
    CHECK_FAILS(mha_module_create(&m, &c), MHA_ERR_INVALID_ARG);
    mha_config_init(&c, 8, 2);
    c.dropout = 1.0f;
    CHECK_FAILS(mha_module_create(&m, &c), MHA_ERR_INVALID_ARG);
    c.dropout = NAN;
    CHECK_FAILS(mha_module_create(&m, &c), MHA_ERR_INVALID_ARG);
    mha_config_init(&c, INT64_MAX / 2, 1);
    CHECK_FAILS(mha_module_create(&m, &c), MHA_ERR_OVERFLOW);
    CHECK_FAILS(mha_module_create(NULL, &c), MHA_ERR_INVALID_ARG);
    CHECK_FAILS(mha_module_create(&m, NULL), MHA_ERR_INVALID_ARG);
    mha_module_destroy(NULL);  // accepts NULL
}

typedef struct stats {
    double mean, std, maxabs;
} stats;

static stats stats_of(const float *x, int64_t n) {
    double s = 0, s2 = 0, mx = 0;
    for (int64_t i = 0; i < n; i++) {
        s += x[i];
        s2 += (double)x[i] * x[i];
        if (fabs(x[i]) > mx) mx = fabs(x[i]);
    }
    stats r = {s / n, sqrt(s2 / n - (s / n) * (s / n)), mx};
    return r;
}

static mha_module *make(int64_t E, int64_t H, int64_t kdim, bool bkv, mha_init_scheme sch,
                        double gain, double std, uint64_t seed) {
    mha_config c;
    mha_config_init(&c, E, H);
    c.kdim = kdim;
    c.add_bias_kv = bkv;
    mha_module *m = NULL;
    CHECK_OK(mha_module_create(&m, &c));
    mha_init_options o;
    mha_init_options_init(&o);
    o.scheme = sch;
    o.gain = gain;
    o.std = std;
    o.seed = seed;
    // biases are zeroed by init even if they were not zero before
    mha_param b;
    if (mha_module_param(&b, m, "in_proj_bias") == MHA_OK) b.data[0] = 5.0f;
    CHECK_OK(mha_module_init(m, &o));
    return m;
}

static float *param(mha_module *m, const char *name, int64_t *n) {
    mha_param p;
    CHECK_OK(mha_module_param(&p, m, name));
    *n = p.numel;
    return p.data;
}

static stats pstats(mha_module *m, const char *name) {
    int64_t n;
    float *x = param(m, name, &n);
    return stats_of(x, n);
}

static void test_init_default(void) {
    const int64_t E = 256;
    mha_module *m = make(E, 8, 0, true, MHA_INIT_XAVIER_UNIFORM, 1.0, 0, 7);
    int64_t n;
    float *w = param(m, "in_proj_weight", &n);
    // xavier_uniform over (3E, E): bound sqrt(6 / (E + 3E)), std bound/sqrt(3)
    double bound = sqrt(6.0 / (4.0 * E));
    stats s = stats_of(w, n);
    CHECKF(s.maxabs <= bound && s.maxabs > 0.99 * bound, "max %g bound %g", s.maxabs, bound);
    CHECKF(fabs(s.std - bound / sqrt(3.0)) < 0.01 * bound, "std %g", s.std);
    CHECK(fabs(s.mean) < 0.01 * bound);
    w = param(m, "out_proj.weight", &n);
    s = stats_of(w, n);
    bound = 1.0 / sqrt((double)E);  // kaiming_uniform(a = sqrt(5))
    CHECKF(s.maxabs <= bound && s.maxabs > 0.99 * bound, "out max %g bound %g", s.maxabs, bound);
    w = param(m, "in_proj_bias", &n);
    s = stats_of(w, n);
    CHECK(s.maxabs == 0.0);
    w = param(m, "out_proj.bias", &n);
    CHECK(stats_of(w, n).maxabs == 0.0);
    float *bk = param(m, "bias_k", &n), *bv;
    int64_t n2;
    bv = param(m, "bias_v", &n2);
    // xavier_normal on (1, 1, E): std 1/sqrt(E); 256 samples: loose check
    s = stats_of(bk, n);
    CHECKF(s.std > 0.7 / sqrt((double)E) && s.std < 1.3 / sqrt((double)E), "bias_k std %g",
           s.std);
    CHECK(memcmp(bk, bv, (size_t)n * 4) != 0);
    // same seed: same values; other seed: different
    mha_module *m2 = make(E, 8, 0, true, MHA_INIT_XAVIER_UNIFORM, 1.0, 0, 7);
    mha_module *m3 = make(E, 8, 0, true, MHA_INIT_XAVIER_UNIFORM, 1.0, 0, 8);
    float *a = param(m, "in_proj_weight", &n), *b2 = param(m2, "in_proj_weight", &n),
          *c = param(m3, "in_proj_weight", &n);
    CHECK(memcmp(a, b2, (size_t)n * 4) == 0);
    CHECK(memcmp(a, c, (size_t)n * 4) != 0);
    mha_module_destroy(m);
    mha_module_destroy(m2);
    mha_module_destroy(m3);
}

static void test_init_separate_fans(void) {
    // k_proj_weight (E, kdim): bound sqrt(6 / (kdim + E))
    mha_module *m = make(64, 4, 192, false, MHA_INIT_XAVIER_UNIFORM, 2.0, 0, 1);
    int64_t n;
    float *w = param(m, "k_proj_weight", &n);
    double bound = 2.0 * sqrt(6.0 / (64.0 + 192.0));
    stats s = stats_of(w, n);
    CHECKF(s.maxabs <= bound && s.maxabs > 0.98 * bound, "max %g bound %g", s.maxabs, bound);
    mha_module_destroy(m);
}

static void test_init_normal_schemes(void) {
    const int64_t E = 128;
    mha_module *m = make(E, 4, 0, false, MHA_INIT_NORMAL, 1.0, 0.02, 3);
    stats s = pstats(m, "in_proj_weight");
    CHECKF(fabs(s.std - 0.02) < 0.0005, "normal std %g", s.std);
    s = pstats(m, "out_proj.weight");
    CHECKF(fabs(s.std - 0.02) < 0.001, "normal out std %g", s.std);
    mha_module_destroy(m);
    m = make(E, 4, 0, false, MHA_INIT_XAVIER_NORMAL, 0.5, 0, 3);
    s = pstats(m, "in_proj_weight");
    double want = 0.5 * sqrt(2.0 / (4.0 * E));
    CHECKF(fabs(s.std - want) < 0.02 * want, "xavier_normal std %g want %g", s.std, want);
    mha_module_destroy(m);
    m = make(E, 4, 0, true, MHA_INIT_ZEROS, 1.0, 0, 3);
    CHECK(pstats(m, "in_proj_weight").maxabs == 0);
    CHECK(pstats(m, "out_proj.weight").maxabs == 0);
    CHECK(pstats(m, "bias_k").maxabs == 0);
    mha_module_destroy(m);
}

static void test_init_orthogonal(void) {
    const int64_t E = 16;
    int64_t n;
    mha_module *m = make(E, 4, 0, false, MHA_INIT_ORTHOGONAL, 1.5, 0, 11);
    // (3E, E): columns orthonormal (times gain): W^T W = gain^2 I
    float *w = param(m, "in_proj_weight", &n);
    double maxerr = 0;
    for (int64_t a = 0; a < E; a++)
        for (int64_t b = 0; b < E; b++) {
            double s = 0;
            for (int64_t r = 0; r < 3 * E; r++) s += (double)w[r * E + a] * w[r * E + b];
            double e = fabs(s - (a == b ? 2.25 : 0.0));
            if (e > maxerr) maxerr = e;
        }
    CHECKF(maxerr < 1e-5, "W^T W - g^2 I max err %g", maxerr);
    w = param(m, "out_proj.weight", &n);  // square: W W^T = g^2 I
    maxerr = 0;
    for (int64_t a = 0; a < E; a++)
        for (int64_t b = 0; b < E; b++) {
            double s = 0;
            for (int64_t c = 0; c < E; c++) s += (double)w[a * E + c] * w[b * E + c];
            double e = fabs(s - (a == b ? 2.25 : 0.0));
            if (e > maxerr) maxerr = e;
        }
    CHECKF(maxerr < 1e-5, "out W W^T max err %g", maxerr);
    mha_module_destroy(m);
}

static void test_init_errors(void) {
    mha_module *m = make(8, 2, 0, false, MHA_INIT_ZEROS, 1, 0, 0);
    mha_init_options o;
    mha_init_options_init(&o);
    o.std = -1;
    o.scheme = MHA_INIT_NORMAL;
    CHECK_FAILS(mha_module_init(m, &o), MHA_ERR_INVALID_ARG);
    o.std = 0.02;
    o.gain = INFINITY;
    CHECK_FAILS(mha_module_init(m, &o), MHA_ERR_INVALID_ARG);
    o.gain = 1;
    o.scheme = (mha_init_scheme)42;
    CHECK_FAILS(mha_module_init(m, &o), MHA_ERR_INVALID_ARG);
    mha_init_scheme s;
    CHECK_OK(mha_init_scheme_from_name(&s, "orthogonal"));
    CHECK(s == MHA_INIT_ORTHOGONAL);
    CHECK_FAILS(mha_init_scheme_from_name(&s, "kaiming"), MHA_ERR_INVALID_ARG);
    mha_module_destroy(m);
}

static void test_save_load(void) {
    const char *dir = getenv("MHA_TEST_TMPDIR");
    char path[512];
    snprintf(path, sizeof path, "%s/test_module_w.safetensors", dir ? dir : "/tmp");
    mha_module *m = make(12, 3, 7, true, MHA_INIT_XAVIER_UNIFORM, 1.0, 0, 5);
    CHECK_OK(mha_module_save(m, path));
    mha_st_file *f = NULL;
    CHECK_OK(mha_st_open(&f, path));
    CHECK(f && mha_st_metadata(f, "num_heads") && !strcmp(mha_st_metadata(f, "num_heads"), "3"));
    mha_module *m2 = NULL;
    CHECK_OK(mha_module_load(&m2, f, NULL));
    if (m2) {
        const mha_config *c = mha_module_config(m2);
        CHECK(c->embed_dim == 12 && c->num_heads == 3 && c->kdim == 7 && c->vdim == 12);
        CHECK(c->bias && c->add_bias_kv);
        CHECK(mha_module_num_params(m2) == mha_module_num_params(m));
        for (int i = 0; i < mha_module_num_params(m); i++) {
            mha_param a, b;
            CHECK_OK(mha_module_param_at(&a, m, i));
            CHECK_OK(mha_module_param_at(&b, m2, i));
            CHECK(!strcmp(a.name, b.name) && a.numel == b.numel);
            CHECK(memcmp(a.data, b.data, (size_t)a.numel * 4) == 0);
        }
    }
    // num_heads override that does not divide embed_dim
    mha_config base;
    mha_config_init(&base, 0, 5);
    mha_module *m3 = NULL;
    CHECK_FAILS(mha_module_load(&m3, f, &base), MHA_ERR_INVALID_ARG);
    CHECK(m3 == NULL);
    mha_st_close(f);
    mha_module_destroy(m);
    mha_module_destroy(m2);
}

// Grouped-query attention: parameter shapes from num_kv_heads (Ekv = Hkv d),
// the config check, xavier_uniform on the packed (E + 2 Ekv, E) matrix,
// save/load (metadata "num_kv_heads", or inferred from the shapes when the
// file has none) and inconsistent files.
static void test_gqa(void) {
    const char *dir = getenv("MHA_TEST_TMPDIR");
    char path[512];
    snprintf(path, sizeof path, "%s/test_module_gqa.safetensors", dir ? dir : "/tmp");
    mha_config c;
    mha_module *m = NULL;
    mha_config_init(&c, 24, 6);
    c.num_kv_heads = 4;  // does not divide 6
    CHECK_FAILS(mha_module_create(&m, &c), MHA_ERR_INVALID_ARG);
    CHECK(strstr(mha_last_error(), "num_kv_heads 4") && strstr(mha_last_error(), "num_heads 6"));
    c.num_kv_heads = -1;
    CHECK_FAILS(mha_module_create(&m, &c), MHA_ERR_INVALID_ARG);
    c.num_kv_heads = 2;  // Ekv = 8
    c.add_bias_kv = true;
    CHECK_OK(mha_module_create(&m, &c));
    CHECK(mha_module_config(m)->num_kv_heads == 2);
    mha_param p;
    CHECK_OK(mha_module_param(&p, m, "in_proj_weight"));
    CHECK(p.shape[0] == 24 + 16 && p.shape[1] == 24);
    CHECK_OK(mha_module_param(&p, m, "in_proj_bias"));
    CHECK(p.numel == 40);
    CHECK_OK(mha_module_param(&p, m, "bias_k"));
    CHECK(p.shape[2] == 8);
    CHECK_OK(mha_module_param(&p, m, "out_proj.weight"));
    CHECK(p.shape[0] == 24 && p.shape[1] == 24);
    mha_init_options o;
    mha_init_options_init(&o);
    CHECK_OK(mha_module_init(m, &o));
    CHECK_OK(mha_module_param(&p, m, "in_proj_weight"));
    stats st = stats_of(p.data, p.numel);
    double bound = sqrt(6.0 / (24.0 + 40.0));  // torch's fans of (E + 2 Ekv, E)
    CHECKF(st.maxabs <= bound && st.maxabs > 0.95 * bound, "gqa in_proj max %g bound %g",
           st.maxabs, bound);
    CHECK_OK(mha_module_save(m, path));
    mha_st_file *f = NULL;
    CHECK_OK(mha_st_open(&f, path));
    CHECK(mha_st_metadata(f, "num_kv_heads") &&
          !strcmp(mha_st_metadata(f, "num_kv_heads"), "2"));
    mha_module *m2 = NULL;
    CHECK_OK(mha_module_load(&m2, f, NULL));
    if (m2) {
        CHECK(mha_module_config(m2)->num_kv_heads == 2 && mha_module_config(m2)->num_heads == 6);
        for (int i = 0; i < mha_module_num_params(m); i++) {
            mha_param a, b;
            CHECK_OK(mha_module_param_at(&a, m, i));
            CHECK_OK(mha_module_param_at(&b, m2, i));
            CHECK(a.numel == b.numel && memcmp(a.data, b.data, (size_t)a.numel * 4) == 0);
        }
    }
    mha_module_destroy(m2);
    // a base num_kv_heads that contradicts the shapes: the shape error names it
    mha_config base;
    mha_config_init(&base, 0, 0);
    base.num_kv_heads = 3;
    m2 = NULL;
    CHECK_FAILS(mha_module_load(&m2, f, &base), MHA_ERR_SHAPE);
    CHECK(strstr(mha_last_error(), "num_kv_heads 3") != NULL);
    mha_st_close(f);
    // without the metadata: num_kv_heads from the shapes (separate weights
    // too); a K/V width that is no multiple of the head dim is refused
    for (int sep = 0; sep < 2; sep++) {
        mha_config cc;
        mha_config_init(&cc, 24, 6);
        cc.num_kv_heads = 1;
        if (sep) cc.kdim = 5;
        mha_module *mm = NULL;
        CHECK_OK(mha_module_create(&mm, &cc));
        mha_st_writer *w = NULL;
        CHECK_OK(mha_st_writer_create(&w));
        for (int i = 0; i < mha_module_num_params(mm); i++) {
            CHECK_OK(mha_module_param_at(&p, mm, i));
            CHECK_OK(mha_st_writer_add(w, p.name, MHA_F32, p.ndim, p.shape, p.data));
        }
        CHECK_OK(mha_st_writer_set_metadata(w, "num_heads", "6"));
        CHECK_OK(mha_st_writer_save(w, path));
        mha_st_writer_destroy(w);
        CHECK_OK(mha_st_open(&f, path));
        m2 = NULL;
        CHECK_OK(mha_module_load(&m2, f, NULL));
        CHECK(m2 && mha_module_config(m2)->num_kv_heads == 1);
        mha_module_destroy(m2);
        mha_st_close(f);
        mha_module_destroy(mm);
    }
    {
        float w0[30 * 24] = {0}, wo[24 * 24] = {0};  // in_proj (E + 2 * 3, E): d = 4
        mha_st_writer *w = NULL;
        CHECK_OK(mha_st_writer_create(&w));
        CHECK_OK(mha_st_writer_add(w, "in_proj_weight", MHA_F32, 2, (int64_t[]){30, 24}, w0));
        CHECK_OK(mha_st_writer_add(w, "out_proj.weight", MHA_F32, 2, (int64_t[]){24, 24}, wo));
        CHECK_OK(mha_st_writer_set_metadata(w, "num_heads", "6"));
        CHECK_OK(mha_st_writer_save(w, path));
        mha_st_writer_destroy(w);
        CHECK_OK(mha_st_open(&f, path));
        m2 = NULL;
        CHECK_FAILS(mha_module_load(&m2, f, NULL), MHA_ERR_SHAPE);
        CHECK(m2 == NULL && strstr(mha_last_error(), "in_proj_weight") != NULL);
        mha_st_close(f);
    }
    // the gradient module must have the same num_kv_heads
    mha_module *g = NULL;
    mha_config gc = *mha_module_config(m);
    gc.num_kv_heads = 6;
    CHECK_OK(mha_module_create(&g, &gc));
    float x[3 * 24], y[3 * 24];
    for (int i = 0; i < 3 * 24; i++) x[i] = 0.01f * (float)i;
    mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 2, (int64_t[]){3, 24});
    mha_tensor yt = mha_tensor_contiguous(y, MHA_F32, 2, (int64_t[]){3, 24});
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = a.key = a.value = &xt;
    CHECK_FAILS(mha_backward(NULL, NULL, NULL, g, m, &a, &yt, false), MHA_ERR_INVALID_ARG);
    CHECK(strstr(mha_last_error(), "num_kv_heads") != NULL);
    mha_module_destroy(g);
    mha_module_destroy(m);
}

// The checkpoint layouts (issue 17): head_dim != E / H (E need not be a
// multiple of H), separate q/k/v matrices with kdim = vdim = E, no
// out_proj.bias: parameter shapes, the config checks (and the overflow
// check with Eq = H head_dim), out_proj.weight's init fan (Eq), save ->
// load round trips of each layout (the layout inferred from the file, with
// or without __metadata__ num_kv_heads), load errors, conversion, and a
// gradient module of another layout refused.
static mha_module *layout_module(int64_t E, int64_t H, int64_t Hkv, int64_t d, bool sep,
                                 bool bias, bool nob, int64_t kdim, uint64_t seed) {
    mha_config c;
    mha_config_init(&c, E, H);
    c.num_kv_heads = Hkv;
    c.head_dim = d;
    c.separate_qkv = sep;
    c.bias = bias;
    c.no_out_bias = nob;
    c.kdim = kdim;
    c.add_bias_kv = seed % 2 == 1;
    c.sinks = seed % 3 == 0;  // "sinks" (H)
    mha_module *m = NULL;
    CHECK_OK(mha_module_create(&m, &c));
    mha_init_options o;
    mha_init_options_init(&o);
    o.seed = seed;
    if (m) CHECK_OK(mha_module_init(m, &o));
    for (int i = 0; m && i < mha_module_num_params(m); i++) {  // biases non-zero too
        mha_param p;
        CHECK_OK(mha_module_param_at(&p, m, i));
        if (p.ndim == 1)
            for (int64_t j = 0; j < p.numel; j++) p.data[j] = 0.01f * (float)(j % 13) - 0.05f;
    }
    return m;
}

static void check_same_module(const mha_module *a, const mha_module *b, const char *what) {
    const mha_config *x = mha_module_config(a), *y = mha_module_config(b);
    CHECKF(x->embed_dim == y->embed_dim && x->num_heads == y->num_heads &&
               x->num_kv_heads == y->num_kv_heads && x->head_dim == y->head_dim &&
               x->kdim == y->kdim && x->vdim == y->vdim && x->bias == y->bias &&
               x->no_out_bias == y->no_out_bias && x->separate_qkv == y->separate_qkv &&
               x->add_bias_kv == y->add_bias_kv && x->sinks == y->sinks,
           "%s: config differs (E %lld/%lld H %lld/%lld Hkv %lld/%lld d %lld/%lld sep %d/%d "
           "no_out_bias %d/%d)",
           what, (long long)x->embed_dim, (long long)y->embed_dim, (long long)x->num_heads,
           (long long)y->num_heads, (long long)x->num_kv_heads, (long long)y->num_kv_heads,
           (long long)x->head_dim, (long long)y->head_dim, x->separate_qkv, y->separate_qkv,
           x->no_out_bias, y->no_out_bias);
    CHECK(mha_module_num_params(a) == mha_module_num_params(b));
    for (int i = 0; i < mha_module_num_params(a) && i < mha_module_num_params(b); i++) {
        mha_param p, q;
        CHECK_OK(mha_module_param_at(&p, a, i));
        CHECK_OK(mha_module_param_at(&q, b, i));
        CHECKF(!strcmp(p.name, q.name) && p.numel == q.numel && p.ndim == q.ndim &&
                   memcmp(p.shape, q.shape, sizeof p.shape) == 0 &&
                   memcmp(p.storage, q.storage, (size_t)p.numel * mha_dtype_size(p.dtype)) == 0,
               "%s: parameter %s differs", what, p.name);
    }
}

static void test_layouts(void) {
    const char *dir = getenv("MHA_TEST_TMPDIR");
    char path[512];
    snprintf(path, sizeof path, "%s/test_module_layout.safetensors", dir ? dir : "/tmp");
    // head_dim 4 with E = 10, H = 3 (E % H != 0), Hkv 1: Eq 12, Ekv 4
    mha_module *m = layout_module(10, 3, 1, 4, false, true, false, 0, 1);
    CHECK(m && mha_module_config(m)->head_dim == 4);
    const char *want[] = {"in_proj_weight", "in_proj_bias",    "bias_k",
                          "bias_v",         "out_proj.weight", "out_proj.bias"};
    const int64_t shp[6][3] = {{20, 10}, {20}, {1, 1, 4}, {1, 1, 4}, {10, 12}, {10}};
    for (int i = 0; m && i < 6; i++) {
        mha_param p;
        CHECK_OK(mha_module_param_at(&p, m, i));
        CHECKF(!strcmp(p.name, want[i]) && p.shape[0] == shp[i][0] &&
                   (p.ndim < 2 || p.shape[1] == shp[i][1]) &&
                   (p.ndim < 3 || p.shape[2] == shp[i][2]),
               "head_dim module: param %d is %s (%lld, %lld)", i, p.name,
               (long long)p.shape[0], (long long)p.shape[1]);
    }
    // out_proj.weight (E, Eq): U(-1/sqrt(Eq), 1/sqrt(Eq)) (nn.Linear's fan_in)
    mha_param po;
    CHECK_OK(mha_module_param(&po, m, "out_proj.weight"));
    stats st = stats_of(po.data, po.numel);
    CHECKF(st.maxabs <= 1.0 / sqrt(12.0) && st.maxabs > 0.85 / sqrt(12.0),
           "out_proj.weight max %g, bound 1/sqrt(Eq) %g", st.maxabs, 1.0 / sqrt(12.0));
    mha_module_destroy(m);
    // separate q/k/v with kdim = vdim = E; no out_proj.bias
    m = layout_module(8, 2, 0, 0, true, true, true, 0, 2);
    mha_param p;
    CHECK_FAILS(mha_module_param(&p, m, "in_proj_weight"), MHA_ERR_NOT_FOUND);
    CHECK_FAILS(mha_module_param(&p, m, "out_proj.bias"), MHA_ERR_NOT_FOUND);
    CHECK_OK(mha_module_param(&p, m, "q_proj_weight"));
    CHECK(p.shape[0] == 8 && p.shape[1] == 8);
    CHECK_OK(mha_module_param(&p, m, "k_proj_weight"));
    CHECK(p.shape[0] == 8 && p.shape[1] == 8);
    CHECK_OK(mha_module_param(&p, m, "in_proj_bias"));
    CHECK(p.numel == 24);
    CHECK(mha_module_num_params(m) == 5);
    mha_module_destroy(m);
    // attention sinks: "sinks" (H), zero after init, saved and loaded
    m = layout_module(10, 3, 1, 4, false, true, false, 0, 3);
    CHECK_OK(mha_module_param(&p, m, "sinks"));
    CHECK(p.ndim == 1 && p.shape[0] == 3 && mha_module_config(m)->sinks);
    mha_module_destroy(m);
    // the checks
    mha_config c;
    mha_config_init(&c, 10, 3);
    c.head_dim = -1;
    m = NULL;
    CHECK_FAILS(mha_module_create(&m, &c), MHA_ERR_INVALID_ARG);
    CHECK(strstr(mha_last_error(), "head_dim") != NULL);
    mha_config_init(&c, 8, 2);
    c.bias = false;
    c.no_out_bias = true;
    CHECK_FAILS(mha_module_create(&m, &c), MHA_ERR_INVALID_ARG);
    CHECK(strstr(mha_last_error(), "no_out_bias") != NULL);
    mha_config_init(&c, 8, 4);
    c.head_dim = INT64_MAX / 2;  // H head_dim overflows
    CHECK_FAILS(mha_module_create(&m, &c), MHA_ERR_OVERFLOW);
    c.head_dim = ((int64_t)1 << 40);  // Eq 2^42: the parameters are too large to address
    CHECK_FAILS(mha_module_create(&m, &c), MHA_ERR_OVERFLOW);
    CHECK(strstr(mha_last_error(), "num_heads x head_dim") != NULL);
    CHECK(m == NULL);
    // save -> load round trips: (E, H, Hkv, d, sep, bias, no_out_bias, kdim)
    static const int64_t cases[][8] = {
        {10, 3, 1, 4, 0, 1, 0, 0}, {10, 3, 3, 4, 1, 1, 1, 0}, {12, 4, 2, 5, 1, 1, 0, 0},
        {12, 4, 2, 0, 1, 0, 0, 0}, {8, 2, 1, 0, 0, 1, 1, 0},  {9, 2, 2, 7, 0, 1, 1, 5},
        {16, 4, 4, 2, 0, 0, 0, 0}, {6, 1, 1, 6, 1, 1, 1, 0},
    };
    for (int i = 0; i < (int)(sizeof cases / sizeof cases[0]); i++) {
        const int64_t *k = cases[i];
        mha_module *a = layout_module(k[0], k[1], k[2], k[3], k[4], k[5], k[6], k[7],
                                      (uint64_t)i + 10);
        for (int meta = 0; meta < 2 && a; meta++) {
            char what[64];
            snprintf(what, sizeof what, "layout round trip %d (metadata %d)", i, meta);
            if (meta) {
                CHECK_OK(mha_module_save(a, path));
            } else {  // only num_heads: the rest from the shapes
                mha_st_writer *w = NULL;
                CHECK_OK(mha_st_writer_create(&w));
                for (int j = 0; j < mha_module_num_params(a); j++) {
                    CHECK_OK(mha_module_param_at(&p, a, j));
                    CHECK_OK(mha_st_writer_add(w, p.name, MHA_F32, p.ndim, p.shape, p.data));
                }
                CHECK_OK(mha_st_writer_save(w, path));
                mha_st_writer_destroy(w);
            }
            mha_st_file *f = NULL;
            CHECK_OK(mha_st_open(&f, path));
            mha_config base;
            mha_config_init(&base, 0, meta ? 0 : k[1]);  // heads: the metadata, else given
            mha_module *b = NULL;
            CHECK_OK(mha_module_load(&b, f, &base));
            if (b) check_same_module(a, b, what);
            // the same outputs
            enum { L = 5 };
            float x[L * 16], y0[L * 16], y1[L * 16];
            const int64_t E = k[0];
            for (int e = 0; e < L * E; e++) x[e] = 0.1f * (float)((e * 7) % 11) - 0.5f;
            mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 2, (int64_t[]){L, E});
            mha_tensor kt = xt;
            float kx[L * 16];
            if (k[7]) {
                for (int e = 0; e < L * k[7]; e++) kx[e] = 0.05f * (float)(e % 9);
                kt = mha_tensor_contiguous(kx, MHA_F32, 2, (int64_t[]){L, k[7]});
            }
            mha_tensor yt0 = mha_tensor_contiguous(y0, MHA_F32, 2, (int64_t[]){L, E}),
                       yt1 = mha_tensor_contiguous(y1, MHA_F32, 2, (int64_t[]){L, E});
            mha_forward_args fa;
            mha_forward_args_init(&fa);
            fa.query = fa.value = &xt;
            fa.key = &kt;
            CHECK_OK(mha_forward(&yt0, NULL, a, &fa));
            if (b) CHECK_OK(mha_forward(&yt1, NULL, b, &fa));
            CHECKF(b && !memcmp(y0, y1, sizeof(float) * (size_t)(L * E)), "%s: outputs differ",
                   what);
            mha_module_destroy(b);
            mha_st_close(f);
        }
        // half weights keep the layout
        mha_module *h = NULL;
        CHECK_OK(mha_module_convert(&h, a, MHA_BF16));
        if (h) {
            const mha_config *x = mha_module_config(a), *y = mha_module_config(h);
            CHECK(x->head_dim == y->head_dim && x->separate_qkv == y->separate_qkv &&
                  x->no_out_bias == y->no_out_bias &&
                  mha_module_num_params(a) == mha_module_num_params(h));
        }
        mha_module_destroy(h);
        mha_module_destroy(a);
    }
    // load errors: out_proj.weight (E, Eq) with Eq no multiple of H; an
    // out_proj.bias without in_proj_bias
    {
        float wq[7 * 6] = {0}, wk[7 * 6] = {0}, wo[6 * 7] = {0}, bo[6] = {0};
        mha_st_writer *w = NULL;
        CHECK_OK(mha_st_writer_create(&w));
        CHECK_OK(mha_st_writer_add(w, "q_proj_weight", MHA_F32, 2, (int64_t[]){7, 6}, wq));
        CHECK_OK(mha_st_writer_add(w, "k_proj_weight", MHA_F32, 2, (int64_t[]){7, 6}, wk));
        CHECK_OK(mha_st_writer_add(w, "v_proj_weight", MHA_F32, 2, (int64_t[]){7, 6}, wk));
        CHECK_OK(mha_st_writer_add(w, "out_proj.weight", MHA_F32, 2, (int64_t[]){6, 7}, wo));
        CHECK_OK(mha_st_writer_set_metadata(w, "num_heads", "2"));
        CHECK_OK(mha_st_writer_save(w, path));
        mha_st_file *f = NULL;
        CHECK_OK(mha_st_open(&f, path));
        m = NULL;
        CHECK_FAILS(mha_module_load(&m, f, NULL), MHA_ERR_SHAPE);
        CHECKF(strstr(mha_last_error(), "out_proj.weight") &&
                   strstr(mha_last_error(), "num_heads 2"),
               "message: %s", mha_last_error());
        mha_st_close(f);
        CHECK_OK(mha_st_writer_add(w, "out_proj.bias", MHA_F32, 1, (int64_t[]){6}, bo));
        CHECK_OK(mha_st_writer_set_metadata(w, "num_heads", "7"));
        CHECK_OK(mha_st_writer_save(w, path));
        mha_st_writer_destroy(w);
        CHECK_OK(mha_st_open(&f, path));
        CHECK_FAILS(mha_module_load(&m, f, NULL), MHA_ERR_FORMAT);
        CHECK(strstr(mha_last_error(), "out_proj.bias without in_proj_bias") != NULL);
        mha_st_close(f);
    }
    // a gradient module of another layout
    m = layout_module(8, 2, 0, 0, true, true, false, 0, 4);
    mha_module *g = layout_module(8, 2, 0, 0, false, true, false, 0, 4);
    float x[3 * 8] = {0}, y[3 * 8] = {0};
    mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 2, (int64_t[]){3, 8});
    mha_tensor yt = mha_tensor_contiguous(y, MHA_F32, 2, (int64_t[]){3, 8});
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = a.key = a.value = &xt;
    CHECK_FAILS(mha_backward(NULL, NULL, NULL, g, m, &a, &yt, false), MHA_ERR_INVALID_ARG);
    CHECK(strstr(mha_last_error(), "layout") != NULL);
    // a scale must be finite (0: the default 1 / sqrt(d), the same bits)
    float y0[3 * 8], y1[3 * 8];
    mha_tensor y0t = mha_tensor_contiguous(y0, MHA_F32, 2, (int64_t[]){3, 8});
    mha_tensor y1t = mha_tensor_contiguous(y1, MHA_F32, 2, (int64_t[]){3, 8});
    for (int i = 0; i < 3 * 8; i++) x[i] = (float)(i % 7) * 0.25f - 0.5f;
    a.opts.scale = 0.0;
    CHECK_OK(mha_forward(&y0t, NULL, m, &a));
    a.opts.scale = 1.0 / sqrt(4.0);  // d = 8 / 2
    CHECK_OK(mha_forward(&y1t, NULL, m, &a));
    CHECK(memcmp(y0, y1, sizeof y0) == 0);
    a.opts.scale = NAN;
    CHECK_FAILS(mha_forward(&yt, NULL, m, &a), MHA_ERR_INVALID_ARG);
    CHECK(strstr(mha_last_error(), "scale") != NULL);
    a.opts.scale = INFINITY;
    CHECK_FAILS(mha_backward(NULL, NULL, NULL, NULL, m, &a, &yt, false), MHA_ERR_INVALID_ARG);
    mha_module_destroy(g);
    mha_module_destroy(m);
}

int main(void) {
    test_params_packed();
    test_params_separate();
    test_bad_config();
    test_init_default();
    test_init_separate_fans();
    test_init_normal_schemes();
    test_init_orthogonal();
    test_init_errors();
    test_save_load();
    test_gqa();
    test_layouts();
    return check_summary("test_module");
}
