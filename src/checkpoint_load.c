// checkpoint_load.c: the attention of one layer of a Hugging Face
// checkpoint loaded into a module (mha_checkpoint_load_layer,
// mha_module_load_checkpoint): the tensors each architecture names (q/k/v
// packed into in_proj_weight, Conv1D weights transposed, the buffers older
// checkpoints saved skipped), found under the layer's prefix, each dtype
// and shape checked against the layer's spec (checkpoint_spec.c) before
// anything is written into the module; and mha_checkpoint_layer_apply.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint.h"
#include "internal.h"
#include "safetensors.h"

// ---------------------------------------------------------------------------
// The layer's tensors

typedef struct ck_want {
    const char *suffix;  // after the layer's attention prefix
    int ndim;
    int64_t shape[2];
    const char *param;  // destination; NULL: a known tensor not loaded
    int64_t row0;       // first row (or element) of the destination
    bool transpose;     // Conv1D: stored (in, out)
    bool required;
    mha_st_tensor t;
    bool found;
} ck_want;

#define CK_MAX_WANT 16

static void want(ck_want *w, int *n, const char *suffix, int ndim, int64_t d0, int64_t d1,
                 const char *param, int64_t row0, bool transpose, bool required) {
    ck_want *x = &w[(*n)++];
    memset(x, 0, sizeof *x);
    x->suffix = suffix;
    x->ndim = ndim;
    x->shape[0] = d0;
    x->shape[1] = d1;
    x->param = param;
    x->row0 = row0;
    x->transpose = transpose;
    x->required = required;
}

// The tensors of the layer's attention under the architecture's names.
static int layer_wants(ck_want *w, const ck_spec *s, ck_arch a) {
    const int64_t E = s->E, Eq = s->H * s->d, Ekv = s->Hkv * s->d;
    int n = 0;
    switch (a) {
    case ARCH_BERT:
        want(w, &n, "self.query.weight", 2, E, E, "in_proj_weight", 0, false, true);
        want(w, &n, "self.key.weight", 2, E, E, "in_proj_weight", E, false, true);
        want(w, &n, "self.value.weight", 2, E, E, "in_proj_weight", 2 * E, false, true);
        want(w, &n, "self.query.bias", 1, E, 0, "in_proj_bias", 0, false, true);
        want(w, &n, "self.key.bias", 1, E, 0, "in_proj_bias", E, false, true);
        want(w, &n, "self.value.bias", 1, E, 0, "in_proj_bias", 2 * E, false, true);
        want(w, &n, "output.dense.weight", 2, E, E, "out_proj.weight", 0, false, true);
        want(w, &n, "output.dense.bias", 1, E, 0, "out_proj.bias", 0, false, true);
        want(w, &n, "output.LayerNorm.weight", 1, E, 0, NULL, 0, false, false);
        want(w, &n, "output.LayerNorm.bias", 1, E, 0, NULL, 0, false, false);
        break;
    case ARCH_GPT2:
        want(w, &n, "c_attn.weight", 2, E, 3 * E, "in_proj_weight", 0, true, true);
        want(w, &n, "c_attn.bias", 1, 3 * E, 0, "in_proj_bias", 0, false, true);
        want(w, &n, "c_proj.weight", 2, E, E, "out_proj.weight", 0, true, true);
        want(w, &n, "c_proj.bias", 1, E, 0, "out_proj.bias", 0, false, true);
        // the causal-mask buffers older checkpoints saved
        want(w, &n, "bias", -1, 0, 0, NULL, 0, false, false);
        want(w, &n, "masked_bias", -1, 0, 0, NULL, 0, false, false);
        break;
    default:
        want(w, &n, "q_proj.weight", 2, Eq, E, "in_proj_weight", 0, false, true);
        want(w, &n, "k_proj.weight", 2, Ekv, E, "in_proj_weight", Eq, false, true);
        want(w, &n, "v_proj.weight", 2, Ekv, E, "in_proj_weight", Eq + Ekv, false, true);
        want(w, &n, "o_proj.weight", 2, E, Eq, "out_proj.weight", 0, false, true);
        if (s->qkv_bias) {
            want(w, &n, "q_proj.bias", 1, Eq, 0, "in_proj_bias", 0, false, true);
            want(w, &n, "k_proj.bias", 1, Ekv, 0, "in_proj_bias", Eq, false, true);
            want(w, &n, "v_proj.bias", 1, Ekv, 0, "in_proj_bias", Eq + Ekv, false, true);
        }
        if (s->o_bias) want(w, &n, "o_proj.bias", 1, E, 0, "out_proj.bias", 0, false, true);
        if (s->qk_norm) {
            want(w, &n, "q_norm.weight", 1, s->d, 0, "q_norm.weight", 0, false, true);
            want(w, &n, "k_norm.weight", 1, s->d, 0, "k_norm.weight", 0, false, true);
        }
        if (s->sinks) want(w, &n, "sinks", 1, s->H, 0, "sinks", 0, false, true);
        want(w, &n, "rotary_emb.inv_freq", -1, 0, 0, NULL, 0, false, false);
        break;
    }
    return n;
}

