// forward.c: the public module forward entry points (mha_forward,
// mha_forward_ex, mha_forward_shapes, mha_forward_workspace_size): the plan
// (plan.c) checks every argument once and lays out the scratch memory; then
// the output views are checked and the chosen implementation runs: the
// reference (ref_module.c) or the fused path (fused_fwd.c). The scratch is
// one block; nothing else is allocated.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "philox.h"
#include "plan.h"
#include "ref.h"

void mha_forward_args_init(mha_forward_args *a) {
    if (!a) return;
    memset(a, 0, sizeof *a);
    a->average_attn_weights = true;
    a->impl = MHA_IMPL_AUTO;
    a->window_left = -1;
    a->window_right = -1;
    a->weights_head_end = -1;
    a->weights_row_end = -1;
    mha_rope_init(&a->rope, MHA_ROPE_NONE);
}

mha_status mha_forward_shapes(mha_shape *out_shape, mha_shape *weights_shape,
                              const mha_module *m, const mha_forward_args *a) {
    fwd_plan p;
    mha_status st = mha__plan_forward(&p, m, a);
    if (st) return st;
    if (out_shape) *out_shape = p.out_shape;
    if (weights_shape) *weights_shape = p.w_shape;
    return MHA_OK;
}

mha_status mha_forward_workspace_size(size_t *bytes, const mha_module *m,
                                      const mha_forward_args *a) {
    if (!bytes)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "mha_forward_workspace_size: NULL argument");
    fwd_plan p;
    mha_status st = mha__plan_forward(&p, m, a);
    if (st) return st;
    *bytes = p.ws_bytes;
    return MHA_OK;
}

static mha_status check_forward_outputs(const fwd_plan *p, mha_tensor *out,
                                        mha_tensor *weights,
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
    const mha_tensor *ins[5] = {a->query, a->key, a->value, a->key_padding_mask,
                                a->attn_mask};
    const char *names[5] = {"query", "key", "value", "key_padding_mask",
                            "attn_mask"};
    for (int i = 0; i < 5; i++) {
        if ((st = mha__check_no_overlap(out, "attn_output", ins[i], names[i])))
            return st;
        if (a->need_weights &&
            (st = mha__check_no_overlap(weights, "attn_output_weights", ins[i], names[i])))
            return st;
    }
    if (a->need_weights &&
        (st = mha__check_no_overlap(weights, "attn_output_weights", out, "attn_output")))
        return st;
    return MHA_OK;
}

mha_status mha_forward_ex(mha_tensor *out, mha_tensor *weights,
                          const mha_module *m, const mha_forward_args *a,
                          void *workspace, size_t workspace_bytes) {
    fwd_plan p;
    mha_status st = mha__plan_forward(&p, m, a);
    if (st) return st;
    if ((st = check_forward_outputs(&p, out, weights, a))) return st;
    if (!workspace || workspace_bytes < p.ws_bytes)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "workspace of %zu bytes is too small: %zu needed",
                         workspace ? workspace_bytes : 0, p.ws_bytes);
    char *ws = (char *)(((uintptr_t)workspace + 63) & ~(uintptr_t)63);
    if (a->save && (st = mha__saved_prepare(a->save, &p, m, a))) return st;
    if (p.fused) return mha__fused_forward(&p, out, weights, m, a, ws);
    mha__ref_forward(&p, out, weights, m, a, ws);
    return MHA_OK;
}

mha_status mha_forward(mha_tensor *out, mha_tensor *weights, const mha_module *m,
                       const mha_forward_args *a) {
    fwd_plan p;
    mha_status st = mha__plan_forward(&p, m, a);
    if (st) return st;
    if ((st = check_forward_outputs(&p, out, weights, a))) return st;
    if (a->save && (st = mha__saved_prepare(a->save, &p, m, a))) return st;
    void *ws = mha__malloc(p.ws_bytes);
    if (!ws)
        return mha__fail(MHA_ERR_NOMEM,
                         "mha_forward: out of memory for %zu bytes of scratch",
                         p.ws_bytes);
    char *al = (char *)(((uintptr_t)ws + 63) & ~(uintptr_t)63);
    if (p.fused) st = mha__fused_forward(&p, out, weights, m, a, al);
    else mha__ref_forward(&p, out, weights, m, a, al);
    free(ws);
    return st;
}

// ---------------------------------------------------------------------------
// The distributed layer's parts (plan.h: mha__part)

