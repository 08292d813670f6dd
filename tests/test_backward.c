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
#include "util.h"
#include "mha.h"

static double g_fd_worst;
static int g_fd_cases;
static void fill(float *x, int64_t n, float s) {
    for (int64_t i = 0; i < n; i++) x[i] = s * frand();
}

enum { E = 6, H = 2, L = 3, S = 4, N = 2, KD = 5, VD = 3 };

// ---------------------------------------------------------------------------
// Finite differences on the float64 variant of the reference: F64 inputs,
// outputs and gradients (the reference computes in double throughout), and
// parameters on a grid of multiples of 2^-12 so that p +- h, p +- 2h are
// exact for h = 2^-10. Fourth-order central differences:
//   f'(x) ~ (-f(x+2h) + 8 f(x+h) - 8 f(x-h) + f(x-2h)) / (12 h).

typedef struct fd_case {
    bool packed, bias, bkv, zero, batch_first, unbatched, causal, dropout;
    int kpm;              // 0 none, 1 bool, 2 float
    int am;               // 0 none, 1 bool (L,S), 2 float (L,S), 3 bool 3-D, 4 float 3-D
    int heads, kv_heads;  // 0: H and H (grouped-query attention otherwise)
    int gate;             // mha_head_gate: none, static, dynamic
    int prune;            // 0 none, 1 head 1, 2 the first KV group's heads
    // the checkpoint layouts: head dim (0: E / H), separate q/k/v matrices,
    // no out_proj.bias, a custom scale (0: none); and RoPE, ALiBi, soft cap
    int head_dim;
    bool sep, no_out_bias, rope, alibi, softcap, sinks;
    double scale;
    int qk_norm;        // mha_qk_norm: none, per head, all features
    float qk_norm_eps;  // 0: 1e-6
} fd_case;

enum { HMAX = 6 };  // the most heads of a grid case (E = 6)

typedef struct fd_problem {
    mha_module *m;
    int64_t kd, vd, n, ndim;
    double q[L * N * E], k[S * N * E], v[S * N * E], gy[L * N * E];  // E >= KD, VD
    uint8_t bm[N * HMAX * L * S], bk[N * S];  // first N H L S random, the rest 0
    double fm[N * HMAX * L * S], fk[N * S];
    mha_tensor qt, kt, vt, gyt, amt, kpt;
    mha_forward_args a;
} fd_problem;

static void dfill(double *x, int64_t n, double s) {
    for (int64_t i = 0; i < n; i++) x[i] = s * frand();
}

// A (T, N, F) / (N, T, F) / (T, F) shape for the case.
static mha_tensor fd_view(double *p, const fd_case *c, int64_t T, int64_t F) {
    if (c->unbatched) return mha_tensor_contiguous(p, MHA_F64, 2, (int64_t[]){T, F});
    if (c->batch_first) return mha_tensor_contiguous(p, MHA_F64, 3, (int64_t[]){N, T, F});
    return mha_tensor_contiguous(p, MHA_F64, 3, (int64_t[]){T, N, F});
}