// The prefix ("" or the architecture's) under which the checkpoint holds
// the layer's attention, as the full attention prefix in buf.
static mha_status layer_prefix(char *buf, size_t cap, const mha_checkpoint *c, int64_t layer) {
    const ck_arch_desc *ad = &mha__ck_archs[c->arch];
    char core[96], cand[2][160];
    snprintf(core, sizeof core, ad->core, (long long)layer);
    snprintf(cand[0], sizeof cand[0], "%s", core);
    snprintf(cand[1], sizeof cand[1], "%s%s", ad->prefix, core);
    int hits[2] = {0, 0};
    for (int k = 0; k < 2; k++) {
        const size_t n = strlen(cand[k]);
        for (int64_t i = 0; i < c->nnames && !hits[k]; i++)
            hits[k] = strncmp(c->names[i].name, cand[k], n) == 0;
    }
    if (hits[0] && hits[1])
        return mha__fail(MHA_ERR_FORMAT,
                         "%s: holds tensors under both \"%s*\" and \"%s*\" (which layer?)",
                         mha__ck_where(c), cand[0], cand[1]);
    if (!hits[0] && !hits[1])
        return mha__fail(MHA_ERR_NOT_FOUND,
                         "%s: no tensor of layer %lld's attention (looked for \"%s*\" and "
                         "\"%s*\")",
                         mha__ck_where(c), (long long)layer, cand[0], cand[1]);
    snprintf(buf, cap, "%s", cand[hits[0] ? 0 : 1]);
    return MHA_OK;
}

// Finds every tensor of the layer's attention and checks its dtype and
// shape; a tensor under the prefix that is not expected is an error.
static mha_status find_layer_tensors(ck_want *w, int nw, const mha_checkpoint *c,
                                     const char *prefix, int64_t layer) {
    const size_t pl = strlen(prefix);
    char q[CK_Q], s1[96], s2[96];
    mha_status st;
    for (int64_t i = 0; i < c->nnames; i++) {
        const char *name = c->names[i].name;
        if (strncmp(name, prefix, pl) != 0) continue;
        int k = 0;
        while (k < nw && strcmp(name + pl, w[k].suffix) != 0) k++;
        if (k == nw)
            return mha__fail(MHA_ERR_FORMAT,
                             "%s: unexpected tensor %s in layer %lld's attention (not a "
                             "parameter of a %s layer with this config)",
                             mha__ck_where(c), mha_escape(q, sizeof q, name), (long long)layer,
                             mha__ck_archs[c->arch].name);
        if ((st = mha_checkpoint_find(&w[k].t, c, name))) return st;
        w[k].found = true;
    }
    for (int k = 0; k < nw; k++) {
        char full[256];
        snprintf(full, sizeof full, "%s%s", prefix, w[k].suffix);
        mha_escape(q, sizeof q, full);
        if (!w[k].found) {
            if (w[k].required)
                return mha__fail(MHA_ERR_NOT_FOUND,
                                 "%s: layer %lld's attention has no tensor %s",
                                 mha__ck_where(c), (long long)layer, q);
            continue;
        }
        if (w[k].ndim < 0) continue;  // a buffer we skip, whatever its shape
        const mha_st_tensor *t = &w[k].t;
        if (t->dtype != MHA_F32 && t->dtype != MHA_F16 && t->dtype != MHA_BF16)
            return mha__fail(MHA_ERR_DTYPE,
                             "%s: tensor %s has dtype %s (F32, F16 or "
                             "BF16 load)",
                             mha__ck_where(c), q, mha_dtype_name(t->dtype));
        bool ok = t->ndim == w[k].ndim;
        for (int dd = 0; ok && dd < t->ndim; dd++) ok = t->shape[dd] == w[k].shape[dd];
        if (!ok)
            return mha__fail(MHA_ERR_SHAPE, "%s: tensor %s has shape %s, the config says %s",
                             mha__ck_where(c), q,
                             mha__shape_str(s1, sizeof s1, t->ndim, t->shape),
                             mha__shape_str(s2, sizeof s2, w[k].ndim, w[k].shape));
    }
    return MHA_OK;
}

