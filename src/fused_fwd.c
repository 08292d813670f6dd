// fused_fwd.c: the fused module forward (MHA_IMPL_FUSED), float32, and the
// fused mha_sdpa:
//   1. projections as GEMMs over row matrices: X (R, F) W^T (F, Eq) (k, v:
//      (F, Ekv), Ekv = Hkv d; Eq = H d, E unless head_dim is set); with
//      self-attention and the packed in_proj_weight, one GEMM X (R, E)
//      in_proj_weight^T (E, Eq + 2 Ekv) -> qkv (R, Eq + 2 Ekv); then the
//      QK-norm (mha_config.qk_norm) and RoPE on the q and k rows
//   2. per (b, h, tile of 64 query rows): flash.c on strided head views of
//      q, k, v (no split, no copy; query head h reads KV head h / (H / Hkv)),
//      writing the context in place
//   3. ctx (R, Eq) out_proj.weight^T (Eq, E) + bias, into the output
// Rows of an input view (d0, d1, F) are r = i0*d1 + i1; a view whose rows
// are evenly spaced with unit feature stride is used in place, any other
// is copied once. Work is split over rows (GEMMs) and over (b, h, tile)
// items (attention): each output element is computed by one thread in a
// fixed order, so results do not depend on the number of threads.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fused.h"
#include "linear.h"

// The forward's step 3 from the context ctx (Rq, Eq; gated in place when
// in_place, else into the scratch): the gates, W_O (+ out_proj.bias unless a
// part without it: pt), the output dropout, into out. xq: the query rows;
// pk: the module's packed weights held by the call, or NULL.
// bf: bf16 compute (fwd_bf16, no gates): ctx rounded to bf16 in place and
// multiplied by the bf16 W_O by gemm_bf16 (mha__linear_rows_bf16). Returns
// whether it did (else ctx stays float32: the float32 GEMM).
static bool out_project(const mha__kernels *kt, const fwd_plan *p, mha_tensor *out,
                        const mha_module *m, const mha__packs *pk, const mha_forward_args *a,
                        float *ctx, bool in_place, const float *xq, int64_t ldq, char *ws,
                        const mha__part *pt, bool bf) {
    const int64_t E = p->E, Eq = p->Eq, Rq = mha__rows_of(a->query);
    const int nt = p->nthreads;
    const bool seq_first = p->unbatched || !m->cfg.batch_first;
    float *wo = (float *)(ws + p->f.wo), *gs = (float *)(ws + p->f.gs),
          *wh = (float *)(ws + p->f.wh);
    int64_t ldo = E;
    bool direct = mha__rows_direct(out, &ldo);
    float *y = direct ? (float *)out->data : (float *)(ws + p->f.out);
    if (!direct) ldo = E;
    const float *octx = ctx;
    if (mha__module_gated(m)) {  // the heads' contexts times their gates (in place
                                 // unless the saved state keeps the ungated ctx)
        float *gctx = in_place ? ctx : (float *)(ws + p->f.gctx);
        mha__gate_rows(kt, (float *)(ws + p->f.gate), gctx, ctx, m, pk, xq, ldq, Rq,
                       (float *)(ws + p->f.wg), gs, nt);
        octx = gctx;
    }
    const float *ob = pt && !pt->bias ? NULL : m->out_bias;
    const bool rounded = bf && octx == ctx &&
                         mha__linear_rows_bf16(kt, y, ldo, ctx, Eq, (const uint16_t *)m->w_out,
                                               pk, ob, Rq, Eq, E, wo,
                                               mha__gemm_packed_b_floats(kt, Eq, E), nt);
    if (!rounded)
        mha__linear_rows(kt, y, ldo, octx, Eq, mha__wmat_of(m, m->w_out, wh, pk), ob, Rq, Eq,
                         E, wo, gs, nt);
    if (p->out_p > 0.0f)
        for (int64_t r = 0; r < Rq; r++) {
            int64_t n, t;
            mha__row_nt(p, seq_first, out, r, &n, &t);
            for (int64_t e = 0; e < E; e++)
                y[r * ldo + e] *= mha__out_drop_factor(a->opts.dropout_seed,
                                                       a->opts.dropout_offset, p->out_p, p->L,
                                                       p->E, n, t, e);
        }
    if (!direct)
        for (int64_t r = 0; r < Rq; r++) {
            mha__mat row = mha__view_row(out, r);
            mha__st_row(row, y + r * ldo, E);
        }
    return rounded;
}

typedef struct fwd_call fwd_call;
static bool fwd_bf16(const fwd_call *c);

