// fused_sdpa_bwd.c: the fused mha_sdpa backward (MHA_IMPL_FUSED) over
// the flash tiles of flash.h: per (b, KV head) item, or in two passes over
// tiles when there are fewer items than threads (see below). It knows no
// module: the module backward is fused_bwd.c's.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fused.h"
#include "linear.h"

// The fused mha_sdpa backward. With at least as many (b, KV head) items as
// threads: one item (one thread) per (b, KV head g); for each query head h
// of the group in increasing order, its forward rows again (the context O
// (L, Dv) and each row's stats into the thread's scratch), then the head's
// whole backward (flash.h: dq written; dk, dv of g overwritten by the
// group's first head, added to by the others). With fewer (a batch of one
// and few KV heads): every head's forward rows over (b, h, query tile)
// items into one block, pass B over the same items, then pass A over (b, g,
// key tile) items, the group's heads in increasing order. The two give the
// same bits (flash.h), and every gradient element is summed by one thread
// in a fixed order: the same bits for any number of threads.
//
// bfloat16 / float16 tensors (any of q, k, v, dout, dq, dk, dv, each its
// own type) take the per-head way whatever the threads (the same bits):
// q, k, v rows are converted as the head loads them (flash.h), a head's
// dout rows into float32 scratch (L, Dv) as the head starts, and dq (L,
// D), the group's dk (S, D) and dv (S, Dv) are summed in float32 scratch
// and rounded once (nearest even) into their tensors: per thread, not a
// float32 copy of a tensor.
//
// The sinks' gradient (dsinks, when asked): a sink is one more logit of
// each row's softmax whose value is 0, so
//   dsink_h = -sum_{b, i} P_sink Dsum_i,  P_sink = exp(sink_h - m_i) / l_i
// from the rows' stats and Dsum (as the module backward, fused_bwd.c):
// each (b, h)'s sum over its rows in double into the block's (B, H)
// doubles as the head's backward leaves its Dsum, then the sum over b in
// increasing order: the same bits for either way and any threads.

// The address of element (b, h, 0, 0) of a 4-D view, as the head's pointer
// (float32, or uint16_t elements cast).
static float *head_at(const mha_tensor *t, int64_t b, int64_t h) {
    return (float *)mha__view_at(t, t->stride[0] * b + t->stride[1] * h, 3).p;
}

// Rows (n, c) of a half view's head from float32 f (row stride c), rounded
// (mha__st: a float32 value rounds once).
static void store_half(const mha_tensor *t, int64_t b, int64_t h, const float *f, int64_t n,
                       int64_t c) {
    const mha__mat m = mha__view_at(t, t->stride[0] * b + t->stride[1] * h, 3);
    for (int64_t i = 0; i < n; i++) {  // (mha__st_row: mha__st's values, vectorised)
        mha__mat row = m;
        row.p = (char *)m.p + i * t->stride[2] * (int64_t)mha_dtype_size(t->dtype);
        mha__st_row(row, f + i * c, c);
    }
}

// Flash head (b, h) of an sdpa backward; its KV head h / (H / Hkv); o and
// stats: where its forward rows go.
static mha__flash_head sdpa_head(const mha_tensor *q, const mha_tensor *k, const mha_tensor *v,
                                 const mha__mask *mk, const mha__dropout *drop, double scale,
                                 int64_t b, int64_t h, float *o, int64_t o_rs, float *stats) {
    const int64_t g = h / (q->shape[1] / k->shape[1]);
    return (mha__flash_head){
        .q = head_at(q, b, h),
        .q_rs = q->stride[2],
        .k = head_at(k, b, g),
        .k_rs = k->stride[2],
        .v = head_at(v, b, g),
        .v_rs = v->stride[2],
        .q_half = mha__half_of(q->dtype),
        .k_half = mha__half_of(k->dtype),
        .v_half = mha__half_of(v->dtype),
        .o = o,
        .o_rs = o_rs,
        .stats = stats,
        .L = q->shape[2],
        .S = k->shape[2],
        .D = q->shape[3],
        .Dv = v->shape[3],
        .scale = (float)scale,
        .mask = mk,
        .drop = drop,
        .b = b,
        .h = h,
        .f32_compute = true,
    };
}

#define SDPA_PTR(t, h) ((float *)(t)->data + (t)->stride[0] * b + (t)->stride[1] * (h))

