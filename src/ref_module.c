// ref_module.c: the module-level reference (the oracle), forward and
// backward, in double: the projections, the appended keys, RoPE, each
// head's attention (ref.c), the gates, the weights block, the output
// projection and the output dropout. Plain loops over float or double views
// (mha__mat); no tiles, no SIMD. mha_forward / mha_backward (forward.c,
// backward.c) check the arguments and plan the scratch, then call these.
//
// The forward (F.multi_head_attention_forward, need_weights path):
//   q = query W_q^T + b_q        (N, L, Eq)  one row per (n, l)
//   k = key W_k^T + b_k          (N, S, Ekv) [+ bias_k] [+ zero row]
//   v = value W_v^T + b_v        (N, S, Ekv) [+ bias_v] [+ zero row]
//   heads: q as (N, H, L, d) is the strided view (L*Eq, d, Eq, 1) of the
//   same buffer: the split is a view, not a copy; so are k and v, as
//   (N, Hkv, S, d) (Eq = H d, = E unless head_dim is set; Ekv = Hkv d;
//   Hkv = H unless grouped-query)
//   ctx (N, H, L, d) = softmax(scale q k^T + masks) v   (per b, h; scale
//   1 / sqrt(d) or the custom one; query head h reads KV head h / (H / Hkv))
//   ctx viewed as (N, L, Eq) is the concatenation of the heads
//   attn_output = ctx W_o^T + b_o  written in the query's layout
// Scratch memory is the plan's one block (fwd_plan.r); nothing else is
// allocated by the forward.
//
// The backward: the gradient of the module's forward. It recomputes the forward's projections and, head by head, the
// attention probabilities (and dropout masks, from their seed): nothing from
// the forward is stored. Every step quotes the forward line it
// differentiates (above, and ref.c):
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
//   P_h = softmax over [s_h, sink_h],       dsink_h = -sum_{b, i} P_sink rowsum(dP P)
//   the sink's column dropped (sinks)       (ref.c), summed over b in order
// Each output element is summed by one thread in a fixed order, so the
// result does not depend on the number of threads.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ref.h"

// ---------------------------------------------------------------------------
// Forward

// Passes a (N, T, E) view (any strides, float or double) to the trace as
// a float32 copy in buf.
static void trace_view(const mha_forward_args *a, const char *step, float *buf, const void *p,
                       mha_dtype dt, const int64_t st[3], int64_t N, int64_t T, int64_t E) {
    if (!a->trace) return;
    for (int64_t n = 0; n < N; n++)
        for (int64_t t = 0; t < T; t++) {
            mha__mat row = mha__vmat((char *)p +
                                         (n * st[0] + t * st[1]) * (int64_t)mha_dtype_size(dt),
                                     dt, 0, st[2]);
            for (int64_t e = 0; e < E; e++)
                buf[(n * T + t) * E + e] = (float)mha__ld(row, 0, e);
        }
    int64_t shape[3] = {N, T, E};
    mha_tensor t = mha_tensor_contiguous(buf, MHA_F32, 3, shape);
    a->trace(a->trace_user, step, -1, -1, &t);
}

// The same for a contiguous (N, T, E) double buffer.
static void trace_buffer(const mha_forward_args *a, const char *step, float *tbuf,
                         const double *buf, int64_t N, int64_t T, int64_t E) {
    const int64_t st[3] = {T * E, E, 1};
    trace_view(a, step, tbuf, buf, MHA_F64, st, N, T, E);
}

// Projects rows of the view x ((seq, batch, feature) strides xs, T rows
// per batch element) into the first T of every Tp rows of buf (N, Tp, E):
// buf[n, t, :] = x[t, n, :] W^T + b.
static void project(double *buf, int64_t Tp, const mha_tensor *x, const int64_t xs[3],
                    const void *W, mha_dtype wdt, const float *b, int64_t N, int64_t T,
                    int64_t I, int64_t E, int nthreads) {
    const size_t es = mha_dtype_size(x->dtype);
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t r = 0; r < N * T; r++) {
        int64_t n = r / T, t = r % T;
        mha__mat xr = mha__vmat((char *)x->data + (t * xs[0] + n * xs[1]) * (int64_t)es,
                                x->dtype, 0, xs[2]);
        mha__ref_linear_row(mha__dmat(buf + (n * Tp + t) * E, E), xr, W, wdt, b, I, E);
    }
}

// QK-norm (mha_config.qk_norm), in place on the first T of every Tp rows
// (N, Tp, W) of x: each group of gs features (d per head, or the whole
// row) x <- x / sqrt(mean(x^2) + eps) * w, w (gs) the norm's weight.
static void qk_norm_d(double *x, int64_t Tp, int64_t T, int64_t N, int64_t W, int64_t gs,
                      const float *w, double eps) {
    for (int64_t n = 0; n < N; n++)
        for (int64_t t = 0; t < T; t++)
            for (int64_t g0 = 0; g0 < W; g0 += gs) {
                double *xg = x + (n * Tp + t) * W + g0, ms = 0.0;
                for (int64_t c = 0; c < gs; c++) ms += xg[c] * xg[c];
                const double r = 1.0 / sqrt(ms / (double)gs + eps);
                for (int64_t c = 0; c < gs; c++) xg[c] = xg[c] * r * (double)w[c];
            }
}