// One fused forward's state, shared by its phases.
struct fwd_call {
    const fwd_plan *p;
    const mha_module *m;
    const mha_forward_args *a;
    const mha__part *pt;  // a part's hooks (fused.h), or NULL
    const mha__kernels *kt;
    const mha__packs *pk;  // the module's packed weights, or NULL (packs.c)
    char *ws;              // the plan's scratch (p->f)
    bool seq_first;        // rows are (t, n) (else (n, t))
    const float *xq;       // the query rows (Rq, E), row stride ldq
    int64_t ldq;
    mha__rowmap qm, km, vm;  // q (Rq, Eq), k and v (Rk, Ekv) after RoPE
    float *ctx;              // the context (Rq, Eq)
    float *lse;              // each row's (max, 1/sum) (N, H, L, 2), or NULL
};

// Rows [0, n) of W (n rows of `in` elements) from row r, as a weight matrix.
static mha__wmat weight_rows(const mha_module *m, const void *w, int64_t r, int64_t in,
                             float *wh, const mha__packs *pk) {
    const size_t es = mha_dtype_size(m->wdt);
    return mha__wmat_of(m, (const char *)w + (size_t)r * (size_t)in * es, wh, pk);
}

// A bias from element o, or NULL without one.
static const float *bias_at(const float *b, int64_t o) { return b ? b + o : NULL; }

// C (R, n) = X (R, in) W[r0, r0 + n)^T + b[r0, r0 + n) into C's columns
// from r0: on the bf16 unit when bf (mha__linear_rows_bf16: the whole
// matrix, r0 = 0; X's rows rounded in place, so never the caller's), else
// (or when the shapes do not fit it) the float32 packed GEMM.
static void project(const fwd_call *c, bool bf, float *C, int64_t ldc, const float *X,
                    int64_t ldx, const void *W, const float *b, int64_t r0, int64_t R,
                    int64_t in, int64_t n, float *Wp, float *gs) {
    const mha__kernels *kt = c->kt;
    const int nt = c->p->nthreads;
    if (bf && mha__linear_rows_bf16(kt, C, ldc, (float *)X, ldx, (const uint16_t *)W, c->pk, b,
                                    R, in, n, Wp, mha__gemm_packed_b_floats(kt, in, n), nt))
        return;
    mha__linear_rows(kt, C + r0, ldc, X, ldx,
                     weight_rows(c->m, W, r0, in, (float *)(c->ws + c->p->f.wh), c->pk),
                     bias_at(b, r0), R, in, n, Wp, gs, nt);
}

