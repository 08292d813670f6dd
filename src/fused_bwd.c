// fused_bwd.c: the fused backward (MHA_IMPL_FUSED): the forward's projections and attention again
// (keeping each row's softmax stats), then
//   dy = dY * drop_o;  dctx = dy Wo;  dWo = dy^T ctx;  dbo = colsum(dy)
//   attention backward (flash.c, two passes) -> dq, dk, dv; through RoPE
//   and the QK-norm
//   dW = d^T X and dX = d W for each projection (one GEMM each over the
//   packed in_proj_weight with self-attention)
// Every sum has a fixed order: GEMMs split over output rows, attention
// over (b, h, tile) items. The gradients' GEMMs and sums are
// fused_grads.c's; the fused mha_sdpa backward is fused_sdpa_bwd.c's.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fused.h"
#include "fused_grads.h"
#include "linear.h"

// The fused backward's scratch, one block of floats, as named pieces:
//   xq (Rq, E), xk (Rk, kdim), xv (Rk, vdim)  the gathered inputs
//   wt                the packed weights of the forward's projections
//   bp, gs            the packed B of the backward's GEMMs, GEMM scratch
//   qkv, dqkv         the projections and their gradients (mha__qkv_floats)
//   ctx, dctx, dy     (Rq, Eq), (Rq, Eq), (Rq, E)
//   lse (N, H, L, 2)  each row's (max, 1/sum); dsum (N, H, L)
//   dextra            the appended keys' dk (N, Hkv, nx, d), then dv
//   extra             the appended keys (Hkv, nx, d) for k, then v
//   tmp               Rmax Fmax (dX rows)
//   xqk, rr           qk_norm: q (Rq, Eq) and k (Rk, Ekv) before the norm;
//                     per row and group 1 / rms (doubles, the q's or the k's)
//   wh                half weights: the widening scratch of their packing
//   wf                a half gradient module (or bf16 compute): one
//                     weight's float32 sums
//   a16, c16, bp16    bf16 compute (bwd_bf16): a GEMM's left operand (rows
//                     or transposed), the context's bf16 rows (recomputed
//                     forward), a packed right operand
//   scratch           nt flash scratches (64-byte aligned: it begins with
//                     pointers)
typedef struct bwd_scratch {
    float *xq, *xk, *xv, *wt, *bp, *gs, *qkv, *dqkv, *ctx, *dctx, *dy, *lse, *dsum, *dextra,
        *extra, *tmp, *xqk, *wh, *wf, *scratch;
    uint16_t *a16, *c16, *bp16;
    double *rr;
    size_t sf;  // floats of one flash scratch
} bwd_scratch;

// One fused backward's state, shared by its phases.
typedef struct bwd_call {
    const fwd_plan *p;
    const mha_module *m;
    const mha_module *grads;  // the gradient module, or NULL
    const mha_forward_args *a;
    const mha__part *pt;  // a part's hooks (fused.h), or NULL
    const mha__kernels *kt;
    const mha__packs *pk;  // the module's packed weights, or NULL (packs.c)
    bool acc;              // += instead of =
    bool bf;               // bf16 compute (mha__fused_backward_bf16)
    bwd_scratch s;
    float *blk;  // the block s is carved from (mha__scratch_alloc)
    size_t blk_bytes;
    float *gbuf;  // gated: gate (Rq, H), dg (Rq, H), gctx (Rq, Eq), packed W_g
    float *gate, *dg, *gctx;
    const float *dy;  // dy (Rq, E), row stride lddy: dY's rows or s.dy
    int64_t lddy;
    const mha_saved *sv;  // a valid saved forward, or NULL
    // the input rows (in place or gathered) and their row strides
    const float *Xq, *Xk, *Xv;
    int64_t ldq, ldk, ldv;
    // q, k, v and their gradients inside qkv / dqkv; row stride of q (W3)
    // and of k, v (ldkv)
    float *q, *k, *v, *dq, *dk, *dv;
    int64_t W3, ldkv;
    // bf16 compute: the context's bf16 rows (the saved ones, or s.c16) and
    // their row stride in elements
    const uint16_t *ctx16;
    int64_t ldc16;
    mha__rowmap qm, km, vm, cm, dcm, dqm, dkm, dvm;
    mha__attn_io io;  // what a part's attn hook sees
} bwd_call;

