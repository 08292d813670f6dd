// tiny.c: the tiny transformer of tiny.h: our own forward/backward for the
// embedding, LayerNorm, linear, GELU and cross-entropy layers, libmha's
// attention (mha_forward / mha_backward) in every block.
//
// Memory: four float allocations, each carved into named pointers with the
// shapes in comments (layout_params, layout_acts): parameters, their
// gradients, activations, activation gradients; plus one int32 block for
// the token/target copies, and the attention modules, which libmha owns.
// Forward and backward never allocate (mha_forward / mha_backward allocate
// their own scratch per call).
//
// Threads: the linear layers split output rows over OpenMP threads; every
// output element is summed by one thread in a fixed order, so results do not
// depend on the thread count.
#include "tiny.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define LN_EPS 1e-5f

// ---------------------------------------------------------------------------
// LayerNorm

void tiny_layernorm_forward(float *out, float *mean, float *rstd, const float *inp,
                            const float *w, const float *b, int64_t N, int64_t C) {
    for (int64_t n = 0; n < N; n++) {
        const float *x = inp + n * C;  // x: (C)
        double s = 0.0;
        for (int64_t i = 0; i < C; i++) s += x[i];
        float m = (float)(s / (double)C);
        double v = 0.0;
        for (int64_t i = 0; i < C; i++) v += (double)(x[i] - m) * (x[i] - m);
        float r = 1.0f / sqrtf((float)(v / (double)C) + LN_EPS);
        float *o = out + n * C;
        for (int64_t i = 0; i < C; i++) o[i] = (x[i] - m) * r * w[i] + b[i];
        mean[n] = m;
        rstd[n] = r;
    }
}

void tiny_layernorm_backward(float *dinp, float *dw, float *db, const float *dout,
                             const float *inp, const float *w, const float *mean,
                             const float *rstd, int64_t N, int64_t C) {
    for (int64_t n = 0; n < N; n++) {
        const float *x = inp + n * C, *dy = dout + n * C;
        float *dx = dinp + n * C;
        float m = mean[n], r = rstd[n];
        // forward: o[i] = (x[i] - m) * r * w[i] + b[i]; with xhat = (x-m)r
        //   db[i] += dy[i], dw[i] += xhat[i] dy[i], dxhat[i] = w[i] dy[i]
        //   dx[i] += r (dxhat[i] - mean(dxhat) - xhat[i] mean(dxhat xhat))
        double s1 = 0.0, s2 = 0.0;
        for (int64_t i = 0; i < C; i++) {
            float xh = (x[i] - m) * r, dxh = w[i] * dy[i];
            s1 += dxh;
            s2 += (double)dxh * xh;
        }
        float m1 = (float)(s1 / (double)C), m2 = (float)(s2 / (double)C);
        for (int64_t i = 0; i < C; i++) {
            float xh = (x[i] - m) * r, dxh = w[i] * dy[i];
            db[i] += dy[i];
            dw[i] += xh * dy[i];
            dx[i] += r * (dxh - m1 - xh * m2);
        }
    }
}

// ---------------------------------------------------------------------------
// Linear

// Dot product with 8 independent partial sums, so the compiler vectorises
// it without -ffast-math; the summation order is fixed.
static float dot(const float *a, const float *b, int64_t n) {
    float acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) acc[k] += a[i + k] * b[i + k];
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

void tiny_linear_forward(float *out, const float *inp, const float *W, const float *b,
                         int64_t N, int64_t IC, int64_t OC) {
#pragma omp parallel for schedule(static) if (N * IC * OC > 65536)
    for (int64_t n = 0; n < N; n++) {
        const float *x = inp + n * IC;  // x: (IC)
        float *o = out + n * OC;        // o: (OC)
        for (int64_t j = 0; j < OC; j++) o[j] = dot(x, W + j * IC, IC) + (b ? b[j] : 0.0f);
    }
}

