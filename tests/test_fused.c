// test_fused.c: the fused forward (MHA_IMPL_FUSED) against the reference on
// random configurations (layouts, strided views, masks, causal, appended
// keys, dropout, need_weights), and bit-identical results with 1, 2 and 8
// threads. ctest runs it once per ISA (MHA_ISA=scalar|avx2|avx512).
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "check.h"
#include "util.h"
#include "mha.h"


// A module of config c with PyTorch's default initialisation (seed 0).
static mha_module *new_module(const mha_config *c) { return torch_module(c, 0); }

// One random configuration: fused vs reference. Returns the error ratio.
static void one_case(int id) {
    const int64_t H = irand(1, 4), d = irand(1, 24), E = H * d;
    const int64_t L = irand(1, 150), S = irand(1, 150), N = irand(1, 3);
    const bool bf = next() & 1, unb = next() % 4 == 0, bkv = next() % 3 == 0,
               zero = next() % 3 == 0, causal = next() & 1, drop = next() % 4 == 0,
               need = next() & 1, avg = next() & 1, strided = next() % 3 == 0;
    const int am_kind = (int)(next() % 3), kpm_kind = (int)(next() % 3);
    mha_config c;
    mha_config_init(&c, E, H);
    c.batch_first = bf;
    c.add_bias_kv = bkv;
    c.add_zero_attn = zero;
    c.dropout = drop ? 0.25f : 0.0f;
    if (next() % 3 == 0) c.kdim = irand(1, 20);
    mha_module *m = NULL;
    CHECK_OK(mha_module_create(&m, &c));
    mha_init_options io;
    mha_init_options_init(&io);
    io.seed = (uint64_t)id;
    CHECK_OK(mha_module_init(m, &io));
    const int64_t kd = mha_module_config(m)->kdim, nb = unb ? 1 : N;
    const int64_t pad = strided ? 3 : 0;  // extra features: a strided view
    float *q = malloc(sizeof(float) * (size_t)(L * nb * (E + pad)));
    float *k = malloc(sizeof(float) * (size_t)(S * nb * (kd + pad)));
    float *v = malloc(sizeof(float) * (size_t)(S * nb * (E + pad)));
    for (int64_t i = 0; i < L * nb * (E + pad); i++) q[i] = frand();
    for (int64_t i = 0; i < S * nb * (kd + pad); i++) k[i] = frand();
    for (int64_t i = 0; i < S * nb * (E + pad); i++) v[i] = frand();
    bool self = !strided && kd == E && S == L && next() % 2 == 0;
    if (self) memcpy(k, q, sizeof(float) * (size_t)(L * nb * E));
    mha_tensor qt, kt, vt;
#define VIEW(t, p, T, F)                                          \
    do {                                                          \
        int64_t sh3[3] = {bf ? nb : T, bf ? T : nb, F};           \
        int64_t sh2[2] = {T, F};                                  \
        t = unb ? mha_tensor_contiguous(p, MHA_F32, 2, sh2)       \
                : mha_tensor_contiguous(p, MHA_F32, 3, sh3);      \
        if (pad) { /* rows of F + pad floats, the first F used */ \
            if (unb) t.stride[0] = F + pad;                       \
            else {                                                \
                t.stride[1] = F + pad;                            \
                t.stride[0] = sh3[1] * (F + pad);                 \
            }                                                     \
        }                                                         \
    } while (0)
    VIEW(qt, q, L, E);
    VIEW(kt, self ? q : k, S, kd);
    VIEW(vt, self ? q : v, S, E);
    const int64_t Sp = S + bkv + zero;
    uint8_t *bm = malloc((size_t)(nb * H * L * S));
    float *fm = malloc(sizeof(float) * (size_t)(nb * H * L * S));
    uint8_t *bk = malloc((size_t)(nb * S));
    for (int64_t i = 0; i < nb * H * L * S; i++) {
        bm[i] = next() % 5 == 0;
        fm[i] = next() % 7 == 0 ? -INFINITY : frand();
    }
    for (int64_t i = 0; i < nb * S; i++) bk[i] = next() % 4 == 0;
    mha_tensor amt, kpt;
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = &qt;
    a.key = &kt;
    a.value = &vt;
    a.opts.is_causal = causal;
    a.need_weights = need;
    a.average_attn_weights = avg;
    a.training = drop;
    a.opts.dropout_seed = (uint64_t)id * 7919;
    if (next() % 3 == 0) {  // a sliding window
        static const int64_t wl[5] = {-1, 0, 1, 5, 40}, wr[4] = {-1, 0, 3, 64};
        a.opts.window_left = wl[next() % 5];
        a.opts.window_right = wr[next() % 4];
    }
    if (need && next() % 3 == 0) {  // a block of the weights
        a.weights_head_begin = irand(0, H - 1);
        a.weights_head_end = irand(a.weights_head_begin + 1, H);
        a.weights_row_begin = irand(0, L);
        a.weights_row_end = next() & 1 ? -1 : irand(a.weights_row_begin, L);
    }
    if (am_kind) {
        amt = next() & 1 ? mha_tensor_contiguous(am_kind == 1 ? (void *)bm : (void *)fm,
                                                 am_kind == 1 ? MHA_BOOL : MHA_F32, 2,
                                                 (int64_t[]){L, S})
                         : mha_tensor_contiguous(am_kind == 1 ? (void *)bm : (void *)fm,
                                                 am_kind == 1 ? MHA_BOOL : MHA_F32, 3,
                                                 (int64_t[]){nb * H, L, S});
        a.attn_mask = &amt;
    }
    if (kpm_kind) {
        kpt = unb ? mha_tensor_contiguous(kpm_kind == 1 ? (void *)bk : (void *)fm,
                                          kpm_kind == 1 ? MHA_BOOL : MHA_F32, 1, (int64_t[]){S})
                  : mha_tensor_contiguous(kpm_kind == 1 ? (void *)bk : (void *)fm,
                                          kpm_kind == 1 ? MHA_BOOL : MHA_F32, 2,
                                          (int64_t[]){nb, S});
        a.key_padding_mask = &kpt;
    }
    mha_shape os, wsh;
    CHECK_OK(mha_forward_shapes(&os, &wsh, m, &a));
    int64_t on = 1, wn = 1;
    for (int i = 0; i < os.ndim; i++) on *= os.dims[i];
    for (int i = 0; i < wsh.ndim; i++) wn *= wsh.dims[i];
    float *y1 = malloc(sizeof(float) * (size_t)on), *y2 = malloc(sizeof(float) * (size_t)on);
    float *w1 = malloc(sizeof(float) * (size_t)wn), *w2 = malloc(sizeof(float) * (size_t)wn);
    mha_tensor y1t = mha_tensor_contiguous(y1, MHA_F32, os.ndim, os.dims);
    mha_tensor y2t = mha_tensor_contiguous(y2, MHA_F32, os.ndim, os.dims);
    mha_tensor w1t = mha_tensor_contiguous(w1, MHA_F32, wsh.ndim, wsh.dims);
    mha_tensor w2t = mha_tensor_contiguous(w2, MHA_F32, wsh.ndim, wsh.dims);
    a.impl = MHA_IMPL_REFERENCE;
    CHECK_OK(mha_forward(&y1t, need ? &w1t : NULL, m, &a));
    a.impl = MHA_IMPL_FUSED;
    CHECK_OK(mha_forward(&y2t, need ? &w2t : NULL, m, &a));
    double e = 0;
    for (int64_t i = 0; i < on; i++) e = fmax(e, fabs((double)y1[i] - y2[i]));
    double tol = 2e-5 * (1 + max_abs(y1, on));
    CHECKF(e <= tol,
           "case %d (E %lld H %lld L %lld S %lld N %lld bf %d unb %d bkv %d zero %d "
           "causal %d window (%lld, %lld) drop %d am %d kpm %d strided %d self %d): output "
           "err %g tol %g",
           id, (long long)E, (long long)H, (long long)L, (long long)S, (long long)N, bf, unb,
           bkv, zero, causal, (long long)a.opts.window_left, (long long)a.opts.window_right,
           drop, am_kind, kpm_kind, strided, self, e, tol);
    if (need) {
        double ew = 0;
        for (int64_t i = 0; i < wn; i++) ew = fmax(ew, fabs((double)w1[i] - w2[i]));
        double wtol = 2e-5 * (1 + max_abs(w1, wn));
        CHECKF(ew <= wtol, "case %d: weights err %g tol %g", id, ew, wtol);
    }
    (void)Sp;
    free(q);
    free(k);
    free(v);
    free(bm);
    free(fm);
    free(bk);
    free(y1);
    free(y2);
    free(w1);
    free(w2);
    mha_module_destroy(m);
}

