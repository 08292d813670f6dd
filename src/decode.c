// decode.c: mha_forward_cached and mha_forward_paged, the module's causal
// self-attention over a chunk of new tokens through a KV cache (incremental
// decoding, chunked prefill; the paged cache: sequences of their own
// lengths in one call): the projections (linear.h), RoPE at the cache's
// positions, append, attention over the cache (kvcache.c, paged.c), gates
// and W_O. Every
// allocation happens before the cache changes; an error after the append
// rolls it back.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvcache.h"
#include "linear.h"

// The cache of a call: the contiguous one, or the paged one with entry n of
// the batch being sequence ids[n], its first counts[n] new tokens real
// (counts NULL: all T).
typedef struct cache_ref {
    mha_kv_cache *kv;
    mha_paged_cache *pg;
    const int64_t *ids, *counts;
    const int32_t *tokens;  // paged: the new tokens' ids (N, T), or NULL
} cache_ref;

static int64_t ref_length(const cache_ref *r, int64_t n) {
    return r->kv ? mha_kv_cache_length(r->kv, n) : mha_paged_cache_length(r->pg, r->ids[n]);
}

static mha_status ref_append(const cache_ref *r, int64_t N, const mha_tensor *k,
                             const mha_tensor *v) {
    return r->kv ? mha_kv_cache_append(r->kv, k, v, NULL)
                 : mha_paged_cache_append(r->pg, N, r->ids, r->counts, k, v, r->tokens);
}

static mha_status ref_attend(const cache_ref *r, int64_t N, mha_tensor *out,
                             const mha_tensor *q, const mha_cache_attend_args *a) {
    return r->kv ? mha_kv_cache_attend(out, q, r->kv, a, NULL)
                 : mha_paged_cache_attend(out, q, r->pg, N, r->ids, r->counts, a);
}

// The cache back to the lengths it had (cannot fail: they are shorter).
static void ref_rollback(const cache_ref *r, int64_t N, const int64_t *starts) {
    for (int64_t n = 0; n < N; n++) {
        const mha_status st = r->kv ? mha_kv_cache_truncate(r->kv, n, starts[n])
                                    : mha_paged_cache_truncate(r->pg, r->ids[n], starts[n]);
        if (st) break;
    }
}

// What the phases share: the plan, the kernels, the scratch and the views.
typedef struct cached_call {
    fwd_plan p;
    const mha__kernels *kt;
    const mha__packs *pk;  // the module's packed weights, or NULL (packs.c)
    int nt;
    bool seq_first, gated;
    int64_t R;  // rows of the query (N T)
    // the scratch: blk (xg, wt, wo, gs, qkv, ctx, yt, wh), the start
    // positions, gbuf (gated: gate (R, H), gctx (R, Eq), packed W_g); wt,
    // wo and W_g empty when the module's packed weights hold them
    float *blk, *gbuf;
    int64_t *starts;
    // StreamingLLM with RoPE: the queries rotated for the sinks (R, Eq) and
    // their positions (N T)
    float *qsink;
    int64_t *spos;
    size_t pw, pwkv;  // floats of a packed (E, Eq) / (E, Ekv) weight
    float *xg, *wt, *wo, *gs, *qkv, *ctx, *yt, *wh;
    const float *X;  // the query rows (R, E), row stride ldx
    int64_t ldx;
    mha_tensor qv, cv;  // q and ctx as (N, H, T, d) views of the rows
    mha_tensor sv;      // qsink as such a view
} cached_call;