static void fd_setup(fd_problem *p, const fd_case *c) {
    memset(p, 0, sizeof *p);
    p->kd = c->packed ? E : KD;
    p->vd = c->packed ? E : VD;
    p->n = c->unbatched ? 1 : N;
    mha_config cfg;
    mha_config_init(&cfg, E, c->heads ? c->heads : H);
    cfg.num_kv_heads = c->kv_heads;
    cfg.kdim = p->kd;
    cfg.vdim = p->vd;
    cfg.bias = c->bias;
    cfg.add_bias_kv = c->bkv;
    cfg.add_zero_attn = c->zero;
    cfg.batch_first = c->batch_first;
    cfg.dropout = c->dropout ? 0.3f : 0.0f;
    cfg.out_dropout = c->dropout ? 0.2f : 0.0f;
    cfg.head_gate = (mha_head_gate)c->gate;
    cfg.head_dim = c->head_dim;
    cfg.separate_qkv = c->sep;
    cfg.no_out_bias = c->no_out_bias && c->bias;
    cfg.sinks = c->sinks;
    cfg.qk_norm = (mha_qk_norm)c->qk_norm;
    cfg.qk_norm_eps = c->qk_norm_eps;
    CHECK_OK(mha_module_create(&p->m, &cfg));
    const int64_t nh = c->heads ? c->heads : H, G = nh / (c->kv_heads ? c->kv_heads : nh);
    int64_t pruned[HMAX], np = 0;
    for (int64_t h = 0; h < nh; h++)
        if ((c->prune == 1 && h == 1) || (c->prune == 2 && h < G)) pruned[np++] = h;
    CHECK_OK(mha_module_prune_heads(p->m, pruned, np));
    for (int i = 0; i < mha_module_num_params(p->m); i++) {
        mha_param pr;
        CHECK_OK(mha_module_param_at(&pr, p->m, i));
        for (int64_t j = 0; j < pr.numel; j++)  // multiples of 2^-12 in (-0.7, 0.7)
            pr.data[j] = (float)(round(0.7 * frand() * 4096.0) / 4096.0);
    }
    dfill(p->q, L * N * E, 1.0);
    dfill(p->k, S * N * E, 1.0);
    dfill(p->v, S * N * E, 1.0);
    dfill(p->gy, L * N * E, 1.0);
    p->qt = fd_view(p->q, c, L, E);
    p->kt = fd_view(p->k, c, S, p->kd);
    p->vt = fd_view(p->v, c, S, p->vd);
    p->gyt = fd_view(p->gy, c, L, E);
    mha_forward_args_init(&p->a);
    p->a.query = &p->qt;
    p->a.key = &p->kt;
    p->a.value = &p->vt;
    p->a.opts.is_causal = c->causal;
    p->a.training = c->dropout;
    p->a.opts.dropout_seed = 1234;
    p->a.opts.dropout_offset = 7;
    if (c->scale > 0) p->a.opts.scale = c->scale;
    if (c->rope) mha_rope_init(&p->a.rope, MHA_ROPE_NEOX);
    p->a.opts.alibi = c->alibi;
    p->a.opts.softcap = c->softcap ? 2.5f : 0.0f;
    // masks: hide a few keys, never a whole row (fully masked rows have a
    // kink-free but zero gradient; test_fully_masked covers them)
    for (int i = 0; i < N * H * L * S; i++) {
        p->bm[i] = (i % 7) == 3;
        p->fm[i] = frand();
    }
    for (int i = 0; i < N * S; i++) {
        p->bk[i] = (i % 5) == 2;
        p->fk[i] = frand();
    }
    if (c->kpm) {
        p->kpt = c->unbatched
                     ? mha_tensor_contiguous(c->kpm == 1 ? (void *)p->bk : (void *)p->fk,
                                             c->kpm == 1 ? MHA_BOOL : MHA_F64, 1,
                                             (int64_t[]){S})
                     : mha_tensor_contiguous(c->kpm == 1 ? (void *)p->bk : (void *)p->fk,
                                             c->kpm == 1 ? MHA_BOOL : MHA_F64, 2,
                                             (int64_t[]){N, S});
        p->a.key_padding_mask = &p->kpt;
    }
    if (c->am) {
        bool is_bool = c->am == 1 || c->am == 3;
        void *data = is_bool ? (void *)p->bm : (void *)p->fm;
        mha_dtype dt = is_bool ? MHA_BOOL : MHA_F64;
        p->amt = c->am <= 2
                     ? mha_tensor_contiguous(data, dt, 2, (int64_t[]){L, S})
                     : mha_tensor_contiguous(data, dt, 3,
                                             (int64_t[]){p->n * (c->heads ? c->heads : H), L,
                                                         S});
        p->a.attn_mask = &p->amt;
    }
}

// loss = sum(gy * forward(...)), all in double
static double fd_loss(fd_problem *p) {
    double y[L * N * E];
    mha_tensor yt = p->gyt;
    yt.data = y;
    mha_status st = mha_forward(&yt, NULL, p->m, &p->a);
    CHECK(st == MHA_OK);
    double s = 0;
    for (int64_t i = 0; i < mha_tensor_numel(&yt); i++) s += p->gy[i] * y[i];
    return s;
}

