// kvattend.c: the attention of new queries over a KV cache or any row
// source (mha__kv_rows: the contiguous cache, a paged cache's blocks, an
// MPI shard): the checks (once), the choice between the split-KV decode
// (at most MHA__DECODE_MAX_T queries per sequence, splitkv.c) and a
// prefill (the flash kernel per (b, h, tile of queries), the queries'
// positions offset by len_b - T_b), StreamingLLM's sink tokens, and half
// queries converted on their way in and out.
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "kvattend.h"

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

// Checks a cache attention's arguments (once) and fills ac.
static mha_status attend_check(mha__attend_call *ac, mha_tensor *out, const mha_tensor *q,
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
    if ((st = mha__kv_check_counts(counts, B, T, "kv cache attend"))) return st;
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

    *ac = (mha__attend_call){.c = c,
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
static mha_status attend_prefill(const mha__attend_call *ac) {
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
                mha__kv_rows_to_f32(kt, c->dt, c->lk, k, ks, w, D, kd + j * D);
                mha__kv_rows_to_f32(kt, c->dt, c->lv, v, vs, w, Dv, vd + j * Dv);
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

// StreamingLLM's sinks (mha_cache_attend_args.sink_tokens): the keys
// [0, min(k, p - w)) of a query at position p, seen at positions j +
// delta, scored with sq's row (float64), merged with the window's result
// (out, its row max and 1/sum in stats): O = (l_w e^(m_w - M) O_w + sum_j
// e^(s_j - M) v_j) / (l_w e^(m_w - M) + sum_j e^(s_j - M)).
static mha_status attend_stream_sinks(const mha__attend_call *ac, const mha_tensor *sq) {
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
                mha__kv_rows_to_f32(ac->kt, c->dt, c->lk, kr + (size_t)i * c->lk.rb,
                                    ks ? ks + i * c->lk.sld : NULL, 1, D, kf + have * D);
                mha__kv_rows_to_f32(ac->kt, c->dt, c->lv, vr + (size_t)i * c->lv.rb,
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
    mha__attend_call ac = {0};
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
    if (!st) st = ac.T > MHA__DECODE_MAX_T ? attend_prefill(&ac) : mha__kv_decode(&ac);
    if (!st && stream) st = attend_stream_sinks(&ac, args->sink_q);
    mha__free(own);
    return st;
}

mha_status mha__kv_cache_attend_ex(mha_tensor *out, const mha_tensor *q, const mha_kv_cache *c,
                                   const mha_cache_attend_args *args, const int64_t *counts,
                                   int64_t q_shift, float *stats) {
    if (!c) return mha__fail(MHA_ERR_INVALID_ARG, "kv cache attend: NULL argument");
    const mha__kv_rows rows = mha__kv_cache_rows(c);
    return mha__kv_attend_rows(out, q, &rows, args, counts, q_shift, stats);
}