// -sum_i P_sink,i Dsum_i of one head's L rows, stats (L, 2) = (m, 1 / l);
// 0 for a sink of -inf (its weight is 0 in every row).
static double sink_grad_head(const float *stats, const float *dsum, int64_t L, float sink) {
    double s = 0.0;
    for (int64_t i = 0; sink > -INFINITY && i < L; i++)
        s -= exp((double)sink - stats[2 * i]) * stats[2 * i + 1] * dsum[i];
    return s;
}

// One thread per (b, KV head): per thread (per floats, from blk) the flash
// scratch sf (64-byte aligned: it begins with pointers), then O (L, Dv),
// stats (L, 2), Dsum (L), and with half tensors dO (L, Dv), dq (L, D), dk
// (S, D), dv (S, Dv) in float32.
static void sdpa_bwd_per_head(mha_tensor *dq, mha_tensor *dk, mha_tensor *dv, double *dsink_bh,
                              const mha_tensor *dout, const mha_tensor *q, const mha_tensor *k,
                              const mha_tensor *v, const mha__mask *mk,
                              const mha__dropout *drop, double scale, size_t sf, size_t per,
                              int nt, float *blk, const mha_saved *sv) {
    const mha__kernels *kt = mha__kernels_get();
    const int64_t B = q->shape[0], H = q->shape[1], L = q->shape[2], D = q->shape[3],
                  S = k->shape[2], Dv = v->shape[3], Hkv = k->shape[1], G = H / Hkv;
    for (int t = 0; t < nt; t++) mha__flash_scratch_reset(blk + (size_t)t * per);
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (int64_t bg = 0; bg < B * Hkv; bg++) {
        const int64_t b = bg / Hkv, g = bg % Hkv;
        float *sc = blk + (size_t)mha__thread_id() * per, *o = sc + sf, *stats = o + L * Dv,
              *dsum = stats + 2 * L, *hdo = dsum + L, *hdq = hdo + L * Dv, *hdk = hdq + L * D,
              *hdv = hdk + S * D;
        // the gradients' rows: the tensors' own, or float32 scratch for a
        // half one (rounded into it below)
        const bool ho = dout->dtype != MHA_F32, hq = dq->dtype != MHA_F32,
                   hk = dk->dtype != MHA_F32, hv = dv->dtype != MHA_F32;
        const bool bf = mha__fused_sdpa_backward_bf16(q, k, v, dout);
        for (int64_t h = g * G; h < (g + 1) * G; h++) {
            const int64_t bh = b * H + h;  // (the forward's state: its O and stats)
            mha__flash_head fh = sv ? sdpa_head(q, k, v, mk, drop, scale, b, h,
                                                sv->buf + bh * L * Dv, Dv,
                                                sv->buf + sv->n_ctx + 2 * bh * L)
                                    : sdpa_head(q, k, v, mk, drop, scale, b, h, o, Dv, stats);
            fh.f32_compute = !bf;  // bf16: the bf16 forward's O and stats
            for (int64_t i0 = 0; !sv && i0 < L; i0 += MHA__FLASH_BR)
                mha__flash_rows(kt, &fh, i0, mha__tile_end(i0, MHA__FLASH_BR, L), sc);
            if (ho) {
                const uint16_t *d16 = (const uint16_t *)(const void *)head_at(dout, b, h);
                for (int64_t i = 0; i < L; i++) {
                    if (dout->dtype == MHA_BF16)
                        kt->cvt_bf16(hdo + i * Dv, d16 + i * dout->stride[2], Dv);
                    else kt->cvt_f16(hdo + i * Dv, d16 + i * dout->stride[2], Dv);
                }
            }
            if (bf)
                mha__flash_bwd_head_bf16(kt, &fh, hdo, Dv,
                                         (const uint16_t *)(const void *)head_at(dout, b, h),
                                         dout->stride[2], dsum, hq ? hdq : SDPA_PTR(dq, h),
                                         hq ? D : dq->stride[2], hk ? hdk : SDPA_PTR(dk, g),
                                         hk ? D : dk->stride[2], hv ? hdv : SDPA_PTR(dv, g),
                                         hv ? Dv : dv->stride[2], h != g * G, sc);
            else
                mha__flash_bwd_head(kt, &fh, ho ? hdo : SDPA_PTR(dout, h),
                                    ho ? Dv : dout->stride[2], dsum, hq ? hdq : SDPA_PTR(dq, h),
                                    hq ? D : dq->stride[2], hk ? hdk : SDPA_PTR(dk, g),
                                    hk ? D : dk->stride[2], hv ? hdv : SDPA_PTR(dv, g),
                                    hv ? Dv : dv->stride[2], NULL, NULL, h != g * G, sc);
            if (hq) store_half(dq, b, h, hdq, L, D);
            if (dsink_bh)  // (the head's Dsum, before the next head's)
                dsink_bh[bh] = sink_grad_head(fh.stats, dsum, L, mk->sinks[h]);
        }
        if (hk) store_half(dk, b, g, hdk, S, D);
        if (hv) store_half(dv, b, g, hdv, S, Dv);
    }
}

