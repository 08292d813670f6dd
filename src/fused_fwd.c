// fused.c: the fused module forward (MHA_IMPL_FUSED), float32:
//   1. projections as GEMMs over row matrices: X (R, F) W^T (F, E) (k, v:
//      (F, Ekv), Ekv = Hkv d); with self-attention and the packed
//      in_proj_weight, one GEMM X (R, E) in_proj_weight^T (E, E + 2 Ekv)
//      -> qkv (R, E + 2 Ekv)
//   2. per (b, h, tile of 64 query rows): flash.c on strided head views of
//      q, k, v (no split, no copy; query head h reads KV head h / (H / Hkv)),
//      writing the context in place
//   3. ctx (R, E) out_proj.weight^T (E, E) + bias, into the output
// Rows of an input view (d0, d1, F) are r = i0*d1 + i1; a view whose rows
// are evenly spaced with unit feature stride is used in place, any other
// is copied once. Work is split over rows (GEMMs) and over (b, h, tile)
// items (attention): each output element is computed by one thread in a
// fixed order, so results do not depend on the number of threads.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "flash.h"
#include "gemm.h"
#include "philox.h"
#include "plan.h"

// The batch element n and position t of row r of a query-shaped view.
static void row_nt(const fwd_plan *p, bool seq_first, const mha_tensor *t, int64_t r,
                   int64_t *n, int64_t *pos) {
    const int64_t d1 = t->ndim == 3 ? t->shape[1] : 1, i0 = r / d1, i1 = r % d1;
    *n = p->unbatched ? 0 : (seq_first ? i1 : i0);
    *pos = p->unbatched ? r : (seq_first ? i0 : i1);
}

// The keys appended by add_bias_kv / add_zero_attn, per KV head: extra
// (H, nx, d) for k (bias_k slice, then zeros), then (H, nx, d) for v; H
// the number of KV heads.
static void fill_extra(float *extra, const mha_module *m, int64_t H, int64_t nx, int64_t d) {
    for (int64_t h = 0; h < H; h++)
        for (int64_t x = 0; x < nx; x++)
            for (int64_t c = 0; c < d; c++) {
                bool bias_row = m->cfg.add_bias_kv && x == 0;
                extra[(h * nx + x) * d + c] = bias_row ? m->bias_k[h * d + c] : 0.0f;
                extra[(H * nx + h * nx + x) * d + c] = bias_row ? m->bias_v[h * d + c] : 0.0f;
            }
}

// A weight matrix in its storage: elements of dt (F32, BF16, F16); wh:
// the widening scratch of half ones (mha__gemm_pack_half_tmp_floats).
typedef struct wsrc {
    const void *p;
    mha_dtype dt;
    float *wh;
} wsrc;

static wsrc wf32(const float *W) { return (wsrc){W, MHA_F32, NULL}; }

// C (R, O) = X (R, I) W^T + b for a PyTorch weight W (O, I): W packed into
// Wp (mha__gemm_packed_b_floats(kt, I, O) floats; half weights widened on
// the way), then the packed GEMM (gemm.h), rows over nt threads with gs as
// its scratch. (Packing even for one row keeps every row's sum order that
// of the packed kernel: a token's projection does not depend on how many
// rows share the call.)
static void linear_rows(const mha__kernels *kt, float *C, int64_t ldc, const float *X,
                        int64_t ldx, wsrc W, const float *b, int64_t R, int64_t I,
                        int64_t O, float *Wp, float *gs, int nt) {
    if (W.dt == MHA_F32) mha__gemm_pack_wt(kt, Wp, W.p, O, I, nt);
    else mha__gemm_pack_wt_half(kt, Wp, W.p, W.dt == MHA_BF16 ? 1 : 2, O, I, nt, W.wh);
    mha__gemm_rows_packed(kt, C, ldc, X, ldx, Wp, b, R, I, O, false, nt, gs);
}

// The module's weight matrix at p (one of m->w_*), with scratch wh.
static wsrc wmod(const mha_module *m, const void *p, float *wh) {
    return (wsrc){p, m->wdt, wh};
}

// The gates of a gated module's R query rows X (R, E), gate (R, H):
// head_gate[h] (static) or sigmoid(X W_g^T + b_g) (dynamic; W_g packed into
// Wp, mha__gemm_packed_b_floats(kt, E, H) floats); and gctx (R, E) = each
// head's ctx times its gate.
static void gate_rows(const mha__kernels *kt, float *gate, float *gctx, const float *ctx,
                      const mha_module *m, const float *X, int64_t ldx, int64_t R, float *Wp,
                      float *gs, int nt) {
    const int64_t E = m->cfg.embed_dim, H = m->cfg.num_heads, d = m->head_dim;
    if (m->cfg.head_gate == MHA_GATE_DYNAMIC) {
        linear_rows(kt, gate, H, X, ldx, wf32(m->gate_weight), m->gate_bias, R, E, H, Wp, gs, nt);
        for (int64_t i = 0; i < R * H; i++) gate[i] = (float)(1.0 / (1.0 + exp(-(double)gate[i])));
    } else {
        for (int64_t r = 0; r < R; r++) memcpy(gate + r * H, m->head_gate, (size_t)H * sizeof(float));
    }
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t r = 0; r < R; r++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t c = 0; c < d; c++)
                gctx[r * E + h * d + c] = ctx[r * E + h * d + c] * gate[r * H + h];
}

// Zeroes rows [i0, i1) of head column block [c0, c0 + d) of a row matrix.
static void zero_head_rows(float *row0, int64_t rs, int64_t i0, int64_t i1, int64_t d) {
    for (int64_t i = i0; i < i1; i++) memset(row0 + i * rs, 0, (size_t)d * sizeof(float));
}

// C (R, N) = A (R, K) B (K, N) for a row-major B (row stride ldb), packed
// into Bp first.
static void matmul_rows(const mha__kernels *kt, float *C, int64_t ldc, const float *A,
                        int64_t lda, const float *B, int64_t ldb, int64_t R, int64_t K,
                        int64_t N, float *Bp, float *gs, int nt) {
    mha__gemm_pack_rows(kt, Bp, B, ldb, K, N, nt);
    mha__gemm_rows_packed(kt, C, ldc, A, lda, Bp, NULL, R, K, N, false, nt, gs);
}

// Head (b, h) rows of a row matrix laid out as its view: first row and
// row stride.
typedef struct rowmap {
    float *base;
    int64_t ld;       // row stride of the matrix
    bool seq_first;   // rows are (t, n) (else (n, t))
    int64_t N, T;
} rowmap;

static float *head_row0(const rowmap *rm, int64_t b, int64_t col) {
    return rm->base + (rm->seq_first ? b : b * rm->T) * rm->ld + col;
}
static int64_t head_rs(const rowmap *rm) { return rm->seq_first ? rm->N * rm->ld : rm->ld; }

