// kvcache.c: the KV cache object for incremental decoding: its storage
// types (float32, bfloat16, float16, int8, int4: the rows' layout, the
// quantisation of a row), create, append, truncate, and the cache as a row
// source (mha__kv_rows) for the attention over it (kvattend.c).
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "kvcache.h"
#include "view.h"

// ---------------------------------------------------------------------------
// KV cache

struct mha_kv_cache {
    int64_t B, Hkv, D, Dv, cap;
    mha_kv_dtype dt;
    mha__kv_layout lk, lv;  // the K and V rows' layout
    void *k, *v;            // (B, Hkv, cap) rows of lk.rb and lv.rb bytes
    float *ks, *vs;         // int8 / int4: (B, Hkv, cap) rows of lk.ns, lv.ns scales
    int64_t *len;           // (B)
};

static const char *const kv_names[] = {"f32", "bf16", "f16", "int8", "int4"};

mha_status mha_kv_dtype_from_name(mha_kv_dtype *dtype, const char *name) {
    if (!dtype || !name) return mha__fail(MHA_ERR_INVALID_ARG, "kv dtype: NULL argument");
    for (int i = 0; i < 5; i++)
        if (strcmp(name, kv_names[i]) == 0) {
            *dtype = (mha_kv_dtype)i;
            return MHA_OK;
        }
    char e[64];
    return mha__fail(MHA_ERR_UNSUPPORTED, "kv dtype %s: expected f32, bf16, f16, int8 or int4",
                     mha_escape(e, sizeof e, name));
}

const char *mha_kv_dtype_name(mha_kv_dtype dtype) {
    return (int)dtype >= 0 && (int)dtype < 5 ? kv_names[dtype] : "unknown";
}

// int4 (MHA_KV_INT4): a row of n elements is cut into groups of 32 along
// the head dim (the last one shorter when 32 does not divide n); group g
// has the float32 scale s_g = max|x_c| / 7 over its elements (1 when they
// are all 0) and each element the 4-bit two's complement value
// q_c = clamp(nearbyint(x_c / s_g), -7, 7) (a NaN element, or any of a
// group holding an infinity, gives 0, as in int8), two per byte: element
// 2i in the low nibble of byte i, 2i + 1 in the high one. A row takes
// ceil(n / 2) bytes (odd n: the last byte's high nibble is 0, unused) and
// ceil(n / 32) scales; it reads back as x^_c = s_g q_c (rounded to
// float32), so |x_c - x^_c| <= s_g / 2 = max|group| / 14 (up to float32's
// rounding of x_c / s_g, a relative 2^-21 of s_g).
mha__kv_layout mha__kv_layout_of(mha_kv_dtype dt, int64_t n) {
    switch (dt) {
    case MHA_KV_F32: return (mha__kv_layout){4 * (size_t)n, 0, 0, n, 0};
    case MHA_KV_INT8: return (mha__kv_layout){(size_t)n, 0, 1, n, 1};
    case MHA_KV_INT4: {
        const int64_t ns = (n + 31) / 32;
        return (mha__kv_layout){(size_t)((n + 1) / 2), 0, ns, n + (n & 1), ns};
    }
    default: return (mha__kv_layout){2 * (size_t)n, 0, 0, n, 0};
    }
}

mha__kv_layout mha__kv_layout_in_rows(mha_kv_dtype dt, int64_t n) {
    mha__kv_layout l = mha__kv_layout_of(dt, n);
    if (!l.ns) return l;
    l.so = (l.rb + 3) & ~(size_t)3;
    l.rb = l.so + (size_t)l.ns * sizeof(float);
    l.lda = dt == MHA_KV_INT4 ? 2 * (int64_t)l.rb : (int64_t)l.rb;
    l.sld = (int64_t)(l.rb / sizeof(float));
    return l;
}

mha_status mha__kv_storage(const char *what, int64_t n0, int64_t n1, int64_t n2, int64_t D,
                           int64_t Dv, mha_kv_dtype dt, size_t *bk, size_t *bv, size_t *bks,
                           size_t *bvs) {
    if (dt != MHA_KV_F32 && dt != MHA_KV_BF16 && dt != MHA_KV_F16 && dt != MHA_KV_INT8 &&
        dt != MHA_KV_INT4)
        return mha__fail(MHA_ERR_INVALID_ARG, "%s: unknown storage type %d", what, (int)dt);
    int64_t rows, nk, nv;
    // (D, Dv < 2^62 so that a row's element count rounded up to even
    // cannot overflow; the bytes per row are at most 4 D)
    if (D > INT64_MAX / 8 || Dv > INT64_MAX / 8 || mha__mul_overflow_i64(n0, n1, &rows) ||
        mha__mul_overflow_i64(rows, n2, &rows) || mha__mul_overflow_i64(rows, Dv, &nv) ||
        mha__mul_overflow_i64(rows, D, &nk))
        return mha__fail(MHA_ERR_OVERFLOW, "%s: size overflows", what);
    const mha__kv_layout lk = mha__kv_layout_of(dt, D), lv = mha__kv_layout_of(dt, Dv);
    if (mha__mul_overflow_size((size_t)rows, lk.rb, bk) ||
        mha__mul_overflow_size((size_t)rows, lv.rb, bv) ||
        mha__mul_overflow_size((size_t)rows, (size_t)lk.ns * sizeof(float), bks) ||
        mha__mul_overflow_size((size_t)rows, (size_t)lv.ns * sizeof(float), bvs))
        return mha__fail(MHA_ERR_OVERFLOW, "%s: size overflows", what);
    return MHA_OK;
}