// Long sequences with sliding windows (tiles outside the band skipped):
// fused forward, weights and backward against the reference.
static void test_windows(void) {
    enum { E = 32, H = 2, L = 700, N = 1 };
    static const int64_t win[][2] = {{0, 0},    {100, -1},  {-1, 50},
                                     {37, 200}, {300, 300}, {5, 0}};
    mha_config c;
    mha_config_init(&c, E, H);
    mha_module *m = new_module(&c);
    float *x = malloc(sizeof(float) * L * E), *gy = malloc(sizeof(float) * L * E);
    float *y[2], *w[2], *gx[2];
    for (int r = 0; r < 2; r++) {
        y[r] = malloc(sizeof(float) * L * E);
        w[r] = malloc(sizeof(float) * H * L * L);
        gx[r] = malloc(sizeof(float) * L * E);
    }
    for (int i = 0; i < L * E; i++) x[i] = 2.0f * frand(), gy[i] = frand();
    mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 3, (int64_t[]){L, N, E});
    mha_tensor gyt = mha_tensor_contiguous(gy, MHA_F32, 3, (int64_t[]){L, N, E});
    for (size_t t = 0; t < sizeof win / sizeof win[0]; t++)
        for (int causal = 0; causal < 2; causal++) {
            mha_forward_args a;
            mha_forward_args_init(&a);
            a.query = a.key = a.value = &xt;
            a.opts.is_causal = causal;
            a.opts.window_left = win[t][0];
            a.opts.window_right = win[t][1];
            a.need_weights = true;
            a.average_attn_weights = false;
            mha_module *g[2];
            for (int r = 0; r < 2; r++) {
                a.impl = r ? MHA_IMPL_FUSED : MHA_IMPL_REFERENCE;
                mha_tensor yt = mha_tensor_contiguous(y[r], MHA_F32, 3, (int64_t[]){L, N, E});
                mha_tensor wt = mha_tensor_contiguous(w[r], MHA_F32, 4, (int64_t[]){N, H, L, L});
                mha_tensor gt = mha_tensor_contiguous(gx[r], MHA_F32, 3, (int64_t[]){L, N, E});
                CHECK_OK(mha_forward(&yt, &wt, m, &a));
                CHECK_OK(mha_module_create(&g[r], mha_module_config(m)));
                CHECK_OK(mha_backward(&gt, NULL, NULL, g[r], m, &a, &gyt, false));
            }
            CHECKF(rel_err(y[0], y[1], L * E) < 2e-5, "window (%lld, %lld) causal %d: output",
                   (long long)win[t][0], (long long)win[t][1], causal);
            CHECKF(rel_err(w[0], w[1], H * L * L) < 2e-5,
                   "window (%lld, %lld) causal %d: weights", (long long)win[t][0],
                   (long long)win[t][1], causal);
            // the band itself: every weight outside it is exactly 0
            int64_t outside = 0;
            for (int64_t h = 0; h < H; h++)
                for (int64_t i = 0; i < L; i++)
                    for (int64_t j = 0; j < L; j++) {
                        bool vis = !(causal && j > i) &&
                                   !(win[t][0] >= 0 && j < i - win[t][0]) &&
                                   !(win[t][1] >= 0 && j > i + win[t][1]);
                        if (!vis && w[1][(h * L + i) * L + j] != 0.0f) outside++;
                    }
            CHECKF(outside == 0, "window (%lld, %lld) causal %d: %lld weights outside the band",
                   (long long)win[t][0], (long long)win[t][1], causal, (long long)outside);
            CHECKF(rel_err(gx[0], gx[1], L * E) < 1e-4,
                   "window (%lld, %lld) causal %d: grad_query %g", (long long)win[t][0],
                   (long long)win[t][1], causal, rel_err(gx[0], gx[1], L * E));
            for (int i = 0; i < mha_module_num_params(g[0]); i++) {
                mha_param p0, p1;
                CHECK_OK(mha_module_param_at(&p0, g[0], i));
                CHECK_OK(mha_module_param_at(&p1, g[1], i));
                double e = rel_err(p0.data, p1.data, p0.numel);
                CHECKF(e < 1e-4, "window (%lld, %lld) causal %d: grad %s %g",
                       (long long)win[t][0], (long long)win[t][1], causal, p0.name, e);
            }
            mha_module_destroy(g[0]);
            mha_module_destroy(g[1]);
        }
    for (int r = 0; r < 2; r++) free(y[r]), free(w[r]), free(gx[r]);
    free(x);
    free(gy);
    mha_module_destroy(m);
}

// A block of the weights is bit for bit that block of the full weights
// (fused), and its average the mean over the block's heads.
static void test_weights_block(void) {
    enum { E = 48, H = 4, L = 300, N = 2 };
    mha_config c;
    mha_config_init(&c, E, H);
    mha_module *m = new_module(&c);
    static float x[L * N * E], y[L * N * E], wf[N * H * L * L], wb[N * H * L * L];
    for (int i = 0; i < L * N * E; i++) x[i] = frand();
    mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 3, (int64_t[]){L, N, E});
    mha_tensor yt = mha_tensor_contiguous(y, MHA_F32, 3, (int64_t[]){L, N, E});
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = a.key = a.value = &xt;
    a.opts.is_causal = true;
    a.need_weights = true;
    a.average_attn_weights = false;
    a.impl = MHA_IMPL_FUSED;
    mha_tensor wft = mha_tensor_contiguous(wf, MHA_F32, 4, (int64_t[]){N, H, L, L});
    CHECK_OK(mha_forward(&yt, &wft, m, &a));
    const int64_t h0 = 1, h1 = 3, r0 = 70, r1 = 201;
    a.weights_head_begin = h0, a.weights_head_end = h1;
    a.weights_row_begin = r0, a.weights_row_end = r1;
    mha_shape ws;
    CHECK_OK(mha_forward_shapes(NULL, &ws, m, &a));
    CHECK(ws.ndim == 4 && ws.dims[0] == N && ws.dims[1] == h1 - h0 && ws.dims[2] == r1 - r0 &&
          ws.dims[3] == L);
    mha_tensor wbt = mha_tensor_contiguous(wb, MHA_F32, 4, ws.dims);
    CHECK_OK(mha_forward(&yt, &wbt, m, &a));
    int64_t diff = 0;
    for (int64_t b = 0; b < N; b++)
        for (int64_t h = h0; h < h1; h++)
            for (int64_t i = r0; i < r1; i++)
                for (int64_t j = 0; j < L; j++)
                    diff += wb[((b * (h1 - h0) + h - h0) * (r1 - r0) + i - r0) * L + j] !=
                            wf[((b * H + h) * L + i) * L + j];
    CHECKF(diff == 0, "weights block: %lld elements differ from the full weights",
           (long long)diff);
    a.average_attn_weights = true;
    CHECK_OK(mha_forward_shapes(NULL, &ws, m, &a));
    CHECK(ws.ndim == 3 && ws.dims[0] == N && ws.dims[1] == r1 - r0 && ws.dims[2] == L);
    wbt = mha_tensor_contiguous(wb, MHA_F32, 3, ws.dims);
    CHECK_OK(mha_forward(&yt, &wbt, m, &a));
    double e = 0;
    for (int64_t b = 0; b < N; b++)
        for (int64_t i = r0; i < r1; i++)
            for (int64_t j = 0; j < L; j++) {
                double s = 0;
                for (int64_t h = h0; h < h1; h++) s += wf[((b * H + h) * L + i) * L + j];
                e = fmax(e, fabs(s / (h1 - h0) - wb[(b * (r1 - r0) + i - r0) * L + j]));
            }
    CHECKF(e < 1e-6, "averaged weights block: err %g", e);
    // errors: bad blocks name the values
    a.weights_head_begin = 3, a.weights_head_end = 2;
    CHECK(mha_forward_shapes(NULL, &ws, m, &a) == MHA_ERR_INVALID_ARG);
    a.weights_head_begin = 0, a.weights_head_end = -1;
    a.weights_row_end = L + 1;
    CHECK(mha_forward_shapes(NULL, &ws, m, &a) == MHA_ERR_INVALID_ARG);
    a.weights_row_end = -1;
    a.opts.window_left = -2;
    CHECK(mha_forward_shapes(NULL, &ws, m, &a) == MHA_ERR_INVALID_ARG);
    mha_module_destroy(m);
}

// mha_sdpa fused against the reference: head views with row padding,
// Dv != D, broadcast masks, key padding, causal, windows, custom scale.
static void test_sdpa(void) {
    for (int id = 0; id < 60; id++) {
        const int64_t B = irand(1, 2), H = irand(1, 3), L = irand(1, 300), S = irand(1, 300),
                      D = irand(1, 40), Dv = irand(1, 40), pad = irand(0, 3);
        const int64_t nq = B * H * L * (D + pad), nk = B * H * S * (D + pad),
                      nv = B * H * S * (Dv + pad), no = B * H * L * Dv;
        float *q = malloc(sizeof(float) * (size_t)nq), *k = malloc(sizeof(float) * (size_t)nk),
              *v = malloc(sizeof(float) * (size_t)nv), *o[2], *w[2];
        for (int64_t i = 0; i < nq; i++) q[i] = 2.0f * frand();
        for (int64_t i = 0; i < nk; i++) k[i] = 2.0f * frand();
        for (int64_t i = 0; i < nv; i++) v[i] = frand();
        for (int r = 0; r < 2; r++) {
            o[r] = malloc(sizeof(float) * (size_t)no);
            w[r] = malloc(sizeof(float) * (size_t)(B * H * L * S));
        }
        mha_tensor qt = mha_tensor_contiguous(q, MHA_F32, 4, (int64_t[]){B, H, L, D + pad});
        mha_tensor kt = mha_tensor_contiguous(k, MHA_F32, 4, (int64_t[]){B, H, S, D + pad});
        mha_tensor vt = mha_tensor_contiguous(v, MHA_F32, 4, (int64_t[]){B, H, S, Dv + pad});
        qt.shape[3] = kt.shape[3] = D;  // rows padded: strided head views
        vt.shape[3] = Dv;
        float *am = malloc(sizeof(float) * (size_t)(L * S));
        uint8_t *kp = malloc((size_t)(B * S));
        for (int64_t i = 0; i < L * S; i++) am[i] = next() % 6 == 0 ? -INFINITY : frand();
        for (int64_t i = 0; i < B * S; i++) kp[i] = next() % 5 == 0;
        mha_tensor amt = mha_tensor_contiguous(am, MHA_F32, 3, (int64_t[]){1, L, S});
        mha_tensor kpt = mha_tensor_contiguous(kp, MHA_BOOL, 2, (int64_t[]){B, S});
        mha_sdpa_args a;
        mha_sdpa_args_init(&a);
        a.q = &qt, a.k = &kt, a.v = &vt;
        a.opts.is_causal = next() & 1;
        if (next() % 2) a.opts.window_left = irand(0, 100);
        if (next() % 3 == 0) a.opts.window_right = irand(0, 100);
        if (next() % 3 == 0) a.attn_mask = &amt;
        if (next() % 3 == 0) a.key_padding_mask = &kpt;
        if (next() % 3 == 0) a.opts.scale = 0.5 + frand();
        for (int r = 0; r < 2; r++) {
            mha_tensor ot = mha_tensor_contiguous(o[r], MHA_F32, 4, (int64_t[]){B, H, L, Dv});
            mha_tensor wt = mha_tensor_contiguous(w[r], MHA_F32, 4, (int64_t[]){B, H, L, S});
            a.impl = r ? MHA_IMPL_FUSED : MHA_IMPL_REFERENCE;
            CHECK_OK(mha_sdpa(&ot, &wt, &a));
        }
        double eo = rel_err(o[0], o[1], no), ew = rel_err(w[0], w[1], B * H * L * S);
        CHECKF(eo < 2e-5 && ew < 2e-5,
               "sdpa %d (B %lld H %lld L %lld S %lld D %lld Dv %lld causal %d window (%lld, "
               "%lld) mask %d kpm %d): out err %g, weights err %g",
               id, (long long)B, (long long)H, (long long)L, (long long)S, (long long)D,
               (long long)Dv, a.opts.is_causal, (long long)a.opts.window_left,
               (long long)a.opts.window_right, a.attn_mask != NULL, a.key_padding_mask != NULL,
               eo, ew);
        for (int r = 0; r < 2; r++) free(o[r]), free(w[r]);
        free(q), free(k), free(v), free(am), free(kp);
    }
}

