// test_rope.c: RoPE positions (rope_positions) and RoPE scaling (linear,
// dynamic NTK, YaRN, llama3) in every path, without PyTorch (their values
// against transformers: tests/rope/test_rope_scaling.py):
//   - the API: mha_rope_scaling_init, mha_rope_scaling_type_from_name,
//     mha_rope_frequencies (unscaled = theta^(-2i/dim); linear = that /
//     factor; dynamic below its length = unscaled; YaRN's attention factor),
//     every field checked with a message naming it
//   - the module forward and backward with positions (default, start,
//     left-padding style, repeated, unordered) and each scaling: fused
//     against the reference, outputs and every gradient; positions equal to
//     start + t give the rope_start bits
//   - finite differences of the float64 reference through a scaled RoPE
//     (YaRN's attention factor: the backward is the transpose, not the
//     inverse)
//   - mha_forward_cached with rope_positions chunk by chunk = the full
//     causal forward with those positions (dynamic: a chunk whose largest
//     position is the full call's)
//   - the saved state keeps the positions and the scaling in its key
//   - mha_diag_create's logit_max = the reference trace's scaled scores
//   - mha_rope_apply: positions = start + t gives mha_rope_apply's bits;
//     inverse after forward multiplies by the attention factor squared
//   - refusals: negative positions, cross-attention with positions, a
//     scaling without RoPE, bad fields
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

// A scaling of type t with the parameters the tests use.
static mha_rope_scaling scaling_of(mha_rope_scaling_type t, int variant) {
    mha_rope_scaling s;
    mha_rope_scaling_init(&s, t);
    switch (t) {
    case MHA_ROPE_SCALING_LINEAR: s.factor = variant ? 0.5 : 4.0; break;
    case MHA_ROPE_SCALING_DYNAMIC:
        s.factor = 3.0;
        s.original_max_position = variant ? 1000 : 12;  // above / below the positions
        break;
    case MHA_ROPE_SCALING_YARN:
        s.factor = 8.0;
        s.original_max_position = 16;
        if (variant) s.mscale = 1.0, s.mscale_all_dim = 0.5, s.truncate = false;
        break;
    case MHA_ROPE_SCALING_LLAMA3:
        s.factor = 8.0;
        s.original_max_position = 32;
        s.low_freq_factor = 1.0;
        s.high_freq_factor = 4.0;
        break;
    default: break;
    }
    return s;
}

