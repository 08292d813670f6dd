// test_half_weights.c: modules whose weight matrices are stored as bf16 or
// f16 (mha_config.weight_dtype). Checks:
//  - storage: dtypes, sizes, values = the float32 weights rounded to
//    nearest even; biases untouched; convert back is exact;
//  - mha_module_init on a half module = init in float32, then rounded;
//  - forward (reference and fused, need_weights, masks, GQA, kdim/vdim,
//    bias_kv) and mha_forward_cached are bit-identical to a float32 module
//    holding the rounded weights (the half values are widened exactly; the
//    sums are the float32 module's);
//  - the error against the unrounded float32 module stays within the
//    documented bound (README "Reduced precision");
//  - safetensors round trips (BF16/F16 tensors written; loaded exactly, or
//    widened into a float32 module);
//  - training: mha_backward (both implementations, a saved forward, =
//    and +=) gives the rounded float32 module's gradients bit for bit,
//    parameter gradients in a float32 or half gradient module (rounded
//    once); the optimizers refuse a half module with a message.
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "mha.h"

typedef struct cfgcase {
    int64_t E, H, kdim, vdim, hkv;
    bool bias, bias_kv, batch_first;
} cfgcase;

static uint64_t rng_state = 12345;
static float urand(void) {  // in [-1, 1)
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((rng_state >> 40) * (1.0 / 16777216.0)) * 2.0f - 1.0f;
}

static mha_module *make(const cfgcase *c, mha_dtype wd, uint64_t seed) {
    mha_config cfg;
    mha_config_init(&cfg, c->E, c->H);
    cfg.kdim = c->kdim;
    cfg.vdim = c->vdim;
    cfg.num_kv_heads = c->hkv;
    cfg.bias = c->bias;
    cfg.add_bias_kv = c->bias_kv;
    cfg.batch_first = c->batch_first;
    cfg.weight_dtype = wd;
    mha_module *m = NULL;
    CHECK_OK(mha_module_create(&m, &cfg));
    if (!m) return NULL;
    mha_init_options io;
    mha_init_options_init(&io);
    io.seed = seed;
    CHECK_OK(mha_module_init(m, &io));
    // biases nonzero so they take part
    for (int i = 0; i < mha_module_num_params(m); i++) {
        mha_param p;
        CHECK_OK(mha_module_param_at(&p, m, i));
        if (p.dtype == MHA_F32 && strstr(p.name, "bias") && strcmp(p.name, "bias_k") &&
            strcmp(p.name, "bias_v"))
            for (int64_t j = 0; j < p.numel; j++) p.data[j] = 0.1f * urand();
    }
    return m;
}

static bool is_weight(const char *name) { return strstr(name, "weight") != NULL; }

static uint16_t round_half(float v, mha_dtype wd) {
    return wd == MHA_BF16 ? mha_f32_to_bf16(v) : mha_f32_to_f16(v);
}
static float widen(uint16_t h, mha_dtype wd) {
    return wd == MHA_BF16 ? mha_bf16_to_f32(h) : mha_f16_to_f32(h);
}

// Storage of mh against m32: weights rounded, the rest copied.
static void check_storage(const mha_module *m32, const mha_module *mh, mha_dtype wd) {
    CHECK(mha_module_num_params(m32) == mha_module_num_params(mh));
    CHECK(mha_module_config(mh)->weight_dtype == wd);
    for (int i = 0; i < mha_module_num_params(m32); i++) {
        mha_param a, b;
        CHECK_OK(mha_module_param_at(&a, m32, i));
        CHECK_OK(mha_module_param_at(&b, mh, i));
        CHECK(strcmp(a.name, b.name) == 0 && a.numel == b.numel);
        CHECK(a.dtype == MHA_F32 && a.data == a.storage);
        CHECK(((uintptr_t)b.storage & 63) == 0);
        if (is_weight(b.name)) {
            CHECKF(b.dtype == wd && b.data == NULL, "%s: dtype %s", b.name,
                   mha_dtype_name(b.dtype));
            const uint16_t *h = b.storage;
            int64_t bad = 0;
            for (int64_t j = 0; j < a.numel; j++) bad += h[j] != round_half(a.data[j], wd);
            CHECKF(bad == 0, "%s: %lld elements not rounded to nearest even", b.name,
                   (long long)bad);
        } else {
            CHECK(b.dtype == MHA_F32 && b.data == b.storage);
            CHECK(memcmp(a.data, b.data, (size_t)a.numel * 4) == 0);
        }
    }
}

