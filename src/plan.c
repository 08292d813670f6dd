// plan.c: the planner. From a module and a forward's arguments it checks
// every argument once, and decides what the call will do and how much
// memory it needs: dims and (seq, batch, feature) strides, the mask as
// (b, h, i, j) strides, dropout, output shapes, the weights block, the
// thread count, the implementation (auto: fused for float32/half inputs
// without a trace; MHA_IMPL overrides), and the scratch layout of the
// reference or of the fused path (from the GEMM and flash primitives'
// sizes). It computes nothing and calls no driver.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "flash.h"
#include "gemm.h"
#include "plan.h"

const char *mha_impl_name(mha_impl impl) {
    switch (impl) {
    case MHA_IMPL_AUTO: return "auto";
    case MHA_IMPL_REFERENCE: return "reference";
    case MHA_IMPL_FUSED: return "fused";
    }
    return "unknown";
}

mha_status mha_impl_from_name(mha_impl *out, const char *name) {
    if (!out || !name)
        return mha__fail(MHA_ERR_INVALID_ARG, "mha_impl_from_name: NULL argument");
    if (strcmp(name, "auto") == 0) *out = MHA_IMPL_AUTO;
    else if (strcmp(name, "reference") == 0 || strcmp(name, "ref") == 0)
        *out = MHA_IMPL_REFERENCE;
    else if (strcmp(name, "fused") == 0) *out = MHA_IMPL_FUSED;
    else
        return mha__fail(MHA_ERR_UNSUPPORTED,
                         "unknown implementation \"%.64s\" (available: auto, "
                         "reference, fused)",
                         name);
    return MHA_OK;
}

// The weights block [wh0, wh1) x [wr0, wr1) from the arguments.
static mha_status weights_block(fwd_plan *p, const mha_forward_args *a) {
    const int64_t hb = a->weights_head_begin, rb = a->weights_row_begin;
    const int64_t he = a->weights_head_end < 0 ? p->H : a->weights_head_end;
    const int64_t re = a->weights_row_end < 0 ? p->L : a->weights_row_end;
    if (a->weights_head_end < -1 || hb < 0 || hb > he || he > p->H)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "weights heads [%lld, %lld): need 0 <= begin <= end <= "
                         "num_heads %lld (end -1: all)",
                         (long long)hb, (long long)a->weights_head_end, (long long)p->H);
    if (a->weights_row_end < -1 || rb < 0 || rb > re || re > p->L)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "weights rows [%lld, %lld): need 0 <= begin <= end <= "
                         "L %lld (end -1: all)",
                         (long long)rb, (long long)a->weights_row_end, (long long)p->L);
    if (a->need_weights && a->average_attn_weights && hb == he && rb < re)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "weights heads [%lld, %lld): averaging needs at least one head",
                         (long long)hb, (long long)he);
    p->wh0 = hb, p->wh1 = he, p->wr0 = rb, p->wr1 = re;
    p->w_block = hb != 0 || he != p->H || rb != 0 || re != p->L;
    return MHA_OK;
}

