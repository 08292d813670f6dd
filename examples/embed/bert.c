// bert.c: the BERT encoder of sentence embeddings (bert.h): loading
// config.json and the weights through libmha's checkpoint reader
// (mha_checkpoint_open: model.safetensors or its shards; each layer's
// attention by mha_checkpoint_load_layer, every other tensor by
// mha_checkpoint_find + mha_st_read), the forward over a padded batch,
// mean pooling and L2 normalisation.
//
// Layout: activations row-major (N L, E), the row of token t of sequence n
// at n L + t, which is libmha's batch_first (N, L, E). Each dense layer
// (intermediate.dense, output.dense) is libmha's mha_linear: its weight
// packed once at load, applied to the activations' rows.
//
// Numerics: float32 storage and products, as transformers (the dense
// layers' sums in the order of libmha's projections, mha.h); LayerNorm's
// mean and variance, the pooling sums and the norm in double (closer to
// the exact result than float, well inside the test's 1e-5).
#include "bert.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mha.h"

#define SQRT1_2 0.70710678118654752440f

typedef struct layer {
    mha_module *attn;            // query/key/value -> in_proj, output.dense -> out_proj
    float *ln1_w, *ln1_b;        // attention.output.LayerNorm (E)
    mha_linear *inter, *output;  // intermediate.dense (E -> I), output.dense (I -> E)
    float *ln2_w, *ln2_b;        // output.LayerNorm (E)
} layer;

struct embed_model {
    embed_bert_config cfg;
    float *word;         // (V, E)
    float *position;     // (P, E)
    float *token_type;   // (T, E); row 0 used
    float *ln_w, *ln_b;  // embeddings.LayerNorm (E)
    layer *layers;       // (num_layers)
};

const embed_bert_config *embed_model_config(const embed_model *m) { return &m->cfg; }

void embed_model_destroy(embed_model *m) {
    if (!m) return;
    free(m->word);
    free(m->position);
    free(m->token_type);
    free(m->ln_w);
    free(m->ln_b);
    if (m->layers)
        for (int64_t l = 0; l < m->cfg.num_layers; l++) {
            layer *ly = &m->layers[l];
            mha_module_destroy(ly->attn);
            free(ly->ln1_w);
            free(ly->ln1_b);
            free(ly->ln2_w);
            free(ly->ln2_b);
            mha_linear_destroy(ly->inter);
            mha_linear_destroy(ly->output);
        }
    free(m->layers);
    free(m);
}

// ---------------------------------------------------------------------------
// config.json

static int config_int(int64_t *out, const cJSON *j, const char *key, const char *path) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, key);
    if (!cJSON_IsNumber(v))
        return embed_fail("%s: \"%s\" is missing or not a number", path, key);
    double d = v->valuedouble;
    if (!(d >= 1 && d <= 1e9) || d != floor(d))
        return embed_fail("%s: \"%s\" = %g (expected a positive integer)", path, key, d);
    *out = (int64_t)d;
    return 0;
}

static int config_string_is(const cJSON *j, const char *key, const char *want, bool required,
                            const char *path) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, key);
    if (!v && !required) return 0;
    if (!cJSON_IsString(v))
        return embed_fail("%s: \"%s\" is missing or not a string (expected \"%s\")", path, key,
                          want);
    if (strcmp(v->valuestring, want))
        return embed_fail("%s: \"%s\" is \"%.60s\": only \"%s\" is supported", path, key,
                          v->valuestring, want);
    return 0;
}