// Check: what a KV cache does not take, float32 query and output, the
// plan (the key and value are the query, causal, fused), the output, the
// cache's dims against the module's.
static mha_status cached_check(cached_call *c, const mha_tensor *out, const mha_module *m,
                               const mha_forward_args *a, const cache_ref *cache) {
    if (!out || !m || !a || !(cache->kv || cache->pg) || !a->query || (cache->pg && !cache->ids))
        return mha__fail(MHA_ERR_INVALID_ARG, "mha_forward_cached: NULL argument");
    const mha_config *cfg = &m->cfg;
    if (a->key_padding_mask || a->attn_mask || a->need_weights || a->trace ||
        (a->training && (cfg->dropout > 0.0f || cfg->out_dropout > 0.0f)) ||
        cfg->add_bias_kv || cfg->add_zero_attn || (cfg->kdim && cfg->kdim != cfg->embed_dim) ||
        (cfg->vdim && cfg->vdim != cfg->embed_dim))
        return mha__fail(MHA_ERR_UNSUPPORTED,
                         "mha_forward_cached: masks, need_weights, trace, dropout, "
                         "add_bias_kv, add_zero_attn and kdim/vdim != embed_dim are not "
                         "available with a KV cache");
    if (a->query->dtype != MHA_F32 || out->dtype != MHA_F32)
        return mha__fail(MHA_ERR_DTYPE,
                         "mha_forward_cached: float32 query and output only, got %s and %s",
                         mha_dtype_name(a->query->dtype), mha_dtype_name(out->dtype));
    if (a->opts.sink_tokens < 0 || (a->opts.sink_tokens > 0 && a->opts.window_left < 0))
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "mha_forward_cached: opts.sink_tokens %lld needs >= 0 and, > 0, a window "
                         "(window_left %lld)",
                         (long long)a->opts.sink_tokens, (long long)a->opts.window_left);
    mha_forward_args a2 = *a;
    a2.key = a2.value = a->query;
    a2.opts.is_causal = true;
    a2.rope_start = NULL;
    a2.save = NULL;
    a2.opts.sink_tokens = 0;  // (the cache attention's, below)
    a2.impl = MHA_IMPL_FUSED;
    fwd_plan *p = &c->p;
    mha_status st = mha__plan_forward(p, m, &a2);
    if (st) return st;
    if ((st = mha__check_output(out, "attn_output", &p->out_shape)) ||
        (st = mha__check_no_overlap(out, "attn_output", a->query, "query")))
        return st;
    const int64_t N = p->N, d = p->d, Hkv = p->Hkv;
    c->R = mha__rows_of(a->query);
    int64_t cB = N, cH, cD, cDv;
    if (cache->kv) mha__kv_cache_dims(cache->kv, &cB, &cH, &cD, &cDv);
    else mha__paged_cache_dims(cache->pg, &cH, &cD, &cDv);
    for (int64_t n = 0; cache->counts && n < N; n++)
        if (cache->counts[n] < 0 || cache->counts[n] > p->L)
            return mha__fail(MHA_ERR_INVALID_ARG,
                             "mha_forward_paged: counts[%lld] = %lld, expected 0..%lld",
                             (long long)n, (long long)cache->counts[n], (long long)p->L);
    if (cB != N || cH != Hkv || cD != d || cDv != d)
        return mha__fail(MHA_ERR_SHAPE,
                         "mha_forward_cached: the cache holds batch %lld, %lld KV heads of "
                         "dims %lld/%lld; this module and query need batch %lld, %lld KV "
                         "heads (num_kv_heads) of dim %lld",
                         (long long)cB, (long long)cH, (long long)cD, (long long)cDv,
                         (long long)N, (long long)Hkv, (long long)d);
    return MHA_OK;
}

