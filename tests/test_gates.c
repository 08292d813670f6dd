// test_gates.c: per-head gates (static and input-dependent) and head
// pruning.
//   - known answers: static gates of 1 give the ungated module's bits;
//     static gates g equal an ungated module whose W_O columns of head h
//     are scaled by g_h; dynamic gates equal sigmoid(x W_g^T + b_g) applied
//     by hand to the reference's traced per-head context; pruning k heads
//     gives the bits of static gates 0 on them, zero weight rows, and the
//     averaged weights are the mean over the live heads
//   - random configurations (GQA, kdim/vdim, masks, causal, dropout,
//     need_weights, pruned sets including whole KV groups): fused against
//     the reference, forward and backward, every gradient
//   - bit-identical results with 1, 2 and 8 threads
//   - mha_forward_cached with gates and pruning = the causal forward
//   - save/load (gate tensors, __metadata__ pruned_heads), convert, misuse
//   - mha_diag_create's pruned flag and gate_mean
// Finite differences of the gates' gradients: test_backward.c.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "check.h"
#include "util.h"
#include "mha.h"


// A module of config c, PyTorch's init (seed), random gate parameters.
static mha_module *new_module(const mha_config *c, uint64_t seed) {
    mha_module *m = torch_module(c, seed);
    mha_param p;
    if (c->head_gate == MHA_GATE_STATIC && !mha_module_param(&p, m, "head_gate"))
        for (int64_t h = 0; h < p.numel; h++) p.data[h] = 1.5f * frand();
    if (c->head_gate == MHA_GATE_DYNAMIC) {
        CHECK_OK(mha_module_param(&p, m, "gate_proj.weight"));
        for (int64_t i = 0; i < p.numel; i++) p.data[i] = 0.5f * frand();
        CHECK_OK(mha_module_param(&p, m, "gate_proj.bias"));
        for (int64_t i = 0; i < p.numel; i++) p.data[i] = frand();
    }
    return m;
}

static float *param(const mha_module *m, const char *name) {
    mha_param p;
    mha_status st = mha_module_param(&p, m, name);
    CHECKF(st == MHA_OK, "no parameter %s", name);
    return st ? NULL : p.data;
}

// Self-attention forward of x (L, N, E) into y; weights (N, H, L, L) per
// head when w.
static void fwd(float *y, float *w, const mha_module *m, float *x, int64_t L, int64_t N,
                mha_impl impl, bool causal) {
    const int64_t E = mha_module_config(m)->embed_dim, H = mha_module_config(m)->num_heads;
    mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 3, (int64_t[]){L, N, E});
    mha_tensor yt = mha_tensor_contiguous(y, MHA_F32, 3, (int64_t[]){L, N, E});
    mha_tensor wt = mha_tensor_contiguous(w, MHA_F32, 4, (int64_t[]){N, H, L, L});
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = a.key = a.value = &xt;
    a.impl = impl;
    a.opts.is_causal = causal;
    a.need_weights = w != NULL;
    a.average_attn_weights = false;
    CHECK_OK(mha_forward(&yt, w ? &wt : NULL, m, &a));
}