// Over tiles: from blk, nt flash scratches sf, then every head's O (B, H,
// L, Dv), stats (B, H, L, 2) and Dsum (B, H, L).
static void sdpa_bwd_tiles(mha_tensor *dq, mha_tensor *dk, mha_tensor *dv, double *dsink_bh,
                           const mha_tensor *dout, const mha_tensor *q, const mha_tensor *k,
                           const mha_tensor *v, const mha__mask *mk, const mha__dropout *drop,
                           double scale, size_t sf, int nt, float *blk, const mha_saved *sv) {
    const mha__kernels *kt = mha__kernels_get();
    const int64_t B = q->shape[0], H = q->shape[1], L = q->shape[2], S = k->shape[2],
                  Dv = v->shape[3], Hkv = k->shape[1], G = H / Hkv;
    for (int t = 0; t < nt; t++) mha__flash_scratch_reset(blk + (size_t)t * sf);
    float *O = blk + sf * (size_t)nt, *stats = O + B * H * L * Dv,
          *dsum = stats + 2 * B * H * L;
    if (sv) O = sv->buf, stats = sv->buf + sv->n_ctx;  // the forward's
    const int64_t tiles = (L + MHA__FLASH_BR - 1) / MHA__FLASH_BR;
    const int64_t ktiles = (S + MHA__FLASH_BC - 1) / MHA__FLASH_BC;
#define SDPA_HEAD(b, h)                                                       \
    sdpa_head(q, k, v, mk, drop, scale, b, h, O + ((b)*H + (h)) * L * Dv, Dv, \
              stats + 2 * ((b)*H + (h)) * L)
    // the forward rows, then pass B (Dsum, dq), per (b, h, query tile)
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (int64_t it = 0; it < (sv ? 0 : B * H * tiles); it++) {
        const int64_t bh = it / tiles, b = bh / H, h = bh % H,
                      i0 = (it % tiles) * MHA__FLASH_BR;
        mha__flash_head fh = SDPA_HEAD(b, h);
        mha__flash_rows(kt, &fh, i0, mha__tile_end(i0, MHA__FLASH_BR, L),
                        blk + (size_t)mha__thread_id() * sf);
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (int64_t it = 0; it < B * H * tiles; it++) {
        const int64_t bh = it / tiles, b = bh / H, h = bh % H,
                      i0 = (it % tiles) * MHA__FLASH_BR;
        mha__flash_head fh = SDPA_HEAD(b, h);
        mha__flash_bwd_q(kt, &fh, SDPA_PTR(dout, h), dout->stride[2], dsum + bh * L, i0,
                         mha__tile_end(i0, MHA__FLASH_BR, L),
                         SDPA_PTR(dq, h) + i0 * dq->stride[2], dq->stride[2],
                         blk + (size_t)mha__thread_id() * sf);
    }
    // pass A (dk, dv), per (b, KV head, key tile), the group's heads in
    // increasing order
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (int64_t it = 0; it < B * Hkv * ktiles; it++) {
        const int64_t bg = it / ktiles, b = bg / Hkv, g = bg % Hkv,
                      j0 = (it % ktiles) * MHA__FLASH_BC,
                      n = S - j0 < MHA__FLASH_BC ? S - j0 : MHA__FLASH_BC;
        for (int64_t h = g * G; h < (g + 1) * G; h++) {
            mha__flash_head fh = SDPA_HEAD(b, h);
            mha__flash_bwd_kv(kt, &fh, SDPA_PTR(dout, h), dout->stride[2],
                              dsum + (b * H + h) * L, j0, n,
                              SDPA_PTR(dk, g) + j0 * dk->stride[2], dk->stride[2],
                              SDPA_PTR(dv, g) + j0 * dv->stride[2], dv->stride[2], h != g * G,
                              blk + (size_t)mha__thread_id() * sf);
        }
    }
    // the sinks: every head's stats and Dsum (pass B's) are there
    for (int64_t bh = 0; dsink_bh && bh < B * H; bh++)
        dsink_bh[bh] = sink_grad_head(stats + 2 * bh * L, dsum + bh * L, L, mk->sinks[bh % H]);
#undef SDPA_HEAD
}

#undef SDPA_PTR

bool mha__fused_sdpa_backward_bf16(const mha_tensor *q, const mha_tensor *k,
                                   const mha_tensor *v, const mha_tensor *dout) {
    return dout->dtype == MHA_BF16 && mha__fused_sdpa_bf16(q, k, v);
}

mha_status mha__fused_sdpa_backward(mha_tensor *dq, mha_tensor *dk, mha_tensor *dv,
                                    float *dsinks, const mha_tensor *dout, const mha_tensor *q,
                                    const mha_tensor *k, const mha_tensor *v,
                                    const mha__mask *mk, const mha__dropout *drop,
                                    double scale, const mha_saved *sv) {
    // the forward's state when it computed in this backward's precision
    if (sv && sv->bf16 != mha__fused_sdpa_backward_bf16(q, k, v, dout)) sv = NULL;
    const int64_t B = q->shape[0], H = q->shape[1], L = q->shape[2], D = q->shape[3],
                  S = k->shape[2], Dv = v->shape[3], Hkv = k->shape[1];
    const int nt = (double)B * H * L * S * (2 * D + 3 * Dv) < MHA__PAR_MIN_WORK
                       ? 1
                       : mha__max_threads();
    const size_t sf = (mha__flash_scratch_floats(D, Dv, S, 0, true) + 15) & ~(size_t)15;
    const mha_tensor *all[7] = {q, k, v, dout, dq, dk, dv};
    bool half = false;
    for (int i = 0; i < 7; i++) half |= all[i]->dtype != MHA_F32;
    const bool per_head = half || B * Hkv >= nt;
    // the scratch, one block: per head, per thread sf + O (L, Dv), stats
    // (L, 2), Dsum (L) (each thread's piece 64-byte aligned); over tiles,
    // nt times sf, then every head's O, stats and Dsum; then, with dsinks,
    // each (b, h)'s sink gradient, (B, H) doubles (at an even float)
    size_t per = 0, heads = 0, floats, bytes;
    // (half: the float32 dO, dq, dk, dv as well)
    size_t hx = 0;
    const bool over =
        per_head
            ? mha__mul_overflow_size((size_t)L, (size_t)Dv + 3, &per) ||
                  mha__add_overflow_size(per, sf + 15, &per) ||
                  (half && (mha__mul_overflow_size((size_t)(L + S), (size_t)(D + Dv), &hx) ||
                            mha__add_overflow_size(per, hx, &per)))
            : mha__mul_overflow_size((size_t)(B * H), (size_t)L * ((size_t)Dv + 3), &heads);
    per &= ~(size_t)15;
    size_t at_sinks = 0;
    if (over || mha__mul_overflow_size(per_head ? per : sf, (size_t)nt, &floats) ||
        mha__add_overflow_size(floats, heads, &floats) ||
        mha__add_overflow_size(floats, floats & 1, &at_sinks) ||
        mha__add_overflow_size(at_sinks, dsinks ? 2 * (size_t)(B * H) : 0, &floats) ||
        mha__mul_overflow_size(floats, sizeof(float), &bytes))
        return mha__fail(MHA_ERR_OVERFLOW, "sdpa backward: scratch size overflows");
    float *blk = mha__scratch_alloc(bytes ? bytes : 1);
    if (!blk)
        return mha__fail(MHA_ERR_NOMEM, "sdpa backward: out of memory for %zu bytes", bytes);
    double *dsink_bh = dsinks ? (double *)(void *)(blk + at_sinks) : NULL;  // (B, H)
    if (per_head)
        sdpa_bwd_per_head(dq, dk, dv, dsink_bh, dout, q, k, v, mk, drop, scale, sf, per, nt,
                          blk, sv);
    else sdpa_bwd_tiles(dq, dk, dv, dsink_bh, dout, q, k, v, mk, drop, scale, sf, nt, blk, sv);
    for (int64_t h = 0; dsink_bh && h < H; h++) {  // dsinks_h = sum_b, b increasing
        double s = 0.0;
        for (int64_t b = 0; b < B; b++) s += dsink_bh[b * H + h];
        dsinks[h] = (float)s;
    }
    mha__scratch_free(blk, bytes ? bytes : 1);
    return MHA_OK;
}
