// test_half_module.c: the module forward with bf16 weight matrices and bf16
// query, key and value computes its attention in bf16 (fused_fwd.c: the
// projected q, k, v rows rounded to bf16, the flash tiles' bf16 products),
// on the tables that do (amx, avx512bf16) and, forced (mha__flash_force_bf16), on
// every other. Checks, over self-attention (the packed qkv rows) and
// cross-attention (kdim, vdim), grouped-query heads, batch_first and
// sequence-first, a key padding mask, causal, need_weights:
//  - mha_last_impl() says "fused ... bf16"; float32 inputs or float32
//    weights keep the float32 compute; a saved state (a training forward)
//    gives the same bits;
//  - the output and weights are the same bits with 1, 2 and 8 threads;
//  - against the float32 module on the same (rounded) weights and inputs,
//    whose only differences are q, k, v and P rounded to bf16 (relative
//    2^-9 each) and the output's rounding: max |diff| <= 2^-7 (1 + max|y|)
//    and the relative RMS difference <= 2^-7: a sanity bound (the
//    accuracy rule, error <= 2x PyTorch's bf16 module, is checked by
//    tests/python/test_module.py::test_module_in_half on the machines that
//    compute in bf16);
//  - the backward (fused_bwd.c's bf16 compute; a module narrower than 32
//    saves and trains in float32): "bf16" in mha_last_impl(),
//    the same bits from the saved state and recomputed, with 1, 2 and 8
//    threads, in a bf16 or a float32 gradient module; += doubles; input
//    and parameter gradients against the float32 module's (reference,
//    float64 sums) on the same rounded values: max |diff| <= 2^-5 (1 +
//    max|g|) and relative RMS <= 2^-6, four times what the bf16 operands'
//    rounding (2^-9 relative, a few roundings in a row: ~2^-8 RMS measured)
//    gives: a sanity bound, the accuracy rule against PyTorch's bf16
//    autograd is tests/python's.
#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "check.h"
#include "flash.h"
#include "mha.h"
#include "view.h"

typedef struct mcase {
    int64_t E, H, hkv, kdim, vdim, N, L, S;
    bool batch_first, causal, kpm, weights;
    float drop, out_drop;  // training with dropout (config.dropout, .out_dropout)
} mcase;

static uint64_t g_rng = 99;
static double g_worst_max, g_worst_rms;  // error / bound, over the cases
static float urand(void) {               // in [-1, 1)
    g_rng = g_rng * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((g_rng >> 40) * (1.0 / 16777216.0)) * 2.0f - 1.0f;
}

static void set_threads(int n) {
#ifdef _OPENMP
    omp_set_num_threads(n);
#else
    (void)n;
#endif
}

// n values of x, rounded to bf16 (x keeps the rounded values as float32)
static uint16_t *to_bf16(float *x, int64_t n) {
    uint16_t *h = malloc(sizeof(uint16_t) * (size_t)n);
    for (int64_t i = 0; i < n; i++) {
        h[i] = mha_f32_to_bf16(x[i]);
        x[i] = mha_bf16_to_f32(h[i]);
    }
    return h;
}

// Largest |x - r| / (1 + max|r|) and the relative RMS of x - r.
static void err_of(const float *x, const float *r, int64_t n, double *emax, double *erms) {
    double rmax = 0, md = 0, num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        const double d = (double)x[i] - r[i];
        rmax = fmax(rmax, fabs(r[i]));
        md = isfinite(d) ? fmax(md, fabs(d)) : INFINITY;
        num += d * d, den += (double)r[i] * r[i];
    }
    *emax = md / (1 + rmax);
    *erms = sqrt(num / (den > 0 ? den : 1));
}

static double g_train_max, g_train_rms;  // over the cases