// Static gates: all 1 = the ungated module, bit for bit; gates g = W_O's
// head columns scaled by g (both implementations).
static void test_static_known(void) {
    enum { E = 24, H = 4, L = 13, N = 2 };
    const int64_t d = E / H;
    mha_config c;
    mha_config_init(&c, E, H);
    mha_module *plain = new_module(&c, 5);
    c.head_gate = MHA_GATE_STATIC;
    mha_module *gated = NULL;
    CHECK_OK(mha_module_create(&gated, &c));
    mha_init_options io;
    mha_init_options_init(&io);
    CHECK_OK(mha_module_init(gated, &io));
    float *hg = param(gated, "head_gate");
    for (int h = 0; h < H; h++) CHECKF(hg[h] == 1.0f, "init head_gate[%d] = %g", h, hg[h]);
    // the same weights as plain
    static const char *names[4] = {"in_proj_weight", "in_proj_bias", "out_proj.weight",
                                   "out_proj.bias"};
    for (int i = 0; i < 4; i++) {
        mha_param a, b;
        CHECK_OK(mha_module_param(&a, plain, names[i]));
        CHECK_OK(mha_module_param(&b, gated, names[i]));
        memcpy(b.data, a.data, sizeof(float) * (size_t)a.numel);
    }
    static float x[L * N * E], y0[L * N * E], y1[L * N * E];
    for (int i = 0; i < L * N * E; i++) x[i] = frand();
    for (int impl = 0; impl < 2; impl++) {
        mha_impl im = impl ? MHA_IMPL_FUSED : MHA_IMPL_REFERENCE;
        fwd(y0, NULL, plain, x, L, N, im, false);
        fwd(y1, NULL, gated, x, L, N, im, false);
        CHECKF(memcmp(y0, y1, sizeof y0) == 0,
               "gates of 1 differ from the ungated module (%s)", mha_impl_name(im));
    }
    // gates g: the plain module with W_O[:, h d : (h+1) d] * g_h
    const float g[H] = {0.25f, -1.5f, 0.0f, 2.0f};
    memcpy(hg, g, sizeof g);
    float *wo = param(plain, "out_proj.weight");
    for (int r = 0; r < E; r++)
        for (int h = 0; h < H; h++)
            for (int j = 0; j < d; j++) wo[r * E + h * d + j] *= g[h];  // exact (powers of 2)
    for (int impl = 0; impl < 2; impl++) {
        mha_impl im = impl ? MHA_IMPL_FUSED : MHA_IMPL_REFERENCE;
        fwd(y0, NULL, plain, x, L, N, im, false);
        fwd(y1, NULL, gated, x, L, N, im, false);
        double e = rel_err(y0, y1, L * N * E);
        CHECKF(e < 1e-6, "static gates vs scaled W_O (%s): rel err %g", mha_impl_name(im), e);
    }
    mha_module_destroy(plain);
    mha_module_destroy(gated);
}

// The reference's traced per-head context ("concat", before the gates).
static float g_concat[64 * 2 * 32];
static void grab_concat(void *user, const char *step, int64_t b, int64_t h,
                        const mha_tensor *t) {
    (void)user, (void)b, (void)h;
    if (strcmp(step, "concat") == 0)
        memcpy(g_concat, t->data, sizeof(float) * (size_t)mha_tensor_numel(t));
}

// Dynamic gates: y = (ctx_h * sigmoid(x W_g[h]^T + b_g[h])) W_O^T + b_O,
// computed here from the traced context; fused agrees with the reference.
static void test_dynamic_known(void) {
    enum { E = 32, H = 4, L = 64, N = 2 };
    const int64_t d = E / H;
    mha_config c;
    mha_config_init(&c, E, H);
    c.head_gate = MHA_GATE_DYNAMIC;
    mha_module *m = NULL;
    CHECK_OK(mha_module_create(&m, &c));
    mha_init_options io;
    mha_init_options_init(&io);
    CHECK_OK(mha_module_init(m, &io));
    const float *wg = param(m, "gate_proj.weight"), *bg = param(m, "gate_proj.bias");
    CHECK(max_abs(wg, H * E) == 0.0 && max_abs(bg, H) == 0.0);  // gates 0.5 at init
    mha_module_destroy(m);
    m = new_module(&c, 9);
    wg = param(m, "gate_proj.weight"), bg = param(m, "gate_proj.bias");
    const float *wo = param(m, "out_proj.weight"), *bo = param(m, "out_proj.bias");
    static float x[L * N * E], y[L * N * E], yf[L * N * E];
    for (int i = 0; i < L * N * E; i++) x[i] = frand();
    mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 3, (int64_t[]){L, N, E});
    mha_tensor yt = mha_tensor_contiguous(y, MHA_F32, 3, (int64_t[]){L, N, E});
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = a.key = a.value = &xt;
    a.impl = MHA_IMPL_REFERENCE;
    a.trace = grab_concat;
    CHECK_OK(mha_forward(&yt, NULL, m, &a));
    double err = 0, gmin = 1, gmax = 0;
    for (int n = 0; n < N; n++)
        for (int t = 0; t < L; t++) {
            const float *xr = x + (t * N + n) * E, *cr = g_concat + (n * L + t) * E;
            double gc[E];
            for (int h = 0; h < H; h++) {
                double z = bg[h];
                for (int e = 0; e < E; e++) z += (double)wg[h * E + e] * xr[e];
                const double g = 1.0 / (1.0 + exp(-z));
                gmin = fmin(gmin, g), gmax = fmax(gmax, g);
                for (int j = 0; j < d; j++) gc[h * d + j] = g * cr[h * d + j];
            }
            for (int o = 0; o < E; o++) {
                double s = bo[o];
                for (int e = 0; e < E; e++) s += (double)wo[o * E + e] * gc[e];
                err = fmax(err, fabs(s - y[(t * N + n) * E + o]));
            }
        }
    CHECKF(err < 1e-6, "dynamic gates by hand vs the reference: %g", err);
    CHECKF(gmax - gmin > 0.2, "the gates vary with the input (%g .. %g)", gmin, gmax);
    fwd(yf, NULL, m, x, L, N, MHA_IMPL_FUSED, false);
    double e = rel_err(y, yf, L * N * E);
    CHECKF(e < 2e-5, "dynamic gates fused vs reference: %g", e);
    mha_module_destroy(m);
}