// Sizes and allocates the scratch (one block), carved into c->s.
static mha_status bwd_alloc(bwd_call *c) {
    const fwd_plan *p = c->p;
    const mha__kernels *kt = c->kt;
    const mha_forward_args *a = c->a;
    const int64_t N = p->N, L = p->L, S = p->S, Sp = p->Sp, E = p->E, H = p->H, d = p->d;
    const int64_t nx = Sp - S, Rq = mha__rows_of(a->query), Rk = mha__rows_of(a->key);
    const int64_t kd = p->kdim, vd = p->vdim, Rmax = Rq > Rk ? Rq : Rk;
    const int64_t Ekv = p->Ekv, Hkv = p->Hkv, Eq = p->Eq;
    const int nt = p->nthreads;
    const bool sp = p->self_packed;
    const int64_t W3 = sp ? Eq + 2 * Ekv : Eq;  // row stride of q (and k, v when packed)
    const int64_t Fmax = E > kd ? (E > vd ? E : vd) : (kd > vd ? kd : vd);
    // the widest B of a backward GEMM: X (R, I) of I <= max(Fmax, Eq) (Eq:
    // the context, dWo), W (O, I) of O <= max(E, Eq) (dX = d W, dctx = dy Wo)
    const int64_t Bmax = Fmax > Eq ? Fmax : Eq, Omax = E > Eq ? E : Eq;
    // Scratch, floats, one block:
    const size_t sf = mha__flash_scratch_floats(d, d, S, nx, true);
    size_t n_x = (size_t)(Rq * E + Rk * (kd + vd));  // gathered inputs
    // packed weights (forward), packed B of the backward GEMMs, GEMM scratch
    const size_t pw_q = mha__gemm_packed_b_floats(kt, E, Eq),
                 pw_k = mha__gemm_packed_b_floats(kt, kd, Ekv),
                 pw_v = mha__gemm_packed_b_floats(kt, vd, Ekv);
    size_t n_w = sp ? mha__gemm_packed_b_floats(kt, E, W3) : pw_q + pw_k + pw_v;
    size_t n_bp = mha__gemm_packed_b_floats(kt, Rmax, Bmax),
           n_bp2 = mha__gemm_packed_b_floats(kt, Omax, Bmax),
           n_gs = mha__gemm_scratch_floats(kt, nt);
    if (n_bp2 > n_bp) n_bp = n_bp2;
    n_w += n_bp + n_gs;
    size_t n_qkv = mha__qkv_floats(p, Rq, Rk);
    size_t n_att = (size_t)(Rq * (2 * Eq + E) + N * H * L * 3 + 2 * N * Hkv * nx * d +
                            2 * Hkv * nx * d);
    size_t n_tmp = (size_t)(Rmax * Fmax);
    // qk_norm: q, k before the norm; 1 / rms per row and group (doubles,
    // from an even float)
    const bool qkn = c->m->cfg.qk_norm != MHA_QK_NORM_NONE,
               head = c->m->cfg.qk_norm == MHA_QK_NORM_HEAD;
    const int64_t nrr = head ? (Rq * H > Rk * Hkv ? Rq * H : Rk * Hkv) : Rmax;
    const size_t n_qn = mha__xqk_floats(p, c->m, Rq, Rk),
                 n_rr = qkn ? (size_t)(2 * nrr + 1) : 0;
    // half weights: the widening scratch of a packing (K <= max(Fmax, E,
    // Eq)); a half gradient module: the widest weight's float32 sums
    const int64_t Kmax = Fmax > Omax ? Fmax : Omax;
    const size_t n_wh = c->m->wdt != MHA_F32 ? mha__gemm_pack_half_tmp_floats(kt, Kmax, nt) : 0;
    size_t n_wf = 0;
    if (c->grads && (c->grads->wdt != MHA_F32 || c->bf)) {
        const int64_t big[4] = {sp ? W3 * E : Eq * E, Ekv * kd, Ekv * vd, E * Eq};
        for (int i = 0; i < 4; i++)
            if ((size_t)big[i] > n_wf) n_wf = (size_t)big[i];
    }
    // bf16 compute: a16 holds any left operand: rows (R, w) or transposed
    // (w, R) of a width w <= Wmax, padded to bf_kpad; bp16 the widest
    // packed right operand; c16 the context's rows (uint16_t elements, each
    // piece 16-float aligned)
    size_t n_a16 = 0, n_c16 = 0, n_bp16 = 0;
    if (c->bf) {
        const int64_t kp = kt->bf_kpad, Wmax = W3 > Fmax ? W3 : Fmax;
        n_a16 = (size_t)((Rmax + kp) * (Wmax + kp));
        n_c16 = (size_t)(Rq * (Eq + kp));
        const int64_t pk[][2] = {{E, W3},  {kd, Ekv},    {vd, Ekv}, {E, Eq},
                                 {Rq, Eq}, {Rmax, Fmax}, {Eq, E},   {Ekv, Fmax}};
        for (size_t i = 0; i < sizeof pk / sizeof pk[0]; i++) {
            const size_t e = (size_t)mha__bf16_packed_elems(pk[i][0], pk[i][1], kp);
            if (e > n_bp16) n_bp16 = e;
        }
    }
    const size_t f_a16 = (n_a16 + 31) / 32 * 16, f_c16 = (n_c16 + 31) / 32 * 16,
                 f_bp16 = (n_bp16 + 31) / 32 * 16;
    // (the flash scratch starts 64-byte aligned: it begins with pointers)
    size_t n_pre = (n_x + n_w + 2 * n_qkv + n_att + n_tmp + n_wh + n_wf + n_qn + n_rr + 15) &
                   ~(size_t)15;
    n_pre += f_a16 + f_c16 + f_bp16;
    size_t total = n_pre + sf * (size_t)nt;
    size_t bytes;
    if (mha__mul_overflow_size(total, sizeof(float), &bytes))
        return mha__fail(MHA_ERR_OVERFLOW, "fused backward: scratch size overflows");
    float *blk = mha__scratch_alloc(bytes);
    if (!blk)
        return mha__fail(MHA_ERR_NOMEM, "fused backward: out of memory for %zu bytes", bytes);
    bwd_scratch *s = &c->s;
    c->blk = blk, c->blk_bytes = bytes;
    s->sf = sf;
    s->xq = blk, s->xk = s->xq + Rq * E, s->xv = s->xk + Rk * kd;
    s->wt = s->xv + Rk * vd, s->bp = s->wt + (n_w - n_bp - n_gs), s->gs = s->bp + n_bp;
    s->qkv = s->wt + n_w, s->dqkv = s->qkv + n_qkv;
    s->ctx = s->dqkv + n_qkv, s->dctx = s->ctx + Rq * Eq, s->dy = s->dctx + Rq * Eq;
    s->lse = s->dy + Rq * E, s->dsum = s->lse + 2 * N * H * L;  // lse: (m, 1/l) rows
    s->dextra = s->dsum + N * H * L, s->extra = s->dextra + 2 * N * Hkv * nx * d;
    s->tmp = s->extra + 2 * Hkv * nx * d, s->wh = s->tmp + n_tmp, s->wf = s->wh + n_wh;
    s->xqk = s->wf + n_wf, s->scratch = blk + n_pre;
    float *b16 = blk + n_pre - (f_a16 + f_c16 + f_bp16);
    s->a16 = (uint16_t *)(void *)b16;
    s->c16 = (uint16_t *)(void *)(b16 + f_a16);
    s->bp16 = (uint16_t *)(void *)(b16 + f_a16 + f_c16);
    s->rr = (double *)(blk + ((size_t)(s->xqk + n_qn - blk + 1) & ~(size_t)1));
    for (int t = 0; t < nt; t++) mha__flash_scratch_reset(s->scratch + (size_t)t * sf);
    c->W3 = W3;
    return MHA_OK;
}

// The inputs as rows (in place, or gathered into the scratch); a saved
// forward (mha_forward_args.save), checked against these args, replaces
// the recomputation: its projections, context and row stats are used.
static mha_status bwd_inputs(bwd_call *c) {
    const fwd_plan *p = c->p;
    const mha_forward_args *a = c->a;
    const int64_t N = p->N, L = p->L, H = p->H, E = p->E, kd = p->kdim, vd = p->vdim;
    const int64_t Rq = mha__rows_of(a->query), Rk = mha__rows_of(a->key), Ekv = p->Ekv;
    const int64_t Eq = p->Eq;
    bwd_scratch *s = &c->s;
    c->ldq = E, c->ldk = kd, c->ldv = vd;
    c->Xq = s->xq, c->Xk = s->xk, c->Xv = s->xv;
    if (mha__rows_direct(a->query, &c->ldq)) c->Xq = a->query->data;
    else mha__gather_rows(s->xq, a->query), c->ldq = E;
    if (mha__rows_direct(a->key, &c->ldk)) c->Xk = a->key->data;
    else mha__gather_rows(s->xk, a->key), c->ldk = kd;
    if (mha__rows_direct(a->value, &c->ldv)) c->Xv = a->value->data;
    else mha__gather_rows(s->xv, a->value), c->ldv = vd;
    const mha_saved *sv = a->save && a->save->valid ? a->save : NULL;
    c->sv = sv;
    if (sv) {
        mha__saved_key key;
        mha__saved_key_of(&key, c->m, a);
        if (!mha__saved_key_equal(&key, &sv->key) ||
            sv->outer_valid != (c->pt && c->pt->attn.fn) ||
            sv->n_qkv != mha__qkv_floats(p, Rq, Rk) || sv->n_lse != (size_t)(2 * N * H * L) ||
            sv->n_xqk != mha__xqk_floats(p, c->m, Rq, Rk) || sv->bf16 != c->bf)
            return mha__fail(MHA_ERR_INVALID_ARG,
                             "mha_backward: args.save holds the state of another forward "
                             "(module, inputs, masks or dropout differ); run the forward "
                             "with these args first, or pass save = NULL");
        s->qkv = sv->buf;
        // (bf16: the saved context rows are bf16; s->ctx stays the
        // scratch's, for their float32 values)
        if (c->bf) c->ctx16 = (const uint16_t *)(const void *)(sv->buf + sv->n_qkv);
        if (c->bf) c->ldc16 = 2 * Eq;
        else s->ctx = sv->buf + sv->n_qkv;
        s->lse = sv->buf + sv->n_qkv + sv->n_ctx;
        s->xqk = s->lse + sv->n_lse;
    }
    const bool sp = p->self_packed;
    float *qkv = s->qkv, *dqkv = s->dqkv;
    c->q = qkv, c->k = sp ? qkv + Eq : qkv + Rq * Eq;
    c->v = sp ? qkv + Eq + Ekv : c->k + Rk * Ekv;
    c->dq = dqkv, c->dk = sp ? dqkv + Eq : dqkv + Rq * Eq;
    c->dv = sp ? dqkv + Eq + Ekv : c->dk + Rk * Ekv;
    c->ldkv = sp ? c->W3 : Ekv;
    return MHA_OK;
}

