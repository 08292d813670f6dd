// io.c: a module's parameters to and from safetensors files, under
// PyTorch's state_dict names. Every tensor's presence and shape is checked
// before anything is copied.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "module.h"

static bool is_float_dtype(mha_dtype t) {
    return t == MHA_F32 || t == MHA_F16 || t == MHA_BF16 || t == MHA_F64;
}

// Finds an optional tensor: *found = false when absent (not an error).
static mha_status find_opt(mha_st_tensor *t, bool *found, const mha_st_file *f,
                           const char *name) {
    for (int64_t i = 0; i < mha_st_num_tensors(f); i++) {
        mha_status st = mha_st_tensor_at(t, f, i);
        if (st) return st;
        if (strcmp(t->name, name) == 0) {
            *found = true;
            return MHA_OK;
        }
    }
    *found = false;
    return MHA_OK;
}

static bool parse_pos_int(const char *s, int64_t *out) {
    if (!s || !*s) return false;
    int64_t v = 0;
    for (const char *c = s; *c; c++) {
        if (*c < '0' || *c > '9') return false;
        if (v > (INT64_MAX - 9) / 10) return false;
        v = v * 10 + (*c - '0');
    }
    if (v <= 0) return false;
    *out = v;
    return true;
}

// __metadata__ "pruned_heads": comma-separated head indices ("" or absent:
// none).
static mha_status load_pruned(mha_module *m, const mha_st_file *f, const char *lab) {
    const char *s = mha_st_metadata(f, "pruned_heads");
    if (!s || !*s) return MHA_OK;
    const int64_t H = m->cfg.num_heads;
    int64_t *heads = mha__malloc(sizeof(int64_t) * (size_t)H), n = 0;
    if (!heads)
        return mha__fail(MHA_ERR_NOMEM, "%s: out of memory for %lld pruned head indices", lab,
                         (long long)H);
    char qn[128];
    for (const char *p = s;;) {
        int64_t v = 0;
        const char *q = p;
        while (*q >= '0' && *q <= '9' && v <= H) v = v * 10 + (*q++ - '0');
        if (q == p || v >= H || n >= H || (*q != ',' && *q != '\0')) {
            free(heads);
            return mha__fail(MHA_ERR_FORMAT,
                             "%s: __metadata__ pruned_heads \"%s\" is not a comma-separated "
                             "list of at most %lld distinct heads in [0, %lld)",
                             lab, mha_escape(qn, sizeof qn, s), (long long)H, (long long)H);
        }
        heads[n++] = v;
        if (!*q) break;
        p = q + 1;
    }
    mha_status st = mha_module_prune_heads(m, heads, n);
    free(heads);
    return st;
}

// The parameters a file may hold, under their state_dict names.
static const char *names[] = {
    "in_proj_weight",   "q_proj_weight",  "k_proj_weight", "v_proj_weight", "in_proj_bias",
    "out_proj.weight",  "out_proj.bias",  "bias_k",        "bias_v",        "head_gate",
    "gate_proj.weight", "gate_proj.bias", "sinks",         "q_norm.weight", "k_norm.weight"};
enum { IN_W, Q_W, K_W, V_W, IN_B, OUT_W, OUT_B, BK, BV, HG, GW, GB, SK, QN, KN, NP };

// Which parameters are present (has, t), and every tensor of the file one
// of them, in a float dtype.
static mha_status find_params(mha_st_tensor t[NP], bool has[NP], const mha_st_file *f,
                              const char *lab) {
    char qn[128];
    mha_status st;
    for (int i = 0; i < NP; i++)
        if ((st = find_opt(&t[i], &has[i], f, names[i]))) return st;
    for (int64_t i = 0; i < mha_st_num_tensors(f); i++) {
        mha_st_tensor x;
        if ((st = mha_st_tensor_at(&x, f, i))) return st;
        bool known = false;
        for (int j = 0; j < NP; j++) known |= strcmp(x.name, names[j]) == 0;
        if (!known)
            return mha__fail(MHA_ERR_FORMAT,
                             "%s: unexpected tensor %s (not a "
                             "MultiheadAttention parameter)",
                             lab, mha_escape(qn, sizeof qn, x.name));
        if (!is_float_dtype(x.dtype))
            return mha__fail(MHA_ERR_FORMAT,
                             "%s: tensor %s has dtype %s (expected F32, "
                             "F16, BF16 or F64)",
                             lab, mha_escape(qn, sizeof qn, x.name), mha_dtype_name(x.dtype));
    }
    return MHA_OK;
}