// Its backward, the same rows: x the forward's input (before the norm),
// dx the gradient of its output in, of its input out; dw (gs) += the
// weight's gradient (rows in order). With r = 1 / sqrt(mean(x^2) + eps),
// u = x r, y = u w:
//   dw += dy u;  du = dy w;  dx = r (du - u mean(du u))
static void qk_norm_bwd_d(double *dx, double *dw, const double *x, int64_t Tp, int64_t T,
                          int64_t N, int64_t W, int64_t gs, const float *w, double eps) {
    for (int64_t n = 0; n < N; n++)
        for (int64_t t = 0; t < T; t++)
            for (int64_t g0 = 0; g0 < W; g0 += gs) {
                const double *xg = x + (n * Tp + t) * W + g0;
                double *dg = dx + (n * Tp + t) * W + g0, ms = 0.0, s = 0.0;
                for (int64_t c = 0; c < gs; c++) ms += xg[c] * xg[c];
                const double r = 1.0 / sqrt(ms / (double)gs + eps);
                for (int64_t c = 0; c < gs; c++) {
                    dw[c] += dg[c] * xg[c] * r;
                    s += dg[c] * (double)w[c] * xg[c] * r;
                }
                s /= (double)gs;
                for (int64_t c = 0; c < gs; c++)
                    dg[c] = r * (dg[c] * (double)w[c] - xg[c] * r * s);
            }
}

// The groups' width: d (MHA_QK_NORM_HEAD) or all of a row's W features.
static int64_t qk_norm_group(const fwd_plan *p, const mha_module *m, int64_t W) {
    return m->cfg.qk_norm == MHA_QK_NORM_HEAD ? p->d : W;
}

// The projections with their biases and the appended keys, before the
// norm and RoPE (mha__project_qkv's first part).
static void project_raw(const fwd_plan *p, const mha_module *m, const mha_forward_args *a,
                        double *q, double *k, double *v) {
    const int64_t N = p->N, L = p->L, S = p->S, Sp = p->Sp, E = p->E, Eq = p->Eq, Ekv = p->Ekv;
    // in_proj_bias (Eq + 2 Ekv): the Q, K, V biases one after the other
    const float *bq = m->in_proj_bias, *bk = bq ? bq + Eq : NULL,
                *bv = bq ? bq + Eq + Ekv : NULL;
    project(q, L, a->query, p->qs, m->w_q, m->wdt, bq, N, L, E, Eq, p->nthreads);
    project(k, Sp, a->key, p->ks, m->w_k, m->wdt, bk, N, S, p->kdim, Ekv, p->nthreads);
    project(v, Sp, a->value, p->vs, m->w_v, m->wdt, bv, N, S, p->vdim, Ekv, p->nthreads);
    for (int64_t n = 0; n < N; n++) {
        int64_t t = S;
        if (m->cfg.add_bias_kv) {  // k = cat([k, bias_k]), v = cat([v, bias_v])
            for (int64_t e = 0; e < Ekv; e++) {
                k[(n * Sp + t) * Ekv + e] = m->bias_k[e];
                v[(n * Sp + t) * Ekv + e] = m->bias_v[e];
            }
            t++;
        }
        if (m->cfg.add_zero_attn) {  // one zero key and value after them
            memset(k + (n * Sp + t) * Ekv, 0, (size_t)Ekv * sizeof(double));
            memset(v + (n * Sp + t) * Ekv, 0, (size_t)Ekv * sizeof(double));
        }
    }
}

void mha__project_qkv(const fwd_plan *p, const mha_module *m, const mha_forward_args *a,
                      double *q, double *k, double *v) {
    project_raw(p, m, a, q, k, v);
    if (m->cfg.qk_norm != MHA_QK_NORM_NONE) {  // q, k <- RMSNorm (not the appended keys)
        const double eps = mha__qk_norm_eps(m);
        qk_norm_d(q, p->L, p->L, p->N, p->Eq, qk_norm_group(p, m, p->Eq), m->q_norm, eps);
        qk_norm_d(k, p->Sp, p->S, p->N, p->Ekv, qk_norm_group(p, m, p->Ekv), m->k_norm, eps);
    }
    mha__rope_qk_d(p, a, q, k, false);
}

void mha__gates_d(const fwd_plan *p, const mha_module *m, const mha_forward_args *a, double *g) {
    const int64_t R = p->N * p->L, H = p->H;
    if (m->cfg.head_gate == MHA_GATE_DYNAMIC) {
        project(g, p->L, a->query, p->qs, m->gate_weight, MHA_F32, m->gate_bias, p->N, p->L,
                p->E, H, p->nthreads);
        for (int64_t i = 0; i < R * H; i++) g[i] = 1.0 / (1.0 + exp(-g[i]));
        return;
    }
    for (int64_t r = 0; r < R; r++)
        for (int64_t h = 0; h < H; h++) g[r * H + h] = m->head_gate[h];
}

void mha__rope_qk_d(const fwd_plan *p, const mha_forward_args *a, double *q, double *k,
                    bool inverse) {
    if (a->rope.mode == MHA_ROPE_NONE) return;
    // the call's frequencies (scaled: linear, dynamic NTK for the call's
    // largest position + 1, YaRN, llama3) and cos/sin factor af (YaRN)
    double inv[MHA__ROPE_MAX_HALF], af;
    mha__rope_freqs(inv, &af, &a->rope, a->rope_scaling, p->d, p->rope_seq);
    const int64_t L = p->L, S = p->S, Sp = p->Sp, Eq = p->Eq, Ekv = p->Ekv;
    for (int64_t n = 0; n < p->N; n++) {
        // token t at rope_positions[n L + t], else rope_start[n] + t
        for (int64_t t = 0; t < L; t++)
            mha__rope_token_d(q + (n * L + t) * Eq, p->d, p->H, &a->rope, p->d, inv, af,
                              (double)mha__rope_pos(a, L, n, t), inverse);
        for (int64_t t = 0; t < S; t++)  // not the appended keys
            mha__rope_token_d(k + (n * Sp + t) * Ekv, p->d, p->Hkv, &a->rope, p->d, inv, af,
                              (double)mha__rope_pos(a, L, n, t), inverse);
    }
}