// The module's weight matrix w from element e (in its storage: float32,
// bf16 or f16).
static mha__wmat weight_at(const bwd_call *c, const void *w, int64_t e) {
    return mha__wmat_of(c->m, (const char *)w + (size_t)e * mha_dtype_size(c->m->wdt), c->s.wh,
                        c->pk);
}

// The flash head (b, h) of the recomputed (or saved) forward.
static mha__flash_head bwd_head(const bwd_call *c, int64_t b, int64_t h) {
    return mha__plan_head(c->p, &c->qm, &c->km, &c->vm, &c->cm, c->s.extra, c->s.lse, b, h);
}

// The forward again (unless saved): the projections (a part: its heads'
// rows of the weights only, into their columns), RoPE, and the attention
// with each row's stats (a part's attn hook instead, for ring attention).
static mha_status bwd_forward(bwd_call *c) {
    const fwd_plan *p = c->p;
    const mha_module *m = c->m;
    const mha_forward_args *a = c->a;
    const mha__part *pt = c->pt;
    const mha__kernels *kt = c->kt;
    const int64_t N = p->N, L = p->L, S = p->S, Sp = p->Sp, E = p->E, H = p->H, d = p->d;
    const int64_t nx = Sp - S, Rq = mha__rows_of(a->query), Rk = mha__rows_of(a->key);
    const int64_t kd = p->kdim, vd = p->vdim, Ekv = p->Ekv, Hkv = p->Hkv, G = H / Hkv;
    const int64_t Eq = p->Eq;
    const int nt = p->nthreads;
    const bool seq_first = p->unbatched || !m->cfg.batch_first, sp = p->self_packed;
    const int64_t W3 = c->W3, ldkv = c->ldkv;
    const mha_saved *sv = c->sv;
    float *q = c->q, *k = c->k, *v = c->v, *wt = c->s.wt, *gs = c->s.gs, *wh = c->s.wh;
    const float *bq = m->in_proj_bias, *bk = bq ? bq + Eq : NULL,
                *bv = bq ? bq + Eq + Ekv : NULL;
    const size_t pw_q = mha__gemm_packed_b_floats(kt, E, Eq),
                 pw_k = mha__gemm_packed_b_floats(kt, kd, Ekv);
    const int64_t g0 = pt ? pt->g0 : 0, g1 = pt ? pt->g1 : Hkv, nq = (g1 - g0) * G * d,
                  nkv = (g1 - g0) * d, oq = g0 * G * d, okv = g0 * d;
    if (sv) {
    } else if (sp && !pt) {
        mha__linear_rows(kt, c->s.qkv, W3, c->Xq, c->ldq, mha__wmat_of(m, m->w_in, wh, c->pk),
                         bq, Rq, E, W3, wt, gs, nt);
    } else {
        float *wq = wt, *wk = sp ? wt : wq + pw_q, *wv = sp ? wt : wk + pw_k;
        mha__linear_rows(kt, q + oq, W3, c->Xq, c->ldq, weight_at(c, m->w_q, oq * E),
                         bq ? bq + oq : NULL, Rq, E, nq, wq, gs, nt);
        mha__linear_rows(kt, k + okv, ldkv, c->Xk, c->ldk, weight_at(c, m->w_k, okv * kd),
                         bk ? bk + okv : NULL, Rk, kd, nkv, wk, gs, nt);
        mha__linear_rows(kt, v + okv, ldkv, c->Xv, c->ldv, weight_at(c, m->w_v, okv * vd),
                         bv ? bv + okv : NULL, Rk, vd, nkv, wv, gs, nt);
    }
    mha__fill_extra(c->s.extra, m, Hkv, nx, d);
    const int64_t Tk = sp ? L : S;  // rows of k and v per batch element
    c->qm = (mha__rowmap){q, W3, seq_first, N, L};
    c->km = (mha__rowmap){k, ldkv, seq_first, N, Tk};
    c->vm = (mha__rowmap){v, ldkv, seq_first, N, Tk};
    c->cm = (mha__rowmap){c->s.ctx, Eq, seq_first, N, L};
    c->dcm = (mha__rowmap){c->s.dctx, Eq, seq_first, N, L};
    c->dqm = (mha__rowmap){c->dq, W3, seq_first, N, L};
    c->dkm = (mha__rowmap){c->dk, ldkv, seq_first, N, Tk};
    c->dvm = (mha__rowmap){c->dv, ldkv, seq_first, N, Tk};
    if (!sv) {  // the saved q, k are normalised and rotated already
        if (m->cfg.qk_norm != MHA_QK_NORM_NONE)
            mha__fused_qk_norm(p, m, &c->qm, &c->km, Rq, Rk, c->s.xqk);
        mha__rope_rows(p, a, &c->qm, L, H, false, pt ? pt->attn.rope_pos : NULL);
        mha__rope_rows(p, a, &c->km, S, Hkv, false, pt ? pt->attn.rope_pos : NULL);
    }
    const bool ext = pt && pt->attn.fn;  // attention done by the caller (ring)
    c->io = (mha__attn_io){.N = N,
                           .L = L,
                           .S = Tk,
                           .seq_first = seq_first,
                           .q = q,
                           .k = k,
                           .v = v,
                           .ldq = W3,
                           .ldk = ldkv,
                           .ctx = c->s.ctx,
                           .stats = sv ? c->s.lse : NULL};
    mha_status est = ext && !sv ? pt->attn.fn(pt->attn.arg, &c->io) : MHA_OK;
    if (est) return est;
    const int64_t tiles = (L + MHA__FLASH_BR - 1) / MHA__FLASH_BR;
    const size_t sf = c->s.sf;
    float *scratch = c->s.scratch;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (int64_t it = 0; it < (sv || ext ? 0 : N * H * tiles); it++) {
        int64_t bh = it / tiles, tile = it % tiles, b = bh / H, h = bh % H;
        int tid = mha__thread_id();
        mha__flash_head fh = bwd_head(c, b, h);
        int64_t i0 = tile * MHA__FLASH_BR, i1 = mha__tile_end(i0, MHA__FLASH_BR, L);
        if (mha__plan_head_live(p, m, h))
            mha__flash_rows(kt, &fh, i0, i1, scratch + (size_t)tid * sf);
        else mha__zero_head_rows(fh.o, fh.o_rs, i0, i1, d);
    }
    return MHA_OK;
}

// bf16 compute's products (below).
static void bf_grad_weight(const bwd_call *c, void *dW, mha_dtype dt, float *db,
                           const float *d, int64_t ldd, const uint16_t *X16, int64_t ldx16,
                           int64_t R, int64_t O, int64_t I);