// 1. The projections q = Xq W_q^T + b_q, k = Xk W_k^T + b_k, v = Xv W_v^T +
//    b_v (one GEMM over the packed in_proj_weight for self-attention; a
//    part: only its heads' rows of the weights, into their columns), into
//    the scratch or, with a saved state, straight into it (the backward's
//    layout); then the QK-norm and RoPE on q and k.
static void fwd_project(fwd_call *c) {
    const fwd_plan *p = c->p;
    const mha_module *m = c->m;
    const mha_forward_args *a = c->a;
    const mha__part *pt = c->pt;
    const mha__kernels *kt = c->kt;
    const mha__packs *pk = c->pk;
    char *ws = c->ws;
    const int64_t N = p->N, L = p->L, S = p->S, E = p->E, H = p->H, d = p->d;
    const int64_t Rq = mha__rows_of(a->query), Rk = mha__rows_of(a->key);
    const int64_t Ekv = p->Ekv, Hkv = p->Hkv, G = H / Hkv, Eq = p->Eq, W3 = Eq + 2 * Ekv;
    const int nt = p->nthreads;
    const bool seq_first = c->seq_first;
    const float *xq = c->xq;
    const int64_t ldq = c->ldq;
    float *wt = (float *)(ws + p->f.wt), *gs = (float *)(ws + p->f.gs),
          *wh = (float *)(ws + p->f.wh);
    const float *bq = m->in_proj_bias, *bk = bq ? bq + Eq : NULL,
                *bv = bq ? bq + Eq + Ekv : NULL;
    mha_saved *sv = a->save;
    float *sbuf = sv ? sv->buf : NULL;
    // a part: only its heads' rows of the weights, into their columns
    const int64_t g0 = pt ? pt->g0 : 0, g1 = pt ? pt->g1 : Hkv, nq = (g1 - g0) * G * d,
                  nkv = (g1 - g0) * d, oq = g0 * G * d, okv = g0 * d;
    if (p->self_packed && pt) {
        float *qkv = sv ? sbuf : (float *)(ws + p->f.qkv);
        mha__linear_rows(kt, qkv + oq, W3, xq, ldq, weight_rows(m, m->w_q, oq, E, wh, pk),
                         bias_at(bq, oq), Rq, E, nq, wt, gs, nt);
        mha__linear_rows(kt, qkv + Eq + okv, W3, xq, ldq,
                         weight_rows(m, m->w_k, okv, E, wh, pk), bias_at(bk, okv), Rq, E, nkv,
                         wt, gs, nt);
        mha__linear_rows(kt, qkv + Eq + Ekv + okv, W3, xq, ldq,
                         weight_rows(m, m->w_v, okv, E, wh, pk), bias_at(bv, okv), Rq, E, nkv,
                         wt, gs, nt);
        c->qm = (mha__rowmap){qkv, W3, seq_first, N, L};
        c->km = (mha__rowmap){qkv + Eq, W3, seq_first, N, L};
        c->vm = (mha__rowmap){qkv + Eq + Ekv, W3, seq_first, N, L};
    } else if (p->self_packed) {
        float *qkv = sv ? sbuf : (float *)(ws + p->f.qkv);
        // bf16 compute: the gathered (never the caller's) bf16 rows, unless
        // gates read them later
        if (!(fwd_bf16(c) && !mha__module_gated(m) && xq == (const float *)(ws + p->f.xq) &&
              mha__linear_rows_bf16(kt, qkv, W3, (float *)(ws + p->f.xq), ldq,
                                    (const uint16_t *)m->w_in, pk, bq, Rq, E, W3, wt,
                                    mha__gemm_packed_b_floats(kt, E, W3), nt)))
            mha__linear_rows(kt, qkv, W3, xq, ldq, mha__wmat_of(m, m->w_in, wh, pk), bq, Rq, E,
                             W3, wt, gs, nt);
        c->qm = (mha__rowmap){qkv, W3, seq_first, N, L};
        c->km = (mha__rowmap){qkv + Eq, W3, seq_first, N, L};
        c->vm = (mha__rowmap){qkv + Eq + Ekv, W3, seq_first, N, L};
    } else {
        int64_t ldk = p->kdim, ldv = p->vdim;
        const float *xk = (const float *)(ws + p->f.xk), *xv = (const float *)(ws + p->f.xv);
        if (p->k_direct) mha__rows_direct(a->key, &ldk), xk = a->key->data;
        else mha__gather_rows((float *)xk, a->key);
        if (p->v_direct) mha__rows_direct(a->value, &ldv), xv = a->value->data;
        else mha__gather_rows((float *)xv, a->value);
        float *wq = wt, *wk = wq + mha__gemm_packed_b_floats(kt, E, Eq),
              *wv = wk + mha__gemm_packed_b_floats(kt, p->kdim, Ekv);
        float *q = sv ? sbuf : (float *)(ws + p->f.qkv),
              *k = sv ? sbuf + Rq * Eq : (float *)(ws + p->f.k),
              *v = sv ? sbuf + Rq * Eq + Rk * Ekv : (float *)(ws + p->f.v);
        // bf16 compute: each projection on the bf16 unit from its gathered
        // rows (never the caller's), unless gates read the query rows later
        // (no part then: the whole matrices)
        const bool bfp = fwd_bf16(c) && !mha__module_gated(m) &&
                         xq == (const float *)(ws + p->f.xq) &&
                         xk == (const float *)(ws + p->f.xk) &&
                         xv == (const float *)(ws + p->f.xv);
        project(c, bfp, q, Eq, xq, ldq, m->w_q, bq, oq, Rq, E, nq, wq, gs);
        project(c, bfp, k, Ekv, xk, ldk, m->w_k, bk, okv, Rk, p->kdim, nkv, wk, gs);
        project(c, bfp, v, Ekv, xv, ldv, m->w_v, bv, okv, Rk, p->vdim, nkv, wv, gs);
        c->qm = (mha__rowmap){q, Eq, seq_first, N, L};
        c->km = (mha__rowmap){k, Ekv, seq_first, N, S};
        c->vm = (mha__rowmap){v, Ekv, seq_first, N, S};
    }
    if (m->cfg.qk_norm != MHA_QK_NORM_NONE)
        mha__fused_qk_norm(p, m, &c->qm, &c->km, Rq, Rk,
                           sv ? sbuf + sv->n_qkv + sv->n_ctx + sv->n_lse : NULL);
    const int64_t *rope_pos = pt ? pt->attn.rope_pos : NULL;
    mha__rope_rows(p, a, &c->qm, L, H, false, rope_pos);
    mha__rope_rows(p, a, &c->km, S, Hkv, false, rope_pos);
}