// Relative L2 error of the analytic gradient g against fourth-order central
// differences of the loss w.r.t. x (float or double elements).
static double fd_rel_error(fd_problem *p, void *x, bool f64, const void *g, bool gf64,
                           int64_t n) {
    const double h = 0x1p-10;
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        double x0 = f64 ? ((double *)x)[i] : ((float *)x)[i], f[4];
        const double off[4] = {2 * h, h, -h, -2 * h};
        for (int t = 0; t < 4; t++) {
            if (f64) ((double *)x)[i] = x0 + off[t];
            else ((float *)x)[i] = (float)(x0 + off[t]);  // exact on the grid
            f[t] = fd_loss(p);
        }
        if (f64) ((double *)x)[i] = x0;
        else ((float *)x)[i] = (float)x0;
        double fd = (-f[0] + 8 * f[1] - 8 * f[2] + f[3]) / (12 * h);
        double an = gf64 ? ((const double *)g)[i] : ((const float *)g)[i];
        num += (fd - an) * (fd - an);
        den += fd * fd;
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

static void check_fd(const fd_case *c) {
    fd_problem *p = malloc(sizeof *p);
    fd_setup(p, c);
    double gq[L * N * E], gk[S * N * E], gv[S * N * E];
    mha_tensor gqt = p->qt, gkt = p->kt, gvt = p->vt;
    gqt.data = gq;
    gkt.data = gk;
    gvt.data = gv;
    mha_module *g = NULL;
    CHECK_OK(mha_module_create(&g, mha_module_config(p->m)));
    CHECK_OK(mha_backward(&gqt, &gkt, &gvt, g, p->m, &p->a, &p->gyt, false));
    char desc[320];
    snprintf(desc, sizeof desc,
             "packed %d bias %d bkv %d zero %d bf %d unb %d causal %d drop %d kpm %d am %d "
             "heads %d kv_heads %d gate %d prune %d head_dim %d sep %d no_out_bias %d "
             "scale %g rope %d alibi %d softcap %d sinks %d qk_norm %d eps %g",
             c->packed, c->bias, c->bkv, c->zero, c->batch_first, c->unbatched, c->causal,
             c->dropout, c->kpm, c->am, c->heads, c->kv_heads, c->gate, c->prune, c->head_dim,
             c->sep, c->no_out_bias, c->scale, c->rope, c->alibi, c->softcap, c->sinks,
             c->qk_norm, (double)c->qk_norm_eps);
    const double tol = 1e-6;
    double e, worst = 0;
    e = fd_rel_error(p, p->q, true, gq, true, mha_tensor_numel(&p->qt));
    CHECKF(e < tol, "%s: grad_query rel err %g", desc, e);
    worst = fmax(worst, e);
    e = fd_rel_error(p, p->k, true, gk, true, mha_tensor_numel(&p->kt));
    CHECKF(e < tol, "%s: grad_key rel err %g", desc, e);
    worst = fmax(worst, e);
    e = fd_rel_error(p, p->v, true, gv, true, mha_tensor_numel(&p->vt));
    CHECKF(e < tol, "%s: grad_value rel err %g", desc, e);
    worst = fmax(worst, e);
    for (int i = 0; i < mha_module_num_params(p->m); i++) {
        mha_param pp, gp;
        CHECK_OK(mha_module_param_at(&pp, p->m, i));
        CHECK_OK(mha_module_param_at(&gp, g, i));
        e = fd_rel_error(p, pp.data, false, gp.data, false, pp.numel);
        // the analytic parameter gradient is stored in float32: its own
        // rounding (2^-24 relative) is far below the tolerance
        CHECKF(e < tol, "%s: grad %s rel err %g", desc, pp.name, e);
        worst = fmax(worst, e);
    }
    g_fd_worst = fmax(g_fd_worst, worst);
    g_fd_cases++;
    mha_module_destroy(g);
    mha_module_destroy(p->m);
    free(p);
}

static void test_fd_grid(void) {
    // every option on and off at least once, and together
    for (int i = 0; i < 64; i++) {
        fd_case c = {
            .packed = i & 1,
            .bias = (i >> 1) & 1,
            .bkv = (i >> 2) & 1,
            .zero = (i >> 3) & 1,
            .batch_first = (i >> 4) & 1,
            .unbatched = i % 5 == 0,
            .causal = (i >> 5) & 1,
            .dropout = i % 3 == 0,
            .kpm = i % 3,
            .am = i % 5,
        };
        check_fd(&c);
    }
    // grouped-query / multi-query attention: (heads, kv_heads) with E = 6,
    // the options varied as above
    static const int gqa[4][2] = {{2, 1}, {6, 2}, {6, 3}, {3, 1}};
    for (int i = 0; i < 16; i++) {
        fd_case c = {
            .packed = i & 1,
            .bias = (i >> 1) & 1,
            .bkv = (i >> 2) & 1,
            .zero = (i >> 3) & 1,
            .batch_first = (i >> 2) & 1,
            .unbatched = i % 5 == 0,
            .causal = (i >> 1) & 1,
            .dropout = i % 3 == 0,
            .kpm = i % 3,
            .am = i % 5,
            .heads = gqa[i % 4][0],
            .kv_heads = gqa[i % 4][1],
        };
        check_fd(&c);
    }
    // head gates (static, dynamic) and pruning (one head; a whole KV group)
    for (int i = 0; i < 18; i++) {
        fd_case c = {
            .packed = i & 1,
            .bias = (i >> 1) & 1,
            .bkv = i % 5 == 1,
            .zero = i % 7 == 2,
            .batch_first = (i >> 2) & 1,
            .unbatched = i % 6 == 0,
            .causal = (i >> 1) & 1,
            .dropout = i % 4 == 0,
            .kpm = i % 3,
            .am = i % 5,
            .heads = i % 3 == 2 ? 6 : 0,
            .kv_heads = i % 3 == 2 ? 2 : 0,
            .gate = 1 + i % 2,
            .prune = i % 3,
        };
        if (i >= 12) c.gate = 0;  // pruning alone
        if (i >= 12 && !c.prune) c.prune = 1;
        check_fd(&c);
    }
    // the checkpoint layouts: head_dim != E / H (E = 6: (heads, kv_heads,
    // d) with and without grouped-query attention), separate q/k/v
    // matrices with kdim = vdim = E, no out_proj.bias, a custom scale;
    // with RoPE, ALiBi, the soft cap, gates, pruning and the options above
    static const int lay[6][3] = {{2, 0, 4}, {4, 2, 2}, {3, 1, 4},
                                  {2, 1, 5}, {1, 0, 8}, {3, 3, 1}};
    for (int i = 0; i < 30; i++) {
        fd_case c = {
            .packed = i % 3 != 0,
            .bias = i % 5 != 4,
            .bkv = i % 4 == 1,
            .zero = i % 6 == 2,
            .batch_first = (i >> 1) & 1,
            .unbatched = i % 7 == 0,
            .causal = (i >> 2) & 1,
            .dropout = i % 4 == 0,
            .kpm = i % 3,
            .am = i % 5,
            .heads = lay[i % 6][0],
            .kv_heads = lay[i % 6][1],
            .head_dim = lay[i % 6][2],
            .sep = i % 2 == 1,
            .no_out_bias = i % 3 == 1,
            .scale = i % 4 == 2 ? 0.37 : 0.0,
            .rope = i % 5 == 1 && lay[i % 6][2] % 2 == 0,
            .alibi = i % 6 == 3,
            .softcap = i % 7 == 4,
            .gate = i % 8 == 5 ? 2 : i % 9 == 1,
            .prune = i % 10 == 3,
            .sinks = i % 3 == 2,
        };
        if (i % 10 == 9) c.heads = 2, c.kv_heads = 1, c.head_dim = 0, c.sep = true;  // E / H
        check_fd(&c);
    }
    // QK-norm (per head, over all features; the default eps and a large
    // one) on the layouts above (every q/k_norm.weight element checked
    // with the other parameters); d = 1 only over all features (one
    // feature's RMSNorm is a near-step)
    for (int i = 0; i < 18; i++) {
        const int *l = lay[i % 6];
        fd_case c = {
            .packed = i % 3 != 0,
            .bias = i % 5 != 4,
            .bkv = i % 4 == 1,
            .zero = i % 6 == 2,
            .batch_first = (i >> 1) & 1,
            .unbatched = i % 7 == 0,
            .causal = (i >> 2) & 1,
            .dropout = i % 4 == 0,
            .kpm = i % 3,
            .am = i % 5,
            .heads = l[0],
            .kv_heads = l[1],
            .head_dim = l[2],
            .sep = i % 2 == 1,
            .rope = i % 4 == 1 && l[2] % 2 == 0,
            .gate = i % 5 == 3 ? 2 : 0,
            .prune = i % 7 == 3,
            .sinks = i % 5 == 2,
            .qk_norm = l[2] == 1 || i % 2 ? MHA_QK_NORM_ALL : MHA_QK_NORM_HEAD,
            .qk_norm_eps = i % 3 == 0 ? 0.25f : 0.0f,
        };
        if (i == 17) c.heads = 2, c.kv_heads = 0, c.head_dim = 0, c.qk_norm = 1;  // E / H
        check_fd(&c);
    }
    printf("finite differences (float64 reference, 4th order, h = 2^-10): %d configs, "
           "worst relative L2 error %.3g\n",
           g_fd_cases, g_fd_worst);
}

// ---------------------------------------------------------------------------
// Properties of the float32 path

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
        p->a.opts.is_causal = true;
    }
    p->a.training = dropout;
    p->a.opts.dropout_seed = 1234;
    p->a.opts.dropout_offset = 7;
}