static void bf_matmul(const bwd_call *c, float *C, int64_t ldc, const float *d, int64_t ldd,
                      const uint16_t *W, const uint16_t *Bp, int64_t R, int64_t K, int64_t N);
static void bf_grad_input(const bwd_call *c, mha_tensor *gx, bool acc, const float *d,
                          int64_t ldd, const void *W, int64_t R, int64_t O, int64_t I);

// dy = dY * drop_o (rows in the query's order: dY's own float32 rows in
// place when there is no output dropout, else copied); dctx = dy Wo (bf16
// compute: round(dy) Wo on the bf16 unit).
static void bwd_dctx(bwd_call *c, const mha_tensor *gout) {
    const fwd_plan *p = c->p;
    const mha_forward_args *a = c->a;
    const int64_t E = p->E, Rq = mha__rows_of(a->query);
    const bool seq_first = p->unbatched || !c->m->cfg.batch_first;
    float *dy = c->s.dy;
    c->dy = dy, c->lddy = E;
    if (p->out_p == 0.0f && mha__rows_direct(gout, &c->lddy)) c->dy = gout->data;
    else c->lddy = E;
#pragma omp parallel for schedule(static) num_threads(p->nthreads)
    for (int64_t r = 0; r < (c->dy == dy ? Rq : 0); r++) {
        mha__ld_row(dy + r * E, mha__view_row(gout, r), E);  // (float: exact)
        int64_t n, t;
        mha__row_nt(p, seq_first, gout, r, &n, &t);
        for (int64_t e = 0; p->out_p > 0.0f && e < E; e++)
            dy[r * E + e] *= mha__out_drop_factor(a->opts.dropout_seed, a->opts.dropout_offset,
                                                  p->out_p, p->L, p->E, n, t, e);
    }
    // dctx (Rq, Eq) = dy (Rq, E) Wo (E, Eq)
    if (c->bf) {
        bf_matmul(c, c->s.dctx, p->Eq, c->dy, c->lddy, c->m->w_out, NULL, Rq, E, p->Eq);
        return;
    }
    mha__matmul_rows(c->kt, c->s.dctx, p->Eq, c->dy, c->lddy, weight_at(c, c->m->w_out, 0),
                     p->Eq, Rq, E, p->Eq, c->s.bp, c->s.gs, p->nthreads);
}

// Gated: W_O saw gctx = ctx_h * g, so dg = sum_c dctx_h ctx_h (dynamic:
// dz = dg g (1 - g), z = Xq W_g^T + b_g), then dctx_h *= g.
static mha_status bwd_gates(bwd_call *c) {
    const mha_module *m = c->m;
    if (!mha__module_gated(m)) return MHA_OK;
    const int64_t E = c->p->E, Eq = c->p->Eq, H = c->p->H, d = c->p->d,
                  Rq = mha__rows_of(c->a->query);
    const size_t nwg = mha__gemm_packed_b_floats(c->kt, E, H);
    c->gbuf = mha__alloc(sizeof(float) * ((size_t)(2 * Rq * H + Rq * Eq) + nwg));
    if (!c->gbuf)
        return mha__fail(MHA_ERR_NOMEM,
                         "fused backward: out of memory for the gates (%zu "
                         "bytes)",
                         sizeof(float) * ((size_t)(2 * Rq * H + Rq * Eq) + nwg));
    float *gate = c->gbuf, *dg = gate + Rq * H, *gctx = dg + Rq * H;
    c->gate = gate, c->dg = dg, c->gctx = gctx;
    const float *ctx = c->s.ctx;
    float *dctx = c->s.dctx;
    mha__gate_rows(c->kt, gate, gctx, ctx, m, c->pk, c->Xq, c->ldq, Rq, gctx + Rq * Eq,
                   c->s.gs, c->p->nthreads);
    const bool dyn = m->cfg.head_gate == MHA_GATE_DYNAMIC;
    for (int64_t r = 0; r < Rq; r++)
        for (int64_t h = 0; h < H; h++) {
            float *dc = dctx + r * Eq + h * d;
            const float *cx = ctx + r * Eq + h * d, g = gate[r * H + h];
            double sdg = 0.0;
            for (int64_t i = 0; i < d; i++) sdg += (double)dc[i] * cx[i];
            dg[r * H + h] = (float)(dyn ? sdg * g * (1.0 - g) : sdg);
            for (int64_t i = 0; i < d; i++) dc[i] *= g;
        }
    return MHA_OK;
}

// The attention backward, one thread per KV head (b, g): each tile pair's
// S and dP computed once; the group's query heads in increasing order,
// adding to dk_g, dv_g. bf16 compute (no appended keys): the heads' bf16
// rows and the context gradient's rows rounded once (a16, dO16).
static void bwd_attention_per_head(const bwd_call *c) {
    const fwd_plan *p = c->p;
    const mha_module *m = c->m;
    const mha__kernels *kt = c->kt;
    const int64_t N = p->N, L = p->L, S = p->S, H = p->H, d = p->d, Hkv = p->Hkv, G = H / Hkv;
    const int64_t nx = p->Sp - S, Eq = p->Eq;
    const int nt = p->nthreads;
    float *dextra = c->s.dextra, *dsum = c->s.dsum, *scratch = c->s.scratch;
    const size_t sf = c->s.sf;
    const mha__rowmap dkm = c->dkm, dvm = c->dvm, dqm = c->dqm, dcm = c->dcm;
    const int64_t kp = kt->bf_kpad, ld16 = (Eq + kp - 1) / kp * kp,
                  rs16 = dcm.seq_first ? N * ld16 : ld16;
    if (c->bf)
        mha__bf16_rows(kt, c->s.a16, ld16, c->s.dctx, Eq, mha__rows_of(c->a->query), Eq, nt);
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (int64_t bg = 0; bg < N * Hkv; bg++) {
        int64_t b = bg / Hkv, g = bg % Hkv, h0 = mha__plan_group_first_live(p, m, g, G);
        if (h0 < 0) {  // the whole group pruned: no gradient
            mha__zero_head_rows(mha__head_row0(&dkm, b, g * d), mha__head_rs(&dkm), 0, S, d);
            mha__zero_head_rows(mha__head_row0(&dvm, b, g * d), mha__head_rs(&dvm), 0, S, d);
            memset(dextra + bg * nx * d, 0, sizeof(float) * (size_t)(nx * d));
            memset(dextra + (N * Hkv + bg) * nx * d, 0, sizeof(float) * (size_t)(nx * d));
        }
        for (int64_t h = g * G; h < (g + 1) * G; h++) {
            if (!mha__plan_head_live(p, m, h)) {
                mha__zero_head_rows(mha__head_row0(&dqm, b, h * d), mha__head_rs(&dqm), 0, L, d);
                continue;
            }
            mha__flash_head fh = bwd_head(c, b, h);
            float *sc = scratch + (size_t)mha__thread_id() * sf;
            if (c->bf) {
                mha__head_to_bf16(&fh, &c->qm, &c->km, &c->vm, p->self_packed);
                mha__flash_bwd_head_bf16(kt, &fh, mha__head_row0(&dcm, b, h * d),
                                         mha__head_rs(&dcm),
                                         c->s.a16 + (dcm.seq_first ? b : b * L) * ld16 + h * d,
                                         rs16, dsum + (b * H + h) * L,
                                         mha__head_row0(&dqm, b, h * d), mha__head_rs(&dqm),
                                         mha__head_row0(&dkm, b, g * d), mha__head_rs(&dkm),
                                         mha__head_row0(&dvm, b, g * d), mha__head_rs(&dvm),
                                         h != h0, sc);
                continue;
            }
            mha__flash_bwd_head(kt, &fh, mha__head_row0(&dcm, b, h * d), mha__head_rs(&dcm),
                                dsum + (b * H + h) * L, mha__head_row0(&dqm, b, h * d),
                                mha__head_rs(&dqm), mha__head_row0(&dkm, b, g * d),
                                mha__head_rs(&dkm), mha__head_row0(&dvm, b, g * d),
                                mha__head_rs(&dvm), dextra + bg * nx * d,
                                dextra + (N * Hkv + bg) * nx * d, h != h0, sc);
        }
    }
}