// Pruning k heads = static gates of 0 on them (bit for bit, the fused path
// and the reference); their weight rows are 0; the average is over the live
// heads; the pruned set is reported and can be restored.
static void test_prune_known(void) {
    enum { E = 32, H = 4, L = 40, N = 2 };
    mha_config c;
    mha_config_init(&c, E, H);
    mha_module *m = new_module(&c, 3);
    c.head_gate = MHA_GATE_STATIC;
    mha_module *gz = NULL;
    CHECK_OK(mha_module_create(&gz, &c));
    for (int i = 0; i < mha_module_num_params(m); i++) {
        mha_param a, b;
        CHECK_OK(mha_module_param_at(&a, m, i));
        CHECK_OK(mha_module_param(&b, gz, a.name));
        memcpy(b.data, a.data, sizeof(float) * (size_t)a.numel);
    }
    float *hg = param(gz, "head_gate");
    hg[1] = hg[3] = 0.0f;
    const int64_t pr[2] = {3, 1};
    CHECK_OK(mha_module_prune_heads(m, pr, 2));
    CHECK(mha_module_num_pruned(m) == 2 && mha_module_head_pruned(m, 1) &&
          mha_module_head_pruned(m, 3) && !mha_module_head_pruned(m, 0) &&
          !mha_module_head_pruned(m, 7));
    static float x[L * N * E], y0[L * N * E], y1[L * N * E], w[N * H * L * L],
        wall[N * H * L * L], avg[N * L * L];
    for (int i = 0; i < L * N * E; i++) x[i] = frand();
    for (int impl = 0; impl < 2; impl++) {
        mha_impl im = impl ? MHA_IMPL_FUSED : MHA_IMPL_REFERENCE;
        fwd(y0, wall, gz, x, L, N, im, true);
        fwd(y1, w, m, x, L, N, im, true);
        CHECKF(memcmp(y0, y1, sizeof y0) == 0, "pruned vs gates 0 (%s): outputs differ",
               mha_impl_name(im));
        double zero = 0, live = 0;
        for (int n = 0; n < N; n++)
            for (int h = 0; h < H; h++)
                for (int i = 0; i < L * L; i++) {
                    const int64_t o = (n * H + h) * L * L + i;
                    if (h == 1 || h == 3) zero = fmax(zero, fabs(w[o]));
                    else live = fmax(live, fabs(w[o] - wall[o]));
                }
        CHECKF(zero == 0.0, "pruned heads' weights are 0 (%s): max %g", mha_impl_name(im), zero);
        CHECKF(live == 0.0, "live heads' weights unchanged (%s): max diff %g",
               mha_impl_name(im), live);
        // averaged: the mean of heads 0 and 2
        mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 3, (int64_t[]){L, N, E});
        mha_tensor yt = mha_tensor_contiguous(y1, MHA_F32, 3, (int64_t[]){L, N, E});
        mha_tensor at = mha_tensor_contiguous(avg, MHA_F32, 3, (int64_t[]){N, L, L});
        mha_forward_args a;
        mha_forward_args_init(&a);
        a.query = a.key = a.value = &xt;
        a.impl = im;
        a.opts.is_causal = true;
        a.need_weights = true;
        CHECK_OK(mha_forward(&yt, &at, m, &a));
        double ea = 0;
        for (int n = 0; n < N; n++)
            for (int i = 0; i < L * L; i++) {
                const double want = 0.5 * ((double)wall[(n * H + 0) * L * L + i] +
                                           wall[(n * H + 2) * L * L + i]);
                ea = fmax(ea, fabs(avg[n * L * L + i] - want));
            }
        CHECKF(ea < 1e-6, "averaged weights = mean of the live heads (%s): %g",
               mha_impl_name(im), ea);
    }
    CHECK_OK(mha_module_prune_heads(m, NULL, 0));
    CHECK(mha_module_num_pruned(m) == 0 && !mha_module_head_pruned(m, 1));
    // misuse: out of range, negative count; the set is unchanged
    CHECK_OK(mha_module_prune_heads(m, pr, 1));
    const int64_t bad[2] = {0, 4};
    CHECK_FAILS(mha_module_prune_heads(m, bad, 2), MHA_ERR_INVALID_ARG);
    CHECK(strstr(mha_last_error(), "heads[1] = 4") != NULL);
    CHECK_FAILS(mha_module_prune_heads(m, pr, -1), MHA_ERR_INVALID_ARG);
    CHECK_FAILS(mha_module_prune_heads(m, NULL, 2), MHA_ERR_INVALID_ARG);
    CHECK(mha_module_num_pruned(m) == 1 && mha_module_head_pruned(m, 3));
    mha_module_destroy(m);
    mha_module_destroy(gz);
}