// A saved training forward (args.save): the backward that uses it gives
// the very bits of the recomputing one; mismatched args are refused.
static void test_saved_cfg(int64_t Hkv) {
    enum { E = 64, H = 4, L = 150, S = 130, N = 2 };
    for (int packed = 0; packed < 2; packed++) {
        mha_config c;
        mha_config_init(&c, E, H);
        c.num_kv_heads = Hkv;  // 0: H
        c.dropout = 0.2f;
        c.add_bias_kv = !packed;
        c.kdim = packed ? E : 40;
        mha_module *m = new_module(&c);
        const int64_t Sx = packed ? L : S, kd = c.kdim;
        float *x = malloc(sizeof(float) * L * N * E), *kx = malloc(sizeof(float) * Sx * N * kd),
              *vx = malloc(sizeof(float) * Sx * N * E), *gy = malloc(sizeof(float) * L * N * E),
              *y = malloc(sizeof(float) * L * N * E), *g[2][3];
        for (int r = 0; r < 2; r++) {
            g[r][0] = malloc(sizeof(float) * L * N * E);
            g[r][1] = malloc(sizeof(float) * Sx * N * kd);
            g[r][2] = malloc(sizeof(float) * Sx * N * E);
        }
        for (int64_t i = 0; i < L * N * E; i++) x[i] = frand(), gy[i] = frand();
        for (int64_t i = 0; i < Sx * N * kd; i++) kx[i] = frand();
        for (int64_t i = 0; i < Sx * N * E; i++) vx[i] = frand();
        mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 3, (int64_t[]){L, N, E});
        mha_tensor kt = mha_tensor_contiguous(kx, MHA_F32, 3, (int64_t[]){Sx, N, kd});
        mha_tensor vt = mha_tensor_contiguous(vx, MHA_F32, 3, (int64_t[]){Sx, N, E});
        mha_tensor yt = mha_tensor_contiguous(y, MHA_F32, 3, (int64_t[]){L, N, E});
        mha_tensor gyt = mha_tensor_contiguous(gy, MHA_F32, 3, (int64_t[]){L, N, E});
        mha_forward_args a;
        mha_forward_args_init(&a);
        a.query = &xt;
        a.key = packed ? &xt : &kt;
        a.value = packed ? &xt : &vt;
        a.opts.is_causal = true;
        a.opts.window_left = 70;
        a.training = true;
        a.opts.dropout_seed = 11;
        a.impl = MHA_IMPL_FUSED;
        mha_saved *sv = NULL;
        CHECK_OK(mha_saved_create(&sv));
        mha_module *gr[2];
        for (int r = 0; r < 2; r++) {
            a.save = r ? sv : NULL;
            CHECK_OK(mha_forward(&yt, NULL, m, &a));
            CHECK_OK(mha_module_create(&gr[r], mha_module_config(m)));
            mha_tensor gq = mha_tensor_contiguous(g[r][0], MHA_F32, 3, (int64_t[]){L, N, E});
            mha_tensor gk = mha_tensor_contiguous(g[r][1], MHA_F32, 3, (int64_t[]){Sx, N, kd});
            mha_tensor gv = mha_tensor_contiguous(g[r][2], MHA_F32, 3, (int64_t[]){Sx, N, E});
            CHECK_OK(mha_backward(&gq, &gk, &gv, gr[r], m, &a, &gyt, false));
        }
        CHECK(mha_saved_bytes(sv) >= sizeof(float) * (size_t)(L * N * E * 2));
        CHECKF(memcmp(g[0][0], g[1][0], sizeof(float) * L * N * E) == 0 &&
                   memcmp(g[0][1], g[1][1], sizeof(float) * Sx * N * kd) == 0 &&
                   memcmp(g[0][2], g[1][2], sizeof(float) * Sx * N * E) == 0,
               "saved forward (packed %d, kv heads %lld): input gradients differ from the "
               "recomputing backward",
               packed, (long long)Hkv);
        for (int i = 0; i < mha_module_num_params(gr[0]); i++) {
            mha_param p0, p1;
            CHECK_OK(mha_module_param_at(&p0, gr[0], i));
            CHECK_OK(mha_module_param_at(&p1, gr[1], i));
            CHECKF(memcmp(p0.data, p1.data, (size_t)p0.numel * 4) == 0,
                   "saved forward (packed %d, kv heads %lld): grad %s differs", packed,
                   (long long)Hkv, p0.name);
        }
        // other args than the forward's: refused, with a message
        a.opts.dropout_offset = 1;
        mha_tensor gq = mha_tensor_contiguous(g[1][0], MHA_F32, 3, (int64_t[]){L, N, E});
        CHECK(mha_backward(&gq, NULL, NULL, NULL, m, &a, &gyt, false) == MHA_ERR_INVALID_ARG);
        CHECK(strstr(mha_last_error(), "save") != NULL);
        a.opts.dropout_offset = 0;  // RoPE, ALiBi or a soft cap other than the forward's too
        a.rope.mode = MHA_ROPE_NEOX;
        CHECK(mha_backward(&gq, NULL, NULL, NULL, m, &a, &gyt, false) == MHA_ERR_INVALID_ARG);
        a.rope.mode = MHA_ROPE_NONE;
        a.opts.alibi = true;
        CHECK(mha_backward(&gq, NULL, NULL, NULL, m, &a, &gyt, false) == MHA_ERR_INVALID_ARG);
        a.opts.alibi = false;
        a.opts.softcap = 5.0f;
        CHECK(mha_backward(&gq, NULL, NULL, NULL, m, &a, &gyt, false) == MHA_ERR_INVALID_ARG);
        a.opts.softcap = 0.0f;
        CHECK_OK(mha_backward(&gq, NULL, NULL, NULL, m, &a, &gyt, false));  // the same again
        // the reference path keeps nothing: its backward recomputes
        a.impl = MHA_IMPL_REFERENCE;
        CHECK_OK(mha_forward(&yt, NULL, m, &a));
        CHECK_OK(mha_backward(&gq, NULL, NULL, NULL, m, &a, &gyt, false));
        mha_saved_destroy(sv);
        for (int r = 0; r < 2; r++) {
            mha_module_destroy(gr[r]);
            for (int j = 0; j < 3; j++) free(g[r][j]);
        }
        free(x), free(kx), free(vx), free(gy), free(y);
        mha_module_destroy(m);
    }
}

// bfloat16 / float16 views (storage; computation in float32, or double in
// the reference): the result is exactly that of float32 views holding the
// same (rounded) values, rounded once more into the half output; the same
// for the weights and the input gradients. Both implementations.
static void test_half(void) {
    enum { E = 32, H = 4, L = 90, N = 2 };
    mha_config c;
    mha_config_init(&c, E, H);
    mha_module *m = new_module(&c);
    static uint16_t xh[L * N * E], yh[L * N * E], wh[N * L * L], gh[L * N * E], dh[L * N * E];
    static float xf[L * N * E], yf[L * N * E], wf[N * L * L], gf[L * N * E], df[L * N * E];
    const mha_dtype types[2] = {MHA_BF16, MHA_F16};
    for (int ti = 0; ti < 2; ti++)
        for (int impl = 1; impl <= 2; impl++) {
            const bool bf = types[ti] == MHA_BF16;
            for (int i = 0; i < L * N * E; i++) {
                xh[i] = bf ? mha_f32_to_bf16(frand()) : mha_f32_to_f16(frand());
                xf[i] = bf ? mha_bf16_to_f32(xh[i]) : mha_f16_to_f32(xh[i]);
                gh[i] = bf ? mha_f32_to_bf16(frand()) : mha_f32_to_f16(frand());
                gf[i] = bf ? mha_bf16_to_f32(gh[i]) : mha_f16_to_f32(gh[i]);
            }
            const int64_t sh[3] = {L, N, E}, ws[3] = {N, L, L};
            mha_tensor xht = mha_tensor_contiguous(xh, types[ti], 3, sh),
                       yht = mha_tensor_contiguous(yh, types[ti], 3, sh),
                       wht = mha_tensor_contiguous(wh, types[ti], 3, ws),
                       ght = mha_tensor_contiguous(gh, types[ti], 3, sh),
                       dht = mha_tensor_contiguous(dh, types[ti], 3, sh);
            mha_tensor xft = mha_tensor_contiguous(xf, MHA_F32, 3, sh),
                       yft = mha_tensor_contiguous(yf, MHA_F32, 3, sh),
                       wft = mha_tensor_contiguous(wf, MHA_F32, 3, ws),
                       gft = mha_tensor_contiguous(gf, MHA_F32, 3, sh),
                       dft = mha_tensor_contiguous(df, MHA_F32, 3, sh);
            mha_forward_args a;
            mha_forward_args_init(&a);
            a.opts.is_causal = true;
            a.need_weights = true;
            a.impl = (mha_impl)impl;
            a.query = a.key = a.value = &xht;
            CHECK_OK(mha_forward(&yht, &wht, m, &a));
            CHECK_OK(mha_backward(&dht, NULL, NULL, NULL, m, &a, &ght, false));
            a.query = a.key = a.value = &xft;
            CHECK_OK(mha_forward(&yft, &wft, m, &a));
            CHECK_OK(mha_backward(&dft, NULL, NULL, NULL, m, &a, &gft, false));
            int bad = 0;
            for (int i = 0; i < L * N * E; i++) {
                bad += yh[i] != (bf ? mha_f32_to_bf16(yf[i]) : mha_f32_to_f16(yf[i]));
                bad += dh[i] != (bf ? mha_f32_to_bf16(df[i]) : mha_f32_to_f16(df[i]));
            }
            for (int i = 0; i < N * L * L; i++)
                bad += wh[i] != (bf ? mha_f32_to_bf16(wf[i]) : mha_f32_to_f16(wf[i]));
            CHECKF(bad == 0,
                   "%s views, impl %d: %d values differ from the float32 run "
                   "rounded",
                   bf ? "bf16" : "f16", impl, bad);
        }
    mha_module_destroy(m);
}