// Writes one tensor into rows [row0, ...) of its parameter.
static mha_status write_tensor(mha_module *m, const ck_want *w) {
    mha_param p;
    mha_status st = mha_module_param(&p, m, w->param);
    if (st) return st;
    const int64_t cols = p.ndim == 2 ? p.shape[1] : 1;
    const size_t es = mha_dtype_size(p.dtype);
    char *dst = (char *)p.storage + (size_t)(w->row0 * cols) * es;
    const size_t bytes = (size_t)w->t.numel * es;
    if (!w->transpose) return mha_st_read(dst, bytes, p.dtype, &w->t);
    // Conv1D (in, out) -> rows of (out, in)
    const int64_t in = w->t.shape[0], out = w->t.shape[1];
    float *tmp = mha__malloc(sizeof(float) * (size_t)(w->t.numel ? w->t.numel : 1));
    if (!tmp) return mha__fail(MHA_ERR_NOMEM, "out of memory transposing %s", w->t.name);
    if ((st = mha_st_read(tmp, sizeof(float) * (size_t)w->t.numel, MHA_F32, &w->t))) {
        free(tmp);
        return st;
    }
    for (int64_t r = 0; r < out; r++)
        for (int64_t k = 0; k < in; k++) {
            const float v = tmp[k * out + r];
            const size_t at = (size_t)(r * in + k);
            if (p.dtype == MHA_F32) ((float *)dst)[at] = v;
            else
                ((uint16_t *)dst)[at] = p.dtype == MHA_BF16 ? mha_f32_to_bf16(v)
                                                            : mha_f32_to_f16(v);
        }
    free(tmp);
    return MHA_OK;
}

mha_status mha_checkpoint_load_layer(mha_module **out, mha_checkpoint_layer *info,
                                     const mha_checkpoint *c, int64_t layer,
                                     const mha_config *base) {
    if (!out || !c)
        return mha__fail(MHA_ERR_INVALID_ARG, "mha_checkpoint_load_layer: NULL argument");
    *out = NULL;
    ck_spec s;
    mha_status st = mha__ck_layer_spec(&s, c, layer);
    if (st) return st;
    char prefix[200];
    if ((st = layer_prefix(prefix, sizeof prefix, c, layer))) return st;
    ck_want w[CK_MAX_WANT];
    const int nw = layer_wants(w, &s, c->arch);
    if ((st = find_layer_tensors(w, nw, c, prefix, layer))) return st;

    // the module: q/k/v packed into in_proj_weight (exact)
    mha_config cfg;
    mha_config_init(&cfg, s.E, s.H);
    cfg.num_kv_heads = s.Hkv;
    if (s.d * s.H != s.E) cfg.head_dim = s.d;
    cfg.bias = s.qkv_bias;
    cfg.no_out_bias = s.qkv_bias && !s.o_bias;
    cfg.qk_norm = s.qk_norm ? MHA_QK_NORM_HEAD : MHA_QK_NORM_NONE;
    cfg.qk_norm_eps = s.qk_norm ? (float)s.eps : 0.0f;
    cfg.sinks = s.sinks;
    cfg.batch_first = base ? base->batch_first : true;
    cfg.weight_dtype = base ? base->weight_dtype : MHA_F32;
    mha_module *m = NULL;
    if ((st = mha_module_create(&m, &cfg))) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", mha_last_error());
        return mha__fail(st, "%s: layer %lld of a %s checkpoint: %s", c->dir, (long long)layer,
                         mha__ck_archs[c->arch].name, msg);
    }
    for (int k = 0; k < nw && !st; k++)
        if (w[k].found && w[k].param) st = write_tensor(m, &w[k]);
    if (st) {
        mha_module_destroy(m);
        return st;
    }
    if (info) *info = s.info;
    *out = m;
    return MHA_OK;
}

mha_status mha_module_load_checkpoint(mha_module **out, mha_checkpoint_layer *info,
                                      const char *dir, int64_t layer, const mha_config *base) {
    if (!out) return mha__fail(MHA_ERR_INVALID_ARG, "mha_module_load_checkpoint: out is NULL");
    *out = NULL;
    mha_checkpoint *c;
    mha_status st = mha_checkpoint_open(&c, dir);
    if (st) return st;
    st = mha_checkpoint_load_layer(out, info, c, layer, base);
    mha_checkpoint_close(c);
    return st;
}

void mha_checkpoint_layer_apply(const mha_checkpoint_layer *info, mha_forward_args *a) {
    if (!info || !a) return;
    a->opts.is_causal = info->opts.is_causal;
    a->opts.window_left = info->opts.window_left;
    a->opts.window_right = -1;
    a->rope = info->rope;
    a->rope_scaling = info->rope_scaling.type != MHA_ROPE_SCALING_NONE ? &info->rope_scaling
                                                                       : NULL;
    a->opts.softcap = info->opts.softcap;
    a->opts.scale = info->opts.scale;
}