// The inputs: the impl, the dtypes, query/key/value shapes against the
// module; dims, (seq, batch, feature) strides, Sp = S + appended keys.
//   query (L, N, E) or (N, L, E) (batch_first) or (L, E) unbatched;
//   key (S, N, kdim), value (S, N, vdim) alike
static mha_status plan_inputs(fwd_plan *p, const mha_module *m, const mha_forward_args *a) {
    char s1[160], s2[160], s3[160];
    mha_status st;
    if ((st = mha__check_impl(a->impl))) return st;
    const mha_config *c = &m->cfg;
    if ((st = mha__check_float(a->query, "query")) || (st = mha__check_float(a->key, "key")) ||
        (st = mha__check_float(a->value, "value")))
        return st;
    const mha_tensor *q = a->query, *k = a->key, *v = a->value;
    if (q->ndim != 2 && q->ndim != 3)
        return mha__fail(MHA_ERR_SHAPE,
                         "query: expected 3 dims (%s) or 2 dims (L, E) "
                         "unbatched, got shape %s",
                         c->batch_first ? "N, L, E" : "L, N, E",
                         mha__shape_str(s1, sizeof s1, q->ndim, q->shape));
    if (k->ndim != q->ndim || v->ndim != q->ndim)
        return mha__fail(MHA_ERR_SHAPE,
                         "query, key and value must have the same number of "
                         "dims, got query %s, key %s, value %s",
                         mha__shape_str(s1, sizeof s1, q->ndim, q->shape),
                         mha__shape_str(s2, sizeof s2, k->ndim, k->shape),
                         mha__shape_str(s3, sizeof s3, v->ndim, v->shape));
    p->unbatched = q->ndim == 2;
    int sd = (p->unbatched || !c->batch_first) ? 0 : 1;  // seq dim
    int bd = 1 - sd;                                     // batch dim
    p->E = c->embed_dim;
    p->H = c->num_heads;
    p->d = m->head_dim;
    p->Hkv = c->num_kv_heads;
    p->g0 = 0;
    p->g1 = p->Hkv;
    p->Ekv = m->kv_dim;
    p->Eq = m->q_dim;
    p->kdim = c->kdim;
    p->vdim = c->vdim;
    p->L = q->shape[sd];
    p->S = k->shape[sd];
    p->N = p->unbatched ? 1 : q->shape[bd];
    if ((st = mha__check_features(q, "query", "embed_dim", p->E)) ||
        (st = mha__check_features(k, "key", "kdim", p->kdim)) ||
        (st = mha__check_features(v, "value", "vdim", p->vdim)))
        return st;
    if (!p->unbatched && (k->shape[bd] != p->N || v->shape[bd] != p->N))
        return mha__fail(MHA_ERR_SHAPE,
                         "batch size mismatch: query %lld, key %lld, value "
                         "%lld (shapes %s, %s, %s)",
                         (long long)p->N, (long long)k->shape[bd], (long long)v->shape[bd],
                         mha__shape_str(s1, sizeof s1, q->ndim, q->shape),
                         mha__shape_str(s2, sizeof s2, k->ndim, k->shape),
                         mha__shape_str(s3, sizeof s3, v->ndim, v->shape));
    if (v->shape[sd] != p->S)
        return mha__fail(MHA_ERR_SHAPE, "key and value lengths differ: key %lld, value %lld",
                         (long long)p->S, (long long)v->shape[sd]);
    mha__seq_batch_feat(p->qs, q, c->batch_first);
    mha__seq_batch_feat(p->ks, k, c->batch_first);
    mha__seq_batch_feat(p->vs, v, c->batch_first);
    p->Sp = p->S + (c->add_bias_kv ? 1 : 0) + (c->add_zero_attn ? 1 : 0);
    return MHA_OK;
}

// key_padding_mask (N, S), or (S) unbatched, as (b, j) strides.
static mha_status plan_kpm(fwd_plan *p, const mha_tensor *t) {
    char s1[160], s2[160];
    mha_status st;
    if ((st = mha__check_mask_dtype(t, "key_padding_mask"))) return st;
    bool ok = p->unbatched ? (t->ndim == 1 && t->shape[0] == p->S)
                           : (t->ndim == 2 && t->shape[0] == p->N && t->shape[1] == p->S);
    if (!ok)
        return mha__fail(MHA_ERR_SHAPE, "key_padding_mask: shape %s, expected %s",
                         mha__shape_str(s1, sizeof s1, t->ndim, t->shape),
                         p->unbatched
                             ? mha__shape_str(s2, sizeof s2, 1, &p->S)
                             : mha__shape_str(s2, sizeof s2, 2, (int64_t[]){p->N, p->S}));
    p->mask.kpm = t->data;
    p->mask.kpm_dtype = t->dtype;
    p->mask.kpm_s[0] = p->unbatched ? 0 : t->stride[0];
    p->mask.kpm_s[1] = t->stride[t->ndim - 1];
    return MHA_OK;
}

