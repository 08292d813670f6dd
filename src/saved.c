// saved.c: the saved state of a training forward (mha_forward_args.save,
// plan.h): its key (what identifies the forward: module, views, masks,
// dropout, position encodings), its sizing from the plan, and the public
// mha_saved_* calls. The fused forward fills it, the fused backward reads
// it: the projections (after the norm and RoPE), the context, the row
// stats, then (qk_norm) q and k before the norm.
#include <stdlib.h>
#include <string.h>

#include "plan.h"

// Floats of the projections as the backward (and the saved state) lay
// them out: (Rq, Eq + 2 Ekv) packed, else q (Rq, Eq), k and v (Rk, Ekv).
size_t mha__qkv_floats(const fwd_plan *p, int64_t Rq, int64_t Rk) {
    return (size_t)(p->self_packed ? Rq * (p->Eq + 2 * p->Ekv) : Rq * p->Eq + 2 * Rk * p->Ekv);
}

size_t mha__xqk_floats(const fwd_plan *p, const mha_module *m, int64_t Rq, int64_t Rk) {
    return m->cfg.qk_norm != MHA_QK_NORM_NONE ? (size_t)(Rq * p->Eq + Rk * p->Ekv) : 0;
}

static void key_tensor(mha_tensor *dst, const mha_tensor *t) {
    memset(dst, 0, sizeof *dst);
    if (!t) return;
    dst->data = t->data;
    dst->dtype = t->dtype;
    dst->ndim = t->ndim;
    for (int i = 0; i < t->ndim && i < MHA_MAX_DIMS; i++) {
        dst->shape[i] = t->shape[i];
        dst->stride[i] = t->stride[i];
    }
}

// The attention options a saved state depends on (field by field: the
// key's padding stays 0 for the comparison).
static void key_opts(mha__saved_key *k, const mha_attn_opts *o) {
    k->causal = o->is_causal;
    k->window_left = o->window_left;
    k->window_right = o->window_right;
    k->seed = o->dropout_seed;
    k->offset = o->dropout_offset;
    k->alibi = o->alibi;
    k->alibi_slopes = o->alibi_slopes;
    k->softcap = o->softcap;
    k->sinks = o->sinks;
    k->dropout_p = o->dropout_p;
    k->scale = o->scale;
}

void mha__saved_key_of(mha__saved_key *k, const mha_module *m, const mha_forward_args *a) {
    memset(k, 0, sizeof *k);
    k->m = m;
    key_tensor(&k->q, a->query);
    key_tensor(&k->k, a->key);
    key_tensor(&k->v, a->value);
    key_tensor(&k->kpm, a->key_padding_mask);
    key_tensor(&k->am, a->attn_mask);
    key_opts(k, &a->opts);
    k->training = a->training;
    k->rope_mode = a->rope.mode;
    k->rope_theta = a->rope.theta;
    k->rope_dim = a->rope.dim;
    k->rope_start = a->rope_start;
    k->rope_positions = a->rope_positions;
    const mha_rope_scaling *rs = a->rope_scaling;
    if (rs && rs->type != MHA_ROPE_SCALING_NONE) {  // (field by field: padding stays 0)
        k->rope_scaling.type = rs->type;
        k->rope_scaling.factor = rs->factor;
        k->rope_scaling.original_max_position = rs->original_max_position;
        k->rope_scaling.low_freq_factor = rs->low_freq_factor;
        k->rope_scaling.high_freq_factor = rs->high_freq_factor;
        k->rope_scaling.beta_fast = rs->beta_fast;
        k->rope_scaling.beta_slow = rs->beta_slow;
        k->rope_scaling.mscale = rs->mscale;
        k->rope_scaling.mscale_all_dim = rs->mscale_all_dim;
        k->rope_scaling.attention_factor = rs->attention_factor;
        k->rope_scaling.truncate = rs->truncate;
    }
}

