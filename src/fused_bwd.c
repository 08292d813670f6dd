
// fused_bwd.c: the fused backward (MHA_IMPL_FUSED): the forward's projections and attention again
// (keeping each row's softmax stats), then
//   dy = dY * drop_o;  dctx = dy Wo;  dWo = dy^T ctx;  dbo = colsum(dy)
//   attention backward (flash.c, two passes) -> dq, dk, dv
//   dW = d^T X and dX = d W for each projection (one GEMM each over the
//   packed in_proj_weight with self-attention)
// Every sum has a fixed order: GEMMs split over output rows, attention
// over (b, h, tile) items.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fused.h"
#include "linear.h"

// dst (cols, rows) = src (rows, cols)^T; src row stride lds.
static void transpose_rows(float *dst, const float *src, int64_t lds, int64_t rows,
                           int64_t cols) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) dst[c * rows + r] = src[r * lds + c];
}

static inline void store_f(float *p, double v, bool acc) { *p = acc ? *p + (float)v : (float)v; }

// dW (O, I) (+)= d^T X: d (R, O) row stride ldd, X (R, I) row stride ldx;
// db (O) (+)= colsum(d), summed in double over r in order. tmp: O*R
// floats (d^T); bp: packed X; gs: GEMM scratch.
static void grad_weight(const mha__kernels *kt, float *dW, float *db, bool acc,
                        const float *d, int64_t ldd, const float *X, int64_t ldx,
                        int64_t R, int64_t O, int64_t I, float *tmp, float *bp, float *gs,
                        int nt) {
    float *dT = tmp;
    transpose_rows(dT, d, ldd, R, O);
    mha__gemm_pack_rows(kt, bp, X, ldx, R, I, nt);
    mha__gemm_rows_packed(kt, dW, I, dT, R, bp, NULL, O, R, I, acc, nt, gs);
    if (db)
        for (int64_t o0 = 0; o0 < O; o0 += 256) {  // independent sums, vectorised over o
            const int64_t w = O - o0 < 256 ? O - o0 : 256;
            double s[256] = {0};
            for (int64_t r = 0; r < R; r++)
                for (int64_t o = 0; o < w; o++) s[o] += d[r * ldd + o0 + o];
            for (int64_t o = 0; o < w; o++) store_f(db + o0 + o, s[o], acc);
        }
}

// dX (view, rows in the view's order) (+)= d (R, O) W (O, I).
void mha__grad_input_rows(const mha__kernels *kt, mha_tensor *gx, bool acc, const float *d,
                       int64_t ldd, const float *W, int64_t R, int64_t O, int64_t I,
                       float *tmp, float *bp, float *gs, int nt) {
    mha__matmul_rows(kt, tmp, I, d, ldd, W, I, R, O, I, bp, gs, nt);
    for (int64_t r = 0; r < R; r++) {
        mha__mat row = mha__view_row(gx, r);
        for (int64_t i = 0; i < I; i++)
            mha__st(row, 0, i, (acc ? mha__ld(row, 0, i) : 0.0) + tmp[r * I + i]);
    }
}

