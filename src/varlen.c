// varlen.c: mha_sdpa_varlen, attention over variable-length sequences
// packed without padding (FlashAttention's cu_seqlens): each sequence's
// queries against its own keys, flash tiles per (sequence, head, tile),
// no work spent on padding.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "flash.h"
#include "rope.h"

void mha_varlen_args_init(mha_varlen_args *a) {
    if (!a) return;
    memset(a, 0, sizeof *a);
    a->opts.window_left = a->opts.window_right = -1;
}

// rows of a (total, heads, dim) view: dims checked, unit last stride, F32,
// BF16 or F16
static mha_status check_packed(const mha_tensor *t, const char *name) {
    mha_status st = mha__check_float(t, name);
    if (st) return st;
    if (t->ndim != 3) {
        char s[160];
        return mha__fail(MHA_ERR_SHAPE, "varlen: %s must be (total, heads, dim), got %s", name,
                         mha__shape_str(s, sizeof s, t->ndim, t->shape));
    }
    const bool empty = t->shape[0] == 0 || t->shape[1] == 0 || t->shape[2] == 0;
    if (t->dtype != MHA_F32 && t->dtype != MHA_BF16 && t->dtype != MHA_F16)
        return mha__fail(MHA_ERR_DTYPE, "varlen: %s must be F32, BF16 or F16, got %s", name,
                         mha_dtype_name(t->dtype));
    if (t->stride[2] != 1 && !empty)
        return mha__fail(MHA_ERR_UNSUPPORTED,
                         "varlen: %s must have unit stride along the head dim, got %lld", name,
                         (long long)t->stride[2]);
    return MHA_OK;
}

static mha_status check_cu(const int64_t *cu, int64_t nseq, int64_t total, const char *name) {
    if (!cu) return mha__fail(MHA_ERR_INVALID_ARG, "varlen: %s is NULL", name);
    if (cu[0] != 0 || cu[nseq] != total)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "varlen: %s must start at 0 and end at the %lld rows, got %lld .. %lld",
                         name, (long long)total, (long long)cu[0], (long long)cu[nseq]);
    for (int64_t b = 0; b < nseq; b++)
        if (cu[b + 1] < cu[b])
            return mha__fail(MHA_ERR_INVALID_ARG,
                             "varlen: %s decreases at %lld (%lld then %lld)", name,
                             (long long)b, (long long)cu[b], (long long)cu[b + 1]);
    return MHA_OK;
}

