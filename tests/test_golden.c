// test_golden.c: the library against PyTorch on a machine without PyTorch.
// Every tests/golden/*.safetensors (written by scripts/gen_golden.py: torch
// 1.13's float64 results on a core set of configurations, and float32
// PyTorch's own error on each) is read through the safetensors API
// (mha_st_open / mha_st_find / mha_st_read), its parameters loaded with
// mha_module_load, and mha_forward and mha_backward run three ways:
//   reference  float32 views (MHA_IMPL_REFERENCE)
//   fused      float32 views (MHA_IMPL_FUSED; the ISA that MHA_ISA picks)
//   ref64      float64 views of the reference: a float64 computation of
//              the same numbers
// Every output (attn_output, attn_output_weights) and gradient (grad_query,
// grad_key, grad_value, grad_<parameter>) must meet the project's rule
// against the float64 reference ref64:
//   float32:  max|mha - ref64| <= max(4 * torch32_err, 4e-6 * (1 + max|ref64|))
//   ref64:    max|mha - ref64| <= 1e-12 * (1 + max|ref64|), and for the
//             parameter gradients (float32 storage in the module) the
//             float32 rounding of that: 2^-23 * (1 + max|ref64|)
// It does not generate anything: the configurations and their coverage are
// gen_golden.py's (regenerate there). The summary states the worst err/tol
// per run and, on its last line before check_summary's, over the float32
// runs.
//
// Usage: test_golden [DIR]   (default MHA_GOLDEN_DIR, compiled in); the
// parameter files it writes for mha_module_load go to MHA_TEST_TMPDIR.
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "mha.h"

#ifndef MHA_GOLDEN_DIR
#define MHA_GOLDEN_DIR "tests/golden"
#endif
#define GOLDEN_MAGIC "mha_golden"
#define GOLDEN_VERSION "1"
// The committed set has 22 files; fewer means some went missing.
#define GOLDEN_MIN_FILES 22
// The float32 rule's floor: F32_FLOOR * (1 + max|ref64|).
#define F32_FLOOR 4e-6

static const char *const PARAM_NAMES[] = {"in_proj_weight", "q_proj_weight", "k_proj_weight",
                                          "v_proj_weight",  "in_proj_bias",  "out_proj.weight",
                                          "out_proj.bias",  "bias_k",        "bias_v"};
enum { NPARAM_NAMES = sizeof PARAM_NAMES / sizeof PARAM_NAMES[0] };

// The three runs of every file.
typedef struct run_kind {
    const char *name;
    mha_impl impl;
    mha_dtype dtype;  // of the input, output and gradient views
} run_kind;
static const run_kind RUNS[] = {
    {"reference", MHA_IMPL_REFERENCE, MHA_F32},
    {"fused", MHA_IMPL_FUSED, MHA_F32},
    {"ref64", MHA_IMPL_REFERENCE, MHA_F64},
};
enum { NRUNS = sizeof RUNS / sizeof RUNS[0] };

// Worst err / tol per run kind over every file, for the summary.
static double g_worst[NRUNS];
static char g_worst_at[NRUNS][160];
static int g_compared[NRUNS];

// One golden file, open, with its options and inputs.
typedef struct golden {
    char path[1024];
    const char *name, *desc;
    mha_st_file *f;
    int64_t H, Hkv;
    bool batch_first, zero_attn, causal, need_w, average, self_attn;
    int checked;  // expected tensors compared in the current run
    // inputs as float32 and float64 (index by dtype: 0 F32, 1 F64)
    void *qb[2], *kb[2], *vb[2], *gyb[2];
    mha_tensor q[2], k[2], v[2], gy[2];
    void *kpmb, *amb;
    mha_tensor kpm, am;
    bool has_kpm, has_am;
} golden;

// A golden tensor read as dtype `to` into a new contiguous buffer *buf with
// view *t of the file's shape.
static mha_status read_tensor(mha_tensor *t, void **buf, const mha_st_file *f,
                              const char *name, mha_dtype to) {
    mha_st_tensor st;
    mha_status s = mha_st_find(&st, f, name);
    if (s) return s;
    size_t bytes = (size_t)st.numel * mha_dtype_size(to);
    *buf = malloc(bytes ? bytes : 1);
    if (!*buf) return MHA_ERR_NOMEM;
    if ((s = mha_st_read(*buf, bytes, to, &st))) return s;
    *t = mha_tensor_contiguous(*buf, to, st.ndim, st.shape);
    return MHA_OK;
}