// A part that wants the projections (sequence parallelism): q_out (Rq, Eq),
// k_out, v_out (Rk, Ekv), rows as the views'.
static void fwd_copy_projections(const fwd_call *c) {
    const int64_t Eq = c->p->Eq, Ekv = c->p->Ekv;
    const int64_t Rq = mha__rows_of(c->a->query), Rk = mha__rows_of(c->a->key);
    const mha__part *pt = c->pt;
    for (int64_t r = 0; r < Rq; r++)
        memcpy(pt->proj.q_out + r * Eq, c->qm.base + r * c->qm.ld, sizeof(float) * (size_t)Eq);
    for (int64_t r = 0; r < Rk; r++) {
        memcpy(pt->proj.k_out + r * Ekv, c->km.base + r * c->km.ld, sizeof(float) * (size_t)Ekv);
        memcpy(pt->proj.v_out + r * Ekv, c->vm.base + r * c->vm.ld, sizeof(float) * (size_t)Ekv);
    }
}

// Rows [r0, r1) of head (b, h)'s attention weights, for a tile whose rows
// are inside the selected block: into the averaging buffer headw, or (int8
// weights) a float tile first, or straight into the weights view. live:
// the head runs (else its weights are 0).
static void tile_weights(const fwd_call *c, mha_tensor *weights, const mha__flash_head *fh,
                         int64_t b, int64_t h, int64_t r0, int64_t r1, bool live, float *sc,
                         int tid) {
    const fwd_plan *p = c->p;
    const mha_forward_args *a = c->a;
    const int64_t Sp = p->Sp;
    float *headw = (float *)(c->ws + p->f.headw);
    const int64_t Hs = p->wh1 - p->wh0, Ls = p->wr1 - p->wr0, hs = h - p->wh0;
    mha__mat w;
    float *wq = NULL;  // int8 weights: the rows in float first
    if (a->need_weights && a->average_attn_weights) {
        w = (mha__mat){headw + ((b * Hs + hs) * Ls + r0 - p->wr0) * Sp, false, Sp, 1, 0};
    } else if (a->weights_scale) {
        wq = (float *)(c->ws + p->f.wtmp) + (size_t)tid * MHA__FLASH_BR * Sp;
        w = (mha__mat){wq, false, Sp, 1, 0};
    } else {
        int o = p->unbatched ? 0 : 1;
        w = mha__vmat((char *)weights->data +
                          ((p->unbatched ? 0 : b * weights->stride[0]) +
                           hs * weights->stride[o] + (r0 - p->wr0) * weights->stride[o + 1]) *
                              (int64_t)mha_dtype_size(weights->dtype),
                      weights->dtype, weights->stride[o + 1], weights->stride[o + 2]);
    }
    if (live) mha__flash_weights(c->kt, fh, r0, r1, w, sc);
    else
        for (int64_t r = 0; r < r1 - r0; r++)
            for (int64_t j = 0; j < Sp; j++) mha__st(w, r, j, 0.0);
    if (wq) {
        int o = p->unbatched ? 0 : 1;
        for (int64_t r = r0; r < r1; r++)
            mha__weights_row_out(weights, a->weights_scale, (b * Hs + hs) * Ls + r - p->wr0,
                                 (p->unbatched ? 0 : b * weights->stride[0]) +
                                     hs * weights->stride[o] +
                                     (r - p->wr0) * weights->stride[o + 1],
                                 NULL, wq + (r - r0) * Sp, Sp);
    }
}

// Whether a module trains in bf16 (mha__fused_backward_bf16's module
// part): no gates, and every projection's summed width (E, kdim, vdim and
// the context's Eq) at least 32, where mha__linear_rows_bf16 computes in
// bf16 (below it the float32 GEMM runs: the forward's rows would not be
// the bf16 ones the backward reads).
bool mha__fused_train_bf16_module(const mha_module *m) {
    const mha_config *c = &m->cfg;
    return !mha__module_gated(m) && c->embed_dim >= 32 && c->kdim >= 32 && c->vdim >= 32 &&
           m->q_dim >= 32;
}