// Which parameters are present tells the configuration: embed_dim, kdim,
// vdim, bias, no_out_bias, add_bias_kv, head_gate, separate_qkv (q/k/v
// matrices with kdim == vdim == E). out_proj.weight is (E, Eq): Eq != E
// means head_dim = Eq / H (config_heads, once H is known).
static mha_status config_from_params(mha_config *cfg, const mha_st_tensor t[NP],
                                     const bool has[NP], const char *lab) {
    char s1[160];
    if (!has[OUT_W])
        return mha__fail(MHA_ERR_FORMAT, "%s: no \"out_proj.weight\" tensor", lab);
    if (t[OUT_W].ndim != 2 || t[OUT_W].shape[0] <= 0 || t[OUT_W].shape[1] <= 0)
        return mha__fail(MHA_ERR_FORMAT,
                         "%s: out_proj.weight has shape %s, expected (E, Eq) (Eq = num_heads "
                         "x head_dim, E unless head_dim is set)",
                         lab, mha__shape_str(s1, sizeof s1, t[OUT_W].ndim, t[OUT_W].shape));
    const int64_t E = t[OUT_W].shape[0];
    cfg->embed_dim = E;
    cfg->separate_qkv = false;
    if (has[IN_W]) {
        if (has[Q_W] || has[K_W] || has[V_W])
            return mha__fail(MHA_ERR_FORMAT,
                             "%s: both in_proj_weight and separate "
                             "q/k/v_proj_weight tensors",
                             lab);
        cfg->kdim = cfg->vdim = E;
    } else {
        if (!has[Q_W] || !has[K_W] || !has[V_W])
            return mha__fail(MHA_ERR_FORMAT,
                             "%s: need in_proj_weight, or all of "
                             "q_proj_weight, k_proj_weight and v_proj_weight",
                             lab);
        if (t[K_W].ndim != 2 || t[V_W].ndim != 2)
            return mha__fail(MHA_ERR_FORMAT,
                             "%s: k_proj_weight and v_proj_weight must "
                             "be 2-D (E, kdim), (E, vdim)",
                             lab);
        cfg->kdim = t[K_W].shape[1];
        cfg->vdim = t[V_W].shape[1];
        // separate matrices of a module that could pack them: kept so
        cfg->separate_qkv = cfg->kdim == E && cfg->vdim == E;
    }
    if (has[OUT_B] && !has[IN_B])
        return mha__fail(MHA_ERR_FORMAT,
                         "%s: out_proj.bias without in_proj_bias (a module has both, "
                         "in_proj_bias only (no_out_bias), or neither)",
                         lab);
    cfg->bias = has[IN_B];
    cfg->no_out_bias = has[IN_B] && !has[OUT_B];
    if (has[BK] != has[BV])
        return mha__fail(MHA_ERR_FORMAT,
                         "%s: bias_k and bias_v must be both present or "
                         "both absent (has %s only)",
                         lab, has[BK] ? "bias_k" : "bias_v");
    cfg->add_bias_kv = has[BK];
    if (has[GW] != has[GB] || (has[HG] && has[GW]))
        return mha__fail(MHA_ERR_FORMAT,
                         "%s: gates are either head_gate (static) or both gate_proj.weight "
                         "and gate_proj.bias (dynamic); the file has%s%s%s",
                         lab, has[HG] ? " head_gate" : "", has[GW] ? " gate_proj.weight" : "",
                         has[GB] ? " gate_proj.bias" : "");
    cfg->head_gate = has[HG] ? MHA_GATE_STATIC : has[GW] ? MHA_GATE_DYNAMIC : MHA_GATE_NONE;
    cfg->sinks = has[SK];
    return MHA_OK;
}