mha_status mha__fused_backward(const fwd_plan *p, mha_tensor *gq, mha_tensor *gk,
                               mha_tensor *gv, mha_module *grads, const mha_module *m,
                               const mha_forward_args *a, const mha_tensor *gout,
                               bool acc, const mha__part *pt) {
    const mha__kernels *kt = mha__kernels_get();
    const int64_t N = p->N, L = p->L, S = p->S, Sp = p->Sp, E = p->E, H = p->H, d = p->d;
    const int64_t nx = Sp - S, Rq = mha__rows_of(a->query), Rk = mha__rows_of(a->key);
    const int64_t kd = p->kdim, vd = p->vdim, Rmax = Rq > Rk ? Rq : Rk;
    const int64_t Ekv = p->Ekv, Hkv = p->Hkv, G = H / Hkv;  // G query heads per KV head
    const int nt = p->nthreads;
    const bool seq_first = p->unbatched || !m->cfg.batch_first, sp = p->self_packed;
    const int64_t W3 = sp ? E + 2 * Ekv : E;  // row stride of q (and k, v when packed)
    const int64_t Fmax = E > kd ? (E > vd ? E : vd) : (kd > vd ? kd : vd);
    // Scratch, floats, one block:
    const size_t sf = mha__flash_scratch_floats(d, d, S, nx, true);
    size_t n_x = (size_t)(Rq * E + Rk * (kd + vd));          // gathered inputs
    // packed weights (forward), packed B of the backward GEMMs, GEMM scratch
    const size_t pw_q = mha__gemm_packed_b_floats(kt, E, E),
                 pw_k = mha__gemm_packed_b_floats(kt, kd, Ekv),
                 pw_v = mha__gemm_packed_b_floats(kt, vd, Ekv);
    size_t n_w = sp ? mha__gemm_packed_b_floats(kt, E, W3) : pw_q + pw_k + pw_v;
    size_t n_bp = mha__gemm_packed_b_floats(kt, Rmax, Fmax),
           n_bp2 = mha__gemm_packed_b_floats(kt, E, Fmax),
           n_gs = mha__gemm_scratch_floats(kt, nt);
    if (n_bp2 > n_bp) n_bp = n_bp2;
    n_w += n_bp + n_gs;
    size_t n_qkv = mha__qkv_floats(p, Rq, Rk);
    size_t n_att = (size_t)(Rq * E * 3 + N * H * L * 3 + 2 * N * Hkv * nx * d + 2 * Hkv * nx * d);
    size_t n_tmp = (size_t)(3 * E * Rmax + 3 * E * Fmax + Rmax * Fmax);
    // (the flash scratch starts 64-byte aligned: it begins with pointers)
    size_t n_pre = (n_x + n_w + 2 * n_qkv + n_att + n_tmp + 15) & ~(size_t)15;
    size_t total = n_pre + sf * (size_t)nt;
    size_t bytes;
    if (mha__mul_overflow_size(total, sizeof(float), &bytes))
        return mha__fail(MHA_ERR_OVERFLOW, "fused backward: scratch size overflows");
    float *blk = mha__alloc(bytes);
    if (!blk)
        return mha__fail(MHA_ERR_NOMEM, "fused backward: out of memory for %zu bytes", bytes);
    float *xq = blk, *xk = xq + Rq * E, *xv = xk + Rk * kd;
    float *wt = xv + Rk * vd, *bp = wt + (n_w - n_bp - n_gs), *gs = bp + n_bp;
    float *qkv = wt + n_w, *dqkv = qkv + n_qkv;
    float *ctx = dqkv + n_qkv, *dctx = ctx + Rq * E, *dy = dctx + Rq * E;
    float *lse = dy + Rq * E, *dsum = lse + 2 * N * H * L;  // lse: (m, 1/l) rows
    // dextra: the appended keys' dk (N, Hkv, nx, d), then dv; extra: the
    // appended keys (Hkv, nx, d) for k, then v
    float *dextra = dsum + N * H * L, *extra = dextra + 2 * N * Hkv * nx * d;
    float *tmp = extra + 2 * Hkv * nx * d, *scratch = blk + n_pre;
    for (int t = 0; t < nt; t++) mha__flash_scratch_reset(scratch + (size_t)t * sf);
    const float *bq = m->in_proj_bias, *bk = bq ? bq + E : NULL,
                *bv = bq ? bq + E + Ekv : NULL;

    // Forward: inputs as rows, projections, attention with the row stats.
    int64_t ldq = E, ldk = kd, ldv = vd;
    const float *Xq = xq, *Xk = xk, *Xv = xv;
    if (mha__rows_direct(a->query, &ldq)) Xq = a->query->data;
    else mha__gather_rows(xq, a->query), ldq = E;
    if (mha__rows_direct(a->key, &ldk)) Xk = a->key->data;
    else mha__gather_rows(xk, a->key), ldk = kd;
    if (mha__rows_direct(a->value, &ldv)) Xv = a->value->data;
    else mha__gather_rows(xv, a->value), ldv = vd;
    // A saved forward (mha_forward_args.save) replaces the recomputation.
    const mha_saved *sv = a->save && a->save->valid ? a->save : NULL;
    if (sv) {
        mha__saved_key key;
        mha__saved_key_of(&key, m, a);
        if (!mha__saved_key_equal(&key, &sv->key) || sv->outer_valid != (pt && pt->attn) ||
            sv->n_qkv != n_qkv ||
            sv->n_lse != (size_t)(2 * N * H * L)) {
            mha__free(blk);
            return mha__fail(MHA_ERR_INVALID_ARG,
                             "mha_backward: args.save holds the state of another forward "
                             "(module, inputs, masks or dropout differ); run the forward "
                             "with these args first, or pass save = NULL");
        }
        qkv = sv->buf;
        ctx = sv->buf + sv->n_qkv;
        lse = ctx + sv->n_ctx;
    }
    float *q = qkv, *k = sp ? qkv + E : qkv + Rq * E, *v = sp ? qkv + E + Ekv : k + Rk * Ekv;
    float *dq = dqkv, *dk = sp ? dqkv + E : dqkv + Rq * E,
          *dv = sp ? dqkv + E + Ekv : dk + Rk * Ekv;
    const int64_t ldkv = sp ? W3 : Ekv;
    // a part: its heads' rows of the weights only, into their columns
    const int64_t g0 = pt ? pt->g0 : 0, g1 = pt ? pt->g1 : Hkv, nq = (g1 - g0) * G * d,
                  nkv = (g1 - g0) * d, oq = g0 * G * d, okv = g0 * d;
#define BOFF(b, o) ((b) ? (b) + (o) : NULL)
    if (sv) {
    } else if (sp && !pt) {
        mha__linear_rows(kt, qkv, W3, Xq, ldq, mha__wmat_f32(m->in_proj_weight), bq, Rq, E, W3, wt, gs, nt);
    } else {
        float *wq = wt, *wk = sp ? wt : wq + pw_q, *wv = sp ? wt : wk + pw_k;
        mha__linear_rows(kt, q + oq, W3, Xq, ldq, mha__wmat_f32(m->q_weight + oq * E), BOFF(bq, oq), Rq, E,
                    nq, wq, gs, nt);
        mha__linear_rows(kt, k + okv, ldkv, Xk, ldk, mha__wmat_f32(m->k_weight + okv * kd), BOFF(bk, okv), Rk,
                    kd, nkv, wk, gs, nt);
        mha__linear_rows(kt, v + okv, ldkv, Xv, ldv, mha__wmat_f32(m->v_weight + okv * vd), BOFF(bv, okv), Rk,
                    vd, nkv, wv, gs, nt);
    }
#undef BOFF
    mha__fill_extra(extra, m, Hkv, nx, d);
    mha__rowmap qm = {q, W3, seq_first, N, L}, km = {k, ldkv, seq_first, N, sp ? L : S},
           vm = {v, ldkv, seq_first, N, sp ? L : S}, cm = {ctx, E, seq_first, N, L},
           dcm = {dctx, E, seq_first, N, L}, dqm = {dq, W3, seq_first, N, L},
           dkm = {dk, ldkv, seq_first, N, sp ? L : S}, dvm = {dv, ldkv, seq_first, N, sp ? L : S};
    if (!sv) {  // the saved q, k are rotated already
        mha__rope_rows(p, a, &qm, L, H, false, pt ? pt->rope_pos : NULL);
        mha__rope_rows(p, a, &km, S, Hkv, false, pt ? pt->rope_pos : NULL);
    }
    const int64_t tiles = (L + MHA__FLASH_BR - 1) / MHA__FLASH_BR;
    const int64_t ktiles = (S + MHA__FLASH_BC - 1) / MHA__FLASH_BC + (nx > 0);
    const float scale = (float)(1.0 / sqrt((double)d));
#define HEAD(b, h)                                                                       \
    (mha__flash_head) {                                                                  \
        .q = mha__head_row0(&qm, b, h * d), .q_rs = mha__head_rs(&qm),                            \
        .k = mha__head_row0(&km, b, (h / G) * d), .k_rs = mha__head_rs(&km),                       \
        .v = mha__head_row0(&vm, b, (h / G) * d), .v_rs = mha__head_rs(&vm),                       \
        .xk = extra + (h / G) * nx * d, .xv = extra + (Hkv + h / G) * nx * d, .nx = nx,  \
        .o = mha__head_row0(&cm, b, h * d), .o_rs = mha__head_rs(&cm), .stats = lse + 2 * (b * H + h) * L, \
        .L = L, .S = S, .D = d, .Dv = d, .scale = scale, .mask = &p->mask,               \
        .drop = mha__plan_drop(p), .b = b, .h = h,                                       \
    }
    const bool ext = pt && pt->attn;  // attention done by the caller (ring)
    mha__attn_io io = {.N = N, .L = L, .S = sp ? L : S, .seq_first = seq_first, .q = q, .k = k,
                       .v = v, .ldq = W3, .ldk = ldkv, .ctx = ctx, .stats = sv ? lse : NULL};
    mha_status est = ext && !sv ? pt->attn(pt->attn_arg, &io) : MHA_OK;
    if (est) {
        mha__free(blk);
        return est;
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (int64_t it = 0; it < (sv || ext ? 0 : N * H * tiles); it++) {
        int64_t bh = it / tiles, tile = it % tiles, b = bh / H, h = bh % H;
        int tid = mha__thread_id();
        mha__flash_head fh = HEAD(b, h);
        int64_t i0 = tile * MHA__FLASH_BR, i1 = mha__tile_end(i0, MHA__FLASH_BR, L);
        if (mha__plan_head_live(p, m, h)) mha__flash_rows(kt, &fh, i0, i1, scratch + (size_t)tid * sf);
        else mha__zero_head_rows(fh.o, fh.o_rs, i0, i1, d);
    }

    // dy = dY * drop_o (rows in the query's order); dctx = dy Wo.
    for (int64_t r = 0; r < Rq; r++) {
        mha__mat row = mha__view_row(gout, r);
        int64_t n, t;
        mha__row_nt(p, seq_first, gout, r, &n, &t);
        for (int64_t e = 0; e < E; e++) {
            float g = (float)mha__ld(row, 0, e);
            if (p->out_p > 0.0f)
                g *= mha__out_drop_factor(a->dropout_seed, a->dropout_offset, p->out_p, p->L, p->E, n,
                                          t, e);
            dy[r * E + e] = g;
        }
    }
    mha__matmul_rows(kt, dctx, E, dy, E, m->out_weight, E, Rq, E, E, bp, gs, nt);
    // Gated: W_O saw gctx = ctx_h * g, so dg = sum_c dctx_h ctx_h (dynamic:
    // dz = dg g (1 - g), z = Xq W_g^T + b_g), then dctx_h *= g.
    float *gbuf = NULL, *gate = NULL, *gctx = NULL, *dg = NULL;
    if (mha__module_gated(m)) {
        const size_t nwg = mha__gemm_packed_b_floats(kt, E, H);
        gbuf = mha__alloc(sizeof(float) * ((size_t)(2 * Rq * H + Rq * E) + nwg));
        if (!gbuf) {
            mha__free(blk);
            return mha__fail(MHA_ERR_NOMEM, "fused backward: out of memory for the gates (%zu "
                             "bytes)", sizeof(float) * ((size_t)(2 * Rq * H + Rq * E) + nwg));
        }
        gate = gbuf, dg = gate + Rq * H, gctx = dg + Rq * H;
        mha__gate_rows(kt, gate, gctx, ctx, m, Xq, ldq, Rq, gctx + Rq * E, gs, nt);
        const bool dyn = m->cfg.head_gate == MHA_GATE_DYNAMIC;
        for (int64_t r = 0; r < Rq; r++)
            for (int64_t h = 0; h < H; h++) {
                float *dc = dctx + r * E + h * d;
                const float *c = ctx + r * E + h * d, g = gate[r * H + h];
                double sdg = 0.0;
                for (int64_t i = 0; i < d; i++) sdg += (double)dc[i] * c[i];
                dg[r * H + h] = (float)(dyn ? sdg * g * (1.0 - g) : sdg);
                for (int64_t i = 0; i < d; i++) dc[i] *= g;
            }
    }
    // Attention backward: one thread per KV head (b, g) when there are at
    // least as many as threads (each tile pair's S and dP computed once; the
    // group's query heads in increasing order, adding to dk_g, dv_g), else
    // pass B (Dsum, dq per query tile) then pass A (dk, dv per key tile,
    // the group's query heads in the same order): the same bits either way
    // (flash.h), no atomics.
    if (ext) {  // the caller's attention backward
        io.dctx = dctx, io.dq = dq, io.dk = dk, io.dv = dv;
        if ((est = pt->attn(pt->attn_arg, &io))) {
            mha__free(gbuf);
            mha__free(blk);
            return est;
        }
    }
    const bool per_head = ext || N * Hkv >= nt;
    if (per_head && !ext) {
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
                mha__flash_head fh = HEAD(b, h);
                mha__flash_bwd_head(kt, &fh, mha__head_row0(&dcm, b, h * d), mha__head_rs(&dcm),
                                    dsum + (b * H + h) * L, mha__head_row0(&dqm, b, h * d),
                                    mha__head_rs(&dqm), mha__head_row0(&dkm, b, g * d), mha__head_rs(&dkm),
                                    mha__head_row0(&dvm, b, g * d), mha__head_rs(&dvm),
                                    dextra + bg * nx * d, dextra + (N * Hkv + bg) * nx * d,
                                    h != h0, scratch + (size_t)mha__thread_id() * sf);
            }
        }
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (int64_t it = 0; it < (per_head ? 0 : N * H * tiles); it++) {
        int64_t bh = it / tiles, tile = it % tiles, b = bh / H, h = bh % H;
        int tid = mha__thread_id();
        mha__flash_head fh = HEAD(b, h);
        int64_t i0 = tile * MHA__FLASH_BR, i1 = mha__tile_end(i0, MHA__FLASH_BR, L);
        if (!mha__plan_head_live(p, m, h)) {
            mha__zero_head_rows(mha__head_row0(&dqm, b, h * d), mha__head_rs(&dqm), i0, i1, d);
            continue;
        }
        mha__flash_bwd_q(kt, &fh, mha__head_row0(&dcm, b, h * d), mha__head_rs(&dcm), dsum + bh * L,
                         i0, i1, mha__head_row0(&dqm, b, h * d) + i0 * mha__head_rs(&dqm),
                         mha__head_rs(&dqm), scratch + (size_t)tid * sf);
    }
    // Pass A: dk, dv per (KV head, key tile), summed over the group's query
    // heads in increasing order (reads Dsum).
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (int64_t it = 0; it < (per_head ? 0 : N * Hkv * ktiles); it++) {
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
            mha__flash_head fh = HEAD(b, h);
            mha__flash_bwd_kv(kt, &fh, mha__head_row0(&dcm, b, h * d), mha__head_rs(&dcm),
                              dsum + (b * H + h) * L, j0, n, dkp, rs, dvp, rs, h != h0,
                              scratch + (size_t)tid * sf);
        }
    }