mha_status mha_kv_cache_create(mha_kv_cache **out, int64_t batch, int64_t num_kv_heads,
                               int64_t head_dim, int64_t v_head_dim, int64_t capacity,
                               mha_kv_dtype dtype) {
    if (!out) return mha__fail(MHA_ERR_INVALID_ARG, "mha_kv_cache_create: NULL out");
    *out = NULL;
    if (batch < 1 || num_kv_heads < 1 || head_dim < 1 || v_head_dim < 1 || capacity < 1)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "kv cache: batch %lld, num_kv_heads %lld, head_dim %lld, "
                         "v_head_dim %lld, capacity %lld must all be >= 1",
                         (long long)batch, (long long)num_kv_heads, (long long)head_dim,
                         (long long)v_head_dim, (long long)capacity);
    size_t bk, bv, bks, bvs;
    mha_status st = mha__kv_storage("kv cache", batch, num_kv_heads, capacity, head_dim,
                                    v_head_dim, dtype, &bk, &bv, &bks, &bvs);
    if (st) return st;
    mha_kv_cache *c = mha__calloc(1, sizeof *c);
    if (!c) return mha__fail(MHA_ERR_NOMEM, "kv cache: out of memory (%zu bytes)", sizeof *c);
    c->B = batch, c->Hkv = num_kv_heads, c->D = head_dim, c->Dv = v_head_dim, c->cap = capacity;
    c->dt = dtype;
    c->lk = mha__kv_layout_of(dtype, head_dim);
    c->lv = mha__kv_layout_of(dtype, v_head_dim);
    c->k = mha__alloc(bk);
    c->v = mha__alloc(bv);
    if (bks) {
        c->ks = mha__alloc(bks);
        c->vs = mha__alloc(bvs);
    }
    c->len = mha__calloc((size_t)batch, sizeof *c->len);
    if (!c->k || !c->v || !c->len || (bks && (!c->ks || !c->vs))) {
        mha_kv_cache_destroy(c);
        return mha__fail(MHA_ERR_NOMEM, "kv cache: out of memory for %zu bytes", bk + bv);
    }
    *out = c;
    return MHA_OK;
}

size_t mha_kv_cache_bytes(const mha_kv_cache *c) {
    if (!c) return 0;
    const size_t rows = (size_t)(c->B * c->Hkv * c->cap);
    return rows * (c->lk.rb + c->lv.rb + (size_t)(c->lk.ns + c->lv.ns) * sizeof(float));
}

// The symmetric scale of n values: max|x| / qmax (1 when all are 0; NaN
// values are skipped, an infinite one gives an infinite scale).
static float sym_scale(const float *x, int64_t n, float qmax) {
    float mx = 0.0f;
    for (int64_t e = 0; e < n; e++) mx = fabsf(x[e]) > mx ? fabsf(x[e]) : mx;
    return mx > 0.0f ? mx / qmax : 1.0f;
}

// x / sc rounded to the nearest integer in [-qmax, qmax] (NaN, from a NaN
// element or an infinite group's inf / inf, is stored as 0: converting
// NaN to an integer is undefined).
static int sym_quant(float x, float sc, float qmax) {
    const float qv = nearbyintf(x / sc);
    return (int)(qv > qmax ? qmax : qv < -qmax ? -qmax : isnan(qv) ? 0.0f : qv);
}

