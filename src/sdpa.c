// sdpa.c: mha_sdpa, scaled dot-product attention on projected (B, H, T, D)
// views: every argument checked once (shapes, GQA, masks broadcast to
// (b, h, i, j) strides, scale, dropout), then the fused driver
// (fused_fwd.c) or the reference, one head at a time (ref.c).
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fused.h"
#include "plan.h"
#include "ref.h"

void mha_sdpa_args_init(mha_sdpa_args *a) {
    if (!a) return;
    memset(a, 0, sizeof *a);
    a->impl = MHA_IMPL_AUTO;
    a->opts.window_left = -1;
    a->opts.window_right = -1;
}

static mha_status check_4d(const mha_tensor *t, const char *name) {
    mha_status st = mha__check_float(t, name);
    if (st) return st;
    if (t->ndim != 4) {
        char s[160];
        return mha__fail(MHA_ERR_SHAPE, "%s: expected 4 dims (B, H, T, D), got %s", name,
                         mha__shape_str(s, sizeof s, t->ndim, t->shape));
    }
    return MHA_OK;
}

// The dims of a call: q (B, H, L, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv).
typedef struct sdpa_dims {
    int64_t B, H, L, D, S, Dv, Hkv;
    float alibi[MHA__ALIBI_MAX_DEFAULT];  // the paper's slopes when asked for
} sdpa_dims;

// q, k, v: 4-dim float views that fit together (Hkv dividing H); the
// scale (custom, or 1/sqrt(D)) and the window.
static mha_status sdpa_check(sdpa_dims *dm, double *scale_out, const mha_sdpa_args *a) {
    char s1[160], s2[160], s3[160];
    mha_status st;
    if ((st = mha__check_impl(a->impl))) return st;
    if ((st = check_4d(a->q, "q")) || (st = check_4d(a->k, "k")) || (st = check_4d(a->v, "v")))
        return st;
    const mha_tensor *q = a->q, *k = a->k, *v = a->v;
    const int64_t B = q->shape[0], H = q->shape[1], L = q->shape[2], D = q->shape[3],
                  S = k->shape[2], Dv = v->shape[3];
    const int64_t Hkv = k->shape[1];
    if (k->shape[0] != B || Hkv < 1 || H % Hkv != 0 || v->shape[0] != B ||
        v->shape[1] != Hkv || k->shape[3] != D || v->shape[2] != S)
        return mha__fail(MHA_ERR_SHAPE,
                         "sdpa: q %s, k %s, v %s do not fit (B, H, L, D), "
                         "(B, Hkv, S, D), (B, Hkv, S, Dv) with Hkv dividing H",
                         mha__shape_str(s1, sizeof s1, 4, q->shape),
                         mha__shape_str(s2, sizeof s2, 4, k->shape),
                         mha__shape_str(s3, sizeof s3, 4, v->shape));
    *dm = (sdpa_dims){.B = B, .H = H, .L = L, .D = D, .S = S, .Dv = Dv, .Hkv = Hkv};
    double scale;
    if ((st = mha__check_attn_opts("sdpa", &a->opts, MHA__REFUSE_SINK_TOKENS))) return st;
    if (a->opts.scale != 0.0) {
        scale = a->opts.scale;
    } else {
        if (D == 0)
            return mha__fail(MHA_ERR_SHAPE, "sdpa: head dim D is 0, so the default scale "
                                            "1/sqrt(D) is undefined (pass a custom scale)");
        scale = 1.0 / sqrt((double)D);
    }
    *scale_out = scale;
    return MHA_OK;
}