void tiny_linear_backward(float *dinp, float *dW, float *db, const float *dout,
                          const float *inp, const float *W, int64_t N, int64_t IC, int64_t OC) {
    // forward: out[n, j] = sum_i inp[n, i] W[j, i] + b[j]
    //   dinp[n, i] += sum_j dout[n, j] W[j, i]
    if (dinp) {
#pragma omp parallel for schedule(static) if (N * IC * OC > 65536)
        for (int64_t n = 0; n < N; n++) {
            float *dx = dinp + n * IC;
            const float *dy = dout + n * OC;
            int64_t j = 0;
            for (; j + 4 <= OC; j += 4) {  // 4 rows of W per pass over dx
                float g0 = dy[j], g1 = dy[j + 1], g2 = dy[j + 2], g3 = dy[j + 3];
                const float *w0 = W + j * IC, *w1 = w0 + IC, *w2 = w1 + IC, *w3 = w2 + IC;
                for (int64_t i = 0; i < IC; i++)
                    dx[i] += (g0 * w0[i] + g1 * w1[i]) + (g2 * w2[i] + g3 * w3[i]);
            }
            for (; j < OC; j++) {
                float g = dy[j];
                const float *w = W + j * IC;
                for (int64_t i = 0; i < IC; i++) dx[i] += g * w[i];
            }
        }
    }
    //   dW[j, i] += sum_n dout[n, j] inp[n, i];  db[j] += sum_n dout[n, j]
#pragma omp parallel for schedule(static) if (N * IC * OC > 65536)
    for (int64_t j = 0; j < OC; j++) {
        float *dw = dW + j * IC;
        float sb = 0.0f;
        int64_t n = 0;
        for (; n + 4 <= N; n += 4) {  // 4 rows of inp per pass over dw
            float g0 = dout[n * OC + j], g1 = dout[(n + 1) * OC + j],
                  g2 = dout[(n + 2) * OC + j], g3 = dout[(n + 3) * OC + j];
            const float *x0 = inp + n * IC, *x1 = x0 + IC, *x2 = x1 + IC, *x3 = x2 + IC;
            sb += (g0 + g1) + (g2 + g3);
            for (int64_t i = 0; i < IC; i++)
                dw[i] += (g0 * x0[i] + g1 * x1[i]) + (g2 * x2[i] + g3 * x3[i]);
        }
        for (; n < N; n++) {
            float g = dout[n * OC + j];
            const float *x = inp + n * IC;
            sb += g;
            for (int64_t i = 0; i < IC; i++) dw[i] += g * x[i];
        }
        if (db) db[j] += sb;
    }
}

// ---------------------------------------------------------------------------
// GELU, tanh approximation

#define GELU_K 0.7978845608028654f  // sqrt(2 / pi)

// tanh(u) = (e^2u - 1) / (e^2u + 1): expf is several times faster than
// tanhf, and the absolute error (~1e-7 near 0, where e^2u - 1 cancels)
// is below what GELU's 0.5 x (1 + tanh) can show in float32.
static inline float tanh_fast(float u) {
    if (u > 9.0f) return 1.0f;
    if (u < -9.0f) return -1.0f;
    float e = expf(2.0f * u);
    return (e - 1.0f) / (e + 1.0f);
}

void tiny_gelu_forward(float *out, const float *inp, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        float x = inp[i];
        out[i] = 0.5f * x * (1.0f + tanh_fast(GELU_K * (x + 0.044715f * x * x * x)));
    }
}

void tiny_gelu_backward(float *dinp, const float *inp, const float *dout, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        // forward: out = 0.5 x (1 + tanh(u)), u = K (x + 0.044715 x^3)
        //   dout/dx = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) K (1 + 3 0.044715 x^2)
        float x = inp[i];
        float th = tanh_fast(GELU_K * (x + 0.044715f * x * x * x));
        float g = 0.5f * (1.0f + th) +
                  0.5f * x * (1.0f - th * th) * GELU_K * (1.0f + 0.134145f * x * x);
        dinp[i] += g * dout[i];
    }
}

// ---------------------------------------------------------------------------
// Embedding

void tiny_embedding_forward(float *out, const int32_t *tokens, const float *wte,
                            const float *wpe, int64_t B, int64_t T, int64_t C) {
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++) {
            float *o = out + (b * T + t) * C;
            const float *e = wte + (int64_t)tokens[b * T + t] * C;
            const float *p = wpe + t * C;
            for (int64_t i = 0; i < C; i++) o[i] = e[i] + p[i];
        }
}

void tiny_embedding_backward(float *dwte, float *dwpe, const float *dout,
                             const int32_t *tokens, int64_t B, int64_t T, int64_t C) {
    // forward: o[i] = e[i] + p[i], e = wte[tokens[b, t]], p = wpe[t]
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++) {
            const float *dy = dout + (b * T + t) * C;
            float *de = dwte + (int64_t)tokens[b * T + t] * C;
            float *dp = dwpe + t * C;
            for (int64_t i = 0; i < C; i++) {
                de[i] += dy[i];
                dp[i] += dy[i];
            }
        }
}

// ---------------------------------------------------------------------------
// Softmax cross-entropy

double tiny_crossentropy_forward(float *probs, float *losses, const float *logits,
                                 const int32_t *targets, int64_t B, int64_t V) {
    double total = 0.0;
    for (int64_t b = 0; b < B; b++) {
        const float *z = logits + b * V;  // z: (V)
        float *p = probs + b * V;
        float mx = z[0];
        for (int64_t v = 1; v < V; v++) mx = z[v] > mx ? z[v] : mx;
        double s = 0.0;
        for (int64_t v = 0; v < V; v++) s += exp((double)(z[v] - mx));
        for (int64_t v = 0; v < V; v++) p[v] = (float)(exp((double)(z[v] - mx)) / s);
        // -log softmax(z)[y] = log sum exp(z - mx) - (z[y] - mx), in double
        double l = log(s) - (double)(z[targets[b]] - mx);
        losses[b] = (float)l;
        total += l;
    }
    return total / (double)B;
}