static void test_api(void) {
    mha_rope_scaling s;
    mha_rope_scaling_init(&s, MHA_ROPE_SCALING_YARN);
    CHECK(s.type == MHA_ROPE_SCALING_YARN && s.factor == 1.0 && s.original_max_position == 0 &&
          s.low_freq_factor == 1.0 && s.high_freq_factor == 4.0 && s.beta_fast == 32.0 &&
          s.beta_slow == 1.0 && s.mscale == 0.0 && s.mscale_all_dim == 0.0 &&
          s.attention_factor == 0.0 && s.truncate);
    static const char *names[6] = {"default", "none", "linear", "dynamic", "yarn", "llama3"};
    static const mha_rope_scaling_type types[6] = {
        MHA_ROPE_SCALING_NONE,    MHA_ROPE_SCALING_NONE, MHA_ROPE_SCALING_LINEAR,
        MHA_ROPE_SCALING_DYNAMIC, MHA_ROPE_SCALING_YARN, MHA_ROPE_SCALING_LLAMA3};
    for (int i = 0; i < 6; i++) {
        mha_rope_scaling_type t = MHA_ROPE_SCALING_LLAMA3;
        CHECK_OK(mha_rope_scaling_type_from_name(&t, names[i]));
        CHECKF(t == types[i], "%s -> %d", names[i], (int)t);
    }
    mha_rope_scaling_type t;
    CHECK_FAILS(mha_rope_scaling_type_from_name(&t, "longrope"), MHA_ERR_UNSUPPORTED);
    CHECK(strstr(mha_last_error(), "longrope") != NULL);

    mha_rope r;
    mha_rope_init(&r, MHA_ROPE_NEOX);
    r.dim = 12;
    double inv[8], ref[8], af;
    CHECK_OK(mha_rope_frequencies(ref, &af, &r, NULL, 16, 0));
    CHECK(af == 1.0);
    for (int i = 0; i < 6; i++)
        CHECKF(fabs(ref[i] - pow(10000.0, -2.0 * i / 12.0)) <= 1e-15 * ref[i], "inv %d", i);
    mha_rope_scaling none = scaling_of(MHA_ROPE_SCALING_NONE, 0);
    CHECK_OK(mha_rope_frequencies(inv, &af, &r, &none, 16, 99));
    CHECK(!memcmp(inv, ref, sizeof(double) * 6) && af == 1.0);
    mha_rope_scaling lin = scaling_of(MHA_ROPE_SCALING_LINEAR, 0);
    CHECK_OK(mha_rope_frequencies(inv, &af, &r, &lin, 16, 0));
    for (int i = 0; i < 6; i++) CHECK(inv[i] == ref[i] / 4.0);
    // dynamic: unchanged up to its length, then a larger theta (lower
    // frequencies, the first always 1)
    mha_rope_scaling dyn = scaling_of(MHA_ROPE_SCALING_DYNAMIC, 0);
    for (int64_t seq = 0; seq <= 13; seq++) {
        CHECK_OK(mha_rope_frequencies(inv, &af, &r, &dyn, 16, seq));
        double e = 0;
        for (int i = 0; i < 6; i++) e = fmax(e, fabs(inv[i] - ref[i]) / ref[i]);
        if (seq <= 12) CHECKF(e <= 1e-15, "dynamic seq %lld: rel %g", (long long)seq, e);
        else CHECK(e > 1e-3 && inv[0] == 1.0 && inv[5] < ref[5]);
    }
    // dynamic's theta' = theta (3 seq / 12 - 2)^(12 / 10) at seq 30
    CHECK_OK(mha_rope_frequencies(inv, &af, &r, &dyn, 16, 30));
    const double th = 10000.0 * pow(3.0 * 30 / 12 - 2, 1.2);
    for (int i = 0; i < 6; i++)
        CHECKF(fabs(inv[i] - pow(th, -2.0 * i / 12.0)) <= 1e-14 * inv[i], "dynamic inv %d", i);
    // YaRN: the attention factor 0.1 ln 8 + 1, from mscale / mscale_all_dim,
    // or given; the first frequency kept (extrapolated), the last / factor
    mha_rope_scaling y = scaling_of(MHA_ROPE_SCALING_YARN, 0);
    CHECK_OK(mha_rope_frequencies(inv, &af, &r, &y, 16, 0));
    CHECK(fabs(af - (0.1 * log(8.0) + 1.0)) <= 1e-15 && inv[0] == ref[0] &&
          fabs(inv[5] - ref[5] / 8.0) <= 1e-15 * inv[5]);
    y.mscale = 1.0, y.mscale_all_dim = 0.5;
    CHECK_OK(mha_rope_frequencies(inv, &af, &r, &y, 16, 0));
    CHECK(fabs(af - (0.1 * log(8.0) + 1.0) / (0.05 * log(8.0) + 1.0)) <= 1e-15);
    y.attention_factor = 1.25;
    CHECK_OK(mha_rope_frequencies(inv, &af, &r, &y, 16, 0));
    CHECK(af == 1.25);
    // llama3: high frequencies kept, low ones / factor
    mha_rope_scaling l3 = scaling_of(MHA_ROPE_SCALING_LLAMA3, 0);
    CHECK_OK(mha_rope_frequencies(inv, &af, &r, &l3, 16, 0));
    CHECK(inv[0] == ref[0] && fabs(inv[5] - ref[5] / 8.0) <= 1e-15 * inv[5] && af == 1.0);

    // every field checked, the message naming it and its value
    struct {
        mha_rope_scaling_type t;
        const char *field;
        int which;
        double v;
    } bad[] = {
        {MHA_ROPE_SCALING_LINEAR, "factor", 0, 0.0},
        {MHA_ROPE_SCALING_LINEAR, "factor", 0, NAN},
        {MHA_ROPE_SCALING_DYNAMIC, "factor", 0, -2.0},
        {MHA_ROPE_SCALING_DYNAMIC, "original_max_position", 1, 0},
        {MHA_ROPE_SCALING_YARN, "original_max_position", 1, -5},
        {MHA_ROPE_SCALING_LLAMA3, "original_max_position", 1, 0},
        {MHA_ROPE_SCALING_LLAMA3, "low_freq_factor", 2, 4.0},
        {MHA_ROPE_SCALING_LLAMA3, "low_freq_factor", 2, 0.0},
        {MHA_ROPE_SCALING_LLAMA3, "high_freq_factor", 3, INFINITY},
        {MHA_ROPE_SCALING_YARN, "beta_fast", 4, -1.0},
        {MHA_ROPE_SCALING_YARN, "beta_slow", 5, NAN},
        {MHA_ROPE_SCALING_YARN, "mscale", 6, INFINITY},
        {MHA_ROPE_SCALING_YARN, "mscale_all_dim", 7, NAN},
        {MHA_ROPE_SCALING_YARN, "attention_factor", 8, -0.5},
        {MHA_ROPE_SCALING_YARN, "attention factor", 9, -30.0},  // mscale: a negative factor
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        mha_rope_scaling b = scaling_of(bad[i].t, 0);
        switch (bad[i].which) {
        case 0: b.factor = bad[i].v; break;
        case 1: b.original_max_position = (int64_t)bad[i].v; break;
        case 2: b.low_freq_factor = bad[i].v; break;
        case 3: b.high_freq_factor = bad[i].v; break;
        case 4: b.beta_fast = bad[i].v; break;
        case 5: b.beta_slow = bad[i].v; break;
        case 6: b.mscale = bad[i].v; break;
        case 7: b.mscale_all_dim = bad[i].v; break;
        case 8: b.attention_factor = bad[i].v; break;
        case 9: b.mscale = bad[i].v, b.mscale_all_dim = 1.0; break;
        }
        CHECK_FAILS(mha_rope_frequencies(inv, &af, &r, &b, 16, 0), MHA_ERR_INVALID_ARG);
        CHECKF(strstr(mha_last_error(), bad[i].field) != NULL, "bad %zu: %s", i,
               mha_last_error());
    }
    mha_rope_scaling b = scaling_of(MHA_ROPE_SCALING_LINEAR, 0);
    b.type = (mha_rope_scaling_type)9;
    CHECK_FAILS(mha_rope_frequencies(inv, &af, &r, &b, 16, 0), MHA_ERR_INVALID_ARG);
    CHECK(strstr(mha_last_error(), "type 9") != NULL);
    mha_rope r2 = r;
    r2.dim = 2;  // dynamic's exponent dim / (dim - 2)
    CHECK_FAILS(mha_rope_frequencies(inv, &af, &r2, &dyn, 16, 0), MHA_ERR_INVALID_ARG);
    r2.theta = 1.0, r2.dim = 12;  // YaRN divides by ln theta
    y = scaling_of(MHA_ROPE_SCALING_YARN, 0);
    CHECK_FAILS(mha_rope_frequencies(inv, &af, &r2, &y, 16, 0), MHA_ERR_INVALID_ARG);
    CHECK_FAILS(mha_rope_frequencies(inv, &af, &r, &lin, 16, -1), MHA_ERR_INVALID_ARG);
    CHECK_FAILS(mha_rope_frequencies(inv, &af, &r, &lin, 10, 0), MHA_ERR_INVALID_ARG);
    CHECK_FAILS(mha_rope_frequencies(NULL, &af, &r, &lin, 16, 0), MHA_ERR_INVALID_ARG);
    // unused fields are not looked at: linear with no original length
    lin.original_max_position = -3, lin.low_freq_factor = NAN;
    CHECK_OK(mha_rope_frequencies(inv, &af, &r, &lin, 16, 0));
}