// One random configuration: fused vs reference, forward, weights and every
// gradient, with gates and a pruned set.
static void random_case(int id) {
    const int64_t H = irand(1, 6);
    int64_t divs[6], nd = 0;
    for (int64_t k = 1; k <= H; k++)
        if (H % k == 0) divs[nd++] = k;
    const int64_t Hkv = divs[next() % (uint64_t)nd], G = H / Hkv;
    const int64_t d = irand(1, 12), E = H * d, L = irand(1, 90), S = irand(1, 90),
                  N = irand(1, 3);
    const bool causal = next() & 1, drop = next() % 4 == 0, need = next() & 1,
               avg = next() & 1, bkv = next() % 3 == 0, kpm = next() % 3 == 0;
    mha_config c;
    mha_config_init(&c, E, H);
    c.num_kv_heads = Hkv;
    c.head_gate = (mha_head_gate)(next() % 3);
    c.add_bias_kv = bkv;
    c.dropout = drop ? 0.25f : 0.0f;
    if (next() % 3 == 0) c.kdim = irand(1, 16);
    mha_module *m = new_module(&c, (uint64_t)id);
    // pruned: none, random heads, a whole KV group, or every head
    int64_t pr[6], np = 0;
    const int kind = (int)(next() % 4);
    for (int64_t h = 0; h < H; h++)
        if ((kind == 1 && next() % 3 == 0) || (kind == 2 && h / G == Hkv - 1) || kind == 3)
            pr[np++] = h;
    CHECK_OK(mha_module_prune_heads(m, pr, np));
    const int64_t kd = mha_module_config(m)->kdim;
    const bool self = kd == E && S == L && next() % 2 == 0;
    test_inputs ti;
    test_inputs_make(&ti, L, S, N, E, kd, E, 4);
    mha_forward_args a;
    test_inputs_args(&a, &ti, self);
    a.opts.is_causal = causal;
    a.need_weights = need;
    a.average_attn_weights = avg;
    a.training = drop;
    a.opts.dropout_seed = (uint64_t)id * 17 + 3;
    if (kpm) a.key_padding_mask = &ti.kpt;
    char desc[200];
    snprintf(desc, sizeof desc,
             "case %d (E %lld H %lld Hkv %lld L %lld S %lld N %lld gate %s pruned %lld kind %d "
             "causal %d drop %d bkv %d kpm %d self %d)",
             id, (long long)E, (long long)H, (long long)Hkv, (long long)L, (long long)S,
             (long long)N, mha_head_gate_name(c.head_gate), (long long)np, kind, causal, drop,
             bkv, kpm, self);
    mha_module *g1 = NULL;  // the fused backward's gradients
    check_fused_vs_ref(&g1, m, &a, &ti.gyt, false, !self, desc);
    // a pruned head's W_Q rows get no gradient (packed or separate)
    mha_param gqp;
    if (mha_module_param(&gqp, g1, "in_proj_weight") != MHA_OK)
        CHECK_OK(mha_module_param(&gqp, g1, "q_proj_weight"));
    double pz = 0;
    const int64_t in = gqp.shape[1];
    for (int64_t i = 0; i < np; i++)
        for (int64_t r = pr[i] * d; r < (pr[i] + 1) * d; r++)
            pz = fmax(pz, max_abs(gqp.data + r * in, in));
    CHECKF(pz == 0.0, "%s: pruned heads' W_Q gradient %g", desc, pz);
    mha_module_destroy(g1);
    test_inputs_free(&ti);
    mha_module_destroy(m);
}