#undef HEAD
    mha__rope_rows(p, a, &dqm, L, H, true, pt ? pt->rope_pos : NULL);  // (orthogonal)
    mha__rope_rows(p, a, &dkm, S, Hkv, true, pt ? pt->rope_pos : NULL);
    if (pt && pt->dq)  // a part's projection gradients, for its caller
        for (int64_t r = 0; r < Rq; r++) memcpy(pt->dq + r * E, dq + r * W3, sizeof(float) * (size_t)E);
    if (pt && pt->dz && dg) memcpy(pt->dz, dg, sizeof(float) * (size_t)(Rq * H));
    if (pt && pt->dk)
        for (int64_t r = 0; r < Rk; r++) {
            memcpy(pt->dk + r * Ekv, dk + r * ldkv, sizeof(float) * (size_t)Ekv);
            memcpy(pt->dv + r * Ekv, dv + r * ldkv, sizeof(float) * (size_t)Ekv);
        }

    // Parameter gradients.
    if (grads) {
        float *gbq = grads->in_proj_bias, *gbk = gbq ? gbq + E : NULL,
              *gbv = gbq ? gbq + E + Ekv : NULL;
        // (a part without the bias: its share of out_proj.bias's gradient is 0)
        float *gbo = pt && !pt->bias ? NULL : grads->out_bias;
        if (grads->out_bias && !gbo && !acc) memset(grads->out_bias, 0, sizeof(float) * (size_t)E);
        grad_weight(kt, grads->out_weight, gbo, acc, dy, E, gctx ? gctx : ctx, E, Rq,
                    E, E, tmp, bp, gs, nt);
        if (m->cfg.head_gate == MHA_GATE_STATIC)  // dgate_h = sum over rows of dg
            for (int64_t h = 0; h < H; h++) {
                double sg = 0.0;
                for (int64_t r = 0; r < Rq; r++) sg += dg[r * H + h];
                store_f(grads->head_gate + h, sg, acc);
            }
        if (m->cfg.head_gate == MHA_GATE_DYNAMIC)  // dW_g = dz^T Xq, db_g = colsum(dz)
            grad_weight(kt, grads->gate_weight, grads->gate_bias, acc, dg, H, Xq, ldq, Rq, H, E,
                        tmp, bp, gs, nt);
        if (sp) {
            // dWin (E + 2 Ekv, E) = dqkv^T X; dbin = colsum(dqkv)
            grad_weight(kt, grads->in_proj_weight, gbq, acc, dqkv, W3, Xq, ldq, Rq, W3, E,
                        tmp, bp, gs, nt);
        } else {
            grad_weight(kt, grads->q_weight, gbq, acc, dq, E, Xq, ldq, Rq, E, E, tmp, bp, gs, nt);
            grad_weight(kt, grads->k_weight, gbk, acc, dk, Ekv, Xk, ldk, Rk, Ekv, kd, tmp, bp, gs,
                        nt);
            grad_weight(kt, grads->v_weight, gbv, acc, dv, Ekv, Xv, ldv, Rk, Ekv, vd, tmp, bp, gs,
                        nt);
        }
        if (m->cfg.add_bias_kv)  // row 0 of the appended keys: sum over b
            for (int64_t g = 0; g < Hkv; g++)
                for (int64_t c = 0; c < d; c++) {
                    double sk = 0.0, sv_ = 0.0;
                    for (int64_t b = 0; b < N; b++) {
                        sk += dextra[(b * Hkv + g) * nx * d + c];
                        sv_ += dextra[(N * Hkv + b * Hkv + g) * nx * d + c];
                    }
                    store_f(grads->bias_k + g * d + c, sk, acc);
                    store_f(grads->bias_v + g * d + c, sv_, acc);
                }
    }
    // Input gradients: dX = d W (self-attention: each part separately, as
    // the API returns grad_query, grad_key, grad_value).
    if (gq) mha__grad_input_rows(kt, gq, acc, dq, W3, m->q_weight, Rq, E, E, tmp, bp, gs, nt);
    if (gq && m->cfg.head_gate == MHA_GATE_DYNAMIC)  // dXq += dz W_g
        mha__grad_input_rows(kt, gq, true, dg, H, m->gate_weight, Rq, H, E, tmp, bp, gs, nt);
    mha__free(gbuf);
    if (gk) mha__grad_input_rows(kt, gk, acc, dk, ldkv, m->k_weight, Rk, Ekv, kd, tmp, bp, gs, nt);
    if (gv) mha__grad_input_rows(kt, gv, acc, dv, ldkv, m->v_weight, Rk, Ekv, vd, tmp, bp, gs, nt);
    mha__free(blk);
    return MHA_OK;
}