// The mask as (b, h, i, j) strides: causal, the window, attn_mask
// broadcast to (B, H, L, S), key_padding_mask (B, S).
static mha_status sdpa_mask(mha__mask *mk_out, const mha_sdpa_args *a, sdpa_dims *dm) {
    char s1[160], s2[160];
    mha_status st;
    const int64_t B = dm->B, H = dm->H, L = dm->L, S = dm->S;
    mha__mask mk;
    memset(&mk, 0, sizeof mk);
    mk.s_masked = S;
    mk.causal = a->opts.is_causal;
    mk.win_left = a->opts.window_left;
    mk.win_right = a->opts.window_right;
    if (a->attn_mask) {
        const mha_tensor *t = a->attn_mask;
        if ((st = mha__check_mask_dtype(t, "attn_mask"))) return st;
        const int64_t full[4] = {B, H, L, S};
        if (t->ndim > 4)
            return mha__fail(MHA_ERR_SHAPE,
                             "attn_mask: %d dims, at most 4 broadcast to (B, H, "
                             "L, S)",
                             t->ndim);
        for (int i = 0; i < 4; i++) {
            int td = t->ndim - 4 + i;  // right-aligned
            if (td < 0) {
                mk.attn_s[i] = 0;
                continue;
            }
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
            return mha__fail(MHA_ERR_SHAPE, "key_padding_mask: shape %s, expected (B, S) = %s",
                             mha__shape_str(s1, sizeof s1, t->ndim, t->shape),
                             mha__shape_str(s2, sizeof s2, 2, (int64_t[]){B, S}));
        mk.kpm = t->data;
        mk.kpm_dtype = t->dtype;
        mk.kpm_s[0] = t->stride[0];
        mk.kpm_s[1] = t->stride[1];
    }
    // the logit's soft cap, ALiBi and sinks (per query head)
    mk.softcap = a->opts.softcap;
    mk.sinks = a->opts.sinks;
    if ((st = mha__attn_logit_params(&mk.alibi, dm->alibi, &a->opts, H, "sdpa"))) return st;
    *mk_out = mk;
    return MHA_OK;
}

// The checks the forward and the backward share: the shapes, the scale and
// dropout_p, then the mask; the dropout descriptor (position ((b H + h) L
// + i) S + j, h the query head; its p 0 when there is none).
static mha_status sdpa_prepare(sdpa_dims *dm, double *scale, mha__mask *mk, mha__dropout *drop,
                               const mha_sdpa_args *a) {
    mha_status st = sdpa_check(dm, scale, a);
    if (st) return st;
    *drop = (mha__dropout){
        .p = a->opts.dropout_p,
        .seed = a->opts.dropout_seed,
        .offset = a->opts.dropout_offset,
        .H = dm->H,  // the query heads: the mask is per query head
        .L = dm->L,
        .S = dm->S,
    };
    return sdpa_mask(mk, a, dm);
}

// The descriptor the heads take: NULL without dropout.
static const mha__dropout *sdpa_drop(const mha__dropout *d) { return d->p > 0.0f ? d : NULL; }

// The outputs: out (B, H, L, Dv), weights (B, H, L, S) when asked, neither
// overlapping an input nor each other.
static mha_status sdpa_check_outputs(mha_tensor *out, mha_tensor *weights,
                                     const mha_sdpa_args *a, const sdpa_dims *dm) {
    mha_status st;
    mha_shape os = {4, {dm->B, dm->H, dm->L, dm->Dv}}, wsh = {4, {dm->B, dm->H, dm->L, dm->S}};
    if ((st = mha__check_output(out, "out", &os))) return st;
    if (weights && (st = mha__check_output(weights, "weights", &wsh))) return st;
    const mha_tensor *ins[5] = {a->q, a->k, a->v, a->attn_mask, a->key_padding_mask};
    const char *names[5] = {"q", "k", "v", "attn_mask", "key_padding_mask"};
    for (int i = 0; i < 5; i++) {
        if ((st = mha__check_no_overlap(out, "out", ins[i], names[i]))) return st;
        if ((st = mha__check_no_overlap(weights, "weights", ins[i], names[i]))) return st;
    }
    if ((st = mha__check_no_overlap(weights, "weights", out, "out"))) return st;
    return MHA_OK;
}

// What auto means for sdpa, forward and backward: fused when fusable, else
// the reference; MHA_IMPL in the environment overrides it (fused only when
// fusable; an unknown name is ignored). Any other impl stays as asked.
static mha_impl sdpa_pick(mha_impl asked, bool fusable) {
    if (asked != MHA_IMPL_AUTO) return asked;
    const char *env = getenv("MHA_IMPL");
    mha_impl forced;
    if (env && strcmp(env, "auto") != 0 && mha_impl_from_name(&forced, env) == MHA_OK &&
        (forced != MHA_IMPL_FUSED || fusable))
        return forced;
    return fusable ? MHA_IMPL_FUSED : MHA_IMPL_REFERENCE;
}

// The implementation: auto is fused when every tensor is F32, BF16 or F16
// (each its own: half rows are computed in float32, fused_fwd.c) with unit
// feature stride (the rows it reads and writes); MHA_IMPL in the
// environment overrides. Fused asked for but not possible: an error.
static mha_status sdpa_impl(mha_impl *impl_out, const mha_tensor *out,
                            const mha_tensor *weights, const mha_sdpa_args *a) {
    const mha_tensor *q = a->q, *k = a->k, *v = a->v;
    bool fusable = true;
    const mha_tensor *fts[5] = {q, k, v, out, weights};
    for (int i = 0; i < 5; i++)
        if (fts[i] && ((fts[i]->dtype != MHA_F32 && fts[i]->dtype != MHA_BF16 &&
                        fts[i]->dtype != MHA_F16) ||
                       (fts[i]->stride[3] != 1 && i < 4)))
            fusable = false;
    const mha_impl impl = sdpa_pick(a->impl, fusable);
    *impl_out = impl;
    if (impl == MHA_IMPL_FUSED && !fusable)
        return mha__fail(MHA_ERR_UNSUPPORTED,
                         "sdpa: the fused implementation takes F32, BF16 or F16 q, k, v, "
                         "out (and weights) with unit stride along the last dim; got "
                         "q %s stride %lld, k %s stride %lld, v %s stride %lld, "
                         "out %s stride %lld",
                         mha_dtype_name(q->dtype), (long long)q->stride[3],
                         mha_dtype_name(k->dtype), (long long)k->stride[3],
                         mha_dtype_name(v->dtype), (long long)v->stride[3],
                         mha_dtype_name(out->dtype), (long long)out->stride[3]);
    return MHA_OK;
}

// The reference: one (b, h) at a time (ref.c), query head h on KV head
// h / (H / Hkv); scores: nt x (L, S) doubles.
static mha_status sdpa_reference(mha_tensor *out, mha_tensor *weights, const mha_sdpa_args *a,
                                 const sdpa_dims *dm, const mha__mask *mk,
                                 const mha__dropout *drop, double scale) {
    const mha_tensor *q = a->q, *k = a->k, *v = a->v;
    const int64_t B = dm->B, H = dm->H, L = dm->L, D = dm->D, S = dm->S, Dv = dm->Dv,
                  Hkv = dm->Hkv;
    int nt = (double)B * H * L * S * (D + Dv) < MHA__PAR_MIN_WORK ? 1 : mha__max_threads();
    int64_t ls;
    size_t bytes;
    if (mha__mul_overflow_i64(L, S, &ls) ||
        mha__mul_overflow_size((size_t)ls, sizeof(double) * (size_t)nt, &bytes))
        return mha__fail(MHA_ERR_OVERFLOW, "sdpa: L %lld x S %lld overflows", (long long)L,
                         (long long)S);
    double *scores = mha__malloc(bytes ? bytes : 1);
    if (!scores) return mha__fail(MHA_ERR_NOMEM, "sdpa: out of memory for %zu bytes", bytes);
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (int64_t bh = 0; bh < B * H; bh++) {
        int64_t b = bh / H, h = bh % H;
        int tid = mha__thread_id();
        const int64_t hk = h / (H / Hkv);  // grouped-query: the KV head
#define MHA__HEAD(t) mha__view_at((t), (t)->stride[0] * b + (t)->stride[1] * h, 3)
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
        mha__ref_attention_head(o, w, qm, km, vm, L, S, D, Dv, scale, mk, drop, b, h,
                                scores + (size_t)tid * ls, NULL);
#undef MHA__HEAD
    }
    free(scores);
    return MHA_OK;
}

// The phases: check the shapes, the scale and dropout_p, the mask, the
// outputs; the implementation; the fused driver (fused_fwd.c) or the
// reference.
mha_status mha_sdpa(mha_tensor *out, mha_tensor *weights, const mha_sdpa_args *a) {
    if (!a) return mha__fail(MHA_ERR_INVALID_ARG, "mha_sdpa: NULL args");
    mha_status st;
    sdpa_dims dm = {0};  // (initialised for the compiler: read only after MHA_OK)
    double scale = 0.0;
    mha__mask mk;
    mha__dropout drop;
    mha_impl impl;
    if ((st = sdpa_prepare(&dm, &scale, &mk, &drop, a)) ||
        (st = sdpa_check_outputs(out, weights, a, &dm)) ||
        (st = sdpa_impl(&impl, out, weights, a)))
        return st;
    // a training forward's state (the fused path fills it)
    if (a->save && (st = mha__saved_prepare_sdpa(a->save, a, dm.B, dm.H, dm.L, dm.Dv)))
        return st;
    if (impl == MHA_IMPL_FUSED)
        st = mha__fused_sdpa(out, weights, a->q, a->k, a->v, &mk, sdpa_drop(&drop), scale,
                             a->save);
    else st = sdpa_reference(out, weights, a, &dm, &mk, sdpa_drop(&drop), scale);
    if (!st)
        mha__set_impl(impl == MHA_IMPL_FUSED, mha_isa(),
                      impl == MHA_IMPL_FUSED && mha__fused_sdpa_bf16(a->q, a->k, a->v));
    return st;
}

// ---------------------------------------------------------------------------
// mha_sdpa_backward

// dq, dk, dv, dout: present, of the shapes q, k, v, out have; the
// gradients overlapping neither an input nor each other.
static mha_status sdpa_check_grads(mha_tensor *dq, mha_tensor *dk, mha_tensor *dv,
                                   const mha_tensor *dout, const mha_sdpa_args *a,
                                   const sdpa_dims *dm) {
    mha_status st;
    const mha_tensor *gs[4] = {dq, dk, dv, dout};
    const char *gn[4] = {"dq", "dk", "dv", "dout"};
    const mha_shape want[4] = {{4, {dm->B, dm->H, dm->L, dm->D}},
                               {4, {dm->B, dm->Hkv, dm->S, dm->D}},
                               {4, {dm->B, dm->Hkv, dm->S, dm->Dv}},
                               {4, {dm->B, dm->H, dm->L, dm->Dv}}};
    for (int i = 0; i < 4; i++) {
        if (!gs[i])
            return mha__fail(MHA_ERR_INVALID_ARG,
                             "mha_sdpa_backward: %s is NULL (dq, dk, dv are all written, "
                             "from dout)",
                             gn[i]);
        if ((st = mha__check_output(gs[i], gn[i], &want[i]))) return st;
    }
    const mha_tensor *ins[6] = {a->q, a->k, a->v, a->attn_mask, a->key_padding_mask, dout};
    const char *names[6] = {"q", "k", "v", "attn_mask", "key_padding_mask", "dout"};
    for (int o = 0; o < 3; o++) {
        for (int i = 0; i < 6; i++)
            if ((st = mha__check_no_overlap(gs[o], gn[o], ins[i], names[i]))) return st;
        for (int o2 = o + 1; o2 < 3; o2++)
            if ((st = mha__check_no_overlap(gs[o], gn[o], gs[o2], gn[o2]))) return st;
    }
    return MHA_OK;
}

// dsinks (H floats): only with opts.sinks, overlapping neither an input
// (the sinks included) nor another gradient.
static mha_status sdpa_check_dsinks(float *dsinks, const mha_tensor *dq, const mha_tensor *dk,
                                    const mha_tensor *dv, const mha_tensor *dout,
                                    const mha_sdpa_args *a, const sdpa_dims *dm) {
    if (!dsinks) return MHA_OK;
    if (!a->opts.sinks)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "mha_sdpa_backward: dsinks is given but opts.sinks is NULL (the "
                         "gradient of the sinks needs the sinks: pass opts.sinks, H = %lld "
                         "logits, or dsinks = NULL)",
                         (long long)dm->H);
    mha_status st;
    const int64_t H = dm->H;
    const mha_tensor ds = mha_tensor_contiguous(dsinks, MHA_F32, 1, &H),
                     sk = mha_tensor_contiguous((void *)a->opts.sinks, MHA_F32, 1, &H);
    const mha_tensor *ts[9] = {&sk,  a->q, a->k, a->v, a->attn_mask, a->key_padding_mask,
                               dout, dq,   dk};
    const char *names[9] = {"opts.sinks",       "q",    "k",  "v", "attn_mask",
                            "key_padding_mask", "dout", "dq", "dk"};
    for (int i = 0; i < 9; i++)
        if ((st = mha__check_no_overlap(&ds, "dsinks", ts[i], names[i]))) return st;
    return mha__check_no_overlap(&ds, "dsinks", dv, "dv");
}