static int read_config(embed_bert_config *c, const char *dir) {
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "rb");
    if (!f) return embed_fail("%s: cannot open: %s", path, strerror(errno));
    char buf[1 << 16];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    bool more = !feof(f) && fgetc(f) != EOF;
    fclose(f);
    if (more) return embed_fail("%s: larger than %zu bytes", path, sizeof buf - 1);
    buf[n] = '\0';
    cJSON *j = cJSON_ParseWithLength(buf, n);
    if (!cJSON_IsObject(j)) {
        cJSON_Delete(j);
        return embed_fail("%s: not a JSON object", path);
    }
    int rc = config_string_is(j, "model_type", "bert", true, path);
    if (!rc) rc = config_string_is(j, "hidden_act", "gelu", true, path);
    if (!rc) rc = config_string_is(j, "position_embedding_type", "absolute", false, path);
    if (!rc) rc = config_int(&c->vocab_size, j, "vocab_size", path);
    if (!rc) rc = config_int(&c->hidden_size, j, "hidden_size", path);
    if (!rc) rc = config_int(&c->num_layers, j, "num_hidden_layers", path);
    if (!rc) rc = config_int(&c->num_heads, j, "num_attention_heads", path);
    if (!rc) rc = config_int(&c->intermediate_size, j, "intermediate_size", path);
    if (!rc) rc = config_int(&c->max_position, j, "max_position_embeddings", path);
    if (!rc) rc = config_int(&c->type_vocab_size, j, "type_vocab_size", path);
    if (!rc) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, "layer_norm_eps");
        if (!cJSON_IsNumber(v) || !(v->valuedouble > 0) || !isfinite(v->valuedouble))
            rc = embed_fail("%s: \"layer_norm_eps\" is missing or not a positive number", path);
        else c->layer_norm_eps = v->valuedouble;
    }
    if (!rc && c->hidden_size % c->num_heads)
        rc = embed_fail("%s: hidden_size %lld is not divisible by num_attention_heads %lld",
                        path, (long long)c->hidden_size, (long long)c->num_heads);
    cJSON_Delete(j);
    return rc;
}

// ---------------------------------------------------------------------------
// Tensors

#define LABEL "the checkpoint"

// A float tensor of the checkpoint by name ("bert." prefix optional) with
// exactly the shape (d0) or (d0, d1) (d1 = 0: one dimension), into dst
// (numel floats). full: the name found, for messages.
static int read_into(float *dst, const mha_checkpoint *f, const char *name, int64_t d0,
                     int64_t d1) {
    mha_st_tensor t;
    char full[256];
    snprintf(full, sizeof full, "%s", name);
    mha_status st = mha_checkpoint_find(&t, f, full);
    if (st == MHA_ERR_NOT_FOUND) {
        snprintf(full, sizeof full, "bert.%s", name);
        st = mha_checkpoint_find(&t, f, full);
    }
    if (st)
        return embed_fail("%s: tensor \"%s\" not found (nor \"bert.%s\")", LABEL, name, name);
    int want_ndim = d1 ? 2 : 1;
    if (t.ndim != want_ndim || t.shape[0] != d0 || (d1 && t.shape[1] != d1)) {
        char got[128] = "";
        for (int i = 0, k = 0; i < t.ndim && k < 100; i++)
            k += snprintf(got + k, sizeof got - (size_t)k, "%s%lld", i ? ", " : "",
                          (long long)t.shape[i]);
        if (d1)
            return embed_fail("%s: \"%s\" has shape (%s), config.json says (%lld, %lld)",
                              LABEL, full, got, (long long)d0, (long long)d1);
        return embed_fail("%s: \"%s\" has shape (%s), config.json says (%lld)", LABEL, full,
                          got, (long long)d0);
    }
    if (t.dtype != MHA_F32 && t.dtype != MHA_F16 && t.dtype != MHA_BF16)
        return embed_fail("%s: \"%s\" has dtype %s (expected F32, F16 or BF16)", LABEL, full,
                          mha_dtype_name(t.dtype));
    size_t bytes = (size_t)t.numel * sizeof(float);
    if (mha_st_read(dst, bytes, MHA_F32, &t))
        return embed_fail("%s: reading \"%s\": %s", LABEL, full, mha_last_error());
    return 0;
}

// As read_into, allocating *dst.
static int read_new(float **dst, const mha_checkpoint *f, const char *name, int64_t d0,
                    int64_t d1) {
    size_t n = (size_t)d0 * (size_t)(d1 ? d1 : 1);
    *dst = malloc(n * sizeof(float));
    if (!*dst) return embed_fail("out of memory for \"%s\" (%zu floats)", name, n);
    return read_into(*dst, f, name, d0, d1);
}