// int8 attention weights (MHA_U8 view + weights_scale): every row within
// half its scale of the float32 weights, scale = max / 255; per head and
// averaged, a block and all, both implementations; misuse refused.
static void test_weights_u8(void) {
    enum { E = 32, H = 4, L = 150, N = 2 };
    mha_config c;
    mha_config_init(&c, E, H);
    mha_module *m = new_module(&c);
    static float x[L * N * E], y[L * N * E], wf[N * H * L * L], sc[N * H * L];
    static uint8_t wq[N * H * L * L];
    for (int i = 0; i < L * N * E; i++) x[i] = 2.0f * frand();
    mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 3, (int64_t[]){L, N, E});
    mha_tensor yt = mha_tensor_contiguous(y, MHA_F32, 3, (int64_t[]){L, N, E});
    for (int impl = 1; impl <= 2; impl++)
        for (int avg = 0; avg < 2; avg++)
            for (int block = 0; block < 2; block++) {
                mha_forward_args a;
                mha_forward_args_init(&a);
                a.query = a.key = a.value = &xt;
                a.opts.is_causal = true;
                a.need_weights = true;
                a.average_attn_weights = avg;
                a.impl = (mha_impl)impl;
                if (block) {
                    a.weights_head_begin = 1, a.weights_head_end = 3;
                    a.weights_row_begin = 20, a.weights_row_end = 99;
                }
                mha_shape ws;
                CHECK_OK(mha_forward_shapes(NULL, &ws, m, &a));
                int64_t rows = 1;
                for (int i = 0; i < ws.ndim - 1; i++) rows *= ws.dims[i];
                const int64_t S = ws.dims[ws.ndim - 1];
                mha_tensor wft = mha_tensor_contiguous(wf, MHA_F32, ws.ndim, ws.dims);
                mha_tensor wqt = mha_tensor_contiguous(wq, MHA_U8, ws.ndim, ws.dims);
                CHECK_OK(mha_forward(&yt, &wft, m, &a));
                CHECK(mha_forward(&yt, &wqt, m, &a) == MHA_ERR_INVALID_ARG);  // no scales
                a.weights_scale = sc;
                CHECK(mha_forward(&yt, &wft, m, &a) == MHA_ERR_INVALID_ARG);  // scales, F32
                CHECK_OK(mha_forward(&yt, &wqt, m, &a));
                int64_t bad = 0;
                for (int64_t r = 0; r < rows; r++) {
                    float mx = 0.0f;
                    for (int64_t j = 0; j < S; j++) mx = fmaxf(mx, wf[r * S + j]);
                    bad += fabsf(sc[r] - mx / 255.0f) > 1e-6f * mx + 1e-12f;
                    for (int64_t j = 0; j < S; j++)
                        bad += fabs((double)sc[r] * wq[r * S + j] - wf[r * S + j]) >
                               0.5 * sc[r] * (1 + 1e-5) + 1e-7;
                }
                CHECKF(bad == 0,
                       "int8 weights (impl %d avg %d block %d): %lld values or "
                       "scales off",
                       impl, avg, block, (long long)bad);
            }
    mha_module_destroy(m);
}

// 1, 2 and 8 threads: bit-identical output, weights and gradients.
// With 2 heads, 8 threads take the backward's two-pass route and 1 or 2
// threads the one-sweep-per-head route: the same bits are required.
// Grouped-query attention (Hkv KV heads): the routes are chosen by the
// number of KV heads (N Hkv >= threads: one sweep per KV head).
static void test_threads_cfg(int64_t E, int64_t H, int64_t L, int64_t N, bool bkv, int64_t Hkv);

static void test_threads(void) {
    test_threads_cfg(96, 4, 200, 2, false, 0);
    test_threads_cfg(64, 2, 300, 1, true, 0);
}

static void test_threads_gqa(void) {
    test_threads_cfg(96, 4, 200, 2, true, 2);   // 4 KV-head items: both routes
    test_threads_cfg(96, 6, 260, 1, true, 1);   // multi-query: 1 item
    test_threads_cfg(64, 8, 300, 1, false, 4);  // 4 items: 8 threads two-pass
}

static void test_threads_cfg(int64_t E, int64_t H, int64_t L, int64_t N, bool bkv, int64_t Hkv) {
    mha_config c;
    mha_config_init(&c, E, H);
    c.add_bias_kv = bkv;
    c.num_kv_heads = Hkv;
    mha_module *m = new_module(&c);
    float *x = malloc(sizeof(float) * (size_t)(L * N * E));
    for (int64_t i = 0; i < L * N * E; i++) x[i] = frand();
    mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 3, (int64_t[]){L, N, E});
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = a.key = a.value = &xt;
    a.opts.is_causal = true;
    a.opts.window_left = 150;  // tiles outside the band skipped in some rows
    a.need_weights = true;
    a.impl = MHA_IMPL_FUSED;
    char desc[64];
    snprintf(desc, sizeof desc, "fused (H %lld Hkv %lld)", (long long)H, (long long)Hkv);
    check_threads_bits(m, &a, &xt, false, desc);  // dY = x
    free(x);
    mha_module_destroy(m);
}

// ---------------------------------------------------------------------------
// The random cases of gqa_case and layout_case: their inputs, drawn in one
// order, with the arguments they share; the comparison is
// check_fused_vs_ref (util.h).

// What a case's inputs and shared arguments depend on: the sizes (query and
// output gradient (L, nb, E), key and value (S, nb, kdim or vdim of the
// module), nb = 1 when unb, else N; H heads), the layout (unb: (T, F); bf:
// (nb, T, F); else (T, nb, F)) and the call's flags.
typedef struct case_shape {
    int64_t E, H, L, S, N;
    bool unb, bf, self, causal, need, avg, drop, kpm, am;
    uint64_t dropout_seed;
} case_shape;

// A case's inputs: test_inputs (a key padding mask hiding about one key in
// four) in the case's layout, then a float mask (nb * H, L, S) with about
// one -inf in seven; a: the arguments every case shares, pointing into the
// struct (not to be copied).
typedef struct case_inputs {
    test_inputs t;
    float *fm;
    mha_tensor amt;
    int64_t nb, kd, vd;
    mha_forward_args a;
} case_inputs;

static mha_tensor case_view(float *p, const case_shape *s, int64_t nb, int64_t T, int64_t F) {
    return s->unb ? mha_tensor_contiguous(p, MHA_F32, 2, (int64_t[]){T, F})
                  : mha_tensor_contiguous(p, MHA_F32, 3,
                                          (int64_t[]){s->bf ? nb : T, s->bf ? T : nb, F});
}

// Draws the inputs of case s for module m into in, and sets in->a: the
// query, key and value (the query alone when s->self), causal, weights,
// dropout, masks.
static void case_inputs_make(case_inputs *in, const case_shape *s, const mha_module *m) {
    test_inputs *t = &in->t;
    const int64_t nb = in->nb = s->unb ? 1 : s->N, L = s->L, S = s->S, H = s->H;
    in->kd = mha_module_config(m)->kdim, in->vd = mha_module_config(m)->vdim;
    test_inputs_make(t, L, S, nb, s->E, in->kd, in->vd, 4);
    t->qt = case_view(t->q, s, nb, L, s->E);
    t->kt = case_view(t->k, s, nb, S, in->kd);
    t->vt = case_view(t->v, s, nb, S, in->vd);
    t->gyt = case_view(t->gy, s, nb, L, s->E);
    if (s->unb) t->kpt = mha_tensor_contiguous(t->kpm, MHA_BOOL, 1, (int64_t[]){S});
    in->fm = malloc(sizeof(float) * (size_t)(nb * H * L * S));
    for (int64_t i = 0; i < nb * H * L * S; i++)
        in->fm[i] = next() % 7 == 0 ? -INFINITY : frand();
    in->amt = mha_tensor_contiguous(in->fm, MHA_F32, 3, (int64_t[]){nb * H, L, S});
    mha_forward_args *a = &in->a;
    test_inputs_args(a, t, s->self);
    a->opts.is_causal = s->causal;
    a->need_weights = s->need;
    a->average_attn_weights = s->avg;
    a->training = s->drop;
    a->opts.dropout_seed = s->dropout_seed;
    if (s->kpm) a->key_padding_mask = &t->kpt;
    if (s->am) a->attn_mask = &in->amt;
}

static void case_inputs_free(case_inputs *in) {
    test_inputs_free(&in->t);
    free(in->fm);
}

// ---------------------------------------------------------------------------
// Grouped-query / multi-query attention (num_kv_heads < num_heads): the
// fused forward and backward against the reference on random
// configurations (run after the tests above, so their random streams are
// unchanged).