// The attention backward in two passes over tiles: pass B (Dsum, dq per
// query tile), then pass A (dk, dv per (KV head, key tile), summed over
// the group's query heads in increasing order; reads Dsum).
static void bwd_attention_tiles(const bwd_call *c) {
    const fwd_plan *p = c->p;
    const mha_module *m = c->m;
    const int64_t N = p->N, L = p->L, S = p->S, H = p->H, d = p->d, Hkv = p->Hkv, G = H / Hkv;
    const int64_t nx = p->Sp - S;
    const int nt = p->nthreads;
    float *dextra = c->s.dextra, *dsum = c->s.dsum, *scratch = c->s.scratch;
    const size_t sf = c->s.sf;
    const mha__rowmap dkm = c->dkm, dvm = c->dvm, dqm = c->dqm, dcm = c->dcm;
    const int64_t tiles = (L + MHA__FLASH_BR - 1) / MHA__FLASH_BR;
    const int64_t ktiles = (S + MHA__FLASH_BC - 1) / MHA__FLASH_BC + (nx > 0);
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (int64_t it = 0; it < N * H * tiles; it++) {
        int64_t bh = it / tiles, tile = it % tiles, b = bh / H, h = bh % H;
        int tid = mha__thread_id();
        mha__flash_head fh = bwd_head(c, b, h);
        int64_t i0 = tile * MHA__FLASH_BR, i1 = mha__tile_end(i0, MHA__FLASH_BR, L);
        if (!mha__plan_head_live(p, m, h)) {
            mha__zero_head_rows(mha__head_row0(&dqm, b, h * d), mha__head_rs(&dqm), i0, i1, d);
            continue;
        }
        mha__flash_bwd_q(c->kt, &fh, mha__head_row0(&dcm, b, h * d), mha__head_rs(&dcm),
                         dsum + bh * L, i0, i1,
                         mha__head_row0(&dqm, b, h * d) + i0 * mha__head_rs(&dqm),
                         mha__head_rs(&dqm), scratch + (size_t)tid * sf);
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (int64_t it = 0; it < N * Hkv * ktiles; it++) {
        int64_t bg = it / ktiles, kt_i = it % ktiles, b = bg / Hkv, g = bg % Hkv;
        int tid = mha__thread_id();
        int64_t j0 = kt_i * MHA__FLASH_BC, n;
        float *dkp, *dvp;
        int64_t rs;
        if (j0 >= S) {  // the appended keys: per (b, g), reduced below
            j0 = S;
            n = nx;
            dkp = dextra + bg * nx * d;
            dvp = dextra + (N * Hkv + bg) * nx * d;
            rs = d;
        } else {
            n = S - j0 < MHA__FLASH_BC ? S - j0 : MHA__FLASH_BC;
            dkp = mha__head_row0(&dkm, b, g * d) + j0 * mha__head_rs(&dkm);
            dvp = mha__head_row0(&dvm, b, g * d) + j0 * mha__head_rs(&dvm);
            rs = mha__head_rs(&dkm);
        }
        const int64_t h0 = mha__plan_group_first_live(p, m, g, G);
        if (h0 < 0) {  // the whole group pruned: no gradient
            mha__zero_head_rows(dkp, rs, 0, n, d);
            mha__zero_head_rows(dvp, rs, 0, n, d);
        }
        for (int64_t h = g * G; h < (g + 1) * G; h++) {
            if (!mha__plan_head_live(p, m, h)) continue;
            mha__flash_head fh = bwd_head(c, b, h);
            mha__flash_bwd_kv(c->kt, &fh, mha__head_row0(&dcm, b, h * d), mha__head_rs(&dcm),
                              dsum + (b * H + h) * L, j0, n, dkp, rs, dvp, rs, h != h0,
                              scratch + (size_t)tid * sf);
        }
    }
}

// Through the rotation (its transpose); then a part's projection gradients
// (and dz) copied out for its caller.
static void bwd_rope_and_part_out(const bwd_call *c) {
    const fwd_plan *p = c->p;
    const mha__part *pt = c->pt;
    const int64_t L = p->L, S = p->S, Eq = p->Eq, H = p->H, Hkv = p->Hkv, Ekv = p->Ekv;
    const int64_t Rq = mha__rows_of(c->a->query), Rk = mha__rows_of(c->a->key);
    const int64_t W3 = c->W3, ldkv = c->ldkv;
    mha__rope_rows(p, c->a, &c->dqm, L, H, true, pt ? pt->attn.rope_pos : NULL);  // (transposed)
    mha__rope_rows(p, c->a, &c->dkm, S, Hkv, true, pt ? pt->attn.rope_pos : NULL);
    if (pt && pt->out.dq)  // a part's projection gradients, for its caller
        for (int64_t r = 0; r < Rq; r++)
            memcpy(pt->out.dq + r * Eq, c->dq + r * W3, sizeof(float) * (size_t)Eq);
    if (pt && pt->out.dz && c->dg) memcpy(pt->out.dz, c->dg, sizeof(float) * (size_t)(Rq * H));
    if (pt && pt->out.dk)
        for (int64_t r = 0; r < Rk; r++) {
            memcpy(pt->out.dk + r * Ekv, c->dk + r * ldkv, sizeof(float) * (size_t)Ekv);
            memcpy(pt->out.dv + r * Ekv, c->dv + r * ldkv, sizeof(float) * (size_t)Ekv);
        }
}

// Through the QK-norm (after the rotation's transpose): dq, dk in place,
// from q, k before the norm; the norms' weights' gradients.
static void bwd_qk_norm(const bwd_call *c, mha_module *grads) {
    const fwd_plan *p = c->p;
    const mha_module *m = c->m;
    if (m->cfg.qk_norm == MHA_QK_NORM_NONE) return;
    const int64_t Eq = p->Eq, Ekv = p->Ekv, Rq = mha__rows_of(c->a->query),
                  Rk = mha__rows_of(c->a->key);
    const bool head = m->cfg.qk_norm == MHA_QK_NORM_HEAD;
    const double eps = mha__qk_norm_eps(m);
    mha__qk_norm_rows_bwd(c->dq, c->W3, c->s.xqk, Eq, Rq, Eq, head ? p->d : Eq, m->q_norm, eps,
                          grads ? grads->q_norm : NULL, c->acc, c->s.rr, p->nthreads);
    mha__qk_norm_rows_bwd(c->dk, c->ldkv, c->s.xqk + Rq * Eq, Ekv, Rk, Ekv, head ? p->d : Ekv,
                          m->k_norm, eps, grads ? grads->k_norm : NULL, c->acc, c->s.rr,
                          p->nthreads);
}

// Parameter gradients: dWo = dy^T gctx, dbo = colsum(dy); the gates'; the
// projections' dW = d^T X, db = colsum(d) (one GEMM over the packed
// in_proj_weight with self-attention); bias_k, bias_v from the appended
// keys' row 0, summed over b.
static void bwd_param_grads(const bwd_call *c, mha_module *grads) {
    const fwd_plan *p = c->p;
    const mha_module *m = c->m;
    const mha__part *pt = c->pt;
    const mha__kernels *kt = c->kt;
    const bool acc = c->acc, sp = p->self_packed;
    const int64_t N = p->N, E = p->E, H = p->H, d = p->d, Hkv = p->Hkv, Ekv = p->Ekv;
    const int64_t nx = p->Sp - p->S, kd = p->kdim, vd = p->vdim, W3 = c->W3, Eq = p->Eq;
    const int64_t Rq = mha__rows_of(c->a->query), Rk = mha__rows_of(c->a->key);
    const int nt = p->nthreads;
    float *bp = c->s.bp, *gs = c->s.gs, *dextra = c->s.dextra;
    const float *dg = c->dg;
    float *gbq = grads->in_proj_bias, *gbk = gbq ? gbq + Eq : NULL,
          *gbv = gbq ? gbq + Eq + Ekv : NULL;
    // (a part without the bias: its share of out_proj.bias's gradient is 0)
    float *gbo = pt && !pt->bias ? NULL : grads->out_bias;
    if (grads->out_bias && !gbo && !acc) memset(grads->out_bias, 0, sizeof(float) * (size_t)E);
    // dWo (E, Eq) = dy^T gctx
    const mha_dtype gdt = grads->wdt;
    float *wf = c->s.wf;
    if (c->bf)  // (bf16 compute: no gates; the context's bf16 rows)
        bf_grad_weight(c, grads->w_out, gdt, gbo, c->dy, c->lddy, c->ctx16, c->ldc16, Rq, E, Eq);
    else
        mha__grad_weight(kt, grads->w_out, gdt, wf, gbo, acc, c->dy, c->lddy,
                         c->gctx ? c->gctx : c->s.ctx, Eq, Rq, E, Eq, bp, gs, nt);
    if (m->cfg.head_gate == MHA_GATE_STATIC)  // dgate_h = sum over rows of dg
        for (int64_t h = 0; h < H; h++) {
            double sg = 0.0;
            for (int64_t r = 0; r < Rq; r++) sg += dg[r * H + h];
            mha__grad_store(grads->head_gate + h, sg, acc);
        }
    // sinks: a sink is one more logit of each row's softmax, of value 0:
    // dsink_h = -sum_{b, i} P_sink Dsum_i, P_sink = exp(sink_h - m_i) / l_i
    // from the rows' stats (heads outside the part or pruned: 0)
    if (grads->sinks)
        for (int64_t h = 0; h < H; h++) {
            double sg = 0.0;
            for (int64_t b = 0; b < N && mha__plan_head_live(p, m, h); b++)
                for (int64_t i = 0; i < p->L; i++) {
                    const int64_t row = (b * H + h) * p->L + i;
                    const float *st = c->s.lse + 2 * row;
                    sg -= exp((double)m->sinks[h] - st[0]) * st[1] * c->s.dsum[row];
                }
            mha__grad_store(grads->sinks + h, sg, acc);
        }
    if (m->cfg.head_gate == MHA_GATE_DYNAMIC)  // dW_g = dz^T Xq, db_g = colsum(dz)
        mha__grad_weight(kt, grads->gate_weight, MHA_F32, NULL, grads->gate_bias, acc, dg, H,
                         c->Xq, c->ldq, Rq, H, E, bp, gs, nt);
#define X16(X) ((const uint16_t *)(const void *)(X))
    if (c->bf && sp) {  // the input rows are bf16 in place (bwd_bf16_forward)
        bf_grad_weight(c, grads->w_in, gdt, gbq, c->s.dqkv, W3, X16(c->Xq), 2 * c->ldq, Rq, W3,
                       E);
    } else if (c->bf) {
        bf_grad_weight(c, grads->w_q, gdt, gbq, c->dq, W3, X16(c->Xq), 2 * c->ldq, Rq, Eq, E);
        bf_grad_weight(c, grads->w_k, gdt, gbk, c->dk, Ekv, X16(c->Xk), 2 * c->ldk, Rk, Ekv, kd);
        bf_grad_weight(c, grads->w_v, gdt, gbv, c->dv, Ekv, X16(c->Xv), 2 * c->ldv, Rk, Ekv, vd);
#undef X16
    } else if (sp) {
        // dWin (Eq + 2 Ekv, E) = dqkv^T X; dbin = colsum(dqkv)
        mha__grad_weight(kt, grads->w_in, gdt, wf, gbq, acc, c->s.dqkv, W3, c->Xq, c->ldq, Rq,
                         W3, E, bp, gs, nt);
    } else {
        mha__grad_weight(kt, grads->w_q, gdt, wf, gbq, acc, c->dq, W3, c->Xq, c->ldq, Rq, Eq,
                         E, bp, gs, nt);
        mha__grad_weight(kt, grads->w_k, gdt, wf, gbk, acc, c->dk, Ekv, c->Xk, c->ldk, Rk, Ekv,
                         kd, bp, gs, nt);
        mha__grad_weight(kt, grads->w_v, gdt, wf, gbv, acc, c->dv, Ekv, c->Xv, c->ldv, Rk, Ekv,
                         vd, bp, gs, nt);
    }
    if (m->cfg.add_bias_kv)  // row 0 of the appended keys: sum over b
        for (int64_t g = 0; g < Hkv; g++)
            for (int64_t cc = 0; cc < d; cc++) {
                double sk = 0.0, sv_ = 0.0;
                for (int64_t b = 0; b < N; b++) {
                    sk += dextra[(b * Hkv + g) * nx * d + cc];
                    sv_ += dextra[(N * Hkv + b * Hkv + g) * nx * d + cc];
                }
                mha__grad_store(grads->bias_k + g * d + cc, sk, acc);
                mha__grad_store(grads->bias_v + g * d + cc, sv_, acc);
            }
}

// Input gradients: dX = d W (self-attention: each part separately, as the
// API returns grad_query, grad_key, grad_value); dXq += dz W_g (dynamic
// gates).
static void bwd_input_grads(const bwd_call *c, mha_tensor *gq, mha_tensor *gk, mha_tensor *gv) {
    const fwd_plan *p = c->p;
    const mha_module *m = c->m;
    const mha__kernels *kt = c->kt;
    const bool acc = c->acc;
    const int64_t E = p->E, H = p->H, Ekv = p->Ekv, kd = p->kdim, vd = p->vdim;
    const int64_t Rq = mha__rows_of(c->a->query), Rk = mha__rows_of(c->a->key);
    const int64_t W3 = c->W3, ldkv = c->ldkv;
    const int nt = p->nthreads;
    float *tmp = c->s.tmp, *bp = c->s.bp, *gs = c->s.gs;
    if (c->bf) {  // (no gates)
        if (gq) bf_grad_input(c, gq, acc, c->dq, W3, m->w_q, Rq, p->Eq, E);
        if (gk) bf_grad_input(c, gk, acc, c->dk, ldkv, m->w_k, Rk, Ekv, kd);
        if (gv) bf_grad_input(c, gv, acc, c->dv, ldkv, m->w_v, Rk, Ekv, vd);
        return;
    }
    if (gq)
        mha__grad_input_rows(kt, gq, acc, c->dq, W3, weight_at(c, m->w_q, 0), Rq, p->Eq, E,
                             tmp, bp, gs, nt);
    if (gq && m->cfg.head_gate == MHA_GATE_DYNAMIC)  // dXq += dz W_g
        mha__grad_input_rows(kt, gq, true, c->dg, H, mha__wmat_f32(m->gate_weight, NULL), Rq,
                             H, E, tmp, bp, gs, nt);
    if (gk)
        mha__grad_input_rows(kt, gk, acc, c->dk, ldkv, weight_at(c, m->w_k, 0), Rk, Ekv, kd,
                             tmp, bp, gs, nt);
    if (gv)
        mha__grad_input_rows(kt, gv, acc, c->dv, ldkv, weight_at(c, m->w_v, 0), Rk, Ekv, vd,
                             tmp, bp, gs, nt);
}

// ---------------------------------------------------------------------------
// bf16 compute (mha__fused_backward_bf16): the forward the bf16 forward
// computes (the saved one, or again: projections on the bf16 unit, q, k, v
// rounded in place, bf16 attention, the context rounded), then every
// product of the backward with bf16 operands and float32 sums, as
// PyTorch's bf16 autograd multiplies: dctx = dy Wo, the attention backward
// (flash.h, mha__flash_bwd_head_bf16: one thread per (b, KV head), the
// same bits for any number of threads), dW = d^T X, dX = d W; the
// operands d (dy, dctx, dq, dk, dv) rounded to bf16 once for each product,
// the biases' sums and the element-wise steps (RoPE, QK-norm) in float32
// from the float32 d.

bool mha__fused_backward_bf16(const mha_module *m, const mha_forward_args *a) {
    return mha__fused_train_bf16_module(m) && mha__fused_forward_bf16(m, a);
}

// A weight gradient dW (O, N) of dt (=, or += when acc) <- A (O, K) Bp on
// the bf16 unit: the sums into dW (float32, =) or into wf, then added to
// dW's value (+=, one float32 addition) and stored (half: rounded once).
static void bf_weight_gemm(const bwd_call *c, void *dW, mha_dtype dt, bool acc,
                           const uint16_t *A, int64_t lda, const uint16_t *Bp, int64_t O,
                           int64_t K, int64_t N) {
    const int nt = c->p->nthreads;
    const bool direct = dt == MHA_F32 && !acc;
    float *C = direct ? dW : c->s.wf;
    mha__gemm_bf16_rows(c->kt, C, N, A, lda, Bp, O, K, N, false, nt);
    if (direct) return;
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t o = 0; o < O; o++) {
        const mha__mat w = mha__vmat((char *)dW + o * N * (int64_t)mha_dtype_size(dt), dt, 0, 1);
        float *t = C + o * N;
        for (int64_t c0 = 0; acc && c0 < N; c0 += 256) {
            const int64_t n = N - c0 < 256 ? N - c0 : 256;
            float cur[256];
            mha__mat part = w;
            part.p = (char *)w.p + c0 * (int64_t)mha_dtype_size(dt);
            mha__ld_row(cur, part, n);
            for (int64_t i = 0; i < n; i++) t[c0 + i] += cur[i];
        }
        mha__st_row(w, t, N);
    }
}

