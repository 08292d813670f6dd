// check.c: the argument checks every entry point shares (base layer):
// tensor views (dims, strides, overflow, data), float and mask dtypes,
// output shapes, aliasing between outputs and inputs, and the attention
// options (window, soft cap, scale). Each returns a status with a message
// naming the argument and its values (mha__fail); none allocates. What a
// check means for one entry point (its shapes) stays with that entry point.
#include <math.h>

#include "check.h"

mha_status mha__check_impl(mha_impl impl) {
    if (impl != MHA_IMPL_AUTO && impl != MHA_IMPL_REFERENCE && impl != MHA_IMPL_FUSED)
        return mha__fail(MHA_ERR_UNSUPPORTED, "unknown implementation %d", (int)impl);
    return MHA_OK;
}

// Checks a tensor view: non-NULL, ndim in range, non-negative dims, element
// count without overflow, data present when non-empty.
static mha_status check_view(const mha_tensor *t, const char *name) {
    if (!t) return mha__fail(MHA_ERR_INVALID_ARG, "%s: NULL tensor", name);
    if (t->ndim < 0 || t->ndim > MHA_MAX_DIMS)
        return mha__fail(MHA_ERR_SHAPE, "%s: ndim %d out of range [0, %d]", name, t->ndim,
                         MHA_MAX_DIMS);
    if ((unsigned)t->dtype >= MHA_DTYPE_COUNT)
        return mha__fail(MHA_ERR_INVALID_ARG, "%s: invalid dtype %d", name, (int)t->dtype);
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) {
        if (t->shape[i] < 0)
            return mha__fail(MHA_ERR_SHAPE, "%s: dim %d is negative (%lld)", name, i,
                             (long long)t->shape[i]);
        if (mha__mul_overflow_i64(n, t->shape[i], &n))
            return mha__fail(MHA_ERR_OVERFLOW, "%s: the number of elements overflows", name);
    }
    // The farthest element must be addressable.
    int64_t span = 0, e;
    for (int i = 0; i < t->ndim && n > 0; i++) {
        int64_t s = t->stride[i] < 0 ? -t->stride[i] : t->stride[i];
        if (t->stride[i] == INT64_MIN || mha__mul_overflow_i64(t->shape[i] - 1, s, &e) ||
            __builtin_add_overflow(span, e, &span))
            return mha__fail(MHA_ERR_OVERFLOW, "%s: strides overflow", name);
    }
    size_t bytes;
    if (mha__mul_overflow_size((size_t)span + 1, mha_dtype_size(t->dtype), &bytes))
        return mha__fail(MHA_ERR_OVERFLOW, "%s: strides overflow", name);
    if (n > 0 && !t->data) return mha__fail(MHA_ERR_INVALID_ARG, "%s: data is NULL", name);
    return MHA_OK;
}

mha_status mha__check_float(const mha_tensor *t, const char *name) {
    mha_status st = check_view(t, name);
    if (st) return st;
    if (t->dtype != MHA_F32 && t->dtype != MHA_F64 && t->dtype != MHA_BF16 &&
        t->dtype != MHA_F16)
        return mha__fail(MHA_ERR_DTYPE,
                         "%s: dtype %s is not supported (expected F32, F64, BF16 or F16)",
                         name, mha_dtype_name(t->dtype));
    return MHA_OK;
}