static void gqa_case(int id) {
    const int64_t H = irand(1, 6);
    int64_t divs[6], nd = 0;
    for (int64_t k = 1; k < H; k++)
        if (H % k == 0) divs[nd++] = k;
    const int64_t Hkv = nd ? divs[next() % (uint64_t)nd] : 1;  // < H unless H = 1
    const int64_t d = irand(1, 16), E = H * d, L = irand(1, 140), S = irand(1, 140),
                  N = irand(1, 3);
    const bool bf = next() & 1, unb = next() % 4 == 0, bkv = next() % 3 == 0,
               zero = next() % 3 == 0, causal = next() & 1, drop = next() % 4 == 0,
               need = next() & 1, avg = next() & 1, kpm = next() % 3 == 0, am = next() % 3 == 0;
    mha_config c;
    mha_config_init(&c, E, H);
    c.num_kv_heads = Hkv;
    c.batch_first = bf;
    c.add_bias_kv = bkv;
    c.add_zero_attn = zero;
    c.dropout = drop ? 0.25f : 0.0f;
    if (next() % 3 == 0) c.kdim = irand(1, 20);
    if (next() % 4 == 0) c.vdim = irand(1, 20);
    mha_module *m = torch_module(&c, (uint64_t)id + 1000);
    if (bkv) {  // bias_k/bias_v of unit size (the init's are ~1/sqrt(Ekv))
        mha_param pk;
        CHECK_OK(mha_module_param(&pk, m, "bias_k"));
        CHECK(pk.shape[2] == Hkv * d);
    }
    const mha_config *mc = mha_module_config(m);
    const bool self = mc->kdim == E && mc->vdim == E && S == L && next() % 2 == 0;
    const case_shape cs = {
        E, H, L, S, N, unb, bf, self, causal, need, avg, drop, kpm, am, (uint64_t)id * 31 + 5};
    case_inputs in;
    case_inputs_make(&in, &cs, m);
    if (next() % 3 == 0) in.a.opts.window_left = irand(0, 40);
    char desc[256];
    snprintf(desc, sizeof desc,
             "gqa case %d (E %lld H %lld Hkv %lld L %lld S %lld N %lld kdim %lld vdim %lld bf %d "
             "unb %d bkv %d zero %d causal %d window %lld drop %d kpm %d am %d self %d)",
             id, (long long)E, (long long)H, (long long)Hkv, (long long)L, (long long)S,
             (long long)N, (long long)in.kd, (long long)in.vd, bf, unb, bkv, zero, causal,
             (long long)in.a.opts.window_left, drop, kpm, am, self);
    check_fused_vs_ref(NULL, m, &in.a, &in.t.gyt, false, true, desc);
    case_inputs_free(&in);
    mha_module_destroy(m);
}

// mha_forward_cached over the self-attention input xt (T, N, E), fed to a
// fresh cache (Hkv heads of dim d) in chunks of 1, 8 and 22 tokens up to
// max_chunk (decode and prefill), with a's options (not causal: the cache
// is) into y1 (T, N, E): the causal forward's y0 within 2e-5. desc names the
// case in the messages.
static void check_cached_chunks(const mha_module *m, const mha_forward_args *a,
                                const mha_tensor *xt, const float *y0, float *y1, int64_t Hkv,
                                int64_t d, int max_chunk, const char *desc) {
    const int64_t T = xt->shape[0], N = xt->shape[1], E = xt->shape[2];
    const float *x = xt->data;
    for (int chunk = 1; chunk <= max_chunk; chunk += chunk == 1 ? 7 : 14) {
        mha_kv_cache *cache = NULL;
        CHECK_OK(mha_kv_cache_create(&cache, N, Hkv, d, d, T, MHA_KV_F32));
        for (int64_t t0 = 0; t0 < T; t0 += chunk) {
            const int64_t n = T - t0 < chunk ? T - t0 : chunk;
            mha_tensor qc = mha_tensor_contiguous((float *)x + t0 * N * E, MHA_F32, 3,
                                                  (int64_t[]){n, N, E});
            mha_tensor oc = mha_tensor_contiguous(y1 + t0 * N * E, MHA_F32, 3,
                                                  (int64_t[]){n, N, E});
            mha_forward_args ac = *a;
            ac.query = ac.key = ac.value = &qc;
            ac.opts.is_causal = false;
            CHECK_OK(mha_forward_cached(&oc, m, &ac, cache));
        }
        double e = rel_err(y0, y1, T * N * E);
        CHECKF(e < 2e-5, "%s (chunk %d): err %g", desc, chunk, e);
        mha_kv_cache_destroy(cache);
    }
}

// mha_forward_cached with grouped-query attention: a cache of num_kv_heads
// heads, token by token and in chunks, gives the causal forward's result;
// a cache with num_heads KV heads is refused.
static void test_cached_gqa(void) {
    enum { E = 48, H = 6, HKV = 2, T = 37, N = 2 };
    mha_config c;
    mha_config_init(&c, E, H);
    c.num_kv_heads = HKV;
    mha_module *m = new_module(&c);
    static float x[T * N * E], y0[T * N * E], y1[T * N * E];
    for (int i = 0; i < T * N * E; i++) x[i] = frand();
    mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 3, (int64_t[]){T, N, E});
    mha_tensor yt = mha_tensor_contiguous(y0, MHA_F32, 3, (int64_t[]){T, N, E});
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = a.key = a.value = &xt;
    a.opts.is_causal = true;
    a.impl = MHA_IMPL_FUSED;
    CHECK_OK(mha_forward(&yt, NULL, m, &a));
    check_cached_chunks(m, &a, &xt, y0, y1, HKV, E / H, 8, "cached gqa");
    mha_kv_cache *bad = NULL;
    CHECK_OK(mha_kv_cache_create(&bad, N, H, E / H, E / H, T, MHA_KV_F32));
    mha_forward_args ac;
    mha_forward_args_init(&ac);
    ac.query = ac.key = ac.value = &xt;
    CHECK(mha_forward_cached(&yt, m, &ac, bad) == MHA_ERR_SHAPE);
    mha_kv_cache_destroy(bad);
    mha_module_destroy(m);
}

// The layouts of real checkpoints (issue 17): head_dim != E / H (with and
// without grouped-query attention; E need not be a multiple of H), separate
// q/k/v matrices with kdim = vdim = E, no out_proj.bias, a custom query
// scale, combined with masks, causal, windows, RoPE, ALiBi, the soft cap,
// dropout, gates, pruning and half weights: the fused forward, weights and
// backward against the reference on random configurations (run last, so
// the other tests' random streams are unchanged). Half weights: forward
// only (the backward refuses them).
static void layout_case(int id, mha_qk_norm qkn) {
    const int64_t H = irand(1, 6);
    int64_t divs[6], nd = 0;
    for (int64_t k = 1; k <= H; k++)
        if (H % k == 0) divs[nd++] = k;
    const int64_t Hkv = divs[next() % (uint64_t)nd];
    const bool rope = next() % 3 == 0;
    const int64_t d = rope ? 2 * irand(1, 6) : irand(1, 12);
    const int64_t E = next() % 5 == 0 ? H * d : irand(1, 40), L = irand(1, 90), N = irand(1, 3);
    const bool bf = next() & 1, unb = next() % 4 == 0, bkv = next() % 4 == 0,
               zero = next() % 4 == 0, causal = next() & 1, drop = next() % 4 == 0,
               need = next() & 1, avg = next() & 1, kpm = next() % 3 == 0, am = next() % 3 == 0,
               sep = next() & 1, bias = next() % 4 != 0, nob = bias && (next() & 1),
               scale = next() & 1, alibi = next() % 4 == 0, cap = next() % 4 == 0,
               prune = next() % 4 == 0, half = next() % 5 == 0, self = next() % 2 == 0;
    const int gate = (int)(next() % 3);
    const bool sinks = next() % 3 == 0;
    const int64_t S = self ? L : irand(1, 90);
    mha_config c;
    mha_config_init(&c, E, H);
    c.sinks = sinks;  // attention sinks (random logits: random_module)
    c.head_dim = d;
    c.num_kv_heads = Hkv;
    c.separate_qkv = sep;
    c.bias = bias;
    c.no_out_bias = nob;
    c.batch_first = bf;
    c.add_bias_kv = bkv;
    c.add_zero_attn = zero;
    c.head_gate = (mha_head_gate)gate;
    c.dropout = drop ? 0.25f : 0.0f;
    if (!self && next() % 3 == 0) c.kdim = irand(1, 20);
    if (!self && next() % 4 == 0) c.vdim = irand(1, 20);
    c.qk_norm = qkn;  // (no draw: the cases without it are unchanged)
    c.qk_norm_eps = id % 3 == 0 ? 0.25f : 0.0f;
    mha_module *m = random_module(&c, (uint64_t)id + 5000);
    if (prune) {
        const int64_t pr = irand(0, H - 1);
        CHECK_OK(mha_module_prune_heads(m, &pr, 1));
    }
    if (half) m = module_as(m, next() & 1 ? MHA_BF16 : MHA_F16);  // its matrices rounded
    CHECK(mha_module_config(m)->head_dim == d);
    const case_shape cs = {
        E, H, L, S, N, unb, bf, self, causal, need, avg, drop, kpm, am, (uint64_t)id * 17 + 3};
    case_inputs in;
    case_inputs_make(&in, &cs, m);
    if (next() % 3 == 0) in.a.opts.window_left = irand(0, 30);
    if (next() % 4 == 0) in.a.opts.window_right = irand(0, 30);
    if (scale) in.a.opts.scale = 0.05 + 0.5 * (frand() + 1.0);
    if (rope) {
        mha_rope_init(&in.a.rope, next() & 1 ? MHA_ROPE_NEOX : MHA_ROPE_INTERLEAVED);
        if (next() & 1) in.a.rope.dim = 2 * irand(1, d / 2);
    }
    in.a.opts.alibi = alibi;
    if (cap) in.a.opts.softcap = 3.0f;
    char desc[320];
    snprintf(desc, sizeof desc,
             "layout case %d (E %lld H %lld Hkv %lld d %lld L %lld S %lld N %lld kdim %lld "
             "vdim %lld sep %d bias %d no_out_bias %d scale %g bf %d unb %d bkv %d zero %d "
             "causal %d window (%lld, %lld) drop %d kpm %d am %d self %d rope %d alibi %d "
             "softcap %d gate %d prune %d half %d sinks %d qk_norm %d)",
             id, (long long)E, (long long)H, (long long)Hkv, (long long)d, (long long)L,
             (long long)S, (long long)N, (long long)in.kd, (long long)in.vd, sep, bias, nob,
             scale ? in.a.opts.scale : 0.0, bf, unb, bkv, zero, causal,
             (long long)in.a.opts.window_left, (long long)in.a.opts.window_right, drop, kpm,
             am, self, rope, alibi, cap, gate, prune, half, sinks, (int)qkn);
    check_fused_vs_ref(NULL, m, &in.a, &in.t.gyt, half, true, desc);
    case_inputs_free(&in);
    mha_module_destroy(m);
}

