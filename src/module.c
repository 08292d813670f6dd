// module.c: the nn.MultiheadAttention module object: its config, and its
// parameters under PyTorch's names, carved out of one allocation.
//
// Parameter block layout (float32, or cfg.weight_dtype for the weight
// matrices; each piece 64-byte aligned), in the order
// of PyTorch's state_dict; d = head_dim (E / H unless set), Eq = H d (= E
// unless head_dim is set), Ekv = num_kv_heads * d (= Eq without
// grouped-query attention):
//   in_proj_weight (Eq + 2 Ekv, E)            when kdim == vdim == E and not
//                                             separate_qkv
//   q_proj_weight (Eq, E), k_proj_weight (Ekv, kdim), v_proj_weight (Ekv, vdim)
//                                             otherwise
//   in_proj_bias (Eq + 2 Ekv)                 when bias
//   bias_k (1, 1, Ekv), bias_v (1, 1, Ekv)    when add_bias_kv
//   out_proj.weight (E, Eq)
//   out_proj.bias (E)                         when bias and not no_out_bias
//   head_gate (H)                             MHA_GATE_STATIC
//   gate_proj.weight (H, E), gate_proj.bias (H)  MHA_GATE_DYNAMIC
//   sinks (H)                                 sinks
//   q_norm.weight (d), k_norm.weight (d)      MHA_QK_NORM_HEAD
//   q_norm.weight (Eq), k_norm.weight (Ekv)   MHA_QK_NORM_ALL
// The pruned-head flags (H) are a separate allocation.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "module.h"
#include "view.h"

void mha_config_init(mha_config *cfg, int64_t embed_dim, int64_t num_heads) {
    if (!cfg) return;
    memset(cfg, 0, sizeof *cfg);
    cfg->embed_dim = embed_dim;
    cfg->num_heads = num_heads;
    cfg->bias = true;
}