// A dense layer "<name>.weight" (O, I), "<name>.bias" (O), read as float32
// and packed by mha_linear_create (which copies them).
static int read_dense(mha_linear **d, const mha_checkpoint *f, const char *name, int64_t O,
                      int64_t I) {
    char wn[200], bn[200];
    snprintf(wn, sizeof wn, "%s.weight", name);
    snprintf(bn, sizeof bn, "%s.bias", name);
    float *w = NULL, *b = NULL;
    int rc = read_new(&b, f, bn, O, 0) || read_new(&w, f, wn, O, I) ? -1 : 0;
    if (!rc) {
        mha_tensor wt = mha_tensor_contiguous(w, MHA_F32, 2, (int64_t[]){O, I});
        mha_tensor bt = mha_tensor_contiguous(b, MHA_F32, 1, (int64_t[]){O});
        if (mha_linear_create(d, &wt, &bt)) rc = embed_fail("%s: %s", name, mha_last_error());
    }
    free(w);
    free(b);
    return rc;
}

// The attention of layer l: libmha's checkpoint loader packs BERT's
// separate query/key/value weights and biases into the module's
// in_proj_weight (3E, E) / in_proj_bias (3E), rows Q then K then V, and
// attention.output.dense into out_proj, checking every shape against
// config.json. What the layer does beyond its parameters must be plain
// BERT: bidirectional, no RoPE, window, soft cap or custom scale.
static int load_attention_layer(mha_module **out, const mha_checkpoint *ck, int64_t l,
                                const embed_bert_config *c) {
    mha_config base;
    mha_config_init(&base, 0, 0);
    base.batch_first = true;  // (N, L, E), the activations' layout
    mha_checkpoint_layer info;
    if (mha_checkpoint_load_layer(out, &info, ck, l, &base))
        return embed_fail("layer %lld attention: %s", (long long)l, mha_last_error());
    const mha_config *mc = mha_module_config(*out);
    if (mc->embed_dim != c->hidden_size || mc->num_heads != c->num_heads ||
        mc->num_kv_heads != c->num_heads || !mc->bias || mc->no_out_bias ||
        info.opts.is_causal || info.rope.mode != MHA_ROPE_NONE || info.opts.window_left >= 0 ||
        info.opts.softcap != 0 || info.opts.scale != 0.0)
        return embed_fail("layer %lld attention: not a BERT self-attention of E = %lld, H = %lld "
                          "(model_type %s)",
                          (long long)l, (long long)c->hidden_size, (long long)c->num_heads,
                          info.model_type);
    return 0;
}

int embed_model_load(embed_model **out, const char *dir) {
    *out = NULL;
    embed_model *m = calloc(1, sizeof *m);
    if (!m) return embed_fail("out of memory for the model");
    mha_checkpoint *f = NULL;
    if (read_config(&m->cfg, dir)) goto fail;
    const embed_bert_config *c = &m->cfg;
    int64_t E = c->hidden_size, I = c->intermediate_size;
    if (mha_checkpoint_open(&f, dir)) {
        embed_fail("%s", mha_last_error());
        goto fail;
    }
    if (read_new(&m->word, f, "embeddings.word_embeddings.weight", c->vocab_size, E) ||
        read_new(&m->position, f, "embeddings.position_embeddings.weight", c->max_position, E) ||
        read_new(&m->token_type, f, "embeddings.token_type_embeddings.weight",
                 c->type_vocab_size, E) ||
        read_new(&m->ln_w, f, "embeddings.LayerNorm.weight", E, 0) ||
        read_new(&m->ln_b, f, "embeddings.LayerNorm.bias", E, 0))
        goto fail;
    m->layers = calloc((size_t)c->num_layers, sizeof *m->layers);
    if (!m->layers) {
        embed_fail("out of memory for %lld layers", (long long)c->num_layers);
        goto fail;
    }
    for (int64_t l = 0; l < c->num_layers; l++) {
        layer *ly = &m->layers[l];
        char n[200];
        if (load_attention_layer(&ly->attn, f, l, c)) goto fail;
#define P(suffix) (snprintf(n, sizeof n, "encoder.layer.%lld.%s", (long long)l, suffix), n)
        if (read_new(&ly->ln1_w, f, P("attention.output.LayerNorm.weight"), E, 0) ||
            read_new(&ly->ln1_b, f, P("attention.output.LayerNorm.bias"), E, 0) ||
            read_dense(&ly->inter, f, P("intermediate.dense"), I, E) ||
            read_dense(&ly->output, f, P("output.dense"), E, I) ||
            read_new(&ly->ln2_w, f, P("output.LayerNorm.weight"), E, 0) ||
            read_new(&ly->ln2_b, f, P("output.LayerNorm.bias"), E, 0))
            goto fail;
#undef P
    }
    mha_checkpoint_close(f);
    *out = m;
    return 0;
fail:
    mha_checkpoint_close(f);
    embed_model_destroy(m);
    return -1;
}