// The forward's scratch: the plan's one block, carved at p->r.
typedef struct ref_fwd_bufs {
    double *q;       // (N, L, Eq)
    double *k, *v;   // (N, Sp, Ekv)
    double *ctx;     // (N, L, Eq)
    double *headw;   // (N, H, L, Sp)
    double *scores;  // nthreads x (L, Sp)
    float *tbuf;     // the trace's copies
    double *gate;    // (N, L, H), gated
} ref_fwd_bufs;

// 1. Projections (one row per (n, t)); then the appended keys/values.
//   q (N, L, Eq) = query W_q^T + b_q
//   k (N, Sp, Ekv) = [key W_k^T + b_k; bias_k; 0], v alike
static void ref_fwd_project(const fwd_plan *p, const mha_module *m, const mha_forward_args *a,
                            const ref_fwd_bufs *buf) {
    const int64_t N = p->N, L = p->L, Sp = p->Sp, Eq = p->Eq, Ekv = p->Ekv;
    mha__project_qkv(p, m, a, buf->q, buf->k, buf->v);
    trace_buffer(a, "q", buf->tbuf, buf->q, N, L, Eq);
    trace_buffer(a, "k", buf->tbuf, buf->k, N, Sp, Ekv);
    trace_buffer(a, "v", buf->tbuf, buf->v, N, Sp, Ekv);
}

// 2. Attention per (b, h) on strided head views of q, k, v, ctx:
//   ctx (N, L, Eq) as (N, H, L, d) = softmax(scale q k^T + masks) v,
//   query head h reading KV head h / G; each head's weights (L, Sp) into
//   headw (via_headw) or straight into the output (perhead)
static void ref_fwd_heads(const fwd_plan *p, const mha_module *m, const mha_forward_args *a,
                          mha_tensor *weights, const ref_fwd_bufs *buf, bool perhead,
                          bool via_headw) {
    const int64_t N = p->N, L = p->L, Sp = p->Sp, Eq = p->Eq, H = p->H, d = p->d;
    const int64_t Ekv = p->Ekv, G = H / p->Hkv;  // G query heads per KV head
    double *q = buf->q, *k = buf->k, *v = buf->v, *ctx = buf->ctx, *headw = buf->headw;
    double *scores = buf->scores;
    float *tbuf = buf->tbuf;
    const double scale = p->scale;  // 1 / sqrt(d), or the custom one
    mha__trace tr = {a->trace, a->trace_user, tbuf};
#pragma omp parallel for schedule(dynamic, 1) num_threads(p->nthreads)
    for (int64_t bh = 0; bh < N * H; bh++) {
        int64_t b = bh / H, h = bh % H;
        int tid = mha__thread_id();
        mha__mat wh = {NULL, false, 0, 0, 0};
        if (!mha__head_live(m, h)) {  // pruned: zero context, zero weights, no work
            for (int64_t i = 0; i < L; i++)
                memset(ctx + b * L * Eq + i * Eq + h * d, 0, (size_t)d * sizeof(double));
            if (via_headw) memset(headw + bh * L * Sp, 0, (size_t)(L * Sp) * sizeof(double));
            else if (perhead) {
                int o = p->unbatched ? 0 : 1;
                mha__mat w = mha__view_at(weights,
                                          (p->unbatched ? 0 : b * weights->stride[0]) +
                                              h * weights->stride[o],
                                          o + 2);
                w.rs = weights->stride[o + 1];
                for (int64_t i = 0; i < L; i++)
                    for (int64_t j = 0; j < Sp; j++) mha__st(w, i, j, 0.0);
            }
            continue;
        }
        if (via_headw) {
            wh = mha__dmat(headw + bh * L * Sp, Sp);
        } else if (perhead) {
            int o = p->unbatched ? 0 : 1;  // weights (N,) H, L, Sp
            wh = mha__view_at(weights,
                              (p->unbatched ? 0 : b * weights->stride[0]) +
                                  h * weights->stride[o],
                              o + 2);
            wh.rs = weights->stride[o + 1];
        }
        mha__ref_attention_head(mha__dmat(ctx + b * L * Eq + h * d, Eq), wh,
                                mha__dmat(q + b * L * Eq + h * d, Eq),
                                mha__dmat(k + b * Sp * Ekv + (h / G) * d, Ekv),
                                mha__dmat(v + b * Sp * Ekv + (h / G) * d, Ekv), L, Sp, d, d,
                                scale, &p->mask, mha__plan_drop(p), b, h,
                                scores + (size_t)tid * L * Sp, a->trace ? &tr : NULL);
    }
    trace_buffer(a, "concat", tbuf, ctx, N, L, Eq);
}

// Gates: head h's context times g[n, t, h] (before W_O).
//   ctx (N, L, Eq) as (N, L, H, d) *= gate (N, L, H)
static void ref_fwd_gates(const fwd_plan *p, const mha_module *m, const mha_forward_args *a,
                          const ref_fwd_bufs *buf) {
    const int64_t N = p->N, L = p->L, Eq = p->Eq, H = p->H, d = p->d;
    double *ctx = buf->ctx, *gate = buf->gate;
    mha__gates_d(p, m, a, gate);
    for (int64_t r = 0; r < N * L; r++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t c = 0; c < d; c++) ctx[r * Eq + h * d + c] *= gate[r * H + h];
    trace_buffer(a, "gated", buf->tbuf, ctx, N, L, Eq);
}