// mha_forward_cached with the checkpoint layouts (head_dim != E / H with
// GQA, separate q/k/v, no out_proj.bias, a custom scale; RoPE, ALiBi, the
// soft cap, gates, half weights): token by token and in chunks it gives the
// fused causal forward's result; a forward with save and its backward give
// the recomputing backward's bits; another scale than the saved forward's
// is refused.
static void test_cached_layouts(void) {
    enum { T = 29, N = 2 };
    for (int cfg = 0; cfg < 6; cfg++) {
        const int64_t E = 20 + 3 * cfg, H = 4,
                      Hkv = cfg % 3 == 0   ? 1
                            : cfg % 3 == 1 ? 2
                                           : 4,
                      d = 6 + 2 * (cfg % 2);
        mha_config c;
        mha_config_init(&c, E, H);
        c.head_dim = d;
        c.num_kv_heads = Hkv;
        c.separate_qkv = cfg & 1;
        c.no_out_bias = cfg % 3 != 2;
        c.head_gate = (mha_head_gate)(cfg % 3);
        c.sinks = cfg % 2 == 0;
        mha_module *m = random_module(&c, 77 + (uint64_t)cfg);
        if (cfg == 4) m = module_as(m, MHA_BF16);
        float *x = malloc(sizeof(float) * T * N * E), *y0 = malloc(sizeof(float) * T * N * E),
              *y1 = malloc(sizeof(float) * T * N * E);
        for (int i = 0; i < T * N * E; i++) x[i] = frand();
        mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 3, (int64_t[]){T, N, E});
        mha_tensor yt = mha_tensor_contiguous(y0, MHA_F32, 3, (int64_t[]){T, N, E});
        mha_forward_args a;
        mha_forward_args_init(&a);
        a.query = a.key = a.value = &xt;
        a.opts.is_causal = true;
        a.impl = MHA_IMPL_FUSED;
        if (cfg != 2) a.opts.scale = 0.11 * (cfg + 1);
        if (cfg % 2 == 0) mha_rope_init(&a.rope, MHA_ROPE_NEOX);
        a.opts.alibi = cfg == 3;
        a.opts.softcap = cfg == 5 ? 4.0f : 0.0f;
        CHECK_OK(mha_forward(&yt, NULL, m, &a));
        char desc[64];
        snprintf(desc, sizeof desc, "cached layout %d", cfg);
        check_cached_chunks(m, &a, &xt, y0, y1, Hkv, d, 22, desc);
        if (cfg != 4) {  // the saved state (float32 weights)
            float *gy = malloc(sizeof(float) * T * N * E),
                  *g = malloc(sizeof(float) * T * N * E);
            for (int i = 0; i < T * N * E; i++) gy[i] = frand();
            mha_tensor gyt = mha_tensor_contiguous(gy, MHA_F32, 3, (int64_t[]){T, N, E});
            mha_saved *sv = NULL;
            CHECK_OK(mha_saved_create(&sv));
            snprintf(desc, sizeof desc, "saved layout %d", cfg);
            check_saved_bits(m, &a, &gyt, sv, false, desc);
            mha_tensor gq = mha_tensor_contiguous(g, MHA_F32, 3, (int64_t[]){T, N, E});
            a.save = sv;
            a.opts.scale = 0.9;  // another scale than the saved forward's
            CHECK_FAILS(mha_backward(&gq, NULL, NULL, NULL, m, &a, &gyt, false),
                        MHA_ERR_INVALID_ARG);
            a.save = NULL;
            free(g), free(gy);
            mha_saved_destroy(sv);
        }
        free(x), free(y0), free(y1);
        mha_module_destroy(m);
    }
}

// The backward of a self-attention call a (x: n floats) of module m with
// the QK-norm: the fused path against the reference (check_fused_vs_ref:
// every input and parameter gradient, the norms' weights included); with a
// saved forward (check_saved_bits) and with 1, 2, 8 threads
// (check_threads_bits): the same bits; accumulating into its own result:
// exactly twice it.
static void qk_norm_backward(const mha_module *m, mha_forward_args *a, int64_t n, int cfg) {
    float *gy = malloc(sizeof(float) * (size_t)n), *gx[2][3];
    for (int64_t i = 0; i < n; i++) gy[i] = frand();
    const mha_tensor *x = a->query;
    mha_tensor gyt = mha_tensor_contiguous(gy, MHA_F32, x->ndim, x->shape);
    char desc[64];
    snprintf(desc, sizeof desc, "qk_norm %d", cfg);
    check_fused_vs_ref(NULL, m, a, &gyt, false, true, desc);  // (leaves a->impl fused)
    mha_saved *sv = NULL;
    CHECK_OK(mha_saved_create(&sv));
    check_saved_bits(m, a, &gyt, sv, true, desc);
    mha_saved_destroy(sv);
    check_threads_bits(m, a, &gyt, true, desc);
    // accumulate: a second backward adding to a copy of the first's results
    mha_module *g[2];
    mha_tensor gt[3];
    for (int j = 0; j < 3; j++) {
        gx[0][j] = malloc(sizeof(float) * (size_t)n);
        gx[1][j] = malloc(sizeof(float) * (size_t)n);
        gt[j] = mha_tensor_contiguous(gx[1][j], MHA_F32, x->ndim, x->shape);
    }
    backward_into(gx[0], &g[0], m, a, &gyt, true);
    for (int j = 0; j < 3; j++) memcpy(gx[1][j], gx[0][j], sizeof(float) * (size_t)n);
    CHECK_OK(mha_module_create(&g[1], mha_module_config(m)));
    for (int i = 0; i < mha_module_num_params(g[1]); i++) {
        mha_param pd, ps;
        CHECK_OK(mha_module_param_at(&pd, g[1], i));
        CHECK_OK(mha_module_param_at(&ps, g[0], i));
        memcpy(pd.data, ps.data, sizeof(float) * (size_t)pd.numel);
    }
    CHECK_OK(mha_backward(&gt[0], &gt[1], &gt[2], g[1], m, a, &gyt, true));
    static const char *gn[3] = {"grad_query", "grad_key", "grad_value"};
    for (int j = 0; j < 3; j++) {
        bool twice = true;
        for (int64_t i = 0; i < n; i++) twice &= gx[1][j][i] == 2.0f * gx[0][j][i];
        CHECKF(twice, "%s: accumulated %s is not twice it", desc, gn[j]);
    }
    for (int i = 0; i < mha_module_num_params(g[0]); i++) {
        mha_param p0, p1;
        CHECK_OK(mha_module_param_at(&p0, g[0], i));
        CHECK_OK(mha_module_param_at(&p1, g[1], i));
        bool twice = true;
        for (int64_t k = 0; k < p0.numel; k++) twice &= p1.data[k] == 2.0f * p0.data[k];
        CHECKF(twice, "%s: accumulated grad %s is not twice it", desc, p0.name);
    }
    for (int r = 0; r < 2; r++) {
        for (int j = 0; j < 3; j++) free(gx[r][j]);
        mha_module_destroy(g[r]);
    }
    a->impl = MHA_IMPL_AUTO;
    free(gy);
}