// 1, 2 and 8 threads: the same bits (forward and every gradient), both
// backward routes (2 heads: 8 threads take the two-pass route).
static void test_threads(void) {
    for (int gate = 1; gate <= 2; gate++) {
        enum { E = 32, H = 2, L = 200, N = 1 };
        mha_config c;
        mha_config_init(&c, E, H);
        c.head_gate = (mha_head_gate)gate;
        mha_module *m = new_module(&c, 11);
        static float x[L * N * E];
        for (int i = 0; i < L * N * E; i++) x[i] = frand();
        mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 3, (int64_t[]){L, N, E});
        mha_forward_args a;
        mha_forward_args_init(&a);
        a.query = a.key = a.value = &xt;
        a.opts.is_causal = true;
        a.impl = MHA_IMPL_FUSED;
        char desc[32];
        snprintf(desc, sizeof desc, "gate %d", gate);
        check_threads_bits(m, &a, &xt, false, desc);  // dY = x
        mha_module_destroy(m);
    }
}

// mha_forward_cached (token by token) with dynamic gates and a pruned head
// equals the causal forward.
static void test_cached(void) {
    enum { E = 24, H = 3, T = 21, N = 2 };
    mha_config c;
    mha_config_init(&c, E, H);
    c.head_gate = MHA_GATE_DYNAMIC;
    mha_module *m = new_module(&c, 4);
    const int64_t pr = 1;
    CHECK_OK(mha_module_prune_heads(m, &pr, 1));
    static float x[T * N * E], y0[T * N * E], y1[T * N * E];
    for (int i = 0; i < T * N * E; i++) x[i] = frand();
    fwd(y0, NULL, m, x, T, N, MHA_IMPL_FUSED, true);
    mha_kv_cache *cache = NULL;
    CHECK_OK(mha_kv_cache_create(&cache, N, H, E / H, E / H, T, MHA_KV_F32));
    for (int t = 0; t < T; t++) {
        mha_tensor qc = mha_tensor_contiguous(x + t * N * E, MHA_F32, 3, (int64_t[]){1, N, E});
        mha_tensor oc = mha_tensor_contiguous(y1 + t * N * E, MHA_F32, 3, (int64_t[]){1, N, E});
        mha_forward_args a;
        mha_forward_args_init(&a);
        a.query = a.key = a.value = &qc;
        CHECK_OK(mha_forward_cached(&oc, m, &a, cache));
    }
    double e = rel_err(y0, y1, T * N * E);
    CHECKF(e < 2e-5, "cached decode with gates and pruning vs causal forward: %g", e);
    mha_kv_cache_destroy(cache);
    mha_module_destroy(m);
}

