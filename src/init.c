// init.c: seeded, reproducible weight initialisation.
//
// The generator is splitmix64 (one stream per call of mha_module_init,
// consumed in parameter order); normals come from Box-Muller in double.
// Values are reproducible on every machine for a given seed, but are not
// the numbers torch's generator would draw: the distributions are the same.
//
// Fans follow torch.nn.init._calculate_fan_in_and_fan_out: for a 2-D
// (out, in) matrix fan_in = in, fan_out = out (the packed in_proj_weight
// (Eq + 2 Ekv, E) as one matrix); for bias_k (1, 1, Ekv) fan_in = fan_out =
// Ekv. (Eq = H d, the query's width: E unless head_dim is set.)
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "module.h"

#define MHA__TWO_PI 6.283185307179586476925286766559

typedef struct rng {
    uint64_t state;
    int has_spare;
    double spare;
} rng;

static uint64_t rng_next(rng *r) {
    uint64_t z = (r->state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// Uniform in [0, 1) with 53 random bits.
static double rng_uniform(rng *r) { return (double)(rng_next(r) >> 11) * 0x1p-53; }

static double rng_normal(rng *r) {
    if (r->has_spare) {
        r->has_spare = 0;
        return r->spare;
    }
    double u1, u2;
    do u1 = rng_uniform(r);
    while (u1 <= 0.0);
    u2 = rng_uniform(r);
    double rad = sqrt(-2.0 * log(u1));
    r->spare = rad * sin(MHA__TWO_PI * u2);
    r->has_spare = 1;
    return rad * cos(MHA__TWO_PI * u2);
}

static void fill_uniform(float *x, int64_t n, double bound, rng *r) {
    for (int64_t i = 0; i < n; i++) x[i] = (float)((2.0 * rng_uniform(r) - 1.0) * bound);
}

static void fill_normal(float *x, int64_t n, double std, rng *r) {
    for (int64_t i = 0; i < n; i++) x[i] = (float)(rng_normal(r) * std);
}

// torch.nn.init.orthogonal_ on a (rows, cols) matrix: draw a normal matrix,
// take the Q of its QR factorisation (of its transpose when rows < cols) with
// the signs that make diag(R) positive, scale by gain. Modified Gram-Schmidt
// in double gives exactly that Q (R's diagonal is the positive norms).
// a: rows * cols doubles of scratch.
static void fill_orthogonal(float *w, int64_t rows, int64_t cols, double gain, rng *r,
                            double *a) {
    int transpose = rows < cols;
    int64_t m = transpose ? cols : rows;  // long side
    int64_t n = transpose ? rows : cols;  // short side: n columns of length m
    // a[c*m + i]: column c of the (m, n) matrix, stored column by column
    for (int64_t i = 0; i < m * n; i++) a[i] = rng_normal(r);
    for (int64_t c = 0; c < n; c++) {
        double *col = a + c * m;
        for (int64_t p = 0; p < c; p++) {
            const double *q = a + p * m;
            double dot = 0.0;
            for (int64_t i = 0; i < m; i++) dot += q[i] * col[i];
            for (int64_t i = 0; i < m; i++) col[i] -= dot * q[i];
        }
        double norm = 0.0;
        for (int64_t i = 0; i < m; i++) norm += col[i] * col[i];
        norm = sqrt(norm);
        if (norm == 0.0) norm = 1.0;  // probability zero; keeps it finite
        for (int64_t i = 0; i < m; i++) col[i] /= norm;
    }
    // Write back (rows, cols) row-major: w[i][j] = Q[i][j] or Q^T.
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < cols; j++)
            w[i * cols + j] = (float)(gain * (transpose ? a[i * m + j] : a[j * m + i]));
}

// One weight matrix (rows, cols) under a scheme; ortho: rows * cols doubles
// of scratch for MHA_INIT_ORTHOGONAL.
static mha_status init_matrix(float *w, int64_t rows, int64_t cols, const mha_init_options *o,
                              rng *r, double *ortho) {
    int64_t n = rows * cols;
    double fan_in = (double)cols, fan_out = (double)rows;
    switch (o->scheme) {
    case MHA_INIT_XAVIER_UNIFORM:
        fill_uniform(w, n, o->gain * sqrt(6.0 / (fan_in + fan_out)), r);
        return MHA_OK;
    case MHA_INIT_XAVIER_NORMAL:
        fill_normal(w, n, o->gain * sqrt(2.0 / (fan_in + fan_out)), r);
        return MHA_OK;
    case MHA_INIT_NORMAL: fill_normal(w, n, o->std, r); return MHA_OK;
    case MHA_INIT_ORTHOGONAL: fill_orthogonal(w, rows, cols, o->gain, r, ortho); return MHA_OK;
    case MHA_INIT_ZEROS: memset(w, 0, (size_t)n * sizeof *w); return MHA_OK;
    }
    return mha__fail(MHA_ERR_INVALID_ARG, "unknown init scheme %d", (int)o->scheme);
}

void mha_init_options_init(mha_init_options *opt) {
    if (!opt) return;
    opt->scheme = MHA_INIT_XAVIER_UNIFORM;
    opt->gain = 1.0;
    opt->std = 0.02;
    opt->seed = 0;
}

mha_status mha_init_scheme_from_name(mha_init_scheme *out, const char *name) {
    static const char *names[] = {"xavier_uniform", "xavier_normal", "normal", "orthogonal",
                                  "zeros"};
    if (!out || !name)
        return mha__fail(MHA_ERR_INVALID_ARG, "mha_init_scheme_from_name: NULL argument");
    for (int i = 0; i < 5; i++) {
        if (strcmp(name, names[i]) == 0) {
            *out = (mha_init_scheme)i;
            return MHA_OK;
        }
    }
    return mha__fail(MHA_ERR_INVALID_ARG,
                     "unknown init scheme \"%.64s\" (expected xavier_uniform, "
                     "xavier_normal, normal, orthogonal or zeros)",
                     name);
}

mha_status mha_module_init(mha_module *m, const mha_init_options *o) {
    if (!m || !o) return mha__fail(MHA_ERR_INVALID_ARG, "mha_module_init: NULL argument");
    if ((unsigned)o->scheme > MHA_INIT_ZEROS)
        return mha__fail(MHA_ERR_INVALID_ARG, "unknown init scheme %d", (int)o->scheme);
    if (!isfinite(o->gain) || !isfinite(o->std) || o->std < 0.0)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "init: gain must be finite and std finite and >= 0, "
                         "got gain %g, std %g",
                         o->gain, o->std);
    if (m->wdt != MHA_F32) {
        // Half weights: the same values as a float32 module's, rounded.
        mha_module *f;
        mha_status st = mha_module_convert(&f, m, MHA_F32);
        if (!st) st = mha_module_init(f, o);
        if (!st) mha__copy_params(m, f);
        mha_module_destroy(f);
        return st;
    }
    const int64_t E = m->cfg.embed_dim, Eq = m->q_dim, Ekv = m->kv_dim, H = m->cfg.num_heads;
    // Orthogonal: scratch for the largest matrix, allocated before anything
    // changes (on failure the module keeps its values).
    double *ortho = NULL;
    if (o->scheme == MHA_INIT_ORTHOGONAL) {
        int64_t big = m->packed ? (Eq + 2 * Ekv) * E : Eq * E;  // (out_proj: E x Eq)
        if (!m->packed) {
            if (Ekv * m->cfg.kdim > big) big = Ekv * m->cfg.kdim;
            if (Ekv * m->cfg.vdim > big) big = Ekv * m->cfg.vdim;
        }
        ortho = mha__malloc(sizeof(double) * (size_t)big);
        if (!ortho)
            return mha__fail(MHA_ERR_NOMEM,
                             "orthogonal init: out of memory for a %lld-double scratch",
                             (long long)big);
    }
    // Gates and sinks (no random draws): static gates open (1), dynamic
    // W_g, b_g zero (every gate sigmoid(0) = 0.5); sinks 0; qk_norm weights 1.
    if (m->sinks) memset(m->sinks, 0, (size_t)H * sizeof(float));
    mha__qk_norm_reset(m);  // qk_norm weights 1
    if (m->head_gate)
        for (int64_t h = 0; h < H; h++) m->head_gate[h] = 1.0f;
    if (m->gate_weight) {
        memset(m->gate_weight, 0, (size_t)(H * E) * sizeof(float));
        memset(m->gate_bias, 0, (size_t)H * sizeof(float));
    }
    rng r = {o->seed, 0, 0.0};
    mha_status st;
    // In-projection: the packed (Eq + 2 Ekv, E) matrix as one, or each matrix.
    if (m->packed) {
        st = init_matrix(m->in_proj_weight, Eq + 2 * Ekv, E, o, &r, ortho);
    } else {
        st = init_matrix(m->q_weight, Eq, E, o, &r, ortho);
        if (!st) st = init_matrix(m->k_weight, Ekv, m->cfg.kdim, o, &r, ortho);
        if (!st) st = init_matrix(m->v_weight, Ekv, m->cfg.vdim, o, &r, ortho);
    }
    if (st) goto done;
    if (m->in_proj_bias) memset(m->in_proj_bias, 0, (size_t)(Eq + 2 * Ekv) * sizeof(float));
    if (m->out_bias) memset(m->out_bias, 0, (size_t)E * sizeof(float));
    // bias_k, bias_v: xavier_normal (fan_in = fan_out = Ekv) under the
    // default, else the scheme itself on a (1, Ekv) matrix.
    if (m->bias_k) {
        if (o->scheme == MHA_INIT_XAVIER_UNIFORM) {
            fill_normal(m->bias_k, Ekv, 1.0 / sqrt((double)Ekv), &r);
            fill_normal(m->bias_v, Ekv, 1.0 / sqrt((double)Ekv), &r);
        } else {
            mha_init_options ob = *o;
            if (ob.scheme == MHA_INIT_XAVIER_NORMAL) {
                // torch's fans for a (1, 1, Ekv) tensor are (Ekv, Ekv), not
                // (Ekv, 1)
                fill_normal(m->bias_k, Ekv, o->gain / sqrt((double)Ekv), &r);
                fill_normal(m->bias_v, Ekv, o->gain / sqrt((double)Ekv), &r);
            } else {
                st = init_matrix(m->bias_k, 1, Ekv, &ob, &r, ortho);
                if (!st) st = init_matrix(m->bias_v, 1, Ekv, &ob, &r, ortho);
                if (st) goto done;
            }
        }
    }
    // out_proj.weight (E, Eq): nn.Linear's kaiming_uniform(a = sqrt(5))
    // under the default, i.e. U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in =
    // Eq; else the scheme.
    if (o->scheme == MHA_INIT_XAVIER_UNIFORM)
        fill_uniform(m->out_weight, E * Eq, 1.0 / sqrt((double)Eq), &r);
    else st = init_matrix(m->out_weight, E, Eq, o, &r, ortho);
done:
    mha__packs_stale(m);  // (whatever was written)
    free(ortho);
    return st;
}