// Scratch (c->kt and c->pk set): the threads; one block, the start
// positions (N) and, gated, gate (R, H), gctx (R, Eq) and the packed W_g,
// all allocated before the cache changes; the block carved into c. The
// packed weights' room only when the module's packed copy is not held.
static mha_status cached_scratch(cached_call *c, const mha_module *m,
                                 const mha_forward_args *a) {
    const fwd_plan *p = &c->p;
    const int64_t N = p->N, E = p->E, Eq = p->Eq, H = p->H, R = c->R;
    const int64_t Ekv = p->Ekv, W3 = Eq + 2 * Ekv;
    const mha__kernels *kt = c->kt;
    const int nt = c->nt = p->nthreads;
    // (the copy holds every float32 matrix whole: found at row 0, see
    // mha__packs_find)
    const bool held = c->pk && m->wdt == MHA_F32, gheld = c->pk != NULL;
    c->seq_first = p->unbatched || !m->cfg.batch_first;
    // scratch: gathered x, packed weights (E (Eq + 2 Ekv) or separate) and
    // Wo (Eq, E), GEMM scratch, qkv (R, Eq + 2 Ekv), ctx (R, Eq), y (R, E),
    // the start positions
    const size_t pw = held ? 0 : mha__gemm_packed_b_floats(kt, E, Eq),
                 pwo = held ? 0 : mha__gemm_packed_b_floats(kt, Eq, E),
                 n_gs = mha__gemm_scratch_floats(kt, nt),
                 pwkv = held ? 0 : mha__gemm_packed_b_floats(kt, E, Ekv);
    const size_t n_w = held        ? 0
                       : m->packed ? mha__gemm_packed_b_floats(kt, E, W3)
                                   : pw + 2 * pwkv;
    const size_t n_wh = m->wdt == MHA_F32 ? 0 : mha__half_weight_floats(kt, m, nt);
    size_t total = (size_t)(R * E) * 2 + (size_t)(R * Eq) + (size_t)(R * W3) + n_w + pwo +
                   n_gs + n_wh,
           bytes;
    if (mha__mul_overflow_size(total, sizeof(float), &bytes))
        return mha__fail(MHA_ERR_OVERFLOW, "mha_forward_cached: scratch overflows");
    // (everything is allocated before the cache changes: a failure after
    // the append can only come from the attention, and is rolled back)
    const bool gated = c->gated = mha__module_gated(m);
    const size_t gfloats = gated ? (size_t)(R * H + R * Eq) +
                                       (gheld ? 0 : mha__gemm_packed_b_floats(kt, E, H))
                                 : 0;
    float *blk = mha__alloc(bytes);
    int64_t *starts = mha__malloc(sizeof(int64_t) * (size_t)N);
    float *gbuf = gated ? mha__alloc(sizeof(float) * gfloats) : NULL;
    // (StreamingLLM with RoPE: the sinks' queries and positions)
    const bool sq = a->opts.sink_tokens > 0 && a->rope.mode != MHA_ROPE_NONE;
    c->qsink = sq ? mha__alloc(sizeof(float) * (size_t)(R * Eq)) : NULL;
    c->spos = sq ? mha__malloc(sizeof(int64_t) * (size_t)R) : NULL;
    if (!blk || !starts || (gated && !gbuf) || (sq && (!c->qsink || !c->spos))) {
        mha__free(blk);
        free(starts);
        mha__free(gbuf);
        mha__free(c->qsink);
        free(c->spos);
        c->qsink = NULL, c->spos = NULL;
        return mha__fail(MHA_ERR_NOMEM,
                         "mha_forward_cached: out of memory for %zu bytes of scratch",
                         bytes + sizeof(float) * gfloats + sizeof(int64_t) * (size_t)N);
    }
    float *xg = blk, *wt = xg + R * E, *wo = wt + n_w, *gs = wo + pwo, *qkv = gs + n_gs,
          *ctx = qkv + R * W3, *yt = ctx + R * Eq, *wh = yt + R * E;
    c->blk = blk, c->gbuf = gbuf, c->starts = starts, c->pw = pw, c->pwkv = pwkv;
    c->xg = xg, c->wt = wt, c->wo = wo, c->gs = gs, c->qkv = qkv, c->ctx = ctx, c->yt = yt;
    c->wh = wh;
    return MHA_OK;
}