// As sdpa_impl, for the backward: fused when q, k, v, dout and the
// gradients are all F32, BF16 or F16 with unit stride along the last dim.
static mha_status sdpa_backward_impl(mha_impl *impl_out, const mha_tensor *const ts[7],
                                     const mha_sdpa_args *a) {
    static const char *names[7] = {"q", "k", "v", "dout", "dq", "dk", "dv"};
    int bad = -1;
    for (int i = 0; i < 7 && bad < 0; i++)
        if ((ts[i]->dtype != MHA_F32 && ts[i]->dtype != MHA_BF16 && ts[i]->dtype != MHA_F16) ||
            ts[i]->stride[3] != 1)
            bad = i;
    const mha_impl impl = sdpa_pick(a->impl, bad < 0);
    *impl_out = impl;
    if (impl == MHA_IMPL_FUSED && bad >= 0)
        return mha__fail(MHA_ERR_UNSUPPORTED,
                         "sdpa backward: the fused implementation takes F32, BF16 or F16 q, "
                         "k, v, dout, dq, dk, dv with unit stride along the last dim; %s is %s "
                         "with stride %lld",
                         names[bad], mha_dtype_name(ts[bad]->dtype),
                         (long long)ts[bad]->stride[3]);
    return MHA_OK;
}

// The reference backward: one item per (b, KV head g); each query head h of
// the group in increasing order through ref.c's head backward (P
// recomputed in double), dq written, the group's dk, dv summed in double
// and written once. ws per thread: 2 (L, S) + 2 (S, D + Dv) doubles; then,
// with dsinks, each (b, h)'s sink gradient (B, H) doubles, summed over b in
// increasing order once every item is done.
static mha_status sdpa_reference_backward(mha_tensor *dq, mha_tensor *dk, mha_tensor *dv,
                                          float *dsinks, const mha_tensor *dout,
                                          const mha_sdpa_args *a, const sdpa_dims *dm,
                                          const mha__mask *mk, const mha__dropout *drop,
                                          double scale) {
    const mha_tensor *q = a->q, *k = a->k, *v = a->v;
    const int64_t B = dm->B, H = dm->H, L = dm->L, D = dm->D, S = dm->S, Dv = dm->Dv,
                  Hkv = dm->Hkv, G = H / Hkv;
    const int nt = (double)B * H * L * S * (2 * D + 3 * Dv) < MHA__PAR_MIN_WORK
                       ? 1
                       : mha__max_threads();
    int64_t ls, skv, per;
    size_t bytes;
    if (mha__mul_overflow_i64(L, S, &ls) || mha__mul_overflow_i64(S, D + Dv, &skv) ||
        __builtin_add_overflow(2 * ls, 2 * skv, &per) ||
        mha__mul_overflow_size((size_t)per, sizeof(double) * (size_t)nt, &bytes) ||
        mha__add_overflow_size(bytes, dsinks ? sizeof(double) * (size_t)(B * H) : 0, &bytes))
        return mha__fail(MHA_ERR_OVERFLOW, "sdpa backward: L %lld x S %lld overflows",
                         (long long)L, (long long)S);
    double *ws = mha__malloc(bytes ? bytes : 1);
    if (!ws)
        return mha__fail(MHA_ERR_NOMEM, "sdpa backward: out of memory for %zu bytes", bytes);
    double *dsink_bh = dsinks ? ws + (size_t)per * (size_t)nt : NULL;  // (B, H)
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (int64_t bg = 0; bg < B * Hkv; bg++) {
        const int64_t b = bg / Hkv, g = bg % Hkv;
        double *w = ws + (size_t)mha__thread_id() * (size_t)per, *sdk = w + 2 * ls,
               *sdv = sdk + S * D, *hdk = sdv + S * Dv, *hdv = hdk + S * D;
        // head (b, h) of a view, rows along dim 2, columns along dim 3
#define SDPA_VIEW(t, hh)                                                         \
    mha__vmat((char *)(t)->data + ((t)->stride[0] * b + (t)->stride[1] * (hh)) * \
                                      (int64_t)mha_dtype_size((t)->dtype),       \
              (t)->dtype, (t)->stride[2], (t)->stride[3])
        const mha__mat none = {NULL, false, 0, 0, 0};
        for (int64_t h = g * G; h < (g + 1) * G; h++) {
            // dk_g = sum over the group's heads of dk_h (the same for dv)
            mha__ref_attention_head_backward(SDPA_VIEW(dq, h), mha__dmat(hdk, D),
                                             mha__dmat(hdv, Dv), none, SDPA_VIEW(dout, h),
                                             SDPA_VIEW(q, h), SDPA_VIEW(k, g), SDPA_VIEW(v, g),
                                             L, S, D, Dv, scale, mk, drop, b, h, w,
                                             dsink_bh ? dsink_bh + b * H + h : NULL);
            for (int64_t i = 0; i < S * D; i++) sdk[i] = h == g * G ? hdk[i] : sdk[i] + hdk[i];
            for (int64_t i = 0; i < S * Dv; i++)
                sdv[i] = h == g * G ? hdv[i] : sdv[i] + hdv[i];
        }
        const mha__mat dkm = SDPA_VIEW(dk, g), dvm = SDPA_VIEW(dv, g);
#undef SDPA_VIEW
        for (int64_t j = 0; j < S; j++) {
            for (int64_t c = 0; c < D; c++) mha__st(dkm, j, c, sdk[j * D + c]);
            for (int64_t c = 0; c < Dv; c++) mha__st(dvm, j, c, sdv[j * Dv + c]);
        }
    }
    // dsinks_h = sum_b dsink(b, h) (ref.c: -sum_i P_sink,i rowsum(dP * P)_i)
    for (int64_t h = 0; dsink_bh && h < H; h++) {
        double s = 0.0;
        for (int64_t b = 0; b < B; b++) s += dsink_bh[b * H + h];
        dsinks[h] = (float)s;
    }
    free(ws);
    return MHA_OK;
}