// 3. Averaged weights: mean over the (selected) heads, summed in head
//    order; or the selected block of the per-head weights.
//   weights (N,) Ls, Sp (avg) or (N,) Hs, Ls, Sp from headw (N, H, L, Sp)
static void ref_fwd_weights(const fwd_plan *p, const mha_module *m, const mha_forward_args *a,
                            mha_tensor *weights, const ref_fwd_bufs *buf, bool avg,
                            bool via_headw) {
    const int64_t N = p->N, L = p->L, Sp = p->Sp, H = p->H;
    double *headw = buf->headw;
    double *scores = buf->scores;
    if (avg) {
        int o = p->unbatched ? 0 : 1;  // weights (N,) Ls, Sp
        const int64_t Ls = p->wr1 - p->wr0, live = mha__live_in(m, p->wh0, p->wh1);
        for (int64_t b = 0; b < N; b++)
            for (int64_t i = p->wr0; i < p->wr1; i++) {
                double *row = scores;  // (a free (L, Sp) block now)
                for (int64_t j = 0; j < Sp; j++) {
                    double s = 0.0;
                    for (int64_t h = p->wh0; h < p->wh1; h++)
                        s += headw[((b * H + h) * L + i) * Sp + j];
                    row[j] = s / (double)(live ? live : 1);  // pruned rows are 0
                }
                mha__weights_row_out(weights, a->weights_scale, b * Ls + i - p->wr0,
                                     (p->unbatched ? 0 : b * weights->stride[0]) +
                                         (i - p->wr0) * weights->stride[o],
                                     row, NULL, Sp);
            }
    } else if (via_headw) {
        int o = p->unbatched ? 0 : 1;  // weights (N,) Hs, Ls, Sp
        const int64_t Hs = p->wh1 - p->wh0, Ls = p->wr1 - p->wr0;
        for (int64_t b = 0; b < N; b++)
            for (int64_t h = p->wh0; h < p->wh1; h++)
                for (int64_t i = p->wr0; i < p->wr1; i++)
                    mha__weights_row_out(weights, a->weights_scale,
                                         (b * Hs + h - p->wh0) * Ls + i - p->wr0,
                                         (p->unbatched ? 0 : b * weights->stride[0]) +
                                             (h - p->wh0) * weights->stride[o] +
                                             (i - p->wr0) * weights->stride[o + 1],
                                         headw + ((b * H + h) * L + i) * Sp, NULL, Sp);
    }
}

// 4. Output projection, written in the query's layout; then the output
//    dropout (training only).
//   attn_output (L, N, E) or (N, L, E) = drop_o(ctx (N, L, Eq) W_o^T + b_o)
static void ref_fwd_out_project(const fwd_plan *p, mha_tensor *out, const mha_module *m,
                                const mha_forward_args *a, const ref_fwd_bufs *buf) {
    const int64_t N = p->N, L = p->L, E = p->E, Eq = p->Eq;
    double *ctx = buf->ctx;
    int64_t os[3];
    mha__seq_batch_feat(os, out, m->cfg.batch_first);
#pragma omp parallel for schedule(static) num_threads(p->nthreads)
    for (int64_t r = 0; r < N * L; r++) {
        int64_t n = r / L, t = r % L;
        mha__mat y = mha__view_at(out, t * os[0] + n * os[1], out->ndim - 1);
        mha__ref_linear_row(y, mha__dmat(ctx + r * Eq, Eq), m->w_out, m->wdt, m->out_bias, Eq,
                            E);
        if (p->out_p > 0.0f)
            for (int64_t e = 0; e < E; e++)
                mha__st(y, 0, e,
                        mha__ld(y, 0, e) *
                            mha__out_drop_factor(a->opts.dropout_seed, a->opts.dropout_offset,
                                                 p->out_p, p->L, p->E, n, t, e));
    }
    if (a->trace) {
        const int64_t st[3] = {os[1], os[0], os[2]};  // as (N, L, E)
        trace_view(a, "output", buf->tbuf, out->data, out->dtype, st, N, L, E);
    }
}

// The forward: passes 1 to 4 (the functions above) on the plan's scratch ws.
void mha__ref_forward(const fwd_plan *p, mha_tensor *out, mha_tensor *weights,
                      const mha_module *m, const mha_forward_args *a, char *ws) {
    const ref_fwd_bufs buf = {
        .q = (double *)(ws + p->r.q),
        .k = (double *)(ws + p->r.k),
        .v = (double *)(ws + p->r.v),
        .ctx = (double *)(ws + p->r.ctx),
        .headw = (double *)(ws + p->r.headw),
        .scores = (double *)(ws + p->r.scores),
        .tbuf = (float *)(ws + p->r.trace),
        .gate = (double *)(ws + p->r.gate),
    };
    // where the heads' weights go: every head's to headw when they are
    // averaged or a block of them is asked for; else straight into the
    // output
    const bool avg = a->need_weights && a->average_attn_weights;
    const bool perhead = a->need_weights && !a->average_attn_weights;
    const bool via_headw = avg || (perhead && (p->w_block || a->weights_scale));

    ref_fwd_project(p, m, a, &buf);                             // 1. q, k, v
    ref_fwd_heads(p, m, a, weights, &buf, perhead, via_headw);  // 2. ctx, heads' weights
    if (mha__module_gated(m)) ref_fwd_gates(p, m, a, &buf);     //    ctx *= gates
    ref_fwd_weights(p, m, a, weights, &buf, avg, via_headw);    // 3. the weights
    ref_fwd_out_project(p, out, m, a, &buf);                    // 4. the output
}

// ---------------------------------------------------------------------------
// Backward

// Element `off` of a view's memory (any float type): = v, or += v.
static inline void store(void *base, mha_dtype dt, int64_t off, double v, bool acc) {
    const mha__mat m = mha__vmat(base, dt, 0, 1);
    mha__st(m, 0, off, acc ? mha__ld(m, 0, off) + v : v);
}