// Project: qkv (R, Eq + 2 Ekv) = X W_in^T + b_in (one packed GEMM or three),
// X the query's rows as they lie or gathered into xg.
static void cached_project(cached_call *c, const mha_module *m, const mha_forward_args *a) {
    const int64_t E = c->p.E, Eq = c->p.Eq, R = c->R, Ekv = c->p.Ekv, W3 = Eq + 2 * Ekv;
    const mha__kernels *kt = c->kt;
    const int nt = c->nt;
    const size_t pw = c->pw, pwkv = c->pwkv;
    float *xg = c->xg, *wt = c->wt, *gs = c->gs, *qkv = c->qkv, *wh = c->wh;
    int64_t ldx = E;
    const float *X = xg;
    if (mha__rows_direct(a->query, &ldx)) X = a->query->data;
    else mha__gather_rows(xg, a->query), ldx = E;
    const float *bq = m->in_proj_bias;
    if (m->packed) {
        mha__linear_rows(kt, qkv, W3, X, ldx, mha__wmat_of(m, m->w_in, wh, c->pk), bq, R, E,
                         W3, wt, gs, nt);
    } else {
        mha__linear_rows(kt, qkv, W3, X, ldx, mha__wmat_of(m, m->w_q, wh, c->pk), bq, R, E, Eq,
                         wt, gs, nt);
        mha__linear_rows(kt, qkv + Eq, W3, X, ldx, mha__wmat_of(m, m->w_k, wh, c->pk),
                         bq ? bq + Eq : NULL, R, E, Ekv, wt + pw, gs, nt);
        mha__linear_rows(kt, qkv + Eq + Ekv, W3, X, ldx, mha__wmat_of(m, m->w_v, wh, c->pk),
                         bq ? bq + Eq + Ekv : NULL, R, E, Ekv, wt + pw + pwkv, gs, nt);
    }
    if (m->cfg.qk_norm != MHA_QK_NORM_NONE) {  // q, k <- RMSNorm, before RoPE
        const mha__rowmap qm = {qkv, W3, true, 1, R}, km = {qkv + Eq, W3, true, 1, R};
        mha__fused_qk_norm(&c->p, m, &qm, &km, R, R, NULL);
    }
    c->X = X, c->ldx = ldx;
}

// StreamingLLM with RoPE: the queries that score the sinks, q before its
// rotation rotated at position - delta instead (delta = max(0, i - w - k),
// i the token's place in its cache), so that they score the sinks' keys,
// stored at their own positions, as at the positions just before the
// window (mha_cache_attend_args.sink_tokens); dynamic NTK scaling from the
// call's largest position + 1, as for q.
static mha_status sink_queries(cached_call *c, const mha_forward_args *a, const mha_tensor *qv) {
    const int64_t N = c->p.N, T = c->p.L, Eq = c->p.Eq, H = c->p.H, d = c->p.d;
    const int64_t k = a->opts.sink_tokens, w = a->opts.window_left;
    const int64_t ns = c->seq_first ? 1 : T, ts = c->seq_first ? N : 1;
    int64_t seq = 0;
    for (int64_t n = 0; n < N; n++)
        for (int64_t t = 0; t < T; t++) {
            const int64_t i = c->starts[n] + t,
                          pos = a->rope_positions ? a->rope_positions[n * T + t] : i;
            const int64_t delta = i - w - k > 0 ? i - w - k : 0;
            c->spos[n * T + t] = pos - delta;
            seq = pos + 1 > seq ? pos + 1 : seq;
        }
    c->sv = (mha_tensor){c->qsink, MHA_F32, 4, {N, H, T, d}, {ns * Eq, d, ts * Eq, 1}};
    for (int64_t n = 0; n < N; n++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t t = 0; t < T; t++)
                memcpy(c->qsink + n * c->sv.stride[0] + h * d + t * c->sv.stride[2],
                       (const float *)qv->data + n * qv->stride[0] + h * qv->stride[1] +
                           t * qv->stride[2],
                       sizeof(float) * (size_t)d);
    return mha_rope_apply(&c->sv, &a->rope, a->rope_scaling, NULL, c->spos, seq, false);
}