static mha_status check_config(const mha_config *c) {
    if (c->embed_dim <= 0)
        return mha__fail(MHA_ERR_INVALID_ARG, "embed_dim must be positive, got %lld",
                         (long long)c->embed_dim);
    if (c->num_heads <= 0)
        return mha__fail(MHA_ERR_INVALID_ARG, "num_heads must be positive, got %lld",
                         (long long)c->num_heads);
    if (c->head_dim < 0)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "head_dim must be >= 0 (0 = embed_dim / num_heads), got %lld",
                         (long long)c->head_dim);
    if (c->head_dim == 0 && c->embed_dim % c->num_heads != 0)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "embed_dim %lld is not divisible by num_heads %lld",
                         (long long)c->embed_dim, (long long)c->num_heads);
    if (c->num_kv_heads < 0 || (c->num_kv_heads > 0 && c->num_heads % c->num_kv_heads != 0))
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "num_kv_heads %lld must divide num_heads %lld (0 = num_heads)",
                         (long long)c->num_kv_heads, (long long)c->num_heads);
    if (c->kdim < 0 || c->vdim < 0)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "kdim and vdim must be >= 0 (0 = embed_dim), got "
                         "kdim %lld, vdim %lld",
                         (long long)c->kdim, (long long)c->vdim);
    if (!(c->dropout >= 0.0f && c->dropout < 1.0f))
        return mha__fail(MHA_ERR_INVALID_ARG, "dropout must be in [0, 1), got %g",
                         (double)c->dropout);
    if (!(c->out_dropout >= 0.0f && c->out_dropout < 1.0f))
        return mha__fail(MHA_ERR_INVALID_ARG, "out_dropout must be in [0, 1), got %g",
                         (double)c->out_dropout);
    if (c->weight_dtype != MHA_F32 && c->weight_dtype != MHA_BF16 && c->weight_dtype != MHA_F16)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "weight_dtype must be F32, BF16 or F16, got %s (%d)",
                         mha_dtype_name(c->weight_dtype), (int)c->weight_dtype);
    if (c->no_out_bias && !c->bias)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "no_out_bias drops out_proj.bias of a biased module: it needs bias "
                         "(in_proj_bias), which is false");
    if ((unsigned)c->qk_norm > MHA_QK_NORM_ALL)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "qk_norm must be MHA_QK_NORM_NONE, MHA_QK_NORM_HEAD or "
                         "MHA_QK_NORM_ALL, got %d",
                         (int)c->qk_norm);
    if (!(c->qk_norm_eps >= 0.0f && c->qk_norm_eps < INFINITY))
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "qk_norm_eps must be finite and >= 0 (0 = 1e-6), got %g",
                         (double)c->qk_norm_eps);
    if ((unsigned)c->head_gate > MHA_GATE_DYNAMIC)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "head_gate must be MHA_GATE_NONE, MHA_GATE_STATIC or "
                         "MHA_GATE_DYNAMIC, got %d",
                         (int)c->head_gate);
    // Every parameter must be addressable: with M = max(E, Eq), at most
    // (3M + 3) * max(M, kdim, vdim) floats in all (Eq = H head_dim; every
    // matrix has at most 3M rows (Ekv <= Eq) and M of them at most 4 M^2
    // floats, the bound's bytes at most PTRDIFF_MAX / 2), checked without
    // overflow.
    int64_t eq = c->embed_dim, rows, n;
    if (c->head_dim > 0 && mha__mul_overflow_i64(c->head_dim, c->num_heads, &eq))
        return mha__fail(MHA_ERR_OVERFLOW, "head_dim %lld x num_heads %lld overflows",
                         (long long)c->head_dim, (long long)c->num_heads);
    int64_t maxd = c->embed_dim > eq ? c->embed_dim : eq, mrow = maxd;
    if (c->kdim > maxd) maxd = c->kdim;
    if (c->vdim > maxd) maxd = c->vdim;
    size_t bytes;
    if (mha__mul_overflow_i64(mrow, 3, &rows) || rows > INT64_MAX - 3 ||
        mha__mul_overflow_i64(rows + 3, maxd, &n) ||
        mha__mul_overflow_size((size_t)n, sizeof(float), &bytes) ||
        bytes > (size_t)PTRDIFF_MAX / 2)
        return mha__fail(MHA_ERR_OVERFLOW,
                         "parameters of embed_dim %lld, kdim %lld, vdim %lld, "
                         "num_heads x head_dim %lld are too large to address",
                         (long long)c->embed_dim, (long long)c->kdim, (long long)c->vdim,
                         (long long)eq);
    return MHA_OK;
}

static void add_param(mha_module *m, const char *name, int ndim, int64_t d0, int64_t d1,
                      int64_t d2, mha_dtype dt) {
    mha_param *p = &m->params[m->nparams++];
    p->name = name;
    p->ndim = ndim;
    p->shape[0] = d0;
    p->shape[1] = d1;
    p->shape[2] = d2;
    p->numel = d0 * (ndim > 1 ? d1 : 1) * (ndim > 2 ? d2 : 1);
    p->data = NULL;
    p->dtype = dt;
    p->storage = NULL;
}

static void *storage_of(const mha_module *m, const char *name) {
    for (int i = 0; i < m->nparams; i++)
        if (strcmp(m->params[i].name, name) == 0) return m->params[i].storage;
    return NULL;
}