// The positions a case uses: kind 0 none (t), 1 rope_start, 2 left padding
// (transformers' cumsum(mask) - 1 with 1 at the padding), 3 repeated and
// unordered, 4 an offset of rope_start given as positions.
static const char *pos_kinds[5] = {"t", "start", "leftpad", "repeated", "start-as-positions"};
static void make_positions(int kind, int64_t *pos, int64_t *start, int64_t N, int64_t L) {
    for (int64_t n = 0; n < N; n++) {
        start[n] = 3 * n + 5;
        const int64_t pad = (n * 3) % (L / 2 + 1);
        for (int64_t t = 0; t < L; t++) {
            int64_t v = t;
            if (kind == 2) v = t < pad ? 1 : t - pad;
            if (kind == 3)
                v = (int64_t)(next() % (uint64_t)(2 * L)), v = t == 1 ? pos[n * L] : v;
            if (kind == 4) v = start[n] + t;
            pos[n * L + t] = v;
        }
    }
}

// Fused against the reference, forward and backward, for every scaling
// type and position kind, both modes, partial rotary, GQA, causal or not.
static void module_case(int id) {
    const int64_t Hkv = irand(1, 3), G = irand(1, 2), H = Hkv * G, d = 2 * irand(2, 8),
                  E = H * d, L = irand(2, 70), N = irand(1, 3);
    const mha_rope_scaling_type type = (mha_rope_scaling_type)(id % 5);
    const int kind = (id / 5) % 5, variant = (id / 25) % 2;
    const bool bf = next() & 1, causal = next() & 1, interleaved = next() & 1,
               partial = next() % 3 == 0;
    mha_config c;
    mha_config_init(&c, E, H);
    c.num_kv_heads = Hkv;
    c.batch_first = bf;
    mha_module *m = random_module(&c, (uint64_t)id);
    test_inputs in;
    test_inputs_make(&in, L, L, N, E, E, E, 4);
    if (bf) {  // (N, L, E) views of the same buffers
        in.qt = mha_tensor_contiguous(in.q, MHA_F32, 3, (int64_t[]){N, L, E});
        in.gyt = mha_tensor_contiguous(in.gy, MHA_F32, 3, (int64_t[]){N, L, E});
        in.kt = mha_tensor_contiguous(in.k, MHA_F32, 3, (int64_t[]){N, L, E});
        in.vt = mha_tensor_contiguous(in.v, MHA_F32, 3, (int64_t[]){N, L, E});
    }
    const bool self = next() & 1;
    int64_t *pos = malloc(sizeof(int64_t) * (size_t)(N * L)), start[3];
    make_positions(kind, pos, start, N, L);
    mha_rope_scaling s = scaling_of(type, variant);
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = &in.qt;
    a.key = self ? &in.qt : &in.kt;
    a.value = self ? &in.qt : &in.vt;
    a.opts.is_causal = causal;
    mha_rope_init(&a.rope, interleaved ? MHA_ROPE_INTERLEAVED : MHA_ROPE_NEOX);
    if (partial) a.rope.dim = 2 * irand(1, d / 2);
    if (type == MHA_ROPE_SCALING_DYNAMIC && a.rope.dim == 2) a.rope.dim = 4;  // (dim > 2)
    a.rope.theta = next() & 1 ? 10000.0 : 100.0;
    a.rope_scaling = &s;
    if (kind == 1) a.rope_start = start;
    if (kind >= 2) a.rope_positions = pos;
    char desc[240];
    snprintf(desc, sizeof desc,
             "case %d (E %lld H %lld Hkv %lld L %lld N %lld bf %d self %d causal %d %s dim "
             "%lld theta %g, scaling %d/%d, positions %s)",
             id, (long long)E, (long long)H, (long long)Hkv, (long long)L, (long long)N, bf,
             self, causal, interleaved ? "interleaved" : "neox", (long long)a.rope.dim,
             a.rope.theta, (int)type, variant, pos_kinds[kind]);
    const int64_t n = L * N * E;
    float *y[2], *g[2][3];
    mha_module *gm[2];
    for (int i = 0; i < 2; i++) {
        y[i] = malloc(sizeof(float) * (size_t)n);
        for (int j = 0; j < 3; j++) g[i][j] = malloc(sizeof(float) * (size_t)n);
        mha_tensor yt = in.qt, gt[3] = {in.qt, in.qt, in.qt};
        yt.data = y[i];
        for (int j = 0; j < 3; j++) gt[j].data = g[i][j];
        a.impl = i ? MHA_IMPL_FUSED : MHA_IMPL_REFERENCE;
        CHECK_OK(mha_forward(&yt, NULL, m, &a));
        CHECK_OK(mha_module_create(&gm[i], &c));
        CHECK_OK(mha_backward(&gt[0], self ? NULL : &gt[1], self ? NULL : &gt[2], gm[i], m, &a,
                              &in.gyt, false));
    }
    const double e = rel_err(y[0], y[1], n);
    CHECKF(e <= 2e-5, "%s: output rel err %g", desc, e);
    for (int j = 0; j < (self ? 1 : 3); j++) {
        const double eg = rel_err(g[0][j], g[1][j], n);
        CHECKF(eg <= 5e-5, "%s: input grad %d rel err %g", desc, j, eg);
    }
    for (int i = 0; i < mha_module_num_params(gm[0]); i++) {
        mha_param p0, p1;
        CHECK_OK(mha_module_param_at(&p0, gm[0], i));
        CHECK_OK(mha_module_param_at(&p1, gm[1], i));
        const double eg = rel_err(p0.data, p1.data, p0.numel);
        CHECKF(eg <= 5e-5, "%s: grad %s rel err %g", desc, p0.name, eg);
    }
    // positions = rope_start + t: the rope_start bits (both implementations)
    if (kind == 4) {
        for (int i = 0; i < 2; i++) {
            float *y2 = malloc(sizeof(float) * (size_t)n);
            mha_tensor yt = in.qt;
            yt.data = y2;
            mha_forward_args b = a;
            b.rope_positions = NULL;
            b.rope_start = start;
            b.impl = i ? MHA_IMPL_FUSED : MHA_IMPL_REFERENCE;
            CHECK_OK(mha_forward(&yt, NULL, m, &b));
            CHECKF(!memcmp(y2, y[i], sizeof(float) * (size_t)n),
                   "%s: positions = start + t differ from rope_start (impl %d)", desc, i);
            free(y2);
        }
    }
    for (int i = 0; i < 2; i++) {
        free(y[i]);
        for (int j = 0; j < 3; j++) free(g[i][j]);
        mha_module_destroy(gm[i]);
    }
    free(pos);
    test_inputs_free(&in);
    mha_module_destroy(m);
}