// The backward of the bf16 module on a's bf16 inputs (a->save: the saved
// forward's state, filled): mha_last_impl() says bf16; the bits equal
// without the saved state (recomputed) and with 1, 2 and 8 threads; += onto
// its own result doubles every gradient (float32: exactly; bf16: within
// its rounding); the input and parameter
// gradients (bf16 views and a bf16 gradient module, or a float32 one)
// against the float32 module's on the same rounded values within the
// bound below.
// Whether the case's module trains in bf16: every projection width (E,
// kdim, vdim) at least 32 (fused.h; narrower ones save and train in
// float32, the same checks hold).
static bool trains_bf16(const mcase *c) {
    return c->E >= 32 && (!c->kdim || c->kdim >= 32) && (!c->vdim || c->vdim >= 32);
}

static void train_case(const mcase *c, const char *desc, const mha_module *m16,
                       const mha_module *mr, mha_forward_args *a, bool self, mha_shape ys) {
    const int64_t kd = c->kdim ? c->kdim : c->E, vd = c->vdim ? c->vdim : c->E;
    const int64_t nq = c->N * c->L * c->E, nk = c->N * c->S * kd, nv = c->N * c->S * vd;
    const int64_t ng = nq + nk + nv;
    int64_t ny = 1;
    for (int i = 0; i < ys.ndim; i++) ny *= ys.dims[i];
    float *g32 = malloc(sizeof(float) * (size_t)ny);
    for (int64_t i = 0; i < ny; i++) g32[i] = urand();
    uint16_t *g16 = to_bf16(g32, ny);
    mha_tensor go16 = mha_tensor_contiguous(g16, MHA_BF16, ys.ndim, ys.dims);
    mha_tensor go32 = mha_tensor_contiguous(g32, MHA_F32, ys.ndim, ys.dims);
    // float32 answer: the float32 module, the reference (float64 sums)
    float *r32 = malloc(sizeof(float) * (size_t)ng);
    mha_module *gr = NULL;
    CHECK_OK(mha_module_convert(&gr, mr, MHA_F32));
    mha_forward_args ar = *a;
    mha_tensor qf, kf, vf;  // float32 views of the same rounded values
    float *xf = malloc(sizeof(float) * (size_t)ng);
    const mha_tensor *in16[3] = {a->query, a->key, a->value};
    mha_tensor *inf[3] = {&qf, &kf, &vf};
    const int64_t off[3] = {0, nq, nq + nk}, cnt[3] = {nq, nk, nv};
    for (int t = 0; t < 3; t++) {
        for (int64_t i = 0; i < cnt[t]; i++)
            xf[off[t] + i] = mha_bf16_to_f32(((const uint16_t *)in16[t]->data)[i]);
        *inf[t] = *in16[t];
        inf[t]->data = xf + off[t], inf[t]->dtype = MHA_F32;
    }
    if (self) kf.data = vf.data = qf.data;
    ar.query = &qf, ar.key = self ? &qf : &kf, ar.value = self ? &qf : &vf;
    ar.save = NULL, ar.impl = MHA_IMPL_REFERENCE;
    mha_tensor rq = qf, rk = kf, rv = vf;
    rq.data = r32, rk.data = r32 + nq, rv.data = r32 + nq + nk;
    CHECK_OK(mha_backward(&rq, &rk, &rv, gr, mr, &ar, &go32, false));
    // bf16: saved (a->save) and recomputed; 1, 2, 8 threads; a bf16 and a
    // float32 gradient module
    uint16_t *h[4];
    mha_module *gh[4] = {NULL};
    const int threads[4] = {2, 2, 1, 8};
    for (int run = 0; run < 4; run++) {
        set_threads(threads[run]);
        h[run] = calloc((size_t)ng, 2);
        mha_tensor tq = *a->query, tk = *a->key, tv = *a->value;
        tq.data = h[run], tk.data = h[run] + nq, tv.data = h[run] + nq + nk;
        CHECK_OK(mha_module_convert(&gh[run], m16, run == 3 ? MHA_F32 : MHA_BF16));
        mha_forward_args ab = *a;
        if (run > 0) ab.save = NULL;  // run 0: the saved forward's state
        CHECK_OK(mha_backward(&tq, &tk, &tv, gh[run], m16, &ab, &go16, false));
        CHECKF((strstr(mha_last_impl(), " bf16") != NULL) == trains_bf16(c),
               "%s: the backward ran \"%s\"", desc, mha_last_impl());
    }
    set_threads(2);
    for (int run = 1; run < 4; run++) {
        CHECKF(memcmp(h[0], h[run], 2 * (size_t)ng) == 0,
               "%s: input gradient bits differ (%s, %d threads)", desc,
               run == 1 ? "recomputed forward" : "saved", threads[run]);
        mha_module *cv = NULL;  // the float32 gradients, rounded, are the bf16 ones
        if (gh[run]) CHECK_OK(mha_module_convert(&cv, gh[run], MHA_BF16));
        for (int i = 0; cv && i < mha_module_num_params(cv); i++) {
            mha_param x, y;
            CHECK_OK(mha_module_param_at(&x, gh[0], i));
            CHECK_OK(mha_module_param_at(&y, cv, i));
            CHECKF(memcmp(x.storage, y.storage, (size_t)x.numel * mha_dtype_size(x.dtype)) == 0,
                   "%s: gradient %s differs (run %d)", desc, x.name, run);
        }
        mha_module_destroy(cv);
    }
    // += onto the result: twice it (the float32 gradient module: exactly;
    // the bf16 input gradients: the float32 sum of the stored gradient and
    // the new one, rounded once: within one rounding of twice it)
    {
        mha_module *g2 = NULL;
        CHECK_OK(mha_module_convert(&g2, gh[3], MHA_F32));
        mha_tensor tq = *a->query, tk = *a->key, tv = *a->value;
        tq.data = h[1], tk.data = h[1] + nq, tv.data = h[1] + nq + nk;
        mha_forward_args ab = *a;
        CHECK_OK(mha_backward(&tq, &tk, &tv, g2, m16, &ab, &go16, true));
        int64_t bad = 0;
        for (int64_t i = 0; i < ng; i++) {
            const double x = mha_bf16_to_f32(h[1][i]), y = 2.0 * mha_bf16_to_f32(h[0][i]);
            bad += !(fabs(x - y) <= 0x1p-8 * fabs(y));
        }
        for (int i = 0; g2 && i < mha_module_num_params(g2); i++) {
            mha_param x, y;
            CHECK_OK(mha_module_param_at(&x, gh[3], i));
            CHECK_OK(mha_module_param_at(&y, g2, i));
            for (int64_t j = 0; j < x.numel; j++) bad += y.data[j] != 2 * x.data[j];
        }
        CHECKF(bad == 0, "%s: += gave %lld values other than twice the gradient", desc,
               (long long)bad);
        mha_module_destroy(g2);
    }
    // against the float32 module's gradients
    float *hf = malloc(sizeof(float) * (size_t)ng);
    for (int64_t i = 0; i < ng; i++) hf[i] = mha_bf16_to_f32(h[0][i]);
    double emax, erms;
    const double B_MAX = 0x1p-5, B_RMS = 0x1p-6;
    for (int t = 0; t < (self ? 1 : 3); t++) {
        float *x = hf + off[t], *r = r32 + off[t];
        if (self)  // the input's gradient: the sum of its three parts
            for (int64_t i = 0; i < nq; i++)
                x[i] = hf[i] + hf[nq + i] + hf[nq + nk + i],
                r[i] = r32[i] + r32[nq + i] + r32[nq + nk + i];
        err_of(x, r, cnt[t], &emax, &erms);
        g_train_max = fmax(g_train_max, emax / B_MAX),
        g_train_rms = fmax(g_train_rms, erms / B_RMS);
        CHECKF(emax <= B_MAX && erms <= B_RMS, "%s: input %d gradient off: max %g, rms %g",
               desc, t, emax, erms);
    }
    for (int i = 0; i < mha_module_num_params(gr); i++) {
        mha_param x, y;
        CHECK_OK(mha_module_param_at(&x, gh[3], i));  // (the float32 gradient module)
        CHECK_OK(mha_module_param_at(&y, gr, i));
        err_of(x.data, y.data, x.numel, &emax, &erms);
        g_train_max = fmax(g_train_max, emax / B_MAX),
        g_train_rms = fmax(g_train_rms, erms / B_RMS);
        CHECKF(emax <= B_MAX && erms <= B_RMS, "%s: %s gradient off: max %g, rms %g", desc,
               x.name, emax, erms);
    }
    for (int run = 0; run < 4; run++) free(h[run]), mha_module_destroy(gh[run]);
    mha_module_destroy(gr);
    free(hf), free(xf), free(r32), free(g32), free(g16);
}