// RoPE and append: q, k, v, ctx as (N, H, T, d) and (N, Hkv, T, d) views
// of the rows; RoPE on q and k at the cache's positions (starts, its
// lengths before); k and v appended to the cache.
static mha_status cached_rope_append(cached_call *c, const mha_forward_args *a,
                                     const cache_ref *cache) {
    const int64_t N = c->p.N, T = c->p.L, Eq = c->p.Eq, H = c->p.H, d = c->p.d;
    const int64_t Hkv = c->p.Hkv, Ekv = c->p.Ekv, W3 = Eq + 2 * Ekv;
    const bool seq_first = c->seq_first;
    float *qkv = c->qkv, *ctx = c->ctx;
    int64_t *starts = c->starts;
    mha_status st;
    // (N, H, T, d) and (N, Hkv, T, d) views of the rows: row r = t N + n
    // (seq first) or n T + t
    const int64_t ns = seq_first ? 1 : T, ts = seq_first ? N : 1;
    mha_tensor qv = {qkv, MHA_F32, 4, {N, H, T, d}, {ns * W3, d, ts * W3, 1}};
    mha_tensor kv = {qkv + Eq, MHA_F32, 4, {N, Hkv, T, d}, {ns * W3, d, ts * W3, 1}};
    mha_tensor vv = kv, cv = {ctx, MHA_F32, 4, {N, H, T, d}, {ns * Eq, d, ts * Eq, 1}};
    vv.data = qkv + Eq + Ekv;
    c->qv = qv, c->cv = cv;  // (what the attention reads and writes)
    for (int64_t n = 0; n < N; n++) starts[n] = ref_length(cache, n);
    if (c->qsink && (st = sink_queries(c, a, &qv))) return st;
    // (rope_positions: the new tokens' positions; dynamic NTK scaling from
    // their largest + 1, the same for q and k)
    if ((st = mha_rope_apply(&qv, &a->rope, a->rope_scaling, starts, a->rope_positions, 0,
                             false)) ||
        (st = mha_rope_apply(&kv, &a->rope, a->rope_scaling, starts, a->rope_positions, 0,
                             false)) ||
        (st = ref_append(cache, N, &kv, &vv)))
        return st;
    return MHA_OK;
}

// Attend: ctx (N, H, T, d) over the cache (window, soft cap, ALiBi, the
// custom scale, the module's sinks); on an error the cache rolled back to its lengths before
// the append.
static mha_status cached_attend(cached_call *c, const mha_module *m, const mha_forward_args *a,
                                const cache_ref *cache) {
    const int64_t N = c->p.N, H = c->p.H;
    const int64_t *starts = c->starts;
    mha_status st;
    float slopes_buf[MHA__ALIBI_MAX_DEFAULT];
    mha_cache_attend_args ca;
    mha_cache_attend_args_init(&ca);
    ca.opts.window_left = a->opts.window_left;
    ca.opts.window_right = a->opts.window_right;
    ca.opts.softcap = a->opts.softcap;
    ca.opts.scale = a->opts.scale;
    ca.opts.sinks = m->sinks;  // (NULL without attention sinks)
    ca.opts.sink_tokens = a->opts.sink_tokens;
    ca.sink_q = c->qsink ? &c->sv : NULL;
    if (a->opts.sink_tokens > 0) ca.opts.window_right = -1;  // (causal: it hides nothing more)
    // (the plan checked the slopes and H <= MHA__ALIBI_MAX_DEFAULT)
    if ((st = mha__attn_logit_params(&ca.opts.alibi_slopes, slopes_buf, &a->opts, H,
                                     "mha_forward_cached")))
        return st;
    if ((st = ref_attend(cache, N, &c->cv, &c->qv, &ca))) {
        ref_rollback(cache, N, starts);  // the cache as it was: its lengths before the append
        return st;
    }
    return MHA_OK;
}