// ---------------------------------------------------------------------------
// GELU

// GELU(u) = u / 2 (1 + erf(u / sqrt 2)) over n floats in place, erf by
// Abramowitz and Stegun 7.1.26 (Handbook of Mathematical Functions, 1964;
// |error| <= 1.5e-7, the formula of PyTorch's vectorised CPU erf):
//   erf(z) = 1 - (a1 t + a2 t^2 + a3 t^3 + a4 t^4 + a5 t^5) exp(-z^2),
//   t = 1 / (1 + p z), z >= 0; erf(-z) = -erf(z)
// with exp(-z^2) = 2^k e^r, k = round(-z^2 / ln 2), |r| <= ln 2 / 2, e^r
// by its Taylor series to r^7 (relative error < 1e-8). Branch-free, so
// that the loop vectorises: the body is compiled per ISA (AVX-512, AVX2 +
// FMA, portable) and picked by mha_isa(), so one binary runs anywhere and
// MHA_ISA=scalar forces the portable one.
static inline __attribute__((always_inline)) void gelu_body(float *h, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        float u = h[i], z = fabsf(u) * SQRT1_2;
        float w = -z * z;
        w = w < -87.0f ? -87.0f : w;
        float kf = (w * 1.44269504f + 12582912.0f) - 12582912.0f;  // round(w / ln 2)
        float r = (w - kf * 0.693145752f) - kf * 1.42860677e-6f;   // ln 2 in two parts
        float er = 1.0f +
                   r * (1.0f +
                        r * (0.5f + r * (1.0f / 6 +
                                         r * (1.0f / 24 +
                                              r * (1.0f / 120 +
                                                   r * (1.0f / 720 + r * (1.0f / 5040)))))));
        int32_t bits = ((int32_t)kf + 127) * (1 << 23);
        float scale;
        memcpy(&scale, &bits, sizeof scale);
        float t = 1.0f / (1.0f + 0.3275911f * z);
        float poly = t * (0.254829592f +
                          t * (-0.284496736f +
                               t * (1.421413741f + t * (-1.453152027f + t * 1.061405429f))));
        float erfz = 1.0f - poly * (er * scale);
        h[i] = 0.5f * u * (1.0f + (u < 0 ? -erfz : erfz));
    }
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(MHA_SCALAR_ONLY)
#define EMBED_X86 1
#endif

#define GELU_DRIVER(NAME, ATTR)                                                   \
    ATTR static void NAME(float *h, int64_t n) {                                  \
        int64_t chunk = 4096;                                                     \
        _Pragma("omp parallel for schedule(static)") for (int64_t c0 = 0; c0 < n; \
                                                          c0 += chunk) {          \
            gelu_body(h + c0, n - c0 < chunk ? n - c0 : chunk);                   \
        }                                                                         \
    }