// accumulate = true adds; with dropout, outputs and gradients are
// bit-identical with 1, 2 and 8 threads (a problem large enough for the
// library to use threads: it runs small ones on one).
static void test_accumulate_threads(void) {
    enum { E3 = 32, H3 = 4, L3 = 40, S3 = 36, N3 = 3 };
    mha_config c;
    mha_config_init(&c, E3, H3);
    c.add_bias_kv = c.add_zero_attn = true;
    c.dropout = 0.2f;
    c.out_dropout = 0.1f;
    mha_module *m = NULL;
    CHECK_OK(mha_module_create(&m, &c));
    mha_init_options io;
    mha_init_options_init(&io);
    CHECK_OK(mha_module_init(m, &io));
    static float x[L3 * N3 * E3], kv[S3 * N3 * E3], gy[L3 * N3 * E3], y[3][L3 * N3 * E3],
        gq[3][L3 * N3 * E3];
    static uint8_t kpm[N3 * S3];
    fill(x, L3 * N3 * E3, 1.0f);
    fill(kv, S3 * N3 * E3, 1.0f);
    fill(gy, L3 * N3 * E3, 1.0f);
    for (int i = 0; i < N3 * S3; i++) kpm[i] = i % 7 == 0;
    mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 3, (int64_t[]){L3, N3, E3});
    mha_tensor kt = mha_tensor_contiguous(kv, MHA_F32, 3, (int64_t[]){S3, N3, E3});
    mha_tensor gyt = mha_tensor_contiguous(gy, MHA_F32, 3, (int64_t[]){L3, N3, E3});
    mha_tensor kpt = mha_tensor_contiguous(kpm, MHA_BOOL, 2, (int64_t[]){N3, S3});
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = &xt;
    a.key = a.value = &kt;
    a.key_padding_mask = &kpt;
    a.opts.is_causal = true;
    a.training = true;
    a.opts.dropout_seed = 77;
    mha_module *g[3] = {NULL, NULL, NULL};
    const int threads[3] = {1, 2, 8};
    for (int r = 0; r < 3; r++) {
#ifdef _OPENMP
        omp_set_num_threads(threads[r]);
#endif
        mha_tensor gt = mha_tensor_contiguous(gq[r], MHA_F32, 3, (int64_t[]){L3, N3, E3});
        mha_tensor yt = mha_tensor_contiguous(y[r], MHA_F32, 3, (int64_t[]){L3, N3, E3});
        CHECK_OK(mha_module_create(&g[r], mha_module_config(m)));
        CHECK_OK(mha_forward(&yt, NULL, m, &a));
        CHECK_OK(mha_backward(&gt, NULL, NULL, g[r], m, &a, &gyt, false));
    }