void tiny_crossentropy_backward(float *dlogits, const float *probs, const int32_t *targets,
                                float scale, int64_t B, int64_t V) {
    // forward: l = log sum_v exp(z[v]) - z[y]  =>  dl/dz[v] = p[v] - [v == y]
    for (int64_t b = 0; b < B; b++)
        for (int64_t v = 0; v < V; v++)
            dlogits[b * V + v] = (probs[b * V + v] - (v == targets[b] ? 1.0f : 0.0f)) * scale;
}

// ---------------------------------------------------------------------------
// The model

// One block's parameters, gradients, activations and attention views.
typedef struct tiny_block {
    int64_t Lq;  // query rows this block computes: T, or 1 in the last block
    // parameters (and d* gradients, same shapes)
    float *ln1w, *ln1b;    // (D)
    float *ln2w, *ln2b;    // (D)
    float *fcw, *fcb;      // (F, D), (F)
    float *projw, *projb;  // (D, F), (D)
    float *dln1w, *dln1b, *dln2w, *dln2b, *dfcw, *dfcb, *dprojw, *dprojb;
    mha_module *attn, *dattn;  // libmha's attention and its gradients
    // activations (B = max_batch when carved; the first B rows are used)
    float *ln1;                  // (B, T, D)
    float *ln1_mean, *ln1_rstd;  // (B, T)
    float *att;                  // (B, Lq, D) attention output
    float *res2;                 // (B, Lq, D) x[rows] + att
    float *ln2;                  // (B, Lq, D)
    float *ln2_mean, *ln2_rstd;  // (B, Lq)
    float *fch;                  // (B, Lq, F) W1 ln2 + b1
    float *fch_gelu;             // (B, Lq, F)
    float *fcproj;               // (B, Lq, D) W2 gelu + b2
    float *out;                  // (B, Lq, D) res2 + fcproj
    // activation gradients
    float *dln1;              // (B, T, D)
    float *dq;                // (B, Lq, D) from mha_backward
    float *dk, *dv;           // (B, T, D)  from mha_backward
    float *dres2;             // (B, Lq, D)
    float *dln2;              // (B, Lq, D)
    float *dfch, *dfch_gelu;  // (B, Lq, F)
    float *dout;              // (B, Lq, D) gradient of `out`
    // the views and arguments of the last forward, reused by the backward
    mha_tensor vq, vkv, vatt, vdq, vdk, vdv, vdatt;
    mha_forward_args args;
} tiny_block;

struct tiny_model {
    tiny_config cfg;
    int64_t max_batch;
    int64_t n_own;          // floats of our own parameters
    float *params, *grads;  // (n_own) each
    float *acts, *dacts;
    int32_t *ints;         // tokens (max_batch, T), targets (max_batch)
    float *wte, *wpe;      // (V, D), (T, D)
    float *lnfw, *lnfb;    // (D)
    float *headw, *headb;  // (V, D), (V)
    float *dwte, *dwpe, *dlnfw, *dlnfb, *dheadw, *dheadb;
    tiny_block *blocks;          // (n_layers)
    float *emb;                  // (B, T, D)
    float *lnf;                  // (B, D)
    float *lnf_mean, *lnf_rstd;  // (B)
    float *logits, *probs;       // (B, V)
    float *losses;               // (B)
    float *demb;                 // (B, T, D)
    float *dlnf;                 // (B, D)
    float *dlogits;              // (B, V)
    int32_t *tokens, *targets;
    int64_t B;  // rows of the last forward
    bool have_targets;
    tiny_tensor *tensors;
    int n_tensors;
};

// Walks a block of floats, handing out consecutive named pieces.
typedef struct carver {
    float *base;
    int64_t used;
} carver;

static float *carve(carver *c, int64_t n) {
    float *p = c->base ? c->base + c->used : NULL;
    c->used += n;
    return p;
}

// Lays out (or, with base NULL, only counts) the parameters (grad = false)
// or their gradients (grad = true).
static int64_t layout_params(tiny_model *m, float *base, bool grad) {
    const tiny_config *c = &m->cfg;
    int64_t V = c->vocab, T = c->seq_len, D = c->d_model, F = c->d_ff;
    carver cv = {base, 0};
    float **p[6] = {&m->wte, &m->wpe, &m->lnfw, &m->lnfb, &m->headw, &m->headb};
    float **g[6] = {&m->dwte, &m->dwpe, &m->dlnfw, &m->dlnfb, &m->dheadw, &m->dheadb};
    float ***s = grad ? g : p;
    *s[0] = carve(&cv, V * D);  // wte (V, D)
    *s[1] = carve(&cv, T * D);  // wpe (T, D)
    for (int64_t l = 0; l < c->n_layers; l++) {
        tiny_block *bl = &m->blocks[l];
        float **q[8] = {&bl->ln1w, &bl->ln1b, &bl->ln2w,  &bl->ln2b,
                        &bl->fcw,  &bl->fcb,  &bl->projw, &bl->projb};
        float **dq[8] = {&bl->dln1w, &bl->dln1b, &bl->dln2w,  &bl->dln2b,
                         &bl->dfcw,  &bl->dfcb,  &bl->dprojw, &bl->dprojb};
        int64_t n[8] = {D, D, D, D, F * D, F, D * F, D};
        for (int i = 0; i < 8; i++) *(grad ? dq : q)[i] = carve(&cv, n[i]);
    }
    *s[2] = carve(&cv, D);      // lnfw (D)
    *s[3] = carve(&cv, D);      // lnfb (D)
    *s[4] = carve(&cv, V * D);  // headw (V, D)
    *s[5] = carve(&cv, V);      // headb (V)
    return cv.used;
}