// Same storage bytes, parameter by parameter.
static bool same_params(const mha_module *x, const mha_module *y) {
    if (mha_module_num_params(x) != mha_module_num_params(y)) return false;
    for (int i = 0; i < mha_module_num_params(x); i++) {
        mha_param a, b;
        if (mha_module_param_at(&a, x, i) || mha_module_param_at(&b, y, i)) return false;
        if (a.dtype != b.dtype || a.numel != b.numel ||
            memcmp(a.storage, b.storage, (size_t)a.numel * mha_dtype_size(a.dtype)))
            return false;
    }
    return true;
}

typedef struct fwd_io {
    int64_t N, L, S;
    float *q, *k, *v;
    mha_tensor qt, kt, vt;
    uint8_t *kpm;
    mha_tensor kpmt;
} fwd_io;

static void io_make(fwd_io *f, const cfgcase *c, int64_t N, int64_t L, int64_t S) {
    f->N = N, f->L = L, f->S = S;
    const int64_t kd = c->kdim ? c->kdim : c->E, vd = c->vdim ? c->vdim : c->E;
    f->q = malloc(sizeof(float) * (size_t)(N * L * c->E));
    f->k = malloc(sizeof(float) * (size_t)(N * S * kd));
    f->v = malloc(sizeof(float) * (size_t)(N * S * vd));
    for (int64_t i = 0; i < N * L * c->E; i++) f->q[i] = urand();
    for (int64_t i = 0; i < N * S * kd; i++) f->k[i] = urand();
    for (int64_t i = 0; i < N * S * vd; i++) f->v[i] = urand();
    int64_t a0 = c->batch_first ? N : L, a1 = c->batch_first ? L : N;
    int64_t b0 = c->batch_first ? N : S, b1 = c->batch_first ? S : N;
    f->qt = mha_tensor_contiguous(f->q, MHA_F32, 3, (int64_t[]){a0, a1, c->E});
    f->kt = mha_tensor_contiguous(f->k, MHA_F32, 3, (int64_t[]){b0, b1, kd});
    f->vt = mha_tensor_contiguous(f->v, MHA_F32, 3, (int64_t[]){b0, b1, vd});
    f->kpm = calloc((size_t)(N * S), 1);
    for (int64_t n = 0; n < N; n++) f->kpm[n * S + S - 1 - n % S] = 1;  // one key each
    f->kpmt = mha_tensor_contiguous(f->kpm, MHA_U8, 2, (int64_t[]){N, S});
}

static void io_free(fwd_io *f) {
    free(f->q);
    free(f->k);
    free(f->v);
    free(f->kpm);
}

// Output (and per-head weights) of one forward.
static void run(float *y, float *w, const mha_module *m, const cfgcase *c, fwd_io *f,
                mha_impl impl) {
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = &f->qt;
    a.key = &f->kt;
    a.value = &f->vt;
    a.key_padding_mask = &f->kpmt;
    a.need_weights = true;
    a.average_attn_weights = false;
    a.impl = impl;
    mha_shape ys, ws;
    CHECK_OK(mha_forward_shapes(&ys, &ws, m, &a));
    mha_tensor yt = mha_tensor_contiguous(y, MHA_F32, ys.ndim, ys.dims);
    mha_tensor wt = mha_tensor_contiguous(w, MHA_F32, ws.ndim, ws.dims);
    CHECK_OK(mha_forward(&yt, &wt, m, &a));
    (void)c;
}

static double maxabs(const float *x, int64_t n) {
    double m = 0;
    for (int64_t i = 0; i < n; i++) m = fmax(m, fabs(x[i]));
    return m;
}
static double maxdiff(const float *x, const float *y, int64_t n) {
    double m = 0;
    for (int64_t i = 0; i < n; i++) m = fmax(m, fabs((double)x[i] - y[i]));
    return m;
}