// Stores one row x (n floats, element stride xs, from a float32 or float64
// view) at dst in storage type dt (int8: its scale into scale[0]; int4:
// its group scales into scale[0 .. ceil(n / 32))); row: n floats of
// scratch.
void mha__kv_store_row(mha_kv_dtype dt, void *dst, float *scale, const void *x, mha_dtype xdt,
                       int64_t xs, int64_t n, float *row) {
    for (int64_t e = 0; e < n; e++)
        row[e] = (float)mha__ld(mha__vmat((void *)x, xdt, 0, xs), 0, e);
    switch (dt) {
    case MHA_KV_F32: memcpy(dst, row, sizeof(float) * (size_t)n); break;
    case MHA_KV_BF16:
        for (int64_t e = 0; e < n; e++) ((uint16_t *)dst)[e] = mha_f32_to_bf16(row[e]);
        break;
    case MHA_KV_F16:
        for (int64_t e = 0; e < n; e++) ((uint16_t *)dst)[e] = mha_f32_to_f16(row[e]);
        break;
    case MHA_KV_INT8: {  // symmetric, one scale per row: max|x| / 127
        const float sc = sym_scale(row, n, 127.0f);
        *scale = sc;
        for (int64_t e = 0; e < n; e++)
            ((int8_t *)dst)[e] = (int8_t)sym_quant(row[e], sc, 127.0f);
        break;
    }
    case MHA_KV_INT4: {  // symmetric, one scale per group of 32: max|group| / 7
        uint8_t *d = dst;
        memset(d, 0, ((size_t)n + 1) / 2);
        for (int64_t g = 0; g * 32 < n; g++) {
            const int64_t c0 = g * 32, w = n - c0 < 32 ? n - c0 : 32;
            const float sc = sym_scale(row + c0, w, 7.0f);
            scale[g] = sc;
            for (int64_t c = c0; c < c0 + w; c++) {  // two's complement nibbles
                const unsigned q = (unsigned)sym_quant(row[c], sc, 7.0f) & 15u;
                d[c / 2] |= (uint8_t)(c & 1 ? q << 4 : q);
            }
        }
        break;
    }
    }
}

// n rows of w elements at src (storage type dt, layout l, int8 / int4
// scales sc) as float32 into dst.
void mha__kv_rows_to_f32(const mha__kernels *kt, mha_kv_dtype dt, mha__kv_layout l,
                         const char *src, const float *sc, int64_t n, int64_t w, float *dst) {
    switch (dt) {
    case MHA_KV_F32: memcpy(dst, src, sizeof(float) * (size_t)(n * w)); break;
    case MHA_KV_BF16: kt->cvt_bf16(dst, (const uint16_t *)src, n * w); break;
    case MHA_KV_F16: kt->cvt_f16(dst, (const uint16_t *)src, n * w); break;
    case MHA_KV_INT8:
        for (int64_t j = 0; j < n; j++)
            kt->cvt_i8(dst + j * w, (const int8_t *)src + (size_t)j * l.rb, w, sc[j * l.sld]);
        break;
    case MHA_KV_INT4:
        for (int64_t j = 0; j < n; j++)
            kt->cvt_i4(dst + j * w, (const uint8_t *)src + (size_t)j * l.rb, w, sc + j * l.sld);
        break;
    }
}

// The contiguous cache as a row source: one segment of cap rows per
// (sequence, KV head).
static void cache_at(const void *ctx, int64_t b, int64_t hk, int64_t s, const char **k,
                     const char **v, const float **ks, const float **vs) {
    const mha_kv_cache *c = ctx;
    (void)s;
    const int64_t r0 = (b * c->Hkv + hk) * c->cap;
    *k = (const char *)c->k + (size_t)r0 * c->lk.rb;
    *v = (const char *)c->v + (size_t)r0 * c->lv.rb;
    *ks = c->ks ? c->ks + r0 * c->lk.ns : NULL;
    *vs = c->vs ? c->vs + r0 * c->lv.ns : NULL;
}

mha__kv_rows mha__kv_cache_rows(const mha_kv_cache *c) {
    return (mha__kv_rows){c->B,  c->Hkv, c->D, c->Dv,    c->cap, c->dt, c->lk,
                          c->lv, c->len, c,    cache_at, false,  false};
}

void mha_kv_cache_destroy(mha_kv_cache *c) {
    if (!c) return;
    mha__free(c->k);
    mha__free(c->v);
    mha__free(c->ks);
    mha__free(c->vs);
    free(c->len);
    free(c);
}

int64_t mha_kv_cache_length(const mha_kv_cache *c, int64_t b) {
    return c && b >= 0 && b < c->B ? c->len[b] : -1;
}

int64_t mha_kv_cache_capacity(const mha_kv_cache *c) { return c ? c->cap : -1; }

void mha__kv_cache_dims(const mha_kv_cache *c, int64_t *B, int64_t *Hkv, int64_t *D,
                        int64_t *Dv) {
    *B = c->B, *Hkv = c->Hkv, *D = c->D, *Dv = c->Dv;
}

static mha_status check_4(const mha_tensor *t, const char *name, int64_t d0, int64_t d1,
                          int64_t d3) {
    mha_status st = mha__check_float(t, name);
    if (st) return st;
    if (t->ndim != 4 || t->shape[0] != d0 || t->shape[1] != d1 || t->shape[3] != d3) {
        char s[160];
        return mha__fail(MHA_ERR_SHAPE, "%s: shape %s, expected (%lld, %lld, T, %lld)", name,
                         mha__shape_str(s, sizeof s, t->ndim, t->shape), (long long)d0,
                         (long long)d1, (long long)d3);
    }
    return MHA_OK;
}