// attn_mask (L, S), or (N H, L, S) ((H, L, S) unbatched), as (b, h, i, j)
// strides.
static mha_status plan_attn_mask(fwd_plan *p, const mha_tensor *t) {
    char s1[160], s2[160], s3[160];
    mha_status st;
    if ((st = mha__check_mask_dtype(t, "attn_mask"))) return st;
    int64_t nh = p->unbatched ? p->H : p->N * p->H;
    bool ok2 = t->ndim == 2 && t->shape[0] == p->L && t->shape[1] == p->S;
    bool ok3 = t->ndim == 3 && t->shape[0] == nh && t->shape[1] == p->L && t->shape[2] == p->S;
    if (!ok2 && !ok3)
        return mha__fail(MHA_ERR_SHAPE,
                         "attn_mask: shape %s, expected (L, S) = %s or "
                         "(%s, L, S) = %s",
                         mha__shape_str(s1, sizeof s1, t->ndim, t->shape),
                         mha__shape_str(s2, sizeof s2, 2, (int64_t[]){p->L, p->S}),
                         p->unbatched ? "num_heads" : "N*num_heads",
                         mha__shape_str(s3, sizeof s3, 3, (int64_t[]){nh, p->L, p->S}));
    p->mask.attn = t->data;
    p->mask.attn_dtype = t->dtype;
    if (ok2) {
        p->mask.attn_s[0] = 0;
        p->mask.attn_s[1] = 0;
        p->mask.attn_s[2] = t->stride[0];
        p->mask.attn_s[3] = t->stride[1];
    } else {
        p->mask.attn_s[0] = p->unbatched ? 0 : p->H * t->stride[0];
        p->mask.attn_s[1] = t->stride[0];
        p->mask.attn_s[2] = t->stride[1];
        p->mask.attn_s[3] = t->stride[2];
    }
    return MHA_OK;
}

// Masks, as (b, h, i, j) strides: causal, the window, the soft cap, the
// query scale, RoPE and ALiBi, key_padding_mask, attn_mask.
static mha_status plan_masks(fwd_plan *p, const mha_module *m, const mha_forward_args *a) {
    mha_status st;
    p->mask.s_masked = p->S;
    p->mask.sinks = m->sinks;  // (NULL without attention sinks)
    p->mask.causal = a->opts.is_causal;
    if ((st = mha__check_attn_opts("mha_forward", &a->opts,
                                   MHA__REFUSE_SINKS | MHA__REFUSE_DROPOUT)))
        return st;
    p->scale = a->opts.scale != 0.0 ? a->opts.scale : 1.0 / sqrt((double)p->d);
    p->mask.win_left = a->opts.window_left;
    p->mask.win_right = a->opts.window_right;
    if ((st = mha__check_rope_alibi(&p->mask, p->alibi_default, &p->rope_seq, a, p->N, p->L,
                                    p->S, p->H, p->d)))
        return st;
    if (a->key_padding_mask && (st = plan_kpm(p, a->key_padding_mask))) return st;
    if (a->attn_mask && (st = plan_attn_mask(p, a->attn_mask))) return st;
    return MHA_OK;
}

// Dropout (training only), the output shape (the query's) and the weights'
// ((N,) [Hs,] Ls, Sp: the weights block, heads averaged or not).
static mha_status plan_shapes(fwd_plan *p, const mha_module *m, const mha_forward_args *a) {
    const mha_config *c = &m->cfg;
    const mha_tensor *q = a->query;
    mha_status st;
    // Dropout (training only).
    if (a->training && c->dropout > 0.0f)
        p->drop = (mha__dropout){
            c->dropout, a->opts.dropout_seed, a->opts.dropout_offset, p->H, p->L, p->Sp};
    p->out_p = a->training ? c->out_dropout : 0.0f;

    // Output shapes.
    p->out_shape.ndim = q->ndim;
    for (int i = 0; i < q->ndim; i++) p->out_shape.dims[i] = q->shape[i];
    mha_shape *w = &p->w_shape;
    if (!p->unbatched) w->dims[w->ndim++] = p->N;
    if ((st = weights_block(p, a))) return st;
    if (!a->average_attn_weights) w->dims[w->ndim++] = p->wh1 - p->wh0;
    w->dims[w->ndim++] = p->wr1 - p->wr0;
    w->dims[w->ndim++] = p->Sp;
    return MHA_OK;
}