// The named pointers from the allocated params.
static void bind_named(mha_module *m) {
    const int64_t E = m->cfg.embed_dim, Eq = m->q_dim, Ekv = m->kv_dim;
    const size_t es = mha_dtype_size(m->wdt);
    m->w_in = storage_of(m, "in_proj_weight");
    if (m->w_in) {
        m->w_q = m->w_in;
        m->w_k = (char *)m->w_in + (size_t)(Eq * E) * es;
        m->w_v = (char *)m->w_in + (size_t)((Eq + Ekv) * E) * es;
    } else {
        m->w_q = storage_of(m, "q_proj_weight");
        m->w_k = storage_of(m, "k_proj_weight");
        m->w_v = storage_of(m, "v_proj_weight");
    }
    m->w_out = storage_of(m, "out_proj.weight");
    if (m->wdt == MHA_F32) {
        m->in_proj_weight = m->w_in;
        m->q_weight = m->w_q;
        m->k_weight = m->w_k;
        m->v_weight = m->w_v;
        m->out_weight = m->w_out;
    }
    m->in_proj_bias = storage_of(m, "in_proj_bias");
    m->bias_k = storage_of(m, "bias_k");
    m->bias_v = storage_of(m, "bias_v");
    m->out_bias = storage_of(m, "out_proj.bias");
    m->head_gate = storage_of(m, "head_gate");
    m->gate_weight = storage_of(m, "gate_proj.weight");
    m->gate_bias = storage_of(m, "gate_proj.bias");
    m->sinks = storage_of(m, "sinks");
    m->q_norm = storage_of(m, "q_norm.weight");
    m->k_norm = storage_of(m, "k_norm.weight");
}

const char *mha_head_gate_name(mha_head_gate g) {
    switch (g) {
    case MHA_GATE_NONE: return "none";
    case MHA_GATE_STATIC: return "static";
    case MHA_GATE_DYNAMIC: return "dynamic";
    }
    return "unknown";
}

mha_status mha_head_gate_from_name(mha_head_gate *out, const char *name) {
    if (!out || !name)
        return mha__fail(MHA_ERR_INVALID_ARG, "mha_head_gate_from_name: NULL argument");
    for (int g = MHA_GATE_NONE; g <= MHA_GATE_DYNAMIC; g++)
        if (strcmp(name, mha_head_gate_name((mha_head_gate)g)) == 0) {
            *out = (mha_head_gate)g;
            return MHA_OK;
        }
    return mha__fail(MHA_ERR_INVALID_ARG,
                     "unknown head gate \"%.64s\" (expected none, static or dynamic)", name);
}

void mha__qk_norm_reset(mha_module *m) {
    for (int i = 0; i < m->nparams; i++)
        if (strcmp(m->params[i].name, "q_norm.weight") == 0 ||
            strcmp(m->params[i].name, "k_norm.weight") == 0)
            for (int64_t j = 0; j < m->params[i].numel; j++) m->params[i].data[j] = 1.0f;
}

static size_t round64(size_t b) { return (b + 63) & ~(size_t)63; }