// dW (O, I) (+)= d^T X16 and db (+)= colsum(d): d (R, O) float32 rows of
// stride ldd, transposed and rounded into a16; X16 (R, I) bf16 rows of
// stride ldx16 packed into bp16.
static void bf_grad_weight(const bwd_call *c, void *dW, mha_dtype dt, float *db,
                           const float *d, int64_t ldd, const uint16_t *X16, int64_t ldx16,
                           int64_t R, int64_t O, int64_t I) {
    const mha__kernels *kt = c->kt;
    const int nt = c->p->nthreads;
    const int64_t kp = kt->bf_kpad, Rp = (R + kp - 1) / kp * kp;
    mha__bf16_transpose(kt, c->s.a16, Rp, d, ldd, R, O, nt);
    mha__bf16_pack(kt, c->s.bp16, X16, ldx16, 1, R, I, nt);
    bf_weight_gemm(c, dW, dt, c->acc, c->s.a16, Rp, c->s.bp16, O, R, I);
    if (db) mha__col_sums(db, c->acc, d, ldd, R, O, nt);
}

// C (R, N) = round(d) (R, K) W (K, N): d float32 rows of stride ldd
// rounded into a16, W a bf16 row-major (K, N) matrix packed into bp16 (or
// Bp, already packed).
static void bf_matmul(const bwd_call *c, float *C, int64_t ldc, const float *d, int64_t ldd,
                      const uint16_t *W, const uint16_t *Bp, int64_t R, int64_t K, int64_t N) {
    const mha__kernels *kt = c->kt;
    const int nt = c->p->nthreads;
    const int64_t kp = kt->bf_kpad, Kp = (K + kp - 1) / kp * kp;
    mha__bf16_rows(kt, c->s.a16, Kp, d, ldd, R, K, nt);
    if (!Bp) {
        mha__bf16_pack(kt, c->s.bp16, W, N, 1, K, N, nt);
        Bp = c->s.bp16;
    }
    mha__gemm_bf16_rows(kt, C, ldc, c->s.a16, Kp, Bp, R, K, N, false, nt);
}