// RoPE on the first T tokens of each batch element of a q or k row matrix
// (all H heads of a token contiguous: p->H for q, p->Hkv for k), or its
// inverse (gradients).
static void rope_rows(const fwd_plan *p, const mha_forward_args *a, const rowmap *rm,
                      int64_t T, int64_t H, bool inverse) {
    if (a->rope.mode == MHA_ROPE_NONE) return;
    double inv[MHA__ROPE_MAX_HALF];
    mha__rope_inv_freq(inv, &a->rope, p->d);
#pragma omp parallel for schedule(static) num_threads(p->nthreads)
    for (int64_t n = 0; n < p->N; n++) {
        const int64_t s0 = a->rope_start ? a->rope_start[n] : 0;
        const int64_t *pos = p->part ? p->part->rope_pos : NULL;
        float *row0 = head_row0(rm, n, 0);
        for (int64_t t = 0; t < T; t++)
            mha__rope_token_f(row0 + t * head_rs(rm), p->d, H, &a->rope, p->d, inv,
                              (double)(s0 + (pos ? pos[t] : t)), inverse);
    }
}

// The forward's step 3 from the context ctx (Rq, E; gated in place when
// in_place, else into the scratch): the gates, W_O (+ out_proj.bias unless a
// part without it), the output dropout, into out. xq: the query rows.
static void out_project(const mha__kernels *kt, const fwd_plan *p, mha_tensor *out,
                        const mha_module *m, const mha_forward_args *a, float *ctx,
                        bool in_place, const float *xq, int64_t ldq, char *ws) {
    const int64_t E = p->E, Rq = mha__rows_of(a->query);
    const int nt = p->nthreads;
    const bool seq_first = p->unbatched || !m->cfg.batch_first;
    const mha__part *pt = p->part;
    float *wo = (float *)(ws + p->f_wo), *gs = (float *)(ws + p->f_gs),
          *wh = (float *)(ws + p->f_wh);
    int64_t ldo = E;
    bool direct = mha__rows_direct(out, &ldo);
    float *y = direct ? (float *)out->data : (float *)(ws + p->f_out);
    if (!direct) ldo = E;
    const float *octx = ctx;
    if (mha__module_gated(m)) {  // the heads' contexts times their gates (in place
                                 // unless the saved state keeps the ungated ctx)
        float *gctx = in_place ? ctx : (float *)(ws + p->f_gctx);
        gate_rows(kt, (float *)(ws + p->f_gate), gctx, ctx, m, xq, ldq, Rq,
                  (float *)(ws + p->f_wg), gs, nt);
        octx = gctx;
    }
    linear_rows(kt, y, ldo, octx, E, wmod(m, m->w_out, wh), pt && !pt->bias ? NULL : m->out_bias,
                Rq, E, E, wo, gs, nt);
    if (p->out_p > 0.0f)
        for (int64_t r = 0; r < Rq; r++) {
            int64_t n, t;
            row_nt(p, seq_first, out, r, &n, &t);
            for (int64_t e = 0; e < E; e++)
                y[r * ldo + e] *= mha__out_drop_factor(a->dropout_seed, a->dropout_offset, p->out_p, p->L,
                                                       p->E, n, t, e);
        }
    if (!direct)
        for (int64_t r = 0; r < Rq; r++) {
            mha__mat row = mha__view_row(out, r);
            for (int64_t e = 0; e < E; e++) mha__st(row, 0, e, y[r * ldo + e]);
        }
}

// The (query tile, key tile) pairs whose scores rows [i0, i1) of a head
// compute (the key tiles flash.c visits).
static int64_t key_tiles(const mha__flash_head *fh, int64_t i0, int64_t i1) {
    int64_t lo, hi;
    mha__flash_key_range(fh, i0, i1, &lo, &hi);
    return (lo < hi ? (hi - 1) / MHA__FLASH_BC - lo / MHA__FLASH_BC + 1 : 0) + (fh->nx > 0);
}