// Finite differences of the float64 reference with a scaled RoPE
// (positions given), every input and parameter gradient.
typedef struct fd_problem {
    mha_module *m;
    mha_forward_args a;
    double *q, *k, *v, *gy, *y;
    mha_tensor qt, kt, vt, gyt, yt;
    int64_t n, nk;
} fd_problem;

static double fd_loss(fd_problem *p) {
    CHECK_OK(mha_forward(&p->yt, NULL, p->m, &p->a));
    double s = 0;
    for (int64_t i = 0; i < p->n; i++) s += p->gy[i] * p->y[i];
    return s;
}

static double fd_err(fd_problem *p, void *x, bool f64, const void *g, bool gf64, int64_t n) {
    const double h = 0x1p-10;
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        const double x0 = f64 ? ((double *)x)[i] : ((float *)x)[i];
        const double off[4] = {2 * h, h, -h, -2 * h};
        double f[4];
        for (int t = 0; t < 4; t++) {
            if (f64) ((double *)x)[i] = x0 + off[t];
            else ((float *)x)[i] = (float)(x0 + off[t]);
            f[t] = fd_loss(p);
        }
        if (f64) ((double *)x)[i] = x0;
        else ((float *)x)[i] = (float)x0;
        const double fd = (-f[0] + 8 * f[1] - 8 * f[2] + f[3]) / (12 * h);
        const double an = gf64 ? ((const double *)g)[i] : ((const float *)g)[i];
        num += (fd - an) * (fd - an);
        den += fd * fd;
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

static void fd_case(mha_rope_scaling_type type, int variant, bool interleaved, int kind) {
    enum { E = 8, H = 2, L = 5, N = 2 };
    fd_problem p = {0};
    mha_config c;
    mha_config_init(&c, E, H);
    c.num_kv_heads = 1;
    p.m = random_module(&c, 77);
    p.n = L * N * E, p.nk = L * N * 4;
    p.q = malloc(sizeof(double) * (size_t)p.n), p.gy = malloc(sizeof(double) * (size_t)p.n);
    p.y = malloc(sizeof(double) * (size_t)p.n);
    p.k = malloc(sizeof(double) * (size_t)p.n), p.v = malloc(sizeof(double) * (size_t)p.n);
    for (int64_t i = 0; i < p.n; i++)
        p.q[i] = frand(), p.k[i] = frand(), p.v[i] = frand(), p.gy[i] = frand();
    p.qt = mha_tensor_contiguous(p.q, MHA_F64, 3, (int64_t[]){L, N, E});
    p.kt = mha_tensor_contiguous(p.k, MHA_F64, 3, (int64_t[]){L, N, E});
    p.vt = mha_tensor_contiguous(p.v, MHA_F64, 3, (int64_t[]){L, N, E});
    p.gyt = mha_tensor_contiguous(p.gy, MHA_F64, 3, (int64_t[]){L, N, E});
    p.yt = mha_tensor_contiguous(p.y, MHA_F64, 3, (int64_t[]){L, N, E});
    int64_t pos[N * L], start[N];
    make_positions(kind, pos, start, N, L);
    for (int64_t i = 0; i < N * L; i++) pos[i] += 20;  // (dynamic: above its length)
    mha_rope_scaling s = scaling_of(type, variant);
    if (type == MHA_ROPE_SCALING_YARN) s.original_max_position = 4;  // (a ramp in dim 4)
    mha_forward_args_init(&p.a);
    p.a.query = &p.qt, p.a.key = &p.kt, p.a.value = &p.vt;
    p.a.opts.is_causal = true;
    mha_rope_init(&p.a.rope, interleaved ? MHA_ROPE_INTERLEAVED : MHA_ROPE_NEOX);
    p.a.rope_positions = pos;
    p.a.rope_scaling = &s;
    double gq[N * L * E], gk[N * L * E], gv[N * L * E];
    mha_tensor gqt = p.qt, gkt = p.kt, gvt = p.vt;
    gqt.data = gq, gkt.data = gk, gvt.data = gv;
    mha_module *gm = NULL;
    CHECK_OK(mha_module_create(&gm, &c));
    CHECK_OK(mha_backward(&gqt, &gkt, &gvt, gm, p.m, &p.a, &p.gyt, false));
    const double tol = 1e-6;
    double e = fd_err(&p, p.q, true, gq, true, p.n);
    CHECKF(e < tol, "fd scaling %d/%d interleaved %d positions %s: grad_query %g", (int)type,
           variant, interleaved, pos_kinds[kind], e);
    e = fd_err(&p, p.k, true, gk, true, p.n);
    CHECKF(e < tol, "fd scaling %d/%d: grad_key %g", (int)type, variant, e);
    e = fd_err(&p, p.v, true, gv, true, p.n);
    CHECKF(e < tol, "fd scaling %d/%d: grad_value %g", (int)type, variant, e);
    for (int i = 0; i < mha_module_num_params(p.m); i++) {
        mha_param pp, gp;
        CHECK_OK(mha_module_param_at(&pp, p.m, i));
        CHECK_OK(mha_module_param_at(&gp, gm, i));
        e = fd_err(&p, pp.data, false, gp.data, false, pp.numel);
        CHECKF(e < tol, "fd scaling %d/%d: grad %s %g", (int)type, variant, pp.name, e);
    }
    mha_module_destroy(gm);
    mha_module_destroy(p.m);
    free(p.q), free(p.k), free(p.v), free(p.gy), free(p.y);
}

// mha_forward_cached with positions (and a scaling), chunk by chunk, equals
// the full causal forward with the same positions.
static void cached_case(int id) {
    const int64_t Hkv = irand(1, 2), H = Hkv * irand(1, 2), d = 2 * irand(2, 6), E = H * d,
                  T = irand(3, 60), N = irand(1, 3);
    const mha_rope_scaling_type type = (mha_rope_scaling_type)(id % 5);
    const int kind = 2 + (id / 5) % 3;  // leftpad, repeated, start as positions
    mha_config c;
    mha_config_init(&c, E, H);
    c.num_kv_heads = Hkv;
    mha_module *m = random_module(&c, 100 + (uint64_t)id);
    const int64_t n = T * N * E;
    float *x = malloc(sizeof(float) * (size_t)n), *yf = malloc(sizeof(float) * (size_t)n),
          *yc = malloc(sizeof(float) * (size_t)n);
    for (int64_t i = 0; i < n; i++) x[i] = frand();
    int64_t *pos = malloc(sizeof(int64_t) * (size_t)(N * T)), start[3];
    make_positions(kind, pos, start, N, T);
    mha_rope_scaling s = scaling_of(type, id / 15 % 2);
    mha_tensor xt = mha_tensor_contiguous(x, MHA_F32, 3, (int64_t[]){T, N, E});
    mha_tensor yt = mha_tensor_contiguous(yf, MHA_F32, 3, (int64_t[]){T, N, E});
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = a.key = a.value = &xt;
    a.opts.is_causal = true;
    a.impl = MHA_IMPL_FUSED;
    mha_rope_init(&a.rope, id & 1 ? MHA_ROPE_INTERLEAVED : MHA_ROPE_NEOX);
    a.rope_positions = pos;
    a.rope_scaling = &s;
    CHECK_OK(mha_forward(&yt, NULL, m, &a));
    // dynamic: its frequencies come from each call's largest position, so
    // one chunk (the full call's seq)
    const int64_t chunk = type == MHA_ROPE_SCALING_DYNAMIC ? T : irand(1, 7);
    mha_kv_cache *cache = NULL;
    CHECK_OK(mha_kv_cache_create(&cache, N, Hkv, d, d, T, MHA_KV_F32));
    int64_t *pc = malloc(sizeof(int64_t) * (size_t)(N * T));
    for (int64_t t0 = 0; t0 < T; t0 += chunk) {
        const int64_t k = T - t0 < chunk ? T - t0 : chunk;
        for (int64_t b = 0; b < N; b++)
            for (int64_t t = 0; t < k; t++) pc[b * k + t] = pos[b * T + t0 + t];
        mha_tensor qc = mha_tensor_contiguous(x + t0 * N * E, MHA_F32, 3, (int64_t[]){k, N, E});
        mha_tensor oc = mha_tensor_contiguous(yc + t0 * N * E, MHA_F32, 3, (int64_t[]){k, N, E});
        mha_forward_args ac = a;
        ac.query = ac.key = ac.value = &qc;
        ac.opts.is_causal = false;
        ac.rope_positions = pc;
        CHECK_OK(mha_forward_cached(&oc, m, &ac, cache));
    }
    const double e = rel_err(yf, yc, n);
    CHECKF(e <= 2e-5,
           "cached case %d (E %lld H %lld Hkv %lld T %lld N %lld chunk %lld scaling "
           "%d positions %s): rel err %g",
           id, (long long)E, (long long)H, (long long)Hkv, (long long)T, (long long)N,
           (long long)chunk, (int)type, pos_kinds[kind], e);
    // the cached default positions (len + t) with a scaling = the full
    // forward without positions
    if (type != MHA_ROPE_SCALING_DYNAMIC) {
        a.rope_positions = NULL;
        CHECK_OK(mha_forward(&yt, NULL, m, &a));
        for (int64_t b = 0; b < N; b++) CHECK_OK(mha_kv_cache_truncate(cache, b, 0));
        for (int64_t t0 = 0; t0 < T; t0 += 2) {
            const int64_t k = T - t0 < 2 ? T - t0 : 2;
            mha_tensor qc = mha_tensor_contiguous(x + t0 * N * E, MHA_F32, 3,
                                                  (int64_t[]){k, N, E});
            mha_tensor oc = mha_tensor_contiguous(yc + t0 * N * E, MHA_F32, 3,
                                                  (int64_t[]){k, N, E});
            mha_forward_args ac = a;
            ac.query = ac.key = ac.value = &qc;
            CHECK_OK(mha_forward_cached(&oc, m, &ac, cache));
        }
        const double e2 = rel_err(yf, yc, n);
        CHECKF(e2 <= 2e-5, "cached case %d, default positions: rel err %g", id, e2);
    }
    mha_kv_cache_destroy(cache);
    free(x), free(yf), free(yc), free(pos), free(pc);
    mha_module_destroy(m);
}

// The saved state: the backward with the forward's positions and scaling
// uses it (the recomputing backward's bits); other ones are refused.
static void test_saved(void) {
    enum { E = 16, H = 2, L = 20, N = 2 };
    mha_config c;
    mha_config_init(&c, E, H);
    mha_module *m = random_module(&c, 5);
    test_inputs in;
    test_inputs_make(&in, L, L, N, E, E, E, 4);
    int64_t pos[N * L], pos2[N * L], start[N];
    make_positions(2, pos, start, N, L);
    memcpy(pos2, pos, sizeof pos);
    mha_rope_scaling s = scaling_of(MHA_ROPE_SCALING_YARN, 1);
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = a.key = a.value = &in.qt;
    a.opts.is_causal = true;
    a.impl = MHA_IMPL_FUSED;
    mha_rope_init(&a.rope, MHA_ROPE_NEOX);
    a.rope_positions = pos;
    a.rope_scaling = &s;
    float y[L * N * E], g0[L * N * E], g1[L * N * E];
    mha_tensor yt = in.qt, gt0 = in.qt, gt1 = in.qt;
    yt.data = y, gt0.data = g0, gt1.data = g1;
    CHECK_OK(mha_forward(&yt, NULL, m, &a));
    CHECK_OK(mha_backward(&gt0, NULL, NULL, NULL, m, &a, &in.gyt, false));
    mha_saved *sv = NULL;
    CHECK_OK(mha_saved_create(&sv));
    a.save = sv;
    CHECK_OK(mha_forward(&yt, NULL, m, &a));
    CHECK_OK(mha_backward(&gt1, NULL, NULL, NULL, m, &a, &in.gyt, false));
    CHECK(!memcmp(g0, g1, sizeof g0));
    mha_forward_args b = a;
    b.rope_positions = pos2;  // (other positions: another forward)
    CHECK_FAILS(mha_backward(&gt1, NULL, NULL, NULL, m, &b, &in.gyt, false),
                MHA_ERR_INVALID_ARG);
    mha_rope_scaling s2 = s;
    s2.factor = 4.0;
    b = a;
    b.rope_scaling = &s2;
    CHECK_FAILS(mha_backward(&gt1, NULL, NULL, NULL, m, &b, &in.gyt, false),
                MHA_ERR_INVALID_ARG);
    b.rope_scaling = NULL;
    CHECK_FAILS(mha_backward(&gt1, NULL, NULL, NULL, m, &b, &in.gyt, false),
                MHA_ERR_INVALID_ARG);
    s2 = s;  // the same values elsewhere: the same forward
    b.rope_scaling = &s2;
    CHECK_OK(mha_backward(&gt1, NULL, NULL, NULL, m, &b, &in.gyt, false));
    CHECK(!memcmp(g0, g1, sizeof g0));
    mha_saved_destroy(sv);
    test_inputs_free(&in);
    mha_module_destroy(m);
}

// mha_diag_create's logit_max (every row, no masks) = the largest of the
// reference's traced scaled scores, with positions and a scaling.
typedef struct trace_max {
    double m[4];
} trace_max;
static void trace_fn(void *user, const char *step, int64_t b, int64_t h, const mha_tensor *t) {
    (void)b;
    if (strcmp(step, "scaled_scores") != 0) return;
    trace_max *tm = user;
    const float *p = t->data;
    for (int64_t i = 0; i < mha_tensor_numel(t); i++) tm->m[h] = fmax(tm->m[h], p[i]);
}

static void test_diag(void) {
    enum { E = 16, H = 4, L = 30, N = 2 };
    mha_config c;
    mha_config_init(&c, E, H);
    c.num_kv_heads = 2;
    mha_module *m = random_module(&c, 9);
    test_inputs in;
    test_inputs_make(&in, L, L, N, E, E, E, 4);
    for (int64_t i = 0; i < L * N * E; i++) in.q[i] *= 3.0f;
    int64_t pos[N * L], start[N];
    make_positions(3, pos, start, N, L);
    for (int t = 0; t < 2; t++) {
        mha_rope_scaling s = scaling_of(t ? MHA_ROPE_SCALING_YARN : MHA_ROPE_SCALING_LLAMA3, 0);
        mha_forward_args a;
        mha_forward_args_init(&a);
        a.query = a.key = a.value = &in.qt;
        mha_rope_init(&a.rope, MHA_ROPE_NEOX);
        a.rope_positions = pos;
        a.rope_scaling = &s;
        mha_diag_options o;
        mha_diag_options_init(&o);
        o.max_rows = 0;
        mha_diag *dg = NULL;
        CHECK_OK(mha_diag_create(&dg, m, &a, &o));
        trace_max tm = {{-INFINITY, -INFINITY, -INFINITY, -INFINITY}};
        float y[L * N * E];
        mha_tensor yt = in.qt;
        yt.data = y;
        a.impl = MHA_IMPL_REFERENCE;
        a.trace = trace_fn;
        a.trace_user = &tm;
        CHECK_OK(mha_forward(&yt, NULL, m, &a));
        for (int64_t h = 0; dg && h < H; h++) {
            const double lm = mha_diag_head(dg, h)->logit_max;
            CHECKF(fabs(lm - tm.m[h]) <= 1e-5 * (1 + fabs(lm)),
                   "diag scaling %d head %lld: logit_max %g, trace %g", t, (long long)h, lm,
                   tm.m[h]);
        }
        mha_diag_destroy(dg);
    }
    test_inputs_free(&in);
    mha_module_destroy(m);
}

// mha_rope_apply on (B, H, T, D) views.
static void test_apply_ex(void) {
    enum { B = 2, H = 3, T = 9, D = 10 };
    double x[B * H * T * D], x0[B * H * T * D], x1[B * H * T * D];
    for (int i = 0; i < B * H * T * D; i++) x0[i] = frand();
    mha_tensor xt = mha_tensor_contiguous(x, MHA_F64, 4, (int64_t[]){B, H, T, D});
    mha_rope r;
    mha_rope_init(&r, MHA_ROPE_INTERLEAVED);
    r.dim = 8;
    int64_t start[B] = {4, 11}, pos[B * T];
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) pos[b * T + t] = start[b] + t;
    memcpy(x, x0, sizeof x);
    CHECK_OK(mha_rope_apply(&xt, &r, NULL, start, NULL, 0, false));
    memcpy(x1, x, sizeof x);
    memcpy(x, x0, sizeof x);
    CHECK_OK(mha_rope_apply(&xt, &r, NULL, NULL, pos, 0, false));
    CHECK(!memcmp(x, x1, sizeof x));
    // YaRN: inverse after forward = af^2 x (af R(-a) af R(a)); the pass-through
    // features untouched
    mha_rope_scaling s = scaling_of(MHA_ROPE_SCALING_YARN, 0);
    s.attention_factor = 1.5;
    memcpy(x, x0, sizeof x);
    CHECK_OK(mha_rope_apply(&xt, &r, &s, start, NULL, 0, false));
    CHECK_OK(mha_rope_apply(&xt, &r, &s, start, NULL, 0, true));
    double e = 0;
    for (int i = 0; i < B * H * T * D; i++)
        e = fmax(e, fabs(x[i] - (i % D < 8 ? 2.25 : 1.0) * x0[i]));
    CHECKF(e <= 1e-14, "apply_ex yarn inverse: err %g", e);
    // dynamic: seq 0 takes the positions' largest + 1; the same as that seq
    mha_rope_scaling dy = scaling_of(MHA_ROPE_SCALING_DYNAMIC, 0);
    memcpy(x, x0, sizeof x);
    CHECK_OK(mha_rope_apply(&xt, &r, &dy, start, NULL, 0, false));
    memcpy(x1, x, sizeof x);
    memcpy(x, x0, sizeof x);
    CHECK_OK(mha_rope_apply(&xt, &r, &dy, start, NULL, 11 + T, false));
    CHECK(!memcmp(x, x1, sizeof x));
    memcpy(x, x0, sizeof x);
    CHECK_OK(mha_rope_apply(&xt, &r, &dy, start, NULL, 100, false));
    CHECK(memcmp(x, x1, sizeof x) != 0);
    pos[3] = -1;
    CHECK_FAILS(mha_rope_apply(&xt, &r, &dy, NULL, pos, 0, false), MHA_ERR_INVALID_ARG);
    CHECK(strstr(mha_last_error(), "positions[3] = -1") != NULL);
    mha_rope none;
    mha_rope_init(&none, MHA_ROPE_NONE);
    CHECK_FAILS(mha_rope_apply(&xt, &none, &dy, NULL, NULL, 0, false), MHA_ERR_INVALID_ARG);
    CHECK_OK(mha_rope_apply(&xt, &none, NULL, NULL, NULL, 0, false));
}