// C (R, O) = X16 (R, I) W^T + b for a bf16 PyTorch weight W (O, I), X's
// rows bf16 in place (row stride ldx floats).
static void bf_project(const bwd_call *c, float *C, int64_t ldc, const float *X, int64_t ldx,
                       const void *W, const float *b, int64_t R, int64_t I, int64_t O) {
    mha__linear_bf16_rows(c->kt, C, ldc, (const uint16_t *)(const void *)X, 2 * ldx, W, c->pk,
                          b, R, I, O, c->s.bp16, c->p->nthreads);
}

// The bf16 forward again (no saved state), or the saved one's context
// widened: the input rows become bf16 in place first (they are the
// gathered copies: bf16 inputs never serve in place).
static void bwd_bf16_forward(bwd_call *c) {
    const fwd_plan *p = c->p;
    const mha_module *m = c->m;
    const mha_forward_args *a = c->a;
    const mha__kernels *kt = c->kt;
    const int64_t N = p->N, L = p->L, S = p->S, E = p->E, H = p->H, d = p->d;
    const int64_t Rq = mha__rows_of(a->query), Rk = mha__rows_of(a->key);
    const int64_t kd = p->kdim, vd = p->vdim, Ekv = p->Ekv, Hkv = p->Hkv, Eq = p->Eq;
    const int nt = p->nthreads;
    const bool seq_first = p->unbatched || !m->cfg.batch_first, sp = p->self_packed;
    const int64_t W3 = c->W3, ldkv = c->ldkv;
    float *q = c->q, *k = c->k, *v = c->v, *ctx = c->s.ctx;
    mha__bf16_rows_in_place(kt, (float *)c->Xq, c->ldq, Rq, E, nt);
    if (!sp) {
        mha__bf16_rows_in_place(kt, (float *)c->Xk, c->ldk, Rk, kd, nt);
        mha__bf16_rows_in_place(kt, (float *)c->Xv, c->ldv, Rk, vd, nt);
    }
    const int64_t Tk = sp ? L : S;
    c->qm = (mha__rowmap){q, W3, seq_first, N, L};
    c->km = (mha__rowmap){k, ldkv, seq_first, N, Tk};
    c->vm = (mha__rowmap){v, ldkv, seq_first, N, Tk};
    c->cm = (mha__rowmap){ctx, Eq, seq_first, N, L};
    c->dcm = (mha__rowmap){c->s.dctx, Eq, seq_first, N, L};
    c->dqm = (mha__rowmap){c->dq, W3, seq_first, N, L};
    c->dkm = (mha__rowmap){c->dk, ldkv, seq_first, N, Tk};
    c->dvm = (mha__rowmap){c->dv, ldkv, seq_first, N, Tk};
    if (c->sv) {  // the saved context's float32 values
#pragma omp parallel for schedule(static) num_threads(nt)
        for (int64_t r = 0; r < Rq; r++)
            kt->cvt_bf16(ctx + r * Eq, c->ctx16 + r * c->ldc16, Eq);
        return;
    }
    const float *bq = m->in_proj_bias, *bk = bq ? bq + Eq : NULL,
                *bv = bq ? bq + Eq + Ekv : NULL;
    if (sp) {
        bf_project(c, c->s.qkv, W3, c->Xq, c->ldq, m->w_in, bq, Rq, E, W3);
    } else {
        bf_project(c, q, W3, c->Xq, c->ldq, m->w_q, bq, Rq, E, Eq);
        bf_project(c, k, ldkv, c->Xk, c->ldk, m->w_k, bk, Rk, kd, Ekv);
        bf_project(c, v, ldkv, c->Xv, c->ldv, m->w_v, bv, Rk, vd, Ekv);
    }
    if (m->cfg.qk_norm != MHA_QK_NORM_NONE)
        mha__fused_qk_norm(p, m, &c->qm, &c->km, Rq, Rk, c->s.xqk);
    mha__rope_rows(p, a, &c->qm, L, H, false, NULL);
    mha__rope_rows(p, a, &c->km, S, Hkv, false, NULL);
    if (sp) mha__bf16_rows_in_place(kt, c->s.qkv, W3, Rq, W3, nt);
    else {
        mha__bf16_rows_in_place(kt, q, W3, Rq, Eq, nt);
        mha__bf16_rows_in_place(kt, k, ldkv, Rk, Ekv, nt);
        mha__bf16_rows_in_place(kt, v, ldkv, Rk, Ekv, nt);
    }
    const int64_t tiles = (L + MHA__FLASH_BR - 1) / MHA__FLASH_BR;
    const size_t sf = c->s.sf;
    float *scratch = c->s.scratch;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (int64_t it = 0; it < N * H * tiles; it++) {
        int64_t bh = it / tiles, tile = it % tiles, b = bh / H, h = bh % H;
        mha__flash_head fh = bwd_head(c, b, h);
        mha__head_to_bf16(&fh, &c->qm, &c->km, &c->vm, sp);
        int64_t i0 = tile * MHA__FLASH_BR, i1 = mha__tile_end(i0, MHA__FLASH_BR, L);
        if (mha__plan_head_live(p, m, h))
            mha__flash_rows(kt, &fh, i0, i1, scratch + (size_t)mha__thread_id() * sf);
        else mha__zero_head_rows(fh.o, fh.o_rs, i0, i1, d);
    }
    // the context rounded, as the forward's output projection reads it
    const int64_t kp = kt->bf_kpad;
    c->ldc16 = (Eq + kp - 1) / kp * kp;
    mha__bf16_rows(kt, c->s.c16, c->ldc16, ctx, Eq, Rq, Eq, nt);
    c->ctx16 = c->s.c16;
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t r = 0; r < Rq; r++) kt->cvt_bf16(ctx + r * Eq, c->ctx16 + r * c->ldc16, Eq);
}