// Gates and out-project: pruned heads' context zeroed; gated: gctx =
// ctx_h * gate; y (R, E) = gctx (R, Eq) W_o^T + b_o, into out's rows
// directly or through yt.
static void cached_out_project(cached_call *c, mha_tensor *out, const mha_module *m) {
    const int64_t E = c->p.E, Eq = c->p.Eq, H = c->p.H, d = c->p.d, R = c->R;
    const mha__kernels *kt = c->kt;
    const int nt = c->nt;
    const bool gated = c->gated;
    float *gbuf = c->gbuf, *wo = c->wo, *gs = c->gs, *ctx = c->ctx, *yt = c->yt, *wh = c->wh;
    const float *X = c->X;
    const int64_t ldx = c->ldx;
    for (int64_t h = 0; h < H; h++)  // pruned heads: zero context (computed all the same)
        if (!mha__head_live(m, h)) mha__zero_head_rows(ctx + h * d, Eq, 0, R, d);
    const float *octx = ctx;
    if (gated) {
        mha__gate_rows(kt, gbuf, gbuf + R * H, ctx, m, c->pk, X, ldx, R, gbuf + R * H + R * Eq,
                       gs, nt);
        octx = gbuf + R * H;
    }
    int64_t ldo = E;
    const bool direct = mha__rows_direct(out, &ldo);
    float *y = direct ? (float *)out->data : yt;
    if (!direct) ldo = E;
    mha__linear_rows(kt, y, ldo, octx, Eq, mha__wmat_of(m, m->w_out, wh, c->pk), m->out_bias,
                     R, Eq, E, wo, gs, nt);
    if (!direct)
        for (int64_t r = 0; r < R; r++) {
            mha__mat row = mha__view_row(out, r);
            mha__st_row(row, y + r * ldo, E);
        }
}

// The output rows of entry n's tokens t >= counts[n] (padding): 0.
static void zero_past_counts(const cached_call *c, mha_tensor *out, const int64_t *counts) {
    const int64_t N = c->p.N, T = c->p.L, E = c->p.E;
    for (int64_t n = 0; n < N; n++)
        for (int64_t t = counts[n]; t < T; t++) {
            mha__mat row = mha__view_row(out, c->seq_first ? t * N + n : n * T + t);
            for (int64_t e = 0; e < E; e++) mha__st(row, 0, e, 0.0);
        }
}

// The phases: check -> the packed weights -> scratch -> project -> RoPE and
// append -> attend -> gates and out-project; the packed weights given back
// and the scratch freed whatever happened.
static mha_status forward_cache(mha_tensor *out, const mha_module *m,
                                const mha_forward_args *a, const cache_ref *cache) {
    cached_call c = {0};  // (initialised for the compiler: read only after MHA_OK)
    mha_status st;
    if ((st = cached_check(&c, out, m, a, cache))) return st;
    c.kt = mha__kernels_get();
    c.pk = mha__packs_acquire(m, c.kt, c.p.nthreads);
    if (!(st = cached_scratch(&c, m, a))) {
        cached_project(&c, m, a);
        if (!(st = cached_rope_append(&c, a, cache)) && !(st = cached_attend(&c, m, a, cache))) {
            cached_out_project(&c, out, m);
            if (cache->counts) zero_past_counts(&c, out, cache->counts);
        }
    }
    mha__packs_release(c.pk);
    mha__free(c.gbuf);
    mha__free(c.blk);
    free(c.starts);
    mha__free(c.qsink);
    free(c.spos);
    return st;
}

mha_status mha_forward_cached(mha_tensor *out, const mha_module *m, const mha_forward_args *a,
                              mha_kv_cache *cache) {
    const cache_ref r = {cache, NULL, NULL, NULL, NULL};
    if (!cache) return mha__fail(MHA_ERR_INVALID_ARG, "mha_forward_cached: NULL argument");
    const mha_status st = forward_cache(out, m, a, &r);
    if (!st) mha__set_impl(true, mha_isa(), false);
    return st;
}

mha_status mha_forward_paged(mha_tensor *out, const mha_module *m, const mha_forward_args *a,
                             mha_paged_cache *cache, const int64_t *ids, const int64_t *counts,
                             const int32_t *tokens) {
    const cache_ref r = {NULL, cache, ids, counts, tokens};
    if (!cache || !ids)
        return mha__fail(MHA_ERR_INVALID_ARG, "mha_forward_paged: NULL argument");
    const mha_status st = forward_cache(out, m, a, &r);
    if (!st) mha__set_impl(true, mha_isa(), false);
    return st;
}