// counts[b] (or T) for every b, checked against T.
mha_status mha__kv_check_counts(const int64_t *counts, int64_t B, int64_t T, const char *what) {
    if (!counts) return MHA_OK;
    for (int64_t b = 0; b < B; b++)
        if (counts[b] < 0 || counts[b] > T)
            return mha__fail(MHA_ERR_INVALID_ARG, "%s: counts[%lld] = %lld, expected 0..%lld",
                             what, (long long)b, (long long)counts[b], (long long)T);
    return MHA_OK;
}

mha_status mha_kv_cache_append(mha_kv_cache *c, const mha_tensor *k, const mha_tensor *v,
                               const int64_t *counts) {
    if (!c || !k || !v)
        return mha__fail(MHA_ERR_INVALID_ARG, "kv cache append: NULL argument");
    mha_status st;
    if ((st = check_4(k, "k", c->B, c->Hkv, c->D)) ||
        (st = check_4(v, "v", c->B, c->Hkv, c->Dv)))
        return st;
    const int64_t T = k->shape[2];
    if (v->shape[2] != T)
        return mha__fail(MHA_ERR_SHAPE, "kv cache append: k has %lld tokens, v %lld",
                         (long long)T, (long long)v->shape[2]);
    if ((st = mha__kv_check_counts(counts, c->B, T, "kv cache append"))) return st;
    for (int64_t b = 0; b < c->B; b++) {  // all checks before any change
        const int64_t n = counts ? counts[b] : T;
        if (c->len[b] + n > c->cap)
            return mha__fail(MHA_ERR_INVALID_ARG,
                             "kv cache full: sequence %lld holds %lld of %lld tokens, "
                             "%lld more do not fit",
                             (long long)b, (long long)c->len[b], (long long)c->cap,
                             (long long)n);
    }
    // a row's float32 copy: on the stack up to 4096 features, else on the
    // heap (allocated before anything changes)
    const int64_t wmax = c->D > c->Dv ? c->D : c->Dv;
    float buf[4096], *row = buf, *heap = NULL;
    if (wmax > 4096) {
        row = heap = mha__malloc(sizeof(float) * (size_t)wmax);
        if (!row)
            return mha__fail(MHA_ERR_NOMEM,
                             "kv cache append: out of memory for a row of %lld floats",
                             (long long)wmax);
    }
    for (int64_t b = 0; b < c->B; b++) {
        const int64_t n = counts ? counts[b] : T;
        for (int64_t h = 0; h < c->Hkv; h++)
            for (int64_t t = 0; t < n; t++) {
                const int64_t r = (b * c->Hkv + h) * c->cap + c->len[b] + t;
                const int64_t ko = b * k->stride[0] + h * k->stride[1] + t * k->stride[2];
                const int64_t vo = b * v->stride[0] + h * v->stride[1] + t * v->stride[2];
                mha__kv_store_row(c->dt, (char *)c->k + (size_t)r * c->lk.rb,
                                  c->ks ? c->ks + r * c->lk.ns : NULL,
                                  (const char *)k->data + ko * (int64_t)mha_dtype_size(k->dtype),
                                  k->dtype, k->stride[3], c->D, row);
                mha__kv_store_row(c->dt, (char *)c->v + (size_t)r * c->lv.rb,
                                  c->vs ? c->vs + r * c->lv.ns : NULL,
                                  (const char *)v->data + vo * (int64_t)mha_dtype_size(v->dtype),
                                  v->dtype, v->stride[3], c->Dv, row);
            }
        c->len[b] += n;
    }
    free(heap);
    return MHA_OK;
}

mha_status mha_kv_cache_truncate(mha_kv_cache *c, int64_t b, int64_t length) {
    if (!c) return mha__fail(MHA_ERR_INVALID_ARG, "kv cache truncate: NULL cache");
    if (b < -1 || b >= c->B)
        return mha__fail(MHA_ERR_INVALID_ARG, "kv cache truncate: sequence %lld of %lld",
                         (long long)b, (long long)c->B);
    for (int64_t i = b < 0 ? 0 : b; i < (b < 0 ? c->B : b + 1); i++)
        if (length < 0 || length > c->len[i])
            return mha__fail(MHA_ERR_INVALID_ARG,
                             "kv cache truncate: length %lld, sequence %lld holds %lld",
                             (long long)length, (long long)i, (long long)c->len[i]);
    for (int64_t i = b < 0 ? 0 : b; i < (b < 0 ? c->B : b + 1); i++) c->len[i] = length;
    return MHA_OK;
}