mha_status mha__fused_forward(const fwd_plan *p, mha_tensor *out, mha_tensor *weights,
                              const mha_module *m, const mha_forward_args *a, char *ws) {
    const mha__kernels *kt = mha__kernels_get();
    const int64_t N = p->N, L = p->L, S = p->S, Sp = p->Sp, E = p->E, H = p->H, d = p->d;
    const int64_t nx = Sp - S, Rq = mha__rows_of(a->query), Rk = mha__rows_of(a->key);
    const int64_t Ekv = p->Ekv, Hkv = p->Hkv, G = H / Hkv, W3 = E + 2 * Ekv;
    const int nt = p->nthreads;
    const bool seq_first = p->unbatched || !m->cfg.batch_first;
    float *wt = (float *)(ws + p->f_wt), *gs = (float *)(ws + p->f_gs),
          *wh = (float *)(ws + p->f_wh);
    const float *bq = m->in_proj_bias, *bk = bq ? bq + E : NULL,
                *bv = bq ? bq + E + Ekv : NULL;

    // 1. Projections.
    int64_t ldq = E, ldk = p->kdim, ldv = p->vdim;
    const float *xq = (const float *)(ws + p->f_xq), *xk = (const float *)(ws + p->f_xk),
                *xv = (const float *)(ws + p->f_xv);
    if (p->q_direct) mha__rows_direct(a->query, &ldq), xq = a->query->data;
    else if (!(p->part && p->part->q_in)) mha__gather_rows((float *)xq, a->query);
    // with a saved state (training), the projections, the context and the
    // row stats go straight into it (the backward's layout)
    mha_saved *sv = a->save;
    float *sbuf = sv ? sv->buf : NULL;
    rowmap qm, km, vm;
    const mha__part *pt = p->part;
    if (pt && pt->q_in) {  // projected elsewhere (sequence parallelism)
        qm = (rowmap){(float *)pt->q_in, E, seq_first, N, L};
        km = (rowmap){(float *)pt->k_in, Ekv, seq_first, N, S};
        vm = (rowmap){(float *)pt->v_in, Ekv, seq_first, N, S};
        goto projected;
    }
    // a part: only its heads' rows of the weights, into their columns
    const int64_t g0 = pt ? pt->g0 : 0, g1 = pt ? pt->g1 : Hkv, nq = (g1 - g0) * G * d,
                  nkv = (g1 - g0) * d, oq = g0 * G * d, okv = g0 * d;
    const size_t es = mha_dtype_size(m->wdt);
#define WROWS(w, r, in) wmod(m, (const char *)(w) + (size_t)(r) * (size_t)(in) * es, wh)
#define BOFF(b, o) ((b) ? (b) + (o) : NULL)
    if (p->self_packed && pt) {
        float *qkv = sv ? sbuf : (float *)(ws + p->f_qkv);
        linear_rows(kt, qkv + oq, W3, xq, ldq, WROWS(m->w_q, oq, E), BOFF(bq, oq), Rq, E, nq,
                    wt, gs, nt);
        linear_rows(kt, qkv + E + okv, W3, xq, ldq, WROWS(m->w_k, okv, E), BOFF(bk, okv), Rq, E,
                    nkv, wt, gs, nt);
        linear_rows(kt, qkv + E + Ekv + okv, W3, xq, ldq, WROWS(m->w_v, okv, E), BOFF(bv, okv),
                    Rq, E, nkv, wt, gs, nt);
        qm = (rowmap){qkv, W3, seq_first, N, L};
        km = (rowmap){qkv + E, W3, seq_first, N, L};
        vm = (rowmap){qkv + E + Ekv, W3, seq_first, N, L};
    } else if (p->self_packed) {
        float *qkv = sv ? sbuf : (float *)(ws + p->f_qkv);
        linear_rows(kt, qkv, W3, xq, ldq, wmod(m, m->w_in, wh), bq, Rq, E, W3, wt, gs, nt);
        qm = (rowmap){qkv, W3, seq_first, N, L};
        km = (rowmap){qkv + E, W3, seq_first, N, L};
        vm = (rowmap){qkv + E + Ekv, W3, seq_first, N, L};
    } else {
        if (p->k_direct) mha__rows_direct(a->key, &ldk), xk = a->key->data;
        else mha__gather_rows((float *)xk, a->key);
        if (p->v_direct) mha__rows_direct(a->value, &ldv), xv = a->value->data;
        else mha__gather_rows((float *)xv, a->value);
        float *wq = wt, *wk = wq + mha__gemm_packed_b_floats(kt, E, E),
              *wv = wk + mha__gemm_packed_b_floats(kt, p->kdim, Ekv);
        float *q = sv ? sbuf : (float *)(ws + p->f_qkv),
              *k = sv ? sbuf + Rq * E : (float *)(ws + p->f_k),
              *v = sv ? sbuf + Rq * E + Rk * Ekv : (float *)(ws + p->f_v);
        linear_rows(kt, q + oq, E, xq, ldq, WROWS(m->w_q, oq, E), BOFF(bq, oq), Rq, E, nq, wq,
                    gs, nt);
        linear_rows(kt, k + okv, Ekv, xk, ldk, WROWS(m->w_k, okv, p->kdim), BOFF(bk, okv), Rk,
                    p->kdim, nkv, wk, gs, nt);
        linear_rows(kt, v + okv, Ekv, xv, ldv, WROWS(m->w_v, okv, p->vdim), BOFF(bv, okv), Rk,
                    p->vdim, nkv, wv, gs, nt);
#undef WROWS
#undef BOFF
        qm = (rowmap){q, E, seq_first, N, L};
        km = (rowmap){k, Ekv, seq_first, N, S};
        vm = (rowmap){v, Ekv, seq_first, N, S};
    }
    rope_rows(p, a, &qm, L, H, false);
    rope_rows(p, a, &km, S, Hkv, false);
    if (pt && pt->q_out) {  // the projections are what the caller wants
        for (int64_t r = 0; r < Rq; r++)
            memcpy(pt->q_out + r * E, qm.base + r * qm.ld, sizeof(float) * (size_t)E);
        for (int64_t r = 0; r < Rk; r++) {
            memcpy(pt->k_out + r * Ekv, km.base + r * km.ld, sizeof(float) * (size_t)Ekv);
            memcpy(pt->v_out + r * Ekv, vm.base + r * vm.ld, sizeof(float) * (size_t)Ekv);
        }
        return MHA_OK;
    }
projected:;
    // the appended keys per KV head: (nx, d) for k, then for v
    float *extra = (float *)(ws + p->f_extra);
    fill_extra(extra, m, Hkv, nx, d);

    // 2. Attention, per (b, h, tile of query rows).
    float *ctx = pt && pt->ctx ? pt->ctx : sv ? sbuf + sv->n_qkv : (float *)(ws + p->f_ctx);
    rowmap cm = {ctx, E, seq_first, N, L};
    float *lse = pt && pt->stats ? pt->stats
                 : sv ? sbuf + sv->n_qkv + sv->n_ctx
                      : a->need_weights ? (float *)(ws + p->f_lse) : NULL;
    float *headw = (float *)(ws + p->f_headw);
    const bool avg = a->need_weights && a->average_attn_weights;
    const int64_t tiles = (L + MHA__FLASH_BR - 1) / MHA__FLASH_BR;
    const size_t sf = mha__flash_scratch_floats(d, d, S, nx, false);
    float *scratch = (float *)(ws + p->f_scratch);
    for (int t = 0; t < nt; t++) mha__flash_scratch_reset(scratch + (size_t)t * sf);
    const bool ext = pt && pt->attn;  // attention done by the caller (ring)
    if (ext) {
        const mha__attn_io io = {.N = N, .L = L, .S = S, .seq_first = seq_first, .q = qm.base,
                                 .k = km.base, .v = vm.base, .ldq = qm.ld, .ldk = km.ld,
                                 .ctx = ctx, .stats = sv ? lse : NULL};
        mha_status st = pt->attn(pt->attn_arg, &io);
        if (st) return st;
    }
    int64_t ntiles = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt) reduction(+ : ntiles)
    for (int64_t item = 0; item < (ext ? 0 : N * H * tiles); item++) {
        // causal rows near the end cost more: hand them out first
        int64_t it = p->mask.causal ? N * H * tiles - 1 - item : item;
        int64_t bh = it / tiles, tile = it % tiles, b = bh / H, h = bh % H;
        int tid = mha__thread_id();
        const int64_t g = h / G;  // the KV head
        mha__flash_head fh = {
            .q = head_row0(&qm, b, h * d), .q_rs = head_rs(&qm),
            .k = head_row0(&km, b, g * d), .k_rs = head_rs(&km),
            .v = head_row0(&vm, b, g * d), .v_rs = head_rs(&vm),
            .xk = extra + g * nx * d, .xv = extra + (Hkv + g) * nx * d, .nx = nx,
            .o = head_row0(&cm, b, h * d), .o_rs = head_rs(&cm),
            .stats = lse ? lse + 2 * bh * L : NULL,
            .L = L, .S = S, .D = d, .Dv = d, .scale = (float)(1.0 / sqrt((double)d)),
            .mask = &p->mask, .drop = mha__plan_drop(p), .b = b, .h = h,
        };
        int64_t i0 = tile * MHA__FLASH_BR, i1 = mha__tile_end(i0, MHA__FLASH_BR, L);
        float *sc = scratch + (size_t)tid * sf;
        const bool live = mha__plan_head_live(p, m, h);  // pruned / not in the part: no work, zero context
        if (live) mha__flash_rows(kt, &fh, i0, i1, sc);
        else zero_head_rows(fh.o, fh.o_rs, i0, i1, d);
        if (live && pt && pt->tiles) ntiles += key_tiles(&fh, i0, i1);
        if (pt && pt->progress && tid == 0) pt->progress(pt->progress_arg);
        // the weights of this tile's rows in the selected block
        const int64_t r0 = i0 > p->wr0 ? i0 : p->wr0, r1 = i1 < p->wr1 ? i1 : p->wr1;
        if (a->need_weights && h >= p->wh0 && h < p->wh1 && r0 < r1) {
            const int64_t Hs = p->wh1 - p->wh0, Ls = p->wr1 - p->wr0, hs = h - p->wh0;
            mha__mat w;
            float *wq = NULL;  // int8 weights: the rows in float first
            if (avg) {
                w = (mha__mat){headw + ((b * Hs + hs) * Ls + r0 - p->wr0) * Sp, false, Sp, 1, 0};
            } else if (a->weights_scale) {
                wq = (float *)(ws + p->f_wtmp) + (size_t)tid * MHA__FLASH_BR * Sp;
                w = (mha__mat){wq, false, Sp, 1, 0};
            } else {
                int o = p->unbatched ? 0 : 1;
                w = mha__vmat((char *)weights->data +
                                  ((p->unbatched ? 0 : b * weights->stride[0]) +
                                   hs * weights->stride[o] +
                                   (r0 - p->wr0) * weights->stride[o + 1]) *
                                      (int64_t)mha_dtype_size(weights->dtype),
                              weights->dtype, weights->stride[o + 1], weights->stride[o + 2]);
            }
            if (live) mha__flash_weights(kt, &fh, r0, r1, w, sc);
            else
                for (int64_t r = 0; r < r1 - r0; r++)
                    for (int64_t j = 0; j < Sp; j++) mha__st(w, r, j, 0.0);
            if (wq) {
                int o = p->unbatched ? 0 : 1;
                for (int64_t r = r0; r < r1; r++)
                    mha__weights_row_out(weights, a->weights_scale,
                                         (b * Hs + hs) * Ls + r - p->wr0,
                                         (p->unbatched ? 0 : b * weights->stride[0]) +
                                             hs * weights->stride[o] +
                                             (r - p->wr0) * weights->stride[o + 1],
                                         NULL, wq + (r - r0) * Sp, Sp);
            }
        }
    }
    if (pt && pt->tiles) *pt->tiles += ntiles;
    if (sv) sv->valid = true;
    if (pt && pt->ctx) return MHA_OK;  // a part's context: the caller goes on
    if (avg) {  // mean over the selected live heads, summed in head order
        const int64_t Hs = p->wh1 - p->wh0, Ls = p->wr1 - p->wr0;
        const float nlive = (float)(mha__live_in(m, p->wh0, p->wh1) ? mha__live_in(m, p->wh0, p->wh1) : 1);
        int o = p->unbatched ? 0 : 1;
        for (int64_t b = 0; b < N; b++)
            for (int64_t i = 0; i < Ls; i++) {
                const int64_t off = (p->unbatched ? 0 : b * weights->stride[0]) +
                                    i * weights->stride[o];
                if (a->weights_scale) {  // int8 weights: the row in float first
                    float *row = (float *)(ws + p->f_wtmp);
                    for (int64_t j = 0; j < Sp; j++) {
                        float s = 0.0f;
                        for (int64_t h = 0; h < Hs; h++)
                            s += headw[((b * Hs + h) * Ls + i) * Sp + j];
                        row[j] = s / nlive;
                    }
                    mha__weights_row_out(weights, a->weights_scale, b * Ls + i, off, NULL, row,
                                         Sp);
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

    // 3. Output projection (rows in the query's order, as ctx), then the
    //    output dropout, into the output view.
    out_project(kt, p, out, m, a, ctx, !sv, xq, ldq, ws);
    return MHA_OK;
}

void mha__fused_out_project(const fwd_plan *p, mha_tensor *out, const mha_module *m,
                            const mha_forward_args *a, float *ctx, char *ws) {
    int64_t ldq = p->E;
    const float *xq = (const float *)(ws + p->f_xq);
    if (p->q_direct) mha__rows_direct(a->query, &ldq), xq = a->query->data;
    else mha__gather_rows((float *)xq, a->query);
    out_project(mha__kernels_get(), p, out, m, a, ctx, true, xq, ldq, ws);
}

// ---------------------------------------------------------------------------
// Saved state of a training forward (mha_forward_args.save)

// Floats of the projections as the backward (and the saved state) lay
// them out: (Rq, E + 2 Ekv) packed, else q (Rq, E), k and v (Rk, Ekv).
static size_t qkv_floats(const fwd_plan *p, int64_t Rq, int64_t Rk) {
    return (size_t)(p->self_packed ? Rq * (p->E + 2 * p->Ekv) : Rq * p->E + 2 * Rk * p->Ekv);
}

static void key_tensor(mha_tensor *dst, const mha_tensor *t) {
    memset(dst, 0, sizeof *dst);
    if (!t) return;
    dst->data = t->data;
    dst->dtype = t->dtype;
    dst->ndim = t->ndim;
    for (int i = 0; i < t->ndim && i < MHA_MAX_DIMS; i++) {
        dst->shape[i] = t->shape[i];
        dst->stride[i] = t->stride[i];
    }
}

void mha__saved_key_of(mha__saved_key *k, const mha_module *m, const mha_forward_args *a) {
    memset(k, 0, sizeof *k);
    k->m = m;
    key_tensor(&k->q, a->query);
    key_tensor(&k->k, a->key);
    key_tensor(&k->v, a->value);
    key_tensor(&k->kpm, a->key_padding_mask);
    key_tensor(&k->am, a->attn_mask);
    k->causal = a->is_causal;
    k->training = a->training;
    k->window_left = a->window_left;
    k->window_right = a->window_right;
    k->seed = a->dropout_seed;
    k->offset = a->dropout_offset;
    k->rope_mode = a->rope.mode;
    k->rope_theta = a->rope.theta;
    k->rope_dim = a->rope.dim;
    k->rope_start = a->rope_start;
    k->alibi = a->alibi;
    k->alibi_slopes = a->alibi_slopes;
    k->softcap = a->softcap;
}

static bool saved_key_equal(const mha__saved_key *x, const mha__saved_key *y) {
    return memcmp(x, y, sizeof *x) == 0;  // both memset before filling
}

mha_status mha__saved_prepare(mha_saved *s, const fwd_plan *p, const mha_module *m,
                              const mha_forward_args *a) {
    s->valid = false;
    s->outer_valid = false;
    if (!p->fused) return MHA_OK;  // only the fused path keeps state
    const int64_t E = p->E, Rq = mha__rows_of(a->query), Rk = mha__rows_of(a->key);
    s->n_qkv = qkv_floats(p, Rq, Rk);
    s->n_ctx = (size_t)(Rq * E);
    s->n_lse = (size_t)(2 * p->N * p->H * p->L);
    const size_t need = s->n_qkv + s->n_ctx + s->n_lse;
    if (need > s->cap) {
        size_t bytes;
        if (mha__mul_overflow_size(need, sizeof(float), &bytes))
            return mha__fail(MHA_ERR_OVERFLOW, "saved state: size overflows");
        float *nb = mha__alloc(bytes);
        if (!nb)
            return mha__fail(MHA_ERR_NOMEM, "saved state: out of memory for %zu bytes", bytes);
        mha__free(s->buf);
        s->buf = nb;
        s->cap = need;
    }
    mha__saved_key_of(&s->key, m, a);
    return MHA_OK;
}

mha_status mha_saved_create(mha_saved **out) {
    if (!out) return mha__fail(MHA_ERR_INVALID_ARG, "mha_saved_create: NULL out");
    *out = mha__calloc(1, sizeof **out);
    if (!*out)
        return mha__fail(MHA_ERR_NOMEM, "mha_saved_create: out of memory (%zu bytes)",
                         sizeof **out);
    return MHA_OK;
}

void mha_saved_destroy(mha_saved *s) {
    if (!s) return;
    mha__free(s->buf);
    free(s);
}

size_t mha_saved_bytes(const mha_saved *s) { return s ? s->cap * sizeof(float) : 0; }

// ---------------------------------------------------------------------------
// Scaled dot-product attention on (B, H, T, D) views (mha_sdpa, fused): one
// flash head per (b, h), items (b, h, tile of query rows) over the threads.
// Extra memory: per thread the flash scratch (O((S) (D + Dv))), plus the
// row stats (B H L 2 floats) when the weights are asked for.

mha_status mha__fused_sdpa(mha_tensor *out, mha_tensor *weights, const mha_tensor *q,
                           const mha_tensor *k, const mha_tensor *v, const mha__mask *mk,
                           double scale) {
    const mha__kernels *kt = mha__kernels_get();
    const int64_t B = q->shape[0], H = q->shape[1], L = q->shape[2], D = q->shape[3],
                  S = k->shape[2], Dv = v->shape[3];
    const int nt = (double)B * H * L * S * (D + Dv) < MHA__PAR_MIN_WORK ? 1 : mha__max_threads();
    const size_t sf = mha__flash_scratch_floats(D, Dv, S, 0, false);
    size_t n_stats = weights ? (size_t)(2 * B * H * L) : 0, floats, bytes;
    if (mha__mul_overflow_size(sf, (size_t)nt, &floats) ||
        mha__add_overflow_size(floats, n_stats, &floats) ||
        mha__mul_overflow_size(floats, sizeof(float), &bytes))
        return mha__fail(MHA_ERR_OVERFLOW, "sdpa: scratch size overflows");
    float *blk = mha__alloc(bytes);
    if (!blk) return mha__fail(MHA_ERR_NOMEM, "sdpa: out of memory for %zu bytes", bytes);
    float *stats = weights ? blk + sf * (size_t)nt : NULL;
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
#define HEAD_PTR(t) ((float *)(t)->data + b * (t)->stride[0] + h * (t)->stride[1])
#define KV_PTR(t) ((float *)(t)->data + b * (t)->stride[0] + hk * (t)->stride[1])
        mha__flash_head fh = {
            .q = HEAD_PTR(q), .q_rs = q->stride[2], .k = KV_PTR(k), .k_rs = k->stride[2],
            .v = KV_PTR(v), .v_rs = v->stride[2], .xk = NULL, .xv = NULL, .nx = 0,
            .o = HEAD_PTR(out), .o_rs = out->stride[2],
            .stats = stats ? stats + 2 * bh * L : NULL,
            .L = L, .S = S, .D = D, .Dv = Dv, .scale = (float)scale,
            .mask = mk, .drop = NULL, .b = b, .h = h,
        };
        int64_t i0 = tile * MHA__FLASH_BR, i1 = mha__tile_end(i0, MHA__FLASH_BR, L);
        mha__flash_rows(kt, &fh, i0, i1, sc);
        if (weights) {
            mha__mat w = {HEAD_PTR(weights) + i0 * weights->stride[2], false,
                          weights->stride[2], weights->stride[3], 0};
            mha__flash_weights(kt, &fh, i0, i1, w, sc);
        }
#undef HEAD_PTR
#undef KV_PTR
    }
    mha__free(blk);
    return MHA_OK;
}

// ---------------------------------------------------------------------------
// Backward (MHA_IMPL_FUSED): the forward's projections and attention again
// (keeping each row's softmax stats), then
//   dy = dY * drop_o;  dctx = dy Wo;  dWo = dy^T ctx;  dbo = colsum(dy)
//   attention backward (flash.c, two passes) -> dq, dk, dv
//   dW = d^T X and dX = d W for each projection (one GEMM each over the
//   packed in_proj_weight with self-attention)
// Every sum has a fixed order: GEMMs split over output rows, attention
// over (b, h, tile) items.

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
static void grad_input(const mha__kernels *kt, mha_tensor *gx, bool acc, const float *d,
                       int64_t ldd, const float *W, int64_t R, int64_t O, int64_t I,
                       float *tmp, float *bp, float *gs, int nt) {
    matmul_rows(kt, tmp, I, d, ldd, W, I, R, O, I, bp, gs, nt);
    for (int64_t r = 0; r < R; r++) {
        mha__mat row = mha__view_row(gx, r);
        for (int64_t i = 0; i < I; i++)
            mha__st(row, 0, i, (acc ? mha__ld(row, 0, i) : 0.0) + tmp[r * I + i]);
    }
}

mha_status mha__fused_backward(const fwd_plan *p, mha_tensor *gq, mha_tensor *gk,
                               mha_tensor *gv, mha_module *grads, const mha_module *m,
                               const mha_forward_args *a, const mha_tensor *gout,
                               bool acc) {
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
    size_t n_qkv = qkv_floats(p, Rq, Rk);
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
        if (!saved_key_equal(&key, &sv->key) || sv->outer_valid != (p->part && p->part->attn) ||
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
    const mha__part *pt = p->part;
    // a part: its heads' rows of the weights only, into their columns
    const int64_t g0 = pt ? pt->g0 : 0, g1 = pt ? pt->g1 : Hkv, nq = (g1 - g0) * G * d,
                  nkv = (g1 - g0) * d, oq = g0 * G * d, okv = g0 * d;
#define BOFF(b, o) ((b) ? (b) + (o) : NULL)
    if (sv) {
    } else if (sp && !pt) {
        linear_rows(kt, qkv, W3, Xq, ldq, wf32(m->in_proj_weight), bq, Rq, E, W3, wt, gs, nt);
    } else {
        float *wq = wt, *wk = sp ? wt : wq + pw_q, *wv = sp ? wt : wk + pw_k;
        linear_rows(kt, q + oq, W3, Xq, ldq, wf32(m->q_weight + oq * E), BOFF(bq, oq), Rq, E,
                    nq, wq, gs, nt);
        linear_rows(kt, k + okv, ldkv, Xk, ldk, wf32(m->k_weight + okv * kd), BOFF(bk, okv), Rk,
                    kd, nkv, wk, gs, nt);
        linear_rows(kt, v + okv, ldkv, Xv, ldv, wf32(m->v_weight + okv * vd), BOFF(bv, okv), Rk,
                    vd, nkv, wv, gs, nt);
    }
#undef BOFF
    fill_extra(extra, m, Hkv, nx, d);
    rowmap qm = {q, W3, seq_first, N, L}, km = {k, ldkv, seq_first, N, sp ? L : S},
           vm = {v, ldkv, seq_first, N, sp ? L : S}, cm = {ctx, E, seq_first, N, L},
           dcm = {dctx, E, seq_first, N, L}, dqm = {dq, W3, seq_first, N, L},
           dkm = {dk, ldkv, seq_first, N, sp ? L : S}, dvm = {dv, ldkv, seq_first, N, sp ? L : S};
    if (!sv) {  // the saved q, k are rotated already
        rope_rows(p, a, &qm, L, H, false);
        rope_rows(p, a, &km, S, Hkv, false);
    }
    const int64_t tiles = (L + MHA__FLASH_BR - 1) / MHA__FLASH_BR;
    const int64_t ktiles = (S + MHA__FLASH_BC - 1) / MHA__FLASH_BC + (nx > 0);
    const float scale = (float)(1.0 / sqrt((double)d));
#define HEAD(b, h)                                                                       \
    (mha__flash_head) {                                                                  \
        .q = head_row0(&qm, b, h * d), .q_rs = head_rs(&qm),                            \
        .k = head_row0(&km, b, (h / G) * d), .k_rs = head_rs(&km),                       \
        .v = head_row0(&vm, b, (h / G) * d), .v_rs = head_rs(&vm),                       \
        .xk = extra + (h / G) * nx * d, .xv = extra + (Hkv + h / G) * nx * d, .nx = nx,  \
        .o = head_row0(&cm, b, h * d), .o_rs = head_rs(&cm), .stats = lse + 2 * (b * H + h) * L, \
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
        else zero_head_rows(fh.o, fh.o_rs, i0, i1, d);
    }

    // dy = dY * drop_o (rows in the query's order); dctx = dy Wo.
    for (int64_t r = 0; r < Rq; r++) {
        mha__mat row = mha__view_row(gout, r);
        int64_t n, t;
        row_nt(p, seq_first, gout, r, &n, &t);
        for (int64_t e = 0; e < E; e++) {
            float g = (float)mha__ld(row, 0, e);
            if (p->out_p > 0.0f)
                g *= mha__out_drop_factor(a->dropout_seed, a->dropout_offset, p->out_p, p->L, p->E, n,
                                          t, e);
            dy[r * E + e] = g;
        }
    }
    matmul_rows(kt, dctx, E, dy, E, m->out_weight, E, Rq, E, E, bp, gs, nt);
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
        gate_rows(kt, gate, gctx, ctx, m, Xq, ldq, Rq, gctx + Rq * E, gs, nt);
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
                zero_head_rows(head_row0(&dkm, b, g * d), head_rs(&dkm), 0, S, d);
                zero_head_rows(head_row0(&dvm, b, g * d), head_rs(&dvm), 0, S, d);
                memset(dextra + bg * nx * d, 0, sizeof(float) * (size_t)(nx * d));
                memset(dextra + (N * Hkv + bg) * nx * d, 0, sizeof(float) * (size_t)(nx * d));
            }
            for (int64_t h = g * G; h < (g + 1) * G; h++) {
                if (!mha__plan_head_live(p, m, h)) {
                    zero_head_rows(head_row0(&dqm, b, h * d), head_rs(&dqm), 0, L, d);
                    continue;
                }
                mha__flash_head fh = HEAD(b, h);
                mha__flash_bwd_head(kt, &fh, head_row0(&dcm, b, h * d), head_rs(&dcm),
                                    dsum + (b * H + h) * L, head_row0(&dqm, b, h * d),
                                    head_rs(&dqm), head_row0(&dkm, b, g * d), head_rs(&dkm),
                                    head_row0(&dvm, b, g * d), head_rs(&dvm),
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
            zero_head_rows(head_row0(&dqm, b, h * d), head_rs(&dqm), i0, i1, d);
            continue;
        }
        mha__flash_bwd_q(kt, &fh, head_row0(&dcm, b, h * d), head_rs(&dcm), dsum + bh * L,
                         i0, i1, head_row0(&dqm, b, h * d) + i0 * head_rs(&dqm),
                         head_rs(&dqm), scratch + (size_t)tid * sf);
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
            dkp = head_row0(&dkm, b, g * d) + j0 * head_rs(&dkm);
            dvp = head_row0(&dvm, b, g * d) + j0 * head_rs(&dvm);
            rs = head_rs(&dkm);
        }
        const int64_t h0 = mha__plan_group_first_live(p, m, g, G);
        if (h0 < 0) {  // the whole group pruned: no gradient
            zero_head_rows(dkp, rs, 0, n, d);
            zero_head_rows(dvp, rs, 0, n, d);
        }
        for (int64_t h = g * G; h < (g + 1) * G; h++) {
            if (!mha__plan_head_live(p, m, h)) continue;
            mha__flash_head fh = HEAD(b, h);
            mha__flash_bwd_kv(kt, &fh, head_row0(&dcm, b, h * d), head_rs(&dcm),
                              dsum + (b * H + h) * L, j0, n, dkp, rs, dvp, rs, h != h0,
                              scratch + (size_t)tid * sf);
        }
    }
#undef HEAD
    rope_rows(p, a, &dqm, L, H, true);  // through the rotation (orthogonal)
    rope_rows(p, a, &dkm, S, Hkv, true);
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
    if (gq) grad_input(kt, gq, acc, dq, W3, m->q_weight, Rq, E, E, tmp, bp, gs, nt);
    if (gq && m->cfg.head_gate == MHA_GATE_DYNAMIC)  // dXq += dz W_g
        grad_input(kt, gq, true, dg, H, m->gate_weight, Rq, H, E, tmp, bp, gs, nt);
    mha__free(gbuf);
    if (gk) grad_input(kt, gk, acc, dk, ldkv, m->k_weight, Rk, Ekv, kd, tmp, bp, gs, nt);
    if (gv) grad_input(kt, gv, acc, dv, ldkv, m->v_weight, Rk, Ekv, vd, tmp, bp, gs, nt);
    mha__free(blk);
    return MHA_OK;
}