// An "0"/"1" (or integer) __metadata__ entry; false (and a failed check)
// when absent or not a number.
static bool meta_int(int64_t *out, const golden *g, const char *key) {
    const char *s = mha_st_metadata(g->f, key);
    char *end = NULL;
    long long v = s ? strtoll(s, &end, 10) : 0;
    bool ok = s && *s && *end == '\0';
    CHECKF(ok, "%s: __metadata__ \"%s\" is %s%s%s, expected an integer", g->path, key,
           s ? "\"" : "", s ? s : "absent", s ? "\"" : "");
    *out = ok ? (int64_t)v : 0;
    return ok;
}

static bool meta_bool(bool *out, const golden *g, const char *key) {
    int64_t v;
    bool ok = meta_int(&v, g, key) && (v == 0 || v == 1);
    *out = v == 1;
    return ok;
}

// Element i of a contiguous F32 or F64 buffer.
static double elem(const void *p, mha_dtype dt, int64_t i) {
    return dt == MHA_F64 ? ((const double *)p)[i] : (double)((const float *)p)[i];
}

// Compares a contiguous result (F32 or F64, shape ndim/shape) with the
// golden tensor `name` by the rule of run r. f32_storage: the result went
// through float32 whatever the views (parameter gradients).
static void compare(golden *g, int r, const char *name, const void *got, mha_dtype dt,
                    int ndim, const int64_t *shape, bool f32_storage) {
    char key[128];
    mha_st_tensor et;
    mha_status s = mha_st_find(&et, g->f, name);
    CHECKF(s == MHA_OK, "%s [%s]: expected tensor %s: %s", g->desc, RUNS[r].name, name,
           mha_last_error());
    if (s) return;
    g->checked++;
    bool same = et.ndim == ndim && et.dtype == MHA_F64;
    for (int i = 0; same && i < ndim; i++) same = et.shape[i] == shape[i];
    CHECKF(same, "%s [%s]: %s has %d dims (dtype %s) in the file, the library's has %d",
           g->desc, RUNS[r].name, name, et.ndim, mha_dtype_name(et.dtype), ndim);
    if (!same) return;
    double *ref = malloc(sizeof(double) * (size_t)(et.numel + 1));
    CHECK_OK(mha_st_read(ref, sizeof(double) * (size_t)et.numel, MHA_F64, &et));
    snprintf(key, sizeof key, "torch32_err.%s", name);
    const char *e32s = mha_st_metadata(g->f, key);
    char *end = NULL;
    double e32 = e32s ? strtod(e32s, &end) : NAN;
    CHECKF(e32s && *end == '\0' && e32 >= 0, "%s: __metadata__ \"%s\" is %s", g->path, key,
           e32s ? e32s : "absent");
    double err = 0, mref = 0;
    int64_t worst = 0;
    for (int64_t i = 0; i < et.numel; i++) {
        double d = fabs(elem(got, dt, i) - ref[i]);
        if (isnan(d)) d = INFINITY;
        if (d > err) err = d, worst = i;
        mref = fmax(mref, fabs(ref[i]));
    }
    double tol = RUNS[r].dtype == MHA_F32 ? fmax(4.0 * e32, F32_FLOOR * (1.0 + mref))
                 : f32_storage            ? 0x1p-23 * (1.0 + mref)
                                          : 1e-12 * (1.0 + mref);
    CHECKF(err <= tol,
           "%s [%s, ISA %s] %s: max|mha - ref64| = %.3g > tol %.3g (torch32 err %.3g, "
           "max|ref64| %.3g); worst at flat index %lld: mha %.9g, ref64 %.9g",
           g->desc, RUNS[r].name, mha_isa(), name, err, tol, e32, mref, (long long)worst,
           et.numel ? elem(got, dt, worst) : 0.0, et.numel ? ref[worst] : 0.0);
    g_compared[r]++;
    if (tol > 0 && err / tol > g_worst[r]) {
        g_worst[r] = err / tol;
        snprintf(g_worst_at[r], sizeof g_worst_at[r], "%s %s", g->name, name);
    }
    free(ref);
}

// A zeroed contiguous buffer of dtype dt for a view of the given shape.
static mha_tensor new_view(void **buf, mha_dtype dt, int ndim, const int64_t *shape) {
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) n *= shape[i];
    *buf = calloc((size_t)n + 1, mha_dtype_size(dt));
    return mha_tensor_contiguous(*buf, dt, ndim, shape);
}