// num_heads and num_kv_heads where base left them 0 (cfg->embed_dim set);
// head_dim = Eq / H when out_proj.weight (E, Eq) has Eq != E.
static mha_status config_heads(mha_config *cfg, const mha_st_file *f,
                               const mha_st_tensor t[NP], const bool has[NP], const char *lab) {
    char qn[128];
    const int64_t E = cfg->embed_dim, Eq = t[OUT_W].shape[1];
    if (cfg->num_heads == 0) {
        const char *h = mha_st_metadata(f, "num_heads");
        if (!h)
            return mha__fail(MHA_ERR_INVALID_ARG,
                             "%s: the number of heads is not given and "
                             "the file has no __metadata__ \"num_heads\"",
                             lab);
        if (!parse_pos_int(h, &cfg->num_heads))
            return mha__fail(MHA_ERR_FORMAT,
                             "%s: __metadata__ num_heads %s is not "
                             "a positive integer",
                             lab, mha_escape(qn, sizeof qn, h));
    }
    if (Eq != E) {  // head_dim != E / H: d = Eq / H
        if (cfg->num_heads <= 0 || Eq % cfg->num_heads != 0)
            return mha__fail(MHA_ERR_SHAPE,
                             "%s: out_proj.weight is (%lld, %lld): its %lld input features "
                             "are not num_heads %lld x a head dim",
                             lab, (long long)E, (long long)Eq, (long long)Eq,
                             (long long)cfg->num_heads);
        cfg->head_dim = Eq / cfg->num_heads;
    }
    // num_kv_heads: base, else __metadata__ "num_kv_heads", else from the
    // shapes of the K/V parameters (Ekv rows of features, d = Eq / H each).
    if (cfg->num_kv_heads == 0) {
        const char *kvh = mha_st_metadata(f, "num_kv_heads");
        if (kvh) {
            if (!parse_pos_int(kvh, &cfg->num_kv_heads))
                return mha__fail(MHA_ERR_FORMAT,
                                 "%s: __metadata__ num_kv_heads %s is not a positive "
                                 "integer",
                                 lab, mha_escape(qn, sizeof qn, kvh));
        } else if (cfg->num_heads > 0 && Eq % cfg->num_heads == 0) {
            // Ekv from the first K/V-shaped tensor present (the others are
            // checked against the module's shapes below)
            int64_t ekv = -1;
            const char *from = NULL;
            if (has[IN_W] && t[IN_W].ndim == 2 && t[IN_W].shape[0] > Eq &&
                (t[IN_W].shape[0] - Eq) % 2 == 0)
                ekv = (t[IN_W].shape[0] - Eq) / 2, from = "in_proj_weight";
            else if (has[K_W] && t[K_W].ndim == 2)
                ekv = t[K_W].shape[0], from = "k_proj_weight";
            if (ekv >= 0) {
                const int64_t d = Eq / cfg->num_heads;
                if (ekv == 0 || ekv % d != 0 || cfg->num_heads % (ekv / d) != 0)
                    return mha__fail(MHA_ERR_SHAPE,
                                     "%s: %s gives K/V width %lld, which is not num_kv_heads "
                                     "x head dim %lld with num_kv_heads dividing num_heads "
                                     "%lld (embed_dim %lld)",
                                     lab, from, (long long)ekv, (long long)d,
                                     (long long)cfg->num_heads, (long long)E);
                cfg->num_kv_heads = ekv / d;
            }
        }
    }
    // qk_norm from q_norm.weight / k_norm.weight: (d) per head (Qwen3),
    // else over all features (OLMo 2: (Eq), (Ekv)); with H = Hkv = 1 both
    // are the same normalisation (read as per head). Its epsilon cannot be
    // read from the file: base's qk_norm_eps (0: 1e-6) stands. The shapes
    // are checked against the module's when loading.
    if (has[QN] != has[KN])
        return mha__fail(MHA_ERR_FORMAT,
                         "%s: q_norm.weight and k_norm.weight must be both present or both "
                         "absent (has %s only)",
                         lab, has[QN] ? "q_norm.weight" : "k_norm.weight");
    cfg->qk_norm = MHA_QK_NORM_NONE;
    if (has[QN]) {
        const int64_t d = cfg->num_heads > 0 ? Eq / cfg->num_heads : 0;
        cfg->qk_norm = t[QN].ndim == 1 && t[QN].shape[0] == d ? MHA_QK_NORM_HEAD
                                                              : MHA_QK_NORM_ALL;
    }
    return MHA_OK;
}

// Before allocating: k/v_proj_weight must have Ekv rows, so that kdim and
// vdim (their columns) are bounded by the data in the file (a (0, 2^40)
// tensor has no bytes but would size the module). Skipped when H or
// num_kv_heads is invalid: mha_module_create refuses those first.
static mha_status check_kv_rows(const mha_config *cfg, const mha_st_tensor t[NP],
                                const bool has[NP], const char *lab) {
    char s1[160];
    const int64_t E = cfg->embed_dim;
    const int64_t d = cfg->head_dim > 0                               ? cfg->head_dim
                      : cfg->num_heads > 0 && E % cfg->num_heads == 0 ? E / cfg->num_heads
                                                                      : 0;
    if (!has[IN_W] && d > 0) {
        const int64_t hkv = cfg->num_kv_heads ? cfg->num_kv_heads : cfg->num_heads;
        int64_t ekv;
        if (hkv > 0 && cfg->num_heads % hkv == 0 && !mha__mul_overflow_i64(hkv, d, &ekv)) {
            for (int i = K_W; i <= V_W; i++)
                if (t[i].shape[0] != ekv)
                    return mha__fail(MHA_ERR_SHAPE,
                                     "%s: %s has shape %s, expected (%lld, %s) (num_kv_heads "
                                     "%lld x head dim %lld; embed_dim %lld, num_heads %lld)",
                                     lab, names[i],
                                     mha__shape_str(s1, sizeof s1, t[i].ndim, t[i].shape),
                                     (long long)ekv, i == K_W ? "kdim" : "vdim", (long long)hkv,
                                     (long long)d, (long long)E, (long long)cfg->num_heads);
        }
    }
    return MHA_OK;
}

