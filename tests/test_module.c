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
    const char *want[] = {"in_proj_weight", "in_proj_bias", "bias_k", "bias_v",
                          "out_proj.weight", "out_proj.bias"};
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

static mha_module *make(int64_t E, int64_t H, int64_t kdim, bool bkv,
                        mha_init_scheme sch, double gain, double std,
                        uint64_t seed) {
    mha_config c;
    mha_config_init(&c, E, H);
    c.kdim = kdim;
    c.add_bias_kv = bkv;
    mha_module *m = NULL;
    CHECK_OK(mha_module_create(&m, &c));
    mha_init_options o;
    mha_init_options_default(&o);
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
    CHECKF(s.std > 0.7 / sqrt((double)E) && s.std < 1.3 / sqrt((double)E), "bias_k std %g", s.std);
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
    mha_init_options_default(&o);
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
    mha_init_options_default(&o);
    CHECK_OK(mha_module_init(m, &o));
    CHECK_OK(mha_module_param(&p, m, "in_proj_weight"));
    stats st = stats_of(p.data, p.numel);
    double bound = sqrt(6.0 / (24.0 + 40.0));  // torch's fans of (E + 2 Ekv, E)
    CHECKF(st.maxabs <= bound && st.maxabs > 0.95 * bound, "gqa in_proj max %g bound %g",
           st.maxabs, bound);
    CHECK_OK(mha_module_save(m, path));
    mha_st_file *f = NULL;
    CHECK_OK(mha_st_open(&f, path));
    CHECK(mha_st_metadata(f, "num_kv_heads") && !strcmp(mha_st_metadata(f, "num_kv_heads"), "2"));
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
    return check_summary("test_module");
}