#ifdef EMBED_X86
GELU_DRIVER(gelu_avx512, __attribute__((target("avx512f,avx2,fma"))))
GELU_DRIVER(gelu_avx2, __attribute__((target("avx2,fma"))))
#endif
GELU_DRIVER(gelu_generic, )

static void gelu(float *h, int64_t n) {
#ifdef EMBED_X86
    const char *isa = mha_isa();
    if (!strncmp(isa, "avx512", 6) || !strcmp(isa, "amx")) return gelu_avx512(h, n);
    if (!strcmp(isa, "avx2")) return gelu_avx2(h, n);
#endif
    gelu_generic(h, n);
}

// h (R, O) = x (R, I) W^T + b, both row-major, through libmha's dense layer.
static int linear(float *h, const float *x, const mha_linear *d, int64_t R, int64_t I,
                  int64_t O, const char *what, int64_t l) {
    mha_tensor xt = mha_tensor_contiguous((void *)x, MHA_F32, 2, (int64_t[]){R, I});
    mha_tensor ht = mha_tensor_contiguous(h, MHA_F32, 2, (int64_t[]){R, O});
    if (mha_linear_forward(d, &ht, &xt))
        return embed_fail("layer %lld %s: %s", (long long)l, what, mha_last_error());
    return 0;
}

// ---------------------------------------------------------------------------
// The forward

// out = (x - mean) / sqrt(var + eps) * w + b over each row of E (in place
// allowed); mean and var (biased) in double.
static void layernorm(float *out, const float *x, const float *w, const float *b, int64_t R,
                      int64_t E, double eps) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < R; r++) {
        const float *xr = x + r * E;
        double s = 0, s2 = 0;
        for (int64_t i = 0; i < E; i++) s += xr[i];
        double mean = s / (double)E;
        for (int64_t i = 0; i < E; i++) s2 += ((double)xr[i] - mean) * ((double)xr[i] - mean);
        float rstd = (float)(1.0 / sqrt(s2 / (double)E + eps)), fm = (float)mean;
        float *o = out + r * E;
        for (int64_t i = 0; i < E; i++) o[i] = (xr[i] - fm) * rstd * w[i] + b[i];
    }
}