// The attention options every entry point shares, one message each (see
// check.h).
mha_status mha__check_attn_opts(const char *who, const mha_attn_opts *o, unsigned refuse) {
    if (o->window_left < -1 || o->window_right < -1)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "%s: window_left %lld, window_right %lld: each must be -1 "
                         "(unbounded) or >= 0",
                         who, (long long)o->window_left, (long long)o->window_right);
    if (!(o->softcap >= 0.0f) || !isfinite(o->softcap))
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "%s: softcap must be >= 0 and finite (0: none), got %g", who,
                         (double)o->softcap);
    if (!isfinite(o->scale))
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "%s: scale must be finite (0: 1 / sqrt(head dim)), got %g", who,
                         o->scale);
    if (!(o->dropout_p >= 0.0f && o->dropout_p < 1.0f))
        return mha__fail(MHA_ERR_INVALID_ARG, "%s: dropout_p must be in [0, 1), got %g", who,
                         (double)o->dropout_p);
    if (o->sink_tokens < 0)
        return mha__fail(MHA_ERR_INVALID_ARG, "%s: sink_tokens must be >= 0, got %lld", who,
                         (long long)o->sink_tokens);
    if ((refuse & MHA__REFUSE_SINKS) && o->sinks)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "%s: opts.sinks is set: a module's sinks are its parameter "
                         "(mha_config.sinks)",
                         who);
    if ((refuse & MHA__REFUSE_DROPOUT) && o->dropout_p != 0.0f)
        return mha__fail(MHA_ERR_INVALID_ARG, "%s: opts.dropout_p %g: %s", who,
                         (double)o->dropout_p,
                         (refuse & MHA__REFUSE_SINKS)
                             ? "a module's dropout rate is its config's (mha_config.dropout, "
                               "with training)"
                             : "this call has no dropout");
    if ((refuse & MHA__REFUSE_SINK_TOKENS) && o->sink_tokens)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "%s: opts.sink_tokens %lld: StreamingLLM's sink tokens go with a KV "
                         "cache (mha_forward_cached, mha_forward_paged, the caches' attend)",
                         who, (long long)o->sink_tokens);
    return MHA_OK;
}

mha_status mha__check_mask_dtype(const mha_tensor *t, const char *name) {
    mha_status st = check_view(t, name);
    if (st) return st;
    if (t->dtype != MHA_F32 && t->dtype != MHA_F64 && t->dtype != MHA_BOOL && t->dtype != MHA_U8)
        return mha__fail(MHA_ERR_DTYPE,
                         "%s: dtype %s is not supported (expected BOOL, U8, "
                         "F32 or F64)",
                         name, mha_dtype_name(t->dtype));
    return MHA_OK;
}

// The byte range [lo, hi) a non-empty view touches.
static void view_extent(const mha_tensor *t, uintptr_t *lo, uintptr_t *hi) {
    int64_t mn = 0, mx = 0;
    for (int i = 0; i < t->ndim; i++) {
        int64_t e = (t->shape[i] - 1) * t->stride[i];
        if (e < 0) mn += e;
        else mx += e;
    }
    size_t es = mha_dtype_size(t->dtype);
    *lo = (uintptr_t)t->data + (uintptr_t)(mn * (int64_t)es);
    *hi = (uintptr_t)t->data + (uintptr_t)((mx + 1) * (int64_t)es);
}

// Outputs may not overlap inputs (nor each other).
mha_status mha__check_no_overlap(const mha_tensor *out, const char *oname,
                                 const mha_tensor *in, const char *iname) {
    if (!out || !in || mha_tensor_numel(out) == 0 || mha_tensor_numel(in) == 0) return MHA_OK;
    uintptr_t a0, a1, b0, b1;
    view_extent(out, &a0, &a1);
    view_extent(in, &b0, &b1);
    if (a0 < b1 && b0 < a1)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "%s overlaps %s in memory (outputs must not alias "
                         "inputs)",
                         oname, iname);
    return MHA_OK;
}

mha_status mha__check_output(const mha_tensor *t, const char *name, const mha_shape *want) {
    mha_status st = mha__check_float(t, name);
    if (st) return st;
    bool same = t->ndim == want->ndim;
    for (int i = 0; same && i < want->ndim; i++) same = t->shape[i] == want->dims[i];
    if (!same) {
        char a[160], b[160];
        return mha__fail(MHA_ERR_SHAPE, "%s: shape %s, expected %s", name,
                         mha__shape_str(a, sizeof a, t->ndim, t->shape),
                         mha__shape_str(b, sizeof b, want->ndim, want->dims));
    }
    return MHA_OK;
}

// The last dim of t (its features) must be `want`, the module's `what`.
mha_status mha__check_features(const mha_tensor *t, const char *name, const char *what,
                               int64_t want) {
    char s1[160];
    int64_t got = t->shape[t->ndim - 1];
    if (got == want) return MHA_OK;
    return mha__fail(MHA_ERR_SHAPE,
                     "%s: feature dim %lld (shape %s) does not match the "
                     "module's %s %lld",
                     name, (long long)got, mha__shape_str(s1, sizeof s1, t->ndim, t->shape),
                     what, (long long)want);
}