// The module, from the file's parameters: they go (as F32, under their
// names, with __metadata__ num_heads / num_kv_heads) to a parameters-only
// file, which mha_module_load reads as the CLI reads a state_dict.
static mha_module *load_module(golden *g) {
    const char *tmp = getenv("MHA_TEST_TMPDIR");
    char path[1200];
    snprintf(path, sizeof path, "%s/golden_%ld_%s", tmp ? tmp : ".", (long)getpid(), g->name);
    mha_st_writer *w = NULL;
    CHECK_OK(mha_st_writer_create(&w));
    if (!w) return NULL;
    bool has[NPARAM_NAMES] = {false};
    for (int i = 0; i < NPARAM_NAMES; i++) {
        mha_st_tensor t;
        if (mha_st_find(&t, g->f, PARAM_NAMES[i]) != MHA_OK) continue;
        has[i] = true;
        float *buf = malloc(sizeof(float) * (size_t)(t.numel + 1));
        CHECK_OK(mha_st_read(buf, sizeof(float) * (size_t)t.numel, MHA_F32, &t));
        CHECK_OK(mha_st_writer_add(w, PARAM_NAMES[i], MHA_F32, t.ndim, t.shape, buf));
        free(buf);
    }
    const char *hs = mha_st_metadata(g->f, "num_heads");
    const char *kvs = mha_st_metadata(g->f, "num_kv_heads");
    CHECK_OK(mha_st_writer_set_metadata(w, "num_heads", hs ? hs : ""));
    if (kvs) CHECK_OK(mha_st_writer_set_metadata(w, "num_kv_heads", kvs));
    CHECK_OK(mha_st_writer_save(w, path));
    mha_st_writer_destroy(w);

    mha_st_file *pf = NULL;
    mha_module *m = NULL;
    CHECK_OK(mha_st_open(&pf, path));
    mha_config base;
    mha_config_init(&base, 0, 0);  // heads from __metadata__, the rest from the tensors
    base.batch_first = g->batch_first;
    base.add_zero_attn = g->zero_attn;
    if (pf) CHECK_OK(mha_module_load(&m, pf, &base));
    mha_st_close(pf);
    remove(path);
    if (!m) return NULL;
    // the configuration the tensors and metadata tell
    const mha_config *c = mha_module_config(m);
    const int64_t kd = g->self_attn ? c->embed_dim : g->k[0].shape[g->k[0].ndim - 1];
    const int64_t vd = g->self_attn ? c->embed_dim : g->v[0].shape[g->v[0].ndim - 1];
    CHECKF(c->num_heads == g->H && c->num_kv_heads == g->Hkv && c->kdim == kd &&
               c->vdim == vd && c->bias == has[4] && c->add_bias_kv == has[7] &&
               c->embed_dim == g->q[0].shape[g->q[0].ndim - 1],
           "%s: mha_module_load gave E %lld H %lld Hkv %lld kdim %lld vdim %lld bias %d "
           "bias_kv %d; the file has H %lld Hkv %lld kdim %lld vdim %lld bias %d bias_kv %d",
           g->desc, (long long)c->embed_dim, (long long)c->num_heads,
           (long long)c->num_kv_heads, (long long)c->kdim, (long long)c->vdim, c->bias,
           c->add_bias_kv, (long long)g->H, (long long)g->Hkv, (long long)kd, (long long)vd,
           has[4], has[7]);
    return m;
}