static void run_case(const mcase *c, int id) {
    const bool self = !c->kdim && !c->vdim && c->S == c->L;
    const int64_t kd = c->kdim ? c->kdim : c->E, vd = c->vdim ? c->vdim : c->E;
    mha_config cfg;
    mha_config_init(&cfg, c->E, c->H);
    cfg.kdim = c->kdim, cfg.vdim = c->vdim, cfg.num_kv_heads = c->hkv;
    cfg.batch_first = c->batch_first;
    cfg.dropout = c->drop, cfg.out_dropout = c->out_drop;
    mha_module *m32, *m16, *mr;
    CHECK_OK(mha_module_create(&m32, &cfg));
    mha_init_options io;
    mha_init_options_init(&io);
    io.seed = 5 + (uint64_t)id;
    CHECK_OK(mha_module_init(m32, &io));
    CHECK_OK(mha_module_convert(&m16, m32, MHA_BF16));
    CHECK_OK(mha_module_convert(&mr, m16, MHA_F32));  // float32 with the rounded weights
    const int64_t nq = c->N * c->L * c->E, nk = c->N * c->S * kd, nv = c->N * c->S * vd;
    // self-attention: key and value are the query's buffers
    float *q = malloc(sizeof(float) * (size_t)nq);
    float *k = self ? q : malloc(sizeof(float) * (size_t)nk);
    float *v = self ? q : malloc(sizeof(float) * (size_t)nv);
    for (int64_t i = 0; i < nq; i++) q[i] = urand();
    for (int64_t i = 0; !self && i < nk; i++) k[i] = urand();
    for (int64_t i = 0; !self && i < nv; i++) v[i] = urand();
    uint16_t *qh = to_bf16(q, nq), *kh = self ? qh : to_bf16(k, nk),
             *vh = self ? qh : to_bf16(v, nv);
    const int64_t a0 = c->batch_first ? c->N : c->L, a1 = c->batch_first ? c->L : c->N;
    const int64_t b0 = c->batch_first ? c->N : c->S, b1 = c->batch_first ? c->S : c->N;
    mha_tensor q32 = mha_tensor_contiguous(q, MHA_F32, 3, (int64_t[]){a0, a1, c->E});
    mha_tensor k32 = mha_tensor_contiguous(k, MHA_F32, 3, (int64_t[]){b0, b1, kd});
    mha_tensor v32 = mha_tensor_contiguous(v, MHA_F32, 3, (int64_t[]){b0, b1, vd});
    mha_tensor q16 = mha_tensor_contiguous(qh, MHA_BF16, 3, (int64_t[]){a0, a1, c->E});
    mha_tensor k16 = mha_tensor_contiguous(kh, MHA_BF16, 3, (int64_t[]){b0, b1, kd});
    mha_tensor v16 = mha_tensor_contiguous(vh, MHA_BF16, 3, (int64_t[]){b0, b1, vd});
    uint8_t *kpm = calloc((size_t)(c->N * c->S), 1);
    for (int64_t n = 0; n < c->N; n++) kpm[n * c->S + c->S - 1 - n % c->S] = 1;
    mha_tensor kpmt = mha_tensor_contiguous(kpm, MHA_U8, 2, (int64_t[]){c->N, c->S});
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.key_padding_mask = c->kpm ? &kpmt : NULL;
    a.opts.is_causal = c->causal;
    a.need_weights = c->weights;
    a.average_attn_weights = false;
    a.training = c->drop > 0 || c->out_drop > 0;
    a.opts.dropout_seed = 77;
    char desc[160];
    snprintf(desc, sizeof desc,
             "case %d (E %lld H %lld/%lld kdim %lld vdim %lld N %lld L %lld S "
             "%lld%s%s%s%s%s)",
             id, (long long)c->E, (long long)c->H, (long long)c->hkv, (long long)c->kdim,
             (long long)c->vdim, (long long)c->N, (long long)c->L, (long long)c->S,
             c->batch_first ? " batch_first" : "", c->causal ? " causal" : "",
             c->kpm ? " kpm" : "", c->weights ? " weights" : "", a.training ? " dropout" : "");
    // the float32 module on the same rounded values
    a.query = &q32, a.key = &k32, a.value = &v32;
    mha_shape ys, wsh;
    CHECK_OK(mha_forward_shapes(&ys, &wsh, mr, &a));
    int64_t ny = 1, nw = 1;
    for (int i = 0; i < ys.ndim; i++) ny *= ys.dims[i];
    for (int i = 0; i < wsh.ndim; i++) nw *= wsh.dims[i];
    float *y32 = malloc(sizeof(float) * (size_t)ny), *w32 = malloc(sizeof(float) * (size_t)nw);
    mha_tensor y32t = mha_tensor_contiguous(y32, MHA_F32, ys.ndim, ys.dims);
    mha_tensor w32t = mha_tensor_contiguous(w32, MHA_F32, wsh.ndim, wsh.dims);
    CHECK_OK(mha_forward(&y32t, c->weights ? &w32t : NULL, mr, &a));
    // float32 inputs to the bf16 module: float32 compute
    CHECK_OK(mha_forward(&y32t, c->weights ? &w32t : NULL, m16, &a));
    CHECKF(strstr(mha_last_impl(), " bf16") == NULL, "%s: float32 inputs ran \"%s\"", desc,
           mha_last_impl());
    CHECK_OK(mha_forward(&y32t, c->weights ? &w32t : NULL, mr, &a));
    // the bf16 module on bf16 inputs, 1, 2, 8 threads
    a.query = &q16, a.key = &k16, a.value = &v16;
    uint16_t *y16[3], *w16[3];
    const int threads[3] = {1, 2, 8};
    for (int r = 0; r < 3; r++) {
        set_threads(threads[r]);
        y16[r] = calloc((size_t)ny, 2), w16[r] = calloc((size_t)nw, 2);
        mha_tensor yt = mha_tensor_contiguous(y16[r], MHA_BF16, ys.ndim, ys.dims);
        mha_tensor wt = mha_tensor_contiguous(w16[r], MHA_BF16, wsh.ndim, wsh.dims);
        CHECK_OK(mha_forward(&yt, c->weights ? &wt : NULL, m16, &a));
        CHECKF(strncmp(mha_last_impl(), "fused ", 6) == 0 &&
                   strstr(mha_last_impl(), " bf16") != NULL,
               "%s: ran \"%s\", not the bf16 compute", desc, mha_last_impl());
    }
    set_threads(2);
    for (int r = 1; r < 3; r++) {
        CHECKF(memcmp(y16[0], y16[r], 2 * (size_t)ny) == 0,
               "%s: output bits differ at %d threads", desc, threads[r]);
        CHECKF(!c->weights || memcmp(w16[0], w16[r], 2 * (size_t)nw) == 0,
               "%s: weights bits differ at %d threads", desc, threads[r]);
    }
    // against the float32 module
    double ymax = 0, md = 0, num = 0, den = 0;
    bool finite = true;
    for (int64_t i = 0; i < ny; i++) {
        const double y = mha_bf16_to_f32(y16[0][i]), r = y32[i];
        finite &= isfinite(y);
        ymax = fmax(ymax, fabs(r));
        md = fmax(md, fabs(y - r));
        num += (y - r) * (y - r), den += r * r;
    }
    const double rms = sqrt(num / (den > 0 ? den : 1));
    g_worst_max = fmax(g_worst_max, md / (0x1p-7 * (1 + ymax)));
    g_worst_rms = fmax(g_worst_rms, rms / 0x1p-7);
    CHECKF(finite && md <= 0x1p-7 * (1 + ymax) && rms <= 0x1p-7,
           "%s: off the float32 module: max %g (bound %g), relative RMS %g (bound %g)", desc,
           md, 0x1p-7 * (1 + ymax), rms, 0x1p-7);
    for (int64_t i = 0; c->weights && i < nw; i++)
        if (!(fabs(mha_bf16_to_f32(w16[0][i]) - w32[i]) <= 0x1p-6)) {
            CHECKF(false, "%s: weight %lld %g vs float32 %g", desc, (long long)i,
                   (double)mha_bf16_to_f32(w16[0][i]), (double)w32[i]);
            break;
        }
    // a saved state (a training forward): the same bf16 compute, the same bits
    mha_saved *sv;
    CHECK_OK(mha_saved_create(&sv));
    a.save = sv;
    {
        mha_tensor yt = mha_tensor_contiguous(y16[1], MHA_BF16, ys.ndim, ys.dims);
        mha_tensor wt = mha_tensor_contiguous(w16[1], MHA_BF16, wsh.ndim, wsh.dims);
        CHECK_OK(mha_forward(&yt, c->weights ? &wt : NULL, m16, &a));
        CHECKF((strstr(mha_last_impl(), " bf16") != NULL) == trains_bf16(c),
               "%s: a saved forward ran \"%s\"", desc, mha_last_impl());
        CHECKF(!trains_bf16(c) || memcmp(y16[0], y16[1], 2 * (size_t)ny) == 0,
               "%s: a saved forward's output bits differ", desc);
    }
    // training: the backward in bf16, against the float32 module's
    train_case(c, desc, m16, mr, &a, self, ys);
    a.save = NULL;
    mha_saved_destroy(sv);
    for (int r = 0; r < 3; r++) free(y16[r]), free(w16[r]);
    free(y32), free(w32), free(kpm), free(qh);
    if (!self) free(kh), free(vh), free(k), free(v);
    free(q);
    mha_module_destroy(m32), mha_module_destroy(m16), mha_module_destroy(mr);
}