// dW (O, I) (+)= sum_{n < N, t < T} dY[n, t, :]^T X[t, n, :] and
// db (O) (+)= sum_{n, t} dY[n, t, :], where dY is (N, Tp, O) row-major
// (only its first T rows per n are used) and X is a float or double view
// with (seq, batch, feature) strides xs.
static void grad_linear(void *dW, mha_dtype wdt, float *db, bool acc, const double *dY,
                        int64_t Tp, const void *X, mha_dtype xdt, const int64_t xs[3],
                        int64_t N, int64_t T, int64_t O, int64_t I, int nt) {
    mha__mat x = mha__vmat((void *)X, xdt, 0, 1);
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t o = 0; o < O; o++) {
        for (int64_t i = 0; i < I; i++) {
            double s = 0.0;
            for (int64_t n = 0; n < N; n++)
                for (int64_t t = 0; t < T; t++)
                    s += dY[(n * Tp + t) * O + o] *
                         mha__ld(x, 0, t * xs[0] + n * xs[1] + i * xs[2]);
            store(dW, wdt, o * I + i, s, acc);
        }
        if (db) {
            double s = 0.0;
            for (int64_t n = 0; n < N; n++)
                for (int64_t t = 0; t < T; t++) s += dY[(n * Tp + t) * O + o];
            store(db, MHA_F32, o, s, acc);
        }
    }
}

// dX[t, n, :] (+)= dY[n, t, :] W for t < T, W (O, I) row-major of wdt
// (float32, bf16, f16); dX is a float or double view with (seq, batch,
// feature) strides xs; dY is (N, Tp, O).
static void grad_input(void *dX, mha_dtype dt, const int64_t xs[3], bool acc, const double *dY,
                       int64_t Tp, const void *W, mha_dtype wdt, int64_t N, int64_t T,
                       int64_t O, int64_t I, int nt) {
    const mha__mat w = mha__vmat((void *)W, wdt, 0, 1);
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t r = 0; r < N * T; r++) {
        int64_t n = r / T, t = r % T;
        const double *dy = dY + (n * Tp + t) * O;
        for (int64_t i = 0; i < I; i++) {
            double s = 0.0;
            for (int64_t o = 0; o < O; o++) s += dy[o] * mha__ld(w, 0, o * I + i);
            store(dX, dt, t * xs[0] + n * xs[1] + i * xs[2], s, acc);
        }
    }
}

// The backward's scratch, one block of doubles: per thread 2 (L, Sp) and,
// with G > 1, 2 (Sp, d) (one query head's dk, dv); q, dq, ctx, dctx (N, L,
// Eq); dy (N, L, E); k, v, dk, dv (N, Sp, Ekv); gated: dgc (N, L, Eq), gate
// and dg (N, L, H); sinks: dsink (N, H).
typedef struct ref_bwd_bufs {
    double *block;                // the allocation (free)
    size_t lsp;                   // L Sp [+ Sp d]: half a thread's part
    double *pw;                   // nt x (2 (L, Sp) [+ 2 (Sp, d)])
    double *q, *dq, *ctx, *dctx;  // (N, L, Eq)
    double *dy;                   // (N, L, E)
    double *k, *v, *dk, *dv;      // (N, Sp, Ekv)
    double *dgc;                  // (N, L, Eq), gated
    double *gate, *dg;            // (N, L, H), gated
    double *dsink;                // (N, H), sinks: each (b, h)'s sink gradient
    double *xq, *xk;              // (N, L, Eq), (N, Sp, Ekv), qk_norm: q, k
                                  // before the norm
    double *dqn, *dkn;            // (Eq), (Ekv), qk_norm: the weights' gradients
} ref_bwd_bufs;

// Sizes, allocates and carves that block (freed by the caller: buf->block).
static mha_status ref_bwd_alloc(ref_bwd_bufs *buf, const fwd_plan *p, const mha_module *m) {
    const int64_t N = p->N, L = p->L, Sp = p->Sp, E = p->E, H = p->H, d = p->d;
    const int64_t Hkv = p->Hkv, Ekv = p->Ekv, G = H / Hkv;  // G query heads per KV head
    const int nt = p->nthreads;
    const bool gated = mha__module_gated(m), qkn = m->cfg.qk_norm != MHA_QK_NORM_NONE;
    size_t nle = (size_t)(N * L * p->Eq), nlo = (size_t)(N * L * E),
           nse = (size_t)(N * Sp * Ekv), nlh = gated ? (size_t)(N * L * H) : 0,
           lsp = (size_t)(L * Sp) + (G > 1 ? (size_t)(Sp * d) : 0), count, bytes;
    if (mha__mul_overflow_size(2 * lsp, (size_t)nt, &count) ||
        mha__add_overflow_size(count, (gated ? 5 : 4) * nle + nlo + 4 * nse + 2 * nlh, &count) ||
        mha__add_overflow_size(count, m->sinks ? (size_t)(N * H) : 0, &count) ||
        mha__add_overflow_size(count, qkn ? nle + nse + (size_t)(p->Eq + Ekv) : 0, &count) ||
        mha__mul_overflow_size(count, sizeof(double), &bytes))
        return mha__fail(MHA_ERR_OVERFLOW, "backward: scratch size overflows");
    double *block = mha__malloc(bytes ? bytes : 1);
    if (!block)
        return mha__fail(MHA_ERR_NOMEM, "mha_backward: out of memory for %zu bytes of scratch",
                         bytes);
    double *pw = block;  // nt x (2 (L, Sp) [+ 2 (Sp, d)])
    double *q = block + 2 * lsp * (size_t)nt;
    double *dq = q + nle, *ctx = dq + nle, *dctx = ctx + nle, *dy = dctx + nle;
    double *k = dy + nlo, *v = k + nse, *dk = v + nse, *dv = dk + nse;
    double *dgc = dv + nse, *gate = dgc + (gated ? nle : 0), *dg = gate + nlh,
           *dsink = dg + nlh;
    *buf = (ref_bwd_bufs){block, lsp,  pw,   q,   dq,  ctx,  dctx, dy,
                          k,     v,    dk,   dv,  dgc, gate, dg,   m->sinks ? dsink : NULL,
                          NULL,  NULL, NULL, NULL};
    if (qkn) {
        double *xq = dsink + (m->sinks ? N * H : 0), *xk = xq + nle, *dqn = xk + nse;
        buf->xq = xq, buf->xk = xk, buf->dqn = dqn, buf->dkn = dqn + p->Eq;
    }
    return MHA_OK;
}