// dX (view) (+)= round(d) (R, O) W (O, I), W bf16: through tmp (R, I).
static void bf_grad_input(const bwd_call *c, mha_tensor *gx, bool acc, const float *d,
                          int64_t ldd, const void *W, int64_t R, int64_t O, int64_t I) {
    int64_t ldx;
    if (mha__rows_direct(gx, &ldx) && !acc) {
        bf_matmul(c, gx->data, ldx, d, ldd, W, NULL, R, O, I);
        return;
    }
    bf_matmul(c, c->s.tmp, I, d, ldd, W, NULL, R, O, I);
    mha__grad_store_rows(gx, acc, c->s.tmp, R, I, c->p->nthreads);
}

mha_status mha__fused_backward(const fwd_plan *p, mha_tensor *gq, mha_tensor *gk,
                               mha_tensor *gv, mha_module *grads, const mha_module *m,
                               const mha_forward_args *a, const mha_tensor *gout, bool acc,
                               const mha__part *pt) {
    mha_status qst = mha__fused_part_qk_norm(m, pt);
    if (qst) return qst;
    bwd_call c = {.p = p,
                  .m = m,
                  .grads = grads,
                  .a = a,
                  .pt = pt,
                  .kt = mha__kernels_get(),
                  .acc = acc,
                  .bf = !pt && mha__fused_backward_bf16(m, a)};
    mha_status st = bwd_alloc(&c);
    if (st) return st;
    if (grads) mha__packs_stale(grads);  // (its parameters are written below)
    c.pk = mha__packs_acquire(m, c.kt, p->nthreads);
    // Forward: inputs as rows (or the saved state), projections, attention
    // with the row stats.
    if ((st = bwd_inputs(&c))) goto done;
    if (c.bf) bwd_bf16_forward(&c);
    else if ((st = bwd_forward(&c))) goto done;
    bwd_dctx(&c, gout);
    if ((st = bwd_gates(&c))) goto done;
    // Attention backward: one thread per KV head (b, g) when there are at
    // least as many as threads, else two passes over tiles: the same bits
    // either way (flash.h), no atomics. A part's attn hook instead: the
    // caller's attention backward.
    const bool ext = pt && pt->attn.fn;
    if (ext) {
        c.io.dctx = c.s.dctx, c.io.dq = c.dq, c.io.dk = c.dk, c.io.dv = c.dv;
        if ((st = pt->attn.fn(pt->attn.arg, &c.io))) goto done;
    } else if (c.bf || p->N * p->Hkv >= p->nthreads) {  // (bf16: per head whatever the threads)
        bwd_attention_per_head(&c);
    } else {
        bwd_attention_tiles(&c);
    }
    bwd_rope_and_part_out(&c);
    bwd_qk_norm(&c, grads);
    if (grads) bwd_param_grads(&c, grads);
    bwd_input_grads(&c, gq, gk, gv);
done:
    mha__packs_release(c.pk);
    mha__free(c.gbuf);
    mha__scratch_free(c.blk, c.blk_bytes);
    return st;
}
