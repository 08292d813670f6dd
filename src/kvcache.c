// kvcache.c: the KV cache for incremental decoding (create, append,
// truncate; float32, bfloat16, float16, int8 or int4 storage) and the attention
// of new queries over it:
//  - decode (at most MHA__DECODE_MAX_T queries per sequence): split-KV. The
//    keys of each sequence are cut into fixed chunks (decode_chunk: by the
//    bytes of a key row);
//    each (b, KV head, chunk) item reads its K and V rows from memory once
//    for all the queries of the group (query heads x new tokens: the group
//    kernels, rows in their storage type converted in registers), keeping
//    per query the chunk's max m, sum l and unnormalised output; the chunks
//    are then combined in chunk order. The chunking depends on the lengths
//    and the rows' layout only, so the bits do not depend on the number of
//    threads.
//  - longer chunks (prefill): the flash kernel per (b, h, tile of queries)
//    with the queries' positions offset by len_b - T_b.
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "flash.h"
#include "rope.h"
#include "kvcache.h"

#define MHA__DECODE_MAX_T 16
// Decode's split-KV chunk (rows per (b, KV head, chunk) item): as many
// rows as fill DECODE_CHUNK_BYTES of K (1024 float32 rows of head dim 64,
// 2048 of bf16, 8192 of int4), a power of two in [DECODE_CHUNK_MIN,
// DECODE_CHUNK_MAX]. A chunk's rows stream from memory one after the
// other; the kernels' look-ahead starts cold at each chunk, so a chunk
// of few bytes (a narrow type's 512 rows) spends much of its time on
// that start (measured on the Zen 4, 256k tokens, against 512-row
// chunks: bf16 1.2x, int4 1.5x faster).
#define DECODE_CHUNK_BYTES 262144
#define DECODE_CHUNK_MIN 512
#define DECODE_CHUNK_MAX 8192

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
static void rows_to_f32(const mha__kernels *kt, mha_kv_dtype dt, mha__kv_layout l,
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

static mha__kv_rows cache_rows(const mha_kv_cache *c) {
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
static mha_status check_counts(const int64_t *counts, int64_t B, int64_t T, const char *what) {
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
    if ((st = check_counts(counts, c->B, T, "kv cache append"))) return st;
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

void mha_cache_attend_args_init(mha_cache_attend_args *a) {
    if (!a) return;
    memset(a, 0, sizeof *a);
    a->opts.window_left = a->opts.window_right = -1;
}

mha_status mha_kv_cache_attend(mha_tensor *out, const mha_tensor *q, const mha_kv_cache *c,
                               const mha_cache_attend_args *args, const int64_t *counts) {
    const mha_status st = mha__kv_cache_attend_ex(out, q, c, args, counts, 0, NULL);
    if (!st) mha__set_impl(true, mha_isa(), false);
    return st;
}

// What the phases of a cache attention share (attend_check fills it).
typedef struct attend_call {
    const mha__kv_rows *c;
    const mha__kernels *kt;
    mha_cache_attend_args a;
    const mha_tensor *q, *out;
    const float *qd;
    float *o, *stats;
    const int64_t *counts;
    int64_t B, H, T, G, D, Dv, maxlen, q_shift;
    double scale;
    int nt;
    float slopes[MHA__ALIBI_MAX_DEFAULT];  // the paper's ALiBi slopes when asked for
} attend_call;

// Checks a cache attention's arguments (once) and fills ac.
static mha_status attend_check(attend_call *ac, mha_tensor *out, const mha_tensor *q,
                               const mha__kv_rows *c, const mha_cache_attend_args *args,
                               const int64_t *counts, int64_t q_shift, float *stats) {
    if (!out || !q || !c)
        return mha__fail(MHA_ERR_INVALID_ARG, "kv cache attend: NULL argument");
    mha_cache_attend_args a;
    if (args) a = *args;
    else mha_cache_attend_args_init(&a);
    mha_status st = mha__check_attn_opts("kv cache attend", &a.opts, MHA__REFUSE_DROPOUT);
    if (st) return st;
    if ((st = mha__check_float(q, "q"))) return st;
    const int64_t B = c->B, D = c->D, Dv = c->Dv;
    if (a.opts.sink_tokens > 0 && a.opts.window_left >= 0 &&
        (q_shift != 0 || a.opts.window_right >= 0))
        return mha__fail(MHA_ERR_UNSUPPORTED,
                         "kv cache attend: sink_tokens (StreamingLLM) with %s",
                         q_shift ? "a sharded cache" : "window_right >= 0");
    if (q->ndim != 4 || q->shape[0] != B || q->shape[3] != D || q->shape[1] < 1 ||
        q->shape[1] % c->Hkv != 0) {
        char s[160];
        return mha__fail(MHA_ERR_SHAPE,
                         "kv cache attend: q %s, expected (%lld, H, T, %lld) with H a "
                         "multiple of the cache's %lld KV heads",
                         mha__shape_str(s, sizeof s, q->ndim, q->shape), (long long)B,
                         (long long)D, (long long)c->Hkv);
    }
    const int64_t H = q->shape[1], T = q->shape[2], G = H / c->Hkv;
    const float *slopes;  // (checked here; set in ac below)
    if ((st = mha__attn_logit_params(&slopes, ac->slopes, &a.opts, H, "kv cache attend")))
        return st;
    const mha_shape os = {4, {B, H, T, Dv}};
    if ((st = mha__check_output(out, "out", &os))) return st;
    if ((st = mha__check_no_overlap(out, "out", q, "q"))) return st;
    if (q->dtype != MHA_F32 || out->dtype != MHA_F32)
        return mha__fail(MHA_ERR_DTYPE, "kv cache attend: q and out must be F32, got %s and %s",
                         mha_dtype_name(q->dtype), mha_dtype_name(out->dtype));
    if (q->stride[3] != 1 || out->stride[3] != 1)
        return mha__fail(MHA_ERR_UNSUPPORTED,
                         "kv cache attend: q and out must have unit stride along the head dim, "
                         "got %lld and %lld",
                         (long long)q->stride[3], (long long)out->stride[3]);
    if ((st = check_counts(counts, B, T, "kv cache attend"))) return st;
    const mha_tensor *sq = a.opts.sink_tokens > 0 && a.opts.window_left >= 0 ? a.sink_q : NULL;
    if (sq) {
        if ((st = mha__check_float(sq, "sink_q"))) return st;
        if (sq->ndim != 4 || sq->shape[0] != B || sq->shape[1] != H || sq->shape[2] != T ||
            sq->shape[3] != D || sq->dtype != MHA_F32 || sq->stride[3] != 1) {
            char s1[160], s2[160];
            return mha__fail(MHA_ERR_SHAPE,
                             "kv cache attend: sink_q %s, expected q's shape %s (F32, unit "
                             "stride along the head dim)",
                             mha__shape_str(s1, sizeof s1, sq->ndim, sq->shape),
                             mha__shape_str(s2, sizeof s2, q->ndim, q->shape));
        }
    }
    for (int64_t b = 0; b < B && q_shift == 0; b++)
        if ((counts ? counts[b] : T) > c->len[b])
            return mha__fail(MHA_ERR_INVALID_ARG,
                             "kv cache attend: sequence %lld has %lld queries but only %lld "
                             "cached tokens (append the chunk's keys first)",
                             (long long)b, (long long)(counts ? counts[b] : T),
                             (long long)c->len[b]);
    const double scale = a.opts.scale != 0.0 ? a.opts.scale : 1.0 / sqrt((double)D);
    const mha__kernels *kt = mha__kernels_get();
    float *o = out->data;
    const float *qd = q->data;
    for (int64_t i = 0; stats && i < B * H * T; i++)
        stats[2 * i] = -INFINITY, stats[2 * i + 1] = 0.0f;
    // rows t >= counts[b] get 0
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t t = counts ? counts[b] : T; t < T; t++)
                for (int64_t e = 0; e < Dv; e++)
                    o[b * out->stride[0] + h * out->stride[1] + t * out->stride[2] + e] = 0.0f;
    int64_t maxlen = 0;
    for (int64_t b = 0; b < B; b++) maxlen = c->len[b] > maxlen ? c->len[b] : maxlen;
    const double work = (double)B * H * T * (double)maxlen * (double)(D + Dv);
    const int nt = work < MHA__PAR_MIN_WORK ? 1 : mha__max_threads();

    *ac = (attend_call){.c = c,
                        .kt = kt,
                        .a = a,
                        .q = q,
                        .out = out,
                        .qd = qd,
                        .o = o,
                        .stats = stats,
                        .counts = counts,
                        .B = B,
                        .H = H,
                        .T = T,
                        .G = G,
                        .D = D,
                        .Dv = Dv,
                        .maxlen = maxlen,
                        .q_shift = q_shift,
                        .scale = scale,
                        .nt = nt};
    // (last: the slopes may point into ac; checked above)
    return mha__attn_logit_params(&ac->a.opts.alibi_slopes, ac->slopes, &a.opts, H,
                                  "kv cache attend");
}

// A prefill chunk (more than MHA__DECODE_MAX_T queries): flash tiles per
// (b, h, tile of queries), the queries' positions offset by len_b - T_b.
static mha_status attend_prefill(const attend_call *ac) {
    const mha__kv_rows *c = ac->c;
    const mha__kernels *kt = ac->kt;
    const mha_cache_attend_args a = ac->a;
    const mha_tensor *q = ac->q, *out = ac->out;
    const float *qd = ac->qd;
    float *o = ac->o, *stats = ac->stats;
    const int64_t *counts = ac->counts;
    const int64_t B = ac->B, H = ac->H, T = ac->T, G = ac->G, D = ac->D, Dv = ac->Dv,
                  maxlen = ac->maxlen, q_shift = ac->q_shift;
    const double scale = ac->scale;
    const int nt = ac->nt;
    const size_t sf = mha__flash_scratch_floats(D, Dv, maxlen, 0, false);
    // a reduced-precision cache, or one in more than one segment, is
    // converted into float32 rows first (the rows in use); else the flash
    // tiles read the cache's rows where they are
    const bool direct = c->dt == MHA_KV_F32 && maxlen <= c->seg;
    const size_t nkv = direct ? 0 : (size_t)(B * c->Hkv * maxlen * (D + Dv));
    size_t bytes;
    if (mha__mul_overflow_size(sf * sizeof(float), (size_t)nt, &bytes) ||
        mha__add_overflow_size(bytes, nkv * sizeof(float), &bytes))
        return mha__fail(MHA_ERR_OVERFLOW, "kv cache attend: scratch overflows");
    float *blk = mha__alloc(bytes);
    if (!blk)
        return mha__fail(MHA_ERR_NOMEM, "kv cache attend: out of memory for %zu bytes", bytes);
    float *kf = blk + sf * (size_t)nt, *vf = kf + (size_t)(B * c->Hkv * maxlen * D);
    if (nkv) {
#pragma omp parallel for schedule(static) num_threads(nt)
        for (int64_t bh = 0; bh < B * c->Hkv; bh++) {
            const int64_t n = c->len[bh / c->Hkv];
            float *kd = kf + bh * maxlen * D, *vd = vf + bh * maxlen * Dv;
            for (int64_t j = 0; j < n; j += c->seg) {  // segment by segment
                const char *k, *v;
                const float *ks, *vs;
                c->at(c->ctx, bh / c->Hkv, bh % c->Hkv, j / c->seg, &k, &v, &ks, &vs);
                const int64_t w = n - j < c->seg ? n - j : c->seg;
                if (!k) {  // a released segment (no query sees it): zeros
                    memset(kd + j * D, 0, sizeof(float) * (size_t)(w * D));
                    memset(vd + j * Dv, 0, sizeof(float) * (size_t)(w * Dv));
                    continue;
                }
                rows_to_f32(kt, c->dt, c->lk, k, ks, w, D, kd + j * D);
                rows_to_f32(kt, c->dt, c->lv, v, vs, w, Dv, vd + j * Dv);
            }
        }
    }
    for (int t = 0; t < nt; t++) mha__flash_scratch_reset(blk + (size_t)t * sf);
    const int64_t tiles = (T + MHA__FLASH_BR - 1) / MHA__FLASH_BR;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (int64_t it = 0; it < B * H * tiles; it++) {
        const int64_t bh = it / tiles, tile = it % tiles, b = bh / H, h = bh % H;
        const int64_t Tb = counts ? counts[b] : T, i0 = tile * MHA__FLASH_BR;
        if (i0 >= Tb) continue;
        mha__mask mk;
        memset(&mk, 0, sizeof mk);
        mk.causal = true;
        mk.win_left = a.opts.window_left;
        mk.win_right = a.opts.window_right;
        mk.q_off = c->len[b] - Tb + q_shift;
        mk.s_masked = c->len[b];
        mk.alibi = a.opts.alibi_slopes;
        mk.softcap = a.opts.softcap;
        mk.sinks = a.opts.sinks;
        const int64_t hk = h / G;
        const char *kc = NULL, *vc = NULL;
        const float *ks, *vs;
        if (direct) c->at(c->ctx, b, hk, 0, &kc, &vc, &ks, &vs);
        mha__flash_head fh = {
            .q = qd + b * q->stride[0] + h * q->stride[1],
            .q_rs = q->stride[2],
            .k = nkv ? kf + (b * c->Hkv + hk) * maxlen * D : (const float *)(const void *)kc,
            .k_rs = D,
            .v = nkv ? vf + (b * c->Hkv + hk) * maxlen * Dv : (const float *)(const void *)vc,
            .v_rs = Dv,
            .o = o + b * out->stride[0] + h * out->stride[1],
            .o_rs = out->stride[2],
            .L = Tb,
            .S = c->len[b],
            .D = D,
            .Dv = Dv,
            .scale = (float)scale,
            .mask = &mk,
            .b = b,
            .h = h,
            .stats = stats ? stats + 2 * bh * T : NULL,
        };
        mha__flash_rows(kt, &fh, i0, mha__tile_end(i0, MHA__FLASH_BR, Tb),
                        blk + (size_t)mha__thread_id() * sf);
    }
    mha__free(blk);
    return MHA_OK;
}

// The chunks' partials combined in chunk order: O = sum_c e^(m_c - M) o_c /
// (sum_c e^(m_c - M) l_c [+ e^(sink - M)]) (and each row's max and 1/sum
// into stats); an attention sink joins the max M and the denominator once.
// acc: Dv doubles of scratch per thread (each chunk's weight exp(m - M)
// computed once for the row, then its output added to every column's sum,
// chunk after chunk in order).
static void attend_combine(const attend_call *ac, const float *part, int64_t nch, size_t per,
                           double *acc) {
    const int64_t B = ac->B, H = ac->H, T = ac->T, Dv = ac->Dv;
    const int64_t *counts = ac->counts;
    const mha_tensor *out = ac->out;
    float *o = ac->o, *stats = ac->stats;
    const int nt = ac->nt;
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t bh = 0; bh < B * H; bh++) {
        const int64_t b = bh / H, h = bh % H, Tb = counts ? counts[b] : T;
        const double sink = ac->a.opts.sinks ? (double)ac->a.opts.sinks[h] : -INFINITY;
        for (int64_t t = 0; t < Tb; t++) {
            float *orow = o + b * out->stride[0] + h * out->stride[1] + t * out->stride[2];
            double M = -INFINITY;
            for (int64_t ch = 0; ch < nch; ch++) {
                const float *pp = part + ((size_t)((bh * nch + ch) * T + t)) * per;
                if (pp[1] > 0.0f && pp[0] > M) M = pp[0];
            }
            if (sink > M) M = sink;
            for (int64_t e = 0; e < Dv; e++) orow[e] = 0.0f;
            if (M == -INFINITY) continue;  // nothing visible: 0
            double L = sink > -INFINITY ? exp(sink - M) : 0.0;
            double *a = acc + (size_t)mha__thread_id() * (size_t)Dv;
            for (int64_t e = 0; e < Dv; e++) a[e] = 0.0;
            for (int64_t ch = 0; ch < nch; ch++) {
                const float *pp = part + ((size_t)((bh * nch + ch) * T + t)) * per;
                if (!(pp[1] > 0.0f)) continue;
                const double w = exp(pp[0] - M);
                L += w * pp[1];
                for (int64_t e = 0; e < Dv; e++) a[e] += w * pp[2 + e];
            }
            for (int64_t e = 0; e < Dv; e++) orow[e] = (float)(a[e] / L);
            if (stats)
                stats[2 * (bh * T + t)] = (float)M,
                                    stats[2 * (bh * T + t) + 1] = (float)(1.0 / L);
        }
    }
}

// One query (head h, at position p) of a group against a chunk: its visible
// keys [lo, hi) and its partial (m, l, O).
typedef struct dec_query {
    int64_t h, p, lo, hi;
    float *pp;
} dec_query;

// Where a segment's rows are (mha__kv_rows.at): its first K and V rows and
// their int8 / int4 scales (all NULL: released).
typedef struct dec_seg {
    const char *k, *v;
    const float *ks, *vs;
} dec_seg;

// A chunk's rows (those of sequence b, KV head hk, from the chunk's first
// key j0, in the source's segments: those from segment s0 on, looked up
// once, in seg) and the thread's per-query floats: qf per query, scores
// (indexed from j0), scaled query, unnormalised output.
typedef struct dec_chunk {
    const mha__kernels *kt;
    const mha__kv_rows *c;
    int64_t b, hk, j0, s0, ch;
    int kind;
    float *sc;
    size_t qf;
    const dec_seg *seg;
    // int8 rows scored against the queries' int8 forms (dot_rows_i8): each
    // query's bytes xi floats on from its scaled query, its scale ldxi / 4
    // floats after them (0: the float32 scores, dot_rows_q)
    int64_t xi, ldxi;
} dec_chunk;

// The int8 query xq (D bytes, D a multiple of 128) in dot_rows_i4's
// order: per 128 elements the even ones, then the odd ones.
static void split_i4(int8_t *xq, int64_t D) {
    int8_t t[128];
    for (int64_t s = 0; s < D; s += 128) {
        memcpy(t, xq + s, sizeof t);
        for (int64_t e = 0; e < 128; e++) xq[s + (e % 2) * 64 + e / 2] = t[e];
    }
}

// The int8 form of the scaled query x (D floats) that dot_rows_i8 takes
// (mha.h's int8 cache): *xs = max_c |x_c| / 127 and xq_c = x_c * (127 /
// max_c |x_c|) rounded to nearest even (|xq_c| <= 127), the bytes from D
// to ldx zero; all zero (and xs 0) for a zero query; xs NaN (so its scores
// NaN) when x holds a NaN or an infinity.
static void quantize_i8(int8_t *xq, float *xs, const float *x, int64_t D, int64_t ldx) {
    float mx = 0.0f;
    bool finite = true;
    for (int64_t c = 0; c < D; c++) {
        const float a = fabsf(x[c]);
        finite = finite && a <= FLT_MAX;
        mx = a > mx ? a : mx;
    }
    memset(xq, 0, (size_t)ldx);
    if (!finite) {
        *xs = NAN;
        return;
    }
    *xs = mx / 127.0f;
    if (mx == 0.0f) return;
    const float inv = 127.0f / mx;
    for (int64_t c = 0; c < D; c++) xq[c] = (int8_t)nearbyintf(x[c] * inv);
}

// Row i of segment g: where its K and V rows (and int8 / int4 scales;
// else NULL) are.
static void seg_rows(const mha__kv_rows *c, const dec_seg *g, int64_t i, const char **k,
                     const char **v, const float **ks, const float **vs) {
    *k = g->k + (size_t)i * c->lk.rb;
    *v = g->v + (size_t)i * c->lv.rb;
    *ks = g->ks ? g->ks + i * c->lk.sld : NULL;
    *vs = g->vs ? g->vs + i * c->lv.sld : NULL;
}

// The piece of rows [r, hi) that lies in one run of memory (r's segment,
// and the segments after it that follow it in memory: a paged cache's
// blocks taken in order): its end (returned) and where row r's K, V (and
// int8 / int4 scales) are.
static int64_t piece(const dec_chunk *dc, int64_t r, int64_t hi, const char **k,
                     const char **v, const float **ks, const float **vs) {
    const mha__kv_rows *c = dc->c;
    const int64_t s = r / c->seg;
    const dec_seg *g = &dc->seg[s - dc->s0];
    seg_rows(c, g, r - s * c->seg, k, v, ks, vs);
    int64_t end = (s + 1) * c->seg;
    const size_t kb = (size_t)c->seg * c->lk.rb, vb = (size_t)c->seg * c->lv.rb;
    for (const dec_seg *e = g + 1; end < hi && g->k && e->k == g->k + kb && e->v == g->v + vb &&
                                   (!g->ks || (e->ks == g->ks + c->seg * c->lk.sld &&
                                               e->vs == g->vs + c->seg * c->lv.sld));
         g = e++)
        end += c->seg;
    return end < hi ? end : hi;
}

// Decode over a cache in segments (a paged cache's blocks): the rows after
// a piece lie apart, so neither the kernels' look-ahead (within a call) nor
// the hardware's (within a page) reaches them. While the piece in segment s
// is read, the kernel fetches segment s + near (the one DEC_NEAR bytes
// ahead: the pf argument, spread over the call) and the driver touches the
// first lines of segment s + far (DEC_FAR bytes ahead, into L2: the
// hardware's streamer then brings the rest of its page); the first piece
// of a range fetches those in between at once. Measured on the Xeon, a
// 256k-token decode over 16-token blocks scattered over the pool: 1.6x
// faster than a window of plain prefetches ahead of each piece.
#define DEC_NEAR 12288
#define DEC_FAR 65536
#define DEC_FAR_LINES 2

// Rows of segment s in [.., hi): where its K (isk) or V rows start and
// their bytes (0: none, or released).
static size_t seg_bytes(const dec_chunk *dc, int64_t s, int64_t hi, bool isk, const char **p) {
    const mha__kv_rows *c = dc->c;
    const int64_t r = s * c->seg, e = (s + 1) * c->seg < hi ? (s + 1) * c->seg : hi;
    if (r >= hi) return 0;
    const dec_seg *g = &dc->seg[s - dc->s0];
    *p = isk ? g->k : g->v;
    return *p ? (size_t)(e - r) * (isk ? c->lk.rb : c->lv.rb) : 0;
}

static void touch(const char *p, size_t bytes, int lines) {
#if defined(__GNUC__) || defined(__clang__)
    for (size_t b = 0; b < bytes && (lines < 0 || b < (size_t)lines * 64); b += 64) {
        if (lines < 0) __builtin_prefetch(p + b, 0, 3);
        else __builtin_prefetch(p + b, 0, 1);
    }
#else
    (void)p, (void)bytes, (void)lines;
#endif
}

// Before the piece [p0, p1) of the range [.., hi) is read: the segments
// ahead (above), counted from the piece's last, as many new ones near and
// far as the piece has segments (a piece of several segments moves the
// look-ahead on by as many); *pf, *pfb: the one for the kernel to fetch
// while it runs (NULL, 0: the range's last piece).
static void prefetch_ahead(const dec_chunk *dc, int64_t p0, int64_t p1, int64_t hi, bool isk,
                           bool first, const void **pf, size_t *pfb) {
    const mha__kv_rows *c = dc->c;
    *pf = NULL, *pfb = 0;
    if (p1 >= hi) return;  // the range's last piece
    const size_t sb = (size_t)c->seg * (isk ? c->lk.rb : c->lv.rb);
    const int64_t kn = (int64_t)((DEC_NEAR + sb - 1) / sb),
                  kf = (int64_t)((DEC_FAR + sb - 1) / sb);
    // (p1 starts a segment: the piece ends at one; m: its segments before
    // its last)
    const int64_t s = p1 / c->seg - 1, m = s - p0 / c->seg;
    const char *p = NULL;
    // (the first piece: all of them; then the new far ones, and the new
    // near ones before the kernel's, the pieces' kernels having fetched one
    // each)
    for (int64_t i = first ? 1 : kf - m > kn ? kf - m : kn; i <= kf; i++) {
        const size_t n = seg_bytes(dc, s + i, hi, isk, &p);
        if (!n) break;
        if (i < kn) touch(p, n, -1);
        else if (i > kn || kn == kf) touch(p, n, DEC_FAR_LINES);
    }
    for (int64_t i = kn - m > 1 ? kn - m : 1; !first && i < kn; i++) {
        const size_t n = seg_bytes(dc, s + i, hi, isk, &p);
        if (!n) break;
        touch(p, n, -1);
    }
    // (at most DEC_NEAR bytes of it: a segment larger than that is left to
    // the kernel's own look-ahead after its first DEC_NEAR bytes, as a
    // contiguous cache's rows are; a whole 48 KiB block fetched into L1
    // while the kernel reads one was 13% slower at 192 tokens a block)
    if ((*pfb = seg_bytes(dc, s + kn, hi, isk, &p))) *pf = p;
    if (*pfb > DEC_NEAR) *pfb = DEC_NEAR;
    // (int8 / int4: the scales of the segments up to the kernel's, which
    // fetches rows only: the first piece those from the next on, then each
    // piece the new ones; none when they lie in the rows)
    const int64_t ns = (isk ? c->lk.so : c->lv.so) ? 0 : isk ? c->lk.ns : c->lv.ns;
    for (int64_t i = first ? 1 : kn - m; ns && i <= kn; i++) {
        const int64_t e = (s + i + 1) * c->seg < hi ? (s + i + 1) * c->seg : hi;
        if (!seg_bytes(dc, s + i, hi, isk, &p)) break;
        const dec_seg *g = &dc->seg[s + i - dc->s0];
        touch((const char *)(isk ? g->ks : g->vs), (size_t)((e - (s + i) * c->seg) * ns) * 4,
              -1);
    }
}

// The look-ahead of a heads-together read (attend_decode): the rows for
// the next kernel call to fetch while it runs (the first call takes them;
// NULL: none).
typedef struct dec_ahead {
    const void *pf;
    size_t pfb;
} dec_ahead;

// The look-ahead for the piece [r, p1) of the range [r0, r1): the caller's
// (ah non-NULL: its rows for the first call, then none), else the piece's
// own (prefetch_ahead).
static void look_ahead(const dec_chunk *dc, int64_t r0, int64_t r, int64_t p1, int64_t r1,
                       bool isk, dec_ahead *ah, const void **pf, size_t *pfb) {
    if (!ah) {
        prefetch_ahead(dc, r, p1, r1, isk, r == r0, pf, pfb);
        return;
    }
    *pf = ah->pf, *pfb = ah->pfb;
    ah->pf = NULL, ah->pfb = 0;
}

// The integer scores (dc->xi: int8 rows, or int4 ones of a head dim a
// multiple of 128) of the n rows at k (scales ks) into s, for the ng
// queries whose rows of dc->qf floats start at the scores row sr.
static void int_scores(const dec_chunk *dc, float *s, const float *sr, int64_t ng, int64_t n,
                       const char *k, const float *ks, const void *pf, size_t pfb) {
    const mha__kv_rows *c = dc->c;
    const int64_t qf = (int64_t)dc->qf;
    const float *x = sr + dc->ch + dc->xi;
    const int8_t *xq = (const int8_t *)(const void *)x;
    const float *xs = x + dc->ldxi / 4;
    if (dc->kind == MHA_KV_INT4)
        dc->kt->dot_rows_i4(s, qf, (const uint8_t *)k, c->lk.lda / 2, ks, c->lk.sld, xq,
                            4 * qf, xs, qf, ng, n, c->D, pf, pfb);
    else
        dc->kt->dot_rows_i8(s, qf, (const int8_t *)k, c->lk.lda, ks, c->lk.sld, xq, 4 * qf, xs,
                            qf, ng, n, c->D, pf, pfb);
}

// The n rows from row r at k (K, with their scales ks) or vr (V, vs) for
// query v alone, in one kernel call: its scores (isk), else O += P V.
static void rows_alone(const dec_chunk *dc, int64_t v, int64_t r, int64_t n, const char *k,
                       const char *vr, const float *ks, const float *vs, bool isk,
                       const void *pf, size_t pfb) {
    const mha__kv_rows *c = dc->c;
    float *s = dc->sc + (size_t)v * dc->qf, *x = s + dc->ch, *o = x + c->D;
    if (isk && dc->xi) int_scores(dc, s + (r - dc->j0), s, 1, n, k, ks, pf, pfb);
    else if (isk)
        dc->kt->dot_rows_q(s + (r - dc->j0), k, c->lk.lda, dc->kind, ks, c->lk.sld, x, n, c->D,
                           pf, pfb);
    else
        dc->kt->axpy_rows_q(o, s + (r - dc->j0), vr, c->lv.lda, dc->kind, vs, c->lv.sld, n,
                            c->Dv, pf, pfb);
}

// Rows [r, r1) for query v alone: its scores (isk), else O += P V.
static void alone(const dec_chunk *dc, int64_t v, int64_t r, int64_t r1, bool isk,
                  dec_ahead *ah) {
    for (int64_t p1, r0 = r; r < r1; r = p1) {
        const char *k, *vr;
        const float *ks, *vs;
        const void *pf;
        size_t pfb;
        p1 = piece(dc, r, r1, &k, &vr, &ks, &vs);
        look_ahead(dc, r0, r, p1, r1, isk, ah, &pf, &pfb);
        rows_alone(dc, v, r, p1 - r, k, vr, ks, vs, isk, pf, pfb);
    }
}

// Rows [r, r1) for all nv queries (their keys in common): the scores (isk),
// else O += P V.
static void shared_rows(const dec_chunk *dc, int64_t nv, int64_t r, int64_t r1, bool isk,
                        dec_ahead *ah) {
    const int64_t D = dc->c->D, Dv = dc->c->Dv, qf = (int64_t)dc->qf;
    float *sc = dc->sc;
    for (int64_t p1, r0 = r; r < r1; r = p1) {
        const char *k, *vr;
        const float *ks, *vs;
        const void *pf;
        size_t pfb;
        p1 = piece(dc, r, r1, &k, &vr, &ks, &vs);
        look_ahead(dc, r0, r, p1, r1, isk, ah, &pf, &pfb);
        if (isk && dc->xi) int_scores(dc, sc + (r - dc->j0), sc, nv, p1 - r, k, ks, pf, pfb);
        else if (isk)
            dc->kt->dot_rows_qg(sc + (r - dc->j0), qf, k, dc->c->lk.lda, dc->kind, ks,
                                dc->c->lk.sld, sc + dc->ch, qf, nv, p1 - r, D, pf, pfb);
        else
            dc->kt->axpy_rows_qg(sc + dc->ch + D, qf, sc + (r - dc->j0), qf, vr, dc->c->lv.lda,
                                 dc->kind, vs, dc->c->lv.sld, nv, p1 - r, Dv, pf, pfb);
    }
}

// One sequence's rows from js on, those in [r, r1), for its un queries uq
// (their scores and outputs at dc): the keys all of them see for all of
// them (the group kernels), each query's others alone. Taken range by
// range in order, every query's rows stay in order (the bits of one range).
static void unit_rows(const dec_chunk *dc, const dec_query *uq, int64_t un, int64_t js,
                      int64_t r, int64_t r1, bool isk, dec_ahead *ah) {
    int64_t clo = js, chi = INT64_MAX;
    for (int64_t v = 0; v < un; v++) {
        const int64_t lo = uq[v].lo > js ? uq[v].lo : js;
        clo = lo > clo ? lo : clo;
        chi = uq[v].hi < chi ? uq[v].hi : chi;
    }
    // (one query, or none shared: each query alone)
    const bool shared = un > 1 && chi > clo;
    for (int64_t v = 0; v < un; v++) {
        const int64_t lo = uq[v].lo > js ? uq[v].lo : js, hi = shared ? clo : uq[v].hi;
        alone(dc, v, lo > r ? lo : r, hi < r1 ? hi : r1, isk, ah);
    }
    if (shared) shared_rows(dc, un, clo > r ? clo : r, chi < r1 ? chi : r1, isk, ah);
    for (int64_t v = 0; shared && v < un; v++)
        alone(dc, v, chi > r ? chi : r, uq[v].hi < r1 ? uq[v].hi : r1, isk, ah);
}

// The rows from js on of an item's nu units: KV heads of one sequence (the
// same chunk, their pieces of a segment side by side in memory), segment
// by segment and, in each, head by head: one run of memory a segment, where
// a head's piece alone is a few KiB at a random place (units with no query
// here skipped). The pieces in the order read, each kernel call fetches
// the piece kn on (DEC_NEAR bytes ahead) while it runs and touches the
// first lines of the one kf on (DEC_FAR; into L2: the hardware's streamer
// brings the rest of its page); the first kn are fetched at once. A head
// with one query calls its kernel on the segment's rows directly (no
// division on the way: a step over 16-token blocks makes hundreds of
// thousands of calls).
static void heads_rows(const dec_chunk *dcs, const dec_query *qs, const int64_t *v0s,
                       int64_t nu, int64_t js, bool isk) {
    const dec_chunk *d0 = &dcs[0];
    const mha__kv_rows *c = d0->c;
    const int64_t seg = c->seg, n = c->len[d0->b];
    const int64_t j1 = d0->j0 + d0->ch < n ? d0->j0 + d0->ch : n, s1 = (j1 - 1) / seg;
    const size_t sb = (size_t)seg * (isk ? c->lk.rb : c->lv.rb);
    const int64_t kn = (int64_t)((DEC_NEAR + sb - 1) / sb),
                  kf = (int64_t)((DEC_FAR + sb - 1) / sb);
    const char *p;
    // (a piece: unit u of segment g; (gn, unx) and (gf, uf) the look-ahead's)
    int64_t g = js / seg, gn = g + kn / nu, unx = kn % nu, gf = g + kf / nu, uf = kf % nu;
#define PIECE(g, u) (v0s[(u) + 1] > v0s[u] ? seg_bytes(&dcs[u], g, j1, isk, &p) : 0)
    for (int64_t i = 0, gi = g, ui = 0; i < kf && gi <= s1; i++) {
        const size_t nb = PIECE(gi, ui);
        if (nb && i < kn) touch(p, nb, -1);
        else if (nb) touch(p, nb, DEC_FAR_LINES);
        if (++ui == nu) ui = 0, gi++;
    }
    for (; g <= s1; g++) {
        const int64_t r = g * seg > js ? g * seg : js,
                      r1 = (g + 1) * seg < j1 ? (g + 1) * seg : j1;
        for (int64_t u = 0; u < nu; u++) {
            const int64_t nq = v0s[u + 1] - v0s[u];
            dec_ahead ah = {NULL, 0};
            if (nq && gn <= s1 && (ah.pfb = PIECE(gn, unx))) ah.pf = p;
            if (ah.pfb > DEC_NEAR) ah.pfb = DEC_NEAR;  // (as prefetch_ahead's)
            size_t nf;
            if (nq && gf <= s1 && (nf = PIECE(gf, uf))) touch(p, nf, DEC_FAR_LINES);
            if (++unx == nu) unx = 0, gn++;
            if (++uf == nu) uf = 0, gf++;
            if (!nq) continue;
            const dec_chunk *dc = &dcs[u];
            const dec_query *q = qs + v0s[u];
            if (nq > 1) {
                unit_rows(dc, q, nq, js, r, r1, isk, &ah);
                continue;
            }
            const int64_t lo = q->lo > r ? q->lo : r, hi = q->hi < r1 ? q->hi : r1;
            if (lo >= hi) continue;
            const char *k, *vr;
            const float *ks, *vs;
            seg_rows(c, &dc->seg[g - dc->s0], lo - g * seg, &k, &vr, &ks, &vs);
            rows_alone(dc, 0, lo, hi - lo, k, vr, ks, vs, isk, ah.pf, ah.pfb);
        }
    }
#undef PIECE
}

// The rows of a decode chunk (DECODE_CHUNK_BYTES).
static int64_t decode_chunk(const mha__kv_rows *c) {
    int64_t ch = DECODE_CHUNK_MIN;
    while (ch < DECODE_CHUNK_MAX && (size_t)(2 * ch) * c->lk.rb <= DECODE_CHUNK_BYTES) ch *= 2;
    return ch;
}

// Sequences decoded together whose chunk starts with the same rows in
// memory (a paged cache's forks of one prompt: the same blocks) form one
// item: those rows are read once for all their queries (the group
// kernels), each sequence's other rows for its own. At most DEC_GROUP_Q
// queries an item, and DEC_GROUP_FLOATS of their scores (a thread's
// scratch: a larger set is cut into items).
#define DEC_GROUP_Q 64
#define DEC_GROUP_FLOATS 65536

// An item's chunk: chunk ch of the m sequences memb[0 .. m) (in increasing
// order), whose rows [j0, js) are the same in memory and seen by all their
// queries (js = j0: nothing shared; m = 1 then).
typedef struct dec_group {
    int64_t ch, m, js;
    const int64_t *memb;
} dec_group;

// An item of a decode call: group g's chunk for its KV heads [hk, hk + nh)
// (nh > 1: a sequence alone, its heads read together).
typedef struct dec_item {
    int64_t g, hk, nh;
} dec_item;

// A sequence's chunk and the first row of its segment s (KV head 0): the
// key the sequences sharing rows are found by.
typedef struct dec_key {
    const char *k;
    int64_t b;
} dec_key;

static int dec_key_cmp(const void *x, const void *y) {
    const dec_key *a = x, *b = y;
    const uintptr_t pa = (uintptr_t)a->k, pb = (uintptr_t)b->k;
    if (pa != pb) return pa < pb ? -1 : 1;
    return a->b < b->b ? -1 : a->b > b->b;
}

// The groups of one call (ng of them into g, their members into memb,
// key: B records of scratch): per chunk, every sequence, those whose
// chunk begins in the same segment of memory together (at
// most mmax of them an item) with the rows they share: the segments that
// are the same for every one of them, up to the first row any of their
// queries sits at (rows before it are seen by all of their queries: no
// window). share false: each sequence alone.
static int64_t decode_groups(const mha__kv_rows *c, const int64_t *counts, int64_t T,
                             int64_t CH, int64_t nch, bool share, int64_t mmax, dec_group *g,
                             int64_t *memb, dec_key *key) {
    int64_t ng = 0, nm = 0;
    const float *fs;
    const char *kk, *vv;
    const float *ks;
    for (int64_t ch = 0; ch < nch; ch++) {
        const int64_t j0 = ch * CH;
        const int64_t nk = c->B;
        // (every sequence: an item also marks its queries' partials empty
        // where the chunk holds none of its rows)
        for (int64_t b = 0; b < nk; b++) {
            key[b].b = b, key[b].k = NULL;
            if (share && c->len[b] > j0)
                c->at(c->ctx, b, 0, j0 / c->seg, &key[b].k, &vv, &ks, &fs);
        }
        if (share) qsort(key, (size_t)nk, sizeof *key, dec_key_cmp);
        for (int64_t i = 0; i < nk;) {
            int64_t e = i + 1;  // [i, e): the same first segment
            while (share && key[i].k && e < nk && key[e].k == key[i].k) e++;
            for (int64_t f = i; f < e;) {
                const int64_t m = e - f < mmax ? e - f : mmax;
                int64_t js = j0;
                if (m > 1) {
                    // rows seen by every query (those before each member's
                    // first query), and within the chunk
                    int64_t lim = j0 + CH;
                    for (int64_t u = f; u < f + m; u++) {
                        const int64_t bu = key[u].b;
                        const int64_t first = c->len[bu] - (counts ? counts[bu] : T);
                        lim = first < lim ? first : lim;
                    }
                    lim = lim > j0 ? lim : j0;  // (a query before the chunk: none shared)
                    // whole segments the same for all of them
                    while (js < lim) {
                        const int64_t s = js / c->seg;
                        const char *k0 = NULL;
                        bool same = true;
                        for (int64_t u = f; u < f + m && same; u++) {
                            c->at(c->ctx, key[u].b, 0, s, &kk, &vv, &ks, &fs);
                            if (u == f) k0 = kk;
                            same = kk && kk == k0;
                        }
                        if (!same) break;
                        js = (s + 1) * c->seg;
                    }
                    if (js > lim) js = lim;
                }
                // nothing shared: the first alone, the others after it
                const int64_t take = js > j0 ? m : 1;
                g[ng++] = (dec_group){ch, take, js, memb + nm};
                for (int64_t u = f; u < f + take; u++) memb[nm++] = key[u].b;
                f += take;
            }
            i = e;
        }
    }
    return ng;
}

// Decode (at most MHA__DECODE_MAX_T queries): split-KV over fixed chunks
// of the keys, per (b, KV head, chunk): each chunk's partial (m, l, O) per
// query, then combined in chunk order (attend_combine). The G T queries of
// a KV head's group read the chunk's rows in place (the _q kernels: no
// float32 copy of a reduced-precision cache), through the group kernels
// where their bands overlap (each row from memory once for all of them),
// query by query at the edges of the bands. Sequences that share their
// chunk's first rows in memory (decode_groups) read those once for all
// their queries. The bits are those of each sequence alone: a score
// depends on its row and query only, and each output sums its rows in
// order, however the rows are cut into calls.
static mha_status attend_decode(const attend_call *ac) {
    const mha__kv_rows *c = ac->c;
    const mha__kernels *kt = ac->kt;
    const mha_cache_attend_args a = ac->a;
    const mha_tensor *q = ac->q;
    const float *qd = ac->qd;
    const int64_t *counts = ac->counts;
    const int64_t B = ac->B, H = ac->H, T = ac->T, G = ac->G, D = ac->D, Dv = ac->Dv,
                  maxlen = ac->maxlen, q_shift = ac->q_shift;
    const double scale = ac->scale;
    const int nt = ac->nt;
    const int64_t CH = decode_chunk(c), nch = (maxlen + CH - 1) / CH;
    if (nch == 0) return MHA_OK;  // nothing cached, so no queries either
    // sharing: several sequences, rows in memory that may coincide, every
    // query seeing every row before its own (no window, not a shard)
    const int64_t nq = G * T;
    const int64_t qcap = DEC_GROUP_FLOATS / CH < DEC_GROUP_Q ? DEC_GROUP_FLOATS / CH
                                                             : DEC_GROUP_Q;
    const bool share = c->shares && B > 1 && a.opts.window_left < 0 &&
                       a.opts.window_right < 0 && q_shift == 0 && qcap / nq >= 2;
    const int64_t mmax = share ? qcap / nq : 1;
    // heads-together rows (mha__kv_rows.heads_together): an item of a
    // sequence alone takes up to HI of its KV heads (as many as a group's
    // queries), each segment's heads one after the other
    const int64_t HI = !c->heads_together   ? 1
                       : c->Hkv < qcap / nq ? c->Hkv
                       : qcap / nq > 1      ? qcap / nq
                                            : 1;
    const int64_t um = mmax > HI ? mmax : HI, qn = um * nq;  // units and queries an item
    // partials per (b, h, chunk, t): m, l, then Dv floats of unnormalised O;
    // per thread, for each of an item's qn queries: scores (CH, indexed
    // from the chunk's first key), scaled query (D), unnormalised output (Dv)
    const size_t per = (size_t)(Dv + 2);
    // (int8 rows with an int8 query: then its bytes, padded to 64, and
    // its scale)
    // (int4 rows too, of a head dim a multiple of 128: the query split into
    // its even and odd elements per 128, as dot_rows_i4 takes it)
    const bool i4q = c->dt == MHA_KV_INT4 && D % 128 == 0;
    const bool i8 = (c->dt == MHA_KV_INT8 || i4q) && D <= MHA__I8_DMAX;
    const int64_t ldxi = i8 ? (D + 63) / 64 * 64 : 0, xi = i8 ? D + Dv : 0;
    const size_t qf = (size_t)(CH + D + Dv + (i8 ? ldxi / 4 + 1 : 0)), tfl = (size_t)qn * qf;
    // (and per thread and unit of an item the segments its chunk's rows
    // lie in)
    const size_t ns = (size_t)((CH + c->seg - 1) / c->seg + 1);
    // (floats: the partials, then the threads' scores from a multiple of
    // 16, then their queries' records, then their segments, then their
    // combine sums, then the groups, their members, the sort's keys and the
    // items)
    const size_t ngmax = (size_t)(B * nch), itmax = ngmax * (size_t)c->Hkv;
    size_t off_sc, off_q, nd, bytes;
    if (mha__mul_overflow_size((size_t)(B * H * nch * T), per, &off_sc) ||
        mha__add_overflow_size(off_sc, 15, &off_sc) ||
        mha__mul_overflow_size(tfl, (size_t)nt, &nd) ||
        mha__add_overflow_size(off_sc & ~(size_t)15, nd + 15, &off_q) ||
        mha__mul_overflow_size(off_q & ~(size_t)15, sizeof(float), &bytes) ||
        mha__mul_overflow_size((size_t)qn * (size_t)nt, sizeof(dec_query), &nd) ||
        mha__add_overflow_size(bytes, nd, &bytes) ||
        mha__mul_overflow_size(ns * (size_t)(um * nt), sizeof(dec_seg), &nd) ||
        mha__add_overflow_size(bytes, nd, &bytes) ||
        mha__mul_overflow_size((size_t)Dv * (size_t)nt, sizeof(double), &nd) ||
        mha__add_overflow_size(bytes, nd, &bytes) ||
        mha__mul_overflow_size(ngmax, sizeof(dec_group) + sizeof(int64_t), &nd) ||
        mha__add_overflow_size(bytes, nd, &bytes) ||
        mha__mul_overflow_size((size_t)B, sizeof(dec_key), &nd) ||
        mha__add_overflow_size(bytes, nd, &bytes) ||
        mha__mul_overflow_size(itmax, sizeof(dec_item), &nd) ||
        mha__add_overflow_size(bytes, nd, &bytes))
        return mha__fail(MHA_ERR_OVERFLOW, "kv cache attend: scratch overflows");
    off_sc &= ~(size_t)15, off_q &= ~(size_t)15;
    float *part = mha__alloc(bytes);
    if (!part)
        return mha__fail(MHA_ERR_NOMEM, "kv cache attend: out of memory for %zu bytes", bytes);
    float *tsc = part + off_sc;
    dec_query *tq = (dec_query *)(void *)(part + off_q);
    dec_seg *tseg = (dec_seg *)(void *)(tq + (size_t)qn * (size_t)nt);
    double *tacc = (double *)(void *)(tseg + ns * (size_t)(um * nt));
    dec_group *grp = (dec_group *)(void *)(tacc + (size_t)Dv * (size_t)nt);
    int64_t *memb = (int64_t *)(void *)(grp + ngmax);
    dec_key *keys = (dec_key *)(void *)(memb + ngmax);
    dec_item *items = (dec_item *)(void *)(keys + B);
    const int64_t ngr = decode_groups(c, counts, T, CH, nch, share, mmax, grp, memb, keys);
    // items: (KV heads, group), a sequence's chunks after each other; a
    // sequence alone takes HI heads an item
    int64_t nit = 0;
    for (int64_t hk = 0; hk < c->Hkv; hk += HI) {
        const int64_t nh = c->Hkv - hk < HI ? c->Hkv - hk : HI;  // (this block of heads)
        for (int64_t g = 0; g < ngr; g++)
            if (grp[g].m == 1) items[nit++] = (dec_item){g, hk, nh};
            else
                for (int64_t h = hk; h < hk + nh; h++) items[nit++] = (dec_item){g, h, 1};
    }
    const int kind = (int)c->dt;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (int64_t it = 0; it < nit; it++) {
        const dec_group *gr = &grp[items[it].g];
        const int64_t ch = gr->ch, j0 = ch * CH, js = gr->js, nh = items[it].nh;
        const int id = mha__thread_id();
        float *sc = tsc + (size_t)id * tfl;
        dec_query *qs = tq + (size_t)id * (size_t)qn;
        int64_t nv = 0;  // the item's queries so far
        // units: (KV head, member), one of the two alone
        const int64_t nu = gr->m * nh;
        dec_chunk dcs[DEC_GROUP_Q];
        int64_t v0s[DEC_GROUP_Q + 1];
        for (int64_t u = 0; u < nu; u++) {
            const int64_t hk = items[it].hk + u / gr->m, b = gr->memb[u % gr->m],
                          n = c->len[b], Tb = counts ? counts[b] : T;
            const int64_t j1 = j0 + CH < n ? j0 + CH : n;
            v0s[u] = nv;
            for (int64_t h = hk * G; h < (hk + 1) * G; h++)
                for (int64_t t = 0; t < Tb; t++) {
                    float *pp = part + ((size_t)(((b * H + h) * nch + ch) * T + t)) * per;
                    int64_t lo, hi;  // query t sits at position n - Tb + t
                    const mha__mask band = {.causal = true,
                                            .win_left = a.opts.window_left,
                                            .win_right = a.opts.window_right,
                                            .q_off = n - Tb + q_shift};
                    mha__mask_band(&band, t, n, &lo, &hi);
                    if (lo < j0) lo = j0;
                    if (hi > j1) hi = j1;
                    pp[0] = -INFINITY;
                    pp[1] = 0.0f;
                    for (int64_t e = 0; e < Dv; e++) pp[2 + e] = 0.0f;
                    if (lo >= hi) continue;
                    qs[nv] = (dec_query){h, n - Tb + t + q_shift, lo, hi, pp};
                    float *x = sc + (size_t)nv * qf + CH, *o = x + D;
                    const float *qr = qd + b * q->stride[0] + h * q->stride[1] +
                                      t * q->stride[2];
                    for (int64_t e = 0; e < D; e++) x[e] = (float)scale * qr[e];
                    for (int64_t e = 0; e < Dv; e++) o[e] = 0.0f;
                    if (i8) quantize_i8((int8_t *)(x + xi), x + xi + ldxi / 4, x, D, ldxi);
                    if (i8 && i4q) split_i4((int8_t *)(x + xi), D);
                    nv++;
                }
            // the segments of its chunk's rows, looked up once (heads read
            // together: head u's those of the item's first head moved on by
            // u heads, as such a source lays them out)
            const int64_t s0 = j0 / c->seg, s1 = (j1 - 1) / c->seg;
            dec_seg *sg = tseg + ((size_t)id * (size_t)um + (size_t)u) * ns;
            const dec_seg *sf = nh > 1 && u > 0 ? sg - (size_t)u * ns : NULL;
            const size_t kb = (size_t)(u * c->seg) * c->lk.rb,
                         vb = (size_t)(u * c->seg) * c->lv.rb;
            for (int64_t g = s0; nv > v0s[u] && g <= s1; g++) {
                dec_seg *e = &sg[g - s0];
                const dec_seg *f = sf ? &sf[g - s0] : NULL;
                if (!f) c->at(c->ctx, b, hk, g, &e->k, &e->v, &e->ks, &e->vs);
                else if (!f->k) *e = *f;  // (released)
                else
                    *e = (dec_seg){
                        f->k + kb, f->v + vb,
                        f->ks ? (const float *)(const void *)((const char *)f->ks + kb) : NULL,
                        f->vs ? (const float *)(const void *)((const char *)f->vs + vb) : NULL};
            }
            dcs[u] = (dec_chunk){kt, c,  b,  hk,  j0, s0, CH, kind, sc + (size_t)v0s[u] * qf,
                                 qf, sg, xi, ldxi};
        }
        v0s[nu] = nv;
        if (nv == 0) continue;
        // the shared rows [j0, js) for all (every query sees them): through
        // the first sequence's segments, the scores and outputs indexed
        // from the item's first query
        dec_chunk all = dcs[0];
        all.sc = sc;
        for (int pass = 0; pass < 2; pass++) {
            const bool isk = pass == 0;
            if (js > j0) shared_rows(&all, nv, j0, js, isk, NULL);
            // each sequence's other rows [js, ..): the keys its queries all
            // see for all of them, each query's others alone, in order
            if (nh == 1)
                for (int64_t u = 0; u < nu; u++)
                    unit_rows(&dcs[u], qs + v0s[u], v0s[u + 1] - v0s[u], js, js, INT64_MAX,
                              isk, NULL);
            else heads_rows(dcs, qs, v0s, nu, js, isk);
            if (!isk) break;
            for (int64_t v = 0; v < nv; v++) {
                const dec_query *dq = &qs[v];
                float *s = sc + (size_t)v * qf + (dq->lo - j0);
                const int64_t w = dq->hi - dq->lo;
                const float cap = a.opts.softcap;
                if (cap > 0.0f)
                    for (int64_t j = 0; j < w; j++) s[j] = cap * mha__softcap_tanh(s[j], cap);
                if (a.opts.alibi_slopes)  // (the bias rounded once to float32)
                    for (int64_t j = dq->lo; j < dq->hi; j++)
                        s[j - dq->lo] += (float)mha__alibi_bias(a.opts.alibi_slopes[dq->h],
                                                                dq->p, j);
                float m = -INFINITY, l = 0.0f;
                (void)kt->softmax_update(s, w, &m, &l);  // s <- exp(s - m)
                dq->pp[0] = m;
                dq->pp[1] = l;
            }
        }
        for (int64_t v = 0; v < nv; v++)
            memcpy(qs[v].pp + 2, sc + (size_t)v * qf + CH + D, sizeof(float) * (size_t)Dv);
    }
    attend_combine(ac, part, nch, per, tacc);
    mha__free(part);
    return MHA_OK;
}

// StreamingLLM's sinks (mha_cache_attend_args.sink_tokens): the keys
// [0, min(k, p - w)) of a query at position p, seen at positions j +
// delta, scored with sq's row (float64), merged with the window's result
// (out, its row max and 1/sum in stats): O = (l_w e^(m_w - M) O_w + sum_j
// e^(s_j - M) v_j) / (l_w e^(m_w - M) + sum_j e^(s_j - M)).
static mha_status attend_stream_sinks(const attend_call *ac, const mha_tensor *sq) {
    const mha__kv_rows *c = ac->c;
    const int64_t B = ac->B, H = ac->H, T = ac->T, G = ac->G, D = ac->D, Dv = ac->Dv;
    const int64_t k = ac->a.opts.sink_tokens, w = ac->a.opts.window_left;
    const int64_t kmax = k < ac->maxlen ? k : ac->maxlen;
    if (kmax <= 0) return MHA_OK;
    // per thread: the sinks' scores (float64), their K and V rows as float32
    const size_t per = (size_t)kmax * (sizeof(double) + sizeof(float) * (size_t)(D + Dv));
    char *buf = mha__alloc(per * (size_t)ac->nt);
    if (!buf)
        return mha__fail(MHA_ERR_NOMEM, "kv cache attend: out of memory for the sink tokens");
    const float *sqd = sq ? sq->data : ac->qd;
    const int64_t *qs = sq ? sq->stride : ac->q->stride;
#pragma omp parallel for schedule(static) num_threads(ac->nt)
    for (int64_t bh = 0; bh < B * H; bh++) {
        const int64_t b = bh / H, h = bh % H, hk = h / G, n = c->len[b];
        const int64_t Tb = ac->counts ? ac->counts[b] : T;
        double *s = (double *)(void *)(buf + (size_t)mha__thread_id() * per);
        float *kf = (float *)(void *)(s + kmax), *vf = kf + kmax * D;
        int64_t have = 0;  // the sink rows converted so far
        for (int64_t t = 0; t < Tb; t++) {
            const int64_t p = n - Tb + t, ns = k < p - w ? k : p - w;
            if (ns <= 0) continue;  // the window reaches back to them
            const int64_t delta = p - w - k > 0 ? p - w - k : 0;
            for (; have < ns; have++) {  // row `have`, segment by segment
                const char *kr, *vr;
                const float *ks, *vs;
                const int64_t sgi = have / c->seg, i = have - sgi * c->seg;
                c->at(c->ctx, b, hk, sgi, &kr, &vr, &ks, &vs);
                rows_to_f32(ac->kt, c->dt, c->lk, kr + (size_t)i * c->lk.rb,
                            ks ? ks + i * c->lk.sld : NULL, 1, D, kf + have * D);
                rows_to_f32(ac->kt, c->dt, c->lv, vr + (size_t)i * c->lv.rb,
                            vs ? vs + i * c->lv.sld : NULL, 1, Dv, vf + have * Dv);
            }
            const float *x = sqd + b * qs[0] + h * qs[1] + t * qs[2];
            double ms = -INFINITY;
            for (int64_t j = 0; j < ns; j++) {
                double d = 0.0;
                for (int64_t e = 0; e < D; e++) d += (double)x[e] * kf[j * D + e];
                d *= ac->scale;
                const float cap = ac->a.opts.softcap;
                if (cap > 0.0f) d = cap * mha__softcap_tanh64(d, cap);
                if (ac->a.opts.alibi_slopes)
                    d += mha__alibi_bias(ac->a.opts.alibi_slopes[h], p, j + delta);
                s[j] = d;
                if (d > ms) ms = d;
            }
            float *orow = ac->o + b * ac->out->stride[0] + h * ac->out->stride[1] +
                          t * ac->out->stride[2];
            float *st = ac->stats + 2 * ((b * H + h) * T + t);
            const double mw = st[0], ilw = st[1];
            const double M = ilw > 0.0 && mw > ms ? mw : ms;
            const double ww = ilw > 0.0 ? exp(mw - M) / ilw : 0.0;
            double L = ww;
            for (int64_t j = 0; j < ns; j++) L += exp(s[j] - M);
            for (int64_t e = 0; e < Dv; e++) {
                double acc = ww * orow[e];
                for (int64_t j = 0; j < ns; j++) acc += exp(s[j] - M) * vf[j * Dv + e];
                orow[e] = (float)(acc / L);
            }
            st[0] = (float)M;
            st[1] = (float)(1.0 / L);
        }
    }
    mha__free(buf);
    return MHA_OK;
}

static mha_status attend_rows_f32(mha_tensor *out, const mha_tensor *q,
                                  const mha__kv_rows *rows, const mha_cache_attend_args *args,
                                  const int64_t *counts, int64_t q_shift, float *stats);

static bool is_half(const mha_tensor *t) {
    return t && (t->dtype == MHA_BF16 || t->dtype == MHA_F16);
}

// Every element of the 4-D view src into dst of the same shape (contiguous
// when dst is a fresh tensor), as float32 and back: one rounding into a
// half type (nearest even), exact otherwise.
static void copy4(const mha_tensor *dst, const mha_tensor *src) {
    for (int64_t i = 0; i < src->shape[0]; i++)
        for (int64_t j = 0; j < src->shape[1]; j++)
            for (int64_t t = 0; t < src->shape[2]; t++) {
                const int64_t so = i * src->stride[0] + j * src->stride[1] + t * src->stride[2],
                              d = i * dst->stride[0] + j * dst->stride[1] + t * dst->stride[2];
                const mha__mat s = mha__view_at(src, so, 3), o = mha__view_at(dst, d, 3);
                for (int64_t e = 0; e < src->shape[3]; e++)
                    mha__st(o, 0, e, (float)mha__ld(s, 0, e));
            }
}

// A bf16 or f16 q or out: the float32 attention on q's values (converted,
// exactly) into a float32 out, then rounded into out once (nearest even).
// The copies hold B H T (D + Dv) floats, the queries' size: no cache row.
static mha_status attend_rows_half(mha_tensor *out, const mha_tensor *q,
                                   const mha__kv_rows *rows, const mha_cache_attend_args *args,
                                   const int64_t *counts, int64_t q_shift, float *stats) {
    mha_status st;
    if ((st = mha__check_float(q, "q")) || (st = mha__check_float(out, "out"))) return st;
    if (q->dtype == MHA_F64 || out->dtype == MHA_F64)
        return mha__fail(MHA_ERR_DTYPE, "kv cache attend: q %s and out %s: F32, BF16 or F16",
                         mha_dtype_name(q->dtype), mha_dtype_name(out->dtype));
    if (q->ndim != 4 || out->ndim != 4)
        return mha__fail(MHA_ERR_SHAPE, "kv cache attend: q and out must be 4-D, got %d and %d",
                         q->ndim, out->ndim);
    if ((st = mha__check_no_overlap(out, "out", q, "q"))) return st;
    const size_t nq = (size_t)mha_tensor_numel(q), no = (size_t)mha_tensor_numel(out);
    size_t bytes;
    if (mha__add_overflow_size(nq, no, &bytes) ||
        mha__mul_overflow_size(bytes, sizeof(float), &bytes))
        return mha__fail(MHA_ERR_OVERFLOW, "kv cache attend: scratch overflows");
    float *buf = mha__alloc(bytes);
    if (!buf)
        return mha__fail(MHA_ERR_NOMEM, "kv cache attend: out of memory for %zu bytes", bytes);
    mha_tensor qf = mha_tensor_contiguous(buf, MHA_F32, 4, q->shape);
    mha_tensor of = mha_tensor_contiguous(buf + nq, MHA_F32, 4, out->shape);
    copy4(&qf, q);
    st = attend_rows_f32(&of, &qf, rows, args, counts, q_shift, stats);
    if (!st) copy4(out, &of);
    mha__free(buf);
    return st;
}

mha_status mha__kv_attend_rows(mha_tensor *out, const mha_tensor *q, const mha__kv_rows *rows,
                               const mha_cache_attend_args *args, const int64_t *counts,
                               int64_t q_shift, float *stats) {
    if (is_half(q) || is_half(out))
        return attend_rows_half(out, q, rows, args, counts, q_shift, stats);
    return attend_rows_f32(out, q, rows, args, counts, q_shift, stats);
}

static mha_status attend_rows_f32(mha_tensor *out, const mha_tensor *q,
                                  const mha__kv_rows *rows, const mha_cache_attend_args *args,
                                  const int64_t *counts, int64_t q_shift, float *stats) {
    attend_call ac = {0};
    const bool stream = args && args->opts.sink_tokens > 0 && args->opts.window_left >= 0;
    float *own = NULL;  // the window's row stats, when the caller wants none
    if (stream && !stats && q && q->ndim == 4 && rows) {
        size_t nst;
        if (mha__mul_overflow_size((size_t)(rows->B * q->shape[1] * q->shape[2]),
                                   2 * sizeof(float), &nst))
            return mha__fail(MHA_ERR_OVERFLOW, "kv cache attend: scratch overflows");
        if (!(stats = own = mha__alloc(nst)))
            return mha__fail(MHA_ERR_NOMEM, "kv cache attend: out of memory for %zu bytes", nst);
    }
    mha_status st = attend_check(&ac, out, q, rows, args, counts, q_shift, stats);
    if (!st) st = ac.T > MHA__DECODE_MAX_T ? attend_prefill(&ac) : attend_decode(&ac);
    if (!st && stream) st = attend_stream_sinks(&ac, args->sink_q);
    mha__free(own);
    return st;
}

mha_status mha__kv_cache_attend_ex(mha_tensor *out, const mha_tensor *q, const mha_kv_cache *c,
                                   const mha_cache_attend_args *args, const int64_t *counts,
                                   int64_t q_shift, float *stats) {
    if (!c) return mha__fail(MHA_ERR_INVALID_ARG, "kv cache attend: NULL argument");
    const mha__kv_rows rows = cache_rows(c);
    return mha__kv_attend_rows(out, q, &rows, args, counts, q_shift, stats);
}