// QK-norm (mha_config.qk_norm, per head and over all features, the
// default eps and a large one) with the checkpoint layouts, GQA, RoPE and
// half weights: the fused forward against the reference, auto taking it;
// the backward (qk_norm_backward); mha_forward_cached
// token by token and in chunks gives the reference forward's result;
// a fresh module's norm weights are 1 (and mha_module_init's); a save and
// load round trip gives the same config (qk_norm inferred, eps from base)
// and the same outputs.
static void test_qk_norm(void) {
    enum { T = 23, N = 2 };
    const char *dir = getenv("MHA_TEST_TMPDIR");
    char path[512];
    snprintf(path, sizeof path, "%s/test_fused_qk_norm_%ld.safetensors", dir ? dir : "/tmp",
             (long)getpid());  // (the per-ISA runs go side by side)
    for (int cfg = 0; cfg < 8; cfg++) {
        const int64_t H = cfg % 4 == 3 ? 1 : 4,
                      Hkv = H == 1         ? 1
                            : cfg % 3 == 0 ? 1
                                           : 2,
                      d = 4 + 2 * (cfg % 3), E = cfg == 5 ? H * d : 18 + cfg;
        mha_config c;
        mha_config_init(&c, E, H);
        c.head_dim = d;
        c.num_kv_heads = Hkv;
        c.separate_qkv = cfg % 4 == 1;
        c.bias = cfg != 6;
        c.qk_norm = cfg % 2 ? MHA_QK_NORM_ALL : MHA_QK_NORM_HEAD;
        c.qk_norm_eps = cfg % 3 == 2 ? 0.5f : 0.0f;
        c.sinks = cfg == 2;
        {  // the norms' weights start at 1: the module is created and initialised so
            mha_module *m0 = NULL;
            CHECK_OK(mha_module_create(&m0, &c));
            for (int pass = 0; pass < 2; pass++) {
                mha_param qn, kn;
                CHECK_OK(mha_module_param(&qn, m0, "q_norm.weight"));
                CHECK_OK(mha_module_param(&kn, m0, "k_norm.weight"));
                const bool all = c.qk_norm == MHA_QK_NORM_ALL;
                CHECK(qn.ndim == 1 && qn.shape[0] == (all ? H * d : d));
                CHECK(kn.ndim == 1 && kn.shape[0] == (all ? Hkv * d : d));
                bool ones = true;
                for (int64_t j = 0; j < qn.numel; j++) ones &= qn.data[j] == 1.0f;
                for (int64_t j = 0; j < kn.numel; j++) ones &= kn.data[j] == 1.0f;
                CHECKF(ones, "qk_norm %d: norm weights not 1 (pass %d)", cfg, pass);
                for (int64_t j = 0; j < qn.numel; j++) qn.data[j] = 3.0f;
                mha_init_options io;
                mha_init_options_init(&io);
                CHECK_OK(mha_module_init(m0, &io));
            }
            mha_module_destroy(m0);
        }
        mha_module *m = random_module(&c, 900 + (uint64_t)cfg);
        if (cfg == 7) m = module_as(m, MHA_BF16);
        float *x = malloc(sizeof(float) * T * N * E), *y0 = malloc(sizeof(float) * T * N * E),
              *y1 = malloc(sizeof(float) * T * N * E), *y2 = malloc(sizeof(float) * T * N * E);
        for (int i = 0; i < T * N * E; i++) x[i] = frand();
        mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 3, (int64_t[]){T, N, E});
        mha_tensor yt = mha_tensor_contiguous(y0, MHA_F32, 3, (int64_t[]){T, N, E});
        mha_tensor y2t = mha_tensor_contiguous(y2, MHA_F32, 3, (int64_t[]){T, N, E});
        mha_forward_args a;
        mha_forward_args_init(&a);
        a.query = a.key = a.value = &xt;
        a.opts.is_causal = true;
        if (cfg % 3 != 1)
            mha_rope_init(&a.rope, cfg & 1 ? MHA_ROPE_INTERLEAVED : MHA_ROPE_NEOX);
        a.impl = MHA_IMPL_REFERENCE;
        CHECK_OK(mha_forward(&yt, NULL, m, &a));
        a.impl = MHA_IMPL_FUSED;  // the fused forward against the reference
        CHECK_OK(mha_forward(&y2t, NULL, m, &a));
        const double ef = rel_err(y0, y2, T * N * E);
        CHECKF(ef < 2e-5, "qk_norm %d: fused forward err %g", cfg, ef);
        a.impl = MHA_IMPL_AUTO;  // auto takes the fused path, bit for bit
        mha_tensor y1t = mha_tensor_contiguous(y1, MHA_F32, 3, (int64_t[]){T, N, E});
        CHECK_OK(mha_forward(&y1t, NULL, m, &a));
        CHECKF(!memcmp(y1, y2, sizeof(float) * T * N * E), "qk_norm %d: auto != fused", cfg);
        if (cfg != 7) qk_norm_backward(m, &a, T * N * E, cfg);
        a.impl = MHA_IMPL_AUTO;
        char desc[64];
        snprintf(desc, sizeof desc, "cached qk_norm %d", cfg);
        check_cached_chunks(m, &a, &xt, y0, y1, Hkv, d, 22, desc);
        // save and load: qk_norm inferred from the tensors, eps from base
        CHECK_OK(mha_module_save(m, path));
        mha_st_file *f = NULL;
        CHECK_OK(mha_st_open(&f, path));
        mha_config base;
        mha_config_init(&base, 0, 0);
        base.qk_norm_eps = c.qk_norm_eps;
        mha_module *m2 = NULL;
        CHECK_OK(mha_module_load(&m2, f, &base));
        mha_st_close(f);
        const mha_config *c2 = mha_module_config(m2);
        CHECKF(c2->qk_norm == (H == 1 ? MHA_QK_NORM_HEAD : c.qk_norm) &&
                   c2->qk_norm_eps == c.qk_norm_eps,
               "qk_norm %d: loaded qk_norm %d eps %g", cfg, (int)c2->qk_norm,
               (double)c2->qk_norm_eps);
        a.impl = MHA_IMPL_REFERENCE;
        CHECK_OK(mha_forward(&y2t, NULL, m2, &a));
        CHECKF(!memcmp(y0, y2, sizeof(float) * T * N * E), "qk_norm %d: loaded module differs",
               cfg);
        a.impl = MHA_IMPL_AUTO;
        mha_module_destroy(m2);
        free(x), free(y0), free(y1), free(y2);
        mha_module_destroy(m);
    }
    remove(path);
}

// The int4 format of mha.h (mha_kv_dtype), written again here: row x (n)
// as it reads back (xq: s_g q_c) and its group scales (sc).
static void int4_row(float *xq, float *sc, const float *x, int64_t n) {
    for (int64_t g = 0; g * 32 < n; g++) {
        const int64_t c1 = g * 32 + 32 < n ? g * 32 + 32 : n;
        float mx = 0.0f;
        for (int64_t c = g * 32; c < c1; c++) mx = fmaxf(mx, fabsf(x[c]));
        sc[g] = mx > 0.0f ? mx / 7.0f : 1.0f;
        for (int64_t c = g * 32; c < c1; c++)
            xq[c] = sc[g] * fminf(7.0f, fmaxf(-7.0f, nearbyintf(x[c] / sc[g])));
    }
}

// The float64 attention of the query xd (D) over keys [lo, hi] of one
// head's rows kr, vr (D each), the scores divided by div: y (D); sc:
// scratch for the scores.
static void oracle_row_x(double *y, const double *xd, const float *kr, const float *vr,
                         int64_t lo, int64_t hi, int64_t D, double div, double *sc) {
    double m = -INFINITY, l = 0.0;
    for (int64_t j = lo; j <= hi; j++) {
        double dot = 0.0;
        for (int64_t e = 0; e < D; e++) dot += xd[e] * kr[j * D + e];
        sc[j] = dot / div;
        m = sc[j] > m ? sc[j] : m;
    }
    for (int64_t j = lo; j <= hi; j++) l += (sc[j] = exp(sc[j] - m));
    for (int64_t e = 0; e < D; e++) {
        y[e] = 0.0;
        for (int64_t j = lo; j <= hi; j++) y[e] += sc[j] * vr[j * D + e];
        y[e] /= l;
    }
}

// The same for query qr (D <= 128), scaled by 1 / sqrt(D).
static void oracle_row(double *y, const float *qr, const float *kr, const float *vr,
                       int64_t lo, int64_t hi, int64_t D, double *sc) {
    double xd[128];
    for (int64_t e = 0; e < D; e++) xd[e] = qr[e];
    oracle_row_x(y, xd, kr, vr, lo, hi, D, sqrt((double)D), sc);
}

// mha.h's int8 decode query: x = fl(q / sqrt(D)) as the cache scales it,
// xs = max|x| / 127, xq = round_even(x * (127 / max|x|)); xd = xs xq (the
// query the scores see) and *xs.
static void int8_query(double *xd, float *xs, const float *qr, int64_t D) {
    const float sc = (float)(1.0 / sqrt((double)D));
    float x[128], mx = 0.0f;
    for (int64_t e = 0; e < D; e++) x[e] = sc * qr[e], mx = fmaxf(mx, fabsf(x[e]));
    *xs = mx / 127.0f;
    const float inv = mx > 0.0f ? 127.0f / mx : 0.0f;
    for (int64_t e = 0; e < D; e++) xd[e] = (double)*xs * nearbyintf(x[e] * inv);
}

// mha.h's bound on an int8 decode's output error from its query's
// rounding alone (K and V exact here): per element c, (exp(2 max_j e_j) -
// 1) max_j |v_jc| with e_j = (xs / 2) sum_c |k_jc|.
static void int8_bound(double *bnd, float xs, const float *kr, const float *vr, int64_t lo,
                       int64_t hi, int64_t D) {
    double emax = 0.0;
    for (int64_t j = lo; j <= hi; j++) {
        double ej = 0.0;
        for (int64_t e = 0; e < D; e++) ej += xs / 2.0 * fabs((double)kr[j * D + e]);
        emax = fmax(emax, ej);
    }
    for (int64_t e = 0; e < D; e++) {
        double vm = 0.0;
        for (int64_t j = lo; j <= hi; j++) vm = fmax(vm, fabs((double)vr[j * D + e]));
        bnd[e] = expm1(2.0 * emax) * vm;
    }
}

// mha.h's bound on an int4 cache's output error for query qr over keys
// [lo, hi] (K, V rows kr, vr, their group scales ks, vs: ng a row), per
// element c: max_j s^V_j,g(c) / 2 + (exp(2 max_j e_j) - 1) max_j |v_jc| with
// e_j = sum_g (s^K_jg / 2) sum_{c in g} |x_c|, x = q / sqrt(D); plus, for
// a query rounded to int8 with scale xs (decode, D a multiple of 128; 0:
// not rounded), (xs / 2) sum_c |k^_jc| (kq: the stored keys).
static void int4_bound(double *bnd, const float *qr, const float *vr, const float *ks,
                       const float *vs, float xs, const float *kq, int64_t lo, int64_t hi,
                       int64_t D) {
    const int64_t ng = (D + 31) / 32;
    double emax = 0.0;
    for (int64_t j = lo; j <= hi; j++) {
        double ej = 0.0;
        for (int64_t e = 0; e < D; e++)
            ej += ks[j * ng + e / 32] / 2.0 * fabs((double)qr[e]) / sqrt((double)D) +
                  xs / 2.0 * fabs((double)kq[j * D + e]);
        emax = fmax(emax, ej);
    }
    for (int64_t e = 0; e < D; e++) {
        double sv = 0.0, vm = 0.0;
        for (int64_t j = lo; j <= hi; j++)
            sv = fmax(sv, vs[j * ng + e / 32] / 2.0),
            vm = fmax(vm, fabs((double)vr[j * D + e]));
        bnd[e] = sv + expm1(2.0 * emax) * vm;
    }
}