// Save and load: the gate tensors and the pruned set come back; convert
// keeps them; malformed gate files and bad configs are refused.
static void test_io(void) {
    const char *dir = getenv("MHA_TEST_TMPDIR");
    char path[512];
    snprintf(path, sizeof path, "%s/gates.safetensors", dir ? dir : "/tmp");
    for (int gate = 1; gate <= 2; gate++) {
        mha_config c;
        mha_config_init(&c, 16, 4);
        c.head_gate = (mha_head_gate)gate;
        mha_module *m = new_module(&c, 2), *r = NULL, *cv = NULL;
        const int64_t pr[2] = {0, 2};
        CHECK_OK(mha_module_prune_heads(m, pr, 2));
        CHECK_OK(mha_module_save(m, path));
        mha_st_file *f = NULL;
        CHECK_OK(mha_st_open(&f, path));
        CHECK_OK(mha_module_load(&r, f, NULL));
        mha_st_close(f);
        if (!r) continue;
        CHECK(mha_module_config(r)->head_gate == (mha_head_gate)gate);
        CHECK(mha_module_num_pruned(r) == 2 && mha_module_head_pruned(r, 0) &&
              mha_module_head_pruned(r, 2));
        for (int i = 0; i < mha_module_num_params(m); i++) {
            mha_param a, b;
            CHECK_OK(mha_module_param_at(&a, m, i));
            CHECK_OK(mha_module_param(&b, r, a.name));
            CHECKF(memcmp(a.data, b.data, sizeof(float) * (size_t)a.numel) == 0,
                   "%s round trip", a.name);
        }
        CHECK_OK(mha_module_convert(&cv, m, MHA_BF16));
        CHECK(cv && mha_module_head_pruned(cv, 2) && mha_module_num_pruned(cv) == 2);
        mha_param gp;
        CHECK_OK(mha_module_param(&gp, cv, gate == 1 ? "head_gate" : "gate_proj.weight"));
        CHECK(gp.dtype == MHA_F32);  // gates stay float32
        // a half-weight module runs gated and pruned
        static float x[5 * 16], y0[5 * 16], y1[5 * 16];
        for (int i = 0; i < 5 * 16; i++) x[i] = frand();
        fwd(y0, NULL, cv, x, 5, 1, MHA_IMPL_REFERENCE, false);
        fwd(y1, NULL, cv, x, 5, 1, MHA_IMPL_FUSED, false);
        CHECK(rel_err(y0, y1, 5 * 16) < 2e-5);
        mha_module_destroy(cv);
        mha_module_destroy(r);
        mha_module_destroy(m);
    }
    // gate_proj.weight without gate_proj.bias
    mha_st_writer *w = NULL;
    static float buf[3 * 16 * 16];
    CHECK_OK(mha_st_writer_create(&w));
    CHECK_OK(mha_st_writer_add(w, "in_proj_weight", MHA_F32, 2, (int64_t[]){48, 16}, buf));
    CHECK_OK(mha_st_writer_add(w, "out_proj.weight", MHA_F32, 2, (int64_t[]){16, 16}, buf));
    CHECK_OK(mha_st_writer_add(w, "gate_proj.weight", MHA_F32, 2, (int64_t[]){4, 16}, buf));
    CHECK_OK(mha_st_writer_set_metadata(w, "num_heads", "4"));
    CHECK_OK(mha_st_writer_save(w, path));
    mha_st_writer_destroy(w);
    mha_st_file *f = NULL;
    mha_module *r = NULL;
    CHECK_OK(mha_st_open(&f, path));
    CHECK_FAILS(mha_module_load(&r, f, NULL), MHA_ERR_FORMAT);
    CHECK(strstr(mha_last_error(), "gate_proj.bias") != NULL);
    mha_st_close(f);
    // a bad pruned_heads list
    CHECK_OK(mha_st_writer_create(&w));
    CHECK_OK(mha_st_writer_add(w, "in_proj_weight", MHA_F32, 2, (int64_t[]){48, 16}, buf));
    CHECK_OK(mha_st_writer_add(w, "out_proj.weight", MHA_F32, 2, (int64_t[]){16, 16}, buf));
    CHECK_OK(mha_st_writer_set_metadata(w, "num_heads", "4"));
    CHECK_OK(mha_st_writer_set_metadata(w, "pruned_heads", "1,9"));
    CHECK_OK(mha_st_writer_save(w, path));
    mha_st_writer_destroy(w);
    CHECK_OK(mha_st_open(&f, path));
    CHECK_FAILS(mha_module_load(&r, f, NULL), MHA_ERR_FORMAT);
    CHECK(strstr(mha_last_error(), "pruned_heads") != NULL);
    mha_st_close(f);
    // bad config; a gradient module with another gate kind
    mha_config c;
    mha_config_init(&c, 16, 4);
    c.head_gate = (mha_head_gate)7;
    CHECK_FAILS(mha_module_create(&r, &c), MHA_ERR_INVALID_ARG);
    mha_head_gate hg;
    CHECK_OK(mha_head_gate_from_name(&hg, "dynamic"));
    CHECK(hg == MHA_GATE_DYNAMIC);
    CHECK_FAILS(mha_head_gate_from_name(&hg, "sometimes"), MHA_ERR_INVALID_ARG);
    c.head_gate = MHA_GATE_STATIC;
    mha_module *m = new_module(&c, 1), *g = NULL;
    c.head_gate = MHA_GATE_NONE;
    CHECK_OK(mha_module_create(&g, &c));
    static float x[3 * 16], gx[3 * 16];
    mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 2, (int64_t[]){3, 16});
    mha_tensor gt = mha_tensor_contiguous(gx, MHA_F32, 2, (int64_t[]){3, 16});
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = a.key = a.value = &xt;
    CHECK_FAILS(mha_backward(&gt, NULL, NULL, g, m, &a, &xt, false), MHA_ERR_INVALID_ARG);
    CHECK(strstr(mha_last_error(), "head_gate") != NULL);
    mha_module_destroy(g);
    mha_module_destroy(m);
}