// The documented bound on |y_half - y_f32| (README "Reduced precision"):
// u (1 + max|y_f32|), u the storage's unit roundoff (bf16 2^-8, f16
// 2^-11): each weight carries a relative error <= u/2 and the products'
// errors have random signs, so the outputs move by a small fraction of u
// times their scale (0.18 of the bound at most in these cases).
static double bound(mha_dtype wd, double ymax) {
    const double u = wd == MHA_BF16 ? 1.0 / 256.0 : 1.0 / 2048.0;
    return u * (1.0 + ymax);
}

// A module like m (weights stored as gdt) filled with values from urand
// (the starting point of an accumulating backward).
static mha_module *grads_like(const mha_module *m, mha_dtype gdt) {
    mha_module *g32 = NULL, *g = NULL;
    CHECK_OK(mha_module_convert(&g32, m, MHA_F32));
    if (!g32) return NULL;
    for (int i = 0; i < mha_module_num_params(g32); i++) {
        mha_param p;
        CHECK_OK(mha_module_param_at(&p, g32, i));
        for (int64_t j = 0; j < p.numel; j++) p.data[j] = urand();
    }
    CHECK_OK(mha_module_convert(&g, g32, gdt));
    mha_module_destroy(g32);
    return g;
}

// One backward of mh and of mr (the float32 module of mh's widened
// weights) on the same args; gh (gradient module of any storage) and gr
// (float32, gh widened) accumulate or are overwritten.
static void test_training(const cfgcase *c, fwd_io *f, const mha_module *mh,
                          const mha_module *mr, mha_dtype wd) {
    const int64_t kd = c->kdim ? c->kdim : c->E, vd = c->vdim ? c->vdim : c->E;
    const int64_t nq = f->N * f->L * c->E, nk = f->N * f->S * kd, nv = f->N * f->S * vd;
    float *go = malloc(sizeof(float) * (size_t)nq),
          *buf = malloc(sizeof(float) * (size_t)(2 * (nq + nk + nv)));
    float *yh = malloc(sizeof(float) * (size_t)nq), *yr = malloc(sizeof(float) * (size_t)nq);
    for (int64_t i = 0; i < nq; i++) go[i] = urand();
    mha_tensor got = f->qt;
    got.data = go;
    const mha_impl impls[2] = {MHA_IMPL_REFERENCE, MHA_IMPL_FUSED};
    const mha_dtype gdts[2] = {MHA_F32, wd};
    for (int ii = 0; ii < 2; ii++)
        for (int save = 0; save < 1 + ii; save++)  // (a saved forward: the fused path)
            for (int gi = 0; gi < 2; gi++)
                for (int acc = 0; acc < 2; acc++) {
                    float *gh = buf, *gr = buf + nq + nk + nv;
                    for (int64_t i = 0; i < nq + nk + nv; i++) gh[i] = gr[i] = urand();
                    mha_tensor gqh = f->qt, gkh = f->kt, gvh = f->vt, gqr = f->qt, gkr = f->kt,
                               gvr = f->vt;
                    gqh.data = gh, gkh.data = gh + nq, gvh.data = gh + nq + nk;
                    gqr.data = gr, gkr.data = gr + nq, gvr.data = gr + nq + nk;
                    mha_module *Gh = grads_like(mh, gdts[gi]), *Gr = NULL;
                    if (Gh) CHECK_OK(mha_module_convert(&Gr, Gh, MHA_F32));
                    mha_saved *svh = NULL, *svr = NULL;
                    mha_forward_args a;
                    mha_forward_args_init(&a);
                    a.query = &f->qt;
                    a.key = &f->kt;
                    a.value = &f->vt;
                    a.key_padding_mask = &f->kpmt;
                    a.impl = impls[ii];
                    mha_forward_args ah = a, ar = a;
                    if (save) {
                        CHECK_OK(mha_saved_create(&svh));
                        CHECK_OK(mha_saved_create(&svr));
                        ah.save = svh, ar.save = svr;
                        mha_tensor yth = f->qt, ytr = f->qt;
                        yth.data = yh, ytr.data = yr;
                        CHECK_OK(mha_forward(&yth, NULL, mh, &ah));
                        CHECK_OK(mha_forward(&ytr, NULL, mr, &ar));
                        CHECK(memcmp(yh, yr, sizeof(float) * (size_t)nq) == 0);
                    }
                    if (Gh && Gr) {
                        CHECK_OK(mha_backward(&gqh, &gkh, &gvh, Gh, mh, &ah, &got, acc));
                        CHECK_OK(mha_backward(&gqr, &gkr, &gvr, Gr, mr, &ar, &got, acc));
                        CHECKF(memcmp(gh, gr, sizeof(float) * (size_t)(nq + nk + nv)) == 0,
                               "%s weights, %s%s, grads %s%s: input gradients differ by %g",
                               mha_dtype_name(wd), mha_impl_name(impls[ii]),
                               save ? " saved" : "", mha_dtype_name(gdts[gi]),
                               acc ? " +=" : "", maxdiff(gh, gr, nq + nk + nv));
                        mha_module *Grh = NULL;  // the float32 gradients, rounded
                        CHECK_OK(mha_module_convert(&Grh, Gr, gdts[gi]));
                        CHECKF(Grh && same_params(Grh, Gh),
                               "%s weights, %s%s, grads %s%s: parameter gradients differ",
                               mha_dtype_name(wd), mha_impl_name(impls[ii]),
                               save ? " saved" : "", mha_dtype_name(gdts[gi]),
                               acc ? " +=" : "");
                        mha_module_destroy(Grh);
                    }
                    mha_saved_destroy(svh);
                    mha_saved_destroy(svr);
                    mha_module_destroy(Gh);
                    mha_module_destroy(Gr);
                }
    free(go), free(buf), free(yh), free(yr);
}