// The output side:
//   y = drop_o(ctx Wo^T + bo)       dy (N, L, E) = dY * keep_o / (1 - p_o)
//                                   dctx (N, L, Eq) = dy Wo
//   gated: gctx_h = ctx_h * g       dgc = dy Wo, dctx_h = dgc_h * g
static void ref_bwd_dy_dctx(const fwd_plan *p, const mha_module *m, const mha_forward_args *a,
                            const mha_tensor *gout, const ref_bwd_bufs *buf) {
    const int64_t N = p->N, L = p->L, E = p->E, Eq = p->Eq, H = p->H, d = p->d;
    const int nt = p->nthreads;
    const bool gated = mha__module_gated(m);
    double *dctx = buf->dctx, *dy = buf->dy, *dgc = buf->dgc, *gate = buf->gate;
    // y = drop_o(ctx Wo^T + bo):  dy = dY * keep_o / (1 - p_o), (N, L, E)
    int64_t gs[3];
    mha__seq_batch_feat(gs, gout, m->cfg.batch_first);
    mha__mat g = mha__vmat(gout->data, gout->dtype, 0, 1);
    for (int64_t n = 0; n < N; n++)
        for (int64_t t = 0; t < L; t++)
            for (int64_t e = 0; e < E; e++) {
                double gv_ = mha__ld(g, 0, t * gs[0] + n * gs[1] + e * gs[2]);
                if (p->out_p > 0.0f)
                    gv_ *= mha__out_drop_factor(a->opts.dropout_seed, a->opts.dropout_offset,
                                                p->out_p, p->L, p->E, n, t, e);
                dy[(n * L + t) * E + e] = gv_;
            }
    // dctx = dy Wo  (forward: y = ctx Wo^T + bo; Wo (E, Eq))
    const int64_t cs[3] = {Eq, L * Eq, 1};  // (seq, batch, feature) of (N, L, Eq)
    grad_input(gated ? dgc : dctx, MHA_F64, cs, false, dy, L, m->w_out, m->wdt, N, L, E, Eq, nt);
    // gated: the forward's ctx_h * g (gctx) went into W_O, so
    // dctx_h = dgc_h * g and dg = sum_c dgc_h ctx_h (after the heads)
    if (gated) {
        mha__gates_d(p, m, a, gate);
        for (int64_t r = 0; r < N * L; r++)
            for (int64_t h = 0; h < H; h++)
                for (int64_t c = 0; c < d; c++)
                    dctx[r * Eq + h * d + c] = dgc[r * Eq + h * d + c] * gate[r * H + h];
    }
}

// Heads: dq, dk, dv slices, and ctx recomputed. One item per KV head
// (b, kvh): its G query heads h = kvh G ... kvh G + G - 1 in increasing order;
// the first writes dk_g, dv_g, each later one adds its share (so the
// sum's order is fixed, whatever the threads).
//   ctx_h = attention(q_h, k_g, v_g)   dq (N, L, Eq), dk, dv (N, Sp, Ekv)
//                                      (ref.c); dk_g = sum of the group's
//                                      dk_h, summed in increasing h
static void ref_bwd_heads(const fwd_plan *p, const mha_module *m, const ref_bwd_bufs *buf) {
    const int64_t N = p->N, L = p->L, Sp = p->Sp, Eq = p->Eq, H = p->H, d = p->d;
    const int64_t Hkv = p->Hkv, Ekv = p->Ekv, G = H / Hkv;  // G query heads per KV head
    const int nt = p->nthreads;
    const size_t lsp = buf->lsp;
    double *pw = buf->pw, *q = buf->q, *dq = buf->dq, *ctx = buf->ctx, *dctx = buf->dctx;
    double *k = buf->k, *v = buf->v, *dk = buf->dk, *dv = buf->dv;
    const double scale = p->scale;  // 1 / sqrt(d), or the custom one
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (int64_t bg = 0; bg < N * Hkv; bg++) {
        int64_t b = bg / Hkv, kvh = bg % Hkv;
        double *ws = pw + (size_t)mha__thread_id() * 2 * lsp;
        double *dkh = ws + 2 * L * Sp, *dvh = dkh + Sp * d;  // (Sp, d) each, G > 1
        const int64_t ok = b * Sp * Ekv + kvh * d, h0 = mha__group_first_live(m, kvh, G);
        if (h0 < 0)  // every query head of the group pruned: no gradient
            for (int64_t j = 0; j < Sp; j++)
                for (int64_t c = 0; c < d; c++)
                    dk[ok + j * Ekv + c] = dv[ok + j * Ekv + c] = 0.0;
        for (int64_t h = kvh * G; h < (kvh + 1) * G; h++) {
            const int64_t oq = b * L * Eq + h * d;
            double *dsink = buf->dsink ? buf->dsink + b * H + h : NULL;
            if (!mha__head_live(m, h)) {  // pruned: zero context (forward), zero dq
                for (int64_t i = 0; i < L; i++)
                    for (int64_t c = 0; c < d; c++)
                        ctx[oq + i * Eq + c] = dq[oq + i * Eq + c] = 0.0;
                if (dsink) *dsink = 0.0;
                continue;
            }
            const bool first = h == h0;
            mha__ref_attention_head_backward(
                mha__dmat(dq + oq, Eq), first ? mha__dmat(dk + ok, Ekv) : mha__dmat(dkh, d),
                first ? mha__dmat(dv + ok, Ekv) : mha__dmat(dvh, d), mha__dmat(ctx + oq, Eq),
                mha__dmat(dctx + oq, Eq), mha__dmat(q + oq, Eq), mha__dmat(k + ok, Ekv),
                mha__dmat(v + ok, Ekv), L, Sp, d, d, scale, &p->mask, mha__plan_drop(p), b, h,
                ws, dsink);
            if (!first)  // dk_g += dk_h, dv_g += dv_h
                for (int64_t j = 0; j < Sp; j++)
                    for (int64_t c = 0; c < d; c++) {
                        dk[ok + j * Ekv + c] += dkh[j * d + c];
                        dv[ok + j * Ekv + c] += dvh[j * d + c];
                    }
        }
    }
}

