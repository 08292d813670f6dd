// backward.c: mha_backward, the gradient of the module's forward (reference
// path). It recomputes the forward's projections and, head by head, the
// attention probabilities (and dropout masks, from their seed): nothing from
// the forward is stored. Every step quotes the forward line it
// differentiates (forward.c, ref.c):
//   forward                                 backward
//   y  = drop_o(ctx Wo^T + bo)              dy = dY * keep_o / (1 - p_o)
//                                           dbo = sum dy; dWo = dy^T ctx
//                                           dctx = dy Wo
//   ctx_h = attention(q_h, k_g, v_g)        dq_h, dk_h, dv_h (ref.c);
//   (g = h / G: grouped-query, G = H / Hkv) dk_g = sum of the group's dk_h,
//                                           summed in increasing h
//   q = Xq Wq^T + bq                        dWq = dq^T Xq; dbq = sum dq;
//                                           dXq = dq Wq
//   k = [Xk Wk^T + bk; bias_k; 0]           rows < S as for q;
//                                           dbias_k = sum_n dk[n, S]
//   v = [Xv Wv^T + bv; bias_v; 0]           the same
// Each output element is summed by one thread in a fixed order, so the
// result does not depend on the number of threads.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "plan.h"

// Element `off` of a view's memory (any float type): = v, or += v.
static inline void store(void *base, mha_dtype dt, int64_t off, double v, bool acc) {
    const mha__mat m = mha__vmat(base, dt, 0, 1);
    mha__st(m, 0, off, acc ? mha__ld(m, 0, off) + v : v);
}

// dW (O, I) (+)= sum_{n < N, t < T} dY[n, t, :]^T X[t, n, :] and
// db (O) (+)= sum_{n, t} dY[n, t, :], where dY is (N, Tp, O) row-major
// (only its first T rows per n are used) and X is a float or double view
// with (seq, batch, feature) strides xs.
static void grad_linear(float *dW, float *db, bool acc, const double *dY,
                        int64_t Tp, const void *X, mha_dtype xdt,
                        const int64_t xs[3], int64_t N, int64_t T, int64_t O,
                        int64_t I, int nt) {
    mha__mat x = mha__vmat((void *)X, xdt, 0, 1);
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t o = 0; o < O; o++) {
        for (int64_t i = 0; i < I; i++) {
            double s = 0.0;
            for (int64_t n = 0; n < N; n++)
                for (int64_t t = 0; t < T; t++)
                    s += dY[(n * Tp + t) * O + o] *
                         mha__ld(x, 0, t * xs[0] + n * xs[1] + i * xs[2]);
            store(dW, MHA_F32, o * I + i, s, acc);
        }
        if (db) {
            double s = 0.0;
            for (int64_t n = 0; n < N; n++)
                for (int64_t t = 0; t < T; t++) s += dY[(n * Tp + t) * O + o];
            store(db, MHA_F32, o, s, acc);
        }
    }
}

// dX[t, n, :] (+)= dY[n, t, :] W for t < T, W (O, I) row-major; dX is a
// float or double view with (seq, batch, feature) strides xs; dY is
// (N, Tp, O).
static void grad_input(void *dX, mha_dtype dt, const int64_t xs[3], bool acc,
                       const double *dY, int64_t Tp, const float *W, int64_t N,
                       int64_t T, int64_t O, int64_t I, int nt) {
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t r = 0; r < N * T; r++) {
        int64_t n = r / T, t = r % T;
        const double *dy = dY + (n * Tp + t) * O;
        for (int64_t i = 0; i < I; i++) {
            double s = 0.0;
            for (int64_t o = 0; o < O; o++) s += dy[o] * W[o * I + i];
            store(dX, dt, t * xs[0] + n * xs[1] + i * xs[2], s, acc);
        }
    }
}

static mha_status check_grad_view(const mha_tensor *g, const char *name,
                                  const mha_tensor *like) {
    if (!g) return MHA_OK;
    mha_shape want = {like->ndim, {0}};
    for (int i = 0; i < like->ndim; i++) want.dims[i] = like->shape[i];
    return mha__check_output(g, name, &want);
}