// Forward and backward of one run kind, every expected tensor compared.
static void run_one(golden *g, const mha_module *m, int r) {
    const run_kind *rk = &RUNS[r];
    const int x = rk->dtype == MHA_F64;
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = &g->q[x];
    a.key = g->self_attn ? &g->q[x] : &g->k[x];
    a.value = g->self_attn ? &g->q[x] : &g->v[x];
    a.key_padding_mask = g->has_kpm ? &g->kpm : NULL;
    a.attn_mask = g->has_am ? &g->am : NULL;
    a.opts.is_causal = g->causal;
    a.need_weights = g->need_w;
    a.average_attn_weights = g->average;
    a.impl = rk->impl;
    g->checked = 0;

    mha_shape os, ws;
    CHECK_OK(mha_forward_shapes(&os, &ws, m, &a));
    void *yb = NULL, *wb = NULL;
    mha_tensor y = new_view(&yb, rk->dtype, os.ndim, os.dims);
    mha_tensor wt = g->need_w ? new_view(&wb, rk->dtype, ws.ndim, ws.dims) : y;
    mha_status s = mha_forward(&y, g->need_w ? &wt : NULL, m, &a);
    CHECKF(s == MHA_OK, "%s [%s]: mha_forward -> %s: %s", g->desc, rk->name,
           mha_status_string(s), mha_last_error());
    if (!s) {
        compare(g, r, "attn_output", yb, rk->dtype, os.ndim, os.dims, false);
        if (g->need_w)
            compare(g, r, "attn_output_weights", wb, rk->dtype, ws.ndim, ws.dims, false);
    }

    // backward: the input gradients shaped as the inputs (self-attention:
    // grad_key and grad_value are the parts through those paths)
    mha_module *grads = NULL;
    CHECK_OK(mha_module_create(&grads, mha_module_config(m)));
    void *gqb, *gkb, *gvb;
    const mha_tensor *kin = a.key, *vin = a.value;
    mha_tensor gq = new_view(&gqb, rk->dtype, g->q[x].ndim, g->q[x].shape);
    mha_tensor gk = new_view(&gkb, rk->dtype, kin->ndim, kin->shape);
    mha_tensor gv = new_view(&gvb, rk->dtype, vin->ndim, vin->shape);
    s = grads ? mha_backward(&gq, &gk, &gv, grads, m, &a, &g->gy[x], false) : MHA_ERR_NOMEM;
    CHECKF(s == MHA_OK, "%s [%s]: mha_backward -> %s: %s", g->desc, rk->name,
           mha_status_string(s), mha_last_error());
    if (!s) {
        compare(g, r, "grad_query", gqb, rk->dtype, gq.ndim, gq.shape, false);
        compare(g, r, "grad_key", gkb, rk->dtype, gk.ndim, gk.shape, false);
        compare(g, r, "grad_value", gvb, rk->dtype, gv.ndim, gv.shape, false);
        for (int i = 0; i < mha_module_num_params(grads); i++) {
            mha_param p;
            char name[96];
            CHECK_OK(mha_module_param_at(&p, grads, i));
            snprintf(name, sizeof name, "grad_%s", p.name);
            compare(g, r, name, p.data, MHA_F32, p.ndim, p.shape, true);
        }
    }
    // every expected tensor of the file was compared (none left unchecked)
    int expected = 0;
    for (int64_t i = 0; i < mha_st_num_tensors(g->f); i++) {
        mha_st_tensor t;
        CHECK_OK(mha_st_tensor_at(&t, g->f, i));
        expected += strncmp(t.name, "attn_output", 11) == 0 ||
                    (strncmp(t.name, "grad_", 5) == 0 &&
                     strcmp(t.name, "grad_attn_output") != 0);
    }
    if (!s)
        CHECKF(g->checked == expected, "%s [%s]: compared %d tensors, the file expects %d",
               g->desc, rk->name, g->checked, expected);
    mha_module_destroy(grads);
    free(yb), free(wb), free(gqb), free(gkb), free(gvb);
}

static void golden_free(golden *g) {
    for (int x = 0; x < 2; x++)
        free(g->qb[x]), free(g->kb[x]), free(g->vb[x]), free(g->gyb[x]);
    free(g->kpmb), free(g->amb);
    mha_st_close(g->f);
}