#ifdef _OPENMP
    omp_set_num_threads(2);
#endif
    for (int r = 1; r < 3; r++) {
        CHECKF(memcmp(y[0], y[r], sizeof y[0]) == 0, "output: 1 vs %d threads", threads[r]);
        CHECKF(memcmp(gq[0], gq[r], sizeof gq[0]) == 0, "grad_query: 1 vs %d threads",
               threads[r]);
        for (int i = 0; i < mha_module_num_params(g[0]); i++) {
            mha_param p0, pr;
            CHECK_OK(mha_module_param_at(&p0, g[0], i));
            CHECK_OK(mha_module_param_at(&pr, g[r], i));
            CHECKF(memcmp(p0.data, pr.data, (size_t)p0.numel * 4) == 0, "%s: 1 vs %d threads",
                   p0.name, threads[r]);
        }
    }
    // accumulate: g[1] += once more gives exactly twice g[0] (x + x is exact)
    mha_tensor gt = mha_tensor_contiguous(gq[1], MHA_F32, 3, (int64_t[]){L3, N3, E3});
    CHECK_OK(mha_backward(&gt, NULL, NULL, g[1], m, &a, &gyt, true));
    for (int i = 0; i < L3 * N3 * E3; i++) CHECK(gq[1][i] == 2.0f * gq[0][i]);
    for (int i = 0; i < mha_module_num_params(g[0]); i++) {
        mha_param p0, p1;
        CHECK_OK(mha_module_param_at(&p0, g[0], i));
        CHECK_OK(mha_module_param_at(&p1, g[1], i));
        bool ok = true;
        for (int64_t j = 0; j < p0.numel; j++) ok &= p1.data[j] == 2.0f * p0.data[j];
        CHECKF(ok, "%s: accumulate did not add", p0.name);
    }
    for (int r = 0; r < 3; r++) mha_module_destroy(g[r]);
    mha_module_destroy(m);
}