mha_status mha__part_input_grads(mha_tensor *gq, mha_tensor *gk, mha_tensor *gv,
                                 const mha_module *m, const mha_forward_args *a,
                                 const float *dq, const float *dk, const float *dv,
                                 const float *dz, bool acc) {
    mha_forward_args a2 = *a;
    a2.need_weights = false, a2.save = NULL, a2.trace = NULL, a2.impl = MHA_IMPL_FUSED;
    fwd_plan p;
    mha_status st = mha__plan_forward(&p, m, &a2);
    if (st) return st;
    const mha__kernels *kt = mha__kernels_get();
    const int64_t E = p.E, H = p.H, Ekv = p.Ekv, kd = p.kdim, vd = p.vdim;
    const int64_t Rq = mha__rows_of(a->query), Rk = mha__rows_of(a->key), Rmax = Rq > Rk ? Rq : Rk;
    const int64_t Fmax = E > kd ? (E > vd ? E : vd) : (kd > vd ? kd : vd);
    const size_t n_bp = mha__gemm_packed_b_floats(kt, E > Ekv ? E : Ekv, Fmax),
                 n_gs = mha__gemm_scratch_floats(kt, p.nthreads),
                 n_tmp = (size_t)(Rmax * Fmax);
    float *blk = mha__alloc(sizeof(float) * (n_bp + n_gs + n_tmp));
    if (!blk)
        return mha__fail(MHA_ERR_NOMEM, "mha parallel: out of memory for %zu bytes of scratch",
                         sizeof(float) * (n_bp + n_gs + n_tmp));
    float *bp = blk, *gs = bp + n_bp, *tmp = gs + n_gs;
    const int nt = p.nthreads;
    if (gq) grad_input(kt, gq, acc, dq, E, m->q_weight, Rq, E, E, tmp, bp, gs, nt);
    if (gq && m->cfg.head_gate == MHA_GATE_DYNAMIC)
        grad_input(kt, gq, true, dz, H, m->gate_weight, Rq, H, E, tmp, bp, gs, nt);
    if (gk) grad_input(kt, gk, acc, dk, Ekv, m->k_weight, Rk, Ekv, kd, tmp, bp, gs, nt);
    if (gv) grad_input(kt, gv, acc, dv, Ekv, m->v_weight, Rk, Ekv, vd, tmp, bp, gs, nt);
    mha__free(blk);
    return MHA_OK;
}