// bf16 compute for a module forward (mha__flash_bf16's rule for the
// module): bf16 weight matrices and bf16 q, k, v inputs, no part, no
// appended keys, on a table that computes bf16 (bf_fast), and with a saved
// state no gates (a training forward: mha__fused_train_bf16): the projected
// q, k, v rows are rounded to bf16 in place, as PyTorch's bf16 module's
// projections are, the attention computes in bf16 (flash.h), and the
// context is rounded to bf16 in place for the output projection (W_O
// on the bf16 unit; a saved state keeps these rows).
bool mha__fused_forward_bf16(const mha_module *m, const mha_forward_args *a) {
    return mha__flash_bf16_table(mha__kernels_get()) && m->wdt == MHA_BF16 &&
           (!a->save || mha__fused_train_bf16_module(m)) && !m->cfg.add_bias_kv &&
           !m->cfg.add_zero_attn && a->query->dtype == MHA_BF16 && a->key->dtype == MHA_BF16 &&
           a->value->dtype == MHA_BF16;
}

static bool fwd_bf16(const fwd_call *c) {
    return !c->pt && c->p->Sp == c->p->S && mha__fused_forward_bf16(c->m, c->a);
}

// Whether c's q, k, v rows are the packed qkv rows of self-attention (one
// matrix: q, k, v columns side by side).
static bool qkv_packed(const fwd_call *c) {
    return c->km.base == c->qm.base + c->p->Eq && c->vm.base == c->km.base + c->p->Ekv &&
           c->km.ld == c->qm.ld && c->vm.ld == c->qm.ld;
}

// The rows of c's q, k and v rowmaps to bf16 in place (the packed qkv rows
// of self-attention once, as one matrix).
static void fwd_round_qkv(const fwd_call *c) {
    const fwd_plan *p = c->p;
    const int64_t Rq = mha__rows_of(c->a->query), Rk = mha__rows_of(c->a->key);
    if (qkv_packed(c)) {
        mha__bf16_rows_in_place(c->kt, c->qm.base, c->qm.ld, Rq, p->Eq + 2 * p->Ekv,
                                p->nthreads);
        return;
    }
    mha__bf16_rows_in_place(c->kt, c->qm.base, c->qm.ld, Rq, p->Eq, p->nthreads);
    mha__bf16_rows_in_place(c->kt, c->km.base, c->km.ld, Rk, p->Ekv, p->nthreads);
    mha__bf16_rows_in_place(c->kt, c->vm.base, c->vm.ld, Rk, p->Ekv, p->nthreads);
}

// 2. The attention, per (b, h, tile of query rows): flash tiles on the
//    strided head views of q, k, v (query head h reads KV head h / G), the
//    context written in place (pruned heads and heads outside a part: zero,
//    no work), each row's stats when wanted, the tile's weights in the
//    selected block. A part's attn hook replaces it (ring attention).
static mha_status fwd_attend(fwd_call *c, mha_tensor *weights) {
    const fwd_plan *p = c->p;
    const mha_module *m = c->m;
    const mha_forward_args *a = c->a;
    const mha__part *pt = c->pt;
    const mha__kernels *kt = c->kt;
    char *ws = c->ws;
    const int64_t N = p->N, L = p->L, S = p->S, Sp = p->Sp, Eq = p->Eq, H = p->H, d = p->d;
    const int64_t nx = Sp - S, Hkv = p->Hkv;
    const int nt = p->nthreads;
    const bool seq_first = c->seq_first;
    mha_saved *sv = a->save;
    float *sbuf = sv ? sv->buf : NULL;
    // the appended keys per KV head: (nx, d) for k, then for v
    float *extra = (float *)(ws + p->f.extra);
    mha__fill_extra(extra, m, Hkv, nx, d);
    c->ctx = pt && pt->out.ctx ? pt->out.ctx
             : sv              ? sbuf + sv->n_qkv
                               : (float *)(ws + p->f.ctx);
    c->lse = pt && pt->block.stats ? pt->block.stats
             : sv                  ? sbuf + sv->n_qkv + sv->n_ctx
             : a->need_weights     ? (float *)(ws + p->f.lse)
                                   : NULL;
    float *lse = c->lse;
    const mha__rowmap qm = c->qm, km = c->km, vm = c->vm, cm = {c->ctx, Eq, seq_first, N, L};
    const int64_t tiles = (L + MHA__FLASH_BR - 1) / MHA__FLASH_BR;
    const size_t sf = mha__flash_scratch_floats(d, d, S, nx, false);
    float *scratch = (float *)(ws + p->f.scratch);
    for (int t = 0; t < nt; t++) mha__flash_scratch_reset(scratch + (size_t)t * sf);
    const bool ext = pt && pt->attn.fn;  // attention done by the caller (ring)
    if (ext) {
        const mha__attn_io io = {.N = N,
                                 .L = L,
                                 .S = S,
                                 .seq_first = seq_first,
                                 .q = qm.base,
                                 .k = km.base,
                                 .v = vm.base,
                                 .ldq = qm.ld,
                                 .ldk = km.ld,
                                 .ctx = c->ctx,
                                 .stats = sv ? lse : NULL};
        mha_status st = pt->attn.fn(pt->attn.arg, &io);
        if (st) return st;
    }
    const bool bf = !ext && fwd_bf16(c);
    if (bf) fwd_round_qkv(c);
    int64_t ntiles = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt) reduction(+ : ntiles)
    for (int64_t item = 0; item < (ext ? 0 : N * H * tiles); item++) {
        // causal rows near the end cost more: hand them out first
        int64_t it = p->mask.causal ? N * H * tiles - 1 - item : item;
        int64_t bh = it / tiles, tile = it % tiles, b = bh / H, h = bh % H;
        int tid = mha__thread_id();
        mha__flash_head fh = mha__plan_head(p, &qm, &km, &vm, &cm, extra, lse, b, h);
        if (bf) mha__head_to_bf16(&fh, &c->qm, &c->km, &c->vm, qkv_packed(c));
        int64_t i0 = tile * MHA__FLASH_BR, i1 = mha__tile_end(i0, MHA__FLASH_BR, L);
        float *sc = scratch + (size_t)tid * sf;
        const bool live =
            mha__plan_head_live(p, m, h);  // pruned / not in the part: no work, zero context
        if (live) mha__flash_rows(kt, &fh, i0, i1, sc);
        else mha__zero_head_rows(fh.o, fh.o_rs, i0, i1, d);
        if (live && pt && pt->progress.tiles) ntiles += mha__key_tiles(&fh, i0, i1);
        if (pt && pt->progress.fn && tid == 0) pt->progress.fn(pt->progress.arg);
        // the weights of this tile's rows in the selected block
        const int64_t r0 = i0 > p->wr0 ? i0 : p->wr0, r1 = i1 < p->wr1 ? i1 : p->wr1;
        if (a->need_weights && h >= p->wh0 && h < p->wh1 && r0 < r1)
            tile_weights(c, weights, &fh, b, h, r0, r1, live, sc, tid);
    }
    if (pt && pt->progress.tiles) *pt->progress.tiles += ntiles;
    if (sv) sv->valid = true, sv->bf16 = bf;
    return MHA_OK;
}