// The threads, and the reference's scratch layout (p->r, p->ws_bytes):
//   q, ctx (N, L, Eq) and k, v (N, Sp, Ekv) doubles; headw (N, H, L, Sp)
//   when the heads' weights are gathered; scores nthreads x (L, Sp); the
//   trace's floats; gate (N, L, H) of a gated module
static mha_status plan_scratch(fwd_plan *p, const mha_module *m, const mha_forward_args *a) {
    // Scratch layout.
    // Threads: one for a trace, and for small problems, where waking a
    // thread team costs more than the work (results are the same either
    // way). work ~ multiply-adds of the projections and the attention.
    double work = (double)p->N *
                  ((double)p->L * p->E * p->Eq + (double)p->S * p->Ekv * (p->kdim + p->vdim) +
                   2.0 * p->L * p->Sp * p->Eq);
    p->nthreads = (a->trace || work < MHA__PAR_MIN_WORK) ? 1 : mha__max_threads();
    int64_t nle, nlo, nse, lsp, nhlsp, tr;  // nle: (N, L, Eq); nlo: (N, L, E)
    if (mha__mul_overflow_i64(p->N * 1, p->L, &nle) || mha__mul_overflow_i64(nle, p->E, &nlo) ||
        mha__mul_overflow_i64(nle, p->Eq, &nle) || mha__mul_overflow_i64(p->N, p->Sp, &nse) ||
        mha__mul_overflow_i64(nse, p->Ekv, &nse) || mha__mul_overflow_i64(p->L, p->Sp, &lsp) ||
        mha__mul_overflow_i64(lsp, p->N * p->H, &nhlsp))
        return mha__fail(MHA_ERR_OVERFLOW, "sizes overflow: N %lld, L %lld, S %lld, E %lld",
                         (long long)p->N, (long long)p->L, (long long)p->S, (long long)p->E);
    // the trace's float copies: (N, Sp, Ekv), (N, L, Eq) projections, the
    // (N, L, E) output, or one head's (L, Sp)
    tr = 0;
    if (a->trace) {
        tr = p->L * (p->Sp > p->d ? p->Sp : p->d);
        if (nse > tr) tr = nse;
        if (nle > tr) tr = nle;
        if (nlo > tr) tr = nlo;
    }
    size_t total = 0;
    if (mha__carve(&total, &p->r.q, nle, sizeof(double)) ||
        mha__carve(&total, &p->r.k, nse, sizeof(double)) ||
        mha__carve(&total, &p->r.v, nse, sizeof(double)) ||
        mha__carve(&total, &p->r.ctx, nle, sizeof(double)) ||
        mha__carve(&total, &p->r.headw,
                   (a->need_weights &&
                    (a->average_attn_weights || p->w_block || a->weights_scale))
                       ? nhlsp
                       : 0,
                   sizeof(double)) ||
        mha__carve(&total, &p->r.scores, lsp * p->nthreads, sizeof(double)) ||
        mha__carve(&total, &p->r.trace, tr, sizeof(float)) ||
        mha__carve(&total, &p->r.gate, mha__module_gated(m) ? p->N * p->L * p->H : 0,
                   sizeof(double)))
        return mha__fail(MHA_ERR_OVERFLOW,
                         "scratch size overflows: N %lld, L %lld, S %lld, E %lld",
                         (long long)p->N, (long long)p->L, (long long)p->S, (long long)p->E);
    p->ws_bytes = total + 64;  // + 64: the caller's block may be unaligned
    return MHA_OK;
}

// The implementation: the fused path's plan (mha__fused_plan) or the
// reference's (done).
static mha_status plan_impl(fwd_plan *p, const mha_module *m, const mha_forward_args *a) {
    // auto: the fused path where it applies (float32 inputs, no trace),
    // else the reference; MHA_IMPL=reference|fused in the environment
    // overrides auto.
    // (bfloat16 / float16 views are read into float32 rows by the fused path)
    bool f32 = a->query->dtype != MHA_F64 && a->key->dtype != MHA_F64 &&
               a->value->dtype != MHA_F64;
    mha_impl impl = a->impl;
    if (impl == MHA_IMPL_AUTO) {
        const char *env = getenv("MHA_IMPL");
        mha_impl forced;
        impl = f32 && !a->trace ? MHA_IMPL_FUSED : MHA_IMPL_REFERENCE;
        // (an unknown name is ignored; the log callback hears about it)
        if (env && strcmp(env, "auto") != 0 && mha_impl_from_name(&forced, env) == MHA_OK)
            impl = forced;
    }
    if (impl == MHA_IMPL_FUSED) return mha__fused_plan(p, m, a);
    return MHA_OK;
}