mha_status mha__part_attn_backward(const mha_module *m, const mha_forward_args *a,
                                   const mha__part *part) {
    fwd_plan p;
    mha_forward_args a2;
    mha_status st = mha__part_plan(&p, &a2, m, a, part);
    if (st) return st;
    if (!part->q_in || !part->k_in || !part->v_in || !part->o_in || !part->do_in ||
        !part->stats || !part->dsum_in || !part->dq || !part->dk || !part->dv)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "mha parallel: a block's attention backward needs q, k, v, the "
                         "context, its gradient, the row stats and Dsum, and dq, dk, dv");
    if (p.Sp != p.S)
        return mha__fail(MHA_ERR_UNSUPPORTED,
                         "mha parallel: a block's attention backward has no appended keys "
                         "(add_bias_kv, add_zero_attn)");
    const mha__kernels *kt = mha__kernels_get();
    const int64_t N = p.N, L = p.L, S = p.S, E = p.E, H = p.H, d = p.d, Hkv = p.Hkv,
                  G = H / Hkv, Ekv = p.Ekv;
    const int nt = p.nthreads;
    const bool seq_first = p.unbatched || !m->cfg.batch_first;
    const size_t sf = mha__flash_scratch_floats(d, d, S, 0, true);
    float *scratch = mha__alloc(sizeof(float) * sf * (size_t)nt);
    if (!scratch)
        return mha__fail(MHA_ERR_NOMEM, "mha parallel: out of memory for %zu bytes of scratch",
                         sizeof(float) * sf * (size_t)nt);
    for (int t = 0; t < nt; t++) mha__flash_scratch_reset(scratch + (size_t)t * sf);
    const rowmap qm = {(float *)part->q_in, E, seq_first, N, L},
                 km = {(float *)part->k_in, Ekv, seq_first, N, S},
                 vm = {(float *)part->v_in, Ekv, seq_first, N, S},
                 om = {(float *)part->o_in, E, seq_first, N, L},
                 dom = {(float *)part->do_in, E, seq_first, N, L},
                 dqm = {part->dq, E, seq_first, N, L}, dkm = {part->dk, Ekv, seq_first, N, S},
                 dvm = {part->dv, Ekv, seq_first, N, S};
    const float scale = (float)(1.0 / sqrt((double)d));
    int64_t ntiles = 0;
    // one thread per KV head (b, g): its query heads in increasing order add
    // to dk_g, dv_g (the fused backward's order), no atomics
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt) reduction(+ : ntiles)
    for (int64_t bg = 0; bg < N * Hkv; bg++) {
        const int64_t b = bg / Hkv, g = bg % Hkv, h0 = mha__plan_group_first_live(&p, m, g, G);
        const int tid = mha__thread_id();
        if (h0 < 0) {  // the whole group pruned: no gradient
            zero_head_rows(head_row0(&dkm, b, g * d), head_rs(&dkm), 0, S, d);
            zero_head_rows(head_row0(&dvm, b, g * d), head_rs(&dvm), 0, S, d);
        }
        for (int64_t h = g * G; h < (g + 1) * G; h++) {
            if (!mha__plan_head_live(&p, m, h)) {
                zero_head_rows(head_row0(&dqm, b, h * d), head_rs(&dqm), 0, L, d);
                continue;
            }
            mha__flash_head fh = {
                .q = head_row0(&qm, b, h * d), .q_rs = head_rs(&qm),
                .k = head_row0(&km, b, g * d), .k_rs = head_rs(&km),
                .v = head_row0(&vm, b, g * d), .v_rs = head_rs(&vm),
                .o = head_row0(&om, b, h * d), .o_rs = head_rs(&om),
                .stats = (float *)part->stats + 2 * (b * H + h) * L,
                .L = L, .S = S, .D = d, .Dv = d, .scale = scale, .mask = &p.mask,
                .drop = mha__plan_drop(&p), .b = b, .h = h, .dsum_fixed = true,
                .progress = tid == 0 ? part->progress : NULL,
                .progress_arg = part->progress_arg,
            };
            mha__flash_bwd_head(kt, &fh, head_row0(&dom, b, h * d), head_rs(&dom),
                                (float *)part->dsum_in + (b * H + h) * L,
                                head_row0(&dqm, b, h * d), head_rs(&dqm),
                                head_row0(&dkm, b, g * d), head_rs(&dkm),
                                head_row0(&dvm, b, g * d), head_rs(&dvm), NULL, NULL, h != h0,
                                scratch + (size_t)tid * sf);
            for (int64_t i0 = 0; part->tiles && i0 < L; i0 += MHA__FLASH_BR)
                ntiles += key_tiles(&fh, i0, mha__tile_end(i0, MHA__FLASH_BR, L));
        }
    }
    if (part->tiles) *part->tiles += ntiles;
    mha__free(scratch);
    return MHA_OK;
}