static void golden_file(const char *dir, const char *fname) {
    golden g;
    memset(&g, 0, sizeof g);
    snprintf(g.path, sizeof g.path, "%s/%s", dir, fname);
    g.name = g.desc = g.path;
    mha_status s = mha_st_open(&g.f, g.path);
    CHECKF(s == MHA_OK, "%s: %s", g.path, mha_last_error());
    if (s) return;
    // the magic and the version first: nothing else is read from a file
    // that is not a golden file of this version
    const char *magic = mha_st_metadata(g.f, GOLDEN_MAGIC);
    CHECKF(magic && strcmp(magic, GOLDEN_VERSION) == 0,
           "%s: __metadata__ \"%s\" is %s, expected \"%s\" (regenerate with "
           "scripts/gen_golden.py)",
           g.path, GOLDEN_MAGIC, magic ? magic : "absent", GOLDEN_VERSION);
    if (!magic || strcmp(magic, GOLDEN_VERSION) != 0) {
        golden_free(&g);
        return;
    }
    if (mha_st_metadata(g.f, "name")) g.name = mha_st_metadata(g.f, "name");
    if (mha_st_metadata(g.f, "description")) g.desc = mha_st_metadata(g.f, "description");
    bool ok = meta_int(&g.H, &g, "num_heads");
    g.Hkv = g.H;
    if (mha_st_metadata(g.f, "num_kv_heads")) ok &= meta_int(&g.Hkv, &g, "num_kv_heads");
    ok &= meta_bool(&g.batch_first, &g, "batch_first");
    ok &= meta_bool(&g.zero_attn, &g, "add_zero_attn");
    ok &= meta_bool(&g.causal, &g, "is_causal");
    ok &= meta_bool(&g.need_w, &g, "need_weights");
    ok &= meta_bool(&g.average, &g, "average_attn_weights");
    ok &= meta_bool(&g.self_attn, &g, "self_attention");
    const mha_dtype dts[2] = {MHA_F32, MHA_F64};
    for (int x = 0; ok && x < 2; x++) {
        CHECK_OK(s = read_tensor(&g.q[x], &g.qb[x], g.f, "query", dts[x]));
        ok &= s == MHA_OK;
        if (!g.self_attn) {
            CHECK_OK(s = read_tensor(&g.k[x], &g.kb[x], g.f, "key", dts[x]));
            ok &= s == MHA_OK;
            CHECK_OK(s = read_tensor(&g.v[x], &g.vb[x], g.f, "value", dts[x]));
            ok &= s == MHA_OK;
        }
        CHECK_OK(s = read_tensor(&g.gy[x], &g.gyb[x], g.f, "grad_attn_output", dts[x]));
        ok &= s == MHA_OK;
    }
    // masks as the file has them: BOOL (true = masked) or F32 (added)
    mha_st_tensor t;
    if (ok && mha_st_find(&t, g.f, "key_padding_mask") == MHA_OK) {
        g.has_kpm = true;
        CHECK_OK(s = read_tensor(&g.kpm, &g.kpmb, g.f, "key_padding_mask",
                                 t.dtype == MHA_BOOL ? MHA_BOOL : MHA_F32));
        ok &= s == MHA_OK;
    }
    if (ok && mha_st_find(&t, g.f, "attn_mask") == MHA_OK) {
        g.has_am = true;
        CHECK_OK(s = read_tensor(&g.am, &g.amb, g.f, "attn_mask",
                                 t.dtype == MHA_BOOL ? MHA_BOOL : MHA_F32));
        ok &= s == MHA_OK;
    }
    mha_module *m = ok ? load_module(&g) : NULL;
    if (m)
        for (int r = 0; r < NRUNS; r++) run_one(&g, m, r);
    mha_module_destroy(m);
    golden_free(&g);
}

static int cmp_names(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

int main(int argc, char **argv) {
    const char *dir = argc > 1 ? argv[1] : MHA_GOLDEN_DIR;
    DIR *d = opendir(dir);
    CHECKF(d != NULL, "cannot open the golden directory %s", dir);
    char *names[512];
    int n = 0;
    for (struct dirent *e; d && (e = readdir(d)) != NULL;) {
        size_t len = strlen(e->d_name), sfx = strlen(".safetensors");
        if (len > sfx && strcmp(e->d_name + len - sfx, ".safetensors") == 0 && n < 512)
            names[n++] = strdup(e->d_name);
    }
    if (d) closedir(d);
    qsort(names, (size_t)n, sizeof names[0], cmp_names);
    CHECKF(n >= GOLDEN_MIN_FILES, "%s: %d golden files, expected at least %d", dir, n,
           GOLDEN_MIN_FILES);
    for (int i = 0; i < n; i++) {
        golden_file(dir, names[i]);
        free(names[i]);
    }
    printf("test_golden: %d files in %s, fused ISA %s\n", n, dir, mha_isa());
    int wr = 0;  // the worst float32 run
    for (int r = 0; r < NRUNS; r++) {
        printf("  %-9s %3d tensors compared, worst err/tol %.3f (%s)\n", RUNS[r].name,
               g_compared[r], g_worst[r], g_worst_at[r][0] ? g_worst_at[r] : "-");
        if (RUNS[r].dtype == MHA_F32 && g_worst[r] > g_worst[wr]) wr = r;
    }
    printf("test_golden: worst float32 error/bound %.3g (%s, %s, ISA %s)\n", g_worst[wr],
           g_worst_at[wr][0] ? g_worst_at[wr] : "-", RUNS[wr].name, mha_isa());
    return check_summary("test_golden");
}