// mha_diag_create reports the pruned flag and each head's gate (static: the
// parameter; dynamic: the mean of the sigmoid over the query rows).
static void test_diag(void) {
    enum { E = 16, H = 4, L = 9, N = 2 };
    static float x[L * N * E];
    for (int i = 0; i < L * N * E; i++) x[i] = frand();
    mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 3, (int64_t[]){L, N, E});
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = a.key = a.value = &xt;
    for (int gate = 0; gate <= 2; gate++) {
        mha_config c;
        mha_config_init(&c, E, H);
        c.head_gate = (mha_head_gate)gate;
        mha_module *m = new_module(&c, 8);
        const int64_t pr = 2;
        CHECK_OK(mha_module_prune_heads(m, &pr, 1));
        mha_diag *d = NULL;
        CHECK_OK(mha_diag_create(&d, m, &a, NULL));
        if (!d) continue;
        for (int h = 0; h < H; h++) {
            const mha_head_diag *hd = mha_diag_head(d, h);
            CHECK(hd->pruned == (h == 2));
            double want = 1.0;
            if (gate == MHA_GATE_STATIC) want = param(m, "head_gate")[h];
            if (gate == MHA_GATE_DYNAMIC) {
                const float *wg = param(m, "gate_proj.weight"),
                            *bg = param(m, "gate_proj.bias");
                want = 0;
                for (int r = 0; r < L * N; r++) {
                    double z = bg[h];
                    for (int e = 0; e < E; e++) z += (double)wg[h * E + e] * x[r * E + e];
                    want += 1.0 / (1.0 + exp(-z));
                }
                want /= L * N;
            }
            CHECKF(fabs(hd->gate_mean - want) < 1e-12,
                   "gate %d head %d: gate_mean %g, want %g", gate, h, hd->gate_mean, want);
        }
        mha_diag_destroy(d);
        mha_module_destroy(m);
    }
}

int main(void) {
    seed_rng(606);
    test_static_known();
    test_dynamic_known();
    test_prune_known();
    for (int id = 0; id < 150; id++) random_case(id);
    test_threads();
    test_cached();
    test_io();
    test_diag();
    return check_summary("test_gates");
}