// ---------------------------------------------------------------------------
// Incremental (cached) self-attention: mha_forward_cached (mha.h).

mha_status mha_forward_cached(mha_tensor *out, const mha_module *m, const mha_forward_args *a,
                              mha_kv_cache *cache) {
    if (!out || !m || !a || !cache || !a->query)
        return mha__fail(MHA_ERR_INVALID_ARG, "mha_forward_cached: NULL argument");
    const mha_config *cfg = &m->cfg;
    if (a->key_padding_mask || a->attn_mask || a->need_weights || a->trace ||
        (a->training && (cfg->dropout > 0.0f || cfg->out_dropout > 0.0f)) ||
        cfg->add_bias_kv || cfg->add_zero_attn || (cfg->kdim && cfg->kdim != cfg->embed_dim) ||
        (cfg->vdim && cfg->vdim != cfg->embed_dim))
        return mha__fail(MHA_ERR_UNSUPPORTED,
                         "mha_forward_cached: masks, need_weights, trace, dropout, "
                         "add_bias_kv, add_zero_attn and kdim/vdim != embed_dim are not "
                         "available with a KV cache");
    if (a->query->dtype != MHA_F32 || out->dtype != MHA_F32)
        return mha__fail(MHA_ERR_UNSUPPORTED, "mha_forward_cached: float32 query and output only");
    mha_forward_args a2 = *a;
    a2.key = a2.value = a->query;
    a2.is_causal = true;
    a2.rope_start = NULL;
    a2.save = NULL;
    a2.impl = MHA_IMPL_FUSED;
    fwd_plan p;
    mha_status st = mha__plan_forward(&p, m, &a2);
    if (st) return st;
    if ((st = mha__check_output(out, "attn_output", &p.out_shape)) ||
        (st = mha__check_no_overlap(out, "attn_output", a->query, "query")))
        return st;
    const int64_t N = p.N, T = p.L, E = p.E, H = p.H, d = p.d, R = mha__rows_of(a->query);
    const int64_t Hkv = p.Hkv, Ekv = p.Ekv, W3 = E + 2 * Ekv;
    int64_t cB, cH, cD, cDv;
    mha__kv_cache_dims(cache, &cB, &cH, &cD, &cDv);
    if (cB != N || cH != Hkv || cD != d || cDv != d)
        return mha__fail(MHA_ERR_SHAPE,
                         "mha_forward_cached: the cache holds batch %lld, %lld KV heads of "
                         "dims %lld/%lld; this module and query need batch %lld, %lld KV "
                         "heads (num_kv_heads) of dim %lld",
                         (long long)cB, (long long)cH, (long long)cD, (long long)cDv,
                         (long long)N, (long long)Hkv, (long long)d);
    const mha__kernels *kt = mha__kernels_get();
    const int nt = p.nthreads;
    const bool seq_first = p.unbatched || !cfg->batch_first;
    // scratch: gathered x, packed weights (E (E + 2 Ekv) or separate) and
    // Wo, GEMM scratch, qkv (R, E + 2 Ekv), ctx (R, E), y (R, E), the start
    // positions
    const size_t pw = mha__gemm_packed_b_floats(kt, E, E), n_gs = mha__gemm_scratch_floats(kt, nt),
                 pwkv = mha__gemm_packed_b_floats(kt, E, Ekv);
    const size_t n_w = m->packed ? mha__gemm_packed_b_floats(kt, E, W3) : pw + 2 * pwkv;
    const size_t n_wh = m->wdt == MHA_F32 ? 0 : mha__half_weight_floats(kt, m, nt);
    size_t total = (size_t)(R * E) * 3 + (size_t)(R * W3) + n_w + pw + n_gs + n_wh, bytes;
    if (mha__mul_overflow_size(total, sizeof(float), &bytes))
        return mha__fail(MHA_ERR_OVERFLOW, "mha_forward_cached: scratch overflows");
    // (everything is allocated before the cache changes: a failure after
    // the append can only come from the attention, and is rolled back)
    const bool gated = mha__module_gated(m);
    const size_t gfloats = gated ? (size_t)(R * H + R * E) + mha__gemm_packed_b_floats(kt, E, H) : 0;
    float *blk = mha__alloc(bytes);
    int64_t *starts = mha__malloc(sizeof(int64_t) * (size_t)N);
    float *gbuf = gated ? mha__alloc(sizeof(float) * gfloats) : NULL;
    if (!blk || !starts || (gated && !gbuf)) {
        mha__free(blk);
        free(starts);
        mha__free(gbuf);
        return mha__fail(MHA_ERR_NOMEM,
                         "mha_forward_cached: out of memory for %zu bytes of scratch",
                         bytes + sizeof(float) * gfloats + sizeof(int64_t) * (size_t)N);
    }
    float *xg = blk, *wt = xg + R * E, *wo = wt + n_w, *gs = wo + pw, *qkv = gs + n_gs,
          *ctx = qkv + R * W3, *yt = ctx + R * E, *wh = yt + R * E;
    int64_t ldx = E;
    const float *X = xg;
    if (mha__rows_direct(a->query, &ldx)) X = a->query->data;
    else mha__gather_rows(xg, a->query), ldx = E;
    const float *bq = m->in_proj_bias;
    if (m->packed) {
        linear_rows(kt, qkv, W3, X, ldx, wmod(m, m->w_in, wh), bq, R, E, W3, wt, gs, nt);
    } else {
        linear_rows(kt, qkv, W3, X, ldx, wmod(m, m->w_q, wh), bq, R, E, E, wt, gs, nt);
        linear_rows(kt, qkv + E, W3, X, ldx, wmod(m, m->w_k, wh), bq ? bq + E : NULL, R, E, Ekv,
                    wt + pw, gs, nt);
        linear_rows(kt, qkv + E + Ekv, W3, X, ldx, wmod(m, m->w_v, wh), bq ? bq + E + Ekv : NULL,
                    R, E, Ekv, wt + pw + pwkv, gs, nt);
    }
    // (N, H, T, d) and (N, Hkv, T, d) views of the rows: row r = t N + n
    // (seq first) or n T + t
    const int64_t ns = seq_first ? 1 : T, ts = seq_first ? N : 1;
    mha_tensor qv = {qkv, MHA_F32, 4, {N, H, T, d}, {ns * W3, d, ts * W3, 1}};
    mha_tensor kv = {qkv + E, MHA_F32, 4, {N, Hkv, T, d}, {ns * W3, d, ts * W3, 1}};
    mha_tensor vv = kv, cv = {ctx, MHA_F32, 4, {N, H, T, d}, {ns * E, d, ts * E, 1}};
    vv.data = qkv + E + Ekv;
    for (int64_t n = 0; n < N; n++) starts[n] = mha_kv_cache_length(cache, n);
    float slopes_buf[MHA__ALIBI_MAX_DEFAULT];
    mha_cache_attend_args ca;
    mha_cache_attend_args_init(&ca);
    ca.window_left = a->window_left;
    ca.window_right = a->window_right;
    ca.softcap = a->softcap;
    if (a->alibi) {
        if (a->alibi_slopes) ca.alibi_slopes = a->alibi_slopes;
        else {
            mha__alibi_slopes(slopes_buf, H);  // H <= MHA__ALIBI_MAX_DEFAULT: the plan checked
            ca.alibi_slopes = slopes_buf;
        }
    }
    if ((st = mha_rope_apply(&qv, &a->rope, starts, false)) ||
        (st = mha_rope_apply(&kv, &a->rope, starts, false)) ||
        (st = mha_kv_cache_append(cache, &kv, &vv, NULL)))
        goto done;
    if ((st = mha_kv_cache_attend(&cv, &qv, cache, &ca, NULL))) {
        // the cache as it was: its lengths before the append
        for (int64_t n = 0; n < N; n++)
            if (mha_kv_cache_truncate(cache, n, starts[n])) break;  // (cannot fail)
        goto done;
    }
    for (int64_t h = 0; h < H; h++)  // pruned heads: zero context (computed all the same)
        if (!mha__head_live(m, h)) zero_head_rows(ctx + h * d, E, 0, R, d);
    const float *octx = ctx;
    if (gated) {
        gate_rows(kt, gbuf, gbuf + R * H, ctx, m, X, ldx, R, gbuf + R * H + R * E, gs, nt);
        octx = gbuf + R * H;
    }
    int64_t ldo = E;
    const bool direct = mha__rows_direct(out, &ldo);
    float *y = direct ? (float *)out->data : yt;
    if (!direct) ldo = E;
    linear_rows(kt, y, ldo, octx, E, wmod(m, m->w_out, wh), m->out_bias, R, E, E, wo, gs, nt);
    if (!direct)
        for (int64_t r = 0; r < R; r++) {
            mha__mat row = mha__view_row(out, r);
            for (int64_t e = 0; e < E; e++) mha__st(row, 0, e, y[r * ldo + e]);
        }
done:
    mha__free(gbuf);
    mha__free(blk);
    free(starts);
    return st;
}