static double worst_ratio[2];  // max error / bound seen, per dtype

static void test_case(const cfgcase *c) {
    mha_module *m32 = make(c, MHA_F32, 7);
    if (!m32) return;
    fwd_io f;
    io_make(&f, c, 2, 9, 11);
    const int64_t Sp = f.S + (c->bias_kv ? 1 : 0);
    const int64_t ny = f.N * f.L * c->E, nw = f.N * c->H * f.L * Sp;
    float *y32 = malloc(sizeof(float) * (size_t)ny), *w32 = malloc(sizeof(float) * (size_t)nw);
    float *yh = malloc(sizeof(float) * (size_t)ny), *wh = malloc(sizeof(float) * (size_t)nw);
    float *yr = malloc(sizeof(float) * (size_t)ny), *wr = malloc(sizeof(float) * (size_t)nw);
    const mha_dtype dts[2] = {MHA_BF16, MHA_F16};
    for (int di = 0; di < 2; di++) {
        const mha_dtype wd = dts[di];
        mha_module *mh = NULL, *mr = NULL, *mi = NULL;
        CHECK_OK(mha_module_convert(&mh, m32, wd));
        if (!mh) continue;
        check_storage(m32, mh, wd);
        CHECK_OK(mha_module_convert(&mr, mh, MHA_F32));
        // mr holds the widened values exactly
        for (int i = 0; mr && i < mha_module_num_params(mr); i++) {
            mha_param a, b;
            CHECK_OK(mha_module_param_at(&a, mh, i));
            CHECK_OK(mha_module_param_at(&b, mr, i));
            int64_t bad = 0;
            for (int64_t j = 0; j < a.numel; j++)
                bad += a.dtype == MHA_F32 ? a.data[j] != b.data[j]
                                          : widen(((uint16_t *)a.storage)[j], wd) != b.data[j];
            CHECKF(bad == 0, "%s: %lld widened values differ", a.name, (long long)bad);
        }
        // init of a half module = float32 init, rounded
        mi = make(c, wd, 7);
        mha_module *m32b = make(c, MHA_F32, 7), *mib = NULL;
        if (m32b) CHECK_OK(mha_module_convert(&mib, m32b, wd));
        if (mi && mib) {
            // make() randomises the biases after init: compare weights only
            for (int i = 0; i < mha_module_num_params(mi); i++) {
                mha_param a, b;
                CHECK_OK(mha_module_param_at(&a, mi, i));
                CHECK_OK(mha_module_param_at(&b, mib, i));
                if (is_weight(a.name))
                    CHECKF(memcmp(a.storage, b.storage, (size_t)a.numel * 2) == 0,
                           "init %s of a %s module", a.name, mha_dtype_name(wd));
            }
        }
        mha_module_destroy(mib);
        mha_module_destroy(m32b);
        mha_module_destroy(mi);

        // forward: half module == float32 module of the rounded weights,
        // both implementations
        const mha_impl impls[2] = {MHA_IMPL_REFERENCE, MHA_IMPL_FUSED};
        for (int ii = 0; ii < 2 && mr; ii++) {
            run(yh, wh, mh, c, &f, impls[ii]);
            run(yr, wr, mr, c, &f, impls[ii]);
            CHECKF(memcmp(yh, yr, sizeof(float) * (size_t)ny) == 0,
                   "%s weights, %s: output differs from the rounded float32 module by %g",
                   mha_dtype_name(wd), mha_impl_name(impls[ii]), maxdiff(yh, yr, ny));
            CHECK(memcmp(wh, wr, sizeof(float) * (size_t)nw) == 0);
            // against the unrounded float32 module: within the bound
            run(y32, w32, m32, c, &f, impls[ii]);
            const double e = maxdiff(yh, y32, ny), b = bound(wd, maxabs(y32, ny));
            CHECKF(e <= b, "%s weights, %s: |y - y_f32| %g > bound %g", mha_dtype_name(wd),
                   mha_impl_name(impls[ii]), e, b);
            if (e / b > worst_ratio[di]) worst_ratio[di] = e / b;
        }

        // training: the half module's backward (each implementation, with
        // and without a saved forward, =, +=) gives the rounded float32
        // module's input gradients bit for bit, and its parameter
        // gradients, in a float32 gradient module or rounded into a half
        // one (nearest even, once)
        if (mr) test_training(c, &f, mh, mr, wd);
        // the optimizers still take float32 modules only
        mha_optim *o = NULL;
        mha_optim_config oc;
        mha_optim_config_init(&oc, MHA_OPTIM_ADAMW);
        CHECK_OK(mha_optim_create(&o, &oc));
        mha_module *g = NULL;
        CHECK_OK(mha_module_convert(&g, mh, wd));
        if (o && g) CHECK_FAILS(mha_optim_add_module(o, mh, g), MHA_ERR_DTYPE);
        if (o && g) CHECK(strstr(mha_last_error(), mha_dtype_name(wd)) != NULL);
        mha_module_destroy(g);
        mha_optim_destroy(o);

        // safetensors: written as BF16/F16; loaded exactly, or widened
        const char *dir = getenv("MHA_TEST_TMPDIR");
        char path[512];
        snprintf(path, sizeof path, "%s/half_weights.safetensors", dir ? dir : ".");
        CHECK_OK(mha_module_save(mh, path));
        mha_st_file *sf = NULL;
        CHECK_OK(mha_st_open(&sf, path));
        if (sf) {
            mha_st_tensor t;
            CHECK_OK(mha_st_find(&t, sf, "out_proj.weight"));
            CHECK(t.dtype == wd && t.nbytes == (size_t)(c->E * c->E * 2));
            mha_config base;
            mha_config_init(&base, 0, c->H);
            base.num_kv_heads = c->hkv;
            base.batch_first = c->batch_first;
            base.weight_dtype = wd;
            mha_module *ml = NULL;
            CHECK_OK(mha_module_load(&ml, sf, &base));
            CHECK(ml && same_params(ml, mh));
            mha_module_destroy(ml);
            base.weight_dtype = MHA_F32;
            ml = NULL;
            CHECK_OK(mha_module_load(&ml, sf, &base));
            CHECK(ml && mr && same_params(ml, mr));
            mha_module_destroy(ml);
            mha_st_close(sf);
        }
        remove(path);
        mha_module_destroy(mr);
        mha_module_destroy(mh);
    }
    free(y32), free(w32), free(yh), free(wh), free(yr), free(wr);
    io_free(&f);
    mha_module_destroy(m32);
}