// Decode over a long cache, against a float64 oracle: B 2 sequences of
// different lengths (9000 keys: two or more split-KV chunks for every
// storage type, whose chunks hold 512 to 8192 keys; many row blocks), GQA groups
// G = H / Hkv of 1, 3 and 4, head dims 64, 40 (not a multiple of 16 or 32)
// and 128 (int8 and int4 only: their integer paths), 1 and 5 queries per
// sequence (the causal band moves within a
// block), no window and left windows of 300 and 2 (5 queries' bands
// apart), every storage type. K and V are k / 64
// with integer |k| <= 127 (each row's max 127): exact in bf16, f16 and
// int8 (scale 1/64), so the oracle reads the same numbers. int4 is checked
// twice: against the oracle over the values it stores (int4_row: the
// format written again), within the same tolerance, and against the oracle
// over the inputs, within mha.h's documented bound computed from the data
// (int4_bound). int8 decode rounds its query (mha.h): checked against the
// oracle over that query, within the same tolerance, and against the one
// over the float32 query within mha.h's bound from the data (int8_bound);
// so does int4 decode at head dim 128 (its oracle over the stored values
// takes the rounded query, its bound the query's term). And the same bits
// with 1, 2 and 8 threads.
static void test_decode_groups(void) {
    enum { B = 2, CAP = 9100, TMAX = 5 };
    const int64_t lens[B] = {9000, 517};
    const int64_t cfgs[][3] = {{4, 4, 64}, {12, 4, 40}, {8, 2, 64}, {8, 2, 128}};  // H, Hkv, D
    for (size_t ci = 0; ci < sizeof cfgs / sizeof cfgs[0]; ci++)
        for (int dt = MHA_KV_F32; dt <= MHA_KV_INT4; dt++)
            for (int T = 1; T <= TMAX; T += 4)
                for (int wi = 0; wi < 3; wi++) {
                    const int64_t H = cfgs[ci][0], Hkv = cfgs[ci][1], D = cfgs[ci][2];
                    const int64_t win = wi == 2 ? 2 : wi ? 300 : -1;
                    // (head dim 128: the int8 and int4 paths it selects only)
                    if (D == 128 && dt < MHA_KV_INT8) continue;
                    mha_kv_cache *c = NULL;
                    CHECK_OK(mha_kv_cache_create(&c, B, Hkv, D, D, CAP, (mha_kv_dtype)dt));
                    const size_t nkv = (size_t)(B * Hkv * CAP * D);
                    float *k = malloc(sizeof(float) * nkv), *v = malloc(sizeof(float) * nkv);
                    for (size_t r = 0; r < nkv / (size_t)D; r++)
                        for (int64_t e = 0; e < D; e++) {
                            const int64_t top = (int64_t)(r % (size_t)D);  // the row's 127
                            k[r * (size_t)D + (size_t)e] =
                                (float)(e == top ? 127 : irand(-127, 127)) / 64.0f;
                            v[r * (size_t)D + (size_t)e] =
                                (float)(e == (top + 1) % D ? -127 : irand(-127, 127)) / 64.0f;
                        }
                    mha_tensor kt = mha_tensor_contiguous(k, MHA_F32, 4,
                                                          (int64_t[]){B, Hkv, CAP, D}),
                               vt = mha_tensor_contiguous(v, MHA_F32, 4,
                                                          (int64_t[]){B, Hkv, CAP, D});
                    CHECK_OK(mha_kv_cache_append(c, &kt, &vt, lens));
                    // int4: the values stored, and their group scales
                    const int64_t ng = (D + 31) / 32;
                    float *kq = NULL, *vq = NULL, *ks = NULL, *vs = NULL;
                    if (dt == MHA_KV_INT4) {
                        kq = malloc(sizeof(float) * nkv), vq = malloc(sizeof(float) * nkv);
                        ks = malloc(sizeof(float) * (nkv / (size_t)D) * (size_t)ng);
                        vs = malloc(sizeof(float) * (nkv / (size_t)D) * (size_t)ng);
                        for (size_t r = 0; r < nkv / (size_t)D; r++) {
                            int4_row(kq + r * (size_t)D, ks + r * (size_t)ng,
                                     k + r * (size_t)D, D);
                            int4_row(vq + r * (size_t)D, vs + r * (size_t)ng,
                                     v + r * (size_t)D, D);
                        }
                    }
                    const size_t nq = (size_t)(B * H * T * D);
                    float *q = malloc(sizeof(float) * nq), *o[3];
                    for (size_t i = 0; i < nq; i++) q[i] = frand();
                    mha_tensor qt = mha_tensor_contiguous(q, MHA_F32, 4,
                                                          (int64_t[]){B, H, T, D});
                    mha_cache_attend_args a;
                    mha_cache_attend_args_init(&a);
                    a.opts.window_left = win;
                    const int threads[3] = {1, 2, 8};
                    for (int r = 0; r < 3; r++) {
                        o[r] = malloc(sizeof(float) * nq);
                        mha_tensor ot = mha_tensor_contiguous(o[r], MHA_F32, 4,
                                                              (int64_t[]){B, H, T, D});
#ifdef _OPENMP
                        omp_set_num_threads(threads[r]);
#endif
                        CHECK_OK(mha_kv_cache_attend(&ot, &qt, c, &a, NULL));
                    }
#ifdef _OPENMP
                    omp_set_num_threads(2);
#endif
                    double err = 0.0, mx = 0.0, over = 0.0, ratio = 0.0;
                    double *sc = malloc(sizeof(double) * CAP), y[128], yq[128], bnd[128];
                    for (int64_t b = 0; b < B; b++)
                        for (int64_t h = 0; h < H; h++)
                            for (int64_t t = 0; t < T; t++) {
                                const int64_t pos = lens[b] - T + t, hk = h / (H / Hkv);
                                const int64_t lo = win >= 0 && pos - win > 0 ? pos - win : 0;
                                const float *qr = q + ((b * H + h) * T + t) * D;
                                const size_t r0 = (size_t)((b * Hkv + hk) * CAP);
                                oracle_row(y, qr, k + r0 * (size_t)D, v + r0 * (size_t)D, lo,
                                           pos, D, sc);
                                if (dt == MHA_KV_INT8) {  // (K, V exact: the query's rounding)
                                    double xd[128];
                                    float xs;
                                    int8_query(xd, &xs, qr, D);
                                    oracle_row_x(yq, xd, k + r0 * (size_t)D,
                                                 v + r0 * (size_t)D, lo, pos, D, 1.0, sc);
                                    int8_bound(bnd, xs, k + r0 * (size_t)D, v + r0 * (size_t)D,
                                               lo, pos, D);
                                }
                                if (kq) {  // (D a multiple of 128: the query rounded too)
                                    double xd[128];
                                    float xs = 0.0f;
                                    if (D % 128 == 0) {
                                        int8_query(xd, &xs, qr, D);
                                        oracle_row_x(yq, xd, kq + r0 * (size_t)D,
                                                     vq + r0 * (size_t)D, lo, pos, D, 1.0, sc);
                                    } else
                                        oracle_row(yq, qr, kq + r0 * (size_t)D,
                                                   vq + r0 * (size_t)D, lo, pos, D, sc);
                                    int4_bound(bnd, qr, v + r0 * (size_t)D,
                                               ks + r0 * (size_t)ng, vs + r0 * (size_t)ng, xs,
                                               kq + r0 * (size_t)D, lo, pos, D);
                                }
                                for (int64_t e = 0; e < D; e++) {
                                    const double g = o[0][((b * H + h) * T + t) * D + e];
                                    const bool rq = kq || dt == MHA_KV_INT8;
                                    const double ye = rq ? yq[e] : y[e];
                                    err = fabs(g - ye) > err ? fabs(g - ye) : err;
                                    mx = fabs(ye) > mx ? fabs(ye) : mx;
                                    if (rq) {  // (the float32 rounding's share: the test's rule)
                                        const double d = fabs(g - y[e]);
                                        over = fmax(over,
                                                    d - bnd[e] - 4e-6 * (1.0 + fabs(y[e])));
                                        ratio = fmax(ratio, d / bnd[e]);
                                    }
                                }
                            }
                    const char *dn = mha_kv_dtype_name((mha_kv_dtype)dt);
                    if ((kq || dt == MHA_KV_INT8) && T == 1 && wi == 0)
                        printf("%s decode H %lld Hkv %lld D %lld: err vs the stored values' "
                               "(int8: and rounded query's) oracle %.3g, largest err / "
                               "documented bound %.3g\n",
                               dn, (long long)H, (long long)Hkv, (long long)D, err, ratio);
                    if (kq || dt == MHA_KV_INT8)
                        CHECKF(over <= 0.0,
                               "decode groups H %lld Hkv %lld D %lld %s T %d window %lld: "
                               "outside the documented bound by %g (largest err / bound %g)",
                               (long long)H, (long long)Hkv, (long long)D, dn, T,
                               (long long)win, over, ratio);
                    CHECKF(err <= 4e-6 * (1.0 + mx),
                           "decode groups H %lld Hkv %lld D %lld %s T %d window %lld: err %g "
                           "(max|ref| %g)",
                           (long long)H, (long long)Hkv, (long long)D,
                           mha_kv_dtype_name((mha_kv_dtype)dt), T, (long long)win, err, mx);
                    for (int r = 1; r < 3; r++)
                        CHECKF(memcmp(o[0], o[r], sizeof(float) * nq) == 0,
                               "decode groups H %lld Hkv %lld D %lld %s T %d: 1 vs %d threads",
                               (long long)H, (long long)Hkv, (long long)D,
                               mha_kv_dtype_name((mha_kv_dtype)dt), T, threads[r]);
                    for (int r = 0; r < 3; r++) free(o[r]);
                    free(sc), free(q), free(k), free(v);
                    free(kq), free(vq), free(ks), free(vs);
                    mha_kv_cache_destroy(c);
                }
}

int main(void) {
    seed_rng(2024);
    for (int i = 0; i < 300; i++) one_case(i);
    test_threads();
    test_windows();
    test_weights_block();
    test_sdpa();
    test_saved_cfg(0);
    // grouped-query attention (after the tests above: their random draws
    // are unchanged)
    for (int i = 0; i < 120; i++) gqa_case(i);
    test_threads_gqa();
    test_saved_cfg(2);
    test_saved_cfg(1);
    test_cached_gqa();
    test_half();
    test_weights_u8();
    // the checkpoint layouts (issue 17), last: the draws above are unchanged
    for (int i = 0; i < 160; i++) layout_case(i, MHA_QK_NORM_NONE);
    test_cached_layouts();
    test_qk_norm();               // (last: the draws above are unchanged)
    for (int i = 0; i < 80; i++)  // the layouts again, with the QK-norm
        layout_case(1000 + i, i % 2 ? MHA_QK_NORM_ALL : MHA_QK_NORM_HEAD);
    test_decode_groups();  // (last: the draws above are unchanged)
    printf("ISA: %s\n", mha_isa());
    return check_summary("test_fused");
}