static mha_status check_grads_module(const mha_module *g, const mha_module *m) {
    if (!g) return MHA_OK;
    if (g == m)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "backward: the gradient module is the module itself");
    const mha_config *a = &g->cfg, *b = &m->cfg;
    if (a->embed_dim != b->embed_dim || a->num_heads != b->num_heads ||
        a->num_kv_heads != b->num_kv_heads ||
        a->kdim != b->kdim || a->vdim != b->vdim || a->bias != b->bias ||
        a->add_bias_kv != b->add_bias_kv || a->head_gate != b->head_gate)
        return mha__fail(MHA_ERR_INVALID_ARG,
                         "backward: the gradient module's configuration "
                         "(embed_dim %lld, num_heads %lld, num_kv_heads %lld, kdim %lld, "
                         "vdim %lld, bias %d, add_bias_kv %d, head_gate %s) differs from the "
                         "module's (%lld, %lld, %lld, %lld, %lld, %d, %d, %s)",
                         (long long)a->embed_dim, (long long)a->num_heads,
                         (long long)a->num_kv_heads,
                         (long long)a->kdim, (long long)a->vdim, a->bias,
                         a->add_bias_kv, mha_head_gate_name(a->head_gate),
                         (long long)b->embed_dim,
                         (long long)b->num_heads, (long long)b->num_kv_heads,
                         (long long)b->kdim,
                         (long long)b->vdim, b->bias, b->add_bias_kv,
                         mha_head_gate_name(b->head_gate));
    return MHA_OK;
}

static mha_status check_backward(const fwd_plan *p, mha_tensor *gq,
                                 mha_tensor *gk, mha_tensor *gv,
                                 const mha_module *grads, const mha_module *m,
                                 const mha_forward_args *a,
                                 const mha_tensor *gout) {
    mha_status st;
    if (!gout)
        return mha__fail(MHA_ERR_INVALID_ARG, "backward: grad_output is NULL");
    if ((st = mha__check_output(gout, "grad_output", &p->out_shape)) ||
        (st = check_grad_view(gq, "grad_query", a->query)) ||
        (st = check_grad_view(gk, "grad_key", a->key)) ||
        (st = check_grad_view(gv, "grad_value", a->value)) ||
        (st = check_grads_module(grads, m)))
        return st;
    const mha_tensor *outs[3] = {gq, gk, gv};
    const char *onames[3] = {"grad_query", "grad_key", "grad_value"};
    const mha_tensor *ins[6] = {a->query, a->key, a->value, a->key_padding_mask,
                                a->attn_mask, gout};
    const char *inames[6] = {"query", "key", "value", "key_padding_mask",
                             "attn_mask", "grad_output"};
    for (int o = 0; o < 3; o++) {
        for (int i = 0; i < 6; i++)
            if ((st = mha__check_no_overlap(outs[o], onames[o], ins[i], inames[i])))
                return st;
        for (int o2 = o + 1; o2 < 3; o2++)
            if ((st = mha__check_no_overlap(outs[o], onames[o], outs[o2], onames[o2])))
                return st;
    }
    return MHA_OK;
}