mha_status mha_sdpa_varlen(mha_tensor *out, const mha_tensor *q, const mha_tensor *k,
                           const mha_tensor *v, const mha_varlen_args *a) {
    if (!out || !q || !k || !v || !a)
        return mha__fail(MHA_ERR_INVALID_ARG, "mha_sdpa_varlen: NULL argument");
    mha_status st;
    if ((st = check_packed(q, "q")) || (st = check_packed(k, "k")) ||
        (st = check_packed(v, "v")) || (st = check_packed(out, "out")))
        return st;
    const int64_t H = q->shape[1], D = q->shape[2], Hkv = k->shape[1], Dv = v->shape[2];
    const int64_t nseq = a->num_seqs;
    if (nseq < 0)
        return mha__fail(MHA_ERR_INVALID_ARG, "varlen: num_seqs %lld < 0", (long long)nseq);
    if (Hkv < 1 || H % Hkv != 0 || k->shape[2] != D || v->shape[1] != Hkv ||
        v->shape[0] != k->shape[0] || out->shape[0] != q->shape[0] || out->shape[1] != H ||
        out->shape[2] != Dv) {
        char s1[160], s2[160], s3[160], s4[160];
        return mha__fail(MHA_ERR_SHAPE,
                         "varlen: q %s, k %s, v %s, out %s do not fit (Tq, H, D), (Tk, Hkv, "
                         "D), (Tk, Hkv, Dv), (Tq, H, Dv) with Hkv dividing H",
                         mha__shape_str(s1, sizeof s1, 3, q->shape),
                         mha__shape_str(s2, sizeof s2, 3, k->shape),
                         mha__shape_str(s3, sizeof s3, 3, v->shape),
                         mha__shape_str(s4, sizeof s4, 3, out->shape));
    }
    if ((st = check_cu(a->cu_seqlens_q, nseq, q->shape[0], "cu_seqlens_q")) ||
        (st = check_cu(a->cu_seqlens_k, nseq, k->shape[0], "cu_seqlens_k")))
        return st;
    if ((st = mha__check_attn_opts("varlen", &a->opts,
                                   MHA__REFUSE_DROPOUT | MHA__REFUSE_SINK_TOKENS)))
        return st;
    if ((st = mha__check_no_overlap(out, "out", q, "q")) ||
        (st = mha__check_no_overlap(out, "out", k, "k")) ||
        (st = mha__check_no_overlap(out, "out", v, "v")))
        return st;
    const double scale = a->opts.scale != 0.0 ? a->opts.scale : 1.0 / sqrt((double)D);
    float slopes_buf[MHA__ALIBI_MAX_DEFAULT];
    const float *slopes;
    if ((st = mha__attn_logit_params(&slopes, slopes_buf, &a->opts, H, "varlen"))) return st;
    int64_t maxk = 0, maxq = 0;
    double work = 0.0;
    for (int64_t b = 0; b < nseq; b++) {
        const int64_t lq = a->cu_seqlens_q[b + 1] - a->cu_seqlens_q[b],
                      lk = a->cu_seqlens_k[b + 1] - a->cu_seqlens_k[b];
        maxk = lk > maxk ? lk : maxk;
        maxq = lq > maxq ? lq : maxq;
        work += (double)lq * (double)lk * (double)H * (double)(D + Dv);
    }
    const int nt = work < MHA__PAR_MIN_WORK ? 1 : mha__max_threads();
    const size_t sf = mha__flash_scratch_floats(D, Dv, maxk, 0, false);
    size_t bytes;
    if (mha__mul_overflow_size(sf * sizeof(float), (size_t)nt, &bytes))
        return mha__fail(MHA_ERR_OVERFLOW, "varlen: scratch overflows");
    float *blk = mha__alloc(bytes);
    if (!blk) return mha__fail(MHA_ERR_NOMEM, "varlen: out of memory for %zu bytes", bytes);
    for (int t = 0; t < nt; t++) mha__flash_scratch_reset(blk + (size_t)t * sf);
    const mha__kernels *kt = mha__kernels_get();
    const int64_t tiles = (maxq + MHA__FLASH_BR - 1) / MHA__FLASH_BR;
    // items (sequence, head, tile of queries); a sequence's tiles past its
    // length are empty: no work on padding
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (int64_t it = 0; it < nseq * H * tiles; it++) {
        const int64_t b = it / (H * tiles), h = (it / tiles) % H, tile = it % tiles;
        const int64_t q0 = a->cu_seqlens_q[b], lq = a->cu_seqlens_q[b + 1] - q0,
                      k0 = a->cu_seqlens_k[b], lk = a->cu_seqlens_k[b + 1] - k0;
        const int64_t i0 = tile * MHA__FLASH_BR;
        if (i0 >= lq) continue;
        mha__mask mk;
        memset(&mk, 0, sizeof mk);
        mk.causal = a->opts.is_causal;
        mk.win_left = a->opts.window_left;
        mk.win_right = a->opts.window_right;
        mk.alibi = slopes;
        mk.softcap = a->opts.softcap;
        mk.sinks = a->opts.sinks;
        mk.s_masked = lk;
        const int64_t hk = h / (H / Hkv);
        // (half views: the pointers at their uint16_t elements, flash.h)
#define AT(t, r, hh)                                                                        \
    ((float *)(void *)((char *)(t)->data + ((r) * (t)->stride[0] + (hh) * (t)->stride[1]) * \
                                               (int64_t)mha_dtype_size((t)->dtype)))
        mha__flash_head fh = {
            .q = AT(q, q0, h),
            .q_rs = q->stride[0],
            .k = AT(k, k0, hk),
            .k_rs = k->stride[0],
            .v = AT(v, k0, hk),
            .v_rs = v->stride[0],
            .o = AT(out, q0, h),
            .o_rs = out->stride[0],
            .q_half = mha__half_of(q->dtype),
            .k_half = mha__half_of(k->dtype),
            .v_half = mha__half_of(v->dtype),
            .o_half = mha__half_of(out->dtype),
            .L = lq,
            .S = lk,
            .D = D,
            .Dv = Dv,
            .scale = (float)scale,
            .mask = &mk,
            .b = b,
            .h = h,
        };
        mha__flash_rows(kt, &fh, i0, mha__tile_end(i0, MHA__FLASH_BR, lq),
                        blk + (size_t)mha__thread_id() * sf);
#undef AT
    }
    mha__free(blk);
    mha__set_impl(true, mha_isa(),
                  mha__flash_bf16(kt, &(mha__flash_head){.q_half = mha__half_of(q->dtype),
                                                         .k_half = mha__half_of(k->dtype),
                                                         .v_half = mha__half_of(v->dtype)}));
    return MHA_OK;
}