// Every parameter of the module must be in the file with its exact shape;
// copied (converted to the parameter's dtype). cfg: what m was created from.
static mha_status read_params(mha_module *m, const mha_st_file *f, const mha_config *cfg,
                              const char *lab) {
    char s1[160];
    const int64_t E = cfg->embed_dim;
    mha_status st;
    for (int i = 0; i < m->nparams; i++) {
        const mha_param *p = &m->params[i];
        mha_st_tensor x;
        if ((st = mha_st_find(&x, f, p->name))) return st;
        bool same = x.ndim == p->ndim;
        for (int d = 0; same && d < p->ndim; d++) same = x.shape[d] == p->shape[d];
        if (!same) {
            char s2[160];
            return mha__fail(MHA_ERR_SHAPE,
                             "%s: %s has shape %s, expected %s (embed_dim "
                             "%lld, num_heads %lld, num_kv_heads %lld, head_dim %lld, "
                             "kdim %lld, vdim %lld)",
                             lab, p->name, mha__shape_str(s1, sizeof s1, x.ndim, x.shape),
                             mha__shape_str(s2, sizeof s2, p->ndim, p->shape), (long long)E,
                             (long long)cfg->num_heads, (long long)m->cfg.num_kv_heads,
                             (long long)m->head_dim, (long long)m->cfg.kdim,
                             (long long)m->cfg.vdim);
        }
        if ((st = mha_st_read(p->storage, (size_t)p->numel * mha_dtype_size(p->dtype),
                              p->dtype, &x)))
            return st;
    }
    return MHA_OK;
}

mha_status mha_module_load(mha_module **out, const mha_st_file *f, const mha_config *base) {
    if (!out || !f) return mha__fail(MHA_ERR_INVALID_ARG, "mha_module_load: NULL argument");
    *out = NULL;
    const char *lab = mha_st_label(f);
    mha_config cfg;
    mha_config_init(&cfg, 0, 0);
    if (base) cfg = *base;
    mha_status st;

    mha_st_tensor t[NP];
    bool has[NP];
    if ((st = find_params(t, has, f, lab))) return st;
    if ((st = config_from_params(&cfg, t, has, lab))) return st;
    if ((st = config_heads(&cfg, f, t, has, lab))) return st;
    if ((st = check_kv_rows(&cfg, t, has, lab))) return st;
    mha_module *m;
    if ((st = mha_module_create(&m, &cfg))) return st;
    if ((st = read_params(m, f, &cfg, lab))) goto fail;
    if ((st = load_pruned(m, f, lab))) goto fail;
    *out = m;
    return MHA_OK;
fail:
    mha_module_destroy(m);
    return st;
}

mha_status mha_module_save(const mha_module *m, const char *path) {
    if (!m || !path) return mha__fail(MHA_ERR_INVALID_ARG, "mha_module_save: NULL argument");
    mha_st_writer *w;
    mha_status st = mha_st_writer_create(&w);
    if (st) return st;
    for (int i = 0; i < m->nparams && !st; i++) {
        const mha_param *p = &m->params[i];
        st = mha_st_writer_add(w, p->name, p->dtype, p->ndim, p->shape, p->storage);
    }
    char heads[32];
    snprintf(heads, sizeof heads, "%lld", (long long)m->cfg.num_heads);
    if (!st) st = mha_st_writer_set_metadata(w, "num_heads", heads);
    if (!st && m->cfg.num_kv_heads != m->cfg.num_heads) {
        snprintf(heads, sizeof heads, "%lld", (long long)m->cfg.num_kv_heads);
        st = mha_st_writer_set_metadata(w, "num_kv_heads", heads);
    }
    if (!st && m->npruned) {
        char *list = mha__malloc((size_t)m->cfg.num_heads * 21 + 1);
        if (!list)
            st = mha__fail(MHA_ERR_NOMEM,
                           "mha_module_save: out of memory for the pruned_heads "
                           "list (%zu bytes)",
                           (size_t)m->cfg.num_heads * 21 + 1);
        size_t k = 0;
        for (int64_t h = 0; list && h < m->cfg.num_heads; h++)
            if (m->pruned[h])
                k += (size_t)sprintf(list + k, "%s%lld", k ? "," : "", (long long)h);
        if (list) st = mha_st_writer_set_metadata(w, "pruned_heads", list);
        free(list);
    }
    if (!st) st = mha_st_writer_save(w, path);
    mha_st_writer_destroy(w);
    return st;
}