// The gates' gradients (gated modules):
//   gctx_h = ctx_h * g              dg (N, L, H) = sum_c dgc_h ctx_h
//   g = sigmoid(z) (dynamic)        dz = dg g (1 - g), in dg
//   g = head_gate[h] (static)       dgate_h = sum_{n,t} dg
//   z = Xq W_g^T + b_g (dynamic)    dW_g = dz^T Xq, db_g = sum dz
// and dgc <- gctx, the output projection's input, for its weight gradient.
static void ref_bwd_gate_grads(const fwd_plan *p, const mha_module *m,
                               const mha_forward_args *a, mha_module *grads, bool accumulate,
                               const ref_bwd_bufs *buf) {
    const int64_t N = p->N, L = p->L, E = p->E, Eq = p->Eq, H = p->H, d = p->d;
    const int nt = p->nthreads;
    const bool gated = mha__module_gated(m);
    double *ctx = buf->ctx, *dgc = buf->dgc, *gate = buf->gate, *dg = buf->dg;
    if (gated) {
        // dg[n, t, h] = sum_c dgc ctx (the ungated context); then dgc <- gctx.
        // Dynamic: dz = dg g (1 - g) in dg, z = x_q W_g^T + b_g.
        for (int64_t r = 0; r < N * L; r++)
            for (int64_t h = 0; h < H; h++) {
                double sdg = 0.0;
                for (int64_t c = 0; c < d; c++) {
                    const int64_t i = r * Eq + h * d + c;
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
        grad_linear(grads->gate_weight, MHA_F32, grads->gate_bias, accumulate, dg, L,
                    a->query->data, a->query->dtype, p->qs, N, L, H, E, nt);
}

// The parameters' gradients (= or += by accumulate):
//   y = ctx Wo^T + bo               dWo = dy^T ctx; dbo = sum dy
//   q = Xq Wq^T + bq                dWq = dq^T Xq; dbq = sum dq
//   k = [Xk Wk^T + bk; bias_k; 0]   rows < S as for q;
//                                   dbias_k = sum_n dk[n, S]
//   v = [Xv Wv^T + bv; bias_v; 0]   the same
static void ref_bwd_param_grads(const fwd_plan *p, const mha_module *m,
                                const mha_forward_args *a, mha_module *grads, bool accumulate,
                                const ref_bwd_bufs *buf) {
    const int64_t N = p->N, L = p->L, S = p->S, Sp = p->Sp, E = p->E, Eq = p->Eq;
    const int64_t Ekv = p->Ekv;
    const int nt = p->nthreads;
    const bool gated = mha__module_gated(m);
    double *dq = buf->dq, *ctx = buf->ctx, *dy = buf->dy, *dk = buf->dk, *dv = buf->dv;
    double *dgc = buf->dgc;
    const int64_t cs[3] = {Eq, L * Eq, 1};  // (seq, batch, feature) of (N, L, Eq)
    float *gbq = grads->in_proj_bias, *gbk = gbq ? gbq + Eq : NULL,
          *gbv = gbq ? gbq + Eq + Ekv : NULL;
    mha_dtype qf = a->query->dtype, kf = a->key->dtype, vf = a->value->dtype;
    // dWo = dy^T ctx, dbo = sum dy  (forward: y = ctx Wo^T + bo; gated:
    // ctx is gctx, formed in dgc after dg; no bo with no_out_bias)
    // (weight matrices in the gradient module's storage: float32, bf16 or
    // f16, each sum rounded once)
    const mha_dtype gw = grads->wdt;
    grad_linear(grads->w_out, gw, grads->out_bias, accumulate, dy, L, gated ? dgc : ctx,
                MHA_F64, cs, N, L, E, Eq, nt);
    // dWq = dq^T Xq, dbq = sum dq  (forward: q = Xq Wq^T + bq)
    grad_linear(grads->w_q, gw, gbq, accumulate, dq, L, a->query->data, qf, p->qs, N, L, Eq, E,
                nt);
    grad_linear(grads->w_k, gw, gbk, accumulate, dk, Sp, a->key->data, kf, p->ks, N, S, Ekv,
                p->kdim, nt);
    grad_linear(grads->w_v, gw, gbv, accumulate, dv, Sp, a->value->data, vf, p->vs, N, S, Ekv,
                p->vdim, nt);
    // sinks: dsink_h = sum_n of each batch element's (ref_bwd_heads)
    if (m->sinks)
        for (int64_t h = 0; h < p->H; h++) {
            double s = 0.0;
            for (int64_t n = 0; n < N; n++) s += buf->dsink[n * p->H + h];
            store(grads->sinks, MHA_F32, h, s, accumulate);
        }
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

// The inputs' gradients (= or += by accumulate), each in its view's layout:
//   q = Xq Wq^T + bq                dXq = dq Wq (+ dz W_g, dynamic gates)
//   k = Xk Wk^T + bk                dXk = dk Wk (rows < S)
//   v = Xv Wv^T + bv                dXv = dv Wv (rows < S)
static void ref_bwd_input_grads(const fwd_plan *p, const mha_module *m, mha_tensor *gq,
                                mha_tensor *gk, mha_tensor *gv, bool accumulate,
                                const ref_bwd_bufs *buf) {
    const int64_t N = p->N, L = p->L, S = p->S, Sp = p->Sp, E = p->E, H = p->H;
    const int64_t Ekv = p->Ekv;
    const int nt = p->nthreads;
    double *dq = buf->dq, *dk = buf->dk, *dv = buf->dv, *dg = buf->dg;
    // dXq = dq Wq, dXk = dk Wk (rows < S), dXv = dv Wv  (forward: projections)
    int64_t xs[3];
    if (gq) {
        mha__seq_batch_feat(xs, gq, m->cfg.batch_first);
        grad_input(gq->data, gq->dtype, xs, accumulate, dq, L, m->w_q, m->wdt, N, L, p->Eq, E,
                   nt);
        if (m->cfg.head_gate == MHA_GATE_DYNAMIC)  // dXq += dz W_g
            grad_input(gq->data, gq->dtype, xs, true, dg, L, m->gate_weight, MHA_F32, N, L, H,
                       E, nt);
    }
    if (gk) {
        mha__seq_batch_feat(xs, gk, m->cfg.batch_first);
        grad_input(gk->data, gk->dtype, xs, accumulate, dk, Sp, m->w_k, m->wdt, N, S, Ekv,
                   p->kdim, nt);
    }
    if (gv) {
        mha__seq_batch_feat(xs, gv, m->cfg.batch_first);
        grad_input(gv->data, gv->dtype, xs, accumulate, dv, Sp, m->w_v, m->wdt, N, S, Ekv,
                   p->vdim, nt);
    }
}

// The reference module backward (mha_backward's reference path; see the
// table at the top of this section): the forward's projections again, then
// dy/dctx, the heads, the gates', the parameters' and the inputs' gradients.
mha_status mha__ref_backward(const fwd_plan *p, mha_tensor *gq, mha_tensor *gk, mha_tensor *gv,
                             mha_module *grads, const mha_module *m, const mha_forward_args *a,
                             const mha_tensor *gout, bool accumulate) {
    ref_bwd_bufs buf = {0};  // (initialised for the compiler: read only after MHA_OK)
    mha_status st = ref_bwd_alloc(&buf, p, m);
    if (st) return st;
    if (grads) mha__packs_stale(grads);  // (its parameters are written below)

    // Forward step 1 again: the projections (with qk_norm, their values
    // before the norm kept: xq, xk).
    const bool qkn = m->cfg.qk_norm != MHA_QK_NORM_NONE;
    const double eps = mha__qk_norm_eps(m);
    const int64_t gq_ = qk_norm_group(p, m, p->Eq), gk_ = qk_norm_group(p, m, p->Ekv);
    if (qkn) {
        project_raw(p, m, a, buf.q, buf.k, buf.v);
        memcpy(buf.xq, buf.q, (size_t)(p->N * p->L * p->Eq) * sizeof(double));
        memcpy(buf.xk, buf.k, (size_t)(p->N * p->Sp * p->Ekv) * sizeof(double));
        qk_norm_d(buf.q, p->L, p->L, p->N, p->Eq, gq_, m->q_norm, eps);
        qk_norm_d(buf.k, p->Sp, p->S, p->N, p->Ekv, gk_, m->k_norm, eps);
        mha__rope_qk_d(p, a, buf.q, buf.k, false);
    } else {
        mha__project_qkv(p, m, a, buf.q, buf.k, buf.v);
    }

    ref_bwd_dy_dctx(p, m, a, gout, &buf);        // dy, dctx (gated: dgc, gates)
    ref_bwd_heads(p, m, &buf);                   // dq, dk, dv; ctx recomputed
    mha__rope_qk_d(p, a, buf.dq, buf.dk, true);  // through the rotation (transposed)
    if (qkn) {  // through the norms: q = RMSNorm(xq) w_q, k alike (rows < S)
        memset(buf.dqn, 0, (size_t)(gq_ + gk_) * sizeof(double));
        double *dkn = buf.dqn + gq_;
        qk_norm_bwd_d(buf.dq, buf.dqn, buf.xq, p->L, p->L, p->N, p->Eq, gq_, m->q_norm, eps);
        qk_norm_bwd_d(buf.dk, dkn, buf.xk, p->Sp, p->S, p->N, p->Ekv, gk_, m->k_norm, eps);
        if (grads)
            for (int64_t c = 0; c < gq_ + gk_; c++)
                store(c < gq_ ? grads->q_norm : grads->k_norm, MHA_F32, c < gq_ ? c : c - gq_,
                      buf.dqn[c], accumulate);
    }
    ref_bwd_gate_grads(p, m, a, grads, accumulate, &buf);  // dg, the gates' parameters
    if (grads) ref_bwd_param_grads(p, m, a, grads, accumulate, &buf);  // dW, db
    ref_bwd_input_grads(p, m, gq, gk, gv, accumulate, &buf);           // dX
    free(buf.block);
    return MHA_OK;
}