// The averaged weights: the mean over the selected live heads of their
// rows in headw, summed in head order, into the weights view (int8: each
// row in float first).
static void fwd_average_weights(const fwd_call *c, mha_tensor *weights) {
    const fwd_plan *p = c->p;
    const mha_module *m = c->m;
    const mha_forward_args *a = c->a;
    const int64_t N = p->N, Sp = p->Sp;
    const float *headw = (const float *)(c->ws + p->f.headw);
    const int64_t Hs = p->wh1 - p->wh0, Ls = p->wr1 - p->wr0;
    const float nlive = (float)(mha__live_in(m, p->wh0, p->wh1)
                                    ? mha__live_in(m, p->wh0, p->wh1)
                                    : 1);
    int o = p->unbatched ? 0 : 1;
    for (int64_t b = 0; b < N; b++)
        for (int64_t i = 0; i < Ls; i++) {
            const int64_t off = (p->unbatched ? 0 : b * weights->stride[0]) +
                                i * weights->stride[o];
            if (a->weights_scale) {  // int8 weights: the row in float first
                float *row = (float *)(c->ws + p->f.wtmp);
                for (int64_t j = 0; j < Sp; j++) {
                    float s = 0.0f;
                    for (int64_t h = 0; h < Hs; h++)
                        s += headw[((b * Hs + h) * Ls + i) * Sp + j];
                    row[j] = s / nlive;
                }
                mha__weights_row_out(weights, a->weights_scale, b * Ls + i, off, NULL, row, Sp);
                continue;
            }
            mha__mat wr = mha__vmat((char *)weights->data +
                                        off * (int64_t)mha_dtype_size(weights->dtype),
                                    weights->dtype, 0, weights->stride[o + 1]);
            for (int64_t j = 0; j < Sp; j++) {
                float s = 0.0f;
                for (int64_t h = 0; h < Hs; h++) s += headw[((b * Hs + h) * Ls + i) * Sp + j];
                mha__st(wr, 0, j, s / nlive);
            }
        }
}