// The phases, in order: the inputs, the masks, dropout and the shapes, the
// threads and the reference's scratch, the implementation.
mha_status mha__plan_forward(fwd_plan *p, const mha_module *m, const mha_forward_args *a) {
    if (!m || !a) return mha__fail(MHA_ERR_INVALID_ARG, "mha_forward: NULL module or args");
    if (a->opts.sink_tokens)
        return mha__fail(MHA_ERR_UNSUPPORTED,
                         "mha_forward: opts.sink_tokens %lld: StreamingLLM's sinks go with a KV "
                         "cache (mha_forward_cached, mha_forward_paged)",
                         (long long)a->opts.sink_tokens);
    memset(p, 0, sizeof *p);
    mha_status st;
    if ((st = plan_inputs(p, m, a)) || (st = plan_masks(p, m, a)) ||
        (st = plan_shapes(p, m, a)) || (st = plan_scratch(p, m, a)))
        return st;
    return plan_impl(p, m, a);
}

// mha__carve in floats (the fused scratch is float32).
static int carve_f(size_t *total, size_t *off, int64_t n) {
    return mha__carve(total, off, n, sizeof(float));
}

// The widening scratch of a module with half weights.
size_t mha__half_weight_floats(const mha__kernels *kt, const mha_module *m, int nt) {
    return mha__gemm_pack_half_tmp_floats(kt, mha__module_max_in(m), nt);
}

mha_status mha__fused_part_qk_norm(const mha_module *m, const void *pt) {
    if (!pt || m->cfg.qk_norm == MHA_QK_NORM_NONE) return MHA_OK;
    return mha__fail(MHA_ERR_UNSUPPORTED,
                     "a part of a call (heads or sequence split across ranks) has no qk_norm "
                     "(mha_config.qk_norm %s): run the whole call on one rank",
                     m->cfg.qk_norm == MHA_QK_NORM_HEAD ? "head" : "all");
}

mha_status mha__fused_plan(fwd_plan *p, const mha_module *m, const mha_forward_args *a) {
    if (a->trace)
        return mha__fail(MHA_ERR_UNSUPPORTED,
                         "the fused implementation has no trace (use reference)");
    const mha_tensor *in[3] = {a->query, a->key, a->value};
    const char *names[3] = {"query", "key", "value"};
    for (int i = 0; i < 3; i++)
        if (in[i]->dtype != MHA_F32 && in[i]->dtype != MHA_BF16 && in[i]->dtype != MHA_F16)
            return mha__fail(MHA_ERR_DTYPE,
                             "the fused implementation takes F32, BF16 or F16 tensors "
                             "(computing in float32), %s is %s",
                             names[i], mha_dtype_name(in[i]->dtype));
    const int64_t E = p->E, H = p->H, d = p->d, N = p->N, L = p->L, Sp = p->Sp;
    const int64_t Ekv = p->Ekv, Hkv = p->Hkv, Eq = p->Eq;
    const int64_t Rq = mha__rows_of(a->query), Rk = mha__rows_of(a->key);
    int64_t ld;
    p->fused = true;
    p->self_packed = m->packed && mha__same_view(a->query, a->key) &&
                     mha__same_view(a->query, a->value);
    p->q_direct = mha__rows_direct(a->query, &ld);
    p->k_direct = mha__rows_direct(a->key, &ld);
    p->v_direct = mha__rows_direct(a->value, &ld);
    int64_t nx = Sp - p->S;
    const mha__kernels *gk = mha__kernels_get();
    size_t t = 0;
    int64_t scratch = (int64_t)mha__flash_scratch_floats(d, d, p->S, nx, false) * p->nthreads;
    int64_t lse = a->need_weights ? 2 * N * H * L : 0;  // (m, 1/l) per row
    int64_t headw = (a->need_weights && a->average_attn_weights)
                        ? N * (p->wh1 - p->wh0) * (p->wr1 - p->wr0) * Sp
                        : 0;
    if (carve_f(&t, &p->f.xq, p->q_direct ? 0 : Rq * E) ||
        carve_f(&t, &p->f.xk, p->k_direct || p->self_packed ? 0 : Rk * p->kdim) ||
        carve_f(&t, &p->f.xv, p->v_direct || p->self_packed ? 0 : Rk * p->vdim) ||
        carve_f(&t, &p->f.wt,
                p->self_packed ? (int64_t)mha__gemm_packed_b_floats(gk, E, Eq + 2 * Ekv)
                               : (int64_t)(mha__gemm_packed_b_floats(gk, E, Eq) +
                                           mha__gemm_packed_b_floats(gk, p->kdim, Ekv) +
                                           mha__gemm_packed_b_floats(gk, p->vdim, Ekv))) ||
        carve_f(&t, &p->f.wo, (int64_t)mha__gemm_packed_b_floats(gk, Eq, E)) ||
        carve_f(&t, &p->f.gs, (int64_t)mha__gemm_scratch_floats(gk, p->nthreads)) ||
        carve_f(&t, &p->f.qkv, p->self_packed ? Rq * (Eq + 2 * Ekv) : Rq * Eq) ||
        carve_f(&t, &p->f.k, p->self_packed ? 0 : Rk * Ekv) ||
        carve_f(&t, &p->f.v, p->self_packed ? 0 : Rk * Ekv) ||
        carve_f(&t, &p->f.ctx, Rq * Eq) || carve_f(&t, &p->f.extra, 2 * Hkv * nx * d) ||
        carve_f(&t, &p->f.lse, lse) || carve_f(&t, &p->f.headw, headw) ||
        carve_f(&t, &p->f.wtmp,
                a->need_weights && a->weights_scale ? (int64_t)p->nthreads * MHA__FLASH_BR * Sp
                                                    : 0) ||
        carve_f(&t, &p->f.out, Rq * E) || carve_f(&t, &p->f.scratch, scratch) ||
        carve_f(&t, &p->f.wh,
                m->wdt == MHA_F32 ? 0 : (int64_t)mha__half_weight_floats(gk, m, p->nthreads)) ||
        carve_f(&t, &p->f.gate, mha__module_gated(m) ? Rq * H : 0) ||
        carve_f(&t, &p->f.gctx, mha__module_gated(m) && a->save ? Rq * Eq : 0) ||
        carve_f(&t, &p->f.wg,
                m->cfg.head_gate == MHA_GATE_DYNAMIC
                    ? (int64_t)mha__gemm_packed_b_floats(gk, E, H)
                    : 0))
        return mha__fail(MHA_ERR_OVERFLOW, "fused: scratch size overflows");
    p->ws_bytes = t + 64;
    return MHA_OK;
}