// Activations (dact = false) or activation gradients (dact = true) for
// batches of max_batch.
static int64_t layout_acts(tiny_model *m, float *base, bool dact) {
    const tiny_config *c = &m->cfg;
    int64_t B = m->max_batch, V = c->vocab, T = c->seq_len, D = c->d_model, F = c->d_ff;
    carver cv = {base, 0};
    if (!dact) {
        m->emb = carve(&cv, B * T * D);
        for (int64_t l = 0; l < c->n_layers; l++) {
            tiny_block *bl = &m->blocks[l];
            int64_t Lq = bl->Lq;
            bl->ln1 = carve(&cv, B * T * D);
            bl->ln1_mean = carve(&cv, B * T);
            bl->ln1_rstd = carve(&cv, B * T);
            bl->att = carve(&cv, B * Lq * D);
            bl->res2 = carve(&cv, B * Lq * D);
            bl->ln2 = carve(&cv, B * Lq * D);
            bl->ln2_mean = carve(&cv, B * Lq);
            bl->ln2_rstd = carve(&cv, B * Lq);
            bl->fch = carve(&cv, B * Lq * F);
            bl->fch_gelu = carve(&cv, B * Lq * F);
            bl->fcproj = carve(&cv, B * Lq * D);
            bl->out = carve(&cv, B * Lq * D);
        }
        m->lnf = carve(&cv, B * D);
        m->lnf_mean = carve(&cv, B);
        m->lnf_rstd = carve(&cv, B);
        m->logits = carve(&cv, B * V);
        m->probs = carve(&cv, B * V);
        m->losses = carve(&cv, B);
    } else {
        m->demb = carve(&cv, B * T * D);
        for (int64_t l = 0; l < c->n_layers; l++) {
            tiny_block *bl = &m->blocks[l];
            int64_t Lq = bl->Lq;
            bl->dln1 = carve(&cv, B * T * D);
            bl->dq = carve(&cv, B * Lq * D);
            bl->dk = carve(&cv, B * T * D);
            bl->dv = carve(&cv, B * T * D);
            bl->dres2 = carve(&cv, B * Lq * D);
            bl->dln2 = carve(&cv, B * Lq * D);
            bl->dfch = carve(&cv, B * Lq * F);
            bl->dfch_gelu = carve(&cv, B * Lq * F);
            bl->dout = carve(&cv, B * Lq * D);
        }
        m->dlnf = carve(&cv, B * D);
        m->dlogits = carve(&cv, B * V);
    }
    return cv.used;
}

static float *alloc_floats(int64_t n) { return calloc((size_t)(n ? n : 1), sizeof(float)); }