// Decoding through a KV cache with half weights = the rounded float32
// module's, token by token.
static void test_cached(mha_dtype wd) {
    const cfgcase c = {64, 8, 0, 0, 2, true, false, false};
    mha_module *m32 = make(&c, MHA_F32, 3), *mh = NULL, *mr = NULL;
    if (!m32) return;
    CHECK_OK(mha_module_convert(&mh, m32, wd));
    if (mh) CHECK_OK(mha_module_convert(&mr, mh, MHA_F32));
    const int64_t T = 12, N = 2, E = 64;
    float x[T * N * E], yh[N * E], yr[N * E];
    for (int64_t i = 0; i < T * N * E; i++) x[i] = urand();
    mha_kv_cache *ch = NULL, *cr = NULL;
    CHECK_OK(mha_kv_cache_create(&ch, N, 2, 8, 8, T, MHA_KV_F32));
    CHECK_OK(mha_kv_cache_create(&cr, N, 2, 8, 8, T, MHA_KV_F32));
    int64_t bad = 0;
    for (int64_t t = 0; ch && cr && mr && t < T; t++) {
        mha_tensor q = mha_tensor_contiguous(x + t * N * E, MHA_F32, 3, (int64_t[]){1, N, E});
        mha_tensor oh = mha_tensor_contiguous(yh, MHA_F32, 3, (int64_t[]){1, N, E});
        mha_tensor orr = mha_tensor_contiguous(yr, MHA_F32, 3, (int64_t[]){1, N, E});
        mha_forward_args a;
        mha_forward_args_init(&a);
        a.query = &q;
        CHECK_OK(mha_forward_cached(&oh, mh, &a, ch));
        CHECK_OK(mha_forward_cached(&orr, mr, &a, cr));
        bad += memcmp(yh, yr, sizeof yh) != 0;
    }
    CHECKF(bad == 0, "%s weights: %lld decode steps differ from the rounded float32 module",
           mha_dtype_name(wd), (long long)bad);
    mha_kv_cache_destroy(ch);
    mha_kv_cache_destroy(cr);
    mha_module_destroy(mr);
    mha_module_destroy(mh);
    mha_module_destroy(m32);
}