// ---------------------------------------------------------------------------
// The outputs of a planned call

mha_status mha__check_forward_outputs(const fwd_plan *p, mha_tensor *out, mha_tensor *weights,
                                      const mha_forward_args *a) {
    mha_status st;
    if ((st = mha__check_output(out, "attn_output", &p->out_shape))) return st;
    if (a->need_weights) {
        if (!weights)
            return mha__fail(MHA_ERR_INVALID_ARG,
                             "need_weights is set but attn_output_weights is NULL");
        if (weights->dtype == MHA_U8) {  // int8 weights: shape, and the scales
            mha_tensor wf = *weights;
            wf.dtype = MHA_F32;  // (the same checks on dims and strides)
            if ((st = mha__check_output(&wf, "attn_output_weights", &p->w_shape))) return st;
            if (!a->weights_scale)
                return mha__fail(MHA_ERR_INVALID_ARG,
                                 "attn_output_weights is U8 (int8 weights) but "
                                 "weights_scale is NULL");
        } else if ((st = mha__check_output(weights, "attn_output_weights", &p->w_shape))) {
            return st;
        } else if (a->weights_scale) {
            return mha__fail(MHA_ERR_INVALID_ARG,
                             "weights_scale is set but attn_output_weights is %s, not U8",
                             mha_dtype_name(weights->dtype));
        }
    }
    const mha_tensor *ins[5] = {a->query, a->key, a->value, a->key_padding_mask, a->attn_mask};
    const char *names[5] = {"query", "key", "value", "key_padding_mask", "attn_mask"};
    for (int i = 0; i < 5; i++) {
        if ((st = mha__check_no_overlap(out, "attn_output", ins[i], names[i]))) return st;
        if (a->need_weights &&
            (st = mha__check_no_overlap(weights, "attn_output_weights", ins[i], names[i])))
            return st;
    }
    if (a->need_weights &&
        (st = mha__check_no_overlap(weights, "attn_output_weights", out, "attn_output")))
        return st;
    return MHA_OK;
}