// The plan of a part: the fused path, float32 weights, no weights output,
// no saved state, no trace; the range checked.
mha_status mha__part_plan(fwd_plan *p, mha_forward_args *a2, const mha_module *m,
                            const mha_forward_args *a, const mha__part *part) {
    if (!m || !a || !part)
        return mha__fail(MHA_ERR_INVALID_ARG, "mha parallel: NULL module, args or part");
    *a2 = *a;
    a2->impl = MHA_IMPL_FUSED;
    a2->need_weights = false;
    if (!part->attn) a2->save = NULL;  // (ring attention keeps one)
    a2->trace = NULL;
    mha_status st = mha__plan_forward(p, m, a2);
    if (st) return st;
    if (!p->fused)
        return mha__fail(MHA_ERR_UNSUPPORTED,
                         "mha parallel: float32, bfloat16 or float16 inputs only (the fused "
                         "path)");
    if (part->g0 < 0 || part->g0 > part->g1 || part->g1 > p->Hkv)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "mha parallel: KV heads [%lld, %lld) not within [0, %lld)",
                         (long long)part->g0, (long long)part->g1, (long long)p->Hkv);
    p->part = part;
    p->mask.q_off = part->q_off;
    if (part->kpm_full) {  // the block's columns of the whole mask
        const mha_tensor *t = part->kpm_full;
        p->mask.kpm = (const char *)t->data +
                      part->kpm_off * t->stride[t->ndim - 1] * (int64_t)mha_dtype_size(t->dtype);
        p->mask.kpm_dtype = t->dtype;
        p->mask.kpm_s[0] = p->unbatched ? 0 : t->stride[0];
        p->mask.kpm_s[1] = t->stride[t->ndim - 1];
    }
    return MHA_OK;
}

mha_status mha__part_forward(mha_tensor *out, const mha_module *m, const mha_forward_args *a,
                             const mha__part *part) {
    fwd_plan p;
    mha_forward_args a2;
    mha_status st = mha__part_plan(&p, &a2, m, a, part);
    if (st) return st;
    if (!part->ctx && !part->q_out && (st = check_forward_outputs(&p, out, NULL, &a2)))
        return st;
    if (a2.save && (st = mha__saved_prepare(a2.save, &p, m, &a2))) return st;
    void *ws = mha__malloc(p.ws_bytes);
    if (!ws)
        return mha__fail(MHA_ERR_NOMEM, "mha parallel: out of memory for %zu bytes of scratch",
                         p.ws_bytes);
    st = mha__fused_forward(&p, out, NULL, m, &a2, (char *)(((uintptr_t)ws + 63) & ~(uintptr_t)63));
    free(ws);
    return st;
}

mha_status mha__part_out_project(mha_tensor *out, const mha_module *m,
                                 const mha_forward_args *a, const float *ctx) {
    const mha__part all = {.g0 = 0, .g1 = m ? m->cfg.num_kv_heads : 0, .bias = true};
    fwd_plan p;
    mha_forward_args a2;
    mha_status st = mha__part_plan(&p, &a2, m, a, &all);
    if (st) return st;
    p.part = NULL;
    if ((st = check_forward_outputs(&p, out, NULL, &a2))) return st;
    const int64_t n = p.N * p.L * p.E;
    void *ws = mha__malloc(p.ws_bytes);
    float *c = mha__malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    if (!ws || !c) {
        free(ws);
        free(c);
        return mha__fail(MHA_ERR_NOMEM, "mha parallel: out of memory for %zu bytes of scratch",
                         p.ws_bytes + sizeof(float) * (size_t)n);
    }
    memcpy(c, ctx, sizeof(float) * (size_t)n);  // (gated in place)
    mha__fused_out_project(&p, out, m, &a2, c, (char *)(((uintptr_t)ws + 63) & ~(uintptr_t)63));
    free(c);
    free(ws);
    return MHA_OK;
}

// ---------------------------------------------------------------------------
// Scaled dot-product attention on projected (B, H, T, D) views

void mha_sdpa_args_init(mha_sdpa_args *a) {
    if (!a) return;
    memset(a, 0, sizeof *a);
    a->impl = MHA_IMPL_AUTO;
    a->window_left = -1;
    a->window_right = -1;
}