// The forward's phases, with the module's packed weights held (c->pk).
static mha_status fused_forward(fwd_call *cp, mha_tensor *out, mha_tensor *weights) {
    fwd_call c = *cp;
    const fwd_plan *p = c.p;
    const mha_module *m = c.m;
    const mha_forward_args *a = c.a;
    const mha__part *pt = c.pt;
    char *ws = c.ws;
    const int64_t N = p->N, L = p->L, S = p->S, Eq = p->Eq, Ekv = p->Ekv;
    // the query rows: the view in place, or gathered
    if (p->q_direct) mha__rows_direct(a->query, &c.ldq), c.xq = a->query->data;
    else if (!(pt && pt->proj.q_in)) mha__gather_rows((float *)c.xq, a->query);
    // 1. Projections (a part may bring its own: projected elsewhere, or
    //    want them back without attending).
    if (pt && pt->proj.q_in) {
        c.qm = (mha__rowmap){(float *)pt->proj.q_in, Eq, c.seq_first, N, L};
        c.km = (mha__rowmap){(float *)pt->proj.k_in, Ekv, c.seq_first, N, S};
        c.vm = (mha__rowmap){(float *)pt->proj.v_in, Ekv, c.seq_first, N, S};
    } else {
        fwd_project(&c);
        if (pt && pt->proj.q_out) {
            fwd_copy_projections(&c);
            return MHA_OK;
        }
    }
    // 2. Attention.
    mha_status st = fwd_attend(&c, weights);
    if (st) return st;
    if (pt && pt->out.ctx) return MHA_OK;  // a part's context: the caller goes on
    if (a->need_weights && a->average_attn_weights) fwd_average_weights(&c, weights);
    // 3. Output projection (rows in the query's order, as ctx), then the
    //    output dropout, into the output view.
    const bool rounded = out_project(c.kt, p, out, m, c.pk, a, c.ctx, !a->save, c.xq, c.ldq,
                                     ws, pt, fwd_bf16(&c) && !mha__module_gated(m));
    // a bf16 state keeps the context's bf16 rows; without them (the float32
    // GEMM ran) the backward recomputes rather than misread it
    if (a->save && a->save->bf16 && !rounded) a->save->valid = false;
    return MHA_OK;
}

mha_status mha__fused_forward(const fwd_plan *p, mha_tensor *out, mha_tensor *weights,
                              const mha_module *m, const mha_forward_args *a, char *ws,
                              const mha__part *pt) {
    mha_status st = mha__fused_part_qk_norm(m, pt);
    if (st) return st;
    fwd_call c = {.p = p,
                  .m = m,
                  .a = a,
                  .pt = pt,
                  .kt = mha__kernels_get(),
                  .ws = ws,
                  .seq_first = p->unbatched || !m->cfg.batch_first,
                  .ldq = p->E,
                  .xq = (const float *)(ws + p->f.xq)};
    // (a part that brings its projections and takes the context multiplies
    // by no weight)
    const bool multiplies = !(pt && pt->proj.q_in && pt->out.ctx);
    c.pk = multiplies ? mha__packs_acquire(m, c.kt, p->nthreads) : NULL;
    st = fused_forward(&c, out, weights);
    mha__packs_release(c.pk);
    return st;
}

void mha__fused_out_project(const fwd_plan *p, mha_tensor *out, const mha_module *m,
                            const mha_forward_args *a, float *ctx, char *ws) {
    int64_t ldq = p->E;
    const float *xq = (const float *)(ws + p->f.xq);
    if (p->q_direct) mha__rows_direct(a->query, &ldq), xq = a->query->data;
    else mha__gather_rows((float *)xq, a->query);
    const mha__kernels *kt = mha__kernels_get();
    const mha__packs *pk = mha__packs_acquire(m, kt, p->nthreads);
    (void)out_project(kt, p, out, m, pk, a, ctx, true, xq, ldq, ws, NULL, false);
    mha__packs_release(pk);
}


// ---------------------------------------------------------------------------
// Scaled dot-product attention on (B, H, T, D) views (mha_sdpa, fused): one
// flash head per (b, h), items (b, h, tile of query rows) over the threads.
// q, k, v, out of F32, BF16 or F16 (each its own): half rows are converted
// to float32 tile by tile as the head loads them, out rounded once per row
// (flash.h); no float32 copy of a tensor. Extra memory: per thread the
// flash scratch (O((S) (D + Dv))), plus the row stats (B H L 2 floats) when
// the weights are asked for.

bool mha__fused_sdpa_bf16(const mha_tensor *q, const mha_tensor *k, const mha_tensor *v) {
    const mha__flash_head fh = {.q_half = mha__half_of(q->dtype),
                                .k_half = mha__half_of(k->dtype),
                                .v_half = mha__half_of(v->dtype)};
    return mha__flash_bf16(mha__kernels_get(), &fh);
}