static mha_status check_grad_view(const mha_tensor *g, const char *name,
                                  const mha_tensor *like) {
    if (!g) return MHA_OK;
    mha_shape want = {like->ndim, {0}};
    for (int i = 0; i < like->ndim; i++) want.dims[i] = like->shape[i];
    return mha__check_output(g, name, &want);
}

static mha_status check_grads_module(const mha_module *g, const mha_module *m) {
    if (!g) return MHA_OK;
    if (g == m)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "backward: the gradient module is the module itself");
    const mha_config *a = &g->cfg, *b = &m->cfg;
    if (a->embed_dim != b->embed_dim || a->num_heads != b->num_heads ||
        a->num_kv_heads != b->num_kv_heads || a->kdim != b->kdim || a->vdim != b->vdim ||
        a->bias != b->bias || a->add_bias_kv != b->add_bias_kv || a->head_gate != b->head_gate)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "backward: the gradient module's configuration "
                         "(embed_dim %lld, num_heads %lld, num_kv_heads %lld, kdim %lld, "
                         "vdim %lld, bias %d, add_bias_kv %d, head_gate %s) differs from the "
                         "module's (%lld, %lld, %lld, %lld, %lld, %d, %d, %s)",
                         (long long)a->embed_dim, (long long)a->num_heads,
                         (long long)a->num_kv_heads, (long long)a->kdim, (long long)a->vdim,
                         a->bias, a->add_bias_kv, mha_head_gate_name(a->head_gate),
                         (long long)b->embed_dim, (long long)b->num_heads,
                         (long long)b->num_kv_heads, (long long)b->kdim, (long long)b->vdim,
                         b->bias, b->add_bias_kv, mha_head_gate_name(b->head_gate));
    if (g->head_dim != m->head_dim || g->packed != m->packed ||
        a->no_out_bias != b->no_out_bias || a->sinks != b->sinks || a->qk_norm != b->qk_norm)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "backward: the gradient module's layout (head_dim %lld, %s, "
                         "out_proj.bias %s, sinks %s, qk_norm %d) differs from the module's "
                         "(%lld, %s, %s, %s, %d)",
                         (long long)g->head_dim,
                         g->packed ? "in_proj_weight" : "q/k/v_proj_weight",
                         a->no_out_bias ? "no" : "yes", a->sinks ? "yes" : "no",
                         (int)a->qk_norm, (long long)m->head_dim,
                         m->packed ? "in_proj_weight" : "q/k/v_proj_weight",
                         b->no_out_bias ? "no" : "yes", b->sinks ? "yes" : "no",
                         (int)b->qk_norm);
    return MHA_OK;
}

mha_status mha__check_backward(const fwd_plan *p, mha_tensor *gq, mha_tensor *gk,
                               mha_tensor *gv, const mha_module *grads, const mha_module *m,
                               const mha_forward_args *a, const mha_tensor *gout) {
    mha_status st;
    if (!gout) return mha__fail(MHA_ERR_INVALID_ARG, "backward: grad_output is NULL");
    if ((st = mha__check_output(gout, "grad_output", &p->out_shape)) ||
        (st = check_grad_view(gq, "grad_query", a->query)) ||
        (st = check_grad_view(gk, "grad_key", a->key)) ||
        (st = check_grad_view(gv, "grad_value", a->value)) ||
        (st = check_grads_module(grads, m)))
        return st;
    const mha_tensor *outs[3] = {gq, gk, gv};
    const char *onames[3] = {"grad_query", "grad_key", "grad_value"};
    const mha_tensor *ins[6] = {a->query,     a->key, a->value, a->key_padding_mask,
                                a->attn_mask, gout};
    const char *inames[6] = {"query",     "key",        "value", "key_padding_mask",
                             "attn_mask", "grad_output"};
    for (int o = 0; o < 3; o++) {
        for (int i = 0; i < 6; i++)
            if ((st = mha__check_no_overlap(outs[o], onames[o], ins[i], inames[i]))) return st;
        for (int o2 = o + 1; o2 < 3; o2++)
            if ((st = mha__check_no_overlap(outs[o], onames[o], outs[o2], onames[o2])))
                return st;
    }
    return MHA_OK;
}