mha_status mha_backward(mha_tensor *gq, mha_tensor *gk, mha_tensor *gv,
                        mha_module *grads, const mha_module *m,
                        const mha_forward_args *args, const mha_tensor *gout,
                        bool accumulate) {
    if (!m || !args)
        return mha__fail(MHA_ERR_INVALID_ARG, "mha_backward: NULL module or args");
    mha_status st = mha__require_f32_weights(m, "mha_backward");
    if (!st && grads) st = mha__require_f32_weights(grads, "mha_backward (grads)");
    if (st) return st;
    mha_forward_args a = *args;
    a.need_weights = false;  // only attn_output is differentiated
    a.trace = NULL;
    fwd_plan p;
    if ((st = mha__plan_forward(&p, m, &a))) return st;
    if ((st = check_backward(&p, gq, gk, gv, grads, m, &a, gout))) return st;
    if (p.fused) return mha__fused_backward(&p, gq, gk, gv, grads, m, &a, gout, accumulate);

    const int64_t N = p.N, L = p.L, S = p.S, Sp = p.Sp, E = p.E, H = p.H, d = p.d;
    const int64_t Hkv = p.Hkv, Ekv = p.Ekv, G = H / Hkv;  // G query heads per KV head
    const int nt = p.nthreads;
    // Scratch, one block of doubles: per thread 2 (L, Sp) and, with G > 1,
    // 2 (Sp, d) (one query head's dk, dv); q, dq, ctx, dctx, dy (N, L, E);
    // k, v, dk, dv (N, Sp, Ekv); gated: dgc (N, L, E), gate and dg (N, L, H).
    const bool gated = mha__module_gated(m);
    size_t nle = (size_t)(N * L * E), nse = (size_t)(N * Sp * Ekv),
           nlh = gated ? (size_t)(N * L * H) : 0,
           lsp = (size_t)(L * Sp) + (G > 1 ? (size_t)(Sp * d) : 0), count, bytes;
    if (mha__mul_overflow_size(2 * lsp, (size_t)nt, &count) ||
        mha__add_overflow_size(count, (gated ? 6 : 5) * nle + 4 * nse + 2 * nlh, &count) ||
        mha__mul_overflow_size(count, sizeof(double), &bytes))
        return mha__fail(MHA_ERR_OVERFLOW, "backward: scratch size overflows");
    double *block = mha__malloc(bytes ? bytes : 1);
    if (!block)
        return mha__fail(MHA_ERR_NOMEM,
                         "mha_backward: out of memory for %zu bytes of scratch", bytes);
    double *pw = block;  // nt x (2 (L, Sp) [+ 2 (Sp, d)])
    double *q = block + 2 * lsp * (size_t)nt;
    double *dq = q + nle, *ctx = dq + nle, *dctx = ctx + nle, *dy = dctx + nle;
    double *k = dy + nle, *v = k + nse, *dk = v + nse, *dv = dk + nse;
    double *dgc = dv + nse, *gate = dgc + (gated ? nle : 0), *dg = gate + nlh;

    // Forward step 1 again: the projections.
    mha__project_qkv(&p, m, &a, q, k, v);

    // y = drop_o(ctx Wo^T + bo):  dy = dY * keep_o / (1 - p_o), (N, L, E)
    int64_t gs[3];
    mha__seq_batch_feat(gs, gout, m->cfg.batch_first);
    mha__mat g = mha__vmat(gout->data, gout->dtype, 0, 1);
    for (int64_t n = 0; n < N; n++)
        for (int64_t t = 0; t < L; t++)
            for (int64_t e = 0; e < E; e++) {
                double gv_ = mha__ld(g, 0, t * gs[0] + n * gs[1] + e * gs[2]);
                if (p.out_p > 0.0f)
                    gv_ *= mha__out_drop_factor(a.dropout_seed, a.dropout_offset, p.out_p, p.L, p.E,
                                                n, t, e);
                dy[(n * L + t) * E + e] = gv_;
            }
    // dctx = dy Wo  (forward: y = ctx Wo^T + bo)
    const int64_t cs[3] = {E, L * E, 1};  // (seq, batch, feature) of (N, L, E)
    grad_input(gated ? dgc : dctx, MHA_F64, cs, false, dy, L, m->out_weight, N, L, E, E, nt);
    // gated: the forward's ctx_h * g (gctx) went into W_O, so
    // dctx_h = dgc_h * g and dg = sum_c dgc_h ctx_h (after the heads)
    if (gated) {
        mha__gates_d(&p, m, &a, gate);
        for (int64_t r = 0; r < N * L; r++)
            for (int64_t h = 0; h < H; h++)
                for (int64_t c = 0; c < d; c++)
                    dctx[r * E + h * d + c] = dgc[r * E + h * d + c] * gate[r * H + h];
    }

    // Heads: dq, dk, dv slices, and ctx recomputed. One item per KV head
    // (b, kvh): its G query heads h = kvh G ... kvh G + G - 1 in increasing order;
    // the first writes dk_g, dv_g, each later one adds its share (so the
    // sum's order is fixed, whatever the threads).
    const double scale = 1.0 / sqrt((double)d);
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (int64_t bg = 0; bg < N * Hkv; bg++) {
        int64_t b = bg / Hkv, kvh = bg % Hkv;
        double *ws = pw + (size_t)mha__thread_id() * 2 * lsp;
        double *dkh = ws + 2 * L * Sp, *dvh = dkh + Sp * d;  // (Sp, d) each, G > 1
        const int64_t ok = b * Sp * Ekv + kvh * d, h0 = mha__group_first_live(m, kvh, G);
        if (h0 < 0)  // every query head of the group pruned: no gradient
            for (int64_t j = 0; j < Sp; j++)
                for (int64_t c = 0; c < d; c++) dk[ok + j * Ekv + c] = dv[ok + j * Ekv + c] = 0.0;
        for (int64_t h = kvh * G; h < (kvh + 1) * G; h++) {
            const int64_t oq = b * L * E + h * d;
            if (!mha__head_live(m, h)) {  // pruned: zero context (forward), zero dq
                for (int64_t i = 0; i < L; i++)
                    for (int64_t c = 0; c < d; c++) ctx[oq + i * E + c] = dq[oq + i * E + c] = 0.0;
                continue;
            }
            const bool first = h == h0;
            mha__ref_attention_head_backward(
                mha__dmat(dq + oq, E), first ? mha__dmat(dk + ok, Ekv) : mha__dmat(dkh, d),
                first ? mha__dmat(dv + ok, Ekv) : mha__dmat(dvh, d),
                mha__dmat(ctx + oq, E), mha__dmat(dctx + oq, E), mha__dmat(q + oq, E),
                mha__dmat(k + ok, Ekv), mha__dmat(v + ok, Ekv), L, Sp, d, d, scale, &p.mask,
                mha__plan_drop(&p), b, h, ws);
            if (!first)  // dk_g += dk_h, dv_g += dv_h
                for (int64_t j = 0; j < Sp; j++)
                    for (int64_t c = 0; c < d; c++) {
                        dk[ok + j * Ekv + c] += dkh[j * d + c];
                        dv[ok + j * Ekv + c] += dvh[j * d + c];
                    }
        }
    }

    mha__rope_qk_d(&p, &a, dq, dk, true);  // through the rotation (orthogonal)
    if (gated) {
        // dg[n, t, h] = sum_c dgc ctx (the ungated context); then dgc <- gctx.
        // Dynamic: dz = dg g (1 - g) in dg, z = x_q W_g^T + b_g.
        for (int64_t r = 0; r < N * L; r++)
            for (int64_t h = 0; h < H; h++) {
                double sdg = 0.0;
                for (int64_t c = 0; c < d; c++) {
                    const int64_t i = r * E + h * d + c;
                    sdg += dgc[i] * ctx[i];
                    dgc[i] = ctx[i] * gate[r * H + h];
                }
                const double gv_ = gate[r * H + h];
                dg[r * H + h] = m->cfg.head_gate == MHA_GATE_DYNAMIC ? sdg * gv_ * (1.0 - gv_)
                                                                     : sdg;
            }
    }
    if (grads && m->cfg.head_gate == MHA_GATE_STATIC)  // dgate_h = sum_{n,t} dg
        for (int64_t h = 0; h < H; h++) {
            double sg = 0.0;
            for (int64_t r = 0; r < N * L; r++) sg += dg[r * H + h];
            store(grads->head_gate, MHA_F32, h, sg, accumulate);
        }
    if (grads && m->cfg.head_gate == MHA_GATE_DYNAMIC)  // dW_g = dz^T Xq, db_g = sum dz
        grad_linear(grads->gate_weight, grads->gate_bias, accumulate, dg, L, a.query->data,
                    a.query->dtype, p.qs, N, L, H, E, nt);
    if (grads) {
        float *gbq = grads->in_proj_bias, *gbk = gbq ? gbq + E : NULL,
              *gbv = gbq ? gbq + E + Ekv : NULL;
        mha_dtype qf = a.query->dtype, kf = a.key->dtype, vf = a.value->dtype;
        // dWo = dy^T ctx, dbo = sum dy  (forward: y = ctx Wo^T + bo; gated:
        // ctx is gctx, formed in dgc after dg)
        grad_linear(grads->out_weight, grads->out_bias, accumulate, dy, L, gated ? dgc : ctx,
                    MHA_F64, cs, N, L, E, E, nt);
        // dWq = dq^T Xq, dbq = sum dq  (forward: q = Xq Wq^T + bq)
        grad_linear(grads->q_weight, gbq, accumulate, dq, L, a.query->data, qf, p.qs,
                    N, L, E, E, nt);
        grad_linear(grads->k_weight, gbk, accumulate, dk, Sp, a.key->data, kf, p.ks,
                    N, S, Ekv, p.kdim, nt);
        grad_linear(grads->v_weight, gbv, accumulate, dv, Sp, a.value->data, vf, p.vs,
                    N, S, Ekv, p.vdim, nt);
        // k = cat([k, bias_k]): dbias_k = sum_n dk[n, S, :]; same for v
        if (m->cfg.add_bias_kv)
            for (int64_t e = 0; e < Ekv; e++) {
                double sk = 0.0, sv = 0.0;
                for (int64_t n = 0; n < N; n++) {
                    sk += dk[(n * Sp + S) * Ekv + e];
                    sv += dv[(n * Sp + S) * Ekv + e];
                }
                store(grads->bias_k, MHA_F32, e, sk, accumulate);
                store(grads->bias_v, MHA_F32, e, sv, accumulate);
            }
    }
    // dXq = dq Wq, dXk = dk Wk (rows < S), dXv = dv Wv  (forward: projections)
    int64_t xs[3];
    if (gq) {
        mha__seq_batch_feat(xs, gq, m->cfg.batch_first);
        grad_input(gq->data, gq->dtype, xs, accumulate, dq, L, m->q_weight,
                   N, L, E, E, nt);
        if (m->cfg.head_gate == MHA_GATE_DYNAMIC)  // dXq += dz W_g
            grad_input(gq->data, gq->dtype, xs, true, dg, L, m->gate_weight, N, L, H, E, nt);
    }
    if (gk) {
        mha__seq_batch_feat(xs, gk, m->cfg.batch_first);
        grad_input(gk->data, gk->dtype, xs, accumulate, dk, Sp, m->k_weight,
                   N, S, Ekv, p.kdim, nt);
    }
    if (gv) {
        mha__seq_batch_feat(xs, gv, m->cfg.batch_first);
        grad_input(gv->data, gv->dtype, xs, accumulate, dv, Sp, m->v_weight,
                   N, S, Ekv, p.vdim, nt);
    }
    free(block);
    return MHA_OK;
}

mha_status mha__part_backward(mha_tensor *gq, mha_tensor *gk, mha_tensor *gv, mha_module *grads,
                              const mha_module *m, const mha_forward_args *args,
                              const mha_tensor *gout, const mha__part *part) {
    if (!m || !args || !part)
        return mha__fail(MHA_ERR_INVALID_ARG, "mha parallel backward: NULL module, args or part");
    mha_status st = mha__require_f32_weights(m, "mha parallel backward");
    if (!st && grads) st = mha__require_f32_weights(grads, "mha parallel backward (grads)");
    if (st) return st;
    fwd_plan p;
    mha_forward_args a;  // (the part's plan: the fused path, its range checked)
    if ((st = mha__part_plan(&p, &a, m, args, part))) return st;
    if ((st = check_backward(&p, gq, gk, gv, grads, m, &a, gout))) return st;
    return mha__fused_backward(&p, gq, gk, gv, grads, m, &a, gout, false);
}