// The phases: the forward's checks (shapes, scale, dropout_p, mask), the
// gradients' views, the implementation, then the fused driver (fused_bwd.c)
// or the reference.
mha_status mha_sdpa_backward(mha_tensor *dq, mha_tensor *dk, mha_tensor *dv, float *dsinks,
                             const mha_tensor *dout, const mha_sdpa_args *a) {
    if (!a) return mha__fail(MHA_ERR_INVALID_ARG, "mha_sdpa_backward: NULL args");
    mha_status st;
    sdpa_dims dm = {0};  // (initialised for the compiler: read only after MHA_OK)
    double scale = 0.0;
    mha__mask mk;
    mha__dropout drop;
    mha_impl impl;
    if ((st = sdpa_prepare(&dm, &scale, &mk, &drop, a)) ||
        (st = sdpa_check_grads(dq, dk, dv, dout, a, &dm)) ||
        (st = sdpa_check_dsinks(dsinks, dq, dk, dv, dout, a, &dm)))
        return st;
    const mha_tensor *ts[7] = {a->q, a->k, a->v, dout, dq, dk, dv};
    if ((st = sdpa_backward_impl(&impl, ts, a))) return st;
    // the forward's state: only from this call's own forward
    const mha_saved *sv = a->save && a->save->valid ? a->save : NULL;
    if (sv) {
        mha__saved_key key;
        mha__saved_key_of_sdpa(&key, a);
        if (!mha__saved_key_equal(&key, &sv->key) || sv->outer_valid)
            return mha__fail(MHA_ERR_INVALID_ARG,
                             "mha_sdpa_backward: args.save holds the state of another call "
                             "(views, masks, options or dropout differ); run mha_sdpa with "
                             "these args first, or pass save = NULL");
    }
    if (impl == MHA_IMPL_FUSED)
        st = mha__fused_sdpa_backward(dq, dk, dv, dsinks, dout, a->q, a->k, a->v, &mk,
                                      sdpa_drop(&drop), scale, sv);
    else
        st = sdpa_reference_backward(dq, dk, dv, dsinks, dout, a, &dm, &mk, sdpa_drop(&drop),
                                     scale);
    if (!st)
        mha__set_impl(impl == MHA_IMPL_FUSED, mha_isa(),
                      impl == MHA_IMPL_FUSED &&
                          mha__fused_sdpa_backward_bf16(a->q, a->k, a->v, dout));
    return st;
}