// splitmix64 (Steele, Lea, Flood, "Fast splittable pseudorandom number
// generators", OOPSLA 2014): one 64-bit state, good enough for data and init.
uint64_t tiny_rng_next(tiny_rng *r) {
    uint64_t z = (r->s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

double tiny_rng_uniform(tiny_rng *r) {
    return (double)(tiny_rng_next(r) >> 11) * (1.0 / 9007199254740992.0);
}

// Box-Muller; 1 - u keeps the log away from 0.
double tiny_rng_normal(tiny_rng *r) {
    double u = 1.0 - tiny_rng_uniform(r), v = tiny_rng_uniform(r);
    return sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v);
}

// Lemire-free modulo is fine here: n <= 26, the bias is below 2^-58.
int64_t tiny_rng_below(tiny_rng *r, int64_t n) {
    return (int64_t)(tiny_rng_next(r) % (uint64_t)n);
}

static void fill_normal(float *p, int64_t n, double std, tiny_rng *r) {
    for (int64_t i = 0; i < n; i++) p[i] = (float)(std * tiny_rng_normal(r));
}

static void fill_uniform(float *p, int64_t n, double bound, tiny_rng *r) {
    for (int64_t i = 0; i < n; i++) p[i] = (float)(bound * (2.0 * tiny_rng_uniform(r) - 1.0));
}

static void fill_const(float *p, int64_t n, float v) {
    for (int64_t i = 0; i < n; i++) p[i] = v;
}

// Initialisation: wte, wpe N(0, 1) as nn.Embedding; LayerNorms w = 1, b = 0;
// the MLP and classifier weights U(-1/sqrt(fan_in), 1/sqrt(fan_in)) as
// nn.Linear, biases 0; the attention modules libmha's default
// (xavier_uniform in_proj, nn.Linear out_proj, zero biases), seeded per
// layer.
static mha_status init_params(tiny_model *m) {
    const tiny_config *c = &m->cfg;
    int64_t V = c->vocab, T = c->seq_len, D = c->d_model, F = c->d_ff;
    tiny_rng r = {c->seed * 0x2545F4914F6CDD1Dull + 1};
    fill_normal(m->wte, V * D, 1.0, &r);
    fill_normal(m->wpe, T * D, 1.0, &r);
    for (int64_t l = 0; l < c->n_layers; l++) {
        tiny_block *bl = &m->blocks[l];
        fill_const(bl->ln1w, D, 1.0f);
        fill_const(bl->ln2w, D, 1.0f);
        fill_uniform(bl->fcw, F * D, 1.0 / sqrt((double)D), &r);
        fill_uniform(bl->projw, D * F, 1.0 / sqrt((double)F), &r);
        mha_init_options io;
        mha_init_options_init(&io);
        io.seed = c->seed * 1000003ull + (uint64_t)l + 1;
        mha_status st = mha_module_init(bl->attn, &io);
        if (st) return st;
    }
    fill_const(m->lnfw, D, 1.0f);
    fill_uniform(m->headw, V * D, 1.0 / sqrt((double)D), &r);
    return MHA_OK;
}

// The list of named tensors: ours, then each block's attention parameters.
static mha_status build_tensor_list(tiny_model *m) {
    const tiny_config *c = &m->cfg;
    int n_attn = 0;
    for (int64_t l = 0; l < c->n_layers; l++)
        n_attn += mha_module_num_params(m->blocks[l].attn);
    int cap = 6 + 8 * (int)c->n_layers + n_attn;
    m->tensors = calloc((size_t)cap, sizeof *m->tensors);
    if (!m->tensors) return MHA_ERR_NOMEM;
    int k = 0;
#define ADD(nm, p, g, cnt)                                                 \
    do {                                                                   \
        snprintf(m->tensors[k].name, sizeof m->tensors[k].name, "%s", nm); \
        m->tensors[k].param = (p);                                         \
        m->tensors[k].grad = (g);                                          \
        m->tensors[k].n = (cnt);                                           \
        k++;                                                               \
    } while (0)
    int64_t V = c->vocab, T = c->seq_len, D = c->d_model, F = c->d_ff;
    ADD("wte", m->wte, m->dwte, V * D);
    ADD("wpe", m->wpe, m->dwpe, T * D);
    for (int64_t l = 0; l < c->n_layers; l++) {
        tiny_block *bl = &m->blocks[l];
        char nm[48];
        static const char *names[8] = {"ln1.weight", "ln1.bias", "ln2.weight",  "ln2.bias",
                                       "fc.weight",  "fc.bias",  "proj.weight", "proj.bias"};
        float *ps[8] = {bl->ln1w, bl->ln1b, bl->ln2w,  bl->ln2b,
                        bl->fcw,  bl->fcb,  bl->projw, bl->projb};
        float *gs[8] = {bl->dln1w, bl->dln1b, bl->dln2w,  bl->dln2b,
                        bl->dfcw,  bl->dfcb,  bl->dprojw, bl->dprojb};
        int64_t ns[8] = {D, D, D, D, F * D, F, D * F, D};
        for (int i = 0; i < 8; i++) {
            snprintf(nm, sizeof nm, "l%lld.%s", (long long)l, names[i]);
            ADD(nm, ps[i], gs[i], ns[i]);
        }
    }
    ADD("lnf.weight", m->lnfw, m->dlnfw, D);
    ADD("lnf.bias", m->lnfb, m->dlnfb, D);
    ADD("head.weight", m->headw, m->dheadw, V * D);
    ADD("head.bias", m->headb, m->dheadb, V);
    for (int64_t l = 0; l < c->n_layers; l++) {
        tiny_block *bl = &m->blocks[l];
        for (int i = 0; i < mha_module_num_params(bl->attn); i++) {
            mha_param p, g;
            mha_status st = mha_module_param_at(&p, bl->attn, i);
            if (!st) st = mha_module_param_at(&g, bl->dattn, i);
            if (st) return st;
            char nm[48];
            snprintf(nm, sizeof nm, "l%lld.attn.%s", (long long)l, p.name);
            ADD(nm, p.data, g.data, p.numel);
        }
    }
#undef ADD
    m->n_tensors = k;
    return MHA_OK;
}

mha_status tiny_create(tiny_model **out, const tiny_config *cfg, int64_t max_batch) {
    *out = NULL;
    tiny_config c = *cfg;
    if (c.d_ff == 0) c.d_ff = 4 * c.d_model;
    if (c.vocab <= 0 || c.seq_len <= 0 || c.d_model <= 0 || c.n_heads <= 0 ||
        c.n_layers <= 0 || c.d_ff <= 0 || max_batch <= 0)
        return MHA_ERR_INVALID_ARG;
    tiny_model *m = calloc(1, sizeof *m);
    if (!m) return MHA_ERR_NOMEM;
    m->cfg = c;
    m->max_batch = max_batch;
    mha_status st = MHA_OK;
    m->blocks = calloc((size_t)c.n_layers, sizeof *m->blocks);
    if (!m->blocks) {
        st = MHA_ERR_NOMEM;
        goto fail;
    }
    mha_config ac;
    mha_config_init(&ac, c.d_model, c.n_heads);
    ac.batch_first = true;
    ac.dropout = c.dropout;
    for (int64_t l = 0; l < c.n_layers; l++) {
        tiny_block *bl = &m->blocks[l];
        bl->Lq = l == c.n_layers - 1 ? 1 : c.seq_len;
        if ((st = mha_module_create(&bl->attn, &ac))) goto fail;
        if ((st = mha_module_create(&bl->dattn, mha_module_config(bl->attn)))) goto fail;
    }
    m->n_own = layout_params(m, NULL, false);
    int64_t na = layout_acts(m, NULL, false), nd = layout_acts(m, NULL, true);
    m->params = alloc_floats(m->n_own);
    m->grads = alloc_floats(m->n_own);
    m->acts = alloc_floats(na);
    m->dacts = alloc_floats(nd);
    m->ints = calloc((size_t)(max_batch * (c.seq_len + 1)), sizeof(int32_t));
    if (!m->params || !m->grads || !m->acts || !m->dacts || !m->ints) {
        st = MHA_ERR_NOMEM;
        goto fail;
    }
    layout_params(m, m->params, false);
    layout_params(m, m->grads, true);
    layout_acts(m, m->acts, false);
    layout_acts(m, m->dacts, true);
    m->tokens = m->ints;                           // (max_batch, T)
    m->targets = m->ints + max_batch * c.seq_len;  // (max_batch)
    if ((st = init_params(m))) goto fail;
    if ((st = build_tensor_list(m))) goto fail;
    *out = m;
    return MHA_OK;
fail:
    tiny_destroy(m);
    return st;
}

void tiny_destroy(tiny_model *m) {
    if (!m) return;
    if (m->blocks)
        for (int64_t l = 0; l < m->cfg.n_layers; l++) {
            mha_module_destroy(m->blocks[l].attn);
            mha_module_destroy(m->blocks[l].dattn);
        }
    free(m->blocks);
    free(m->params);
    free(m->grads);
    free(m->acts);
    free(m->dacts);
    free(m->ints);
    free(m->tensors);
    free(m);
}

const tiny_config *tiny_get_config(const tiny_model *m) { return &m->cfg; }

const tiny_tensor *tiny_tensors(const tiny_model *m, int *n_tensors) {
    *n_tensors = m->n_tensors;
    return m->tensors;
}

void tiny_params_changed(tiny_model *m) {
    for (int64_t l = 0; l < m->cfg.n_layers; l++) mha_module_params_changed(m->blocks[l].attn);
}

int64_t tiny_num_params(const tiny_model *m) {
    int64_t n = 0;
    for (int i = 0; i < m->n_tensors; i++) n += m->tensors[i].n;
    return n;
}

// A (B, rows, D) view of a (B, T, D) buffer starting at row r0.
static mha_tensor rows_view(float *base, int64_t B, int64_t T, int64_t r0, int64_t rows,
                            int64_t D) {
    mha_tensor t;
    memset(&t, 0, sizeof t);
    t.data = base + r0 * D;
    t.dtype = MHA_F32;
    t.ndim = 3;
    t.shape[0] = B;
    t.shape[1] = rows;
    t.shape[2] = D;
    t.stride[0] = T * D;
    t.stride[1] = D;
    t.stride[2] = 1;
    return t;
}

const float *tiny_attention_input(const tiny_model *m, int64_t l) {
    return l >= 0 && l < m->cfg.n_layers ? m->blocks[l].ln1 : NULL;
}

mha_status tiny_attention_weights(const tiny_model *m, int64_t l, int64_t b, float *w,
                                  int64_t *lq, const mha_module **mod) {
    const tiny_config *c = &m->cfg;
    if (l < 0 || l >= c->n_layers || b < 0 || b >= m->B) return MHA_ERR_INVALID_ARG;
    const tiny_block *bl = &m->blocks[l];
    const int64_t T = c->seq_len, D = c->d_model, Lq = bl->Lq;
    mha_tensor q = rows_view(bl->ln1 + b * T * D, 1, T, T - Lq, Lq, D),
               kv = rows_view(bl->ln1 + b * T * D, 1, T, 0, T, D);
    float *y = malloc(sizeof(float) * (size_t)(Lq * D));
    if (!y) return MHA_ERR_NOMEM;
    mha_tensor yt = mha_tensor_contiguous(y, MHA_F32, 3, (int64_t[]){1, Lq, D});
    mha_tensor wt = mha_tensor_contiguous(w, MHA_F32, 4, (int64_t[]){1, c->n_heads, Lq, T});
    mha_forward_args a = bl->args;
    a.query = &q;
    a.key = a.value = &kv;
    a.training = false;
    a.need_weights = true;
    a.average_attn_weights = false;
    mha_status st = mha_forward(&yt, &wt, bl->attn, &a);
    free(y);
    *lq = Lq;
    if (mod) *mod = bl->attn;
    return st;
}

mha_status tiny_forward(tiny_model *m, float *loss, const int32_t *tokens,
                        const int32_t *targets, int64_t B, bool training,
                        uint64_t dropout_offset) {
    const tiny_config *c = &m->cfg;
    int64_t V = c->vocab, T = c->seq_len, D = c->d_model, F = c->d_ff;
    if (B <= 0 || B > m->max_batch) return MHA_ERR_INVALID_ARG;
    for (int64_t i = 0; i < B * T; i++)
        if (tokens[i] < 0 || tokens[i] >= V) return MHA_ERR_INVALID_ARG;
    if (targets)
        for (int64_t b = 0; b < B; b++)
            if (targets[b] < 0 || targets[b] >= V) return MHA_ERR_INVALID_ARG;
    memcpy(m->tokens, tokens, (size_t)(B * T) * sizeof(int32_t));
    if (targets) memcpy(m->targets, targets, (size_t)B * sizeof(int32_t));
    m->B = B;
    m->have_targets = targets != NULL;

    tiny_embedding_forward(m->emb, tokens, m->wte, m->wpe, B, T, D);
    const float *x = m->emb;  // x: (B, T, D), the block's input
    for (int64_t l = 0; l < c->n_layers; l++) {
        tiny_block *bl = &m->blocks[l];
        int64_t Lq = bl->Lq, r0 = T - Lq;  // query rows [r0, T)
        tiny_layernorm_forward(bl->ln1, bl->ln1_mean, bl->ln1_rstd, x, bl->ln1w, bl->ln1b,
                               B * T, D);
        // self-attention: keys and values from every row, queries from
        // rows [r0, T): att (B, Lq, D)
        bl->vq = rows_view(bl->ln1, B, T, r0, Lq, D);
        bl->vkv = rows_view(bl->ln1, B, T, 0, T, D);
        bl->vatt = rows_view(bl->att, B, Lq, 0, Lq, D);
        mha_forward_args_init(&bl->args);
        bl->args.query = &bl->vq;
        bl->args.key = &bl->vkv;
        bl->args.value = &bl->vkv;
        // a causal mask's last row sees every key: the last block (Lq = 1)
        // needs none
        bl->args.opts.is_causal = c->causal && Lq == T;
        bl->args.training = training && c->dropout > 0.0f;
        bl->args.opts.dropout_seed = c->seed * 0x9E3779B97F4A7C15ull + (uint64_t)l;
        bl->args.opts.dropout_offset = dropout_offset;
        mha_status st = mha_forward(&bl->vatt, NULL, bl->attn, &bl->args);
        if (st) return st;
        for (int64_t b = 0; b < B; b++)  // res2 = x[rows] + att
            for (int64_t i = 0; i < Lq * D; i++)
                bl->res2[b * Lq * D + i] = x[(b * T + r0) * D + i] + bl->att[b * Lq * D + i];
        tiny_layernorm_forward(bl->ln2, bl->ln2_mean, bl->ln2_rstd, bl->res2, bl->ln2w,
                               bl->ln2b, B * Lq, D);
        tiny_linear_forward(bl->fch, bl->ln2, bl->fcw, bl->fcb, B * Lq, D, F);
        tiny_gelu_forward(bl->fch_gelu, bl->fch, B * Lq * F);
        tiny_linear_forward(bl->fcproj, bl->fch_gelu, bl->projw, bl->projb, B * Lq, F, D);
        for (int64_t i = 0; i < B * Lq * D; i++)  // out = res2 + fcproj
            bl->out[i] = bl->res2[i] + bl->fcproj[i];
        x = bl->out;
    }
    // x: (B, 1, D), the last position
    tiny_layernorm_forward(m->lnf, m->lnf_mean, m->lnf_rstd, x, m->lnfw, m->lnfb, B, D);
    tiny_linear_forward(m->logits, m->lnf, m->headw, m->headb, B, D, V);
    if (targets) {
        double l = tiny_crossentropy_forward(m->probs, m->losses, m->logits, targets, B, V);
        if (loss) *loss = (float)l;
    }
    return MHA_OK;
}

mha_status tiny_backward(tiny_model *m) {
    const tiny_config *c = &m->cfg;
    int64_t V = c->vocab, T = c->seq_len, D = c->d_model, F = c->d_ff, B = m->B;
    if (!m->have_targets) return MHA_ERR_INVALID_ARG;
    // forward: loss = mean_b CE(logits[b], targets[b])
    tiny_crossentropy_backward(m->dlogits, m->probs, m->targets, 1.0f / (float)B, B, V);
    // forward: logits = lnf headw^T + headb
    memset(m->dlnf, 0, (size_t)(B * D) * sizeof(float));
    tiny_linear_backward(m->dlnf, m->dheadw, m->dheadb, m->dlogits, m->lnf, m->headw, B, D, V);
    // forward: lnf = LN(x), x = the last block's out (B, 1, D)
    tiny_block *last = &m->blocks[c->n_layers - 1];
    memset(last->dout, 0, (size_t)(B * D) * sizeof(float));
    tiny_layernorm_backward(last->dout, m->dlnfw, m->dlnfb, m->dlnf, last->out, m->lnfw,
                            m->lnf_mean, m->lnf_rstd, B, D);
    for (int64_t l = c->n_layers - 1; l >= 0; l--) {
        tiny_block *bl = &m->blocks[l];
        int64_t Lq = bl->Lq, r0 = T - Lq;
        const float *x = l ? m->blocks[l - 1].out : m->emb;  // (B, T, D)
        float *dx = l ? m->blocks[l - 1].dout : m->demb;     // (B, T, D)
        int64_t nq = B * Lq * D, nf = B * Lq * F, nx = B * T * D;
        // forward: out = res2 + fcproj
        memcpy(bl->dres2, bl->dout, (size_t)nq * sizeof(float));
        // forward: fcproj = fch_gelu projw^T + projb
        memset(bl->dfch_gelu, 0, (size_t)nf * sizeof(float));
        tiny_linear_backward(bl->dfch_gelu, bl->dprojw, bl->dprojb, bl->dout, bl->fch_gelu,
                             bl->projw, B * Lq, F, D);
        // forward: fch_gelu = GELU(fch)
        memset(bl->dfch, 0, (size_t)nf * sizeof(float));
        tiny_gelu_backward(bl->dfch, bl->fch, bl->dfch_gelu, nf);
        // forward: fch = ln2 fcw^T + fcb
        memset(bl->dln2, 0, (size_t)nq * sizeof(float));
        tiny_linear_backward(bl->dln2, bl->dfcw, bl->dfcb, bl->dfch, bl->ln2, bl->fcw, B * Lq,
                             D, F);
        // forward: ln2 = LN(res2)
        tiny_layernorm_backward(bl->dres2, bl->dln2w, bl->dln2b, bl->dln2, bl->res2, bl->ln2w,
                                bl->ln2_mean, bl->ln2_rstd, B * Lq, D);
        // forward: res2 = x[rows] + att
        memset(dx, 0, (size_t)nx * sizeof(float));
        for (int64_t b = 0; b < B; b++)
            for (int64_t i = 0; i < Lq * D; i++)
                dx[(b * T + r0) * D + i] += bl->dres2[b * Lq * D + i];
        // forward: att = MHA(query = ln1[rows], key = value = ln1)
        bl->vdq = rows_view(bl->dq, B, Lq, 0, Lq, D);
        bl->vdk = rows_view(bl->dk, B, T, 0, T, D);
        bl->vdv = rows_view(bl->dv, B, T, 0, T, D);
        bl->vdatt = rows_view(bl->dres2, B, Lq, 0, Lq, D);
        mha_status st = mha_backward(&bl->vdq, &bl->vdk, &bl->vdv, bl->dattn, bl->attn,
                                     &bl->args, &bl->vdatt, false);
        if (st) return st;
        // ln1 feeds query (rows [r0, T)), key and value: its gradient is
        // the sum of the three
        for (int64_t i = 0; i < nx; i++) bl->dln1[i] = bl->dk[i] + bl->dv[i];
        for (int64_t b = 0; b < B; b++)
            for (int64_t i = 0; i < Lq * D; i++)
                bl->dln1[(b * T + r0) * D + i] += bl->dq[b * Lq * D + i];
        // forward: ln1 = LN(x)
        tiny_layernorm_backward(dx, bl->dln1w, bl->dln1b, bl->dln1, x, bl->ln1w, bl->ln1_mean,
                                bl->ln1_rstd, B * T, D);
    }
    // forward: emb = wte[tokens] + wpe
    tiny_embedding_backward(m->dwte, m->dwpe, m->demb, m->tokens, B, T, D);
    return MHA_OK;
}

void tiny_zero_grad(tiny_model *m) {
    for (int i = 0; i < m->n_tensors; i++)
        memset(m->tensors[i].grad, 0, (size_t)m->tensors[i].n * sizeof(float));
}

const float *tiny_logits(const tiny_model *m) { return m->logits; }

void tiny_predict(const tiny_model *m, int32_t *pred) {
    int64_t V = m->cfg.vocab;
    for (int64_t b = 0; b < m->B; b++) {
        const float *z = m->logits + b * V;
        int32_t best = 0;
        for (int64_t v = 1; v < V; v++)
            if (z[v] > z[best]) best = (int32_t)v;
        pred[b] = best;
    }
}

mha_status tiny_optimizer_register(tiny_model *m, mha_optim *o) {
    // our own tensors one by one; each attention module with its grads
    int n_own = 6 + 8 * (int)m->cfg.n_layers;
    for (int i = 0; i < n_own; i++) {
        mha_status st = mha_optim_add(o, m->tensors[i].param, m->tensors[i].grad,
                                      m->tensors[i].n);
        if (st) return st;
    }
    for (int64_t l = 0; l < m->cfg.n_layers; l++) {
        mha_status st = mha_optim_add_module(o, m->blocks[l].attn, m->blocks[l].dattn);
        if (st) return st;
    }
    return MHA_OK;
}