// What a forward refuses, naming the problem.
static void test_refusals(void) {
    enum { E = 8, H = 2, L = 6, S = 4, N = 2 };
    mha_config c;
    mha_config_init(&c, E, H);
    mha_module *m = random_module(&c, 3);
    test_inputs in;
    test_inputs_make(&in, L, S, N, E, E, E, 4);
    float y[L * N * E];
    mha_tensor yt = in.qt;
    yt.data = y;
    int64_t pos[N * L];
    for (int i = 0; i < N * L; i++) pos[i] = i;
    mha_rope_scaling s = scaling_of(MHA_ROPE_SCALING_LINEAR, 0);
    for (int impl = 0; impl < 2; impl++) {
        mha_forward_args a;
        mha_forward_args_init(&a);
        a.impl = impl ? MHA_IMPL_FUSED : MHA_IMPL_REFERENCE;
        a.query = a.key = a.value = &in.qt;
        a.rope_scaling = &s;  // without RoPE: refused
        CHECK_FAILS(mha_forward(&yt, NULL, m, &a), MHA_ERR_INVALID_ARG);
        CHECK(strstr(mha_last_error(), "linear") != NULL);
        a.rope_scaling = NULL;
        a.rope_positions = pos;  // without RoPE: ignored (as rope_start)
        CHECK_OK(mha_forward(&yt, NULL, m, &a));
        mha_rope_init(&a.rope, MHA_ROPE_NEOX);
        a.rope_scaling = &s;
        CHECK_OK(mha_forward(&yt, NULL, m, &a));
        pos[7] = -2;
        CHECK_FAILS(mha_forward(&yt, NULL, m, &a), MHA_ERR_INVALID_ARG);
        CHECK(strstr(mha_last_error(), "rope_positions[7] = -2") != NULL);
        pos[7] = 7;
        a.key = &in.kt;  // cross-attention (S != L) with positions
        a.value = &in.vt;
        CHECK_FAILS(mha_forward(&yt, NULL, m, &a), MHA_ERR_INVALID_ARG);
        CHECK(strstr(mha_last_error(), "cross-attention") != NULL);
        a.rope_positions = NULL;  // with rope_start: fine
        CHECK_OK(mha_forward(&yt, NULL, m, &a));
        s.factor = -1.0;
        CHECK_FAILS(mha_forward(&yt, NULL, m, &a), MHA_ERR_INVALID_ARG);
        CHECK(strstr(mha_last_error(), "factor") != NULL);
        s.factor = 4.0;
    }
    // mha_forward_cached: the same checks
    mha_kv_cache *cache = NULL;
    CHECK_OK(mha_kv_cache_create(&cache, N, H, E / H, E / H, 16, MHA_KV_F32));
    mha_forward_args a;
    mha_forward_args_init(&a);
    a.query = a.key = a.value = &in.qt;
    mha_rope_init(&a.rope, MHA_ROPE_NEOX);
    pos[0] = -1;
    a.rope_positions = pos;
    CHECK_FAILS(mha_forward_cached(&yt, m, &a, cache), MHA_ERR_INVALID_ARG);
    CHECK(mha_kv_cache_length(cache, 0) == 0);
    pos[0] = 0;
    mha_rope_scaling bad = scaling_of(MHA_ROPE_SCALING_LLAMA3, 0);
    bad.high_freq_factor = 0.5;
    a.rope_scaling = &bad;
    CHECK_FAILS(mha_forward_cached(&yt, m, &a, cache), MHA_ERR_INVALID_ARG);
    CHECK(strstr(mha_last_error(), "high_freq_factor") != NULL);
    CHECK(mha_kv_cache_length(cache, 0) == 0);
    mha_kv_cache_destroy(cache);
    test_inputs_free(&in);
    mha_module_destroy(m);
}

int main(void) {
    seed_rng(17);
    test_api();
    for (int i = 0; i < 100; i++) module_case(i);
    for (int t = 0; t < 5; t++)
        for (int v = 0; v < 2; v++) fd_case((mha_rope_scaling_type)t, v, (t + v) & 1, 2 + v);
    for (int i = 0; i < 40; i++) cached_case(i);
    test_saved();
    test_diag();
    test_apply_ex();
    test_refusals();
    return check_summary("test_rope");
}