static void test_bad_dtype(void) {
    mha_config cfg;
    mha_config_init(&cfg, 8, 2);
    mha_module *m = NULL;
    cfg.weight_dtype = MHA_I32;
    CHECK_FAILS(mha_module_create(&m, &cfg), MHA_ERR_INVALID_ARG);
    CHECK(strstr(mha_last_error(), "weight_dtype") != NULL);
    cfg.weight_dtype = (mha_dtype)99;
    CHECK_FAILS(mha_module_create(&m, &cfg), MHA_ERR_INVALID_ARG);
    cfg.weight_dtype = MHA_F32;
    CHECK_OK(mha_module_create(&m, &cfg));
    mha_module *c = NULL;
    CHECK_FAILS(mha_module_convert(&c, m, MHA_F64), MHA_ERR_INVALID_ARG);
    CHECK(c == NULL);
    CHECK_FAILS(mha_module_convert(NULL, m, MHA_BF16), MHA_ERR_INVALID_ARG);
    mha_module_destroy(m);
}

int main(void) {
    const cfgcase cases[] = {
        {64, 4, 0, 0, 0, true, false, false},    // packed in_proj_weight
        {48, 6, 40, 24, 0, true, true, true},    // separate, bias_kv, batch first
        {64, 8, 0, 0, 2, false, false, false},   // GQA, no bias
        {96, 3, 0, 0, 1, true, false, true},     // MQA
        {768, 12, 0, 0, 0, true, false, false},  // BERT-base size
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) test_case(&cases[i]);
    test_cached(MHA_BF16);
    test_cached(MHA_F16);
    test_bad_dtype();
    printf("largest error / bound: bf16 %.3f, f16 %.3f\n", worst_ratio[0], worst_ratio[1]);
    return check_summary("test_half_weights");
}