mha_status mha_module_create(mha_module **out, const mha_config *cfg) {
    if (!out || !cfg)
        return mha__fail(MHA_ERR_INVALID_ARG, "mha_module_create: NULL argument");
    *out = NULL;
    mha_status st = check_config(cfg);
    if (st) return st;
    mha_module *m = mha__calloc(1, sizeof *m);
    if (!m)
        return mha__fail(MHA_ERR_NOMEM, "mha_module_create: out of memory (%zu bytes)",
                         sizeof *m);
    m->cfg = *cfg;
    const int64_t E = cfg->embed_dim;
    if (m->cfg.kdim == 0) m->cfg.kdim = E;
    if (m->cfg.vdim == 0) m->cfg.vdim = E;
    m->packed = (m->cfg.kdim == E && m->cfg.vdim == E && !cfg->separate_qkv);
    m->head_dim = cfg->head_dim ? cfg->head_dim : E / cfg->num_heads;
    m->cfg.head_dim = m->head_dim;
    m->q_dim = cfg->num_heads * m->head_dim;
    if (m->cfg.num_kv_heads == 0) m->cfg.num_kv_heads = cfg->num_heads;
    const int64_t Eq = m->q_dim, Ekv = m->cfg.num_kv_heads * m->head_dim;
    m->kv_dim = Ekv;
    const mha_dtype wd = m->wdt = cfg->weight_dtype;

    if (m->packed) {
        add_param(m, "in_proj_weight", 2, Eq + 2 * Ekv, E, 0, wd);
    } else {
        add_param(m, "q_proj_weight", 2, Eq, E, 0, wd);
        add_param(m, "k_proj_weight", 2, Ekv, m->cfg.kdim, 0, wd);
        add_param(m, "v_proj_weight", 2, Ekv, m->cfg.vdim, 0, wd);
    }
    if (cfg->bias) add_param(m, "in_proj_bias", 1, Eq + 2 * Ekv, 0, 0, MHA_F32);
    if (cfg->add_bias_kv) {
        add_param(m, "bias_k", 3, 1, 1, Ekv, MHA_F32);
        add_param(m, "bias_v", 3, 1, 1, Ekv, MHA_F32);
    }
    add_param(m, "out_proj.weight", 2, E, Eq, 0, wd);
    if (cfg->bias && !cfg->no_out_bias) add_param(m, "out_proj.bias", 1, E, 0, 0, MHA_F32);
    const int64_t H = cfg->num_heads;
    if (cfg->head_gate == MHA_GATE_STATIC) add_param(m, "head_gate", 1, H, 0, 0, MHA_F32);
    if (cfg->head_gate == MHA_GATE_DYNAMIC) {
        add_param(m, "gate_proj.weight", 2, H, E, 0, MHA_F32);
        add_param(m, "gate_proj.bias", 1, H, 0, 0, MHA_F32);
    }
    if (cfg->sinks) add_param(m, "sinks", 1, H, 0, 0, MHA_F32);
    if (cfg->qk_norm != MHA_QK_NORM_NONE) {
        const bool all = cfg->qk_norm == MHA_QK_NORM_ALL;
        add_param(m, "q_norm.weight", 1, all ? Eq : m->head_dim, 0, 0, MHA_F32);
        add_param(m, "k_norm.weight", 1, all ? Ekv : m->head_dim, 0, 0, MHA_F32);
    }

    size_t total = 0;
    for (int i = 0; i < m->nparams; i++)
        total += round64((size_t)m->params[i].numel * mha_dtype_size(m->params[i].dtype));
    m->block = mha__alloc(total);
    m->pruned = mha__calloc((size_t)H, sizeof(bool));
    if (!m->block || !m->pruned) {
        mha__free(m->block);
        free(m->pruned);
        free(m);
        return mha__fail(MHA_ERR_NOMEM,
                         "mha_module_create: out of memory for %zu bytes of "
                         "parameters",
                         total);
    }
    memset(m->block, 0, total);
    char *p = (char *)m->block;
    for (int i = 0; i < m->nparams; i++) {
        mha_param *q = &m->params[i];
        q->storage = p;
        q->data = q->dtype == MHA_F32 ? (float *)p : NULL;
        p += round64((size_t)q->numel * mha_dtype_size(q->dtype));
    }
    bind_named(m);
    if ((st = mha__packs_create(m))) {
        mha__free(m->block);
        free(m->pruned);
        free(m);
        return st;
    }
    if (m->head_gate)  // static gates start open: the ungated module
        for (int64_t h = 0; h < H; h++) m->head_gate[h] = 1.0f;
    mha__qk_norm_reset(m);  // the norms' weights start at 1 (torch's RMSNorm)
    *out = m;
    return MHA_OK;
}

void mha_module_destroy(mha_module *m) {
    if (!m) return;
    mha__packs_destroy(m->packs);
    mha__free(m->block);
    free(m->pruned);
    free(m);
}