static mha_status check_4d(const mha_tensor *t, const char *name) {
    mha_status st = mha__check_float(t, name);
    if (st) return st;
    if (t->ndim != 4) {
        char s[160];
        return mha__fail(MHA_ERR_SHAPE, "%s: expected 4 dims (B, H, T, D), got %s",
                         name, mha__shape_str(s, sizeof s, t->ndim, t->shape));
    }
    return MHA_OK;
}

mha_status mha_sdpa(mha_tensor *out, mha_tensor *weights, const mha_sdpa_args *a) {
    char s1[160], s2[160], s3[160];
    if (!a) return mha__fail(MHA_ERR_INVALID_ARG, "mha_sdpa: NULL args");
    mha_status st;
    if ((st = mha__check_impl(a->impl))) return st;
    if ((st = check_4d(a->q, "q")) || (st = check_4d(a->k, "k")) ||
        (st = check_4d(a->v, "v")))
        return st;
    const mha_tensor *q = a->q, *k = a->k, *v = a->v;
    const int64_t B = q->shape[0], H = q->shape[1], L = q->shape[2],
                  D = q->shape[3], S = k->shape[2], Dv = v->shape[3];
    const int64_t Hkv = k->shape[1];
    if (k->shape[0] != B || Hkv < 1 || H % Hkv != 0 || v->shape[0] != B ||
        v->shape[1] != Hkv || k->shape[3] != D || v->shape[2] != S)
        return mha__fail(MHA_ERR_SHAPE,
                         "sdpa: q %s, k %s, v %s do not fit (B, H, L, D), "
                         "(B, Hkv, S, D), (B, Hkv, S, Dv) with Hkv dividing H",
                         mha__shape_str(s1, sizeof s1, 4, q->shape),
                         mha__shape_str(s2, sizeof s2, 4, k->shape),
                         mha__shape_str(s3, sizeof s3, 4, v->shape));
    double scale;
    if ((st = mha__check_attn_opts("sdpa", a->window_left, a->window_right, 0.0f,
                                   a->use_custom_scale, a->scale)))
        return st;
    if (a->use_custom_scale) {
        scale = a->scale;
    } else {
        if (D == 0)
            return mha__fail(MHA_ERR_SHAPE,
                             "sdpa: head dim D is 0, so the default scale "
                             "1/sqrt(D) is undefined (pass a custom scale)");
        scale = 1.0 / sqrt((double)D);
    }
    mha__mask mk;
    memset(&mk, 0, sizeof mk);
    mk.s_masked = S;
    mk.causal = a->is_causal;
    mk.win_left = a->window_left;
    mk.win_right = a->window_right;
    if (a->attn_mask) {
        const mha_tensor *t = a->attn_mask;
        if ((st = mha__check_mask_dtype(t, "attn_mask"))) return st;
        const int64_t full[4] = {B, H, L, S};
        if (t->ndim > 4)
            return mha__fail(MHA_ERR_SHAPE,
                             "attn_mask: %d dims, at most 4 broadcast to (B, H, "
                             "L, S)", t->ndim);
        for (int i = 0; i < 4; i++) {
            int td = t->ndim - 4 + i;  // right-aligned
            if (td < 0) { mk.attn_s[i] = 0; continue; }
            if (t->shape[td] == full[i]) mk.attn_s[i] = full[i] == 1 ? 0 : t->stride[td];
            else if (t->shape[td] == 1) mk.attn_s[i] = 0;
            else
                return mha__fail(MHA_ERR_SHAPE,
                                 "attn_mask: shape %s does not broadcast to "
                                 "(B, H, L, S) = %s",
                                 mha__shape_str(s1, sizeof s1, t->ndim, t->shape),
                                 mha__shape_str(s2, sizeof s2, 4, full));
        }
        mk.attn = t->data;
        mk.attn_dtype = t->dtype;
    }
    if (a->key_padding_mask) {
        const mha_tensor *t = a->key_padding_mask;
        if ((st = mha__check_mask_dtype(t, "key_padding_mask"))) return st;
        if (t->ndim != 2 || t->shape[0] != B || t->shape[1] != S)
            return mha__fail(MHA_ERR_SHAPE,
                             "key_padding_mask: shape %s, expected (B, S) = %s",
                             mha__shape_str(s1, sizeof s1, t->ndim, t->shape),
                             mha__shape_str(s2, sizeof s2, 2, (int64_t[]){B, S}));
        mk.kpm = t->data;
        mk.kpm_dtype = t->dtype;
        mk.kpm_s[0] = t->stride[0];
        mk.kpm_s[1] = t->stride[1];
    }
    mha_shape os = {4, {B, H, L, Dv}}, wsh = {4, {B, H, L, S}};
    if ((st = mha__check_output(out, "out", &os))) return st;
    if (weights && (st = mha__check_output(weights, "weights", &wsh))) return st;
    const mha_tensor *ins[5] = {q, k, v, a->attn_mask, a->key_padding_mask};
    const char *names[5] = {"q", "k", "v", "attn_mask", "key_padding_mask"};
    for (int i = 0; i < 5; i++) {
        if ((st = mha__check_no_overlap(out, "out", ins[i], names[i]))) return st;
        if ((st = mha__check_no_overlap(weights, "weights", ins[i], names[i]))) return st;
    }
    if ((st = mha__check_no_overlap(weights, "weights", out, "out"))) return st;

    // auto: fused when every tensor is F32 with unit feature stride (the
    // rows it reads and writes); MHA_IMPL in the environment overrides.
    bool fusable = true;
    const mha_tensor *fts[5] = {q, k, v, out, weights};
    for (int i = 0; i < 5; i++)
        if (fts[i] && (fts[i]->dtype != MHA_F32 || (fts[i]->stride[3] != 1 && i < 4)))
            fusable = false;
    mha_impl impl = a->impl;
    if (impl == MHA_IMPL_AUTO) {
        const char *env = getenv("MHA_IMPL");
        mha_impl forced;
        impl = fusable ? MHA_IMPL_FUSED : MHA_IMPL_REFERENCE;
        if (env && strcmp(env, "auto") != 0 && mha_impl_from_name(&forced, env) == MHA_OK &&
            (forced != MHA_IMPL_FUSED || fusable))
            impl = forced;
    }
    if (impl == MHA_IMPL_FUSED) {
        if (!fusable)
            return mha__fail(MHA_ERR_UNSUPPORTED,
                             "sdpa: the fused implementation takes F32 q, k, v, out "
                             "(and weights) with unit stride along the last dim; got "
                             "q %s stride %lld, k %s stride %lld, v %s stride %lld, "
                             "out %s stride %lld",
                             mha_dtype_name(q->dtype), (long long)q->stride[3],
                             mha_dtype_name(k->dtype), (long long)k->stride[3],
                             mha_dtype_name(v->dtype), (long long)v->stride[3],
                             mha_dtype_name(out->dtype), (long long)out->stride[3]);
        return mha__fused_sdpa(out, weights, q, k, v, &mk, scale);
    }

    int nt = (double)B * H * L * S * (D + Dv) < MHA__PAR_MIN_WORK ? 1 : mha__max_threads();
    int64_t ls;
    size_t bytes;
    if (mha__mul_overflow_i64(L, S, &ls) ||
        mha__mul_overflow_size((size_t)ls, sizeof(double) * (size_t)nt, &bytes))
        return mha__fail(MHA_ERR_OVERFLOW, "sdpa: L %lld x S %lld overflows",
                         (long long)L, (long long)S);
    double *scores = mha__malloc(bytes ? bytes : 1);
    if (!scores)
        return mha__fail(MHA_ERR_NOMEM, "sdpa: out of memory for %zu bytes", bytes);
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (int64_t bh = 0; bh < B * H; bh++) {
        int64_t b = bh / H, h = bh % H;
        int tid = mha__thread_id();
        const int64_t hk = h / (H / Hkv);  // grouped-query: the KV head
#define MHA__HEAD(t)                                                          \
    mha__view_at((t), b * (t)->stride[0] + h * (t)->stride[1], 3)
        mha__mat w = {NULL, false, 0, 0, 0}, o = MHA__HEAD(out), qm = MHA__HEAD(q),
                 km = mha__view_at(k, b * k->stride[0] + hk * k->stride[1], 3),
                 vm = mha__view_at(v, b * v->stride[0] + hk * v->stride[1], 3);
        if (weights) {
            w = MHA__HEAD(weights);
            w.rs = weights->stride[2];
        }
        o.rs = out->stride[2];
        qm.rs = q->stride[2];
        km.rs = k->stride[2];
        vm.rs = v->stride[2];
        mha__ref_attention_head(o, w, qm, km, vm, L, S, D, Dv, scale, &mk, NULL, b, h,
                                scores + (size_t)tid * ls, NULL);
#undef MHA__HEAD
    }
    free(scores);
    return MHA_OK;
}