mha_status mha__fused_sdpa(mha_tensor *out, mha_tensor *weights, const mha_tensor *q,
                           const mha_tensor *k, const mha_tensor *v, const mha__mask *mk,
                           const mha__dropout *drop, double scale, mha_saved *sv) {
    const mha__kernels *kt = mha__kernels_get();
    const int64_t B = q->shape[0], H = q->shape[1], L = q->shape[2], D = q->shape[3],
                  S = k->shape[2], Dv = v->shape[3];
    const int nt = (double)B * H * L * S * (D + Dv) < MHA__PAR_MIN_WORK ? 1
                                                                        : mha__max_threads();
    const size_t sf = mha__flash_scratch_floats(D, Dv, S, 0, false);
    size_t n_stats = weights ? (size_t)(2 * B * H * L) : 0, floats, bytes;
    if (mha__mul_overflow_size(sf, (size_t)nt, &floats) ||
        mha__add_overflow_size(floats, n_stats, &floats) ||
        mha__mul_overflow_size(floats, sizeof(float), &bytes))
        return mha__fail(MHA_ERR_OVERFLOW, "sdpa: scratch size overflows");
    float *blk = mha__scratch_alloc(bytes);
    if (!blk) return mha__fail(MHA_ERR_NOMEM, "sdpa: out of memory for %zu bytes", bytes);
    float *stats = weights ? blk + sf * (size_t)nt : NULL;
    // a training forward's state: O (B, H, L, Dv) and the stats kept there
    float *so = sv ? sv->buf : NULL;
    if (sv) stats = sv->buf + sv->n_ctx;
    for (int t = 0; t < nt; t++) mha__flash_scratch_reset(blk + (size_t)t * sf);
    const int64_t tiles = (L + MHA__FLASH_BR - 1) / MHA__FLASH_BR, items = B * H * tiles;
    const bool back_first = mk->causal || mk->win_left >= 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (int64_t item = 0; item < items; item++) {
        // causal rows near the end cost more: hand them out first
        int64_t it = back_first ? items - 1 - item : item;
        int64_t bh = it / tiles, tile = it % tiles, b = bh / H, h = bh % H;
        float *sc = blk + (size_t)mha__thread_id() * sf;
        const int64_t hk = h / (H / k->shape[1]);  // grouped-query: the KV head
#define AT(t, i) ((float *)mha__view_at((t), (t)->stride[0] * b + (t)->stride[1] * (i), 3).p)
#define HEAD_PTR(t) AT(t, h)
#define KV_PTR(t) AT(t, hk)
        mha__flash_head fh = {
            .q = HEAD_PTR(q),
            .q_rs = q->stride[2],
            .k = KV_PTR(k),
            .k_rs = k->stride[2],
            .v = KV_PTR(v),
            .v_rs = v->stride[2],
            .xk = NULL,
            .xv = NULL,
            .nx = 0,
            .o = so ? so + bh * L * Dv : HEAD_PTR(out),
            .o_rs = so ? Dv : out->stride[2],
            .stats = stats ? stats + 2 * bh * L : NULL,
            .L = L,
            .S = S,
            .D = D,
            .Dv = Dv,
            .q_half = mha__half_of(q->dtype),
            .k_half = mha__half_of(k->dtype),
            .v_half = mha__half_of(v->dtype),
            .o_half = so ? 0 : mha__half_of(out->dtype),
            .scale = (float)scale,
            .mask = mk,
            .drop = drop,
            .b = b,
            .h = h,
        };
        int64_t i0 = tile * MHA__FLASH_BR, i1 = mha__tile_end(i0, MHA__FLASH_BR, L);
        mha__flash_rows(kt, &fh, i0, i1, sc);
        if (so) {  // the kept float32 rows into out, rounded once as flash.c does
            mha__mat o = mha__view_at(out, out->stride[0] * b + out->stride[1] * h, 3);
            for (int64_t i = i0; i < i1; i++) {
                mha__mat row = o;
                row.p = (char *)o.p + i * out->stride[2] * (int64_t)mha_dtype_size(out->dtype);
                mha__st_row(row, so + (bh * L + i) * Dv, Dv);
            }
        }
        if (weights) {
            mha__mat w = mha__view_at(weights,
                                      weights->stride[0] * b + weights->stride[1] * h +
                                          weights->stride[2] * i0,
                                      3);
            w.rs = weights->stride[2];
            mha__flash_weights(kt, &fh, i0, i1, w, sc);
        }
#undef HEAD_PTR
#undef KV_PTR
#undef AT
    }
    mha__scratch_free(blk, bytes);
    if (sv) sv->valid = true, sv->bf16 = mha__fused_sdpa_bf16(q, k, v);
    return MHA_OK;
}