int embed_model_encode(float *out, const embed_model *m, const int64_t *ids,
                       const int64_t *mask, int64_t N, int64_t L) {
    const embed_bert_config *c = &m->cfg;
    int64_t E = c->hidden_size, I = c->intermediate_size, R = N * L;
    if (N < 1 || L < 1 || L > c->max_position)
        return embed_fail("batch %lld x %lld tokens: need N >= 1 and 1 <= L <= %lld "
                          "(max_position_embeddings)",
                          (long long)N, (long long)L, (long long)c->max_position);
    for (int64_t n = 0; n < N; n++) {
        int64_t ones = 0;
        for (int64_t t = 0; t < L; t++) {
            int64_t id = ids[n * L + t];
            if (id < 0 || id >= c->vocab_size)
                return embed_fail("token id %lld at [%lld, %lld] outside [0, %lld)",
                                  (long long)id, (long long)n, (long long)t,
                                  (long long)c->vocab_size);
            ones += mask[n * L + t] != 0;
        }
        if (!ones)
            return embed_fail("sequence %lld has no token (its mask is all 0)", (long long)n);
    }
    // Only attention sees the padded (N, L, E) layout; every other step is
    // row-wise, so it runs on the T real tokens alone, packed: row k of the
    // packed activations is padded row rows[k] (transformers computes the
    // padding rows too; they never reach the pooled result).
    int64_t T = 0;
    for (int64_t r = 0; r < R; r++) T += mask[r] != 0;
    // scratch: xp, ap (R, E) padded; x, a (T, E) and h (T, I) packed
    size_t floats = (size_t)R * (size_t)(2 * E) + (size_t)T * (size_t)(2 * E + I);
    float *xp = calloc(floats, sizeof(float));  // padding rows stay 0
    uint8_t *pad = malloc((size_t)R);
    int64_t *rows = malloc((size_t)T * sizeof *rows);
    double *acc = malloc((size_t)E * sizeof *acc);  // a pooled row
    if (!xp || !pad || !rows || !acc) {
        free(xp);
        free(pad);
        free(rows);
        free(acc);
        return embed_fail("out of memory for a batch of %lld x %lld tokens", (long long)N,
                          (long long)L);
    }
    float *ap = xp + R * E, *x = ap + R * E, *a = x + T * E, *h = a + T * E;
    for (int64_t r = 0, k = 0; r < R; r++) {
        pad[r] = mask[r] == 0;
        if (mask[r]) rows[k++] = r;
    }
    // embeddings: (word + token_type[0]) + position, as transformers adds
    for (int64_t k = 0; k < T; k++) {
        int64_t r = rows[k];
        const float *we = m->word + ids[r] * E, *pe = m->position + (r % L) * E;
        for (int64_t i = 0; i < E; i++) x[k * E + i] = (we[i] + m->token_type[i]) + pe[i];
    }
    layernorm(x, x, m->ln_w, m->ln_b, T, E, c->layer_norm_eps);

    int64_t shape[3] = {N, L, E}, mshape[2] = {N, L};
    mha_tensor xt = mha_tensor_contiguous(xp, MHA_F32, 3, shape);
    mha_tensor at = mha_tensor_contiguous(ap, MHA_F32, 3, shape);
    mha_tensor kpm = mha_tensor_contiguous(pad, MHA_U8, 2, mshape);
    mha_forward_args fa;
    mha_forward_args_init(&fa);
    fa.query = fa.key = fa.value = &xt;
    fa.key_padding_mask = &kpm;
    int rc = 0;
    size_t row_bytes = (size_t)E * sizeof(float);
    for (int64_t l = 0; l < c->num_layers && !rc; l++) {
        const layer *ly = &m->layers[l];
        for (int64_t k = 0; k < T; k++) memcpy(xp + rows[k] * E, x + k * E, row_bytes);
        if (mha_forward(&at, NULL, ly->attn, &fa)) {
            rc = embed_fail("layer %lld attention: %s", (long long)l, mha_last_error());
            break;
        }
        for (int64_t k = 0; k < T; k++)  // a = attention + residual
            for (int64_t i = 0; i < E; i++) a[k * E + i] = ap[rows[k] * E + i] + x[k * E + i];
        layernorm(x, a, ly->ln1_w, ly->ln1_b, T, E, c->layer_norm_eps);
        if ((rc = linear(h, x, ly->inter, T, E, I, "intermediate.dense", l)))  // (T, I)
            break;
        gelu(h, T * I);  // the exact (erf) GELU
        if ((rc = linear(a, h, ly->output, T, I, E, "output.dense", l)))  // (T, E)
            break;
        for (int64_t i = 0; i < T * E; i++) a[i] += x[i];
        layernorm(x, a, ly->ln2_w, ly->ln2_b, T, E, c->layer_norm_eps);
    }
    // mean pooling over the mask, then L2 normalisation (the packed rows
    // of sequence n are consecutive)
    for (int64_t n = 0, k = 0; n < N && !rc; n++) {
        double cnt = 0, norm = 0;
        for (int64_t i = 0; i < E; i++) acc[i] = 0;
        for (; k < T && rows[k] < (n + 1) * L; k++) {
            cnt += 1;
            for (int64_t i = 0; i < E; i++) acc[i] += x[k * E + i];
        }
        cnt = cnt > 1e-9 ? cnt : 1e-9;
        for (int64_t i = 0; i < E; i++) {
            acc[i] /= cnt;
            norm += acc[i] * acc[i];
        }
        norm = sqrt(norm);
        norm = norm > 1e-12 ? norm : 1e-12;
        for (int64_t i = 0; i < E; i++) out[n * E + i] = (float)(acc[i] / norm);
    }
    free(xp);
    free(pad);
    free(rows);
    free(acc);
    return rc;
}