// Eval mode ignores dropout exactly; training masks are reproducible from
// (seed, offset); the dropped fraction is within 0.01 of p over a large
// tensor; averaged over many seeds the output approaches the no-dropout
// output.
static void test_dropout_semantics(void) {
    enum { E2 = 8, H2 = 2, L2 = 128, N2 = 4 };
    mha_config c;
    mha_config_init(&c, E2, H2);
    mha_module *m0 = NULL, *m1 = NULL;
    CHECK_OK(mha_module_create(&m0, &c));
    c.dropout = 0.3f;
    CHECK_OK(mha_module_create(&m1, &c));
    mha_init_options io;
    mha_init_options_init(&io);
    CHECK_OK(mha_module_init(m0, &io));
    CHECK_OK(mha_module_init(m1, &io));
    static float x[L2 * N2 * E2], y0[L2 * N2 * E2], y1[L2 * N2 * E2], w[N2 * H2 * L2 * L2],
        w2[N2 * H2 * L2 * L2];
    static double avg[L2 * N2 * E2];
    fill(x, L2 * N2 * E2, 1.0f);
    mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 3, (int64_t[]){L2, N2, E2});
    mha_tensor y0t = mha_tensor_contiguous(y0, MHA_F32, 3, (int64_t[]){L2, N2, E2});
    mha_tensor y1t = mha_tensor_contiguous(y1, MHA_F32, 3, (int64_t[]){L2, N2, E2});
    mha_tensor wt = mha_tensor_contiguous(w, MHA_F32, 4, (int64_t[]){N2, H2, L2, L2});
    mha_tensor w2t = mha_tensor_contiguous(w2, MHA_F32, 4, (int64_t[]){N2, H2, L2, L2});
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = a.key = a.value = &xt;
    a.opts.dropout_seed = 5;
    CHECK_OK(mha_forward(&y0t, NULL, m0, &a));
    CHECK_OK(mha_forward(&y1t, NULL, m1, &a));  // eval: p ignored, exactly
    CHECK(memcmp(y0, y1, sizeof y0) == 0);
    a.training = true;
    a.need_weights = true;
    a.average_attn_weights = false;
    CHECK_OK(mha_forward(&y1t, &wt, m1, &a));
    CHECK(memcmp(y0, y1, sizeof y0) != 0);
    int64_t zeros = 0, n = N2 * H2 * L2 * L2;
    for (int64_t i = 0; i < n; i++) zeros += w[i] == 0.0f;
    double frac = (double)zeros / (double)n;
    CHECKF(fabs(frac - 0.3) < 0.01, "dropped fraction %g of %lld weights (p = 0.3)", frac,
           (long long)n);
    printf("dropout: dropped fraction %.4f of %lld weights at p = 0.3\n", frac, (long long)n);
    CHECK_OK(mha_forward(&y1t, &w2t, m1, &a));  // same seed/offset: same mask
    CHECK(memcmp(w, w2, sizeof w) == 0);
    a.opts.dropout_offset = 1;
    CHECK_OK(mha_forward(&y1t, &w2t, m1, &a));
    CHECK(memcmp(w, w2, sizeof w) != 0);
    // E[dropout(P)] = P: the mean over seeds converges to the eval output
    a.need_weights = false;
    const int seeds = 200;
    double one = 0, mean_err = 0;
    for (int sd = 0; sd < seeds; sd++) {
        a.opts.dropout_seed = 1000 + (uint64_t)sd;
        CHECK_OK(mha_forward(&y1t, NULL, m1, &a));
        for (int i = 0; i < L2 * N2 * E2; i++) {
            avg[i] += y1[i] / seeds;
            if (sd == 0) one += fabs(y1[i] - y0[i]);
        }
    }
    for (int i = 0; i < L2 * N2 * E2; i++) mean_err += fabs(avg[i] - y0[i]);
    printf("dropout: mean |y - y_eval|: one seed %.3g, mean of %d seeds %.3g\n",
           one / (L2 * N2 * E2), seeds, mean_err / (L2 * N2 * E2));
    // about 1/sqrt(200) = 0.07 of the one-seed deviation is expected
    CHECKF(mean_err < 0.15 * one, "mean over seeds err %g vs one seed %g", mean_err, one);
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
    CHECK_FAILS(mha_backward(NULL, NULL, NULL, NULL, p.m, &p.a, NULL, false),
                MHA_ERR_INVALID_ARG);
    mha_tensor gy_bad = mha_tensor_contiguous(p.gy, MHA_F32, 3, (int64_t[]){L, N, E - 1});
    CHECK_FAILS(mha_backward(NULL, NULL, NULL, NULL, p.m, &p.a, &gy_bad, false), MHA_ERR_SHAPE);
    CHECK_FAILS(mha_backward(NULL, NULL, NULL, p.m, p.m, &p.a, &p.gyt, false),
                MHA_ERR_INVALID_ARG);
    mha_config c;
    mha_config_init(&c, E, H);  // kdim/vdim differ from the module's
    mha_module *other = NULL;
    CHECK_OK(mha_module_create(&other, &c));
    CHECK_FAILS(mha_backward(NULL, NULL, NULL, other, p.m, &p.a, &p.gyt, false),
                MHA_ERR_INVALID_ARG);
    mha_tensor alias = mha_tensor_contiguous(p.q, MHA_F32, 3, (int64_t[]){L, N, E});
    CHECK_FAILS(mha_backward(&alias, NULL, NULL, NULL, p.m, &p.a, &p.gyt, false),
                MHA_ERR_INVALID_ARG);
    mha_module_destroy(other);
    mha_module_destroy(p.m);
}

int main(void) {
    seed_rng(99);
    test_fd_grid();
    test_accumulate_threads();
    test_dropout_semantics();
    test_fully_masked();
    test_misuse();
    return check_summary("test_backward");
}