int main(void) {
    const mcase cases[] = {
        {96, 6, 0, 0, 0, 2, 70, 70, true, false, true, true, 0, 0},    // self, packed qkv
        {64, 4, 2, 0, 0, 3, 33, 33, false, true, false, false, 0, 0},  // GQA, seq-first, causal
        {64, 8, 0, 48, 40, 2, 40, 130, true, false, true, true, 0, 0},   // cross, kdim/vdim
        {128, 2, 1, 0, 0, 1, 200, 200, true, true, false, false, 0, 0},  // MQA, d 64, tiles
        {64, 4, 0, 0, 0, 2, 90, 90, false, false, true, false, 0.2f, 0.1f},  // dropout
        {16, 2, 0, 0, 0, 2, 20, 20, true, false, true, false, 0, 0},  // narrow: float32 training
    };
    const bool fast = strcmp(mha_isa(), "amx") == 0 || strcmp(mha_isa(), "avx512bf16") == 0;
    if (!fast) mha__flash_force_bf16(true);  // the bf16 compute of this table, forced
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) run_case(&cases[i], (int)i);
    printf("test_half_module: %zu cases, kernels %s%s; worst max error / bound %.3g, relative "
           "RMS / bound %.3g; backward %.3g, %.3g\n",
           sizeof cases / sizeof cases[0], mha_isa(), fast ? "" : " (bf16 compute forced)",
           g_worst_max, g_worst_rms, g_train_max, g_train_rms);
    return check_summary("test_half_module");
}