void mha__saved_key_of_sdpa(mha__saved_key *k, const mha_sdpa_args *a) {
    memset(k, 0, sizeof *k);
    key_tensor(&k->q, a->q);
    key_tensor(&k->k, a->k);
    key_tensor(&k->v, a->v);
    key_tensor(&k->kpm, a->key_padding_mask);
    key_tensor(&k->am, a->attn_mask);
    key_opts(k, &a->opts);
    k->training = a->opts.dropout_p > 0.0f;
}

// Grows s's buffer to need floats (its contents dropped); at least one, so
// that an empty call's state still has a buffer to offset from.
static mha_status saved_grow(mha_saved *s, size_t need) {
    if (need == 0) need = 1;
    if (need <= s->cap) return MHA_OK;
    size_t bytes;
    if (mha__mul_overflow_size(need, sizeof(float), &bytes))
        return mha__fail(MHA_ERR_OVERFLOW, "saved state: size overflows");
    float *nb = mha__alloc(bytes);
    if (!nb)
        return mha__fail(MHA_ERR_NOMEM, "saved state: out of memory for %zu bytes", bytes);
    mha__free(s->buf);
    s->buf = nb;
    s->cap = need;
    return MHA_OK;
}

mha_status mha__saved_prepare_sdpa(mha_saved *s, const mha_sdpa_args *a, int64_t B, int64_t H,
                                   int64_t L, int64_t Dv) {
    s->valid = s->outer_valid = s->bf16 = false;
    size_t rows, nctx, nlse, need;
    if (mha__mul_overflow_size((size_t)B * (size_t)H, (size_t)L, &rows) ||
        mha__mul_overflow_size(rows, (size_t)Dv, &nctx) ||
        mha__mul_overflow_size(rows, 2, &nlse) || mha__add_overflow_size(nctx, nlse, &need))
        return mha__fail(MHA_ERR_OVERFLOW, "saved state: size overflows");
    mha_status st = saved_grow(s, need);
    if (st) return st;
    s->n_qkv = 0, s->n_ctx = nctx, s->n_lse = nlse, s->n_xqk = 0;
    mha__saved_key_of_sdpa(&s->key, a);
    return MHA_OK;
}

bool mha__saved_key_equal(const mha__saved_key *x, const mha__saved_key *y) {
    return memcmp(x, y, sizeof *x) == 0;  // both memset before filling
}

mha_status mha__saved_prepare(mha_saved *s, const fwd_plan *p, const mha_module *m,
                              const mha_forward_args *a) {
    s->valid = false;
    s->outer_valid = false;
    s->bf16 = false;
    if (!p->fused) return MHA_OK;  // only the fused path keeps state
    const int64_t Eq = p->Eq, Rq = mha__rows_of(a->query), Rk = mha__rows_of(a->key);
    s->n_qkv = mha__qkv_floats(p, Rq, Rk);
    s->n_ctx = (size_t)(Rq * Eq);
    s->n_lse = (size_t)(2 * p->N * p->H * p->L);
    s->n_xqk = mha__xqk_floats(p, m, Rq, Rk);
    const size_t need = s->n_qkv + s->n_ctx + s->n_lse + s->n_xqk;
    mha_status st = saved_grow(s, need);
    if (st) return st;
    mha__saved_key_of(&s->key, m, a);
    return MHA_OK;
}

mha_status mha_saved_create(mha_saved **out) {
    if (!out) return mha__fail(MHA_ERR_INVALID_ARG, "mha_saved_create: NULL out");
    *out = mha__calloc(1, sizeof **out);
    if (!*out)
        return mha__fail(MHA_ERR_NOMEM, "mha_saved_create: out of memory (%zu bytes)",
                         sizeof **out);
    return MHA_OK;
}

void mha_saved_destroy(mha_saved *s) {
    if (!s) return;
    mha__free(s->buf);
    free(s);
}

size_t mha_saved_bytes(const mha_saved *s) { return s ? s->cap * sizeof(float) : 0; }