mha_status mha_module_prune_heads(mha_module *m, const int64_t *heads, int64_t n) {
    if (!m || n < 0 || (n > 0 && !heads))
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "mha_module_prune_heads: NULL module, negative count or NULL heads");
    const int64_t H = m->cfg.num_heads;
    for (int64_t i = 0; i < n; i++)
        if (heads[i] < 0 || heads[i] >= H)
            return mha__fail(MHA_ERR_INVALID_ARG,
                             "mha_module_prune_heads: heads[%lld] = %lld is not a head "
                             "(num_heads %lld)",
                             (long long)i, (long long)heads[i], (long long)H);
    memset(m->pruned, 0, (size_t)H * sizeof(bool));
    for (int64_t i = 0; i < n; i++) m->pruned[heads[i]] = true;
    m->npruned = mha__live_in(m, 0, H);
    m->npruned = H - m->npruned;
    return MHA_OK;
}

bool mha_module_head_pruned(const mha_module *m, int64_t h) {
    return m && h >= 0 && h < m->cfg.num_heads && m->pruned[h];
}

int64_t mha_module_num_pruned(const mha_module *m) { return m ? m->npruned : 0; }

const mha_config *mha_module_config(const mha_module *m) { return m ? &m->cfg : NULL; }

int mha_module_num_params(const mha_module *m) { return m ? m->nparams : 0; }

mha_status mha_module_param_at(mha_param *out, const mha_module *m, int i) {
    if (!out || !m)
        return mha__fail(MHA_ERR_INVALID_ARG, "mha_module_param_at: NULL argument");
    if (i < 0 || i >= m->nparams)
        return mha__fail(MHA_ERR_INVALID_ARG, "parameter index %d out of range [0, %d)", i,
                         m->nparams);
    *out = m->params[i];
    mha__packs_stale(m);  // (the caller may write through out->data)
    return MHA_OK;
}

mha_status mha_module_param(mha_param *out, const mha_module *m, const char *name) {
    if (!out || !m || !name)
        return mha__fail(MHA_ERR_INVALID_ARG, "mha_module_param: NULL argument");
    for (int i = 0; i < m->nparams; i++) {
        if (strcmp(m->params[i].name, name) == 0) {
            *out = m->params[i];
            mha__packs_stale(m);  // (the caller may write through out->data)
            return MHA_OK;
        }
    }
    return mha__fail(MHA_ERR_NOT_FOUND, "the module has no parameter \"%.100s\"", name);
}

void mha__copy_params(mha_module *dst, const mha_module *src) {
    mha__packs_stale(dst);
    for (int i = 0; i < src->nparams; i++) {
        const mha_param *s = &src->params[i], *d = &dst->params[i];
        if (s->dtype == d->dtype) {
            memcpy(d->storage, s->storage, (size_t)s->numel * mha_dtype_size(s->dtype));
            continue;
        }
        // element by element through the reference's typed views (to a half
        // type: via float32, nearest even)
        const mha__mat from = mha__vmat(s->storage, s->dtype, 0, 1),
                       to = mha__vmat(d->storage, d->dtype, 0, 1);
        for (int64_t e = 0; e < s->numel; e++) mha__st(to, 0, e, mha__ld(from, 0, e));
    }
}

mha_status mha_module_convert(mha_module **out, const mha_module *m, mha_dtype weight_dtype) {
    if (!out || !m) return mha__fail(MHA_ERR_INVALID_ARG, "mha_module_convert: NULL argument");
    *out = NULL;
    mha_config cfg = m->cfg;
    cfg.weight_dtype = weight_dtype;
    mha_module *c;
    mha_status st = mha_module_create(&c, &cfg);
    if (st) return st;
    mha__copy_params(c, m);
    memcpy(c->pruned, m->pruned, (size_t)cfg.num_heads * sizeof(bool));
    c->npruned = m->npruned;
    *out = c;
    return MHA_OK;
}

mha_status mha__require_f32_weights(const mha_module *m, const char *what) {
    if (m->wdt == MHA_F32) return MHA_OK;
    return mha__fail(MHA_ERR_DTYPE,
                     "%s: the module's weights are stored as %s (inference only); "
                     "training needs float32 weights (mha_module_convert(..., MHA_F32))",
                     what, mha_dtype_name(m->wdt));
}
